// Microbenchmark (standalone, not part of the library; session 16): a prototype of the warp-specialised expert GEMMs
// that notes/research_b256_s14.md proposes for large decode batches, on real data, checked against plain fp32
// references. Qwen3-30B-A3B's experts (E 128, I 768, H 2048, bf16, SiLU-gated) at batch 256 with 16 kept experts (each
// token's 8 slots on 8 distinct of the 16: ~128 tokens per expert).
//
//   nvcc -O3 -std=c++20 -arch=sm_90a -Icsrc/include benchmarks/micro/ws_experts.cu -o /tmp/ws_experts
//   /tmp/ws_experts
//
// Pipeline: pack (each slot's hidden-state row into expert-sorted order, xp [slots, H], so that an expert's token rows
// are one TMA box per k step: stream_rate.cu, session 16 call 3, found cp.async gathers of the same rows ~12 us slower
// under wgmmas), gate_up (act [slots, I] = SiLU(x W_gate) * (x W_up), expert-sorted rows), down (y_slot[token * k +
// place, H] = weight * act W_down), slot sum (y [T, H], each token's k rows added in order).
// Both GEMMs run one persistent CTA per SM: thread 0 of warpgroup 0 produces, the other warpgroups consume. An item is
// (expert, weight tile, chunk of <= N = 160 of its tokens); per k step of 64 elements the producer loads, on the
// stage's full mbarrier, one TMA box of 64 weight rows per consumer and one box of N token rows (B), in the 128-byte
// swizzle wgmma reads. Consumers run four m64n160k16 wgmmas per stage, keep one stage in flight (wait<1>) and release
// the previous one on its empty mbarrier (one arrival per consumer warp).
//   gate_up: 3 consumers, 96 intermediates per tile, K = H. Consumer c's box (5-D) holds 32 intermediates as 4 groups
//            of [8 gate rows, the same 8 up rows]: warp w's 16 accumulator rows are group w, so each thread's two rows
//            (lane / 4, lane / 4 + 8) are the gate and up of one intermediate, and SiLU(g) * u goes straight from the
//            registers to act (per store: 8 consecutive intermediates of 4 tokens).
//   down:    2 consumers, 128 output rows per tile (256 items on 132 SMs), K = I; B is act, already packed by expert.
//            Epilogue: weight * accumulator to the slot's token-major y_slot row (per store: 8 consecutive h of 4
//            rows).
// Session 16: gate_up alone (then ws_gate_up.cu) in call 5 with 4 stages and the up halves exchanged through shared
// memory: correct, 37.7 us; call 6 with the 5-D boxes and 5 stages: correct, 34.4 us (2.93 TB/s), pack 4.9 us.
// Call 7 (this file) and call 9 (epilogues on one column walk, now wgmma.cuh's wgmma_for_each_column): both GEMMs
// correct on 4 routings (act within 0.34% of max |ref|: bf16 rounding; y within 1.3e-6); gate_up 35.7 / 35.8 us
// (2.8 TB/s), down 28.4 / 27.8 us (1.8 TB/s), pack 5.8 / 5.5, slot sum 5.7 / 5.5: 75.6 / 74.6 us in all, against the
// library's 87.6 us for its expert op at this point. Down with 4 consumers over 256-row tiles (half the token-row
// traffic per weight byte) does not compile at N = 160: 640 threads leave 96 registers, the wgmma needs 106.
// Prints: the largest errors against the references, the kernels' microseconds (GEMMs: span from per-CTA globaltimer
// stamps; pack and slot sum: events over 20 back-to-back launches), medians over launches on 4 routings / expert sets.
// Then the timing cases (Mode: what limits the GEMMs) and gate_up's per-CTA phases. Session 17 (device_runs/
// session17.txt, calls 1-6): the token rows are not the limit (loaded once per CTA: -1.7 us), the GEMMs take as long
// without wgmmas; the weights alone stream at 36.6 GB/s per SM in the k loops, whatever the box shape, swizzle or
// expert placement; ~3 us pass before the first stage lands and ~3 more in the epilogue and exit.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "base_moe/experts_mma.cuh"
#include "base_moe/wgmma.cuh"
#include "check.cuh"

using namespace base_moe::experts_detail;

constexpr int H = 2048, I = 768, E = 128, TOP_K = 8, T = 256, KEPT = 16, SLOTS = T * TOP_K;
constexpr int N = 160;           // token columns per item (wgmma n)
constexpr int KSTEP = 64;        // elements per k step (128-byte rows)
constexpr int BOX_A = 64 * 128;  // one consumer's 64 weight rows of a k step
constexpr int ROUTINGS = 4;

// Timing cases besides the real GEMM (kFull); all but kFull leave garbage outputs. kTokensOnce: the token box is loaded
// once per CTA into its own region and every stage's wgmmas read it, so the ring streams the weights alone. kNoMma: the
// consumers wait for each stage and release it without wgmmas (the kernel's stream alone). kNoLoad: the producer
// arrives on each stage's full barrier without loading (the wgmmas and the pipeline's handshakes alone). kWeightsOnly:
// no wgmmas, no token boxes (the weight stream alone). kFlat: kWeightsOnly with gate_up's weights as plain boxes of 64
// consecutive rows (3-D map; down's boxes are that already). kFlatOneBox (gate_up): kFlat with one box of the tile's
// 192 rows per stage, as stream_rate.cu's ws3 loader reads.
enum Mode { kFull, kTokensOnce, kNoMma, kNoLoad, kWeightsOnly, kFlat, kFlatOneBox };

// The two GEMMs' shapes (see the header).
template <bool GATED, int MODE = kFull>
struct Gemm {
  static constexpr bool B_ONCE = MODE == kTokensOnce;
  static constexpr bool B_IN_RING = MODE == kFull || MODE == kNoMma || MODE == kNoLoad;
  static constexpr bool MMA = MODE == kFull || MODE == kTokensOnce || MODE == kNoLoad;
  static constexpr int CONSUMERS = GATED ? 3 : 2;
  static constexpr int TILE = GATED ? 96 : 128;  // intermediates (gate_up) or output rows (down) per tile
  static constexpr int TILES = (GATED ? I : H) / TILE;
  static constexpr int NK = (GATED ? H : I) / KSTEP;
  static constexpr int STAGES = GATED ? 5 : 6;
  static constexpr int A_BYTES = CONSUMERS * BOX_A;
  static constexpr int B_BYTES = N * 128;
  static constexpr int STAGE_BYTES = A_BYTES + (B_IN_RING ? B_BYTES : 0);
  static constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + (B_ONCE ? B_BYTES : 0) + 1024;  // + 1 KB: swizzle alignment
  static constexpr int THREADS = 128 * (CONSUMERS + 1);
};

struct Item {
  int expert, tile, slot0, cols;  // cols: the chunk's tokens (<= N), expert-sorted slots slot0..
};
struct Outputs {
  __nv_bfloat16* act;        // gate_up: [SLOTS, I], expert-sorted slot rows
  float* y_slot;             // down: [T * TOP_K, H]
  const int* slot_origin;    // down: each expert-sorted slot's y_slot row (token * TOP_K + place)
  const float* slot_weight;  // down: its routing weight
};
struct Stamp {
  unsigned long long start, end;
  unsigned long long first, loop_end;  // consumer thread 128: its first stage landed; its last item's k loop ended
  unsigned cycles, pad;
};

template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  BASE_MOE_WGMMA("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  BASE_MOE_WGMMA("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

// xp[r] = x[slot_token[r]]: each slot's hidden-state row, in expert-sorted slot order (one CTA per row).
__global__ void pack_kernel(const __nv_bfloat16* x, const int* slot_token, __nv_bfloat16* xp) {
  const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(slot_token[blockIdx.x]) * H);
  uint4* dst = reinterpret_cast<uint4*>(xp + static_cast<int64_t>(blockIdx.x) * H);
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) dst[i] = src[i];
}

// y[t, h] = sum over places j (in order) of y_slot[t * TOP_K + j, h]; one thread per 4 h.
__global__ void slot_sum_kernel(const float* y_slot, float* y) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= T * H / 4) return;
  const int t = idx / (H / 4), h4 = idx % (H / 4);
  float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int j = 0; j < TOP_K; ++j) {
    const float4 v = reinterpret_cast<const float4*>(y_slot)[(t * TOP_K + j) * (H / 4) + h4];
    acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
  }
  reinterpret_cast<float4*>(y)[idx] = acc;
}

// gate_up: rows (l / 4, l / 4 + 8) of warp w are the gate and up of intermediate 8 w + l / 4 of the consumer's 32.
__device__ __forceinline__ void gate_up_epilogue(const float (&d)[N / 2], const Item& item, int c, int warp, int lane,
                                                 __nv_bfloat16* act) {
  const int i = item.tile * Gemm<true>::TILE + 32 * c + 8 * warp + lane / 4;
  wgmma_for_each_column<N>(lane, [&](int col, int reg) {
    const float g = d[reg], u = d[reg + 2];
    if (col < item.cols)
      act[static_cast<int64_t>(item.slot0 + col) * I + i] = __float2bfloat16(g / (1.0f + __expf(-g)) * u);
  });
}
// down: rows (l / 4, l / 4 + 8) of warp w are output rows h and h + 8 of the consumer's 64.
__device__ __forceinline__ void down_epilogue(const float (&d)[N / 2], const Item& item, int c, int warp, int lane,
                                              const Outputs& out) {
  const int h = item.tile * Gemm<false>::TILE + 64 * c + 16 * warp + lane / 4;
  wgmma_for_each_column<N>(lane, [&](int col, int reg) {
    if (col < item.cols) {
      const int slot = item.slot0 + col;
      float* row = out.y_slot + static_cast<int64_t>(out.slot_origin[slot]) * H;
      const float w = out.slot_weight[slot];
      row[h] = w * d[reg];
      row[h + 8] = w * d[reg + 2];
    }
  });
}

template <bool GATED, int MODE>
__global__ void __launch_bounds__(Gemm<GATED>::THREADS, 1)
    ws_gemm_kernel(const Item* items, int n_items, Outputs out, const __grid_constant__ CUtensorMap wmap,
                   const __grid_constant__ CUtensorMap bmap, Stamp* stamps) {
  using G = Gemm<GATED, MODE>;
  constexpr bool B_ONCE = G::B_ONCE;
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[G::STAGES], empty[G::STAGES];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const unsigned long long t0 = globaltimer();
  const long long c0 = clock64();
  const int tid = threadIdx.x, wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;
  const uint32_t ring = smem_addr(smem), full0 = smem_addr(full), empty0 = smem_addr(empty);
  if (tid == 0) {
    for (int s = 0; s < G::STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, G::CONSUMERS * 4);  // every consumer warp releases
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  if (wg == 0) {
    if constexpr (GATED) setmaxnreg_dec<40>();  // four warpgroups: the consumers take the producer's registers
    if (tid == 0) {
      int g = 0;  // this CTA's k steps so far (ring slot, mbarrier parity)
      for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
        const Item item = items[it];
        for (int ks = 0; ks < G::NK; ++ks, ++g) {
          const int s = g % G::STAGES;
          if (g >= G::STAGES) mbar_wait(empty0 + 8 * s, (g / G::STAGES - 1) & 1);
          const uint32_t stage = ring + s * G::STAGE_BYTES, bar = full0 + 8 * s;
          if (MODE == kNoLoad) {
            mbar_arrive(bar);
            continue;
          }
          mbar_arrive_expect_tx(bar, G::STAGE_BYTES + (B_ONCE && g == 0 ? G::B_BYTES : 0));
          for (int c = 0; c < G::CONSUMERS; ++c) {
            if constexpr (GATED && MODE == kFlatOneBox) {
              if (c == 0) load_3d(stage, &wmap, ks * KSTEP, item.tile * 2 * G::TILE, item.expert, bar);
            } else if constexpr (GATED && MODE == kFlat)
              load_3d(stage + c * BOX_A, &wmap, ks * KSTEP, item.tile * 2 * G::TILE + 64 * c, item.expert, bar);
            else if constexpr (GATED)  // 4 groups of 8 intermediates from group (tile * 96 + 32 c) / 8
              load_5d(stage + c * BOX_A, &wmap, ks * KSTEP, 0, 0, (item.tile * G::TILE + 32 * c) / 8, item.expert, bar);
            else
              load_3d(stage + c * BOX_A, &wmap, ks * KSTEP, item.tile * G::TILE + 64 * c, item.expert, bar);
          }
          if (G::B_IN_RING || (B_ONCE && g == 0))  // rows past the slots: zeros
            load_2d(B_ONCE ? ring + G::STAGES * G::STAGE_BYTES : stage + G::A_BYTES, &bmap, ks * KSTEP, item.slot0, bar);
        }
      }
    }
  } else {
    if constexpr (GATED) setmaxnreg_inc<152>();
    const int c = wg - 1;
    float d[N / 2];
    int g = 0;
    for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
      const Item item = items[it];
#pragma unroll
      for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
      int pending = -1;  // the ring slot whose wgmmas may still be reading it
      for (int ks = 0; ks < G::NK; ++ks, ++g) {
        const int s = g % G::STAGES;
        mbar_wait(full0 + 8 * s, (g / G::STAGES) & 1);
        if (g == 0 && tid == 128) stamps[blockIdx.x].first = globaltimer();
        const uint32_t stage = ring + s * G::STAGE_BYTES;
        const uint64_t da = wgmma_desc(stage + c * BOX_A);
        const uint64_t db = wgmma_desc(B_ONCE ? ring + G::STAGES * G::STAGE_BYTES : stage + G::A_BYTES);
        fence_registers<N / 2>(d);
        if constexpr (G::MMA) {
          wgmma_fence();
#pragma unroll
          for (int kk = 0; kk < 4; ++kk)
            wgmma_m64k16<__nv_bfloat16, N>(d, wgmma_desc_advance(da, kk * 32), wgmma_desc_advance(db, kk * 32));
          wgmma_commit();
          wgmma_wait_one();
        }  // the previous stage's wgmmas are done: release its slot
        fence_registers<N / 2>(d);
        if (pending >= 0 && lane == 0) mbar_arrive(empty0 + 8 * pending);
        pending = s;
      }
      wgmma_wait_all();
      if (tid == 128) stamps[blockIdx.x].loop_end = globaltimer();
      fence_registers<N / 2>(d);
      if (lane == 0) mbar_arrive(empty0 + 8 * pending);
      if constexpr (GATED)
        gate_up_epilogue(d, item, c, warp, lane, out.act);
      else
        down_epilogue(d, item, c, warp, lane, out);
    }
  }
  __syncthreads();
  if (tid == 0) {
    stamps[blockIdx.x].start = t0;
    stamps[blockIdx.x].end = globaltimer();
    stamps[blockIdx.x].cycles = static_cast<unsigned>(clock64() - c0);
  }
}

// act_ref[r, i] in fp32 from the same bf16 inputs; thread (i, r) with r fastest, so a warp reads one weight row
// (slots are sorted by expert) and 32 hidden rows.
__global__ void gate_up_reference(const __nv_bfloat16* x, const __nv_bfloat16* w, const int* slot_token,
                                  const int* slot_expert, float* ref) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= SLOTS * I) return;
  const int r = idx % SLOTS, i = idx / SLOTS;
  const __nv_bfloat16* xr = x + static_cast<int64_t>(slot_token[r]) * H;
  const __nv_bfloat16* gw = w + (static_cast<int64_t>(slot_expert[r]) * 2 * I + i) * H;
  const __nv_bfloat16* uw = gw + static_cast<int64_t>(I) * H;
  float g = 0.0f, u = 0.0f;
  for (int h = 0; h < H; ++h) {
    const float xv = __bfloat162float(xr[h]);
    g += xv * __bfloat162float(gw[h]);
    u += xv * __bfloat162float(uw[h]);
  }
  ref[static_cast<int64_t>(r) * I + i] = g / (1.0f + expf(-g)) * u;
}

// y_ref[t, h] in fp32 from the gate_up kernel's act (so that it checks the down GEMM and the slot sum alone):
// sum over the token's places j of weight * act[slot] . W_down[expert, h]; thread (t, h) with h fastest.
__global__ void down_reference(const __nv_bfloat16* act, const __nv_bfloat16* wd, const int* token_slot,
                               const int* slot_expert, const float* slot_weight, float* ref) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= T * H) return;
  const int t = idx / H, h = idx % H;
  float y = 0.0f;
  for (int j = 0; j < TOP_K; ++j) {
    const int r = token_slot[t * TOP_K + j];
    const __nv_bfloat16* a = act + static_cast<int64_t>(r) * I;
    const __nv_bfloat16* w = wd + (static_cast<int64_t>(slot_expert[r]) * H + h) * I;
    float dot = 0.0f;
    for (int i = 0; i < I; ++i) dot += __bfloat162float(a[i]) * __bfloat162float(w[i]);
    y += slot_weight[r] * dot;
  }
  ref[idx] = y;
}

__global__ void fill_kernel(__nv_bfloat16* v, int64_t n, uint32_t salt, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9e3779b9u ^ salt;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    v[i] = __float2bfloat16((static_cast<float>(h >> 8) / 16777216.0f * 2.0f - 1.0f) * scale);
  }
}

// Token rows [rows, cols] (bf16, row-major) as the GEMMs' B operand: boxes of 64 columns x N rows.
CUtensorMap token_map(void* base, int rows, int cols) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {KSTEP, N};
  return encode_bf16_map(base, 2, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_128B);
}

struct Routing {
  std::vector<int> slot_token, slot_expert, slot_origin, token_slot;
  std::vector<float> slot_weight;
  std::vector<Item> gate_up_items, down_items;
  int *d_token, *d_expert, *d_origin, *d_token_slot;
  float* d_weight;
  Item *d_gate_up_items, *d_down_items;
  __nv_bfloat16 *xp, *act;
  float *y_slot, *y;
  CUtensorMap xmap, amap;
};

// KEPT distinct random experts; every token's TOP_K places on distinct ones of them with random weights summing to 1;
// slots sorted by expert, then token; items per expert: chunks of <= N tokens x weight tiles.
Routing draw_routing(uint32_t& lcg) {
  auto next = [&] {
    lcg = lcg * 1664525u + 1013904223u;
    return lcg >> 8;
  };
  std::vector<int> kept;
  while (static_cast<int>(kept.size()) < KEPT) {
    const int e = static_cast<int>(next() % E);
    if (std::find(kept.begin(), kept.end(), e) == kept.end()) kept.push_back(e);
  }
  std::sort(kept.begin(), kept.end());
  std::vector<std::vector<int>> places_of(KEPT);  // token * TOP_K + place, per kept expert
  std::vector<float> weight(T * TOP_K);
  for (int t = 0; t < T; ++t) {
    std::vector<int> order(KEPT);
    for (int j = 0; j < KEPT; ++j) order[j] = j;
    float total = 0.0f;
    for (int j = 0; j < TOP_K; ++j) {
      std::swap(order[j], order[j + next() % (KEPT - j)]);
      places_of[order[j]].push_back(t * TOP_K + j);
      weight[t * TOP_K + j] = 0.05f + static_cast<float>(next() % 1000) / 1000.0f;
      total += weight[t * TOP_K + j];
    }
    for (int j = 0; j < TOP_K; ++j) weight[t * TOP_K + j] /= total;
  }
  Routing r;
  r.token_slot.assign(T * TOP_K, 0);
  for (int a = 0; a < KEPT; ++a) {
    const int slot0 = static_cast<int>(r.slot_token.size()), count = static_cast<int>(places_of[a].size());
    for (int place : places_of[a]) {
      r.token_slot[place] = static_cast<int>(r.slot_token.size());
      r.slot_token.push_back(place / TOP_K);
      r.slot_expert.push_back(kept[a]);
      r.slot_origin.push_back(place);
      r.slot_weight.push_back(weight[place]);
    }
    for (int chunk = 0; chunk * N < count; ++chunk) {
      const int first = slot0 + chunk * N, cols = std::min(N, count - chunk * N);
      for (int tile = 0; tile < Gemm<true>::TILES; ++tile) r.gate_up_items.push_back(Item{kept[a], tile, first, cols});
      for (int tile = 0; tile < Gemm<false>::TILES; ++tile) r.down_items.push_back(Item{kept[a], tile, first, cols});
    }
  }
  return r;
}

template <typename V>
V* to_device(const std::vector<V>& v) {
  V* d;
  CHECK(cudaMalloc(&d, v.size() * sizeof(V)));
  CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(V), cudaMemcpyHostToDevice));
  return d;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// max |got - want| / max |want| over n values, and how many got values are not finite (unwritten: NaN fill)
template <typename V>
void compare(const char* what, int routing, const V* got_dev, const float* want_dev, size_t n) {
  std::vector<V> got(n);
  std::vector<float> want(n);
  CHECK(cudaMemcpy(got.data(), got_dev, n * sizeof(V), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(want.data(), want_dev, n * 4, cudaMemcpyDeviceToHost));
  double max_err = 0, max_ref = 0;
  int bad = 0;
  for (size_t j = 0; j < n; ++j) {
    const double e = std::fabs(static_cast<double>(static_cast<float>(got[j])) - want[j]);
    if (!(e <= 1e30)) ++bad;
    else max_err = std::max(max_err, e);
    max_ref = std::max(max_ref, static_cast<double>(std::fabs(want[j])));
  }
  std::printf("routing %d %-8s max |got - ref| %.3g, max |ref| %.3g, ratio %.2e, %d not finite: %s\n", routing, what,
              max_err, max_ref, max_err / max_ref, bad, bad == 0 && max_err <= 1e-2 * max_ref ? "ok" : "FAIL");
}

template <bool GATED, int MODE = kFull>
void launch_gemm(const Routing& r, const CUtensorMap& wmap, Stamp* stamps, int sms) {
  const Outputs out{r.act, r.y_slot, r.d_origin, r.d_weight};
  const std::vector<Item>& items = GATED ? r.gate_up_items : r.down_items;
  using G = Gemm<GATED, MODE>;
  static bool ready = false;  // the shared-memory attribute, once per instance
  if (!ready) {
    CHECK(cudaFuncSetAttribute(ws_gemm_kernel<GATED, MODE>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               G::SMEM_BYTES));
    ready = true;
  }
  CHECK(cudaMemset(stamps, 0, sizeof(Stamp) * sms));  // CTAs without items leave first / loop_end at 0
  ws_gemm_kernel<GATED, MODE><<<sms, G::THREADS, G::SMEM_BYTES>>>(
      GATED ? r.d_gate_up_items : r.d_down_items, static_cast<int>(items.size()), out, wmap, GATED ? r.xmap : r.amap,
      stamps);
  CHECK(cudaGetLastError());
}

// The span of the last GEMM launch (first CTA start to last CTA end, us) and its CTAs' mean clock (MHz).
void span(Stamp* stamps, int sms, std::vector<double>& us, std::vector<double>& mhz) {
  std::vector<Stamp> s(sms);
  CHECK(cudaMemcpy(s.data(), stamps, sizeof(Stamp) * sms, cudaMemcpyDeviceToHost));
  unsigned long long first = ~0ull, last = 0;
  double cycles = 0, ns = 0;
  for (const Stamp& st : s) {
    first = std::min(first, st.start);
    last = std::max(last, st.end);
    cycles += st.cycles;
    ns += st.end - st.start;
  }
  us.push_back((last - first) / 1e3);
  mhz.push_back(cycles / ns * 1e3);
}

// Where one launch's time goes, medians over the CTAs that had items (us): start - first CTA's start, first - start
// (the first stage's latency), loop_end - first (the k loops), end - loop_end (the last epilogue and the exit).
struct Phases {
  std::vector<double> skew, first, loop, tail;
};
void phases(Stamp* stamps, int sms, Phases& ph) {
  std::vector<Stamp> s(sms);
  CHECK(cudaMemcpy(s.data(), stamps, sizeof(Stamp) * sms, cudaMemcpyDeviceToHost));
  unsigned long long first = ~0ull;
  for (const Stamp& st : s) first = std::min(first, st.start);
  std::vector<double> skew, lat, loop, tail;
  for (const Stamp& st : s) {
    if (st.first == 0) continue;
    skew.push_back((st.start - first) / 1e3);
    lat.push_back((st.first - st.start) / 1e3);
    loop.push_back((st.loop_end - st.first) / 1e3);
    tail.push_back((st.end - st.loop_end) / 1e3);
  }
  ph.skew.push_back(median(skew)), ph.first.push_back(median(lat)), ph.loop.push_back(median(loop));
  ph.tail.push_back(median(tail));
}
void print_phases(const char* what, const Phases& ph) {
  std::printf("  %-44s start skew %.2f, first stage %.2f, k loops %.2f, epilogue + exit %.2f us (CTA medians)\n", what,
              median(ph.skew), median(ph.first), median(ph.loop), median(ph.tail));
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  __nv_bfloat16 *w, *wd, *x;
  const int64_t w_elems = static_cast<int64_t>(E) * 2 * I * H, wd_elems = static_cast<int64_t>(E) * H * I;
  CHECK(cudaMalloc(&w, w_elems * 2));
  CHECK(cudaMalloc(&wd, wd_elems * 2));
  CHECK(cudaMalloc(&x, static_cast<int64_t>(T) * H * 2));
  fill_kernel<<<4 * sms, 256>>>(w, w_elems, 0x1234u, 0.05f);
  fill_kernel<<<4 * sms, 256>>>(wd, wd_elems, 0x4321u, 0.05f);
  fill_kernel<<<4 * sms, 256>>>(x, static_cast<int64_t>(T) * H, 0x9876u, 1.0f);
  CHECK(cudaGetLastError());
  // gate_up [E, 2I, H] as (h, intermediate in its group of 8, gate|up, group of 8, expert): a box of 64 h x 8 x both
  // halves x 4 groups lands as [group][gate|up][8 rows][64 h]
  const cuuint64_t gdims[5] = {H, 8, 2, I / 8, E};
  const cuuint64_t gstrides[4] = {H * 2ull, static_cast<cuuint64_t>(I) * H * 2, 8ull * H * 2, 2ull * I * H * 2};
  const cuuint32_t gbox[5] = {KSTEP, 8, 2, 4, 1};
  const CUtensorMap gmap = encode_bf16_map(w, 5, gdims, gstrides, gbox, CU_TENSOR_MAP_SWIZZLE_128B);
  // down [E, H, I] as (i, h, expert): a box of 64 i x 64 rows
  const cuuint64_t ddims[3] = {I, H, E};
  const cuuint64_t dstrides[2] = {I * 2ull, static_cast<cuuint64_t>(H) * I * 2};
  const cuuint32_t dbox[3] = {KSTEP, 64, 1};
  const CUtensorMap dmap = encode_bf16_map(wd, 3, ddims, dstrides, dbox, CU_TENSOR_MAP_SWIZZLE_128B);
  // gate_up as (h, row, expert), boxes of 64 h x 64 consecutive rows: timing case kFlat only
  const cuuint64_t fdims[3] = {H, 2 * I, E};
  const cuuint64_t fstrides[2] = {H * 2ull, static_cast<cuuint64_t>(2) * I * H * 2};
  const CUtensorMap flat_gmap = encode_bf16_map(w, 3, fdims, fstrides, dbox, CU_TENSOR_MAP_SWIZZLE_128B);
  uint32_t lcg = 2024u;
  std::vector<Routing> routings;
  for (int i = 0; i < ROUTINGS; ++i) {
    Routing r = draw_routing(lcg);
    r.d_token = to_device(r.slot_token);
    r.d_expert = to_device(r.slot_expert);
    r.d_origin = to_device(r.slot_origin);
    r.d_token_slot = to_device(r.token_slot);
    r.d_weight = to_device(r.slot_weight);
    r.d_gate_up_items = to_device(r.gate_up_items);
    r.d_down_items = to_device(r.down_items);
    CHECK(cudaMalloc(&r.xp, static_cast<int64_t>(SLOTS) * H * 2));
    CHECK(cudaMalloc(&r.act, static_cast<int64_t>(SLOTS) * I * 2));
    CHECK(cudaMalloc(&r.y_slot, static_cast<int64_t>(SLOTS) * H * 4));
    CHECK(cudaMalloc(&r.y, static_cast<int64_t>(T) * H * 4));
    // NaN everywhere: an output the kernels never write fails the check
    CHECK(cudaMemset(r.act, 0xff, static_cast<int64_t>(SLOTS) * I * 2));
    CHECK(cudaMemset(r.y_slot, 0xff, static_cast<int64_t>(SLOTS) * H * 4));
    r.xmap = token_map(r.xp, SLOTS, H);
    r.amap = token_map(r.act, SLOTS, I);
    routings.push_back(r);
  }
  Stamp* stamps;
  CHECK(cudaMalloc(&stamps, sizeof(Stamp) * sms));
  float* ref;
  CHECK(cudaMalloc(&ref, static_cast<int64_t>(SLOTS) * I * 4));
  auto run = [&](const Routing& r) {
    pack_kernel<<<SLOTS, 256>>>(x, r.d_token, r.xp);
    launch_gemm<true>(r, gmap, stamps, sms);
    launch_gemm<false>(r, dmap, stamps, sms);
    slot_sum_kernel<<<(T * H / 4 + 255) / 256, 256>>>(r.y_slot, r.y);
    CHECK(cudaGetLastError());
  };
  for (int i = 0; i < ROUTINGS; ++i) {
    const Routing& r = routings[i];
    run(r);
    int most = 0;
    for (const Item& it : r.gate_up_items) most = std::max(most, it.cols);
    std::printf("routing %d: %zu gate_up items, %zu down items, largest chunk %d tokens\n", i, r.gate_up_items.size(),
                r.down_items.size(), most);
    gate_up_reference<<<(SLOTS * I + 255) / 256, 256>>>(x, w, r.d_token, r.d_expert, ref);
    CHECK(cudaGetLastError());
    compare("act", i, r.act, ref, static_cast<size_t>(SLOTS) * I);
    down_reference<<<(T * H + 255) / 256, 256>>>(r.act, wd, r.d_token_slot, r.d_expert, r.d_weight, ref);
    CHECK(cudaGetLastError());
    compare("y", i, r.y, ref, static_cast<size_t>(T) * H);
  }
  // timing, rounds over the routings
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  constexpr int kBurst = 20;  // back-to-back launches per event pair: the launch gaps mostly hidden
  std::vector<double> pack_us, sum_us, gate_up_us, down_us, gate_up_mhz, down_mhz, case_mhz;
  std::vector<double> case_us[5][2];  // [mode - 1][gate_up, down]
  Phases full_phases, weights_phases;
  for (int rep = 0; rep < 10; ++rep) {
    for (const Routing& r : routings) {
      float ms;
      CHECK(cudaEventRecord(e0));
      for (int b = 0; b < kBurst; ++b) pack_kernel<<<SLOTS, 256>>>(x, r.d_token, r.xp);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      pack_us.push_back(ms * 1e3 / kBurst);
      launch_gemm<true>(r, gmap, stamps, sms);
      CHECK(cudaDeviceSynchronize());
      span(stamps, sms, gate_up_us, gate_up_mhz);
      phases(stamps, sms, full_phases);
      launch_gemm<false>(r, dmap, stamps, sms);
      CHECK(cudaDeviceSynchronize());
      span(stamps, sms, down_us, down_mhz);
      // the timing cases (garbage outputs from here)
      auto time_case = [&](auto launch_gate_up, auto launch_down, int mode) {
        launch_gate_up();
        CHECK(cudaDeviceSynchronize());
        span(stamps, sms, case_us[mode - 1][0], case_mhz);
        launch_down();
        CHECK(cudaDeviceSynchronize());
        span(stamps, sms, case_us[mode - 1][1], case_mhz);
      };
      time_case([&] { launch_gemm<true, kTokensOnce>(r, gmap, stamps, sms); },
                [&] { launch_gemm<false, kTokensOnce>(r, dmap, stamps, sms); }, kTokensOnce);
      time_case([&] { launch_gemm<true, kNoMma>(r, gmap, stamps, sms); },
                [&] { launch_gemm<false, kNoMma>(r, dmap, stamps, sms); }, kNoMma);
      time_case([&] { launch_gemm<true, kNoLoad>(r, gmap, stamps, sms); },
                [&] { launch_gemm<false, kNoLoad>(r, dmap, stamps, sms); }, kNoLoad);
      launch_gemm<true, kWeightsOnly>(r, gmap, stamps, sms);
      CHECK(cudaDeviceSynchronize());
      phases(stamps, sms, weights_phases);
      time_case([&] { launch_gemm<true, kWeightsOnly>(r, gmap, stamps, sms); },
                [&] { launch_gemm<false, kWeightsOnly>(r, dmap, stamps, sms); }, kWeightsOnly);
      time_case([&] { launch_gemm<true, kFlat>(r, flat_gmap, stamps, sms); },
                [&] { launch_gemm<false, kFlat>(r, dmap, stamps, sms); }, kFlat);
      CHECK(cudaEventRecord(e0));
      for (int b = 0; b < kBurst; ++b) slot_sum_kernel<<<(T * H / 4 + 255) / 256, 256>>>(r.y_slot, r.y);
      CHECK(cudaEventRecord(e1));
      CHECK(cudaEventSynchronize(e1));
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      sum_us.push_back(ms * 1e3 / kBurst);
    }
  }
  const double gate_up_bytes = static_cast<double>(KEPT) * 2 * I * H * 2, down_bytes = gate_up_bytes / 2;
  std::printf("gate_up span median %.1f us (%.2f TB/s, %.0f MHz) | down span median %.1f us (%.2f TB/s, %.0f MHz) | "
              "pack %.1f us | slot sum %.1f us | sum of the four %.1f us\n", median(gate_up_us),
              gate_up_bytes / median(gate_up_us) / 1e6, median(gate_up_mhz), median(down_us),
              down_bytes / median(down_us) / 1e6, median(down_mhz), median(pack_us), median(sum_us),
              median(gate_up_us) + median(down_us) + median(pack_us) + median(sum_us));
  const char* cases[5] = {"token box loaded once per CTA", "no wgmmas (stream only)", "no loads (wgmmas only)",
                          "weights only (no wgmmas, tokens)", "weights only, gate_up flat boxes"};
  for (int m = 0; m < 5; ++m)
    std::printf("%-30s gate_up %.1f us, down %.1f us\n", cases[m], median(case_us[m][0]), median(case_us[m][1]));
  // stream_rate.cu's loaders read 0x01 bytes: the weights-only case again on such weights (session 17)
  CHECK(cudaMemset(w, 1, w_elems * 2));
  CHECK(cudaMemset(wd, 1, wd_elems * 2));
  std::vector<double> ones_us[2], ones_mhz;
  for (int rep = 0; rep < 10; ++rep) {
    for (const Routing& r : routings) {
      launch_gemm<true, kWeightsOnly>(r, gmap, stamps, sms);
      CHECK(cudaDeviceSynchronize());
      span(stamps, sms, ones_us[0], ones_mhz);
      launch_gemm<false, kWeightsOnly>(r, dmap, stamps, sms);
      CHECK(cudaDeviceSynchronize());
      span(stamps, sms, ones_us[1], ones_mhz);
    }
  }
  std::printf("%-30s gate_up %.1f us, down %.1f us\n", "weights only, 0x01 bytes", median(ones_us[0]),
              median(ones_us[1]));
  // what else differs from ws3 (gate_up's weights alone): the swizzle, one 192-row box per stage, and the experts'
  // place (16 random of 128, or experts 0..15: one contiguous 100 MB region, ws3's flat buffer)
  auto flat_map = [&](uint32_t rows, CUtensorMapSwizzle swizzle) {
    const cuuint32_t box[3] = {KSTEP, rows, 1};
    return encode_bf16_map(w, 3, fdims, fstrides, box, swizzle);
  };
  const CUtensorMap flat_plain = flat_map(64, CU_TENSOR_MAP_SWIZZLE_NONE);
  const CUtensorMap one_box = flat_map(192, CU_TENSOR_MAP_SWIZZLE_NONE);
  std::vector<Routing> adjacent = routings;  // the same items on experts 0..15
  for (Routing& r : adjacent) {
    std::vector<Item> items = r.gate_up_items;
    std::vector<int> order;  // the routing's experts in item order
    for (Item& it : items) {
      auto at = std::find(order.begin(), order.end(), it.expert);
      if (at == order.end()) at = order.insert(order.end(), it.expert);
      it.expert = static_cast<int>(at - order.begin());
    }
    r.d_gate_up_items = to_device(items);
  }
  std::vector<double> bisect_us[4], bisect_mhz;
  Phases bisect_phases[4];
  for (int rep = 0; rep < 10; ++rep) {
    for (int i = 0; i < ROUTINGS; ++i) {
      auto time_gate_up = [&](auto launch, int slot) {
        launch();
        CHECK(cudaDeviceSynchronize());
        span(stamps, sms, bisect_us[slot], bisect_mhz);
        phases(stamps, sms, bisect_phases[slot]);
      };
      time_gate_up([&] { launch_gemm<true, kFlat>(routings[i], flat_plain, stamps, sms); }, 0);
      time_gate_up([&] { launch_gemm<true, kFlatOneBox>(routings[i], one_box, stamps, sms); }, 1);
      time_gate_up([&] { launch_gemm<true, kFlat>(adjacent[i], flat_plain, stamps, sms); }, 2);
      time_gate_up([&] { launch_gemm<true, kFlatOneBox>(adjacent[i], one_box, stamps, sms); }, 3);
    }
  }
  const char* bisect[4] = {"flat 64-row boxes, no swizzle", "one 192-row box, no swizzle",
                           "flat 64-row, experts 0..15", "one 192-row box, experts 0..15"};
  for (int m = 0; m < 4; ++m) std::printf("weights only, %-32s gate_up %.1f us\n", bisect[m], median(bisect_us[m]));
  std::printf("gate_up phases:\n");
  print_phases("real GEMM", full_phases);
  print_phases("weights only (5-D boxes, swizzled)", weights_phases);
  for (int m = 0; m < 4; ++m) print_phases(bisect[m], bisect_phases[m]);
  return 0;
}
