// Small device helpers shared by the CUDA kernels: dtype conversion, 16-byte loads, order-preserving
// float keys for warp top-k, deterministic warp sums, tensor-core MMA, thread-block clusters and their inboxes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cooperative_groups.h>
#include <cstdint>
#include <type_traits>

#include "base_moe/tma.cuh"

namespace base_moe {
namespace cuda {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpSize = 32;

template <typename T>
__device__ __forceinline__ float to_float(T v);
template <>
__device__ __forceinline__ float to_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ float to_float<__half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

// float to T, rounding to nearest even (torch's extensions build without the implicit half / bfloat16 conversions)
template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Monotone map of finite floats to unsigned integers: a < b  <=>  ordered(a) < ordered(b).
// Finite floats map to [0x00800000, 0xff7fffff], so 0 is free to mean "no candidate"; -0 and +0 map alike.
__device__ __forceinline__ uint32_t ordered_bits(float v) {
  const uint32_t b = __float_as_uint(v + 0.0f);  // -0 -> +0: equal floats get equal keys
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float from_ordered_bits(uint32_t o) {
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}

// Butterfly sum over the warp: every lane gets the bitwise same result (fp addition is commutative),
// and the order is fixed, so it is deterministic.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

// warp_sum of a value that only lanes [0, n) hold (the others hold zeros), on those lanes: the butterfly's levels that
// would only add the zeros (offsets >= the first power of two >= n) are skipped, so lanes below n get warp_sum's bits
// (but for the sign of an all-zero sum: x + +0 turns -0 into +0); the lanes above get partial sums.
__device__ __forceinline__ float warp_sum_first(float v, int n) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    if (offset < n) v += __shfl_xor_sync(kFullMask, v, offset);
  }
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Hardware warp max of 32-bit integers (sm_80+).
__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v) {
  return __reduce_max_sync(kFullMask, v);
}

// D += A * B on tensor cores: m16n8k16, A row-major (16x16), B column-major (16x8), fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Thread-block clusters (sm_90): the kernels launch one cluster per unit of work and exchange partial
// results through distributed shared memory, so reductions across CTAs stay in a fixed order.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define BASE_MOE_HAS_CLUSTERS 1
#endif

__device__ __forceinline__ void cluster_sync() {
#ifdef BASE_MOE_HAS_CLUSTERS
  cooperative_groups::this_cluster().sync();
#else
  __syncthreads();
#endif
}

// cluster_sync in two halves, so that independent work (e.g. a PDL wait) runs between them: cluster_arrive (a
// release, like cluster_sync's) and cluster_wait (an acquire). Every thread calls both, outside divergent code.
// Without clusters the pair is a __syncthreads.
__device__ __forceinline__ void cluster_arrive() {
#ifdef BASE_MOE_HAS_CLUSTERS
  cooperative_groups::this_cluster().barrier_arrive();
#endif
}

__device__ __forceinline__ void cluster_wait() {
#ifdef BASE_MOE_HAS_CLUSTERS
  cooperative_groups::this_cluster().barrier_wait();
#else
  __syncthreads();
#endif
}

__device__ __forceinline__ unsigned cluster_rank() {
#ifdef BASE_MOE_HAS_CLUSTERS
  return cooperative_groups::this_cluster().block_rank();
#else
  return 0;
#endif
}

// The same shared-memory variable in CTA `rank` of this cluster.
template <typename T>
__device__ __forceinline__ T* cluster_map(T* ptr, unsigned rank) {
#ifdef BASE_MOE_HAS_CLUSTERS
  return cooperative_groups::this_cluster().map_shared_rank(ptr, rank);
#else
  return ptr;
#endif
}

#ifdef BASE_MOE_HAS_CLUSTERS
// Whether the inbox counts bytes on its mbarrier: in a cluster of two or more CTAs (st.async needs them).
__device__ __forceinline__ bool inbox_counts_bytes() {
  return cooperative_groups::this_cluster().num_blocks() > 1;
}
#endif

// A CTA's inbox: 32- or 64-bit values the other CTAs of its cluster push into its shared memory, complete on its own
// mbarrier once it has received the number of bytes it expects (st.async, sm_90). Where a CTA knows how many bytes it
// will receive, waiting on its inbox replaces a cluster barrier, whose release (a MEMBAR.ALL.GPU per warp on sm_90)
// cost the one-launch select_experts kernel (removed in session 59) ~0.5 us per call at its third barrier
// (device_runs/session22.txt, call 4). In a one-CTA cluster (st.async needs two or more) and without clusters the
// pushes are plain stores and the wait a __syncthreads. The inbox is one 8-byte aligned shared word; every thread of
// the CTA calls inbox_wait. inbox_init, before the cluster barrier that orders it before every push and only where
// inbox_wait follows, and inbox_expect, after that barrier, declaring the bytes: every thread of the CTA calls both,
// outside divergent code; the leader (one thread) acts. A push's complete_tx may come before the expect (the tx-count
// goes negative until then, and the phase cannot complete before this arrival). Why not `if (leader)` around them
// (session 41): ptxas runs the mbarrier instructions on the uniform datapath, from the address register of the one lane
// that holds it, and racecheck counts them as accesses by every lane of the warp, each at its own copy of that
// register. Where the other lanes' copies were stale, racecheck reported races against the weight copies (that kernel);
// where the expect_tx followed the init at once, a race between the two (route_select, session 40). Here every lane
// holds the address and the operations are predicated, and the barrier separates the init from the expect.
__device__ __forceinline__ void inbox_init(uint64_t* inbox, bool leader) {
#ifdef BASE_MOE_HAS_CLUSTERS
  if (!inbox_counts_bytes()) return;
  asm volatile(
      "{ .reg .pred p; setp.ne.u32 p, %1, 0; @p mbarrier.init.shared::cta.b64 [%0], 1; "
      "@p fence.mbarrier_init.release.cluster; }" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(inbox))),
      "r"(static_cast<uint32_t>(leader))
      : "memory");
#else
  (void)inbox;
  (void)leader;
#endif
}

__device__ __forceinline__ void inbox_expect(uint64_t* inbox, uint32_t bytes, bool leader) {
#ifdef BASE_MOE_HAS_CLUSTERS
  if (!inbox_counts_bytes()) return;
  asm volatile(
      "{ .reg .pred p; setp.ne.u32 p, %2, 0; @p mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1; }" ::"r"(
          static_cast<uint32_t>(__cvta_generic_to_shared(inbox))),
      "r"(bytes), "r"(static_cast<uint32_t>(leader))
      : "memory");
#else
  (void)inbox;
  (void)bytes;
  (void)leader;
#endif
}

#ifdef BASE_MOE_HAS_CLUSTERS
// The shared::cluster address of `ptr` (a shared-memory variable, as in this CTA) in CTA `rank`: what st.async and
// remote mbarrier operations take (cluster_map gives a generic pointer instead).
__device__ __forceinline__ uint32_t cluster_shared_address(const void* ptr, unsigned rank) {
  uint32_t remote;
  asm("mapa.shared::cluster.u32 %0, %1, %2;\n"
      : "=r"(remote)
      : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(ptr))), "r"(rank));
  return remote;
}
#endif

// `value` to `dst` (a shared-memory variable, as in this CTA) of CTA `rank`, counted by that CTA's inbox: one 4- or
// 8-byte st.async (uint32_t or uint2; dst aligned to its size).
template <typename V>
__device__ __forceinline__ void inbox_push(V* dst, unsigned rank, V value, uint64_t* inbox) {
  static_assert(std::is_same_v<V, uint32_t> || std::is_same_v<V, uint2>, "st.async takes 4 or 8 bytes here");
#ifdef BASE_MOE_HAS_CLUSTERS
  if (inbox_counts_bytes()) {
    if constexpr (std::is_same_v<V, uint2>) {
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];\n" ::"r"(
                       cluster_shared_address(dst, rank)),
                   "r"(value.x), "r"(value.y), "r"(cluster_shared_address(inbox, rank))
                   : "memory");
    } else {
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.u32 [%0], %1, [%2];\n" ::"r"(
                       cluster_shared_address(dst, rank)),
                   "r"(value), "r"(cluster_shared_address(inbox, rank))
                   : "memory");
    }
    return;
  }
#endif
  (void)rank;
  (void)inbox;
  *dst = value;
}

// Returns once this CTA's inbox has received all the bytes inbox_expect declared. The acquire is at cluster scope: the
// bytes come from other CTAs' threads.
__device__ __forceinline__ void inbox_wait(uint64_t* inbox) {
#ifdef BASE_MOE_HAS_CLUSTERS
  if (inbox_counts_bytes()) {
    tma::mbar_wait</*CLUSTER=*/true>(static_cast<uint32_t>(__cvta_generic_to_shared(inbox)), 0);
    return;
  }
#endif
  (void)inbox;
  __syncthreads();
}

// Programmatic dependent launch (sm_90): a kernel launched with programmatic stream serialisation may start
// while the previous kernel finishes; it must call pdl_wait() before touching memory the previous kernel writes
// or reads. Both are no-ops for a normal launch.
__device__ __forceinline__ void pdl_wait() {
#ifdef BASE_MOE_HAS_CLUSTERS
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#ifdef BASE_MOE_HAS_CLUSTERS
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Synchronises `threads` threads of the CTA (a multiple of 32) on hardware barrier `id` (1-15; __syncthreads takes 0),
// with __syncthreads's ordering of their shared-memory accesses.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// 16 bytes to shared-memory address `dst`, or 16 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void cp_async16_zfill(uint32_t dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n) : "memory");
}
// Groups: commit closes the thread's copies issued since the last commit into a group; wait<N> returns once at most
// N of the thread's groups are still in flight.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

}  // namespace cuda
}  // namespace base_moe
