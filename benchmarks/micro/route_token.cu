// Microbenchmark (standalone, not part of the library): cycles of the selection kernels' per-token warp routines
// (csrc/include/base_moe/routing_device.cuh, the library's own code, included as is) on one warp, cold and warm.
//
//   nvcc -O3 -std=c++20 -arch=sm_90a -Icsrc/include benchmarks/micro/route_token.cu -o /tmp/route_token && /tmp/route_token
//
// Qwen3 routing (E 128, k 8, softmax, renormalised, BASE cost, backfill). One warp per CTA, one CTA per SM; each warp
// routes REPS tokens in a row, timing with clock64 (after the results are consumed):
//   score  : score_token (softmax statistics)
//   route  : route_token (top k of E, the weight rule)
//   fill   : fill_token on the slow path (16 experts kept, none of the routed ones, so the slots are re-ranked)
// Repetition 0 of launch 0 runs code the SM has never fetched (cold instruction cache); later repetitions run it warm.
// The selection kernel runs each routine once per launch, so its cost sits between the two.
// Then candidate rewrites of the top-k loop alone (k rounds over E keys, ties to the lower index), same input:
//   topk_lib    : the library's warp_top_k (routing_device.cuh): each lane sorts its EPL keys first, so rounds compare
//                 lane heads only (redux + ballot + shfl); until 461c614 a scan of every lane's keys per round, until
//                 0e4657b with shared-memory slot writes (H200: 2070 -> 1999 -> 1080 cycles)
//   topk_shfl   : a scan of every lane's keys per round, with a butterfly of shuffles instead of redux.sync
//   topk_key64  : 64-bit keys (value, ~index): a butterfly max gives every lane the winner; no ballot, no branch
// A candidate rewrite of backfill's slow path (fill_smem: scores, group masks and keys through the warp's shared
// memory, ranks by broadcast loads) was checked bitwise against fill_token and timed here in session 16, then became
// the library's top_k_of_kept (git history: 74d1b69 has the comparison).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "check.cuh"

#include "base_moe/routing_device.cuh"

using namespace base_moe;
using namespace base_moe::routing_device;

constexpr int E = 128, K = 8, EPL = 4, REPS = 8, CTAS = 132, KEPT = 16;

template <typename V>
__device__ __forceinline__ void consume(V v) {
  asm volatile("" ::"r"(*reinterpret_cast<unsigned*>(&v)));
}

__device__ __forceinline__ uint32_t shfl_max_u32(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Lane r < k returns slot r's expert (E if fewer eligible); keys 0 = not eligible. Library semantics.
__device__ __forceinline__ int topk_shfl(uint32_t (&key)[EPL], int k, int lane) {
  int mine = E;
  for (int r = 0; r < k; ++r) {
    uint32_t best = 0;
    int best_j = 0;
#pragma unroll
    for (int j = 0; j < EPL; ++j)
      if (key[j] > best) {
        best = key[j];
        best_j = j;
      }
    const uint32_t top = shfl_max_u32(best);
    if (top == 0) break;
    const int owner = __ffs(__ballot_sync(0xffffffffu, best == top)) - 1;
    const int id = __shfl_sync(0xffffffffu, lane * EPL + best_j, owner);
    if (lane == owner) {
#pragma unroll
      for (int j = 0; j < EPL; ++j)
        if (j == best_j) key[j] = 0;
    }
    if (lane == r) mine = id;
  }
  return mine;
}

__device__ __forceinline__ int topk_key64(uint32_t (&key)[EPL], int k, int lane) {
  uint64_t packed[EPL];
#pragma unroll
  for (int j = 0; j < EPL; ++j)
    packed[j] = key[j] == 0 ? 0 : (static_cast<uint64_t>(key[j]) << 32) | (0xffffffffu - (lane * EPL + j));
  int mine = E;
  for (int r = 0; r < k; ++r) {
    uint64_t best = 0;
#pragma unroll
    for (int j = 0; j < EPL; ++j) best = max(best, packed[j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
    if (best == 0) break;
#pragma unroll
    for (int j = 0; j < EPL; ++j)
      if (packed[j] == best) packed[j] = 0;
    if (lane == r) mine = static_cast<int>(0xffffffffu - static_cast<uint32_t>(best));
  }
  return mine;
}

__global__ void topk_kernel(const float* logits, int variant, long long* cycles, int* ids) {
  const int lane = threadIdx.x;
  for (int rep = 0; rep < REPS; ++rep) {
    const float* row = logits + (blockIdx.x * REPS + rep) * E;
    uint32_t key[EPL];
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      key[j] = base_moe::cuda::ordered_bits(row[lane * EPL + j]);
      consume(key[j]);
    }
    __syncwarp();
    const long long t0 = clock64();
    int id;
    if (variant == 0) {
      id = E;
      warp_top_k<EPL>(key, 0, K, lane, id);
    } else if (variant == 1) {
      id = topk_shfl(key, K, lane);
    } else {
      id = topk_key64(key, K, lane);
    }
    consume(id);
    const long long t1 = clock64();
    if (lane == 0) cycles[blockIdx.x * REPS + rep] = t1 - t0;
    if (lane < K) ids[(blockIdx.x * REPS + rep) * K + lane] = id;
  }
}

// cycles[(cta * REPS + rep) * 3 + phase]
__global__ void route_kernel(const SelectParams p, const float* logits, const float* log_norms, long long* cycles) {
  __shared__ float scratch[E + 2];
  __shared__ uint64_t fill_words[kFillScratchWords / 2];
  __shared__ int kept_flag[E];
  __shared__ int kept[KEPT];
  const int lane = threadIdx.x;
  for (int u = lane; u < E; u += 32) kept_flag[u] = u < 2 * KEPT && (u & 1) == 0;  // the first KEPT even experts
  for (int r = lane; r < KEPT; r += 32) kept[r] = 2 * r;
  __syncwarp();
  for (int rep = 0; rep < REPS; ++rep) {
    const float* row = logits + (blockIdx.x * REPS + rep) * E;
    Token<EPL> s;
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      s.logit[j] = row[lane * EPL + j];
      s.log_norm[j] = log_norms[lane * EPL + j];
      consume(s.logit[j]);
      consume(s.log_norm[j]);
    }
    __syncwarp();
    const long long t0 = clock64();
    score_token<EPL>(p, lane, scratch, scratch + E, s);
    consume(s.denominator);
    const long long t1 = clock64();
    int32_t id;
    float w, log_norm;
    route_token<EPL>(p, s, lane, id, w, log_norm);
    consume(w);
    consume(id);
    const long long t2 = clock64();
    // force the slow path: the routed experts become odd ones, dropped (the kept ones are even)
    s.slot_id = (s.slot_id | 1);
    int slot;
    int32_t fid;
    float fw;
    fill_token<EPL, true>(p, s, lane, kept, [&](int u) { return kept_flag[u] != 0; },
                          FillScratch{scratch, reinterpret_cast<uint32_t*>(fill_words)}, slot, fid, fw);
    consume(fw);
    consume(fid);
    const long long t3 = clock64();
    if (lane == 0) {
      long long* c = cycles + (blockIdx.x * REPS + rep) * 3;
      c[0] = t1 - t0;
      c[1] = t2 - t1;
      c[2] = t3 - t2;
    }
  }
}

int main() {
  SelectParams p{};
  p.B = 1;
  p.E = E;
  p.k = K;
  p.W = KEPT;
  p.scoring = static_cast<int>(Scoring::kSoftmax);
  p.renormalize = true;
  p.n_group = 1;
  p.topk_group = 1;
  p.group_size = E;
  p.scaling = 1.0f;
  p.cost = static_cast<int>(Cost::kBase);
  p.fill = static_cast<int>(Fill::kBackfill);
  std::vector<float> h(CTAS * REPS * E);
  unsigned x = 12345;
  for (float& v : h) {
    x = x * 1664525u + 1013904223u;
    v = static_cast<float>(x >> 8) / 16777216.0f * 4.0f - 2.0f;
  }
  float *logits, *log_norms;
  long long* cycles;
  CHECK(cudaMalloc(&logits, h.size() * sizeof(float)));
  CHECK(cudaMalloc(&log_norms, E * sizeof(float)));
  CHECK(cudaMalloc(&cycles, CTAS * REPS * 3 * sizeof(long long)));
  CHECK(cudaMemcpy(logits, h.data(), h.size() * sizeof(float), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(log_norms, h.data(), E * sizeof(float), cudaMemcpyHostToDevice));
  const char* names[3] = {"score_token", "route_token", "fill_token (slow path)"};
  for (int launch = 0; launch < 3; ++launch) {
    route_kernel<<<CTAS, 32>>>(p, logits, log_norms, cycles);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<long long> c(CTAS * REPS * 3);
    CHECK(cudaMemcpy(c.data(), cycles, c.size() * sizeof(long long), cudaMemcpyDeviceToHost));
    for (int phase = 0; phase < 3; ++phase) {
      std::vector<long long> first, later;
      for (int b = 0; b < CTAS; ++b)
        for (int r = 0; r < REPS; ++r) (r == 0 ? first : later).push_back(c[(b * REPS + r) * 3 + phase]);
      std::sort(first.begin(), first.end());
      std::sort(later.begin(), later.end());
      std::printf("launch %d %-24s cycles: first token median %6lld (max %6lld) | later tokens median %6lld\n", launch,
                  names[phase], first[first.size() / 2], first.back(), later[later.size() / 2]);
    }
  }
  // top-k variants: warm medians, and every variant's ids equal to the library's
  int* ids;
  CHECK(cudaMalloc(&ids, CTAS * REPS * K * sizeof(int)));
  std::vector<int> reference(CTAS * REPS * K), got(CTAS * REPS * K);
  const char* variants[3] = {"topk_lib", "topk_shfl", "topk_key64"};
  for (int v = 0; v < 3; ++v) {
    for (int launch = 0; launch < 2; ++launch) topk_kernel<<<CTAS, 32>>>(logits, v, cycles, ids);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<long long> c(CTAS * REPS);
    CHECK(cudaMemcpy(c.data(), cycles, c.size() * sizeof(long long), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy((v == 0 ? reference : got).data(), ids, got.size() * sizeof(int), cudaMemcpyDeviceToHost));
    std::sort(c.begin(), c.end());
    std::printf("%-12s k=%d of E=%d: warm median %5lld cycles (min %5lld)  ids %s\n", variants[v], K, E,
                c[c.size() / 2], c.front(), v == 0 ? "(reference)" : (got == reference ? "equal" : "DIFFER"));
  }
  return 0;
}
