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
  static const bool allowed = env_flag("BASE_MOE_CLUSTERS", true);
  if (!allowed) return false;
  static std::atomic<int> memo[kMaxDevices];  // 1 no, 2 yes
  return once_per_device(memo, device, 1, [&] { return probe(device) ? 2 : 1; }) == 2;
}

}  // namespace base_moe::cuda
