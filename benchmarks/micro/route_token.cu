// Microbenchmark (standalone, not part of the library): cycles of the selection kernels' per-token warp routines
// (csrc/include/base_moe/routing_device.cuh, the library's own code, included as is) on one warp, cold and warm.
//
//   nvcc -O3 -std=c++20 -arch=sm_90a -Icsrc/include benchmarks/micro/route_token.cu -o /tmp/route_token && /tmp/route_token
//
// Qwen3 routing (E 128, k 8, softmax, renormalised, BASE cost, backfill). One warp per CTA, one CTA per SM; each warp
// routes REPS tokens in a row, timing with clock64 (after the results are consumed):
//   score  : score_token (softmax statistics)
//   route  : route_token (top k of E, the weight rule)
//   fill   : fill_token on the slow path (half the experts kept, none of the routed ones, so the top k is redone)
// Repetition 0 of launch 0 runs code the SM has never fetched (cold instruction cache); later repetitions run it warm.
// The selection kernel runs each routine once per launch, so its cost sits between the two.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "base_moe/routing_device.cuh"

using namespace base_moe;
using namespace base_moe::routing_device;

constexpr int E = 128, K = 8, EPL = 4, REPS = 8, CTAS = 132;

#define CHECK(x)                                                                                    \
  do {                                                                                              \
    cudaError_t e = (x);                                                                            \
    if (e != cudaSuccess) {                                                                         \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));                 \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

template <typename V>
__device__ __forceinline__ void consume(V v) {
  asm volatile("" ::"r"(*reinterpret_cast<unsigned*>(&v)));
}

// cycles[(cta * REPS + rep) * 3 + phase]
__global__ void route_kernel(const SelectParams p, const float* logits, const float* log_norms, long long* cycles) {
  __shared__ float scratch[E + 2];
  __shared__ float slots[3 * kMaxTopK];
  __shared__ int kept_flag[E];
  const int lane = threadIdx.x;
  for (int u = lane; u < E; u += 32) kept_flag[u] = u & 1;
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
    route_token<EPL>(p, s, lane, slots, id, w, log_norm);
    consume(w);
    consume(id);
    const long long t2 = clock64();
    // force the slow path: the routed experts are the odd ones dropped (kept = even experts)
    s.slot_id = (s.slot_id | 1);
    int slot;
    int32_t fid;
    float fw;
    fill_token<EPL>(p, s, lane, slots, [&](int u) { return kept_flag[u] == 0; }, slot, fid, fw);
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
  p.W = 16;
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
  return 0;
}
