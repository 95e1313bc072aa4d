// Decode expert kernel (stage 4): y_t = sum_j w_tj * down_u(silu(gate_u x_t) * up_u x_t) over the token's
// non-sentinel slots, for HF v5 layouts (gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]).
//
// Three launches, chained with programmatic dependent launch (PDL) so each starts streaming weights
// while the previous one finishes:
//   1. gate_up GEMM: act[p, i] = silu(gate_i . x_t) * (up_i . x_t) for every pair p = t*k + j of an expert,
//      rounded to hidden's dtype (act is indexed by pair).
//   2. down GEMM:    yslot[p, h] = w_p * (down_h . act[p]) in fp32.
//   3. slot sum:     y[t, h] = sum over j in slot order of yslot[t*k + j, h] (non-sentinel slots only).
// v1 (expert_gemm_kernel, the default): CTA (x, y) streams row tile x of active experts y, y + gridDim.y, ... in
// 64-column steps (tokens in the same cp.async stages, re-streamed per 32 tokens, or 128 for V1L; act indexed by expert-sorted
// position); the grid has min(E, T*k, max_active_experts) rows. v2 (persist_gemm_kernel below; only when forced
// with BASE_MOE_EXPERTS_CONFIG=S|S2|M|L|XL, for experiments): a persistent grid, each CTA counting the ids itself
// and streaming its work items (expert, pass of up to NP tokens, 64-row tile) as one continuous k-step sequence
// through a cp.async + mbarrier ring filled by producer warps and drained by 8 MMA warps: each expert's weights are
// read from HBM once for up to NP (32..192, by config) tokens.
// So the op needs no host sync and allocates only buffers sized from T, k, H, I.
//
// Tensor cores: mma.sync m16n8k16 with weight rows as M and tokens as the narrow N side. Each lane loads 16
// contiguous bytes of a row; the k order inside each 32-wide chunk is permuted identically for A (weights)
// and B (tokens), so one 16-byte shared load feeds two MMAs' fragments. Accumulation in fp32; every output
// element is written by one thread in a fixed order, and a token's result depends only on its own MMA
// column: deterministic whatever the order of items or of tokens within a pass.
//
// Shape constraints (checked at the op boundary, csrc/experts_cuda.cpp): H and I multiples of 64, E <= 512, 16-byte aligned
// tensors, bf16 or fp16. ids outside [0, E] are treated like the sentinel (can't be checked without a sync).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "base_moe/checks.h"
#include "base_moe/experts_mma.cuh"
#include "base_moe/launch.cuh"
#include "base_moe/routing.h"

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
  void* out;               // gated: act [T*k, I] (input dtype); else yslot [T*k, H] fp32
  int out_stride;
  int R;                   // v2: output rows per expert (I for gate_up: gate rows; H for down)
  int tiles;               // v2: row tiles per expert
};

// Byte offset of 16-byte chunk `ch` (0..7) of stage row `r`: odd rows swap halves so that the 8 lanes of a
// quarter warp (two rows x 64 bytes) hit all 32 banks.
__device__ __forceinline__ uint32_t swz(int r, int ch) { return r * ROW_BYTES + ((ch ^ ((r & 1) << 2)) << 4); }

// One work item of expert_gemm_kernel: output rows [tile * ROWS_out, (tile + 1) * ROWS_out) of expert u, whose
// tokens start at expert-sorted position off, in passes of NP tokens. GATED: gate_up GEMM + SiLU * up (ROWS = gate
// rows + up rows, half each; ROWS_out = ROWS / 2); else the down GEMM (ROWS_out = ROWS). WARPS warps split the
// tokens of a pass (n-tile of 8 tokens j belongs to warp j % WARPS), each warp covers every weight row of the
// tile: NP = WARPS * NTW * 8 tokens per pass.
template <typename T, bool GATED, int ROWS, int NTW, int WARPS, int STAGES>
__device__ __forceinline__ void expert_item(const GemmParams& p, uint8_t* smem, int* s_list, int* s_scan, int u,
                                            int off, int tile) {
  constexpr int NT = WARPS * 32;
  constexpr int NP = WARPS * NTW * 8;
  constexpr int RT = ROWS / 16;
  constexpr int A_BYTES = ROWS * ROW_BYTES;
  constexpr int STAGE_BYTES = (ROWS + NP) * ROW_BYTES;
  constexpr int A_PER_THREAD = ROWS * 8 / NT;
  constexpr int B_PER_THREAD = (NP * 8 + NT - 1) / NT;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, q = lane & 3;
  const int* s_cnt = reinterpret_cast<const int*>(smem + STAGES * STAGE_BYTES);
  const int cnt = s_cnt[u];

  const T* wexp = static_cast<const T*>(p.w) + static_cast<int64_t>(u) * p.w_expert_stride;
  const int row0 = tile * (GATED ? ROWS / 2 : ROWS);
  const int K = p.K;
  const int nk = K / KS;
  const uint64_t policy = evict_first_policy();
  const uint32_t smem0 = smem_addr(smem);

  // this thread's A chunks: row pointers (fixed for the whole tile)
  const T* a_src[A_PER_THREAD];
  uint32_t a_dst[A_PER_THREAD];
#pragma unroll
  for (int i = 0; i < A_PER_THREAD; ++i) {
    const int c = tid + i * NT, r = c >> 3, ch = c & 7;
    int grow = row0 + r;
    if (GATED && r >= ROWS / 2) grow = p.up_row_offset + row0 + (r - ROWS / 2);
    a_src[i] = wexp + static_cast<int64_t>(grow) * K + ch * 8;
    a_dst[i] = swz(r, ch);
  }
  auto load_a = [&](int slot, int ks) {
#pragma unroll
    for (int i = 0; i < A_PER_THREAD; ++i)
      cp_async16_stream(smem0 + slot * STAGE_BYTES + a_dst[i], a_src[i] + ks * KS, policy);
  };

  for (int c0 = 0; c0 < cnt; c0 += NP) {
    const int nv = min(NP, cnt - c0);  // tokens in this pass
    const int nv8 = (nv + 7) & ~7;

    // weights first: they don't depend on the previous kernel
#pragma unroll 1
    for (int s = 0; s < STAGES - 1; ++s)
      if (s < nk) load_a(s, s);

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

    // this thread's B chunks (token rows)
    const T* b_src[B_PER_THREAD];
    uint32_t b_dst[B_PER_THREAD];
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
      b_dst[i] = A_BYTES + swz(r, ch);
    }
    auto load_b = [&](int slot, int ks) {
#pragma unroll
      for (int i = 0; i < B_PER_THREAD; ++i)
        if (b_live[i]) cp_async16_zfill(smem0 + slot * STAGE_BYTES + b_dst[i], b_src[i] + ks * KS, b_valid[i]);
    };
#pragma unroll 1
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < nk) load_b(s, s);
      cp_async_commit();
    }

    float acc[RT][NTW][4];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int j = 0; j < NTW; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[r][j][e] = 0.f;

    const bool warp_has_tokens = warp * 8 < nv;

#pragma unroll 1
    for (int ks = 0; ks < nk; ++ks) {
      cp_async_wait<STAGES - 2>();
      __syncthreads();
      {
        const int nx = ks + STAGES - 1;
        if (nx < nk) {
          load_a(nx % STAGES, nx);
          load_b(nx % STAGES, nx);
        }
        cp_async_commit();
      }
      if (warp_has_tokens) {
        const uint32_t sa = smem0 + (ks % STAGES) * STAGE_BYTES;
        const uint32_t sb = sa + A_BYTES;
#pragma unroll
        for (int kc = 0; kc < KS / 32; ++kc) {
          const int ch = kc * 4 + q;
          uint4 bf[NTW];
#pragma unroll
          for (int j = 0; j < NTW; ++j) {
            const int nt = warp + j * WARPS;
            if (nt * 8 < nv) bf[j] = lds128(sb + swz(nt * 8 + g, ch));
          }
#pragma unroll
          for (int rt = 0; rt < RT; ++rt) {
            const uint4 lo = lds128(sa + swz(rt * 16 + g, ch));
            const uint4 hi = lds128(sa + swz(rt * 16 + g + 8, ch));
#pragma unroll
            for (int j = 0; j < NTW; ++j) {
              const int nt = warp + j * WARPS;
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
#pragma unroll
      for (int j = 0; j < NTW; ++j) {
        const int nt = warp + j * WARPS;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int tok = nt * 8 + 2 * q + e;
          if (tok >= nv) continue;
          if constexpr (GATED) {
            T* act = static_cast<T*>(p.out) + static_cast<int64_t>(off + c0 + tok) * p.out_stride + row0;
#pragma unroll
            for (int rt = 0; rt < RT / 2; ++rt) {
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const float gv = acc[rt][j][2 * h + e], uv = acc[rt + RT / 2][j][2 * h + e];
                act[rt * 16 + g + 8 * h] = from_float<T>(gv / (1.f + __expf(-gv)) * uv);
              }
            }
          } else {
            const int flat = s_list[tok];
            const float wv = p.weights[flat];
            float* y = static_cast<float*>(p.out) + static_cast<int64_t>(flat) * p.out_stride + row0;
#pragma unroll
            for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
              for (int h = 0; h < 2; ++h) y[rt * 16 + g + 8 * h] = wv * acc[rt][j][2 * h + e];
            }
          }
        }
      }
    }
    __syncthreads();  // s_list and the stages are reused by the next pass
  }
}


// v1: CTA (x, y) computes row tile x of the active experts y, y + gridDim.y, ... (in ascending expert order). The
// grid has min(E, T*k, max_active_experts) rows: with the caller's bound on the active experts (a budget), no CTA is
// spent on experts no token uses; more active experts than rows are still all computed.
template <typename T, bool GATED, int ROWS, int NTW, int WARPS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32) expert_gemm_kernel(const GemmParams p) {
  constexpr int NT = WARPS * 32;
  constexpr int NP = WARPS * NTW * 8;
  constexpr int STAGE_BYTES = (ROWS + NP) * ROW_BYTES;
  static_assert(ROWS * 8 % NT == 0, "A tile must split evenly over the threads");
  static_assert(!GATED || ROWS % 32 == 0, "gated tiles hold as many gate rows as up rows");

  extern __shared__ __align__(128) uint8_t smem[];
  int* s_cnt = reinterpret_cast<int*>(smem + STAGES * STAGE_BYTES);  // [kMaxE] tokens per expert
  int* s_list = s_cnt + kMaxE;                                      // [NP] flat (t*k+j) of this pass's tokens
  int* s_active = s_list + NP;                                      // [kMaxE] active experts, ascending
  int* s_offset = s_active + kMaxE;                                 // [kMaxE] their first expert-sorted position
  __shared__ int s_scan[WARPS];
  __shared__ int s_num_active;

  const int tid = threadIdx.x;
  const int E = p.num_experts;

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
    expert_item<T, GATED, ROWS, NTW, WARPS, STAGES>(p, smem, s_list, s_scan, s_active[a], s_offset[a], blockIdx.x);
  }
}

// ==== v2: persistent, warp-specialised, one pass over each expert's weights =============================
// Grid = CTAs resident on the device (1 per SM with the ~200 KB rings). Each CTA counts the ids itself
// (T*k ints from L2), enumerates the work items (active expert, pass of up to NP tokens, row tile of 64
// weight rows; gated: 32 gate + 32 up rows) and takes items blockIdx.x, blockIdx.x + gridDim.x, ...
// One producer warp streams the CTA's items as one continuous sequence of k-steps (64 columns each) through
// a STAGES-deep ring: weight rows (evict-first) and the item's token rows (x for gate_up, act for down,
// gathered from L2) by cp.async, completion tracked on a "full" mbarrier per stage; so the ring never
// drains between items. It also builds each item's token list (pairs t*k+j of the expert, in token order,
// one ballot scan of the ids) into a small smem ring read by the consumers. 8 consumer warps (2 row groups
// x 4 token groups) run mma.sync on each stage and release it on an "empty" mbarrier.
// act is indexed by pair (t*k+j), so no global sorted order is needed; the output of every token depends
// only on its own column of the MMA, so the results are bitwise independent of the item order.
constexpr int P_ROWS = 64;
constexpr int P_WM = 2, P_WN = 4, P_CW = P_WM * P_WN;

template <int NTW, int STAGES, int PW>
struct PLayout {
  static constexpr int THREADS = (P_CW + PW) * 32;  // consumer warps, then PW producer warps
  static constexpr int NP = P_WN * NTW * 8;          // tokens per pass
  static constexpr int A_BYTES = P_ROWS * ROW_BYTES;
  static constexpr int STAGE_BYTES = (P_ROWS + NP) * ROW_BYTES;
  static constexpr int BAR = STAGES * STAGE_BYTES;     // full[STAGES], empty[STAGES]
  static constexpr int DESC = BAR + 16 * STAGES;       // [STAGES] int2 {row0, nv}
  static constexpr int LIST = DESC + 8 * STAGES;       // [STAGES][NP] pair t*k+j
  static constexpr int BROW = LIST + 4 * STAGES * NP;  // [STAGES][NP] row of the token operand
  static constexpr int NVW = BROW + 4 * STAGES * NP;   // [PW][STAGES] tokens of the item, per producer warp
  static constexpr int CNT = NVW + 4 * PW * STAGES;    // [E] tokens per expert, [E+1] first unit
  static constexpr size_t bytes(int E) { return static_cast<size_t>(CNT) + 4 * (2 * E + 1); }
};

template <typename T, bool GATED, int NTW, int STAGES, int PW, int MINB>
__global__ void __launch_bounds__(PLayout<NTW, STAGES, PW>::THREADS, MINB) persist_gemm_kernel(const GemmParams p) {
  using L = PLayout<NTW, STAGES, PW>;
  constexpr int NP = L::NP;
  constexpr int NT = L::THREADS;
  constexpr int PT = PW * 32;  // producer threads
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t smem0 = smem_addr(smem);
  int2* s_desc = reinterpret_cast<int2*>(smem + L::DESC);
  int* s_list = reinterpret_cast<int*>(smem + L::LIST);
  int* s_brow = reinterpret_cast<int*>(smem + L::BROW);
  int* s_nvw = reinterpret_cast<int*>(smem + L::NVW);
  int* s_cnt = reinterpret_cast<int*>(smem + L::CNT);
  const int E = p.num_experts;
  int* s_ustart = s_cnt + E;
  __shared__ int s_scan[P_CW + PW];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int bid = blockIdx.x, G = gridDim.x;
  cuda::pdl_launch_dependents();

  // ---- routing: tokens per expert, passes, first unit of each expert -----------------------------------
  for (int e = tid; e < E; e += NT) s_cnt[e] = 0;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(smem0 + L::BAR + 8 * s, 2 * PT);           // per producer thread: cp.async arrival + plain arrival
      mbar_init(smem0 + L::BAR + 8 * (STAGES + s), P_CW);  // one per consumer warp
    }
  }
  __syncthreads();
  for (int i = tid; i < p.tk; i += NT) {
    const int u = __ldg(p.ids + i);
    if (static_cast<unsigned>(u) < static_cast<unsigned>(E)) atomicAdd(&s_cnt[u], 1);
  }
  __syncthreads();
  {
    const int per = (E + NT - 1) / NT;
    const int e0 = min(tid * per, E), e1 = min(e0 + per, E);
    int n = 0;
    for (int e = e0; e < e1; ++e) n += (s_cnt[e] + NP - 1) / NP;
    int total;
    int before = block_exclusive_scan<P_CW + PW>(n, s_scan, total);
    for (int e = e0; e < e1; ++e) {
      s_ustart[e] = before;
      before += (s_cnt[e] + NP - 1) / NP;
    }
    if (tid == 0) s_ustart[E] = total;
  }
  __syncthreads();
  const int n_items = s_ustart[E] * p.tiles;
  const int my_items = bid < n_items ? (n_items - 1 - bid) / G + 1 : 0;
  const int nk = p.K / KS;
  const int steps = my_items * nk;

  if (warp >= P_CW) {
    // ---- producer warps: thread pt copies 16-byte chunk (pt & 7) of rows (pt >> 3) + 4 * PW * a ----------
    // Each producer warp works out every item itself (no sync between producer warps); warp 0 also
    // publishes the item's descriptor and token list to the consumers.
    const int pw = warp - P_CW, pt = tid - P_CW * 32;
    const int ch = lane & 7, r_lane = pt >> 3;
    const int K = p.K;
    const uint64_t policy = evict_first_policy();
    const T* wexp = static_cast<const T*>(p.w);
    int row0 = 0, j_cur = -1;
    auto begin_item = [&](int j) {
      const int id = bid + j * G;
      const int uidx = id / p.tiles, tile = id - uidx * p.tiles;
      int lo = 0, hi = E - 1;  // the last expert whose first unit is <= uidx
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s_ustart[mid] <= uidx) lo = mid;
        else hi = mid - 1;
      }
      const int e = lo, first = (uidx - s_ustart[e]) * NP;
      const int nv = min(NP, s_cnt[e] - first), last = first + nv;
      row0 = tile * (GATED ? P_ROWS / 2 : P_ROWS);
      wexp = static_cast<const T*>(p.w) + static_cast<int64_t>(e) * p.w_expert_stride;
      const int ring = j % STAGES;
      if (lane == 0) {
        s_nvw[pw * STAGES + ring] = nv;
        if (pw == 0) s_desc[ring] = make_int2(row0, nv);
      }
      int got = 0;
      for (int base = 0; base < p.tk && got < last; base += 128) {
        int v[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int i = base + c * 32 + lane;
          v[c] = i < p.tk ? __ldg(p.ids + i) : -1;
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const bool hit = v[c] == e;
          const unsigned m = __ballot_sync(0xffffffffu, hit);
          const int r = got + __popc(m & ((1u << lane) - 1u)) - first;
          if (hit && r >= 0 && r < nv) {
            const int i = base + c * 32 + lane;
            if (pw == 0) s_list[ring * NP + r] = i;
            if (((r >> 2) % PW) == pw) s_brow[ring * NP + r] = GATED ? i / p.top_k : i;  // rows this warp loads
          }
          got += __popc(m);
        }
      }
      __syncwarp();
    };
    auto ensure_item = [&](int i) {
      const int j = i / nk;
      if (j != j_cur) {
        begin_item(j);
        j_cur = j;
      }
    };
    auto issue_weights = [&](int i) {
      const int ks = i % nk;
      const uint32_t dst0 = smem0 + (i % STAGES) * L::STAGE_BYTES;
      const int col = ks * KS + ch * 8;
#pragma unroll
      for (int a = 0; a < P_ROWS / (4 * PW); ++a) {
        const int r = r_lane + 4 * PW * a;
        int grow;
        if (GATED) grow = r < P_ROWS / 2 ? row0 + r : p.up_row_offset + row0 + (r - P_ROWS / 2);
        else grow = min(row0 + r, p.R - 1);  // rows past R (last partial tile): loaded, never stored
        cp_async16_stream(dst0 + swz(r, ch), wexp + static_cast<int64_t>(grow) * K + col, policy);
      }
    };
    auto issue_tokens = [&](int i) {
      const int j = i / nk, ks = i - j * nk, ring = j % STAGES;
      const int nv = s_nvw[pw * STAGES + ring];
      const uint32_t dst0 = smem0 + (i % STAGES) * L::STAGE_BYTES + L::A_BYTES;
      const T* B = static_cast<const T*>(p.b);
      const int col = ks * KS + ch * 8;
      for (int r = r_lane; r < nv; r += 4 * PW)
        cp_async16(dst0 + swz(r, ch), B + static_cast<int64_t>(s_brow[ring * NP + r]) * K + col);
    };
    auto publish = [&](int i) {
      const uint32_t full = smem0 + L::BAR + 8 * (i % STAGES);
      cp_async_mbar_arrive_noinc(full);
      mbar_arrive(full);
    };
    int start = 0;
    if (!GATED) {
      // weights don't depend on the gate_up kernel: fill the ring with them first, then wait for act
      const int P = min(STAGES, steps);
      for (int i = 0; i < P; ++i) {
        ensure_item(i);
        issue_weights(i);
      }
      cuda::pdl_wait();
      for (int i = 0; i < P; ++i) {
        issue_tokens(i);
        publish(i);
      }
      start = P;
    }
#pragma unroll 1
    for (int i = start; i < steps; ++i) {
      if (i >= STAGES) mbar_wait(smem0 + L::BAR + 8 * (STAGES + i % STAGES), ((i / STAGES) & 1) ^ 1);
      ensure_item(i);
      issue_weights(i);
      issue_tokens(i);
      publish(i);
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
  } else {
    // ---- consumer warps: warp (wm, wn) computes rows wm (gated: gate rows wm*16.. and the matching up rows;
    // else rows wm*32..+32) for the n-tiles wn, wn + 4, ... of each item ------------------------------------
    const int g = lane >> 2, q = lane & 3;
    const int wm = warp % P_WM, wn = warp / P_WM;
    float acc[2][NTW][4];
    int pr[NTW][2];
    float wv[NTW][2];
    int row0 = 0, nv = 0;
#pragma unroll 1
    for (int j = 0; j < my_items; ++j) {
#pragma unroll 1
      for (int ks = 0; ks < nk; ++ks) {
        const int i = j * nk + ks, slot = i % STAGES;
        mbar_wait(smem0 + L::BAR + 8 * slot, (i / STAGES) & 1);
        if (ks == 0) {
          const int ring = j % STAGES;
          const int2 d = s_desc[ring];
          row0 = d.x;
          nv = d.y;
#pragma unroll
          for (int jj = 0; jj < NTW; ++jj) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int tok = (wn + jj * P_WN) * 8 + 2 * q + e;
              pr[jj][e] = tok < nv ? s_list[ring * NP + tok] : 0;
              wv[jj][e] = (!GATED && tok < nv) ? __ldg(p.weights + pr[jj][e]) : 0.f;
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
              for (int c = 0; c < 4; ++c) acc[mt][jj][c] = 0.f;
          }
        }
        if (wn * 8 < nv) {
          const uint32_t sa = smem0 + slot * L::STAGE_BYTES;
          const uint32_t sb = sa + L::A_BYTES;
#pragma unroll
          for (int kc = 0; kc < KS / 32; ++kc) {
            const int ch = kc * 4 + q;
            uint4 bf[NTW];
#pragma unroll
            for (int jj = 0; jj < NTW; ++jj) {
              const int nt = wn + jj * P_WN;
              bf[jj] = nt * 8 < nv ? lds128(sb + swz(nt * 8 + g, ch)) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
              const int rb = GATED ? mt * (P_ROWS / 2) + wm * 16 : wm * 32 + mt * 16;
              const uint4 lo = lds128(sa + swz(rb + g, ch));
              const uint4 hi = lds128(sa + swz(rb + g + 8, ch));
#pragma unroll
              for (int jj = 0; jj < NTW; ++jj) {
                if ((wn + jj * P_WN) * 8 < nv) {
                  cuda::mma_16816<T>(acc[mt][jj], lo.x, hi.x, lo.y, hi.y, bf[jj].x, bf[jj].y);
                  cuda::mma_16816<T>(acc[mt][jj], lo.z, hi.z, lo.w, hi.w, bf[jj].z, bf[jj].w);
                }
              }
            }
          }
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(smem0 + L::BAR + 8 * (STAGES + slot));
      }
      // ---- epilogue: accumulator (row g [+8], tokens 2q, 2q+1) -------------------------------------------
      if (wn * 8 < nv) {
#pragma unroll
        for (int jj = 0; jj < NTW; ++jj) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int tok = (wn + jj * P_WN) * 8 + 2 * q + e;
            if (tok >= nv) continue;
            const int64_t pair = pr[jj][e];
            if constexpr (GATED) {
              T* act = static_cast<T*>(p.out) + pair * p.out_stride + row0 + wm * 16 + g;
#pragma unroll
              for (int h = 0; h < 2; ++h) {
                const float gv = acc[0][jj][2 * h + e], uv = acc[1][jj][2 * h + e];
                act[8 * h] = from_float<T>(gv / (1.f + __expf(-gv)) * uv);
              }
            } else {
              float* y = static_cast<float*>(p.out) + pair * p.out_stride;
#pragma unroll
              for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                  const int row = row0 + wm * 32 + mt * 16 + g + 8 * h;
                  if (row < p.R) y[row] = wv[jj][e] * acc[mt][jj][2 * h + e];
                }
              }
            }
          }
        }
      }
    }
  }
}

// y[t, h..h+8) = sum over slots j (in order) of yslot[t*k + j, h..h+8), skipping sentinel slots.
template <typename T>
__global__ void __launch_bounds__(256) slot_sum_kernel(const int32_t* __restrict__ ids,
                                                       const float* __restrict__ yslot, T* __restrict__ y,
                                                       int tokens, int top_k, int num_experts, int H) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int h8 = H / 8;
  if (idx >= static_cast<int64_t>(tokens) * h8) return;
  const int t = static_cast<int>(idx / h8), h = static_cast<int>(idx % h8) * 8;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  cuda::pdl_wait();
  for (int j = 0; j < top_k; ++j) {
    const int u = ids[t * top_k + j];
    if (static_cast<unsigned>(u) >= static_cast<unsigned>(num_experts)) continue;
    const float4* src = reinterpret_cast<const float4*>(yslot + (static_cast<int64_t>(t) * top_k + j) * H + h);
    const float4 a = src[0], b = src[1];
    acc[0] += a.x; acc[1] += a.y; acc[2] += a.z; acc[3] += a.w;
    acc[4] += b.x; acc[5] += b.y; acc[6] += b.z; acc[7] += b.w;
  }
  alignas(16) T out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = from_float<T>(acc[i]);
  *reinterpret_cast<uint4*>(y + static_cast<int64_t>(t) * H + h) = *reinterpret_cast<const uint4*>(out);
}

// ---- host side ------------------------------------------------------------------------------------------
template <typename T, bool GATED, int ROWS, int NTW, int WARPS, int STAGES>
void launch_gemm(const GemmParams& p, int row_tiles, int grid_experts, cudaStream_t stream, bool pdl) {
  constexpr int NP = WARPS * NTW * 8;
  // stages, then counts [kMaxE], the pass's token list [NP], active experts and their offsets [2 kMaxE]
  constexpr size_t smem = STAGES * (ROWS + NP) * ROW_BYTES + (3 * kMaxE + NP) * sizeof(int);
  auto kernel = expert_gemm_kernel<T, GATED, ROWS, NTW, WARPS, STAGES>;
  static bool configured = [&] {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    return true;
  }();
  (void)configured;
  cuda::launch({dim3(row_tiles, grid_experts), dim3(WARPS * 32), smem, stream, 0, pdl}, kernel, p);
}

// v2 launch: persistent grid (CTAs resident on the device, at most one per possible item).
template <typename T, bool GATED, int NTW, int STAGES, int PW, int MINB>
void launch_persist(const GemmParams& p, int64_t units_max, cudaStream_t stream, bool pdl) {
  using L = PLayout<NTW, STAGES, PW>;
  auto kernel = persist_gemm_kernel<T, GATED, NTW, STAGES, PW, MINB>;
  static const int resident = [&] {
    const size_t max_smem = L::bytes(kMaxE);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)max_smem));
    int occ = 0, dev = 0, sms = 0;
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, L::THREADS, max_smem));
    C10_CUDA_CHECK(cudaGetDevice(&dev));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    return std::max(1, occ) * sms;
  }();
  const int64_t items_max = units_max * p.tiles;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(items_max, resident)));
  cuda::launch({dim3(grid), dim3(L::THREADS), L::bytes(p.num_experts), stream, 0, pdl}, kernel, p);
}

// Kernel configurations: V1 (the default) and the v2 ones, up to NP tokens of one expert per pass over its weights,
// reachable only through BASE_MOE_EXPERTS_CONFIG (a process-wide setting, so the choice is graph-safe).
enum class Config { kV1, kV1L, kS, kS2, kM, kL, kXL };

// tokens_per_expert: T * k over the most experts that can be active (min(E, T * k, max_active_experts)): the
// average load per active expert when no slot is empty and the bound is exact (empty slots or a loose bound make it
// an overestimate), the best the host knows without a sync. Measured at 32 (V1 wins) and 128 (V1L wins) only.
Config pick_config(int64_t tokens_per_expert) {
  const char* forced = std::getenv("BASE_MOE_EXPERTS_CONFIG");  // for benchmarks
  if (forced != nullptr) {
    if (!std::strcmp(forced, "V1")) return Config::kV1;
    if (!std::strcmp(forced, "V1L")) return Config::kV1L;
    if (!std::strcmp(forced, "S")) return Config::kS;
    if (!std::strcmp(forced, "S2")) return Config::kS2;
    if (!std::strcmp(forced, "M")) return Config::kM;
    if (!std::strcmp(forced, "L")) return Config::kL;
    if (!std::strcmp(forced, "XL")) return Config::kXL;
  }
  // Measured on the H200 (notes/experts_kernel.md): the v2 kernels keep only about one k-step in flight per CTA,
  // and their one win (S2 at batch 16 with a budget: 64 us vs v1's 72) came from v1 launching CTAs for expert
  // slots no token used; with max_active_experts v1 no longer does (53 us at 88e3edd). V1L (128 tokens per pass)
  // reads each expert's weights once for up to 128 tokens where V1 re-reads them per 32, but keeps fewer weight
  // bytes in flight (v1 configs of session 1: b256/M16 236 us vs 318, b64/M16 145 vs 102, b256 dense 933 vs 511).
  return tokens_per_expert >= 96 ? Config::kV1L : Config::kV1;
}

bool use_pdl() {  // BASE_MOE_EXPERTS_PDL=0 turns programmatic dependent launch off (benchmarks)
  return cuda::env_flag("BASE_MOE_EXPERTS_PDL", true);
}

template <typename T, int NTW, int STAGES, int PW, int MINB>
void run_persist(GemmParams p1, GemmParams p2, int64_t I, int64_t H, int64_t E, int64_t tk, cudaStream_t stream,
                 bool pdl) {
  constexpr int NP = PLayout<NTW, STAGES, PW>::NP;
  const int64_t units_max = std::min<int64_t>(E, tk) + tk / NP;
  p1.R = static_cast<int>(I);
  p1.tiles = static_cast<int>(I / (P_ROWS / 2));
  p2.R = static_cast<int>(H);
  p2.tiles = static_cast<int>((H + P_ROWS - 1) / P_ROWS);
  launch_persist<T, true, NTW, STAGES, PW, MINB>(p1, units_max, stream, false);
  launch_persist<T, false, NTW, STAGES, PW, MINB>(p2, units_max, stream, pdl);
}

template <typename T>
void run_experts(const GemmParams& p1, const GemmParams& p2, int64_t I, int64_t H, int64_t E, int64_t tk,
                 int grid_experts, Config cfg, cudaStream_t stream) {
  const bool pdl = use_pdl();
  switch (cfg) {
    case Config::kV1:  // v1 S: gate_up 16+16 rows, 32 tokens per pass; down 32 rows
      launch_gemm<T, true, 32, 1, 4, 8>(p1, I / 16, grid_experts, stream, false);
      launch_gemm<T, false, 32, 1, 4, 6>(p2, H / 32, grid_experts, stream, pdl);
      break;
    case Config::kV1L:  // v1 L: gate_up 32+32 rows, 128 tokens per pass; down 64 rows; 4 stages
      launch_gemm<T, true, 64, 4, 4, 4>(p1, I / 32, grid_experts, stream, false);
      launch_gemm<T, false, 64, 4, 4, 4>(p2, H / 64, grid_experts, stream, pdl);
      break;
    case Config::kS:  // 32 tokens per pass, 16 stages, 8 producer warps, 1 CTA/SM
      run_persist<T, 1, 16, 8, 1>(p1, p2, I, H, E, tk, stream, pdl);
      break;
    case Config::kS2:  // 32 tokens per pass, 8 stages, 4 producer warps, 2 CTAs/SM
      run_persist<T, 1, 8, 4, 2>(p1, p2, I, H, E, tk, stream, pdl);
      break;
    case Config::kM:  // 64 tokens per pass, 12 stages, 8 producer warps
      run_persist<T, 2, 12, 8, 1>(p1, p2, I, H, E, tk, stream, pdl);
      break;
    case Config::kL:  // 128 tokens per pass, 8 stages, 8 producer warps
      run_persist<T, 4, 8, 8, 1>(p1, p2, I, H, E, tk, stream, pdl);
      break;
    case Config::kXL:  // 192 tokens per pass, 6 stages, 8 producer warps
      run_persist<T, 6, 6, 8, 1>(p1, p2, I, H, E, tk, stream, pdl);
      break;
  }
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
  Tensor yslot = at::empty({tk, H}, hidden.options().dtype(at::kFloat));
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

  const Config cfg = pick_config(tk / grid_experts);
  const int64_t n8 = T * (H / 8);
  const dim3 sum_grid(static_cast<unsigned>((n8 + 255) / 256));
  if (hidden.scalar_type() == at::kBFloat16) {
    run_experts<__nv_bfloat16>(p1, p2, I, H, E, tk, grid_experts, cfg, stream);
    cuda::launch({sum_grid, dim3(256), 0, stream, 0, use_pdl()}, slot_sum_kernel<__nv_bfloat16>, p1.ids,
           static_cast<const float*>(p2.out), static_cast<__nv_bfloat16*>(y.data_ptr()), static_cast<int>(T),
           static_cast<int>(k), static_cast<int>(E), static_cast<int>(H));
  } else {
    run_experts<__half>(p1, p2, I, H, E, tk, grid_experts, cfg, stream);
    cuda::launch({sum_grid, dim3(256), 0, stream, 0, use_pdl()}, slot_sum_kernel<__half>, p1.ids,
           static_cast<const float*>(p2.out), static_cast<__half*>(y.data_ptr()), static_cast<int>(T),
           static_cast<int>(k), static_cast<int>(E), static_cast<int>(H));
  }
  return y;
}

}  // namespace base_moe
