// Device helpers of the decode expert kernel (csrc/experts.cu): asynchronous copies, shared-memory loads, block
// scans. Inline PTX for sm_80+. Tensor-core MMA and programmatic dependent launch come from cuda_utils.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "base_moe/cuda_utils.cuh"

namespace base_moe {
namespace experts_detail {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// A weight row segment: streamed once, so mark it evict-first in L2 (keeps hidden states and activations hot).
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

__device__ __forceinline__ void cp_async16_stream(uint32_t dst, const void* src, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "l"(policy)
               : "memory");
}

// The same without the L2 policy. ptxas (CUDA 13.0) miscompiles the policy form in the kernels with several row
// groups (expert_item with WR > 1): their SASS reads uninitialised uniform registers for the address offset and
// the policy, an illegal instruction at run time.
__device__ __forceinline__ void cp_async16_nohint(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

using cuda::cp_async16_zfill;
using cuda::cp_async_commit;
using cuda::cp_async_wait;

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr));
  return v;
}

using cuda::from_float;

// SiLU(gate) * up for the gate_up epilogues (csrc/experts.cu, csrc/experts_ws.cu). __fdividef instead of IEEE
// division: the division's slow-path branch kept ptxas from interleaving a thread's 16-64 epilogue values, and with
// one or two warps per scheduler each dependent instruction costs its full latency (the W64 epilogue took ~2 us per
// CTA, stamped on the H200; session 13).
// __fdividef returns 0 for denominators above 2^126, i.e. for gate values below 126 ln 2 = -87.3, where |SiLU| <
// 1e-36 (the IEEE division gave that tiny value; for gate values below -88.7 both give -0).
__device__ __forceinline__ float silu_mul(float gate, float up) {
  return __fdividef(gate, 1.f + __expf(-gate)) * up;
}

// Exclusive prefix sum of one int per thread over the block (threads in order), and the block total.
// `scratch` holds one int per warp; the function synchronises the block (twice) so it can be called again.
template <int WARPS>
__device__ __forceinline__ int block_exclusive_scan(int v, int* scratch, int& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int n = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += n;
  }
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  int before = 0;
  total = 0;
#pragma unroll
  for (int w = 0; w < WARPS; ++w) {
    const int s = scratch[w];
    before += w < warp ? s : 0;
    total += s;
  }
  __syncthreads();
  return before + incl - v;
}

}  // namespace experts_detail
}  // namespace base_moe
