// Microbenchmark (standalone, not part of the library; session 16): a prototype of the warp-specialised gate_up GEMM
// that notes/research_b256_s14.md proposes for large decode batches, on real data, checked against a plain fp32
// reference. Qwen3-30B-A3B's gate_up (E 128, I 768, H 2048, bf16) at batch 256 with 16 kept experts (each token's 8
// slots on 8 distinct of the 16: ~128 tokens per expert).
//
//   nvcc -O3 -std=c++20 -arch=sm_90a -Icsrc/include benchmarks/micro/ws_gate_up.cu -o /tmp/ws_gate_up
//   /tmp/ws_gate_up
//
// Pipeline: a pack kernel copies each slot's hidden-state row into expert-sorted order (xp [slots, H]), so that an
// expert's token rows are one TMA box per k step (stream_rate.cu, session 16 call 3: cp.async gathers of the same rows
// cost ~12 us more under wgmmas). Then one persistent CTA per SM (4 warpgroups): thread 0 of warpgroup 0 produces,
// warpgroups 1-3 consume. An item is (expert, tile of 96 intermediates, chunk of <= N = 160 of its tokens); per k step
// of 64 elements the producer loads, on the stage's full mbarrier, three 5-D TMA boxes of the weights and one box of
// N token rows (B), all in the 128-byte swizzle wgmma reads. Consumer c's box holds 32 intermediates of the tile as 4
// groups of [8 gate rows, the same 8 up rows]: warp w's 16 accumulator rows are group w, so each thread's two rows
// (lane / 4, lane / 4 + 8) are the gate and up of one intermediate and the epilogue needs no exchange. Consumers run
// four m64n160k16 wgmmas per stage, keep one stage in flight (wait<1>) and release the previous one on its empty
// mbarrier. Epilogue per item: SiLU(g) * u straight from the accumulators to act [slots, I] (the down GEMM's B operand,
// packed by expert; per store, 8 consecutive intermediates of 4 tokens).
// Session 16, call 5 (first form: 32 gate + 32 up rows per consumer, the up halves passed through shared memory, 4
// stages): correct on 4 routings (max error 0.3% of max |ref|), 37.7 us. Call 6 (this form, 5 stages): correct, 34.4 us
// (min 33.1) at ~1770 MHz, 2.93 TB/s of weights; the pack 4.9 us. For scale: the library's expert op takes 87.6 us at
// this point (gate_up + down), and a pure stream of these 100 MB in the library kernel's tile shape 51 us.
// Prints: pack and gate_up microseconds (kernel span from per-CTA globaltimer stamps, median over launches on 4
// routings / expert sets), the SM clock, and the largest error against the reference.
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "base_moe/wgmma.cuh"
#include "check.cuh"

using namespace base_moe::experts_detail;

constexpr int H = 2048, I = 768, E = 128, TOP_K = 8, T = 256, KEPT = 16;
constexpr int TILE_I = 96;                  // intermediates per tile: 96 gate + 96 up weight rows
constexpr int CONSUMERS = 3;                // consumer warpgroups, 32 intermediates each
constexpr int N = 160;                      // token columns per item (wgmma n)
constexpr int STAGES = 5;
constexpr int KSTEP = 64;                   // elements per k step (128 bytes per row)
constexpr int NK = H / KSTEP;
constexpr int BOX_A = 64 * 128;             // one consumer's 4 x (8 gate + 8 up) rows
constexpr int A_BYTES = CONSUMERS * BOX_A;
constexpr int B_BYTES = N * 128;
constexpr int STAGE_BYTES = A_BYTES + B_BYTES;
constexpr int SMEM_BYTES = STAGES * STAGE_BYTES + 1024;
constexpr int ROUTINGS = 4;

struct Item {
  int expert, tile, slot0, cols;  // cols: the chunk's tokens (<= N), rows slot0.. of xp / act
};
struct Stamp {
  unsigned long long start, end;
  unsigned cycles, pad;
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void tma_5d(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, int c3, int c4,
                                       uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, "
      "%6}], [%7];" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(bar)
      : "memory");
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
  BASE_MOE_WGMMA("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
  BASE_MOE_WGMMA("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
__device__ __forceinline__ void wgmma_wait_1() { BASE_MOE_WGMMA("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

__device__ __forceinline__ void wgmma_m64n160k16_bf16(float* d, uint64_t desc_a, uint64_t desc_b) {
  BASE_MOE_WGMMA(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n160k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}, %80, %81, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

// xp[r] = x[slot_token[r]]: each slot's hidden-state row, in expert-sorted slot order (one CTA per row).
__global__ void pack_kernel(const __nv_bfloat16* x, const int* slot_token, __nv_bfloat16* xp) {
  const uint4* src = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(slot_token[blockIdx.x]) * H);
  uint4* dst = reinterpret_cast<uint4*>(xp + static_cast<int64_t>(blockIdx.x) * H);
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) dst[i] = src[i];
}

// One consumer warpgroup's epilogue of an item: act[slot0 + col, i0 + r] = SiLU(gate) * up for the item's cols
// tokens and 32 intermediates r. Thread (warp, lane) holds, per 8 token columns j, the gate (registers 4j, 4j + 1) and
// the up (4j + 2, 4j + 3) of intermediate 8 warp + lane / 4 at columns 8j + 2 (lane % 4) + {0, 1}.
__device__ __forceinline__ void epilogue(const float (&d)[N / 2], const Item& item, int c, int warp, int lane,
                                         __nv_bfloat16* act) {
  const int i = item.tile * TILE_I + 32 * c + 8 * warp + lane / 4;
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int col = 8 * j + 2 * (lane % 4) + b;
      const float g = d[4 * j + b], u = d[4 * j + 2 + b];
      if (col < item.cols)
        act[static_cast<int64_t>(item.slot0 + col) * I + i] = __float2bfloat16(g / (1.0f + __expf(-g)) * u);
    }
  }
}

__global__ void __launch_bounds__(128 * (CONSUMERS + 1), 1)
    ws_gate_up_kernel(const Item* items, int n_items, __nv_bfloat16* act, const __grid_constant__ CUtensorMap wmap,
                      const __grid_constant__ CUtensorMap xmap, Stamp* stamps) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);  // the swizzle wants 1 KB alignment
  const unsigned long long t0 = globaltimer();
  const long long c0 = clock64();
  const int tid = threadIdx.x, wg = tid / 128, warp = (tid / 32) % 4, lane = tid % 32;
  const uint32_t ring = smem_u32(smem), full0 = smem_u32(full), empty0 = smem_u32(empty);
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, 1);
      mbar_init(empty0 + 8 * s, CONSUMERS * 4);  // every consumer warp releases
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (wg == 0) {
    setmaxnreg_dec<40>();
    if (tid == 0) {
      int g = 0;  // this CTA's k steps so far (ring slot, mbarrier parity)
      for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
        const Item item = items[it];
        for (int ks = 0; ks < NK; ++ks, ++g) {
          const int s = g % STAGES;
          if (g >= STAGES) bar_wait(empty0 + 8 * s, (g / STAGES - 1) & 1);
          const uint32_t stage = ring + s * STAGE_BYTES, bar = full0 + 8 * s;
          mbar_arrive_expect_tx(bar, STAGE_BYTES);
          for (int c = 0; c < CONSUMERS; ++c)  // 4 groups of 8 intermediates from group (tile * 96 + 32 c) / 8
            tma_5d(stage + c * BOX_A, &wmap, ks * KSTEP, 0, 0, (item.tile * TILE_I + 32 * c) / 8, item.expert, bar);
          tma_2d(stage + A_BYTES, &xmap, ks * KSTEP, item.slot0, bar);  // rows past the slots: zeros
        }
      }
    }
  } else {
    setmaxnreg_inc<152>();
    const int c = wg - 1;
    float d[N / 2];
    int g = 0;
    for (int it = blockIdx.x; it < n_items; it += gridDim.x) {
      const Item item = items[it];
#pragma unroll
      for (int i = 0; i < N / 2; ++i) d[i] = 0.0f;
      int pending = -1;  // the ring slot whose wgmmas may still be reading it
      for (int ks = 0; ks < NK; ++ks, ++g) {
        const int s = g % STAGES;
        bar_wait(full0 + 8 * s, (g / STAGES) & 1);
        const uint32_t stage = ring + s * STAGE_BYTES;
        const uint64_t da = wgmma_desc(stage + c * BOX_A), db = wgmma_desc(stage + A_BYTES);
        fence_registers<N / 2>(d);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_m64n160k16_bf16(d, wgmma_desc_advance(da, kk * 32), wgmma_desc_advance(db, kk * 32));
        wgmma_commit();
        wgmma_wait_1();  // the previous stage's wgmmas are done: release its slot
        fence_registers<N / 2>(d);
        if (pending >= 0 && lane == 0) mbar_arrive(empty0 + 8 * pending);
        pending = s;
      }
      wgmma_wait_all();
      fence_registers<N / 2>(d);
      if (lane == 0) mbar_arrive(empty0 + 8 * pending);
      epilogue(d, item, c, warp, lane, act);
    }
  }
  __syncthreads();
  if (tid == 0) stamps[blockIdx.x] = Stamp{t0, globaltimer(), static_cast<unsigned>(clock64() - c0), 0};
}

// ref[r, i] in fp32 from the same bf16 inputs; thread (i, r) with r fastest, so a warp reads one weight row (slots
// are sorted by expert) and 32 hidden rows.
__global__ void reference_kernel(const __nv_bfloat16* x, const __nv_bfloat16* w, const int* slot_token,
                                 const int* slot_expert, float* ref) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= T * TOP_K * I) return;
  const int r = idx % (T * TOP_K), i = idx / (T * TOP_K);
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

__global__ void fill_kernel(__nv_bfloat16* v, int64_t n, uint32_t salt, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9e3779b9u ^ salt;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    v[i] = __float2bfloat16((static_cast<float>(h >> 8) / 16777216.0f * 2.0f - 1.0f) * scale);
  }
}

using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*, const cuuint64_t*,
                            const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                            CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

CUtensorMap encode(Encode fn, void* base, cuuint32_t rank, const cuuint64_t* dims, const cuuint64_t* strides,
                   const cuuint32_t* box) {
  const cuuint32_t elem[5] = {1, 1, 1, 1, 1};
  CUtensorMap map;
  const CUresult r = fn(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, base, dims, strides, box, elem,
                        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("cuTensorMapEncodeTiled failed: %d\n", static_cast<int>(r));
    std::exit(1);
  }
  return map;
}

struct Routing {
  std::vector<int> slot_token, slot_expert;
  std::vector<Item> items;
  int *d_token, *d_expert;
  Item* d_items;
  __nv_bfloat16 *xp, *act;
  CUtensorMap xmap;
};

// KEPT distinct random experts; every token's TOP_K slots on distinct ones of them; slots sorted by expert, then token
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
  std::vector<std::vector<int>> tokens_of(KEPT);
  for (int t = 0; t < T; ++t) {
    std::vector<int> order(KEPT);
    for (int j = 0; j < KEPT; ++j) order[j] = j;
    for (int j = 0; j < TOP_K; ++j) std::swap(order[j], order[j + next() % (KEPT - j)]);
    for (int j = 0; j < TOP_K; ++j) tokens_of[order[j]].push_back(t);
  }
  Routing r;
  for (int a = 0; a < KEPT; ++a) {
    const int slot0 = static_cast<int>(r.slot_token.size()), count = static_cast<int>(tokens_of[a].size());
    for (int t : tokens_of[a]) {
      r.slot_token.push_back(t);
      r.slot_expert.push_back(kept[a]);
    }
    for (int chunk = 0; chunk * N < count; ++chunk)
      for (int tile = 0; tile < I / TILE_I; ++tile)
        r.items.push_back(Item{kept[a], tile, slot0 + chunk * N, std::min(N, count - chunk * N)});
  }
  return r;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  const Encode encode_fn = reinterpret_cast<Encode>(fn);
  constexpr int SLOTS = T * TOP_K;
  __nv_bfloat16 *w, *x;
  const int64_t w_elems = static_cast<int64_t>(E) * 2 * I * H;
  CHECK(cudaMalloc(&w, w_elems * 2));
  CHECK(cudaMalloc(&x, static_cast<int64_t>(T) * H * 2));
  fill_kernel<<<4 * sms, 256>>>(w, w_elems, 0x1234u, 0.05f);
  fill_kernel<<<4 * sms, 256>>>(x, static_cast<int64_t>(T) * H, 0x9876u, 1.0f);
  CHECK(cudaGetLastError());
  // gate_up [E, 2I, H] as (h, intermediate in its group of 8, gate|up, group of 8, expert): a box of 64 h x 8 x both
  // halves x 4 groups lands as [group][gate|up][8 rows][64 h]
  const cuuint64_t wdims[5] = {H, 8, 2, I / 8, E};
  const cuuint64_t wstrides[4] = {H * 2ull, static_cast<cuuint64_t>(I) * H * 2, 8ull * H * 2, 2ull * I * H * 2};
  const cuuint32_t wbox[5] = {KSTEP, 8, 2, 4, 1};
  const CUtensorMap wmap = encode(encode_fn, w, 5, wdims, wstrides, wbox);
  uint32_t lcg = 2024u;
  std::vector<Routing> routings;
  for (int i = 0; i < ROUTINGS; ++i) {
    Routing r = draw_routing(lcg);
    CHECK(cudaMalloc(&r.d_token, SLOTS * 4));
    CHECK(cudaMalloc(&r.d_expert, SLOTS * 4));
    CHECK(cudaMalloc(&r.d_items, r.items.size() * sizeof(Item)));
    CHECK(cudaMalloc(&r.xp, static_cast<int64_t>(SLOTS) * H * 2));
    CHECK(cudaMalloc(&r.act, static_cast<int64_t>(SLOTS) * I * 2));
    CHECK(cudaMemset(r.act, 0xff, static_cast<int64_t>(SLOTS) * I * 2));  // NaN: unwritten outputs fail the check
    CHECK(cudaMemcpy(r.d_token, r.slot_token.data(), SLOTS * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(r.d_expert, r.slot_expert.data(), SLOTS * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(r.d_items, r.items.data(), r.items.size() * sizeof(Item), cudaMemcpyHostToDevice));
    const cuuint64_t xdims[2] = {H, SLOTS};
    const cuuint64_t xstrides[1] = {H * 2ull};
    const cuuint32_t xbox[2] = {KSTEP, N};
    r.xmap = encode(encode_fn, r.xp, 2, xdims, xstrides, xbox);
    routings.push_back(r);
  }
  CHECK(cudaFuncSetAttribute(ws_gate_up_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM_BYTES));
  Stamp* stamps;
  CHECK(cudaMalloc(&stamps, sizeof(Stamp) * sms));
  float* ref;
  CHECK(cudaMalloc(&ref, static_cast<int64_t>(SLOTS) * I * 4));
  auto run = [&](const Routing& r) {
    pack_kernel<<<SLOTS, 256>>>(x, r.d_token, r.xp);
    ws_gate_up_kernel<<<sms, 128 * (CONSUMERS + 1), SMEM_BYTES>>>(r.d_items, static_cast<int>(r.items.size()), r.act,
                                                                  wmap, r.xmap, stamps);
    CHECK(cudaGetLastError());
  };
  // correctness: every routing once, against the fp32 reference
  std::vector<__nv_bfloat16> got(static_cast<size_t>(SLOTS) * I);
  std::vector<float> want(static_cast<size_t>(SLOTS) * I);
  for (int i = 0; i < ROUTINGS; ++i) {
    const Routing& r = routings[i];
    run(r);
    reference_kernel<<<(SLOTS * I + 255) / 256, 256>>>(x, w, r.d_token, r.d_expert, ref);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(got.data(), r.act, got.size() * 2, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(want.data(), ref, want.size() * 4, cudaMemcpyDeviceToHost));
    double max_err = 0, max_ref = 0;
    int bad = 0;
    for (size_t j = 0; j < got.size(); ++j) {
      const double e = std::fabs(static_cast<double>(__bfloat162float(got[j])) - want[j]);
      if (!(e <= 1e30)) ++bad;  // NaN: not written
      else max_err = std::max(max_err, e);
      max_ref = std::max(max_ref, static_cast<double>(std::fabs(want[j])));
    }
    int most = 0;
    for (const Item& it : r.items) most = std::max(most, it.cols);
    std::printf("routing %d: %zu items (largest chunk %d tokens); max |act - ref| %.3g, max |ref| %.3g, "
                "ratio %.2e, %d outputs not finite: %s\n", i, r.items.size(), most, max_err, max_ref,
                max_err / max_ref, bad, bad == 0 && max_err <= 1e-2 * max_ref ? "ok" : "FAIL");
  }
  // timing: pack by events, gate_up by the CTAs' globaltimer span (no launch gaps), rounds over the routings
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<double> pack_us, gemm_us, mhz;
  constexpr int kPackBurst = 20;  // back-to-back pack launches per event pair: the launch gaps mostly hidden
  std::vector<Stamp> s(sms);
  for (int rep = 0; rep < 10; ++rep) {
    for (const Routing& r : routings) {
      CHECK(cudaEventRecord(e0));
      for (int b = 0; b < kPackBurst; ++b) pack_kernel<<<SLOTS, 256>>>(x, r.d_token, r.xp);
      CHECK(cudaEventRecord(e1));
      ws_gate_up_kernel<<<sms, 128 * (CONSUMERS + 1), SMEM_BYTES>>>(r.d_items, static_cast<int>(r.items.size()),
                                                                    r.act, wmap, r.xmap, stamps);
      CHECK(cudaGetLastError());
      CHECK(cudaDeviceSynchronize());
      float ms;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      pack_us.push_back(ms * 1e3 / kPackBurst);
      CHECK(cudaMemcpy(s.data(), stamps, sizeof(Stamp) * sms, cudaMemcpyDeviceToHost));
      unsigned long long first = ~0ull, last = 0;
      double cycles = 0, ns = 0;
      for (const Stamp& st : s) {
        first = std::min(first, st.start);
        last = std::max(last, st.end);
        cycles += st.cycles;
        ns += st.end - st.start;
      }
      gemm_us.push_back((last - first) / 1e3);
      mhz.push_back(cycles / ns * 1e3);
    }
  }
  const double bytes = static_cast<double>(KEPT) * 2 * I * H * 2;
  std::printf("pack (events over 20 launches) median %.1f us | ws gate_up span median %.1f us (min %.1f), %.2f TB/s of "
              "weights, %.0f MHz\n", median(pack_us), median(gemm_us), *std::min_element(gemm_us.begin(),
              gemm_us.end()), bytes / median(gemm_us) / 1e6, median(mhz));
  return 0;
}
