// The expert op's warp-specialised tile configuration "WS", for large decode batches (tens to hundreds of tokens per
// expert), where csrc/experts.cu's cp.async kernels are latency-bound. Benchmarked first as a standalone prototype
// (benchmarks/micro/ws_experts.cu; notes/ws_experts_plan.md). Three launches before the op's slot sum, chained with
// programmatic dependent launch:
//   1. plan: the slots in expert-sorted order (each CTA recomputes the expert counts and offsets from the ids, so no
//      grid-wide sync is needed, then ranks its 16 slots stably): each sorted slot's pair t * k + j and routing
//      weight; CTA 0 writes the chunks (per active expert, runs of at most N of its slots; N = 64, 80, 128 or 160:
//      csrc/experts.cu pick_config): a GEMM's work items are its chunks x its weight tiles.
//   2. gate_up: act[slot, i] = SiLU(gate_i . x) * (up_i . x) for the items' 96-intermediate tiles.
//   3. down:    yslot[t * k + j, h] = w * (down_h . act[slot]) for 128-row tiles, rounded to the input dtype.
// Both GEMMs: one persistent CTA per SM; warpgroup 0 loads, per 64-wide k step, one TMA box of 64 weight rows per
// consumer warpgroup and the item's N token rows (down: one TMA box of act rows from thread 0; gate_up: all of
// warpgroup 0 gathers the slots' hidden rows with cp.async) into a ring of stages (full / empty mbarriers);
// each consumer warpgroup runs four m64nNk16 wgmmas per stage on its 64 rows, keeps one stage in flight and releases
// the one before. down's loader issues its first item's first weight stages before its PDL wait (produce_down), so the
// weights stream on the SMs gate_up frees first while gate_up's last items finish. gate_up's weight box is 5-D (h,
// row in a group of 8, gate | up, group, expert): consumer c's 64 rows are 4 groups of [8 gate rows, the same 8 up
// rows], so each thread's two accumulator rows (lane / 4 and + 8) are the gate and up of one intermediate and SiLU *
// up goes from registers to act. Rows past I or H (partial last tiles) and token rows past the slots arrive as zeros
// and are not stored. Every output element is computed by one thread in a fixed order: deterministic.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/detail/IntegerDivider.cuh>

#include <algorithm>
#include <atomic>

#include "base_moe/experts_mma.cuh"
#include "base_moe/experts_ws.h"
#include "base_moe/launch.cuh"
#include "base_moe/tma.cuh"
#include "base_moe/wgmma.cuh"

namespace base_moe {
namespace {

using namespace experts_detail;

constexpr int kMaxE = 512;
constexpr int kMaxN = 160;            // token columns per work item at most (the wgmma's N: 64, 80, 128 or 160)
constexpr int kStep = 64;             // k elements per stage (128-byte rows)
constexpr int kBox = 64 * 128;        // one consumer's 64 weight rows of a stage
constexpr int kPlanThreads = 512;
constexpr int kSlotsPerPlanCta = 16;  // <= 32: one warp ranks them in one round
constexpr int kMaxSharedBytes = 227 * 1024;  // shared memory per CTA on sm_90 (static + dynamic)
constexpr int kGatherThreads = 128;          // gate_up: warpgroup 0 gathers the token rows

// A work item: weight tile `tile` of `expert` against a chunk of its slots. The plan kernel writes one entry per
// chunk (tile 0); item it of a GEMM with `tiles` weight tiles is chunk it / tiles, tile it % tiles (ws_item).
struct alignas(16) WsItem {
  int expert, tile, slot0, cols;  // cols: the chunk's slots (<= N), expert-sorted slots slot0..
};
static_assert(sizeof(WsItem) == 16, "an item is read as one int4 (ws_item)");

// The two GEMMs' shapes: gate_up 3 consumers x 32 intermediates per tile, K = H; down 2 consumers x 64 output rows,
// K = I; N token columns per item. Registers: 4 warpgroups leave ptxas 128 per thread, enough for the consumers' 80
// accumulators at N = 160 (setmaxnreg does not raise ptxas's per-kernel limit: a 5-warpgroup form failed to compile
// at 96, session 16).
template <bool GATED, int N = kMaxN>
struct WsShape {
  static constexpr int CONSUMERS = GATED ? 3 : 2;
  static constexpr int TILE = GATED ? 96 : 128;
  static constexpr int A_BYTES = CONSUMERS * kBox;
  static constexpr int STAGE_BYTES = A_BYTES + N * 128;
  // as many stages as the shared memory holds, at most 8: 5 / 6 at N = 160 (gate_up / down), 6 / 8 at 80, 7 / 8 at
  // 64
  static constexpr int STAGES = std::min((kMaxSharedBytes - 1024) / STAGE_BYTES, 8);
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024;  // + 1 KB to align the ring for the swizzle
  static constexpr int THREADS = 128 * (CONSUMERS + 1);
  // whole 8-row swizzle blocks of token rows, so every stage's boxes start 1024-byte aligned
  static_assert(N % 8 == 0 && N <= kMaxN, "token columns: a multiple of 8, at most kMaxN");
  // with the ring: its mbarriers and (down) the item's staged yslot rows and weights (ws_gemm_kernel)
  static_assert(STAGES >= 2 && SMEM_BYTES + 16 * STAGES + (GATED ? 0 : 8 * N) <= kMaxSharedBytes,
                "the ring, its mbarriers and down's staged item must fit");
  static_assert(GATED || N <= 128 * CONSUMERS, "down's consumers stage one column each");
};

// Weight tiles of a GEMM whose output has `rows` rows (I for gate_up, H for down); the last one may be partial.
template <bool GATED>
int64_t weight_tiles(int64_t rows) {
  return (rows + WsShape<GATED>::TILE - 1) / WsShape<GATED>::TILE;
}

struct PlanParams {
  const int32_t* ids;
  const float* weights;
  int tk, E;
  int* slot_origin;    // [tk]: each expert-sorted slot's pair t * k + j
  float* slot_weight;  // [tk]
  WsItem* chunks;      // per chunk: expert, slot0, cols (tile 0)
  int* chunk_count;
  int chunk;  // slots per work item at most: the GEMMs' N
};

__global__ void __launch_bounds__(kPlanThreads) ws_plan_kernel(const PlanParams p) {
  constexpr int kWarps = kPlanThreads / 32;
  constexpr int kCountBatch = 8;  // ids per thread per round trip of the count
  __shared__ int s_count[kMaxE];
  __shared__ int s_base[kMaxE];  // first sorted position of expert e's slots among this CTA's (after the scan)
  __shared__ int s_scan[kWarps];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, E = p.E;
  const int p0 = blockIdx.x * kSlotsPerPlanCta, p1 = min(p.tk, p0 + kSlotsPerPlanCta);
  for (int e = tid; e < E; e += kPlanThreads) s_count[e] = s_base[e] = 0;
  __syncthreads();
  cuda::pdl_wait();  // ids and weights come from the kernels before
  cuda::pdl_launch_dependents();
  // Every global read the kernel needs before its stores goes out here, in one round trip: the first batch of ids to
  // count, warp 0's own pairs' ids and weights (a load after a shared atomic waits for it: the compiler cannot tell a
  // generic pointer from shared memory). With the warp-aggregated count below, ncu at b256 (session 27): 12.83 ->
  // 10.40 us (M16), 12.54 -> 11.39 (M32) against one round trip per count batch and phase and an atomic per id.
  const int pair = p0 + lane;
  const bool own = warp == 0 && pair < p1;
  const int own_id = own ? p.ids[pair] : -1;
  const float own_weight = own ? p.weights[pair] : 0.0f;
  // The count: one shared atomic per distinct (expert, before this CTA's pairs) among a warp's 32 ids (a token's k
  // slots and its neighbours' share experts at decode budgets, and atomics on one address serialise). The loop bound
  // is uniform over the warp, as __match_any_sync needs.
  for (int w0 = warp * 32; w0 < p.tk; w0 += kPlanThreads * kCountBatch) {
    int u[kCountBatch];
#pragma unroll
    for (int b = 0; b < kCountBatch; ++b) {
      const int i = w0 + lane + b * kPlanThreads;
      u[b] = i < p.tk ? p.ids[i] : -1;
    }
#pragma unroll
    for (int b = 0; b < kCountBatch; ++b) {
      const bool valid = static_cast<unsigned>(u[b]) < static_cast<unsigned>(E);
      const bool before = w0 + lane + b * kPlanThreads < p0;
      const unsigned peers = __match_any_sync(cuda::kFullMask, valid ? 2 * u[b] + before : -1);
      if (valid && lane == __ffs(peers) - 1) {
        atomicAdd(&s_count[u[b]], __popc(peers));
        if (before) atomicAdd(&s_base[u[b]], __popc(peers));
      }
    }
  }
  __syncthreads();
  // expert offsets: an exclusive scan of the counts, each thread a contiguous range of experts
  const int per = (E + kPlanThreads - 1) / kPlanThreads;
  const int e0 = min(tid * per, E), e1 = min(e0 + per, E);
  int mine = 0;
  for (int e = e0; e < e1; ++e) mine += s_count[e];
  int total = 0;
  int offset = block_exclusive_scan<kWarps>(mine, s_scan, total);
  for (int e = e0; e < e1; ++e) {
    s_base[e] += offset;  // + the expert's slots in pairs before this CTA's
    offset += s_count[e];
  }
  __syncthreads();
  // this CTA's pairs in order: a pair's position is its expert's base + the earlier pairs of the same expert here
  if (warp == 0) {
    const bool valid = own && static_cast<unsigned>(own_id) < static_cast<unsigned>(E);
    const unsigned peers = __match_any_sync(cuda::kFullMask, valid ? own_id : -1);
    const int pos = valid ? s_base[own_id] + __popc(peers & ((1u << lane) - 1u)) : -1;
    if (pos >= 0) {
      p.slot_origin[pos] = pair;
      p.slot_weight[pos] = own_weight;
    }
  }
  if (blockIdx.x != 0) return;
  // the chunks (CTA 0, whose bases are the expert offsets) in expert order; the GEMMs take them chunk-major, tiles
  // inner, so that neighbouring CTAs stream tiles of the same expert and share its token rows in L2. One entry per
  // chunk, not per item: CTA 0 wrote 24 items per chunk at Qwen3's shape and left ~1 us after the other CTAs, ~0.5
  // now (device_runs/session35.txt call 4, session36.txt call 2), and the GEMMs wait for the whole plan grid.
  int my_chunks = 0;
  for (int e = e0; e < e1; ++e) my_chunks += (s_count[e] + p.chunk - 1) / p.chunk;
  int all_chunks = 0;
  int chunk = block_exclusive_scan<kWarps>(my_chunks, s_scan, all_chunks);
  for (int e = e0; e < e1; ++e) {
    for (int first = 0; first < s_count[e]; first += p.chunk, ++chunk)
      p.chunks[chunk] = WsItem{e, 0, s_base[e] + first, min(p.chunk, s_count[e] - first)};
  }
  if (tid == 0) *p.chunk_count = all_chunks;
}

struct WsGemmParams {
  const WsItem* chunks;       // the plan kernel's
  const int* chunk_count;
  int tiles;                  // weight tiles per chunk: the GEMM's items are chunk_count x tiles
  int K;                      // reduction length: H (gate_up) or I (down)
  int rows_out;               // I (gate_up) or H (down): rows past it belong to a partial last tile
  void* act;                  // gate_up: [tk, I], expert-sorted slot rows
  void* yslot;                // down: [tk, H] in the input dtype, row t * k + j
  const int* slot_origin;     // each expert-sorted slot's pair t * k + j (down: its yslot row)
  const float* slot_weight;   // down: its routing weight
  const void* hidden;         // gate_up: [T, H], whose rows its producer warpgroup gathers
  at::cuda::detail::IntDivider<unsigned> per_token;  // gate_up: a pair's token (pair / top_k) by multiply and shift
};

// gate_up: rows (l / 4, l / 4 + 8) of warp w are the gate and up of intermediate 8 w + l / 4 of consumer c's 32.
template <typename T, int N>
__device__ __forceinline__ void gate_up_epilogue(const float (&d)[N / 2], const WsGemmParams& p, const WsItem& item,
                                                 int c, int warp, int lane) {
  const int i = item.tile * WsShape<true>::TILE + 32 * c + 8 * warp + lane / 4;
  if (i >= p.rows_out) return;
  T* act = static_cast<T*>(p.act);
  wgmma_for_each_column<N>(lane, [&](int col, int reg) {
    if (col < item.cols)
      act[static_cast<int64_t>(item.slot0 + col) * p.rows_out + i] = from_float<T>(silu_mul(d[reg], d[reg + 2]));
  });
}
// down: rows (l / 4, l / 4 + 8) of warp w are output rows h and h + 8 of consumer c's 64. The item's yslot rows and
// routing weights come staged in shared memory (origin, weight: ws_gemm_kernel).
template <typename T, int N>
__device__ __forceinline__ void down_epilogue(const float (&d)[N / 2], const WsGemmParams& p, const WsItem& item,
                                              const int* origin, const float* weight, int c, int warp, int lane) {
  const int h = item.tile * WsShape<false>::TILE + 64 * c + 16 * warp + lane / 4;
  wgmma_for_each_column<N>(lane, [&](int col, int reg) {
    if (col < item.cols) {
      T* row = static_cast<T*>(p.yslot) + static_cast<int64_t>(origin[col]) * p.rows_out;
      const float w = weight[col];
      if (h < p.rows_out) row[h] = from_float<T>(w * d[reg]);
      if (h + 8 < p.rows_out) row[h + 8] = from_float<T>(w * d[reg + 2]);
    }
  });
}

// Stage s of the ring expects its bytes and gets the weight boxes of k step ks of `item`. A partial last tile:
// consumers whose rows all lie past I (H) get no box (their results are not stored).
template <bool GATED, int N>
__device__ __forceinline__ void load_weight_stage(const WsGemmParams& p, const CUtensorMap& weights, const WsItem& item,
                                                  int ks, uint32_t stage, uint32_t bar) {
  using S = WsShape<GATED, N>;
  const int first_row = item.tile * S::TILE, rows_per_consumer = GATED ? 32 : 64;
  const int live = min(S::CONSUMERS, (p.rows_out - first_row + rows_per_consumer - 1) / rows_per_consumer);
  // the weight boxes, and down's token box (gate_up's token rows arrive by cp.async, counted as arrivals)
  tma::mbar_arrive_expect_tx(bar, live * kBox + (GATED ? 0 : N * 128));
  // The weights are read once per call: evict first, meant to keep act and the slot outputs in L2 and the write-back
  // of dirty lines off this stream (b256/M16 61.1 -> 58.3 us, M32 92.6 -> 87.4; device_runs/session52.txt, calls 4
  // and 7)
  const uint64_t policy = evict_first_policy();
  for (int c = 0; c < live; ++c) {
    if constexpr (GATED)  // 4 groups of 8 intermediates from group (tile * 96 + 32 c) / 8
      tma::load_5d_hint(stage + c * kBox, &weights, ks * kStep, 0, 0, (first_row + 32 * c) / 8, item.expert, bar,
                        policy);
    else
      tma::load_3d_hint(stage + c * kBox, &weights, ks * kStep, first_row + 64 * c, item.expert, bar, policy);
  }
}

// A read of the plan kernel's output. L2: through L2 (ld.global.cg), as down's producer reads its first item before
// its PDL wait, when L2 is where the plan kernel's writes are visible (see produce_down).
template <bool L2, typename V>
__device__ __forceinline__ V load_plan(const V* x) {
  return L2 ? __ldcg(x) : *x;
}

// Item `it` of the GEMM from its chunk's entry.
template <bool L2 = false>
__device__ __forceinline__ WsItem ws_item(const WsGemmParams& p, int it) {
  const int chunk = it / p.tiles;
  const int4 v = load_plan<L2>(reinterpret_cast<const int4*>(p.chunks + chunk));
  return WsItem{v.x, it - chunk * p.tiles, v.z, v.w};
}

// The GEMM's item count (chunks x tiles).
template <bool L2 = false>
__device__ __forceinline__ int ws_item_count(const WsGemmParams& p) {
  return load_plan<L2>(p.chunk_count) * p.tiles;
}

// gate_up's producer (warpgroup 0): per item and k step, thread 0 loads the weight boxes with TMA and the warpgroup
// gathers the item's token rows straight from hidden with cp.async (8 threads per 128-byte row segment, in the
// 128-byte swizzle wgmma reads), each thread's copies arriving on the stage's full barrier when they land
// (cp.async.mbarrier.arrive.noinc: the barrier counts kGatherThreads of them besides the TMA's). Columns past the
// item's slots are zero-filled. This replaces the plan kernel's copy of every slot's hidden row in expert order, one
// TMA box per stage (8 MB written and read back at b256). H200, session 28 (device_runs/session28.txt), with the
// token list in shared memory and every thread polling (branch wip/ws-gather's first commit): the plan kernel 7.1 ->
// 4.8 us at b256/M16, the op 97.6-98.0 -> 92.5-93.1 us at Qwen3 b256/M32 and 170.2 -> 164.1 at M64, M16 unchanged
// (65.0: gate_up ends with its weight stream), but OLMoE b256/M16 90.8 -> 101.4 (not diagnosed). Gathered by one
// warp, 40 copies per thread and stage at N = 160, gate_up took twice as long (b256/M16 104.5 us).
template <int N>
__device__ __forceinline__ void produce_gate_up(const WsGemmParams& p, const CUtensorMap& weights, uint32_t ring,
                                                uint32_t full0, uint32_t empty0, int nk, int tid) {
  using S = WsShape<true, N>;
  // thread tid copies chunk tid % 8 of the item's columns tid / 8 + kRowStep i; kRowStep is a multiple of the
  // swizzle's 8 rows, so column kRowStep i + r lands at column r's offset + kRowStep i rows (an immediate)
  constexpr int kRowStep = kGatherThreads / 8, kRows = N / kRowStep;
  static_assert(N % kRowStep == 0 && kRowStep % 8 == 0, "every gathering thread takes the same rows of each stage");
  static_assert(kGatherThreads == 128, "the gatherers are warpgroup 0 (ws_gemm_kernel), counted by the full barriers");
  cuda::pdl_wait();
  cuda::pdl_launch_dependents();  // never before the wait (see produce_down)
  const int n_items = ws_item_count(p);
  const char* hidden = static_cast<const char*>(p.hidden);
  const int64_t row_bytes = static_cast<int64_t>(p.K) * 2;
  const int sub = tid >> 3, ch = tid & 7, lane = tid & 31;
  const uint32_t chunk_offset = swz128(sub, ch);
  int g = 0;  // this CTA's stages so far (ring slot, mbarrier parity)
  for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
    const WsItem item = ws_item(p, it);
    int origin[kRows];  // loaded here, used after the item's first weight boxes went out
#pragma unroll
    for (int i = 0; i < kRows; ++i) {
      const int col = kRowStep * i + sub;
      origin[i] = col < item.cols ? p.slot_origin[item.slot0 + col] : -1;
    }
    const char* src[kRows] = {};  // set at the item's first k step (nk >= 1: H and I are multiples of 64)
    for (int ks = 0; ks < nk; ++ks, ++g) {
      const int s = g % S::STAGES;
      const uint32_t stage = ring + s * S::STAGE_BYTES, bar = full0 + 8 * s;
      // one lane per warp polls the slot's release (the consumers' wgmmas have read it); the warp follows it
      if (g >= S::STAGES && lane == 0) tma::mbar_wait(empty0 + 8 * s, (g / S::STAGES - 1) & 1);
      __syncwarp();
      if (tid == 0) load_weight_stage<true, N>(p, weights, item, ks, stage, bar);
      if (ks == 0) {
#pragma unroll
        for (int i = 0; i < kRows; ++i)
          src[i] = hidden + (origin[i] >= 0 ? p.per_token.div(origin[i]) * row_bytes : 0) + ch * 16;
      }
      const uint32_t tokens = stage + S::A_BYTES + chunk_offset;
#pragma unroll
      for (int i = 0; i < kRows; ++i)
        cp_async16_zfill(tokens + i * kRowStep * 128, src[i] + ks * 128, origin[i] >= 0);
      tma::cp_async_mbar_arrive_noinc(bar);
    }
  }
  // none of this thread's copies outlives it (wait_group counts committed groups only: commit them first)
  cp_async_commit();
  cp_async_wait<0>();
}

// down's producer (thread 0 of warpgroup 0): per item and k step, the weight boxes and the act box into the ring. It
// issues the weights of its first item's first STAGES k steps before its PDL wait: its items come from the plan
// kernel, which completed before any gate_up CTA passed its own wait, and a down CTA runs only after every gate_up CTA
// has (PDL launches a grid's dependents once all its CTAs triggered, and gate_up triggers after its wait); only the
// act boxes, which gate_up writes, wait. So a down CTA that lands on an SM freed early by gate_up streams its first
// stages while the rest of gate_up finishes.
template <int N>
__device__ __forceinline__ void produce_down(const WsGemmParams& p, const CUtensorMap& weights,
                                             const CUtensorMap& act, uint32_t ring, uint32_t full0, uint32_t empty0,
                                             int nk) {
  using S = WsShape<false, N>;
  int early = 0;  // k steps of the first item whose weights went out before the wait
  WsItem first{};
  if (static_cast<int>(blockIdx.x) < ws_item_count<true>(p)) {
    first = ws_item<true>(p, blockIdx.x);
    early = min(S::STAGES, nk);
    for (int ks = 0; ks < early; ++ks)
      load_weight_stage<false, N>(p, weights, first, ks, ring + ks * S::STAGE_BYTES, full0 + 8 * ks);
  }
  cuda::pdl_wait();
  cuda::pdl_launch_dependents();  // never before the wait: down's producer reads the plan's items before its own
  const int n_items = ws_item_count(p);
  // the early weights belong to the item the consumers read now (its tile is blockIdx.x's in both reads; the expert
  // could differ if the plan's writes were not visible before the wait): else hang or mix, so fail loudly
  if (early > 0 && static_cast<int>(blockIdx.x) >= n_items) __trap();
  int g = 0;  // this CTA's stages so far (ring slot, mbarrier parity)
  for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
    const WsItem item = ws_item(p, it);
    if (g < early && item.expert != first.expert) __trap();  // (g < early: the first item only)
    for (int ks = 0; ks < nk; ++ks, ++g) {
      const int s = g % S::STAGES;
      const uint32_t stage = ring + s * S::STAGE_BYTES, bar = full0 + 8 * s;
      if (g >= early) {
        if (g >= S::STAGES) tma::mbar_wait(empty0 + 8 * s, (g / S::STAGES - 1) & 1);
        load_weight_stage<false, N>(p, weights, item, ks, stage, bar);
      }
      tma::load_2d(stage + S::A_BYTES, &act, ks * kStep, item.slot0, bar);
    }
  }
}

template <typename T, bool GATED, int N>
__global__ void __launch_bounds__(WsShape<GATED, N>::THREADS, 1)
    ws_gemm_kernel(const WsGemmParams p, const __grid_constant__ CUtensorMap weights,
                   const __grid_constant__ CUtensorMap act) {  // act: down's token rows (gate_up reads none)
  using S = WsShape<GATED, N>;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[S::STAGES], empty[S::STAGES];
  // down: the item's yslot rows and routing weights, which its epilogue reads per column (formerly from global memory
  // there, each load behind the previous column's stores: a round trip per column)
  __shared__ int s_origin[GATED ? 1 : N];
  __shared__ float s_weight[GATED ? 1 : N];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const int tid = threadIdx.x, wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;
  const uint32_t ring = smem_addr(smem), full0 = smem_addr(full), empty0 = smem_addr(empty);
  if (tid == 0) {
    for (int s = 0; s < S::STAGES; ++s) {
      tma::mbar_init(full0 + 8 * s, GATED ? 1 + kGatherThreads : 1);  // gate_up: + its gathers' cp.async arrivals
      tma::mbar_init(empty0 + 8 * s, S::CONSUMERS * 4);  // every consumer warp releases
    }
    tma::fence_mbarrier_init();
  }
  __syncthreads();
  const int nk = p.K / kStep;
  if constexpr (GATED) {
    if (wg == 0) {
      produce_gate_up<N>(p, weights, ring, full0, empty0, nk, tid);
      return;
    }
  } else if (tid == 0) {
    produce_down<N>(p, weights, act, ring, full0, empty0, nk);
    return;
  }
  cuda::pdl_wait();  // the items, token rows and (down) act come from the kernels before
  cuda::pdl_launch_dependents();  // never before the wait (see produce_down)
  if (wg == 0) return;
  const int n_items = ws_item_count(p);
  const int c = wg - 1;
  float d[N / 2];
  int g = 0;
  for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
    const WsItem item = ws_item(p, it);
    // down: consumer thread `col` loads the item's column col before the k loop and stages it after
    const int col = tid - 128;
    int origin = 0;
    float weight = 0.0f;
    if (!GATED && col < item.cols) {
      origin = p.slot_origin[item.slot0 + col];
      weight = p.slot_weight[item.slot0 + col];
    }
#pragma unroll
    for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
    int pending = -1;  // the ring slot whose wgmmas may still be reading it
    for (int ks = 0; ks < nk; ++ks, ++g) {
      const int s = g % S::STAGES;
      tma::mbar_wait(full0 + 8 * s, (g / S::STAGES) & 1);
      if constexpr (GATED) fence_proxy_async_shared();  // the gathered token rows, for wgmma's async-proxy reads
      const uint32_t stage = ring + s * S::STAGE_BYTES;
      const uint64_t da = wgmma_desc(stage + c * kBox), db = wgmma_desc(stage + S::A_BYTES);
      fence_registers<N / 2>(d);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kStep / 16; ++kk)
        wgmma_m64k16<T, N>(d, wgmma_desc_advance(da, kk * 32), wgmma_desc_advance(db, kk * 32));
      wgmma_commit();
      wgmma_wait_one();  // the previous stage's wgmmas are done: release its slot
      fence_registers<N / 2>(d);
      if (pending >= 0 && lane == 0) tma::mbar_arrive(empty0 + 8 * pending);
      pending = s;
    }
    wgmma_wait_all();
    fence_registers<N / 2>(d);
    if (lane == 0 && pending >= 0) tma::mbar_arrive(empty0 + 8 * pending);
    if constexpr (GATED) {
      gate_up_epilogue<T, N>(d, p, item, c, warp, lane);
    } else {
      cuda::named_barrier_sync(1, S::CONSUMERS * 128);  // the previous item's epilogue has read the staged column
      if (col < item.cols) {
        s_origin[col] = origin;
        s_weight[col] = weight;
      }
      cuda::named_barrier_sync(1, S::CONSUMERS * 128);
      down_epilogue<T, N>(d, p, item, s_origin, s_weight, c, warp, lane);
    }
  }
}

// ---- host side ------------------------------------------------------------------------------------------
using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled (through the runtime, so the library needs no -lcuda); null if unavailable.
EncodeTiled encode_tiled() {
  static const EncodeTiled fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult result{};
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault,
                                                           &result);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &f, cudaEnableDefault, &result);
#endif
    return e == cudaSuccess && result == cudaDriverEntryPointSuccess ? reinterpret_cast<EncodeTiled>(f) : nullptr;
  }();
  return fn;
}

// A tensor map over `rank` dimensions (dims innermost first, strides in bytes for dimensions 1..), boxes of `box`
// elements in the 128-byte swizzle wgmma reads; false if the driver refuses it.
bool encode(CUtensorMap& map, at::ScalarType dtype, const void* base, int rank, const cuuint64_t* dims,
            const cuuint64_t* strides, const cuuint32_t* box) {
  const EncodeTiled fn = encode_tiled();
  if (fn == nullptr) return false;
  const cuuint32_t elem[5] = {1, 1, 1, 1, 1};
  const CUtensorMapDataType type =
      dtype == at::kBFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return fn(&map, type, rank, const_cast<void*>(base), dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE,
            CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Token rows [rows, cols] (row-major) as the GEMMs' B operand: boxes of 64 columns x n rows.
bool encode_tokens(CUtensorMap& map, const at::Tensor& t, int n) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(t.size(1)), static_cast<cuuint64_t>(t.size(0))};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(t.size(1)) * 2};
  const cuuint32_t box[2] = {kStep, static_cast<cuuint32_t>(n)};
  return encode(map, t.scalar_type(), t.data_ptr(), 2, dims, strides, box);
}

// 1 in the image a device runs if that image is sm_90a code (wgmma, TMA), 0 in the sm_90 / sm_80 fallbacks, where
// the GEMMs would trap.
__device__ int ws_code_loaded = kWgmmaCompiled ? 1 : 0;

// Reads ws_code_loaded on the current device into `loaded`. Through a stream of its own, in the relaxed capture mode
// (as PyTorch's allocator calls cudaMalloc during capture), so that a first op call during stream capture (a graph
// captured before any eager call) gets the answer an eager call gets, and the graph holds what eager calls run. The
// mode is swapped by hand rather than by c10's guard, which throws on an error: nothing in this file may throw.
bool read_ws_code_loaded(int& loaded) {
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  if (cudaThreadExchangeStreamCaptureMode(&mode) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  cudaStream_t side = nullptr;
  bool read = cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) == cudaSuccess;
  if (read) {
    const cudaError_t copied =
        cudaMemcpyFromSymbolAsync(&loaded, ws_code_loaded, sizeof(int), 0, cudaMemcpyDeviceToHost, side);
    read = copied == cudaSuccess && cudaStreamSynchronize(side) == cudaSuccess;
    (void)cudaStreamDestroy(side);
  }
  (void)cudaThreadExchangeStreamCaptureMode(&mode);  // the caller's mode back
  if (!read) (void)cudaGetLastError();
  return read;
}

// Whether the device runs this build's sm_90a code: an sm_90 device, and the symbol above read once per device (a
// failed read answers no and asks again next time).
bool ws_available() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> known[kMaxDevices];  // 0 unknown, 1 no, 2 yes
  int device = 0, major = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= kMaxDevices) return false;
  const int cached = known[device].load(std::memory_order_acquire);
  if (cached != 0) return cached == 2;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) return false;
  int loaded = 0;
  if (major == 9 && !read_ws_code_loaded(loaded)) return false;  // no image for this device
  known[device].store(loaded == 1 ? 2 : 1, std::memory_order_release);
  return loaded == 1;
}

// Raises the dynamic shared-memory limit of ws_gemm_kernel<T, GATED, N>, once per device (as csrc/experts.cu's
// prepare; one flag per instance); false if the device refuses it.
template <typename T, bool GATED, int N>
bool allow_shared_memory() {
  constexpr int kMaxDevices = 64;
  static std::atomic<bool> done[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  if (device < kMaxDevices && done[device].load(std::memory_order_acquire)) return true;
  if (cudaFuncSetAttribute(ws_gemm_kernel<T, GATED, N>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           WsShape<GATED, N>::SMEM_BYTES) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (device < kMaxDevices) done[device].store(true, std::memory_order_release);
  return true;
}

template <typename T, bool GATED, int N>
void launch_ws_gemm(const WsGemmParams& p, const CUtensorMap& weights, const CUtensorMap& act, cudaStream_t stream,
                    bool pdl) {
  using S = WsShape<GATED, N>;
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  cuda::launch({dim3(sms), dim3(S::THREADS), S::SMEM_BYTES, stream, 0, pdl}, ws_gemm_kernel<T, GATED, N>, p, weights,
               act);
}

// false, having launched nothing, where a GEMM's shared memory cannot be had
template <typename T, int N>
bool launch_all(const PlanParams& plan, const WsGemmParams& gate_up, const WsGemmParams& down,
                const CUtensorMap (&maps)[3], cudaStream_t stream, bool pdl) {
  if (!allow_shared_memory<T, true, N>() || !allow_shared_memory<T, false, N>()) return false;
  const int plan_ctas = (plan.tk + kSlotsPerPlanCta - 1) / kSlotsPerPlanCta;
  cuda::launch({dim3(plan_ctas), dim3(kPlanThreads), 0, stream, 0, pdl}, ws_plan_kernel, plan);
  launch_ws_gemm<T, true, N>(gate_up, maps[0], maps[2], stream, pdl);  // (gate_up reads no token map)
  launch_ws_gemm<T, false, N>(down, maps[1], maps[2], stream, pdl);
  return true;
}

// Both dtypes' instances of one N.
template <int N>
bool launch_all_n(at::ScalarType dtype, const PlanParams& plan, const WsGemmParams& gate_up, const WsGemmParams& down,
                  const CUtensorMap (&maps)[3], cudaStream_t stream, bool pdl) {
  return dtype == at::kBFloat16 ? launch_all<__nv_bfloat16, N>(plan, gate_up, down, maps, stream, pdl)
                                : launch_all<__half, N>(plan, gate_up, down, maps, stream, pdl);
}

}  // namespace

double experts_ws_round_fill(int64_t experts, int64_t I, int64_t H, int sms) {
  if (experts <= 0 || sms <= 0) return 0.0;
  auto fill = [&](int64_t items) {
    const int64_t rounds = (items + sms - 1) / sms;
    return static_cast<double>(items) / static_cast<double>(rounds * sms);
  };
  return std::min(fill(experts * weight_tiles<true>(I)), fill(experts * weight_tiles<false>(H)));
}

bool experts_ws_launch(const at::Tensor& hidden, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                       const at::Tensor& gate_up_proj, const at::Tensor& down_proj, at::Tensor& act, at::Tensor& yslot,
                       int columns, cudaStream_t stream, bool pdl) {
  if (!ws_available()) return false;
  const int64_t H = hidden.size(1), k = expert_ids.size(1), tk = expert_ids.numel();
  const int64_t E = gate_up_proj.size(0), I = gate_up_proj.size(1) / 2;
  const int gate_up_tiles = static_cast<int>(weight_tiles<true>(I));
  const int down_tiles = static_cast<int>(weight_tiles<false>(H));
  // the sum over experts of ceil(count / columns) at most
  const int64_t chunks_bound = (tk + columns - 1) / columns + std::min(E, tk);
  const auto ints = hidden.options().dtype(at::kInt);
  at::Tensor slot_origin = at::empty({tk}, ints);
  at::Tensor slot_weight = at::empty({tk}, hidden.options().dtype(at::kFloat));
  at::Tensor chunks = at::empty({chunks_bound, 4}, ints);
  at::Tensor chunk_count = at::empty({1}, ints);

  CUtensorMap maps[3];  // gate_up weights, down weights, act
  // gate_up [E, 2I, H] as (h, intermediate in its group of 8, gate | up, group of 8, expert): a box of 64 h x 8 rows
  // x both halves x 4 groups lands as [group][gate | up][8 rows][64 h]
  const cuuint64_t g_dims[5] = {static_cast<cuuint64_t>(H), 8, 2, static_cast<cuuint64_t>(I / 8),
                                static_cast<cuuint64_t>(E)};
  const cuuint64_t g_strides[4] = {static_cast<cuuint64_t>(H) * 2, static_cast<cuuint64_t>(I * H) * 2,
                                   static_cast<cuuint64_t>(8 * H) * 2, static_cast<cuuint64_t>(2 * I * H) * 2};
  const cuuint32_t g_box[5] = {kStep, 8, 2, 4, 1};
  // down [E, H, I] as (i, h, expert): boxes of 64 i x 64 rows
  const cuuint64_t d_dims[3] = {static_cast<cuuint64_t>(I), static_cast<cuuint64_t>(H), static_cast<cuuint64_t>(E)};
  const cuuint64_t d_strides[2] = {static_cast<cuuint64_t>(I) * 2, static_cast<cuuint64_t>(H * I) * 2};
  const cuuint32_t d_box[3] = {kStep, 64, 1};
  if (!encode(maps[0], hidden.scalar_type(), gate_up_proj.data_ptr(), 5, g_dims, g_strides, g_box) ||
      !encode(maps[1], hidden.scalar_type(), down_proj.data_ptr(), 3, d_dims, d_strides, d_box) ||
      !encode_tokens(maps[2], act, columns))
    return false;

  PlanParams plan{};
  plan.ids = expert_ids.data_ptr<int32_t>();
  plan.weights = expert_weights.data_ptr<float>();
  plan.tk = static_cast<int>(tk);
  plan.E = static_cast<int>(E);
  plan.slot_origin = slot_origin.data_ptr<int>();
  plan.slot_weight = slot_weight.data_ptr<float>();
  plan.chunks = reinterpret_cast<WsItem*>(chunks.data_ptr<int>());
  plan.chunk_count = chunk_count.data_ptr<int>();
  plan.chunk = columns;
  WsGemmParams gate_up{};
  gate_up.chunks = plan.chunks;
  gate_up.chunk_count = plan.chunk_count;
  gate_up.tiles = gate_up_tiles;
  gate_up.K = static_cast<int>(H);
  gate_up.rows_out = static_cast<int>(I);
  gate_up.act = act.data_ptr();
  gate_up.slot_origin = plan.slot_origin;
  gate_up.hidden = hidden.data_ptr();
  gate_up.per_token = at::cuda::detail::IntDivider<unsigned>(static_cast<unsigned>(k));
  WsGemmParams down{};
  down.chunks = plan.chunks;
  down.chunk_count = plan.chunk_count;
  down.tiles = down_tiles;
  down.K = static_cast<int>(I);
  down.rows_out = static_cast<int>(H);
  down.yslot = yslot.data_ptr();
  down.slot_origin = plan.slot_origin;
  down.slot_weight = plan.slot_weight;
  const at::ScalarType dtype = hidden.scalar_type();
  switch (columns) {
    case 64: return launch_all_n<64>(dtype, plan, gate_up, down, maps, stream, pdl);
    case 80: return launch_all_n<80>(dtype, plan, gate_up, down, maps, stream, pdl);
    case 128: return launch_all_n<128>(dtype, plan, gate_up, down, maps, stream, pdl);
    case kMaxN: return launch_all_n<kMaxN>(dtype, plan, gate_up, down, maps, stream, pdl);
    default: return false;  // not an instance: the caller's fallback
  }
}

}  // namespace base_moe
