// Microbenchmark (standalone, not part of the library): the floor of select_experts' launch shape on the H200, i.e.
// what consecutive launches of a kernel shaped like it cost when it does (almost) nothing, to tell how much of #3's
// 6 us target its structure leaves for the work itself.
//
//   nvcc -O3 -std=c++20 -arch=sm_90a -Icsrc/include benchmarks/micro/select_floor.cu -o /tmp/select_floor && /tmp/select_floor
//
// Every case is a CUDA graph of kRot consecutive launches of one cluster of C CTAs x 512 threads with ~200 KB of
// dynamic shared memory (select_experts' occupancy at the Qwen3 shape), launched with programmatic dependent launch
// (PDL) as the library does; the graph is replayed kReplays times, and the per-launch time is the median replay
// time / kRot. Nothing is checked: the kernels compute nothing. What a launch does, cumulatively:
//   empty   : trigger its dependents, wait for its predecessor (griddepcontrol), nothing else
//   +stage  : before the wait, copy its share of 1 MB of "weight rows" into shared memory with 16-byte cp.async
//             (a different 1 MB copy per launch out of 64: L2 holds none), and wait for them after the wait
//   +hidden : after the wait, load one 4 KB "hidden row" (one decode token) and add it up
//   +3 bar  : three cluster barriers (select_experts has three)
//   +out    : write 4 KB of outputs
// "late trigger" variants trigger their dependents after the wait instead of at the start (the order
// notes/early_kept.patch gives the selection kernels). "after a norm": each launch follows a small kernel that
// does not trigger (a stand-in for the decoder layer's RMSNorm), timed as (norm + launch) - norm, as
// benchmarks/bench_select.py does.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "base_moe/cuda_utils.cuh"
#include "base_moe/launch_config.cuh"
#include "check.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kSmemBytes = 200 * 1024;
constexpr int kWeightBytes = 1 << 20;  // router + predictor rows of Qwen3-30B-A3B (2 x 128 x 2048 bf16)
constexpr int kCopies = 64;            // 64 MB of weight copies: more than the 60 MB L2
constexpr int kRot = kCopies;  // each launch of a replay reads its own copy
constexpr int kReplays = 50;
constexpr int kHidden = 2048;

enum Mode : int { kStage = 1, kHiddenRow = 2, kBarriers = 4, kOutput = 8, kLateTrigger = 16 };

struct Args {
  const uint4* weights;  // this launch's 1 MB copy
  const uint4* hidden;   // [kHidden] bf16 = 4 KB
  float* out;
};

__global__ void __launch_bounds__(kThreads, 1) floor_kernel(const Args a, int mode) {
  extern __shared__ __align__(16) uint4 smem[];
  namespace bc = base_moe::cuda;
  const int tid = threadIdx.x;
  const unsigned rank = bc::cluster_rank();
  const int C = static_cast<int>(gridDim.x);  // one cluster per launch
  if (!(mode & kLateTrigger)) bc::pdl_launch_dependents();
  if (mode & kStage) {
    const int chunks = kWeightBytes / 16 / C;  // this CTA's 16-byte chunks
    const uint4* src = a.weights + static_cast<int64_t>(rank) * chunks;
    for (int i = tid; i < chunks; i += kThreads) bc::cp_async16(smem + i, src + i);
    bc::cp_async_commit();
  }
  bc::pdl_wait();
  if (mode & kLateTrigger) {
    __syncthreads();
    bc::pdl_launch_dependents();
  }
  float acc = 0.0f;
  if (mode & kStage) {
    bc::cp_async_wait<0>();
    __syncthreads();
    acc += static_cast<float>(smem[tid].x & 1u);
  }
  if ((mode & kHiddenRow) && tid < kHidden / 8) {
    const uint4 v = a.hidden[tid];
    acc += static_cast<float>((v.x ^ v.y ^ v.z ^ v.w) & 1u);
  }
  if (mode & kBarriers) {
    for (int b = 0; b < 3; ++b) bc::cluster_sync();
  }
  if (mode & kOutput) {
    for (int i = tid; i < 1024; i += kThreads) a.out[rank * 1024 + i] = acc;
  }
}

// The decoder norm's stand-in: copies 16 x kHidden bf16 (16 tokens) over 132 CTAs; no PDL trigger.
__global__ void norm_kernel(const uint4* in, uint4* out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = in[i];
}

void launch_floor(const Args& a, int mode, int cluster, cudaStream_t s) {
  const base_moe::cuda::LaunchConfig config({dim3(cluster), dim3(kThreads), kSmemBytes, s, cluster, true});
  CHECK(cudaLaunchKernelEx(config.get(), floor_kernel, a, mode));
}

struct Buffers {
  uint4* weights;
  uint4* hidden;
  float* out;
  uint4* norm_in;
  uint4* norm_out;
};

// Median microseconds per launch of kRot launches (each after a norm launch when with_norm), or of the norms alone.
float time_case(const Buffers& b, int mode, int cluster, bool with_norm, bool norm_only, cudaStream_t s) {
  const int norm_n = 16 * kHidden / 8;  // 16 tokens
  auto body = [&] {
    for (int r = 0; r < kRot; ++r) {
      if (with_norm || norm_only) norm_kernel<<<132, 256, 0, s>>>(b.norm_in, b.norm_out, norm_n);
      if (norm_only) continue;
      const Args a{b.weights + static_cast<int64_t>(r) * (kWeightBytes / 16), b.hidden, b.out};
      launch_floor(a, mode, cluster, s);
    }
  };
  body();  // warm-up outside capture
  CHECK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  body();
  CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec;
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::vector<float> us;
  for (int i = 0; i < kReplays; ++i) {
    CHECK(cudaEventRecord(e0, s));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(e1, s));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    us.push_back(ms * 1000.0f / kRot);
  }
  std::sort(us.begin(), us.end());
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return us[us.size() / 2];
}

}  // namespace

int main() {
  CHECK(cudaFuncSetAttribute(floor_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  CHECK(cudaFuncSetAttribute(floor_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  Buffers b{};
  CHECK(cudaMalloc(&b.weights, static_cast<size_t>(kWeightBytes) * kCopies));
  CHECK(cudaMemset(b.weights, 1, static_cast<size_t>(kWeightBytes) * kCopies));
  CHECK(cudaMalloc(&b.hidden, kHidden * 2));
  CHECK(cudaMemset(b.hidden, 0, kHidden * 2));
  CHECK(cudaMalloc(&b.out, 16 * 1024 * sizeof(float)));
  CHECK(cudaMalloc(&b.norm_in, 16 * kHidden * 2));
  CHECK(cudaMalloc(&b.norm_out, 16 * kHidden * 2));
  CHECK(cudaMemset(b.norm_in, 0, 16 * kHidden * 2));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));

  const float norm = time_case(b, 0, 16, false, true, s);
  std::printf("norm stand-in alone: %.2f us per launch\n", norm);
  std::printf("%-34s %8s %8s %14s\n", "case", "C=16", "C=8", "C=16 after norm");
  struct Case {
    const char* name;
    int mode;
  };
  const Case cases[] = {
      {"empty", 0},
      {"+stage", kStage},
      {"+stage +hidden", kStage | kHiddenRow},
      {"+stage +hidden +3 bar", kStage | kHiddenRow | kBarriers},
      {"+stage +hidden +3 bar +out", kStage | kHiddenRow | kBarriers | kOutput},
      {"empty, late trigger", kLateTrigger},
      {"+stage, late trigger", kStage | kLateTrigger},
      {"all, late trigger", kStage | kHiddenRow | kBarriers | kOutput | kLateTrigger},
  };
  for (const Case& c : cases) {
    const float c16 = time_case(b, c.mode, 16, false, false, s);
    const float c8 = time_case(b, c.mode, 8, false, false, s);
    const float after = time_case(b, c.mode, 16, true, false, s) - norm;
    std::printf("%-34s %8.2f %8.2f %14.2f\n", c.name, c16, c8, after);
  }
  std::printf("(us per launch, median of %d replays of %d launches; select_experts itself: 8.7 / 10.7 us one call at "
              "T = 1 / 16, 13.4 / 15.6 after a norm, session 19)\n", kReplays, kRot);
  return 0;
}
