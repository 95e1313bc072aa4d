// The launch configuration of cudaLaunchKernelEx with an optional thread-block cluster and programmatic dependent
// launch (PDL). Needs only the CUDA runtime: the standalone microbenchmarks (benchmarks/micro) use it as the library
// does (csrc/include/base_moe/launch.cuh).
#pragma once

#include <cuda_runtime.h>

namespace base_moe::cuda {

struct LaunchShape {
  dim3 grid;
  dim3 block;
  size_t shared_bytes = 0;
  cudaStream_t stream = nullptr;
  int cluster_x = 0;  // > 0: launch as clusters of cluster_x CTAs along x (the kernel uses cluster APIs)
  bool pdl = false;   // programmatic stream serialisation: may start while the previous kernel finishes
};

// cudaLaunchKernelEx's configuration of a LaunchShape (also what the occupancy queries take). It owns the attribute
// array that config.attrs points to, so it is neither copied nor moved.
class LaunchConfig {
 public:
  explicit LaunchConfig(const LaunchShape& shape) {
    config_.gridDim = shape.grid;
    config_.blockDim = shape.block;
    config_.dynamicSmemBytes = shape.shared_bytes;
    config_.stream = shape.stream;
    unsigned n = 0;
    if (shape.cluster_x > 0) {
      attributes_[n].id = cudaLaunchAttributeClusterDimension;
      attributes_[n].val.clusterDim.x = shape.cluster_x;
      attributes_[n].val.clusterDim.y = 1;
      attributes_[n].val.clusterDim.z = 1;
      ++n;
    }
    if (shape.pdl) {
      attributes_[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attributes_[n].val.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    config_.attrs = attributes_;
    config_.numAttrs = n;
  }
  LaunchConfig(const LaunchConfig&) = delete;
  LaunchConfig& operator=(const LaunchConfig&) = delete;
  const cudaLaunchConfig_t* get() const { return &config_; }

 private:
  cudaLaunchAttribute attributes_[2] = {};
  cudaLaunchConfig_t config_ = {};
};

}  // namespace base_moe::cuda
