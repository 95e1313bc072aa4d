// Microbenchmark (standalone, not part of the library): how fast CTAs that only stream weight tiles through a
// shared-memory ring pull them from HBM, with the expert kernel's access pattern and none of its arithmetic.
//
//   nvcc -O3 -std=c++20 -arch=sm_90a -Icsrc/include benchmarks/micro/stream_rate.cu -o /tmp/stream_rate && /tmp/stream_rate
//   /tmp/stream_rate "ws3 192"    # only the cases whose note contains the text
//
// Why: the expert GEMMs' CTAs each complete about one k step per memory round trip whatever their ring depth
// (notes/experts_kernel.md, sessions 2-12: ~15 GB/s per CTA at one or two CTAs per SM), so b64/M16's 192 gate_up CTAs
// on 132 SMs stream at ~3 TB/s. This tells whether a CTA that does nothing but stream has the same limit, and which
// loader, ring depth, stage size and layout lift it.
//
// The buffer holds the weight rows of b64/M16's gate_up (16 experts x 1536 rows x 2048 bf16 columns = 100 MB, row
// stride 4 KB) several times over, a different copy per launch (L2 holds none of it; with the expert layout, 16
// random experts of 128 per launch, about 2 of them shared with the previous launch). Tile t = ROWS rows; CTA b
// streams items b, b + grid, ..., item i being tile i / share (share = 1 but in the token-row cases below). A k step
// moves (ROWS + token rows) x KSB bytes (KSB bytes of each row) into one ring slot; the loop is the expert kernel's:
// wait for the oldest slot, barrier, refill the slot freed one step earlier, read the slot.
// Loaders:
//   cp      : 16-byte cp.async per thread, strided rows: the expert kernel's own copy (experts_mma.cuh,
//             cp_async16_nohint: .L2::256B prefetch hint, no cache policy)
//   cp-nohint: the same without the L2 prefetch hint (cp_async16_zfill with every byte valid)
//   cp-contig: 16-byte cp.async, each k step's tile one contiguous block (a packed layout)
//   bulk    : one cp.async.bulk per k step (contiguous block), mbarrier completion (async proxy)
//   tma     : a 2-D TMA box of ROWS x KSB per k step from the strided rows, mbarrier completion
//   ws2, ws3: warp-specialised (session 14, first run in session 15): one persistent CTA per SM, a producer
//             warpgroup (weights by TMA, token rows by cp.async) and 2 or 3 consumer warpgroups on full / empty
//             mbarriers (ws_stream_kernel)
//   ws3-mma : ws3 whose consumers run the stage's real wgmmas (N = 144 tokens) instead of a delay (session 15; first
//             run in session 16: 39.9 us with 144 token rows per stage, against 26.7 with no wgmmas). WsMode: token
//             rows per stage, resident, or no loads at all. MHz: the CTAs' clock64 ticks per ns (throttling?)
// H200 (session 13, benchmarks/results/device_runs/session13.txt): the W64 shape streams 100 MB in 24-26 us (3.8-4.1
// TB/s, ~22 GB/s per CTA, the same on SMs holding one CTA as on SMs holding two); ring depth 3-6, TMA, bulk copies,
// contiguous tiles, the expert layout and random bytes all within 2 us of it. The expert kernel's gate_up takes ~33 us
// for the same bytes, its k loop included (per-CTA stamps: the loop runs at this rate; the rest is before and after it).
// Token rows and pass splits (session 14, not yet run): a case may add token_rows rows per stage from a 1 MB buffer
// that stays in L2 (a pass's token rows) and let `share` neighbouring CTAs stream each tile (the kernel's pass
// splits; the tile's HBM bytes are read once, the rest hit L2 when the CTAs run together). The b256/M16 rows compare
// W64 as it runs today past one wave with wider passes that stream each tile once: what a restructured kernel could
// gain before it is written. With them, "TB/s" still counts the weights' bytes once (the expert op's measure) and the
// per-CTA GB/s count every byte a CTA stages (token rows and shared tiles included). The cases without token rows run
// their own instances, whose k loops are within a few SASS instructions of session 13's (not identical: the item /
// share indexing changed the register allocation); compare rows of one run, not with session 13's figures.
// Timing: %globaltimer stamps per CTA (kernel span = last end - first start; per-CTA rate split by whether another
// CTA ran on its SM at the same time), the median of 9 launches. Shared-memory padding caps the CTAs per SM; the
// "max/SM" column is the occupancy API's answer for the padded kernel (the grid decides how many an SM really holds).
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "base_moe/experts_mma.cuh"
#include "base_moe/wgmma.cuh"
#include "check.cuh"

constexpr int NT = 128;               // threads per CTA (one warpgroup, as W64 / W128)
constexpr int64_t K_BYTES = 4096;     // one weight row (2048 bf16)
constexpr int64_t ROWS_TOTAL = 24576; // 16 experts x 1536 gate_up rows
constexpr int64_t REGION = ROWS_TOTAL * K_BYTES;
constexpr int REGIONS = 8;
constexpr int kTokenRows = 256;       // the token buffer's rows (1 MB: stays in L2, like a batch's hidden states)
constexpr int kTokenPool = 2304;      // its allocation: the rows of packed per-expert token copies (kPacked, 9 MB)

// ws loaders: token rows per stage (as a kernel would stream them), loaded once and resident in shared memory (the
// wgmmas read the same B every stage: the weight stream and the tensor pipe without the token traffic), or resident
// and no loads at all (consumers run their wgmmas without waiting: the tensor pipe's time alone)
enum WsMode { kTokensPerStage, kTokensResident, kComputeOnly };
// ws loaders' token rows per stage: which rows (all CTAs rows 0..; each CTA its own 144 of the 256 batch rows, as an
// expert's token list gathers them; or rows packed per expert, [expert][token], 8 consecutive CTAs = one expert's
// tiles) and how (cp.async by 3 warps; one bulk copy per row by warp 0, async proxy, on the stage's mbarrier; one TMA
// box, which needs the packed rows)
enum TokenPattern { kFirstRows, kGathered, kPacked };
enum TokenLoader { kTokensCp, kTokensBulk, kTokensTma };
enum Loader { kCp, kCpNoHint, kCpContig, kBulk, kTma, kWs2, kWs3, kWs3Mma };
const char* kLoaderNames[] = {"cp", "cp-nohint", "cp-contig", "bulk", "tma", "ws2", "ws3", "ws3-mma"};
constexpr int consumer_warpgroups(int loader) {
  return loader == kWs2 ? 2 : loader == kWs3 || loader == kWs3Mma ? 3 : 0;
}

struct Stamp {
  unsigned long long start, end;
  unsigned sm, cycles;  // cycles: the CTA's clock64 ticks from start to end (its SM clock = cycles / ns)
};

__device__ __forceinline__ unsigned smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
using namespace base_moe::experts_detail;  // the expert kernel's copy, swizzle and wgmma helpers
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// An arrival on `bar` once this thread's earlier cp.async copies have landed; noinc: `bar`'s initial count includes it.
__device__ __forceinline__ void cp_async_arrive_noinc(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

constexpr int kExperts = 128, kChosen = 16, kExpertRows = 1536;  // Qwen3-30B-A3B gate_up: [128, 1536, 2048]
struct Params {
  const uint8_t* w;  // this launch's region (the whole buffer with the expert layout)
  int rows, ksb, tiles, loader;
  int experts;       // 1: tile t = gate rows 64 j.. + up rows 768 + 64 j.. of expert chosen[t / 12], j = t % 12
  int chosen[kChosen];
  int delay;         // cycles of pretend arithmetic per k step
  Stamp* stamps;
  unsigned* sink;
  int share;             // CTAs per tile (the expert kernel's pass splits): CTA item i streams tile i / share
  int token_rows;        // rows per stage from the token buffer, after the tile's rows (a pass's token rows)
  const uint8_t* tokens; // [kTokenRows, K_BYTES]: pass j of a tile reads rows j * token_rows.. (mod kTokenRows)
  int ws_mode;           // ws loaders: a WsMode
  int token_pattern, token_loader;  // ws loaders: a TokenPattern, a TokenLoader
};

// Row j of this CTA's token rows (ws loaders)
__device__ __forceinline__ int token_row(const Params& p, int j) {
  if (p.token_pattern == kGathered) return (j * 97 + static_cast<int>(blockIdx.x) * 31) % kTokenRows;  // 97: odd
  if (p.token_pattern == kPacked) return static_cast<int>(blockIdx.x) / 8 * 128 + j;
  return j;
}

// What a CTA does with a landed stage instead of MMAs: thread `thread` reads 16 of its bytes (so the copy is used),
// then spends `delay` cycles of pretend arithmetic. Returns the bits the caller folds into its checksum.
__device__ __forceinline__ unsigned consume_stage(const uint8_t* stage, int stage_bytes, int thread, int delay) {
  const uint4 v = *reinterpret_cast<const uint4*>(stage + (thread * 16) % stage_bytes);
  if (delay) {
    const long long c0 = clock64();
    while (clock64() - c0 < delay) {
    }
  }
  return v.x ^ v.w;
}

// CHUNKS: 16-byte chunks per thread per k step ((rows + token_rows) x ksb / 16 / NT); TOKENS: token_rows > 0 (a
// separate instance, so that the cases without token rows run session 13's k loop)
template <int STAGES, int CHUNKS, bool TOKENS>
__global__ void __launch_bounds__(NT) stream_kernel(const Params p, const __grid_constant__ CUtensorMap map,
                                                    const __grid_constant__ CUtensorMap) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t bars[STAGES];
  // TMA wants 128-byte aligned slots: align the ring to 1 KB (the launch adds 1 KB)
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const unsigned long long t0 = globaltimer();
  const long long c0 = clock64();
  const int tid = threadIdx.x;
  const int stage_bytes = (p.rows + p.token_rows) * p.ksb;
  const int nk = static_cast<int>(K_BYTES / p.ksb);
  const int chunks_per_row = p.ksb / 16;
  const uint32_t s0 = smem_addr(smem);
  const bool async_proxy = p.loader == kBulk || p.loader == kTma;
  const uint32_t bar0 = smem_addr(bars);
  if (async_proxy && tid == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(bar0 + 8 * s, 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  // this thread's chunks of a k step: byte offsets from the tile's first row (or the pass's first token row) at k
  // step 0
  int src_off[CHUNKS];
  bool token_chunk[CHUNKS];
#pragma unroll
  for (int i = 0; i < CHUNKS; ++i) {
    const int c = tid + i * NT;
    const int r = c / chunks_per_row;
    token_chunk[i] = TOKENS && r >= p.rows;
    const int row = token_chunk[i] ? r - p.rows : p.experts && r >= 64 ? kExpertRows / 2 + r - 64 : r;
    src_off[i] = p.loader == kCpContig ? c * 16 : row * K_BYTES + (c % chunks_per_row) * 16;
  }
  unsigned acc = 0;
  int phase_base = 0;  // k steps consumed so far by this CTA (mbarrier parity)

  for (int item = blockIdx.x; item < p.tiles * p.share; item += gridDim.x) {
    const int tile = item / p.share;
    const uint8_t* token_base = p.tokens + static_cast<int64_t>(item % p.share * p.token_rows % kTokenRows) * K_BYTES;
    const uint8_t* tile_base =
        p.experts ? p.w + (static_cast<int64_t>(p.chosen[tile / 12]) * kExpertRows + (tile % 12) * 64) * K_BYTES
                  : p.w + static_cast<int64_t>(tile) * p.rows * K_BYTES;
    auto issue = [&](int ks) {
      const int slot = (phase_base + ks) % STAGES;
      const uint32_t dst = s0 + slot * stage_bytes;
      if (async_proxy) {
        if (tid == 0) {
          const uint32_t bar = bar0 + 8 * slot;
          mbar_arrive_expect_tx(bar, stage_bytes);
          if (p.loader == kBulk)
            bulk_copy(dst, tile_base + static_cast<int64_t>(ks) * stage_bytes, stage_bytes, bar);
          else
            load_2d(dst, &map, ks * p.ksb / 2, tile * p.rows, bar);
        }
        return;
      }
      const uint8_t* step = tile_base + static_cast<int64_t>(ks) * (p.loader == kCpContig ? stage_bytes : p.ksb);
      const uint8_t* token_step = token_base + static_cast<int64_t>(ks) * p.ksb;
#pragma unroll
      for (int i = 0; i < CHUNKS; ++i) {
        const uint32_t to = dst + (tid + i * NT) * 16;
        const uint8_t* from = (TOKENS && token_chunk[i] ? token_step : step) + src_off[i];
        if (p.loader == kCpNoHint) cp_async16_zfill(to, from, true);
        else cp_async16_nohint(to, from);
      }
    };
    // k step g of the CTA (g = phase_base + ks) fills ring slot g % STAGES; a slot is refilled only after every thread
    // passed the barrier that follows its last read
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < nk) issue(s);
      cp_async_commit();
    }
    for (int ks = 0; ks < nk; ++ks) {
      const uint32_t slot = (phase_base + ks) % STAGES;
      if (async_proxy) mbar_wait(bar0 + 8 * slot, ((phase_base + ks) / STAGES) & 1);
      else cp_async_wait<STAGES - 2>();
      __syncthreads();
      if (ks + STAGES - 1 < nk) issue(ks + STAGES - 1);
      cp_async_commit();
      acc ^= consume_stage(smem + slot * stage_bytes, stage_bytes, tid, p.delay);
    }
    cp_async_wait<0>();
    __syncthreads();  // the next tile refills every slot
    phase_base += nk;
  }
  if (acc == 0x9e3779b9u) atomicAdd(p.sink, 1u);
  if (tid == 0) p.stamps[blockIdx.x] = Stamp{t0, globaltimer(), smid(), static_cast<unsigned>(clock64() - c0)};
}

using Kernel = void (*)(Params, CUtensorMap, CUtensorMap);  // the weights' and the token pool's maps

// ws3-mma's consumer arithmetic: D[64 x 144] += A[64 x 16] * B[16 x 144] (bf16, fp32 accumulators: 72 per thread),
// both operands in shared memory through 128-byte-swizzle descriptors (wgmma.cuh). The stages are not swizzled
// (TMA without swizzle, plain cp.async rows), so the products are garbage; the tensor pipe's work and the shared-memory
// reads are those of the real kernel, which is all a stream-rate case needs.
__device__ __forceinline__ void wgmma_m64n144k16_bf16(float* d, uint64_t desc_a, uint64_t desc_b) {
  BASE_MOE_WGMMA(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %74, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n144k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71}, %72, %73, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71])
      : "l"(desc_a), "l"(desc_b), "r"(1));
}

// Loaders ws2 / ws3: the warp-specialised stream that notes/research_b256_s14.md proposes for the b256 expert GEMMs.
// One persistent CTA per SM (grid = SMs; tiles b, b + grid, ...): warpgroup 0 produces, CONSUMERS warpgroups consume,
// and the ring runs on across tiles, so the producer stays STAGES k steps ahead. Thread 0 issues each stage's
// weight box by TMA (full[s]: expect_tx); with token rows, warps 1-3 gather them by cp.async (rows 0.. of the
// L2-resident token buffer) and arrive on full[s] as they land (noinc: full[s]'s initial count has the 96
// arrivals). Consumer warps wait on full[s], read the stage, spend p.delay cycles (pretend wgmma) and release the
// previous stage's slot on empty[], as a kernel that keeps one stage's wgmmas in flight (wait<1>) would; the
// producers wait on empty[s] before they refill slot s. No __syncthreads in the loop. CONSUMERS only sets how many
// warps wait and spin: the rows differ in tile height and stage count, not in work split between consumers.
// MMA (loader ws3-mma; 3 x 64 rows, 144 token rows, 128-byte k steps): consumer warpgroup c runs the stage's real
// wgmmas instead of the delay, rows 64 c.. of the weight box times the 144 token rows (N = 144), four k16 steps per
// stage, and keeps one stage's wgmmas in flight: wait<1> after committing stage g frees stage g - 1's slot.
template <int STAGES, int CONSUMERS, bool MMA>
__global__ void __launch_bounds__((CONSUMERS + 1) * 128) ws_stream_kernel(const Params p,
                                                                          const __grid_constant__ CUtensorMap map,
                                                                          const __grid_constant__ CUtensorMap token_map) {
  extern __shared__ uint8_t smem_raw[];
  __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
  uint8_t* smem = smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
  const unsigned long long t0 = globaltimer();
  const long long c0 = clock64();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const bool tokens = p.token_rows > 0 && p.ws_mode == kTokensPerStage;  // token rows in every stage
  const bool tokens_cp = tokens && p.token_loader == kTokensCp;
  const int token_bytes = tokens ? p.token_rows * p.ksb : 0;
  const int weight_bytes = p.rows * p.ksb, stage_bytes = (p.rows + (tokens ? p.token_rows : 0)) * p.ksb;
  const int nk = static_cast<int>(K_BYTES / p.ksb);
  const uint32_t s0 = smem_addr(smem), full0 = smem_addr(full), empty0 = smem_addr(empty);
  if (p.ws_mode != kTokensPerStage) {  // the resident token rows, after the ring
    for (int i = tid; i < p.token_rows * p.ksb / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(smem + STAGES * stage_bytes)[i] =
          reinterpret_cast<const uint4*>(p.tokens)[i / (p.ksb / 16) * (K_BYTES / 16) + i % (p.ksb / 16)];
    fence_proxy_async_shared();  // generic-proxy stores, read by wgmma (async proxy) after the barrier
  }
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full0 + 8 * s, tokens_cp ? 1 + 96 : 1);
      mbar_init(empty0 + 8 * s, CONSUMERS * 4);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  const int steps = (p.tiles - static_cast<int>(blockIdx.x) + static_cast<int>(gridDim.x) - 1) /
                    static_cast<int>(gridDim.x) * nk;  // this CTA's k steps over all its tiles
  unsigned acc = 0;
  if (warp >= 4) {  // consumers
    float d[MMA ? 72 : 1] = {};
    for (int g = 0; g < steps; ++g) {
      const int s = g % STAGES;
      if (p.ws_mode != kComputeOnly) mbar_wait(full0 + 8 * s, (g / STAGES) & 1);
      if constexpr (MMA) {
        fence_proxy_async_shared();  // the token rows came by cp.async (generic proxy); wgmma reads the async one
        const uint32_t stage = s0 + s * stage_bytes;
        const uint64_t da = wgmma_desc(stage + (warp / 4 - 1) * 64 * p.ksb);
        const uint64_t db = wgmma_desc(tokens ? stage + weight_bytes : s0 + STAGES * stage_bytes);
        fence_registers<72>(d);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
          wgmma_m64n144k16_bf16(d, wgmma_desc_advance(da, kk * 32), wgmma_desc_advance(db, kk * 32));
        }
        wgmma_commit();
        wgmma_wait_one();
        fence_registers<72>(d);
      } else {
        acc ^= consume_stage(smem + s * stage_bytes, stage_bytes, tid - 128, p.delay);
      }
      __syncwarp();
      if (lane == 0 && g > 0) mbar_arrive(empty0 + 8 * ((g - 1) % STAGES));
    }
    if constexpr (MMA) {
      wgmma_wait_all();
      fence_registers<72>(d);
      for (float v : d) acc ^= __float_as_uint(v);
    }
    if (lane == 0 && steps > 0) mbar_arrive(empty0 + 8 * ((steps - 1) % STAGES));
  } else if (p.ws_mode != kComputeOnly && (warp == 0 || tokens_cp)) {
    // producers: warp 0 (lane 0: the weight TMA, the token TMA; every lane: bulk token row copies), warps 1-3 the
    // token rows by cp.async
    const int chunks = p.token_rows * p.ksb / 16, per_row = p.ksb / 16;
    for (int g = 0; g < steps; ++g) {
      const int s = g % STAGES, ks = g % nk;
      const int tile = static_cast<int>(blockIdx.x) + g / nk * static_cast<int>(gridDim.x);
      if (g >= STAGES) mbar_wait(empty0 + 8 * s, (g / STAGES - 1) & 1);
      const uint32_t dst = s0 + s * stage_bytes, full = full0 + 8 * s;
      if (warp == 0) {
        if (lane == 0) {
          mbar_arrive_expect_tx(full, weight_bytes + (tokens_cp ? 0 : token_bytes));
          load_2d(dst, &map, ks * p.ksb / 2, tile * p.rows, full);
          if (tokens && p.token_loader == kTokensTma)
            load_2d(dst + weight_bytes, &token_map, ks * p.ksb / 2, token_row(p, 0), full);
        }
        __syncwarp();  // the expect_tx before any token row's complete_tx
        if (tokens && p.token_loader == kTokensBulk)
          for (int j = lane; j < p.token_rows; j += 32)
            bulk_copy(dst + weight_bytes + j * p.ksb, p.tokens + static_cast<int64_t>(token_row(p, j)) * K_BYTES +
                                                          ks * p.ksb, p.ksb, full);
      } else {
        for (int c = tid - 32; c < chunks; c += 96)
          cp_async16_nohint(dst + weight_bytes + c * 16, p.tokens + static_cast<int64_t>(token_row(p, c / per_row)) *
                                                                        K_BYTES + ks * p.ksb + (c % per_row) * 16);
        cp_async_arrive_noinc(full);
      }
    }
  }
  if (acc == 0x9e3779b9u) atomicAdd(p.sink, 1u);
  __syncthreads();
  if (tid == 0) p.stamps[blockIdx.x] = Stamp{t0, globaltimer(), smid(), static_cast<unsigned>(clock64() - c0)};
}

template <int CONSUMERS, bool MMA = false>
Kernel pick_ws_consumers(int stages) {
  switch (stages) {
    case 4: return ws_stream_kernel<4, CONSUMERS, MMA>;
    case 5: return ws_stream_kernel<5, CONSUMERS, MMA>;
    case 6: return ws_stream_kernel<6, CONSUMERS, MMA>;
    case 8: return ws_stream_kernel<8, CONSUMERS, MMA>;
  }
  return nullptr;
}
Kernel pick_ws(int loader, int stages) {
  if (loader == kWs3Mma) return pick_ws_consumers<3, true>(stages);
  return loader == kWs2 ? pick_ws_consumers<2>(stages) : loader == kWs3 ? pick_ws_consumers<3>(stages) : nullptr;
}

struct Case {
  const char* note;
  int loader, stages, rows, ksb, occupancy, grid, delay;
  int experts = 0, random = 0;  // the expert layout (cp loaders, 128 rows); random bytes instead of 0x01
  int share = 1, token_rows = 0;  // CTAs per tile and token rows per stage (Params; cp / cp-nohint loaders)
  int ws_mode = kTokensPerStage;
  int token_pattern = kFirstRows, token_loader = kTokensCp;
};

__global__ void fill_kernel(uint32_t* w, int64_t n, uint32_t salt) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 0x9e3779b9u ^ salt;
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    w[i] = salt ? x : 0x01010101u;
  }
}

template <int STAGES, bool TOKENS>
Kernel pick_chunks(int chunks) {
  switch (chunks) {
    case 4: return stream_kernel<STAGES, 4, TOKENS>;
    case 8: return stream_kernel<STAGES, 8, TOKENS>;
    case 12: return stream_kernel<STAGES, 12, TOKENS>;
    case 16: return stream_kernel<STAGES, 16, TOKENS>;
    case 20: return stream_kernel<STAGES, 20, TOKENS>;
  }
  return nullptr;
}
template <int STAGES>
Kernel pick_tokens(int chunks, bool tokens) {
  return tokens ? pick_chunks<STAGES, true>(chunks) : pick_chunks<STAGES, false>(chunks);
}
Kernel pick(int stages, int chunks, bool tokens) {
  switch (stages) {
    case 2: return pick_tokens<2>(chunks, tokens);
    case 3: return pick_tokens<3>(chunks, tokens);
    case 4: return pick_tokens<4>(chunks, tokens);
    case 6: return pick_tokens<6>(chunks, tokens);
    case 8: return pick_tokens<8>(chunks, tokens);
    case 12: return pick_tokens<12>(chunks, tokens);
  }
  return nullptr;
}

CUtensorMap make_map(const void* base, int rows, int ksb, int64_t total_rows = ROWS_TOTAL) {
  const cuuint64_t dims[2] = {K_BYTES / 2, static_cast<cuuint64_t>(total_rows)};
  const cuuint64_t strides[1] = {K_BYTES};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(ksb / 2), static_cast<cuuint32_t>(rows)};
  return encode_bf16_map(base, 2, dims, strides, box, CU_TENSOR_MAP_SWIZZLE_NONE);
}

int main(int argc, char** argv) {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  uint8_t* w = nullptr;
  CHECK(cudaMalloc(&w, REGION * REGIONS));
  CHECK(cudaMemset(w, 1, REGION * REGIONS));
  Stamp* stamps = nullptr;
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&stamps, sizeof(Stamp) * 4096));
  CHECK(cudaMalloc(&sink, 4));
  uint8_t* tokens = nullptr;
  CHECK(cudaMalloc(&tokens, kTokenPool * K_BYTES));
  CHECK(cudaMemset(tokens, 1, kTokenPool * K_BYTES));

  // copy reference: device-to-device of one region into another, median of 9
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> copy_ms;
  for (int r = 0; r < 12; ++r) {
    CHECK(cudaEventRecord(e0));
    CHECK(cudaMemcpyAsync(w + REGION * ((r % 4) * 2), w + REGION * ((r % 4) * 2 + 1), REGION,
                          cudaMemcpyDeviceToDevice));
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    if (r >= 3) copy_ms.push_back(ms);
  }
  std::sort(copy_ms.begin(), copy_ms.end());
  std::printf("%s, %d SMs; device-to-device copy of %.0f MB: %.2f TB/s counting read and write bytes (2 x size / "
              "event time; mixed traffic, not a read-only ceiling)\n", prop.name, sms, REGION / 1e6,
              2.0 * REGION / (copy_ms[copy_ms.size() / 2] * 1e9));

  const int base_grid = static_cast<int>(ROWS_TOTAL / 128);  // 192: b64/M16's gate_up CTAs
  std::vector<Case> cases = {
      {"expert kernel's W64 gate_up shape", kCp, 4, 128, 128, 2, base_grid, 0},
      {"  + 600 cycles per k step", kCp, 4, 128, 128, 2, base_grid, 600},
      {"  ring 2", kCp, 2, 128, 128, 2, base_grid, 0},
      {"  ring 3", kCp, 3, 128, 128, 2, base_grid, 0},
      {"  ring 6", kCp, 6, 128, 128, 2, base_grid, 0},
      {"  ring 12 (1 CTA/SM: two waves)", kCp, 12, 128, 128, 1, base_grid, 0},
      {"  no L2 hint", kCpNoHint, 4, 128, 128, 2, base_grid, 0},
      {"  contiguous tiles", kCpContig, 4, 128, 128, 2, base_grid, 0},
      {"  bulk copy, contiguous", kBulk, 4, 128, 128, 2, base_grid, 0},
      {"  TMA 2-D box", kTma, 4, 128, 128, 2, base_grid, 0},
      {"  TMA, ring 6", kTma, 6, 128, 128, 2, base_grid, 0},
      {"  256 B per row per k step", kCp, 3, 128, 256, 2, base_grid, 0},
      {"  TMA 256 B per row", kTma, 3, 128, 256, 2, base_grid, 0},
      {"64-row tiles, 384 CTAs, 3/SM", kCp, 4, 64, 128, 3, 2 * base_grid, 0},
      {"64-row tiles, 264 CTAs (balanced-ish)", kCp, 4, 64, 128, 2, 2 * sms, 0},
      {"128-row tiles, 132 CTAs, 1/SM, ring 12", kCp, 12, 128, 128, 1, sms, 0},
      {"TMA 128-row, 132 CTAs 1/SM ring 12", kTma, 12, 128, 128, 1, sms, 0},
      {"W64 shape, random bytes", kCp, 4, 128, 128, 2, base_grid, 0, 0, 1},
      {"W64 shape, expert layout (16 of 128)", kCp, 4, 128, 128, 2, base_grid, 0, 1, 0},
      {"W64 shape, expert layout, random bytes", kCp, 4, 128, 128, 2, base_grid, 0, 1, 1},
      {"  same, ring 6", kCp, 6, 128, 128, 2, base_grid, 0, 1, 1},
      {"TMA 2-D box, random bytes", kTma, 4, 128, 128, 2, base_grid, 0, 0, 1},
      // b256/M16's gate_up (~128 tokens per expert) with its token rows (from L2) and pass splits: W64 today (3 CTAs
      // per tile, 64 token rows each; 2 stages at 4 CTAs per SM past one wave), and wider passes that stream each
      // tile once (the shapes a warp-specialised kernel with one or two consumer warpgroups would have)
      {"b256/M16 W64: 2 st, 4/SM, 3 per tile", kCp, 2, 128, 128, 4, 3 * base_grid, 0, 0, 0, 3, 64},
      {"  same, no token rows", kCp, 2, 128, 128, 4, 3 * base_grid, 0, 0, 0, 3, 0},
      {"  same, 4 st, 2/SM", kCp, 4, 128, 128, 2, 3 * base_grid, 0, 0, 0, 3, 64},
      {"b256/M16 W128: 3 st, 2/SM, 2 per tile", kCp, 3, 128, 128, 2, 2 * base_grid, 0, 0, 0, 2, 128},
      {"b256/M16 one pass of 192: 4 st, 1/SM", kCp, 4, 128, 128, 1, base_grid, 0, 0, 0, 1, 192},
      {"  64-row tiles + 192 tokens, 3 st, 2/SM", kCp, 3, 64, 128, 2, 2 * base_grid, 0, 0, 0, 1, 192},
      // the warp-specialised stream of notes/research_b256_s14.md: one persistent CTA per SM, one pass of an
      // expert's ~144 tokens per tile. 192-row tiles: 128 tiles, one per CTA (4 SMs idle); 128-row tiles: 192 tiles,
      // 60 CTAs take two, so their span is set by those (compare the per-CTA GB/s, not TB/s, across tile heights).
      // The delay stands in for the wgmmas of N = 144: 3.5 MFLOP per 192-row stage = 864 cycles at one SM's tensor
      // peak (4096 FLOP/clock), so 1000 cycles ~ 86% of peak; ~670 for 128-row stages.
      {"ws3 192-row tiles, 5 st", kWs3, 5, 192, 128, 1, sms, 0},
      // session 17: ws_experts.cu's weights-only case streams the same bytes in 34.9 us, from random bf16 weights
      {"ws3 192-row tiles, 5 st, random bytes", kWs3, 5, 192, 128, 1, sms, 0, 0, 1},
      {"  + 144 token rows", kWs3, 5, 192, 128, 1, sms, 0, 0, 0, 1, 144},
      {"  + 144 token rows, 1000 cycles/stage", kWs3, 5, 192, 128, 1, sms, 1000, 0, 0, 1, 144},
      {"  + 144 token rows, real wgmmas (N 144)", kWs3Mma, 5, 192, 128, 1, sms, 0, 0, 0, 1, 144},
      {"  same, 4 stages", kWs3Mma, 4, 192, 128, 1, sms, 0, 0, 0, 1, 144},
      // session 16: why real wgmmas cost 13 us over the stream (39.9 against 26.7, call 1): the tensor pipe alone,
      // and the weight stream under real wgmmas without the per-stage token rows (8 stages fit then)
      {"  wgmmas alone (no loads)", kWs3Mma, 5, 192, 128, 1, sms, 0, 0, 0, 1, 144, kComputeOnly},
      {"  token rows resident, 5 st", kWs3Mma, 5, 192, 128, 1, sms, 0, 0, 0, 1, 144, kTokensResident},
      {"  token rows resident, 8 st", kWs3Mma, 8, 192, 128, 1, sms, 0, 0, 0, 1, 144, kTokensResident},
      {"ws3 192-row tiles, 8 st, no tokens", kWs3, 8, 192, 128, 1, sms, 0},
      // then: does the token rows' pattern or their loader cost the 12 us?
      {"ws3-mma, 144 of 256 rows per CTA, cp", kWs3Mma, 5, 192, 128, 1, sms, 0, 0, 0, 1, 144, kTokensPerStage, kGathered},
      {"  same, bulk row copies", kWs3Mma, 5, 192, 128, 1, sms, 0, 0, 0, 1, 144, kTokensPerStage, kGathered,
       kTokensBulk},
      {"  same, no wgmmas", kWs3, 5, 192, 128, 1, sms, 0, 0, 0, 1, 144, kTokensPerStage, kGathered, kTokensBulk},
      {"ws3-mma, rows packed per expert, TMA", kWs3Mma, 5, 192, 128, 1, sms, 0, 0, 0, 1, 144, kTokensPerStage, kPacked,
       kTokensTma},
      {"  same, no wgmmas", kWs3, 5, 192, 128, 1, sms, 0, 0, 0, 1, 144, kTokensPerStage, kPacked, kTokensTma},
      {"ws3-mma, first rows, bulk row copies", kWs3Mma, 5, 192, 128, 1, sms, 0, 0, 0, 1, 144, kTokensPerStage,
       kFirstRows, kTokensBulk},
      {"  + 1000 cycles/stage", kWs3, 8, 192, 128, 1, sms, 1000},
      {"ws2 192-row tiles, 5 st, + 144 tokens", kWs2, 5, 192, 128, 1, sms, 0, 0, 0, 1, 144},
      {"ws2 128-row tiles, 6 st", kWs2, 6, 128, 128, 1, sms, 0},
      {"  + 144 token rows, 5 st", kWs2, 5, 128, 128, 1, sms, 0, 0, 0, 1, 144},
      {"  + 144 token rows, 670 cycles/stage", kWs2, 5, 128, 128, 1, sms, 670, 0, 0, 1, 144},
  };
  int filled_random = 0;
  std::printf("%-40s %-9s %2s %4s %4s %3s %5s %4s %4s | %7s %6s | %8s %8s %8s | %8s %5s\n", "case", "loader", "S",
              "rows", "tok", "shr", "KSB", "max/SM", "grid", "span us", "TB/s", "CTA us", "GB/s@1", "GB/s@2+",
              "burst us", "MHz");
  int launch = 0;
  for (const Case& c : cases) {
    if (argc > 1 && std::strstr(c.note, argv[1]) == nullptr) continue;
    const int consumers = consumer_warpgroups(c.loader);
    const int threads = consumers ? (consumers + 1) * 128 : NT;
    const int chunks = (c.rows + c.token_rows) * c.ksb / 16 / NT;
    Kernel kernel = consumers ? pick_ws(c.loader, c.stages) : pick(c.stages, chunks, c.token_rows > 0);
    if (kernel == nullptr) {
      std::printf("%-40s: no instance\n", c.note);
      continue;
    }
    if (consumers && (c.share != 1 || c.experts || c.token_rows > kTokenRows || c.rows > 256)) {
      std::printf("%-40s: the ws loaders take one CTA per tile, plain tiles of <= 256 rows\n", c.note);
      continue;
    }
    if (c.loader == kWs3Mma && (c.rows != 192 || c.token_rows != 144 || c.ksb != 128)) {
      std::printf("%-40s: ws3-mma's wgmmas take 3 x 64 rows, 144 token rows and 128-byte k steps\n", c.note);
      continue;
    }
    if (c.experts && (c.rows != 128 || (c.loader != kCp && c.loader != kCpNoHint))) {
      std::printf("%-40s: the expert layout takes the cp loaders with 128-row tiles only\n", c.note);
      continue;
    }
    if (c.token_rows && c.loader != kCp && c.loader != kCpNoHint && !consumers) {
      std::printf("%-40s: token rows take the cp and ws loaders only\n", c.note);
      continue;
    }
    bool tokens_fit = true;  // every pass's token rows inside the token buffer
    for (int j = 0; j < c.share; ++j) tokens_fit &= j * c.token_rows % kTokenRows + c.token_rows <= kTokenRows;
    if (!tokens_fit) {
      std::printf("%-40s: %d passes of %d token rows do not fit the %d-row token buffer\n", c.note, c.share,
                  c.token_rows, kTokenRows);
      continue;
    }
    const int ring = c.ws_mode == kTokensPerStage ? c.stages * (c.rows + c.token_rows) * c.ksb
                                                  : (c.stages * c.rows + c.token_rows) * c.ksb;
    const int padded = std::max(ring + 1024, static_cast<int>(228 * 1024 / c.occupancy) - 1024 - 2048);
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, padded));
    int occ = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, threads, padded));
    const int tiles = static_cast<int>(ROWS_TOTAL / c.rows);
    if (c.random != filled_random) {
      fill_kernel<<<4 * sms, 256>>>(reinterpret_cast<uint32_t*>(w), REGION * REGIONS / 4, c.random ? 0x2545f491u : 0);
      CHECK(cudaDeviceSynchronize());
      filled_random = c.random;
    }
    uint32_t lcg = 12345;
    // one launch on the next region (L2 holds none of it) or, with the expert layout, on 16 other random experts
    auto launch_next = [&] {
      const uint8_t* region = w + REGION * (launch++ % REGIONS);
      Params p{c.experts ? w : region, c.rows, c.ksb, tiles, c.loader, c.experts, {}, c.delay, stamps, sink,
               c.share, c.token_rows, tokens, c.ws_mode, c.token_pattern, c.token_loader};
      for (int i = 0; i < kChosen; ++i) {  // distinct random experts
        bool fresh = false;
        while (!fresh) {
          lcg = lcg * 1664525u + 1013904223u;
          p.chosen[i] = (lcg >> 8) % kExperts;
          fresh = std::find(p.chosen, p.chosen + i, p.chosen[i]) == p.chosen + i;
        }
      }
      kernel<<<c.grid, threads, padded>>>(p, make_map(region, c.rows, c.ksb),
                                          make_map(tokens, std::max(c.token_rows, 1), c.ksb, kTokenPool));
      CHECK(cudaGetLastError());
    };
    std::vector<double> spans, cta_us, rate1, rate2, mhz;
    for (int r = 0; r < 12; ++r) {
      launch_next();
      CHECK(cudaDeviceSynchronize());
      if (r < 3) continue;
      std::vector<Stamp> s(c.grid);
      CHECK(cudaMemcpy(s.data(), stamps, sizeof(Stamp) * c.grid, cudaMemcpyDeviceToHost));
      unsigned long long first = ~0ull, last = 0;
      for (const Stamp& x : s) {
        first = std::min(first, x.start);
        last = std::max(last, x.end);
      }
      // CTAs that shared their SM with another one at some time ("@2+"), or ran alone on it ("@1")
      std::vector<bool> shared(c.grid, false);
      for (int a = 0; a < c.grid; ++a)
        for (int b = a + 1; b < c.grid; ++b)
          if (s[a].sm == s[b].sm && s[a].start < s[b].end && s[b].start < s[a].end) shared[a] = shared[b] = true;
      spans.push_back((last - first) / 1e3);
      double sum_us = 0, b1 = 0, t1 = 0, b2 = 0, t2 = 0, cycles = 0, ns = 0;
      for (int b = 0; b < c.grid; ++b) {
        const double us = (s[b].end - s[b].start) / 1e3;
        const int my_items = (tiles * c.share - b + c.grid - 1) / c.grid;
        const double bytes = static_cast<double>(my_items) * (c.rows + c.token_rows) * K_BYTES;
        sum_us += us;
        cycles += s[b].cycles, ns += s[b].end - s[b].start;
        if (!shared[b]) b1 += bytes, t1 += us;
        else b2 += bytes, t2 += us;
      }
      cta_us.push_back(sum_us / c.grid);
      rate1.push_back(t1 > 0 ? b1 / t1 / 1e3 : 0);
      rate2.push_back(t2 > 0 ? b2 / t2 / 1e3 : 0);
      mhz.push_back(cycles / ns * 1e3);
    }
    // the same launches back to back: us per launch over kBurst stream launches without a host sync between them,
    // including the host's tensor-map encoding and the launch gaps (a replayed graph would have smaller gaps)
    CHECK(cudaEventRecord(e0));
    constexpr int kBurst = 30;
    for (int r = 0; r < kBurst; ++r) launch_next();
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float burst_ms;
    CHECK(cudaEventElapsedTime(&burst_ms, e0, e1));
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double span = median(spans);
    std::printf("%-40s %-9s %2d %4d %4d %3d %5d %4d %4d | %7.1f %6.2f | %8.1f %8.1f %8.1f | %8.1f %5.0f\n", c.note,
                kLoaderNames[c.loader], c.stages, c.rows, c.token_rows, c.share, c.ksb, occ, c.grid, span,
                REGION / span / 1e6, median(cta_us), median(rate1), median(rate2), burst_ms * 1e3 / kBurst,
                median(mhz));
  }
  CHECK(cudaFree(w));
  CHECK(cudaFree(tokens));
  return 0;
}
