// Host-side launch helpers shared by the CUDA kernels: device capability, and cudaLaunchKernelEx with an
// optional thread-block cluster and programmatic dependent launch (PDL).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "base_moe/launch_config.cuh"

namespace base_moe::cuda {

constexpr int kMaxDevices = 64;

// A per-device answer that never changes, asked once: `compute()` (a positive int) for devices [0, kMaxDevices), kept
// in `memo` (0: not asked yet); `outside` for any other ordinal. Host threads asking at once on a new device each
// compute it and store the same answer.
template <typename Compute>
int once_per_device(std::atomic<int> (&memo)[kMaxDevices], int device, int outside, Compute compute) {
  if (device < 0 || device >= kMaxDevices) return outside;
  int known = memo[device].load(std::memory_order_acquire);
  if (known == 0) {
    known = compute();
    memo[device].store(known, std::memory_order_release);
  }
  return known;
}

// Thread-block clusters and programmatic dependent launch (PDL) need an sm_90 device and device code compiled for
// sm_90 or later: a build for older targets only (TORCH_CUDA_ARCH_LIST="8.0+PTX") runs JIT-compiled sm_80 code on an
// H100, where the kernels' cluster and griddepcontrol calls compile to plain barriers and nothing, so a launch asking
// for clusters or PDL would compute garbage there. The launchers ask this before either (csrc/launch.cu).
// BASE_MOE_CLUSTERS=0 makes it false everywhere, so the fallback paths (one CTA per group, no PDL) can be tested on
// an sm_90 device too.
bool device_has_clusters(int device);

// An environment switch read once: unset gives `fallback`, "0" false, anything else true (benchmarks use them).
inline bool env_flag(const char* name, bool fallback) {
  const char* v = std::getenv(name);
  return v == nullptr ? fallback : std::strcmp(v, "0") != 0;
}

// Programmatic dependent launch for the selection kernels (router_predict, route_select): on unless BASE_MOE_PDL=0.
// Before its griddepcontrol.wait a kernel touches only weight matrices (router_predict copies them to shared memory
// and computes on that copy), which must not be written by the kernel just
// before (the op docs say so); everything else is read after the wait.
inline bool selection_pdl() {
  static const bool enabled = env_flag("BASE_MOE_PDL", true);
  return enabled;
}

// Whether the device co-schedules one cluster of `size` CTAs of `kernel` (`threads` threads and `smem` bytes of dynamic
// shared memory each, an amount the kernel's attributes already allow); sizes above 8 need the non-portable opt-in,
// which this sets.
template <typename Kernel>
bool cluster_fits(Kernel kernel, int size, int threads, size_t smem) {
  if (size > 8) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  const LaunchConfig config({dim3(size), dim3(threads), smem, nullptr, size});
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, config.get()) == cudaSuccess && clusters > 0) return true;
  (void)cudaGetLastError();  // an unsupported size is an answer, not an error
  return false;
}

// The largest cluster (16, 8, or 1 if neither) of `kernel` that the device co-schedules (cluster_fits).
template <typename Kernel>
int largest_cluster(Kernel kernel, int threads, size_t smem) {
  for (int c : {16, 8}) {
    if (cluster_fits(kernel, c, threads, smem)) return c;
  }
  return 1;
}

template <typename Kernel, typename... Args>
void launch(const LaunchShape& shape, Kernel kernel, Args... args) {
  const LaunchConfig config(shape);
  C10_CUDA_CHECK(cudaLaunchKernelEx(config.get(), kernel, args...));
}

}  // namespace base_moe::cuda
