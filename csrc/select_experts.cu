// Stages 1-3 in one launch (select_experts): router + predictor GEMV, routing, batch cost, top-budget selection and
// fill for decode batches. One thread-block cluster per group (decode batch) does everything; its CTAs exchange
// through distributed shared memory, so there is no second launch and no round trip of the logits through HBM.
//
// Cluster = TG token groups x RG row groups (TG * RG <= 16 CTAs; chosen by the launcher to minimise the bytes
// each CTA reads). CTA (tg, rg):
//   1. GEMV: logits and log-norms of experts [rg * EC, (rg + 1) * EC) for tokens [tg * TC, (tg + 1) * TC) of the
//      group, on tensor cores (mma.sync m16n8k16: weight rows as M, tokens as the narrow N side). The weight rows are
//      copied to shared memory (cp.async) before the kernel waits for its predecessor (programmatic dependent
//      launch), so their HBM read overlaps the previous kernel; their biases follow right after the wait (a bias may
//      come from the kernel just before, e.g. a cast to fp32); hidden states come from global memory in 16-byte
//      loads (each warp's first addresses computed before the wait). The CTA's warps split the tile and H; partial
//      sums are added in a fixed order.                                                            -- cluster barrier
//   2. Routing: one warp per token (token i of the token group goes to CTA rg = i % RG): the warp gathers the
//      token's E logits from the RG CTAs of its token group, picks the top k (csrc/include/base_moe/
//      routing_device.cuh), computes weights and slot costs, and writes each slot's cost into the shared memory of
//      the CTA that owns the expert for the batch cost (up to EO experts per CTA), at the token's position.
//                                                                                                  -- barrier
//   3. Batch cost: each CTA adds its owned experts' costs in token order (bitwise the reference's sequential fp32
//      sum: absent tokens contribute nothing) and pushes the ranking keys (D of the candidates, 0 otherwise) into
//      every CTA's inbox (cuda::inbox_push: st.async counted by the receiver's mbarrier).  -- each CTA waits for its
//      E keys (no cluster barrier: its release fence cost ~0.5 us)
//   4. Every CTA ranks the candidates (D descending, index ascending) and keeps the top W; the token warps fill
//      their tokens' slots (still in registers) and add them to the counts in global memory with integer atomics
//      (the owners zeroed their experts' counts right after the PDL wait, before barrier 1; integer sums do not
//      depend on the order).
//   5. ids, weights, logits, log-norms, D and the kept list go to global memory. No CTA touches another's shared
//      memory after phase 3's pushes, and a CTA leaves only once all pushes to it have landed, so no barrier closes
//      the kernel. Global writes before a barrier make its fence wait for them: only the counts' zeroing precedes
//      one, with the GEMV in between.
// Code size costs latency here (measured; presumably because each CTA runs each phase once, so most instructions are
// fetched cold, in the layer after the expert kernels' weights went through L2). The strided loops that run at most a
// pass or two at decode sizes carry `#pragma unroll 1`: without it ptxas unrolled them into ~1.3k of the Qwen3
// instance's 5.4k instructions, and the call took 0.4 us longer (one call 7.64 / 8.85 / 9.73 / 14.62 -> 7.18 / 8.49 /
// 9.31 / 14.18 us at T = 1 / 4 / 16 / 64; the BASE layer b16/M16 55.7 -> 55.0; device_runs/session33.txt, call 4),
// and a model without DeepSeek's group limit runs an instance without its code (3488 instructions; b16/M16 55.3 ->
// 54.9, call 5); softmax-scored models at budgets up to 32 also leave out the other scoring modes and backfill's
// W > 32 path (GENERIC = false: 2904 instructions; one call 7.14 / 8.29 / 9.15 / 13.99 -> 6.94 / 7.98 / 8.73 / 13.53
// us, b16/M16 54.9 -> 54.4; device_runs/session34.txt, calls 1-2).
// Deterministic (no float atomics; integer counts only), graph-capturable, fixed output shapes. Shapes the kernel
// does not take (fp32, H % 8 != 0, more than kMaxFusedTokens (16) tokens per group, weight rows that do not fit in
// shared memory) run the two-kernel path (router_predict + route_select); csrc/select_cuda.cpp falls back.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

#include "base_moe/cuda_utils.cuh"
#include "base_moe/launch.cuh"
#include "base_moe/routing.h"
#include "base_moe/routing_device.cuh"
#include "base_moe/select_kernels.h"

namespace base_moe {
namespace {

using cuda::kFullMask;
using namespace routing_device;

constexpr int kWarps = 16;  // 512 threads: one warp per token of the CTA in the routing and fill phases
constexpr int kThreads = kWarps * 32;
constexpr int kUnroll = 4;  // 32-column chunks whose loads are in flight at once per warp
constexpr int kSmemWeightBytes = 140 * 1024;  // stage the CTA's weight rows in shared memory up to this size
constexpr int kMaxSmemBytes = 220 * 1024;
// kMaxFusedTokens (select_kernels.h) = 16: above 16 tokens per group the two kernels win wherever a norm runs before
// the selection, as in every decode step (H200, Qwen3 shape, us, fused vs two kernels behind base_moe's rms_norm: T =
// 16 9.53 vs 9.43, 24 11.09 vs 9.93, 32 12.30 vs 10.25, 64 14.98 vs 11.35; behind torch's norm 12.61 / 12.58 at 16,
// 15.49 / 12.41 at 32), though a lone call of the fused kernel is faster up to 48 tokens (16: 7.92 vs 10.14, 32: 9.56
// vs 10.94); device_runs/session48.txt, call 2.

struct FusedLayout {
  // Offsets in 4-byte words into dynamic shared memory.
  int weights, bias, partial, logit, log_norm, own, flags, own_cost, rank_key, kept_flag, kept, scratch, fill, inbox,
      total;
};

__host__ __device__ inline int round_up(int a, int b) { return (a + b - 1) / b * b; }

// x / f.d for 0 <= x < 2^31 (make_fast_div)
__device__ __forceinline__ int fast_div(int x, const FastDiv& f) {
  return f.d == 1 ? x : static_cast<int>(__umulhi(static_cast<unsigned>(x), f.mul) >> f.shift);
}

// Bytes per weight row in shared memory: rows 64 bytes apart modulo 128, so the two rows a quarter warp reads with
// 16-byte loads (lanes g, g + 1 at 4 x 16 contiguous bytes each) fall on disjoint banks.
__host__ __device__ inline int weight_row_stride(int H) { return round_up(H * 2, 128) + 64; }

__host__ __device__ inline FusedLayout fused_layout(const FusedSelectParams& f) {
  const int rows = f.experts_per_cta * (f.predict ? 2 : 1);
  const int E = f.sel.E;
  FusedLayout s{};
  int at = 0;
  s.weights = at;  // [rows][weight_row_stride bytes]: the CTA's weight rows
  at += rows * weight_row_stride(f.gemv.H) / 4;
  s.bias = at;  // [rows]: the biases of those rows (0 for a router without bias)
  at += rows;
  s.partial = at;  // [k_slices][rows rounded to 16][tokens rounded to 16]
  at += f.k_slices * round_up(rows, 16) * round_up(f.tokens_per_cta, 16);
  s.logit = at;  // [tokens_per_cta][experts_per_cta]
  at += f.tokens_per_cta * f.experts_per_cta;
  s.log_norm = at;
  at += f.predict ? f.tokens_per_cta * f.experts_per_cta : 0;
  s.own = at;  // [owned_experts][B]: slot costs of the owned experts, by token
  at += f.owned_experts * f.sel.B;
  s.flags = at;  // [owned_experts]: bit 0 routed by some token, bit 1 some token's top-1
  at += f.owned_experts;
  s.own_cost = at;  // [owned_experts]: D of the owned experts
  at += f.owned_experts;
  s.rank_key = at;  // [E], every CTA: ranking key of the candidates (routed in the group), 0 otherwise
  at += E;
  s.kept_flag = at;  // [E]
  at += E;
  s.kept = at;  // [W]
  at += f.sel.W;
  s.scratch = at;  // per warp: E + 2 * n_group floats (group limit; the E floats serve the fill too)
  at += kWarps * (E + 2 * f.sel.n_group);
  s.fill = round_up(at, 2);  // per warp: the fill's kFillScratchWords (8-byte keys)
  at = s.fill + kWarps * kFillScratchWords;
  s.inbox = at;  // 8 bytes (at is even): the mbarrier counting the rank keys the other CTAs push (cuda::inbox_push)
  at += 2;
  s.total = at;
  return s;
}

// Weight row of local GEMV row r: router rows first, then predictor rows (null past the experts). No modulo: a valid
// r is below 2 EC.
template <typename T>
__device__ __forceinline__ const T* gemv_row(const FusedSelectParams& f, int rg, int r) {
  const int EC = f.experts_per_cta;
  if (r >= EC * (f.predict ? 2 : 1)) return nullptr;
  const bool router = r < EC;
  const int u = rg * EC + (router ? r : r - EC);
  if (u >= f.sel.E) return nullptr;
  const void* w = router ? f.gemv.router_weight : f.gemv.predictor_weight;
  return static_cast<const T*>(w) + static_cast<int64_t>(u) * f.gemv.H;
}

// The biases of the CTA's GEMV rows to shared memory, issued after the PDL wait (the caller may have just written
// them: the HF integration casts a bf16 router bias to fp32 per call) as one cp.async group, which gemv_tile waits
// for only before its epilogue: their load overlaps the GEMV's instead of preceding it.
__device__ __forceinline__ void stage_biases(const FusedSelectParams& f, int rg, float* bias) {
  const int EC = f.experts_per_cta, rows = EC * (f.predict ? 2 : 1);
#pragma unroll 1
  for (int r = threadIdx.x; r < rows; r += kThreads) {
    const int u = rg * EC + (r < EC ? r : r - EC);  // r < 2 EC: no modulo (a ~20-instruction chain before the barrier)
    const float* b = r < EC ? f.gemv.router_bias : f.gemv.predictor_bias;
    if (u < f.sel.E && b != nullptr) {
      cuda::cp_async4(bias + r, b + u);
    } else {
      bias[r] = 0.0f;
    }
  }
  cuda::cp_async_commit();
}

// Phase 1: this CTA's [rows x tokens] tile of the GEMV, into shared memory (the op's outputs are written at the end).
// The weight rows are in shared memory (copied before the kernel waited for its predecessor); the hidden states
// stream from global memory. Every lane loads unconditionally: a weight row past the CTA's rows reads row 0 and a token
// past the group's reads the batch's first, whose MMA rows / columns are never read back (an MMA's output row depends
// on its A row only, its column on its B column only); only k past the slice's end must add nothing, so both operands
// are zeroed there. A load under a condition compiled into a divergent branch per load (BSSY / BSYNC), and the first
// pass through that code took ~2.3k cycles with its data in L2 (device_runs/session23.txt, call 5).
//
// A warp's work item: the 16 x 16 tile (row tile rt, token unit tu) of k slice ks. The kernel plans each warp's first
// item before its PDL wait: ~110 instructions of addressing per warp (~190 with the divisions of several tiles), 16
// warps on 4 schedulers, stood between the weights' barrier and the first load (one call 6.92 / 7.98 / 8.76 / 13.63
// -> 6.67 / 7.74 / 8.52 / 12.89 us at T = 1 / 4 / 16 / 64; device_runs/session43.txt, call 3). Loading the first
// hidden states right after the wait as well, before the weights' barrier, was slower (7.22 / 8.35 / 9.15 / 13.97,
// call 2).
template <typename T>
struct GemvItem {
  const T* a_row[2];  // shared memory: the tile's weight rows g and g + 8 (row 0 for rows without an expert)
  const T* b_row[2];  // global memory: the hidden states of the tile's tokens g and g + 8 (the batch's first past
                      // the token group's)
  int rt, tu, ks, k_begin, k_end;
};

// Work items of the CTA's GEMV: 16 x 16 tiles times k slices. (gemv_item and plan derive the same tile geometry; having
// plan store it once measured 0.02-0.10 us slower per call: device_runs/session45.txt, call 2.)
__device__ __forceinline__ int gemv_items(const FusedSelectParams& f) {
  const int rows = f.experts_per_cta * (f.predict ? 2 : 1);
  return ((rows + 15) / 16) * ((f.tokens_per_cta + 15) / 16) * f.k_slices;
}

template <typename T>
__device__ __forceinline__ GemvItem<T> gemv_item(const FusedSelectParams& f, int group, int tg, int rg,
                                                 const float* smem, const FusedLayout& L, int w) {
  const GemvParams& p = f.gemv;
  const int g = (threadIdx.x & 31) >> 2, B = f.sel.B, TC = f.tokens_per_cta;
  const int rows = f.experts_per_cta * (f.predict ? 2 : 1), row_tiles = (rows + 15) / 16;
  const int units = row_tiles * ((TC + 15) / 16);
  const int slice = f.gemv_slice;
  const int tokens_here = min(TC, B - tg * TC);  // tokens of this token group (the last may be short)
  const int stride = weight_row_stride(p.H);
  const char* weights = reinterpret_cast<const char*>(smem + L.weights);
  GemvItem<T> it;
  // one 16 x 16 tile at decode sizes (Qwen3 up to 16 tokens): no integer division on the path to the loads then
  it.ks = w;
  it.rt = it.tu = 0;
  if (units > 1) {
    const int unit = w % units;
    it.ks = w / units;
    it.rt = unit % row_tiles;
    it.tu = unit / row_tiles;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = it.rt * 16 + h * 8 + g;
    it.a_row[h] = reinterpret_cast<const T*>(weights + (gemv_row<T>(f, rg, r) != nullptr ? r : 0) * stride);
    const int i = it.tu * 16 + h * 8 + g;
    const int64_t token = static_cast<int64_t>(group) * B + (i < tokens_here ? tg * TC + i : 0);
    it.b_row[h] = static_cast<const T*>(p.hidden) + token * p.H;
  }
  it.k_begin = it.ks * slice;
  it.k_end = min(p.H, it.k_begin + slice);
  return it;
}

// One k step of an item's operands (lane (g, t4) holds columns [8 t4, 8 t4 + 8) of each 32-column chunk), zero past
// the slice's end: the hidden states (global memory, read-only loads) or the weights (kShared: shared memory).
template <bool kShared, typename T>
__device__ __forceinline__ void load_gemv_operand(const T* const (&row)[2], int k0, int k_end, uint4 (&x)[kUnroll][2]) {
  const int t4 = threadIdx.x & 3;
  const uint4 zero = make_uint4(0, 0, 0, 0);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int k = k0 + u * 32 + t4 * 8;
    const bool ok = k < k_end;
    const int kc = ok ? k : k0;  // k0 + 8 <= k_end: H and the slice bounds are multiples of 8
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      x[u][h] = kShared ? *reinterpret_cast<const uint4*>(row[h] + kc) : cuda::load16(row[h] + kc);
      if (!ok) x[u][h] = zero;
    }
  }
}

// The CTA's tile. `it` is the warp's first item (gemv_item(..., warp)), from the caller.
template <typename T>
__device__ __forceinline__ void gemv_tile(const FusedSelectParams& f, int group, int tg, int rg, float* smem,
                                          const FusedLayout& L, GemvItem<T> it) {
  const GemvParams& p = f.gemv;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t4 = lane & 3;
  const int B = f.sel.B, E = f.sel.E, EC = f.experts_per_cta, TC = f.tokens_per_cta, KS = f.k_slices;
  const int rows = EC * (f.predict ? 2 : 1), rows_pad = round_up(rows, 16), tokens_pad = round_up(TC, 16);
  const int tokens_here = min(TC, B - tg * TC);  // tokens of this token group (the last may be short)
  float* partial = smem + L.partial;
  const int items = gemv_items(f);
  for (int w = warp; w < items; w += kWarps) {
    if (w != warp) it = gemv_item<T>(f, group, tg, rg, smem, L, w);
    float acc[2][4] = {};
    for (int k0 = it.k_begin; k0 < it.k_end; k0 += 32 * kUnroll) {
      uint4 a[kUnroll][2], hidden[kUnroll][2];
      load_gemv_operand<false>(it.b_row, k0, it.k_end, hidden);
      load_gemv_operand<true>(it.a_row, k0, it.k_end, a);
      // k within each 32-chunk is permuted identically for A and B: lane (g, t4) holds columns [8 t4, 8 t4 + 8)
      // and feeds them to two MMAs as logical k {2 t4, 2 t4 + 1, 2 t4 + 8, 2 t4 + 9}.
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const uint4& b = hidden[u][n];
          cuda::mma_16816<T>(acc[n], a[u][0].x, a[u][1].x, a[u][0].y, a[u][1].y, b.x, b.y);
          cuda::mma_16816<T>(acc[n], a[u][0].z, a[u][1].z, a[u][0].w, a[u][1].w, b.z, b.w);
        }
    }
    // C fragment: c0, c1 at (row g, tokens 2 t4, 2 t4 + 1); c2, c3 at (row g + 8, same tokens).
#pragma unroll
    for (int n = 0; n < 2; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int r = it.rt * 16 + g + (c >> 1) * 8, i = it.tu * 16 + n * 8 + 2 * t4 + (c & 1);
        partial[(it.ks * rows_pad + r) * tokens_pad + i] = acc[n][c];
      }
  }
  cuda::cp_async_wait<0>();  // this thread's bias copies
  __syncthreads();

  // Add the k slices in order, then the biases. One 16 x 16 tile (decode sizes): thread idx takes the tile's element
  // idx, so a warp reads 32 consecutive words of each slice and no thread divides (taking only the valid (row, token)
  // pairs in order, 16 threads of one warp read rows 16 words apart at T = 1: 8-way bank conflicts, after ~90
  // instructions of divisions); larger tiles take the valid pairs in order.
  float* logit = smem + L.logit;
  float* log_norm = smem + L.log_norm;
  const float* bias = smem + L.bias;
  const bool single_tile = items == KS;
  const int sums = single_tile ? 16 * 16 : rows * tokens_here;
#pragma unroll 1
  for (int idx = threadIdx.x; idx < sums; idx += kThreads) {
    int r, i;
    if (single_tile) {
      r = idx >> 4;
      i = idx & 15;
      if (r >= rows || i >= tokens_here) continue;
    } else {
      r = idx / tokens_here;
      i = idx % tokens_here;
    }
    const int u = rg * EC + (r < EC ? r : r - EC);  // r < 2 EC
    if (u >= E) continue;
    float v = 0.0f;
    for (int ks = 0; ks < KS; ++ks) v += partial[(ks * rows_pad + r) * tokens_pad + i];
    if (r < EC) {
      if (p.router_bias != nullptr) v += bias[r];
      logit[i * EC + r] = v;
    } else {
      log_norm[i * EC + r - EC] = v + bias[r];
    }
  }
}

// The CTA's logits / log-norms tile ([tokens][EC]) to the op's outputs. Thread tid writes elements tid, tid + kThreads,
// ...; (first_token, first_column) must be its first one's, tid / EC and tid % EC, which the caller divides out before
// its PDL wait (at decode sizes a thread has one element: no division left at the kernel's end).
__device__ __forceinline__ void write_gemv_tile(const FusedSelectParams& f, int group, int tg, int rg, const float* smem,
                                                const FusedLayout& L, int first_token, int first_column) {
  const int B = f.sel.B, E = f.sel.E, EC = f.experts_per_cta, TC = f.tokens_per_cta;
  const int tokens_here = min(TC, B - tg * TC);
  // element idx's (token, expert column); dividing only past the first element (a plain for loop with `if (idx !=
  // threadIdx.x)`) measured 0.07-0.18 us slower per call (device_runs/session45.txt, call 2)
  int i = first_token, e = first_column;
#pragma unroll 1
  for (int idx = threadIdx.x; i < tokens_here;) {
    const int u = rg * EC + e;
    if (u < E) {
      const int64_t out = (static_cast<int64_t>(group) * B + tg * TC + i) * E + u;
      f.gemv.logits[out] = smem[L.logit + idx];
      if (f.predict) f.gemv.log_norms[out] = smem[L.log_norm + idx];
    }
    idx += kThreads;
    if (idx >= tokens_here * EC) break;
    i = fast_div(idx, f.ec_div);
    e = idx - i * EC;
  }
}

// Phase 2 input: token i of token group tg, gathered from the RG CTAs that computed its logits. Expert u = lane * EPL
// + j is column u % EC of row group u / EC: (row_group, column) is the lane's first expert's, which the caller divides
// out before its PDL wait, then a step per register (this is the routing warp's critical path, where a division is a
// ~20-instruction chain).
template <int EPL>
__device__ __forceinline__ void gather_token(const FusedSelectParams& f, int tg, int i, int lane, float* logit_smem,
                                             float* log_norm_smem, bool base_cost, int row_group, int column,
                                             Token<EPL>& s) {
  const int E = f.sel.E, EC = f.experts_per_cta, RG = f.row_groups;
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int u = lane * EPL + j;
    const unsigned owner = static_cast<unsigned>(tg * RG + row_group);
    const int at = i * EC + column;
    s.logit[j] = u < E ? cuda::cluster_map(logit_smem, owner)[at] : 0.0f;
    s.log_norm[j] = u < E && base_cost ? cuda::cluster_map(log_norm_smem, owner)[at] : 0.0f;
    if (++column == EC) {
      column = 0;
      ++row_group;
    }
  }
}

// Keeps the top W candidates (key descending, index ascending): kept[rank] = u, kept_flag[u] = 1 for rank < W. One
// warp per candidate: each lane compares the candidate with EPL keys it holds in registers (experts lane + 32 j) and
// a warp sum gives the rank, so each CTA spends ~E / 16 short warp passes instead of E x E / 512 compares per thread.
template <int EPL>
__device__ __forceinline__ void rank_candidates(const uint32_t* rank_key, int E, int W, int warp, int lane, int* kept,
                                                int* kept_flag) {
  // key of expert v = lane + 32 j, with the index below it so that equal keys order by index: (key, ~v) as 64 bits
  uint64_t mine[EPL];
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int v = lane + 32 * j;
    mine[j] = v < E ? (static_cast<uint64_t>(rank_key[v]) << 32) | (~static_cast<uint32_t>(v)) : 0u;
  }
#pragma unroll 1
  for (int u = warp; u < E; u += kWarps) {
    const uint32_t ku = rank_key[u];
    if (ku == 0u) continue;  // not a candidate (the same for the whole warp)
    const uint64_t key_u = (static_cast<uint64_t>(ku) << 32) | (~static_cast<uint32_t>(u));
    int above = 0;
#pragma unroll
    for (int j = 0; j < EPL; ++j) above += mine[j] > key_u ? 1 : 0;
    const int r = static_cast<int>(__reduce_add_sync(kFullMask, static_cast<unsigned>(above)));
    if (lane == 0 && r < W) {
      kept[r] = u;
      kept_flag[u] = 1;
    }
  }
}

template <typename T, int EPL, bool GENERIC>
__global__ void __launch_bounds__(kThreads, 1) select_experts_kernel(const FusedSelectParams f) {
  extern __shared__ __align__(16) float smem[];
  const SelectParams& p = f.sel;
  const FusedLayout L = fused_layout(f);
  const int E = p.E, k = p.k, B = p.B, W = p.W, C = f.token_groups * f.row_groups, EO = f.owned_experts;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const unsigned rank = cuda::cluster_rank();
  // shifts and a multiply-high (plan): ptxas finished this kernel's divisions after its PDL wait, on the path to the
  // GEMV (~50 instructions per thread between the wait and the GEMV's barrier in Qwen3's instance, session 44)
  const int group = static_cast<int>(blockIdx.x) >> f.cluster_shift, tg = static_cast<int>(rank) >> f.row_group_shift,
            rg = static_cast<int>(rank) & (f.row_groups - 1);
  const bool base_cost = p.cost == static_cast<int>(Cost::kBase);
  float* own = smem + L.own;
  int* flags = reinterpret_cast<int*>(smem + L.flags);
  float* own_cost = smem + L.own_cost;
  uint32_t* rank_key = reinterpret_cast<uint32_t*>(smem + L.rank_key);
  int* kept_flag = reinterpret_cast<int*>(smem + L.kept_flag);
  int* kept = reinterpret_cast<int*>(smem + L.kept);
  uint64_t* inbox = reinterpret_cast<uint64_t*>(smem + L.inbox);
  float* my_scratch = smem + L.scratch + warp * (E + 2 * p.n_group);

  // The weights do not depend on the previous kernel: start copying this CTA's rows to shared memory while it
  // finishes (programmatic dependent launch), then wait before touching hidden states or outputs.
  cuda::pdl_launch_dependents();
  {
    const int rows = f.experts_per_cta * (f.predict ? 2 : 1), chunks = f.gemv.H / 8;
    const int stride = weight_row_stride(f.gemv.H);
    char* weights = reinterpret_cast<char*>(smem + L.weights);
    // chunk c of row r for the flat index r * chunks + c = tid, tid + kThreads, ...: (r, c) steps by (kThreads /
    // chunks, kThreads % chunks) with one carry, not a division per chunk (16 chunks per thread at Qwen3's H 2048).
    // H = 0: no chunks, nothing to copy.
    const int dr = chunks > 0 ? kThreads / chunks : 0, dc = kThreads - dr * chunks;
    int r = chunks > 0 ? tid / chunks : rows, c = tid - r * chunks;
    while (r < rows) {
      const T* row = gemv_row<T>(f, rg, r);
      if (row != nullptr) cuda::cp_async16(weights + r * stride + c * 16, row + c * 8);
      r += dr;
      c += dc;
      if (c >= chunks) {
        c -= chunks;
        ++r;
      }
    }
    cuda::cp_async_commit();
  }
#pragma unroll 1
  for (int i = tid; i < EO * B; i += kThreads) own[i] = 0.0f;
#pragma unroll 1
  for (int i = tid; i < EO; i += kThreads) flags[i] = 0;
#pragma unroll 1
  for (int i = tid; i < E; i += kThreads) kept_flag[i] = 0;
#pragma unroll 1
  for (int i = tid; i < W; i += kThreads) kept[i] = E;
  cuda::inbox_init(inbox, tid == 0);
  // Work that needs no input, done while the previous kernel finishes: gemv_tile's first item, gather_token's and
  // write_gemv_tile's divisions (with the owners by shift and stage_biases without a modulo: one call 6.67 / 7.76 /
  // 8.53 / 12.92 -> 6.43 / 7.47 / 8.22 / 12.56 us at T = 1 / 4 / 16 / 64; device_runs/session43.txt, call 5).
  const GemvItem<T> first_item = gemv_item<T>(f, group, tg, rg, smem, L, warp);
  const int EC = f.experts_per_cta;
  const int gather_row_group = fast_div(lane * EPL, f.ec_div), gather_column = lane * EPL - gather_row_group * EC;
  const int out_token = fast_div(tid, f.ec_div), out_column = tid - out_token * EC;
  cuda::pdl_wait();
  int32_t* group_counts = p.counts + static_cast<int64_t>(group) * E;
#pragma unroll 1
  for (int e = tid; e < EO; e += kThreads) {
    const int u = static_cast<int>(rank) * EO + e;
    if (u < E) group_counts[u] = 0;
  }
  stage_biases(f, rg, smem + L.bias);

  // ---- 1. GEMV ----
  cuda::cp_async_wait<1>();  // the weight rows; the biases may still be in flight
  __syncthreads();
  gemv_tile<T>(f, group, tg, rg, smem, L, first_item);
  cuda::cluster_sync();

  // ---- 2. routing, slot costs to the owners ----
  const int TC = f.tokens_per_cta, RG = f.row_groups;
  const int i = rg + RG * warp;  // this warp's token within the token group
  const int t_local = tg * TC + i;
  const bool has_token = i < TC && t_local < B;
  const int64_t t = static_cast<int64_t>(group) * B + t_local;
  Token<EPL> s;
  if (has_token) {
    gather_token<EPL>(f, tg, i, lane, smem + L.logit, smem + L.log_norm, base_cost, gather_row_group, gather_column,
                      s);
    score_token<EPL, GENERIC>(p, lane, my_scratch, my_scratch + E, s);
    float w, log_norm;
    int32_t id;
    route_token<EPL, GENERIC>(p, s, lane, id, w, log_norm);
    if (id < E) {
      const unsigned owner = static_cast<unsigned>(id >> f.owned_shift);  // EO is a power of two (plan)
      const int u = id & (EO - 1);
      cuda::cluster_map(own, owner)[u * B + t_local] =
          slot_cost(static_cast<Cost>(p.cost), w, base_cost ? log_norm : 0.0f);
      atomicOr(cuda::cluster_map(flags, owner) + u, lane == 0 ? 3 : 1);
    }
  }
  cuda::cluster_sync();
  cuda::inbox_expect(inbox, 4u * static_cast<uint32_t>(E), tid == 0);  // every expert's rank key, from its owner

  // ---- 3. batch cost of the owned experts, in token order; the ranking keys to every CTA ----
#pragma unroll 1
  for (int e = warp; e < EO; e += kWarps) {
    const int u = static_cast<int>(rank) * EO + e;
    if (u >= E) break;
    const float summed = warp_add_nonzero_in_order<(kMaxFusedTokens + 31) / 32>(0.0f, own + e * B, B, lane);
    const int fl = flags[e];
    const float d = with_top1_offset(p, summed, fl);
    if (lane < C) cuda::inbox_push(rank_key + u, static_cast<unsigned>(lane), (fl & 1) ? candidate_key(d) : 0u, inbox);
    if (lane == 0) own_cost[e] = d;
  }
  // No CTA touches another's shared memory after this point, so the inbox (all E keys in) replaces a cluster barrier
  cuda::inbox_wait(inbox);

  // ---- 4. top-budget selection (every CTA): rank each candidate (key descending, index ascending) ----
  rank_candidates<EPL>(rank_key, E, W, warp, lane, kept, kept_flag);
  __syncthreads();

  // ---- 5. fill this warp's token from the kept experts, count the final slots ----
  int32_t final_id = E;
  float final_weight = 0.0f;
  int final_slot = lane;
  if (has_token) {
    const FillScratch scratch{my_scratch, reinterpret_cast<uint32_t*>(smem + L.fill) + warp * kFillScratchWords};
    fill_token<EPL, GENERIC>(p, s, lane, kept, [&](int u) { return kept_flag[u] != 0; }, scratch, final_slot,
                             final_id, final_weight);
    if (lane < k && final_id < E) atomicAdd(group_counts + final_id, 1);
  }
  if (has_token && lane < k) {
    p.ids[t * k + final_slot] = final_id;
    p.weights[t * k + final_slot] = final_weight;
  }
  write_gemv_tile(f, group, tg, rg, smem, L, out_token, out_column);
#pragma unroll 1
  for (int e = tid; e < EO; e += kThreads) {
    const int u = static_cast<int>(rank) * EO + e;
    if (u < E) p.batch_cost_out[static_cast<int64_t>(group) * E + u] = own_cost[e];
  }
  if (rank == 0) {
#pragma unroll 1
    for (int j = tid; j < W; j += kThreads) p.kept[static_cast<int64_t>(group) * W + j] = kept[j];
  }
}

// The dynamic shared memory this kernel may take on the device, asked once per device, and its attribute raised to
// that: kMaxSmemBytes, or less where the device allows less beside the kernel's static shared memory (sm_120 GPUs
// have clusters and 99 KiB per CTA); 0 for a device ordinal past the memo.
template <typename T, int EPL, bool GENERIC>
int smem_limit(int device) {
  static std::atomic<int> memo[cuda::kMaxDevices];
  return cuda::once_per_device(memo, device, 0, [&] {
    auto kernel = select_experts_kernel<T, EPL, GENERIC>;
    cudaFuncAttributes attributes{};
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
    const int allowed = static_cast<int>(at::cuda::getDeviceProperties(device)->sharedMemPerBlockOptin -
                                         attributes.sharedSizeBytes);
    const int limit = std::min(kMaxSmemBytes, allowed);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit));
    return limit;
  });
}

// Largest cluster the device can co-schedule for this kernel (16 needs the non-portable opt-in), 1 if neither 16 nor
// 8 fits; 0 for a device ordinal past the memo (launch_fused then declines: the two kernels run).
template <typename T, int EPL, bool GENERIC>
int max_cluster(size_t smem, int device) {
  static std::atomic<int> memo[cuda::kMaxDevices];
  return cuda::once_per_device(memo, device, 0, [&] {
    if (smem_limit<T, EPL, GENERIC>(device) < static_cast<int>(smem)) return 1;
    return cuda::largest_cluster(select_experts_kernel<T, EPL, GENERIC>, kThreads, smem);
  });
}

// Picks the cluster shape: among the (token groups, row groups) splits whose weight rows fit in shared memory, the
// one that reads the fewest bytes per CTA. False when none fits (large H x E) or the batch has more than
// kMaxFusedTokens tokens.
bool plan(FusedSelectParams& f, int max_c) {
  const int B = f.sel.B, E = f.sel.E, H = f.gemv.H;
  if (B > kMaxFusedTokens) return false;
  int64_t best_bytes = -1;
  for (int rg = 1; rg <= max_c && rg <= std::max(1, E / 8); rg *= 2) {
    const int ec = (E + rg - 1) / rg, rows = ec * (f.predict ? 2 : 1);
    if (static_cast<int64_t>(rows) * weight_row_stride(H) > kSmemWeightBytes) continue;
    for (int tg = 1; tg * rg <= max_c; tg *= 2) {
      const int tc = (B + tg - 1) / tg;
      if ((tc + rg - 1) / rg > kWarps) continue;  // one warp per token
      const int64_t bytes = static_cast<int64_t>(rows + tc) * H * 2;
      if (best_bytes < 0 || bytes < best_bytes) {
        best_bytes = bytes;
        f.token_groups = tg;
        f.row_groups = rg;
      }
    }
  }
  if (best_bytes < 0) return false;
  const int C = f.token_groups * f.row_groups;
  f.experts_per_cta = (E + f.row_groups - 1) / f.row_groups;
  f.ec_div = make_fast_div(f.experts_per_cta);
  f.cluster_shift = __builtin_ctz(static_cast<unsigned>(C));  // token and row groups are powers of two
  f.row_group_shift = __builtin_ctz(static_cast<unsigned>(f.row_groups));
  f.tokens_per_cta = (B + f.token_groups - 1) / f.token_groups;
  f.owned_experts = owned_experts_per_cta(E, C);
  // the kernel reads the shift rather than deriving it (__ffs before its PDL wait measured 0.03-0.1 us slower in
  // session 44: device_runs/session44.txt, call 1)
  f.owned_shift = __builtin_ctz(static_cast<unsigned>(f.owned_experts));
  const int rows = f.experts_per_cta * (f.predict ? 2 : 1);
  const int units = ((rows + 15) / 16) * ((f.tokens_per_cta + 15) / 16);
  f.k_slices = 1;
  while (units * f.k_slices * 2 <= kWarps && H / (f.k_slices * 2) >= 32 * kUnroll) f.k_slices *= 2;
  f.gemv_slice = round_up((H + f.k_slices - 1) / f.k_slices, 32);
  return true;
}

template <typename T, int EPL, bool GENERIC>
bool launch_fused(FusedSelectParams f, int groups, int device, cudaStream_t stream) {
  const int max_c = max_cluster<T, EPL, GENERIC>(64 * 1024, device);
  if (max_c < 1 || !plan(f, max_c)) return false;
  const size_t smem = static_cast<size_t>(fused_layout(f).total) * 4;
  if (smem > static_cast<size_t>(smem_limit<T, EPL, GENERIC>(device))) return false;
  const int C = f.token_groups * f.row_groups;
  cuda::launch({dim3(groups * C), dim3(kThreads), smem, stream, C, cuda::selection_pdl()},
               select_experts_kernel<T, EPL, GENERIC>, f);
  return true;
}

// One instance per (experts per lane, GENERIC): the other scoring modes' and the group limit's code would lengthen
// the common models' instance (the header's note on code size).
template <typename T, bool GENERIC>
bool launch_by_experts(const FusedSelectParams& f, int groups, int device, cudaStream_t stream) {
  const int epl = (f.sel.E + 31) / 32;
  if (epl <= 1) return launch_fused<T, 1, GENERIC>(f, groups, device, stream);
  if (epl <= 2) return launch_fused<T, 2, GENERIC>(f, groups, device, stream);
  if (epl <= 4) return launch_fused<T, 4, GENERIC>(f, groups, device, stream);
  if (epl <= 8) return launch_fused<T, 8, GENERIC>(f, groups, device, stream);
  return launch_fused<T, 16, GENERIC>(f, groups, device, stream);
}

template <typename T>
bool launch_by_shape(const FusedSelectParams& f, int groups, int device, cudaStream_t stream) {
  if (needs_generic_routing(f.sel)) return launch_by_experts<T, true>(f, groups, device, stream);
  return launch_by_experts<T, false>(f, groups, device, stream);
}

}  // namespace

bool select_experts_launch(const FusedSelectParams& f, FloatDtype dtype, int groups, int device) {
  if (!cuda::device_has_clusters(device)) return false;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  if (dtype == FloatDtype::kBFloat16) return launch_by_shape<__nv_bfloat16>(f, groups, device, stream);
  if (dtype == FloatDtype::kHalf) return launch_by_shape<__half>(f, groups, device, stream);
  return false;
}

}  // namespace base_moe
