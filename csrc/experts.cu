// Decode expert kernel (stage 4): y_t = sum_j w_tj * down_u(silu(gate_u x_t) * up_u x_t) over the token's
// non-sentinel slots, for HF v5 layouts (gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]).
//
// Three launches, chained with programmatic dependent launch (PDL): gate_up waits for the selection before it
// reads anything (ids, weights and hidden states all come from it) and then lets the down GEMM launch, which
// streams its first weight stages while gate_up finishes; the slot sum waits for the down GEMM:
//   1. gate_up GEMM: act[p, i] = silu(gate_i . x_t) * (up_i . x_t) for every pair p = t*k + j of an expert,
//      rounded to hidden's dtype (act rows in expert-sorted order of the pairs).
//   2. down GEMM:    yslot[p, h] = w_p * (down_h . act[p]), accumulated in fp32, rounded to hidden's dtype (as HF
//                    rounds each expert's output; half the bytes of fp32 rows to write and read back: at 256 tokens
//                    x 8 slots, 8 MB instead of 17).
//   3. slot sum:     y[t, h] = sum in fp32 over j in slot order of yslot[t*k + j, h] (non-sentinel slots only).
// expert_gemm_kernel: CTA (x, y) streams row tile x / S of active experts y, y + gridDim.y, ... in 64-column steps
// (tokens in the same cp.async stages, re-streamed per pass of 16 to 128 tokens depending on the tile configuration;
// passes x % S, x % S + S, ... of each expert, S = pass_splits; act indexed by expert-sorted position); the grid has
// min(E, T*k, max_active_experts) rows. (A persistent warp-specialised kernel, "v2", lost to
// it everywhere once it stopped launching CTAs for unused expert slots, and was removed: notes/experts_kernel.md.)
// So the op needs no host sync and allocates only buffers sized from T, k, H, I.
//
// Tensor cores: configurations T16 / T32 use mma.sync m16n8k16 with weight rows as M and tokens as the narrow N
// side; each lane loads 16 contiguous bytes of a row, and the k order inside each 32-wide chunk is permuted
// identically for A (weights) and B (tokens), so one 16-byte shared load feeds two MMAs' fragments. W64 / W128
// use wgmma m64nNk16 (N = the pass's 64 / 128 tokens) on both operands in shared memory, 128-byte swizzle, k in
// order (wgmma.cuh); on targets without wgmma they run the same tiles on mma.sync. Accumulation in fp32; every output
// element is written by one thread in a fixed order, and a token's result depends only on its own MMA
// column: deterministic whatever the order of items or of tokens within a pass.
//
// Shape constraints (checked at the op boundary, csrc/experts_cuda.cpp): H and I multiples of 64, E <= 512, 16-byte
// aligned tensors, bf16 or fp16. ids outside [0, E] are treated like the sentinel (can't be checked without a sync).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <mutex>
#include <set>
#include <string>

#include "base_moe/checks.h"
#include "base_moe/experts_mma.cuh"
#include "base_moe/experts_ws.h"
#include "base_moe/launch.cuh"
#include "base_moe/routing.h"
#include "base_moe/wgmma.cuh"

namespace base_moe {
namespace {

using namespace experts_detail;

constexpr int KS = 64;          // k elements per pipeline stage
constexpr int ROW_BYTES = 128;  // KS * 2 bytes: one stage row in shared memory
constexpr int kMaxE = 512;

struct GemmParams {
  const int32_t* ids;      // [T*k]
  const float* weights;    // [T*k]
  int tk;                  // T * k
  int top_k;
  int num_experts;
  const void* w;           // expert weights [E, R, K]
  int64_t w_expert_stride; // R * K elements
  int K;                   // reduction length (H for gate_up, I for down)
  int up_row_offset;       // gated: row of the first up row (I)
  const void* b;           // gated: hidden [T, K]; else act [T*k, K]
  void* out;               // gated: act [T*k, I]; else yslot [T*k, H] (both in the input dtype)
  int out_stride;
  int pass_splits;         // CTAs per (row tile, expert), each taking every pass_splits-th pass; set by the launcher
};

// Byte offset of 16-byte chunk `ch` (0..7) of stage row `r`: odd rows swap halves so that the 8 lanes of a
// quarter warp (two rows x 64 bytes) hit all 32 banks.
__device__ __forceinline__ uint32_t swz(int r, int ch) { return r * ROW_BYTES + ((ch ^ ((r & 1) << 2)) << 4); }

// One work item of expert_gemm_kernel: output rows [tile * ROWS_out, (tile + 1) * ROWS_out) of expert u, whose
// tokens start at expert-sorted position off, in passes of NP tokens. GATED: gate_up GEMM + SiLU * up (ROWS = gate
// rows + up rows, half each; ROWS_out = ROWS / 2); else the down GEMM (ROWS_out = ROWS). The WARPS warps form a
// WR x WN grid: warp (wr, wn) covers row group wr (gated: the same share of the gate rows and of the up rows, so
// each warp's epilogue pairs its own gate and up accumulators) and the n-tiles of 8 tokens j with j % WN == wn:
// NP = WN * NTW * 8 tokens per pass. More row groups read the token rows (from L2) once for more weight rows.
// WG (wgmma, one warpgroup: WARPS = WR = 4, ROWS = 128): the tile is two 64-row wgmma blocks (gated: the 64 gate
// rows, then the 64 up rows) times the pass's NP tokens, both operands read from shared memory in the 128-byte swizzle;
// warp w holds rows 16w..16w+15 of each block, for every token (the m16n8 accumulator layout per 8 tokens).
template <typename T, bool GATED, int ROWS, int NTW, int WARPS, int STAGES, int WR, bool WG>
__device__ __forceinline__ void expert_item(const GemmParams& p, uint8_t* smem, int* s_list, float* s_weight,
                                            int* s_scan, int u, int off, int tile, int first_pass, int pass_step) {
  constexpr int NT = WARPS * 32;
  constexpr int WN = WARPS / WR;
  constexpr int NP = WN * NTW * 8;
  constexpr int RTW = ROWS / 16 / WR;  // 16-row MMA tiles per warp
  // Gated tiles: the warp's gate tiles, then as many up tiles (HALF each); or, with one 16-row tile per warp
  // (interleaved, IL), rows 0-7 of the tile gate rows and 8-15 the matching up rows, so that each thread's two
  // accumulator rows (g, g + 8) are a gate / up pair.
  constexpr bool IL = GATED && RTW == 1;
  constexpr int HALF = RTW / 2;
  static_assert(WARPS % WR == 0 && ROWS % (16 * WR) == 0 && (!GATED || RTW % 2 == 0 || IL),
                "row groups must tile ROWS");
  static_assert(!WG || (WARPS == 4 && WR == 4 && ROWS == 128 && (NP == 64 || NP == 128)), "wgmma tile shape");
  constexpr int A_BYTES = ROWS * ROW_BYTES;
  constexpr int STAGE_BYTES = (ROWS + NP) * ROW_BYTES;
  constexpr int A_PER_THREAD = ROWS * 8 / NT;
  constexpr int B_PER_THREAD = (NP * 8 + NT - 1) / NT;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wr = warp / WN, wn = warp % WN;
  const int g = lane >> 2, q = lane & 3;
  // first stage row of the warp's MMA tile rt
  auto tile_row = [&](int rt) {
    if constexpr (IL)
      return wr * 16;
    else if constexpr (GATED)
      return (rt < HALF ? 0 : ROWS / 2) + wr * (ROWS / 2 / WR) + (rt % HALF) * 16;
    else if constexpr (WG)
      return rt * 64 + wr * 16;
    else
      return wr * (ROWS / WR) + rt * 16;
  };
  auto stage_offset = [](int r, int ch) { return WG ? swz128(r, ch) : swz(r, ch); };
  const int* s_cnt = reinterpret_cast<const int*>(smem + STAGES * STAGE_BYTES);
  const int cnt = s_cnt[u];

  const T* wexp = static_cast<const T*>(p.w) + static_cast<int64_t>(u) * p.w_expert_stride;
  const int row0 = tile * (GATED ? ROWS / 2 : ROWS);
  const int K = p.K;
  const int nk = K / KS;
  uint64_t policy = 0;  // the kernels with row groups do not use it (cp_async16_nohint)
  if constexpr (WR == 1) policy = evict_first_policy();
  const uint32_t smem0 = smem_addr(smem);

  // This thread's chunks of a stage, A and B alike: chunk tid % 8 of rows tid / 8 + i * ROW_STEP. The swizzles
  // depend on the row's low three bits only, so chunk i's shared-memory offset is chunk 0's + i * ROW_STEP rows (an
  // immediate), and the global pointers step by KS per k step: the k loop spends few instructions on addresses.
  constexpr int ROW_STEP = NT / 8;
  static_assert(NT % 8 == 0 && ROW_STEP % 8 == 0, "chunk rows must keep the swizzle phase");
  const uint32_t chunk_dst = stage_offset(tid >> 3, tid & 7);
  // this thread's A chunks: row pointers, advanced by KS per k step issued
  const T* a_src[A_PER_THREAD];
#pragma unroll
  for (int i = 0; i < A_PER_THREAD; ++i) {
    const int c = tid + i * NT, r = c >> 3, ch = c & 7;
    int grow = row0 + r;
    if (IL) grow = ((r & 8) ? p.up_row_offset : 0) + row0 + (r >> 4) * 8 + (r & 7);
    else if (GATED && r >= ROWS / 2) grow = p.up_row_offset + row0 + (r - ROWS / 2);
    a_src[i] = wexp + static_cast<int64_t>(grow) * K + ch * 8;
  }
  // the k steps are issued in order, each once
  auto load_a = [&](int slot) {
    const uint32_t dst = smem0 + slot * STAGE_BYTES + chunk_dst;
#pragma unroll
    for (int i = 0; i < A_PER_THREAD; ++i) {
      if constexpr (WR == 1) cp_async16_stream(dst + i * ROW_STEP * ROW_BYTES, a_src[i], policy);
      else cp_async16_nohint(dst + i * ROW_STEP * ROW_BYTES, a_src[i]);
      a_src[i] += KS;
    }
  };

  for (int c0 = first_pass * NP; c0 < cnt; c0 += pass_step * NP) {
    const int nv = min(NP, cnt - c0);  // tokens in this pass
    const int nv8 = (nv + 7) & ~7;

    // weights first: the down GEMM issues them before its PDL wait, while gate_up finishes (gate_up has waited
    // for the selection at its start)
#pragma unroll 1
    for (int s = 0; s < STAGES - 1; ++s)
      if (s < nk) load_a(s);

    // this pass's (token, slot) pairs of expert u, in token order
    {
      const int per = (p.tk + NT - 1) / NT;
      const int i0 = min(tid * per, p.tk), i1 = min(i0 + per, p.tk);
      int m = 0;
      for (int i = i0; i < i1; ++i) m += p.ids[i] == u;
      int total;
      int r = block_exclusive_scan<WARPS>(m, s_scan, total);
      for (int i = i0; i < i1 && r < c0 + nv; ++i) {
        if (p.ids[i] == u) {
          if (r >= c0) s_list[r - c0] = i;
          ++r;
        }
      }
    }
    __syncthreads();

    if (!GATED) cuda::pdl_wait();  // act comes from the gate_up kernel

    // this thread's B chunks (token rows), advanced like A's
    const T* b_src[B_PER_THREAD];
    bool b_valid[B_PER_THREAD], b_live[B_PER_THREAD];
#pragma unroll
    for (int i = 0; i < B_PER_THREAD; ++i) {
      const int c = tid + i * NT, r = c >> 3, ch = c & 7;
      b_live[i] = c < NP * 8 && r < nv8;
      b_valid[i] = b_live[i] && r < nv;
      const T* base = static_cast<const T*>(p.b);
      int64_t row = 0;
      if (b_valid[i]) row = GATED ? s_list[r] / p.top_k : off + c0 + r;
      b_src[i] = base + row * K + ch * 8;
    }
    auto load_b = [&](int slot) {
      const uint32_t dst = smem0 + slot * STAGE_BYTES + A_BYTES + chunk_dst;
#pragma unroll
      for (int i = 0; i < B_PER_THREAD; ++i) {
        if (b_live[i]) cp_async16_zfill(dst + i * ROW_STEP * ROW_BYTES, b_src[i], b_valid[i]);
        b_src[i] += KS;
      }
    };
#pragma unroll 1
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < nk) load_b(s);
      cp_async_commit();
    }
    // The down GEMM's routing weights of this pass's tokens, for the epilogue, loaded while the first stages are in
    // flight (the k loop's barriers publish them: nk >= 1, as the op's H and I are positive multiples of 64).
    // Loaded in the epilogue itself, after stores to y that might alias p.weights for all the compiler knows, they
    // cost one memory round trip per token (session 13: b256/M8 -6 us).
    if constexpr (!GATED)
      for (int t = tid; t < nv; t += NT) s_weight[t] = p.weights[s_list[t]];

    float acc[RTW][NTW][4];
#pragma unroll
    for (int r = 0; r < RTW; ++r)
#pragma unroll
      for (int j = 0; j < NTW; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][j][e] = 0.f;

    const bool warp_has_tokens = wn * 8 < nv;

#pragma unroll 1
    for (int ks = 0; ks < nk; ++ks) {
      cp_async_wait<STAGES - 2>();
      if constexpr (WG) fence_proxy_async_shared();  // the cp.async data, for wgmma's async-proxy reads
      __syncthreads();
      {
        const int nx = ks + STAGES - 1;
        if (nx < nk) {
          load_a(nx % STAGES);
          load_b(nx % STAGES);
        }
        cp_async_commit();
      }
      if constexpr (WG) {
        const uint32_t sa = smem0 + (ks % STAGES) * STAGE_BYTES;
        const uint32_t sb = sa + A_BYTES;
        const uint64_t da = wgmma_desc(sa), db = wgmma_desc(sb);  // the stage's; the others advance from them
        fence_registers<RTW * NTW * 4>(&acc[0][0][0]);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < KS / 16; ++kk) {
#pragma unroll
          for (int rt = 0; rt < RTW; ++rt)
            wgmma_m64k16<T, NP>(&acc[rt][0][0], wgmma_desc_advance(da, rt * 64 * ROW_BYTES + kk * 32),
                                wgmma_desc_advance(db, kk * 32));
        }
        wgmma_commit();
        // Complete before the next barrier: this stage's slot is refilled right after it (next step's loads).
        wgmma_wait_all();
        fence_registers<RTW * NTW * 4>(&acc[0][0][0]);
      } else if (warp_has_tokens) {
        const uint32_t sa = smem0 + (ks % STAGES) * STAGE_BYTES;
        const uint32_t sb = sa + A_BYTES;
#pragma unroll
        for (int kc = 0; kc < KS / 32; ++kc) {
          const int ch = kc * 4 + q;
          uint4 bf[NTW];
#pragma unroll
          for (int j = 0; j < NTW; ++j) {
            const int nt = wn + j * WN;
            if (nt * 8 < nv) bf[j] = lds128(sb + swz(nt * 8 + g, ch));
          }
#pragma unroll
          for (int rt = 0; rt < RTW; ++rt) {
            const uint4 lo = lds128(sa + swz(tile_row(rt) + g, ch));
            const uint4 hi = lds128(sa + swz(tile_row(rt) + g + 8, ch));
#pragma unroll
            for (int j = 0; j < NTW; ++j) {
              const int nt = wn + j * WN;
              if (nt * 8 < nv) {
                cuda::mma_16816<T>(acc[rt][j], lo.x, hi.x, lo.y, hi.y, bf[j].x, bf[j].y);
                cuda::mma_16816<T>(acc[rt][j], lo.z, hi.z, lo.w, hi.w, bf[j].z, bf[j].w);
              }
            }
          }
        }
      }
    }

    // ---- epilogue: accumulator (row g [+8], tokens 2q, 2q+1) ---------------------------------------------
    if (warp_has_tokens) {
      if constexpr (GATED) {
        // SiLU(gate) * up of every pair first, in place of the gate value, for every column (those past the pass's
        // tokens are never stored): one branch-free block, so the thread's 16-64 values interleave
#pragma unroll
        for (int j = 0; j < NTW; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            if constexpr (IL) acc[0][j][e] = silu_mul(acc[0][j][e], acc[0][j][2 + e]);
#pragma unroll
            for (int rt = 0; rt < HALF; ++rt)
#pragma unroll
              for (int h = 0; h < 2; ++h)
                acc[rt][j][2 * h + e] = silu_mul(acc[rt][j][2 * h + e], acc[rt + HALF][j][2 * h + e]);
          }
      }
#pragma unroll
      for (int j = 0; j < NTW; ++j) {
        const int nt = wn + j * WN;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = nt * 8 + 2 * q + e;
          if (tok >= nv) continue;
          if constexpr (GATED) {
            T* act = static_cast<T*>(p.out) + static_cast<int64_t>(off + c0 + tok) * p.out_stride + row0;
            if constexpr (IL) act[wr * 8 + g] = from_float<T>(acc[0][j][e]);
#pragma unroll
            for (int rt = 0; rt < HALF; ++rt) {
#pragma unroll
              for (int h = 0; h < 2; ++h) act[tile_row(rt) + g + 8 * h] = from_float<T>(acc[rt][j][2 * h + e]);
            }
          } else {
            T* y = static_cast<T*>(p.out) + static_cast<int64_t>(s_list[tok]) * p.out_stride + row0;
            const float wv = s_weight[tok];  // once: a store to y might alias shared memory, for all the compiler knows
#pragma unroll
            for (int rt = 0; rt < RTW; ++rt) {
#pragma unroll
              for (int h = 0; h < 2; ++h) y[tile_row(rt) + g + 8 * h] = from_float<T>(wv * acc[rt][j][2 * h + e]);
            }
          }
        }
      }
    }
    __syncthreads();  // s_list and the stages are reused by the next pass
#pragma unroll
    for (int i = 0; i < A_PER_THREAD; ++i) a_src[i] -= nk * KS;  // the next pass streams the tile from its start
  }
}


// CTA (x, y) computes row tile x of the active experts y, y + gridDim.y, ... (in ascending expert order). The
// grid has min(E, T*k, max_active_experts) rows: with the caller's bound on the active experts (a budget), no CTA is
// spent on experts no token uses; more active experts than rows are still all computed.
template <typename T, bool GATED, int ROWS, int NTW, int WARPS, int STAGES, int WR, bool WG>
__global__ void __launch_bounds__(WARPS * 32) expert_gemm_kernel(const GemmParams p) {
  constexpr int NT = WARPS * 32;
  constexpr int NP = WARPS / WR * NTW * 8;
  constexpr int STAGE_BYTES = (ROWS + NP) * ROW_BYTES;
  static_assert(ROWS * 8 % NT == 0, "A tile must split evenly over the threads");
  static_assert(!GATED || ROWS % 32 == 0, "gated tiles hold as many gate rows as up rows");

  extern __shared__ __align__(128) uint8_t smem_raw[];
  // wgmma's 128-byte swizzle needs 1024-byte aligned tiles (the launch adds 1 KB for this)
  uint8_t* smem = WG ? smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023) : smem_raw;
  int* s_cnt = reinterpret_cast<int*>(smem + STAGES * STAGE_BYTES);  // [kMaxE] tokens per expert
  int* s_list = s_cnt + kMaxE;                                      // [NP] flat (t*k+j) of this pass's tokens
  int* s_active = s_list + NP;                                      // [kMaxE] active experts, ascending
  int* s_offset = s_active + kMaxE;                                 // [kMaxE] their first expert-sorted position
  float* s_weight = reinterpret_cast<float*>(s_offset + kMaxE);     // [NP] down: the pass's routing weights
  __shared__ int s_scan[WARPS];
  __shared__ int s_num_active;

  const int tid = threadIdx.x;
  const int E = p.num_experts;

  // gate_up starts while the selection kernel finishes (programmatic dependent launch): wait for it before reading
  // ids, weights or hidden states, and only then let the down kernel start, so that the down kernel, which reads the
  // ids before its own wait, never runs ahead of the selection.
  if constexpr (GATED) cuda::pdl_wait();
  cuda::pdl_launch_dependents();  // the next kernel may be scheduled once all our CTAs are

  // ---- routing: count the ids, list the active experts and their offsets in expert-sorted order ----------
  for (int e = tid; e < E; e += NT) s_cnt[e] = 0;
  __syncthreads();
  for (int i = tid; i < p.tk; i += NT) {
    const int u = p.ids[i];
    if (static_cast<unsigned>(u) < static_cast<unsigned>(E)) atomicAdd(&s_cnt[u], 1);
  }
  __syncthreads();
  {
    const int per = (E + NT - 1) / NT;
    const int e0 = min(tid * per, E), e1 = min(e0 + per, E);
    int n_active = 0, n_tok = 0;
    for (int e = e0; e < e1; ++e) {
      n_active += s_cnt[e] > 0;
      n_tok += s_cnt[e];
    }
    int total;
    int active_before = block_exclusive_scan<WARPS>(n_active, s_scan, total);
    if (tid == 0) s_num_active = total;
    int tok_before = block_exclusive_scan<WARPS>(n_tok, s_scan, total);
    for (int e = e0; e < e1; ++e) {
      if (s_cnt[e] > 0) {
        s_active[active_before] = e;
        s_offset[active_before] = tok_before;
        ++active_before;
        tok_before += s_cnt[e];
      }
    }
  }
  __syncthreads();

#pragma unroll 1
  for (int a = blockIdx.y; a < s_num_active; a += gridDim.y) {
    expert_item<T, GATED, ROWS, NTW, WARPS, STAGES, WR, WG && kWgmmaCompiled>(
        p, smem, s_list, s_weight, s_scan, s_active[a], s_offset[a], blockIdx.x / p.pass_splits,
        blockIdx.x % p.pass_splits, p.pass_splits);
  }
}

// y[t, h..h+8) = sum in fp32 over slots j (in order) of yslot[t*k + j, h..h+8), skipping sentinel slots;
// top_k <= KMAX.
template <typename T, int KMAX>
__global__ void __launch_bounds__(256) slot_sum_kernel(const int32_t* __restrict__ ids,
                                                       const T* __restrict__ yslot, T* __restrict__ y,
                                                       int tokens, int top_k, int num_experts, int H) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int h8 = H / 8;
  if (idx >= static_cast<int64_t>(tokens) * h8) return;
  const int t = static_cast<int>(idx / h8), h = static_cast<int>(idx % h8) * 8;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  cuda::pdl_wait();
  // The next kernel may be scheduled while the sum runs (it reads y only after its own griddepcontrol.wait, which
  // waits for this whole grid): the next layer's router_predict copies its weights meanwhile. Not before the wait:
  // the down GEMM triggers at its start, so a dependent launched then would hold SM slots for the whole GEMM.
  cuda::pdl_launch_dependents();
  // Every slot's row is loaded at once (rows of empty slots exist, unwritten): no load waits for the previous id.
  // An empty slot adds +0, which leaves the sum's bits unchanged (a sum that starts at +0 is never -0), so the
  // result equals skipping it.
  uint4 row[KMAX];
#pragma unroll
  for (int j = 0; j < KMAX; ++j) {
    if (j < top_k) row[j] = *reinterpret_cast<const uint4*>(yslot + (static_cast<int64_t>(t) * top_k + j) * H + h);
  }
#pragma unroll
  for (int j = 0; j < KMAX; ++j) {
    if (j < top_k) {
      const bool used = static_cast<unsigned>(ids[t * top_k + j]) < static_cast<unsigned>(num_experts);
      const T* v = reinterpret_cast<const T*>(&row[j]);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += used ? cuda::to_float(v[i]) : 0.f;
    }
  }
  alignas(16) T out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = from_float<T>(acc[i]);
  *reinterpret_cast<uint4*>(y + static_cast<int64_t>(t) * H + h) = *reinterpret_cast<const uint4*>(out);
}

// ---- host side ------------------------------------------------------------------------------------------
// CTAs that split an expert's passes over its tokens: split z takes passes z, z + splits, ... An expert whose
// tokens need two passes would otherwise stream its weights twice in a row on one CTA (the busiest expert of a batch
// sets the kernel's time); side by side, the CTAs read the same tiles at about the same time, mostly one HBM read.
// busiest_expert: the host's estimate of the busiest expert's tokens (see experts_cuda_launch); one split per pass
// it needs, at most 4. Each output element is still computed by one CTA in the same order (same bits).
// BASE_MOE_EXPERTS_SPLITS=N (1 to 8) forces N (benchmarks).
int pass_splits(int64_t busiest_expert, int tokens_per_pass) {
  const char* forced = std::getenv("BASE_MOE_EXPERTS_SPLITS");
  if (forced != nullptr) {
    const int n = std::atoi(forced);
    if (n >= 1 && n <= 8) return n;
    TORCH_WARN_ONCE("BASE_MOE_EXPERTS_SPLITS=", forced, " is not a number from 1 to 8: ignored");
  }
  return static_cast<int>(std::clamp<int64_t>((busiest_expert + tokens_per_pass - 1) / tokens_per_pass, 1, 4));
}

// The current device's SMs (PyTorch caches the device properties).
int multiprocessors() {
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

// One expert GEMM instance, ready to launch on the current device: its dynamic shared memory and how many of its CTAs
// fit on the device at once (resident CTAs per SM x SMs), both found once per device.
template <typename T, bool GATED, int ROWS, int NTW, int WARPS, int STAGES, int WR, bool WG>
struct GemmKernel {
  static constexpr int NP = WARPS / WR * NTW * 8;
  // stages, then counts [kMaxE], the pass's token list [NP], active experts and their offsets [2 kMaxE], the pass's
  // routing weights [NP]
  static constexpr size_t smem =
      STAGES * (ROWS + NP) * ROW_BYTES + (3 * kMaxE + NP) * sizeof(int) + NP * sizeof(float) + (WG ? 1024 : 0);
  static constexpr auto kernel = expert_gemm_kernel<T, GATED, ROWS, NTW, WARPS, STAGES, WR, WG>;

  // Sets the shared-memory attribute (it belongs to each device's copy of the kernel; two threads may both set it,
  // which is harmless; none launches before it is set) and returns the resident CTAs of one wave.
  static int prepare() {
    constexpr int kMaxDevices = 64;
    static std::atomic<int> wave[kMaxDevices];
    int device = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    if (device < kMaxDevices) {
      const int known = wave[device].load(std::memory_order_acquire);
      if (known > 0) return known;
    }
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int per_sm = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, WARPS * 32, smem));
    const int ctas = std::max(1, per_sm * multiprocessors());
    if (device < kMaxDevices) wave[device].store(ctas, std::memory_order_release);
    return ctas;
  }

  // Whether one CTA fits `limit` bytes of shared memory (shared_memory_limit), its static shared memory included.
  static bool fits(size_t limit) {
    static const size_t static_bytes = [] {
      cudaFuncAttributes attributes{};
      C10_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
      return attributes.sharedSizeBytes;
    }();
    return smem + static_bytes <= limit;
  }

  // The CTAs of a launch over row_tiles x grid_experts (launch_gemm's grid: each row tile split over its passes).
  static int64_t ctas(int row_tiles, int grid_experts, int64_t busiest_expert) {
    return static_cast<int64_t>(row_tiles) * pass_splits(busiest_expert, NP) * grid_experts;
  }
};

template <typename T, bool GATED, int ROWS, int NTW, int WARPS, int STAGES, int WR, bool WG = false>
void launch_gemm(const GemmParams& p, int row_tiles, int grid_experts, int64_t busiest_expert, cudaStream_t stream,
                 bool pdl) {
  using G = GemmKernel<T, GATED, ROWS, NTW, WARPS, STAGES, WR, WG>;
  G::prepare();
  // The splits of a row tile are neighbours in x, so the hardware dispatches an expert's passes together (all first
  // passes before any second one would run them one after the other again once the grid exceeds the resident CTAs).
  GemmParams q = p;
  q.pass_splits = pass_splits(busiest_expert, G::NP);
  cuda::launch({dim3(row_tiles * q.pass_splits, grid_experts), dim3(WARPS * 32), G::smem, stream, 0, pdl}, G::kernel,
               q);
}

// launch_gemm with STAGES while the grid fits one wave of resident CTAs, with FEW_STAGES past it where those fit more
// CTAs per SM: deeper rings keep more weight bytes in flight per CTA, which decides the time of a single wave, but
// past one wave the partial last wave decides it, and more resident CTAs shorten it. Also with FEW_STAGES wherever
// STAGES do not fit smem_limit: T32's 5 stages take 106 KiB and W64's 4 103.5 KiB, so GPUs with 99 KiB per CTA (sm_86
// / sm_89 / sm_120) run their 3 and 2. H200, Qwen3 shape
// (device_runs/session9.txt): T16 at 5 vs 3 stages (2 vs 3 CTAs per SM): b1 27.9 vs 30.9 us and b16/M16 45.9 vs
// 46.5 within one wave; b16/M32 87.1 vs 80.5, b4 dense 80.6 vs 74.7, b64/M64 159.9 vs 155.7 past it. W64 at 4 vs 2
// stages (2 vs 3 per SM) past one wave: b64/M32 93.9 vs 86.0, b256/M16 105.9 vs 95.7, b256/M64 192.8 vs 189.2; T32
// at 5 vs 3: b256 dense 353.0 vs 338.9. (W128's 255 registers per thread allow 2 CTAs per SM at any stage count.)
// The grid counts every CTA the bound on active experts allows (those of inactive experts exit at once): the host's
// estimate without a sync.
template <typename T, bool GATED, int ROWS, int NTW, int WARPS, int STAGES, int FEW_STAGES, int WR, bool WG = false>
void launch_gemm_by_waves(const GemmParams& p, int row_tiles, int grid_experts, int64_t busiest_expert,
                          cudaStream_t stream, bool pdl, size_t smem_limit) {
  if constexpr (FEW_STAGES != STAGES) {
    using G = GemmKernel<T, GATED, ROWS, NTW, WARPS, STAGES, WR, WG>;
    using Few = GemmKernel<T, GATED, ROWS, NTW, WARPS, FEW_STAGES, WR, WG>;
    bool few = !G::fits(smem_limit);
    if (!few) {
      const int wave = G::prepare();
      few = G::ctas(row_tiles, grid_experts, busiest_expert) > wave && Few::prepare() > wave;
    }
    if (few) {
      launch_gemm<T, GATED, ROWS, NTW, WARPS, FEW_STAGES, WR, WG>(p, row_tiles, grid_experts, busiest_expert, stream,
                                                                  pdl);
      return;
    }
  }
  launch_gemm<T, GATED, ROWS, NTW, WARPS, STAGES, WR, WG>(p, row_tiles, grid_experts, busiest_expert, stream, pdl);
}

// Warns that `knob`'s `value` is not `expected` and is ignored: once per knob and process (TORCH_WARN_ONCE would warn
// once for all the knobs of its call site).
void warn_ignored_knob(const char* knob, const char* value, const std::string& expected) {
  static std::mutex mutex;
  static std::set<std::string> warned;
  const std::lock_guard<std::mutex> lock(mutex);
  if (warned.insert(knob).second) TORCH_WARN(knob, "=", value, " is not ", expected, ": ignored");
}

// A benchmark knob that names one of `choices`: the index of the one it names, or -1 where it is unset or names none
// (with a warning: warn_ignored_knob).
int forced_choice(const char* knob, std::initializer_list<const char*> choices) {
  const char* value = std::getenv(knob);
  if (value == nullptr) return -1;
  int index = 0;
  for (const char* choice : choices) {
    if (!std::strcmp(value, choice)) return index;
    ++index;
  }
  std::string names;
  for (const char* choice : choices) names += (names.empty() ? "" : ", ") + std::string(choice);
  warn_ignored_knob(knob, value, "one of " + names);
  return -1;
}

// The shared memory one CTA may take on the current device (PyTorch caches the device properties): its opt-in limit
// (227 KiB on H100 / H200, 163 on A100, 99 on sm_86 / sm_89 / sm_120), or less where BASE_MOE_EXPERTS_SMEM_KIB caps
// it (tests run the 99 KiB fallbacks on an H100; read per op call like the other knobs). A cap below 99 KiB, the
// least of any device the kernels run on (sm_80 and later), is ignored with a warning: T16 needs 96 KiB.
size_t shared_memory_limit() {
  constexpr long kLeastKiB = 99;
  const size_t optin = at::cuda::getCurrentDeviceProperties()->sharedMemPerBlockOptin;
  const char* knob = "BASE_MOE_EXPERTS_SMEM_KIB";
  const char* value = std::getenv(knob);
  if (value == nullptr) return optin;
  char* end = nullptr;
  const long kib = std::strtol(value, &end, 10);
  if (end == value || *end != '\0' || kib < kLeastKiB) {
    warn_ignored_knob(knob, value, "a whole number of KiB of at least 99");
    return optin;
  }
  return std::min(optin, static_cast<size_t>(kib) * 1024);
}

// Tile configurations, named by the tokens of one expert that a CTA takes per pass over its weights: T16 / T32 on
// mma.sync (m16n8k16, tokens as the narrow n side), W64 / W128 on wgmma (m64nNk16, tokens as N); WS, the
// warp-specialised persistent GEMMs of csrc/experts_ws.cu (64-160 token columns per work item, TMA; sm_90a code
// only). Picked on the host (pick_config); BASE_MOE_EXPERTS_CONFIG=T16|T32|W64|W128|WS forces one (a
// process-wide setting, so the choice is graph-safe).
enum class Config { kT16, kT32, kW64, kW128, kWS };

// T: tokens of the batch (no expert gets more unless a token lists it twice); tokens_per_expert: T * k over the most
// experts that can be active (min(E, T * k, max_active_experts)), the average load per active expert when no slot is
// empty and the bound is exact (empty slots or a loose bound make it an overestimate): the best the host knows
// without a sync.
// The cp.async configuration for this load; also where WS is picked or forced but cannot run (see pick_config).
Config cp_async_config(int64_t T, int64_t tokens_per_expert) {
  // Measured on the H200 at every batch x budget point of bench_layer.py (bench_layer_configs.json, session 4;
  // bench_layer_wgmma_sweep.json, session 5; notes/experts_kernel.md): a pass that holds an expert's busiest token
  // count avoids re-reading its weights, but wider passes keep fewer weight bytes in flight per shared-memory byte. T16
  // whenever no expert can exceed 16 tokens or the average is at most 8 (b16/M8 28.9 us vs T32 31.3, b16 dense 185, b64
  // dense 295); T32 at 16 per expert in batches of more than 64 tokens, where experts exceed 16 tokens by chance (b256
  // dense 344 vs W64 352); W64 in batches of 17-64 tokens (b64/M16 50.5 vs T32 79, b64/M8 38.3 vs W128 45.7; b64/M32
  // 94.3 vs T32 101.7, session 7) and up to 56 per expert beyond (b256/M64 193 vs W128 213; device_runs/session20.txt
  // call 5, W64 vs W128: Qwen3 b256/M56 (36 per expert) 170.9 vs 183.7, M48 (42) 161.6 vs 166.9, M40 (51) 122.5 vs
  // 134.8, b128/M24 (42) 77.6 vs 95.5, b512/M96 (42) 347.5 vs 379.9; OLMoE b256/M56 214.7 vs 244.1, M40 174.6 vs
  // 175.8); past 56 per expert, with an expert's passes split over CTAs (pass_splits; session 7,
  // BASE_MOE_EXPERTS_SPLITS sweeps in benchmarks/results/device_runs/session7.txt): W128 at up to 64 per expert
  // (b256/M32 130 vs W64 in two splits 140; 115.3 vs 132.5 in session 20), W64 at 121-128 (b256/M16: three 64-token
  // splits 105.6 vs W128 113-118 with or without splits; 87.8 vs 96.3 in session 17, call 7), W128 beyond (b256/M8: two
  // 128-token splits 67 vs W64 in four 88, W128 unsplit 111). W128 also at 65-120 (notes/ws_window.py,
  // device_runs/session17.txt calls 7-8; us, W128 vs W64): Qwen3 b256/M18 (113 per expert) 77.6 vs 87.4, M20 (102) 81.8
  // vs 93.8, M22 (93) 87.0 vs 97.9, M24 (85) 109.6 vs 122.6; OLMoE b256/M18 113.9 vs 127.9, M20 116.0 vs 135.5, M24
  // 121.1 vs 141.1.
  if (T <= 16 || tokens_per_expert <= 8) return Config::kT16;
  if (T <= 64) return Config::kW64;
  if (tokens_per_expert <= 16) return Config::kT32;
  if (tokens_per_expert <= 56) return Config::kW64;
  if (tokens_per_expert <= 120) return Config::kW128;
  if (tokens_per_expert <= 128) return Config::kW64;
  return Config::kW128;
}

// BASE_MOE_EXPERTS_CONFIG's choice (benchmarks and tests): an index into pick_config's kConfigs, or -1 where unset.
int forced_config() { return forced_choice("BASE_MOE_EXPERTS_CONFIG", {"T16", "T32", "W64", "W128", "WS"}); }

// WS's token columns per work item (its wgmma's N), in the order of BASE_MOE_WS_N's names.
constexpr int kWsColumns[] = {64, 80, 128, 160};
constexpr int kWsMaxColumns = kWsColumns[std::size(kWsColumns) - 1];

// The WS token columns measured best for this load (active_experts: the bound tokens_per_expert divides by), or 0
// where a cp.async configuration is faster. Only where WS's items fill the SMs' last round to at least 65%
// (experts_ws_round_fill). 160 columns where experts average 97-150 tokens, so that each fits one item with little
// padding. H200 (device_runs/session17.txt, calls 1-3 and 7-8; us, WS vs the best cp.async configuration): Qwen3
// b256/M14 (146 per expert) 75.7 vs 88.6, M16 (128) 76.8 vs 87.6, b512/M28 / M32 / M40 142.9 / 144.4 / 178.0 vs 211.2
// / 180.5 / 188.0; OLMoE (I 1024: 11 gate_up tiles) b256/M16 (176 items, 67% of the last round) 103.6 vs 107.4, M18
// 112.6 vs 113.9, b512/M32 183.1 vs 230.6. Slower at 157 per expert (Qwen3 b256/M13: some experts take two items,
// 101.2 vs 86.5), at 93 (M22 105.6 vs 86.7: padding), and where the items leave more SMs idle (Qwen3 b256/M18 and M20,
// 144 and 160 gate_up items on 132 SMs, 55% and 61% of the last round: 106.9 / 105.8 vs 77.2 / 81.2; b128/M8, 64
// items: 51.1 vs 38.9; OLMoE b256/M14, 58%: 104.7 vs 103.5).
// 64 or 128 columns at 32-96 per expert (64 at 32-56, 128 at 81-96; 57-80 takes 80, below), first (session 20) in
// batches of 512 tokens or more, where 160-column items are mostly padding (device_runs/session20.txt, call 5; us,
// WS-64 / WS-128 / the best cp.async configuration): Qwen3 b512/M128 (32 per expert) 339.3 / 373.6 / 419.6, M112 (36)
// 303.7 / 333.0 / 400.2, M96 (42) 269.5 / 293.8 / 347.5, M80 (51) 235.7 / 257.6 / 280.4, M64 (64) 249.8 / 214.0 /
// 258.9, M56 (73) 242.0 / 200.9 / 239.1, M48 (85) 213.5 / 173.7 / 216.5; OLMoE b512/M64 (64) 309.5 / 283.1 / 319.6, M48
// (85) 266.5 / 222.0 / 248.0. Then not in smaller batches, where fewer items make WS's rounds coarse and the wins and
// losses mix by model and load (b256: Qwen3 M48 (42) 143.7 / 156.8 / 161.6 and M24 (85) 111.2 / 99.0 / 108.4, but M44
// (46) 136.8 / 150.7 / 130.3, M22 (93) 107.2 / 97.9 / 86.3; OLMoE M64 (32) 237.9 / 265.6 / 219.8, M28 (73) 161.7 /
// 143.9 / 131.5; b128/M12 (85) 70.1 / 56.8 / 49.6).
// 80 columns at 57-80 per expert in batches of 256 or more: an expert's tokens are about Binomial(T, k / M), so at a
// mean of 64-73 most experts fit one 80-column item, where 128 columns are 43-50% padding and 64 split half or more
// of the experts in two (their weights stream twice). device_runs/session21.txt, call 1 (us, WS-80 / WS-128 / the
// default before): Qwen3 b256/M28 (73) 101.6 / 110.5 / 110.1, M32 (64) 108.1 / 119.9 / 115.6, b512/M56 (73) 189.0 /
// 201.9 / 204.0, M64 (64) 202.8 / 228.7 / 210.7; OLMoE b256/M32 (64) 134.8 / 149.0 / 139.4, b512/M64 (64) 260.3 / 281.7
// / 283.3, but b256/M28 (73) 134.1 / 144.1 / 132.1 (a 1.5% loss, taken for the rule's simplicity). Not at b128 (M16,
// 64 per expert: 59.2 vs 56.3) nor at 85 (Qwen3 b256/M24 116.9 vs 109.8).
// Since WS's down epilogue reads its items' columns from shared memory (session 21), 64 and 128 columns also in
// batches of 256 (device_runs/session21.txt, call 5; us, WS at the rule's columns against the cp.async choice before):
// Qwen3 b256/M48-64 (32-42 per expert) WS-64 135.8-172.5 vs 160.7-180.4, M24 (85) WS-128 90.2 vs 109.5; OLMoE b256/M40
// -56 (36-51) WS-64 154.9-200.3 vs 173.7-208.6, M24 (85) WS-128 109.8 vs 118.9; within 2% either way at Qwen3
// b256/M36-44 (46-56) and M22 (93: 88.6 vs 86.8) and OLMoE b256/M64 (32: 225.8 vs 222.4). Against the rule before
// (device_runs/session22.txt, call 2): Qwen3 b256/M64 181.8 -> 170.8, b256/M8-32 and batch <= 64 within 0.4 us. Still
// not at b128.
int ws_columns_for(int64_t T, int64_t tokens_per_expert, int64_t active_experts, int64_t I, int64_t H, int sms) {
  if (T <= 64 || experts_ws_round_fill(active_experts, I, H, sms) < 0.65) return 0;
  if (tokens_per_expert > 96 && tokens_per_expert <= 150) return 160;
  if (T < 256 || tokens_per_expert < 32 || tokens_per_expert > 96) return 0;
  return tokens_per_expert <= 56 ? 64 : tokens_per_expert <= 80 ? 80 : 128;
}

struct Pick {
  Config config;
  int ws_columns;  // WS's token columns per work item, where config is kWS
};

// BASE_MOE_EXPERTS_CONFIG's choice, if set (benchmarks and tests), or else the configuration measured best for this
// load: WS where ws_columns_for gives its columns, a cp.async configuration otherwise. WS's columns wherever it runs:
// BASE_MOE_WS_N=64|80|128|160 if set (benchmarks and tests; with BASE_MOE_EXPERTS_CONFIG=WS at any load), else the
// rule's, else (WS forced where the rule takes none) 160.
Pick pick_config(int64_t T, int64_t tokens_per_expert, int64_t active_experts, int64_t I, int64_t H, int sms) {
  static constexpr Config kConfigs[] = {Config::kT16, Config::kT32, Config::kW64, Config::kW128, Config::kWS};
  const int forced = forced_config();
  const int forced_columns = forced_choice("BASE_MOE_WS_N", {"64", "80", "128", "160"});
  const int columns = ws_columns_for(T, tokens_per_expert, active_experts, I, H, sms);
  const int ws_columns = forced_columns >= 0 ? kWsColumns[forced_columns] : columns > 0 ? columns : kWsMaxColumns;
  if (forced >= 0) return {kConfigs[forced], ws_columns};
  return {columns > 0 ? Config::kWS : cp_async_config(T, tokens_per_expert), ws_columns};
}

// Programmatic dependent launch where the device code supports it (launch.cuh); BASE_MOE_EXPERTS_PDL=0 turns it off
// (benchmarks set it between calls, so it is read once per op call, not once per process).
bool use_pdl(int device) {
  return cuda::env_flag("BASE_MOE_EXPERTS_PDL", true) && cuda::device_has_clusters(device);
}

// gate_up's tile height: the configuration's ROWS (by waves) or ROWS / 2 (gate + up rows per CTA).
enum class GateUpTiles { kFull, kHalf };  // in the order of BASE_MOE_EXPERTS_GATE_UP_TILES's names

// gate_up then down with the same tile configuration (ROWS weight rows per CTA: ROWS / 2 gate + ROWS / 2 up rows for
// gate_up). When ROWS does not divide H (H is a multiple of 64), the down GEMM takes another configuration instead:
// 64-row tiles, 4 warps splitting 32 tokens per pass, 8 stages. The two GEMMs of the configuration run with
// FEW_STAGES where their grid exceeds one wave (launch_gemm_by_waves). HALF_TILES: where twice gate_up's CTAs fit
// one wave of a kernel with half the rows per tile, it runs in those tiles (each warp's 16 rows 8 gate + 8 up,
// interleaved): the weight stream spreads over more SMs, or over two or three CTAs of half the bytes per SM instead
// of one or two of the full bytes. H200, Qwen3 shape, T16, full -> half (device_runs/session10.txt, call 1): b1 26.8
// -> 26.1 us, b4/M8 28.3 -> 26.4, b16/M8 29.8 -> 27.7, b4/M16 42.4 -> 41.5, b16/M16 45.7 -> 44.4; past one wave
// half tiles lose to full ones at 3 stages, at 5 stages (b4/M32 60.8 vs 55.2) and at 3 (56.0-56.1 vs 55.3, b16/M32
// 80.3-80.4 vs 79.9; call 7). W64 at b64/M16 did not gain (session 9: 49.9 vs 50.0), so only T16 has
// them. Taller tiles at one CTA per SM with a deeper ring (192 rows, 8 stages) were slower at every point (b1 32.6,
// b16/M16 46.7; W64 at b64/M16 52.3 vs 50.0): the stream needs CTAs on every SM more than bytes in flight per CTA.
// The down GEMM in half tiles on the same rule gained at most 0.4 us (b1, b16/M8; call 2): not taken.
template <typename T, int ROWS, int NTW, int WARPS, int STAGES, int WR, bool WG = false, int FEW_STAGES = STAGES,
          bool HALF_TILES = false>
void launch_pair(const GemmParams& p1, const GemmParams& p2, int64_t I, int64_t H, int grid_experts,
                 int64_t busiest_expert, cudaStream_t stream, bool pdl, size_t smem_limit) {
  // BASE_MOE_EXPERTS_GATE_UP_TILES=full|half forces a height where the configuration has it (benchmarks); read per
  // op call like the other knobs, and for every configuration, so that a malformed value warns.
  const int forced = forced_choice("BASE_MOE_EXPERTS_GATE_UP_TILES", {"full", "half"});
  bool half = false;
  if constexpr (HALF_TILES) {
    using Half = GemmKernel<T, true, ROWS / 2, NTW, WARPS, STAGES, WR, WG>;
    const int half_row_tiles = static_cast<int>(I / (ROWS / 4));
    half = forced >= 0 ? forced == static_cast<int>(GateUpTiles::kHalf)
                       : Half::ctas(half_row_tiles, grid_experts, busiest_expert) <= Half::prepare();
    if (half)
      launch_gemm<T, true, ROWS / 2, NTW, WARPS, STAGES, WR, WG>(p1, half_row_tiles, grid_experts, busiest_expert,
                                                                stream, pdl);
  } else if (forced == static_cast<int>(GateUpTiles::kHalf)) {
    TORCH_WARN_ONCE("BASE_MOE_EXPERTS_GATE_UP_TILES=half: this tile configuration has no half tiles (only T16)");
  }
  if (!half)
    launch_gemm_by_waves<T, true, ROWS, NTW, WARPS, STAGES, FEW_STAGES, WR, WG>(p1, I / (ROWS / 2), grid_experts,
                                                                              busiest_expert, stream, pdl, smem_limit);
  if (H % ROWS == 0)
    launch_gemm_by_waves<T, false, ROWS, NTW, WARPS, STAGES, FEW_STAGES, WR, WG>(p2, H / ROWS, grid_experts,
                                                                               busiest_expert, stream, pdl, smem_limit);
  else if (GemmKernel<T, false, 64, 1, 4, 8, 1, false>::fits(smem_limit))
    launch_gemm<T, false, 64, 1, 4, 8, 1>(p2, H / 64, grid_experts, busiest_expert, stream, pdl);
  else  // GPUs with 99 KiB per CTA: 6 stages (78 KiB) for 8 (102 KiB)
    launch_gemm<T, false, 64, 1, 4, 6, 1>(p2, H / 64, grid_experts, busiest_expert, stream, pdl);
}

template <typename T>
void run_experts(const GemmParams& p1, const GemmParams& p2, int64_t I, int64_t H, int grid_experts,
                 int64_t busiest_expert, Config cfg, cudaStream_t stream, bool pdl, size_t smem_limit) {
  switch (cfg) {
    case Config::kT16:  // 128-row tiles, 4 warps, one row group each (16 gate + 16 up rows), 5 stages, 2 CTAs/SM;
                        // past one wave 3 stages, 3 CTAs/SM; gate_up in 64-row tiles where twice its CTAs fit one wave
      launch_pair<T, 128, 2, 4, 5, 4, false, 3, true>(p1, p2, I, H, grid_experts, busiest_expert, stream, pdl,
                                                      smem_limit);
      break;
    case Config::kT32:  // as T16 with 32 tokens per pass (and 3 stages past one wave)
      launch_pair<T, 128, 4, 4, 5, 4, false, 3>(p1, p2, I, H, grid_experts, busiest_expert, stream, pdl, smem_limit);
      break;
    case Config::kW128:  // wgmma: 128-row tiles, 128 tokens per pass, 3 stages, 2 CTAs/SM (at any stage count:
                         // its 255 registers per thread)
      if (GemmKernel<T, true, 128, 16, 4, 3, 4, true>::fits(smem_limit)) {
        launch_pair<T, 128, 16, 4, 3, 4, true>(p1, p2, I, H, grid_experts, busiest_expert, stream, pdl, smem_limit);
        break;
      }
      if (forced_config() == static_cast<int>(Config::kW128))
        TORCH_WARN_ONCE("BASE_MOE_EXPERTS_CONFIG=W128: needs 104 KiB of shared memory per CTA, more than this device "
                        "allows; ran W64");
      [[fallthrough]];  // W64 fits 99 KiB GPUs at 2 stages
    case Config::kW64:  // wgmma: 128-row tiles (two m64 blocks), 64 tokens per pass, 4 stages, 2 CTAs/SM; past
                        // one wave 2 stages, 4 CTAs/SM (<= 128 registers per thread)
      launch_pair<T, 128, 8, 4, 4, 4, true, 2>(p1, p2, I, H, grid_experts, busiest_expert, stream, pdl, smem_limit);
      break;
    case Config::kWS:  // unreachable: experts_cuda_launch runs WS itself, or a cp.async configuration instead
      break;
  }
}

// The slot sum with every slot's row loaded at once: KMAX = 8 covers most models (registers: one uint4 per slot).
template <typename T>
void launch_slot_sum(const int32_t* ids, const T* yslot, Tensor& y, int64_t T_, int64_t k, int64_t E, int64_t H,
                     cudaStream_t stream, bool pdl) {
  const int64_t n8 = T_ * (H / 8);
  const dim3 grid(static_cast<unsigned>((n8 + 255) / 256));
  auto kernel = k <= 8 ? slot_sum_kernel<T, 8> : slot_sum_kernel<T, kMaxTopK>;
  cuda::launch({grid, dim3(256), 0, stream, 0, pdl}, kernel, ids, yslot, static_cast<T*>(y.data_ptr()),
               static_cast<int>(T_), static_cast<int>(k), static_cast<int>(E), static_cast<int>(H));
}

}  // namespace

// Called by experts_cuda (csrc/experts_cuda.cpp) after every argument check: errors are raised from
// host-compiled code only (an exception thrown from this nvcc-compiled file crashed torch 2.11 on the device).
Tensor experts_cuda_launch(const Tensor& hidden, const Tensor& expert_ids, const Tensor& expert_weights,
                           const Tensor& gate_up_proj, const Tensor& down_proj, int64_t max_active_experts) {
  const int64_t T = hidden.size(0), H = hidden.size(1), k = expert_ids.size(1);
  const int64_t E = gate_up_proj.size(0), I = gate_up_proj.size(1) / 2;
  Tensor y = at::empty_like(hidden);
  if (T == 0) return y;

  const c10::cuda::CUDAGuard guard(hidden.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t tk = T * k;
  Tensor act = at::empty({tk, I}, hidden.options());
  Tensor yslot = at::empty({tk, H}, hidden.options());
  const int grid_experts = static_cast<int>(std::min({E, tk, max_active_experts}));

  GemmParams p1{};
  p1.ids = expert_ids.data_ptr<int32_t>();
  p1.weights = expert_weights.data_ptr<float>();
  p1.tk = static_cast<int>(tk);
  p1.top_k = static_cast<int>(k);
  p1.num_experts = static_cast<int>(E);
  GemmParams p2 = p1;
  p1.w = gate_up_proj.data_ptr();
  p1.w_expert_stride = 2 * I * H;
  p1.K = static_cast<int>(H);
  p1.up_row_offset = static_cast<int>(I);
  p1.b = hidden.data_ptr();
  p1.out = act.data_ptr();
  p1.out_stride = static_cast<int>(I);
  p2.w = down_proj.data_ptr();
  p2.w_expert_stride = H * I;
  p2.K = static_cast<int>(I);
  p2.up_row_offset = 0;
  p2.b = act.data_ptr();
  p2.out = yslot.data_ptr();
  p2.out_stride = static_cast<int>(H);

  const int64_t tokens_per_expert = tk / grid_experts;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const Pick pick = pick_config(T, tokens_per_expert, grid_experts, I, H, sms);
  Config cfg = pick.config;
  // The busiest expert's tokens, estimated without a sync: the average plus a third (random routings of the benchmark
  // points spread about that far), never more than T (a token lists an expert once; if twice, the estimate is low,
  // which costs time, not correctness).
  const int64_t busiest_expert = std::min(T, tokens_per_expert + tokens_per_expert / 3);
  const bool pdl = use_pdl(hidden.get_device());
  const size_t smem_limit = shared_memory_limit();
  // WS needs TMA and wgmma: this build's sm_90a code (the default target) on an sm_90 device
  bool ran_ws = false;
  if (cfg == Config::kWS) {
    ran_ws = experts_ws_launch(hidden, expert_ids, expert_weights, gate_up_proj, down_proj, act, yslot,
                               pick.ws_columns, stream, pdl);
    if (!ran_ws) {
      if (forced_config() >= 0)  // WS was forced (an automatic pick falls back silently)
        TORCH_WARN_ONCE("BASE_MOE_EXPERTS_CONFIG=WS: unavailable on this device or build, ran a cp.async "
                        "configuration");
      cfg = cp_async_config(T, tokens_per_expert);
    }
  }
  if (hidden.scalar_type() == at::kBFloat16) {
    if (!ran_ws) run_experts<__nv_bfloat16>(p1, p2, I, H, grid_experts, busiest_expert, cfg, stream, pdl, smem_limit);
    launch_slot_sum<__nv_bfloat16>(p1.ids, static_cast<const __nv_bfloat16*>(p2.out), y, T, k, E, H, stream, pdl);
  } else {
    if (!ran_ws) run_experts<__half>(p1, p2, I, H, grid_experts, busiest_expert, cfg, stream, pdl, smem_limit);
    launch_slot_sum<__half>(p1.ids, static_cast<const __half*>(p2.out), y, T, k, E, H, stream, pdl);
  }
  return y;
}

}  // namespace base_moe
