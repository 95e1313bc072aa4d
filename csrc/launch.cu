// Host-side capability check shared by the CUDA launchers (csrc/include/base_moe/launch.cuh).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

#include <atomic>

#include "base_moe/launch.cuh"

namespace base_moe::cuda {
namespace {

// Compiled with the same targets as every kernel of the library, so the driver loads the same kind of code for it:
// its PTX version says whether the kernels' sm_90 paths (clusters, griddepcontrol) are live on a device.
__global__ void arch_probe_kernel() {}

bool probe(int device) {
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  if (major < 9) return false;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));  // the query answers for the current device
  cudaFuncAttributes attributes{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, arch_probe_kernel));
  return attributes.ptxVersion >= 90;
}

}  // namespace

bool device_has_clusters(int device) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];  // 0 unknown, 1 no, 2 yes
  if (device < 0 || device >= kMaxDevices) return false;
  int known = cached[device].load(std::memory_order_acquire);
  if (known == 0) {
    known = probe(device) ? 2 : 1;
    cached[device].store(known, std::memory_order_release);
  }
  return known == 2;
}

}  // namespace base_moe::cuda
