// Hopper asynchronous-copy helpers of the warp-specialised expert GEMMs (csrc/experts_ws.cu) and of the
// microbenchmarks: mbarriers with transaction counts and TMA tensor loads into shared memory. Device code for
// sm_90 and later; other targets compile them to a trap (the host never launches those kernels there).
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstdint>

namespace base_moe {
namespace tma {

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define BASE_MOE_SM90(...) __trap()
#else
#define BASE_MOE_SM90(...) asm volatile(__VA_ARGS__)
#endif

// The mbarrier at shared address `bar`, completing a phase after `count` arrivals; then made visible to the async
// proxy (the TMA unit) before any copy may signal it.
__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  BASE_MOE_SM90("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() {
  BASE_MOE_SM90("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival that also expects `bytes` more transaction bytes (the TMA copies' complete_tx) in this phase.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  BASE_MOE_SM90("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  BASE_MOE_SM90("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// One arrival when all of this thread's earlier cp.async copies have landed (noinc: the arrival counts against the
// barrier's expected count, which must include it).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(uint32_t bar) {
  BASE_MOE_SM90("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// Spins until the phase with parity `parity` has completed. CLUSTER: the wait acquires at cluster scope, for bytes
// that other CTAs' threads pushed (cuda::inbox_push); the TMA unit's copies into this CTA need only its own scope.
template <bool CLUSTER = false>
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    if constexpr (CLUSTER) {
      BASE_MOE_SM90(
          "{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; "
          "}"
          : "=r"(done)
          : "r"(bar), "r"(parity)
          : "memory");
    } else {
      BASE_MOE_SM90("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                    : "=r"(done)
                    : "r"(bar), "r"(parity)
                    : "memory");
    }
  }
}

// TMA tensor loads of one box at element coordinates c0.. (innermost first) of `map` into shared address `dst`,
// completing on the mbarrier at `bar`. Elements outside the tensor arrive as zeros (and count as bytes).
__device__ __forceinline__ void load_2d(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  BASE_MOE_SM90(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
          "r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void load_3d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar) {
  BASE_MOE_SM90(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
      "[%5];" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void load_5d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3, int c4,
                                        uint32_t bar) {
  BASE_MOE_SM90(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, "
      "%6}], [%7];" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}

// load_3d / load_5d with an L2 cache policy (a createpolicy result, e.g. experts_mma.cuh's evict_first_policy).
__device__ __forceinline__ void load_3d_hint(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint32_t bar,
                                             uint64_t policy) {
  BASE_MOE_SM90(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
      "%3, %4}], [%5], %6;" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(bar), "l"(policy)
      : "memory");
}
__device__ __forceinline__ void load_5d_hint(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3,
                                             int c4, uint32_t bar, uint64_t policy) {
  BASE_MOE_SM90(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1, {%2, "
      "%3, %4, %5, %6}], [%7], %8;" ::"r"(dst), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar),
      "l"(policy)
      : "memory");
}

}  // namespace tma
}  // namespace base_moe
