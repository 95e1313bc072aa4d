// Stage 1 on CUDA: the fused router + predictor GEMV.
//
// Both weight matrices are one virtual [R, H] matrix (R = E router rows, then E predictor rows), read once per
// call. The product out[T, R] = hidden[T, H] . W[R, H]^T runs on tensor cores (mma.sync m16n8k16, bf16/fp16 in,
// fp32 accumulate): the m dimension is tokens, n is weight rows, k is H. A CTA owns a tile of BM tokens x 128 weight
// rows and a slice of H, whose operands go through shared memory in stages of 64 columns (a kStages-deep cp.async
// pipeline), so each hidden row is read once per 128 weight rows and each weight row once per BM tokens; the weight
// stages before the first are copied before the PDL wait, while the previous kernel finishes. The CTAs of one
// thread-block cluster (up to 16) split H and reduce their partial tiles through distributed shared memory in rank
// order, so the result is deterministic and the grid has about one CTA per SM.
// This replaced a kernel that fed each warp's MMAs straight from global memory (16-byte loads into registers, no
// reuse across warps: ~12 MB of L2 -> SM traffic at Qwen3's T = 256 against ~6 here). Router_predict alone, H200,
// graph replay of consecutive calls on rotated inputs, us at T = 1 / 16 / 64 / 256: Qwen3 (H 2048, E 128) 3.75 / 4.17 /
// 8.63 / 9.96 -> 3.38 / 4.13 / 5.23 / 5.73, DeepSeek-like (H 7168, E 256) 8.18 / 8.90 / 21.64 / 34.59 -> 5.66 / 6.47 /
// 8.58 / 17.94 (device_runs/session46.txt: the old kernel in call 2, this one in calls 8 and, at DeepSeek's T = 256,
// 4).
// fp32 inputs (and unaligned or H % 8 != 0 shapes) take a plain fp32 FMA kernel, as do devices whose shared memory
// is too small for the 4-stage tiles (below 72-96 KB per CTA).
// The op wrappers (argument checks, outputs, registration) are in csrc/select_cuda.cpp.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>

#include "base_moe/cuda_utils.cuh"
#include "base_moe/launch.cuh"
#include "base_moe/select_kernels.h"

namespace base_moe {
namespace {

template <typename T>
__device__ __forceinline__ const T* weight_row(const GemvParams& p, int row) {
  return row < p.E ? static_cast<const T*>(p.router_weight) + static_cast<int64_t>(row) * p.H
                   : static_cast<const T*>(p.predictor_weight) + static_cast<int64_t>(row - p.E) * p.H;
}

// Row `row`'s bias: the router's (0 without one: store_output then adds nothing) or the predictor's; 0 past R.
__device__ __forceinline__ float row_bias(const GemvParams& p, int row) {
  if (row >= p.R) return 0.0f;
  if (row < p.E) return p.router_bias != nullptr ? p.router_bias[row] : 0.0f;
  return p.predictor_bias[row - p.E];
}

// The output of (token, row) from its dot product and its row_bias; a logit rounded to T where round_logits asks.
template <typename T>
__device__ __forceinline__ void store_output(const GemvParams& p, int token, int row, float acc, float bias) {
  if (row < p.E) {
    if (p.router_bias != nullptr) acc += bias;
    if (p.round_logits) acc = cuda::to_float(cuda::from_float<T>(acc));
    p.logits[static_cast<int64_t>(token) * p.E + row] = acc;
  } else {
    p.log_norms[static_cast<int64_t>(token) * p.E + row - p.E] = acc + bias;
  }
}

constexpr int kBK = 64, kTileRows = 128, kMmaThreads = 256;

template <int BM, int kStages>
constexpr int mma_smem_bytes() {
  return kStages * (BM + kTileRows) * kBK * 2;
}

__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {  // byte offset of 16-byte chunk `chunk` of `row`
  return static_cast<uint32_t>(row * kBK * 2 + ((chunk ^ (row & 7)) << 4));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// 8 warps, WM x WN, each 16 MT tokens x 8 NT weight rows of the CTA's BM x 128 tile; a ring of kStages stages.
// Fragments come from shared memory by ldmatrix: stage rows of 64 elements, their 16-byte chunks XOR-swizzled by row
// so that the 8 rows one ldmatrix reads fall on distinct banks.
template <typename T, int MT, int NT, int WM, int WN, int kStages>
__global__ void __launch_bounds__(kMmaThreads) router_predict_mma_kernel(const GemvParams p) {
  static_assert(WM * WN * 32 == kMmaThreads && 8 * NT * WN == kTileRows && NT % 2 == 0, "tile shape");
  constexpr int BM = 16 * MT * WM, kStageBytes = (BM + kTileRows) * kBK * 2, kPad = 8;
  extern __shared__ __align__(128) unsigned char stage_smem[];
  const uint32_t smem = static_cast<uint32_t>(__cvta_generic_to_shared(stage_smem));

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp / WN, wn = warp % WN;
  const unsigned rank = cuda::cluster_rank();
  const int tok_base = blockIdx.z * BM, row_base = blockIdx.y * kTileRows;
  const int k_begin = static_cast<int>(rank) * p.k_per_cta;
  const int k_end = min(p.H, k_begin + p.k_per_cta);
  const int stages = k_end > k_begin ? (k_end - k_begin + kBK - 1) / kBK : 0;

  // Thread tid copies chunk tid & 7 of tile rows tid / 8 + 32 j: its row pointers are fixed, only k moves.
  const int chunk = tid & 7, first_row = tid >> 3;
  constexpr int kRowsPerThread = kTileRows / 32, kTokensPerThread = (BM + 31) / 32;
  const T* w_src[kRowsPerThread];
  bool w_ok[kRowsPerThread];
#pragma unroll
  for (int j = 0; j < kRowsPerThread; ++j) {
    const int row = row_base + first_row + 32 * j;
    w_ok[j] = row < p.R;
    w_src[j] = weight_row<T>(p, w_ok[j] ? row : 0) + chunk * 8;
  }
  const T* x_src[kTokensPerThread];
  bool x_ok[kTokensPerThread];
#pragma unroll
  for (int j = 0; j < kTokensPerThread; ++j) {
    const int r = first_row + 32 * j, token = tok_base + r;
    x_ok[j] = r < BM && token < p.T;
    x_src[j] = static_cast<const T*>(p.hidden) + static_cast<int64_t>(x_ok[j] ? token : 0) * p.H + chunk * 8;
  }
  auto load_weights = [&](int s) {  // stage s's weight tile, zeros past the rows and the slice
    const int k = k_begin + s * kBK + chunk * 8;
    const uint32_t base = smem + (s % kStages) * kStageBytes + BM * kBK * 2;
#pragma unroll
    for (int j = 0; j < kRowsPerThread; ++j) {
      const bool ok = w_ok[j] && k < k_end;
      cuda::cp_async16_zfill(base + swizzled(first_row + 32 * j, chunk), ok ? w_src[j] + (k - chunk * 8) : w_src[j],
                             ok);
    }
  };
  auto load_hidden = [&](int s) {  // stage s's hidden tile, zeros past the tokens and the slice
    const int k = k_begin + s * kBK + chunk * 8;
    const uint32_t base = smem + (s % kStages) * kStageBytes;
#pragma unroll
    for (int j = 0; j < kTokensPerThread; ++j) {
      if (first_row + 32 * j >= BM) continue;
      const bool ok = x_ok[j] && k < k_end;
      cuda::cp_async16_zfill(base + swizzled(first_row + 32 * j, chunk), ok ? x_src[j] + (k - chunk * 8) : x_src[j],
                             ok);
    }
  };

  // The weights do not depend on the previous kernel: their first stages are copied while it finishes.
  cuda::pdl_launch_dependents();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < stages) load_weights(s);
  }
  cuda::cp_async_commit();
  cuda::pdl_wait();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < stages) load_hidden(s);
    cuda::cp_async_commit();
  }
  // The biases of this thread's first quad of the reduction below (at most one quad per thread wherever the grid
  // has clusters of 8 or more), loaded now, after the wait (a bias may come from the kernel just before): their
  // latency hides behind the k loop. Loaded in the reduction, each waited for the previous output's store (a load
  // cannot move above a store to memory it may alias): four cold loads in a row on the kernel's tail.
  constexpr int kQuads = BM * kTileRows / 4;
  const int first_quad = static_cast<int>(rank) * kMmaThreads + tid;
  float first_bias[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    first_bias[i] = first_quad < kQuads ? row_bias(p, row_base + (first_quad % (kTileRows / 4)) * 4 + i) : 0.0f;
  }

  float acc[MT][NT][4] = {};
  for (int s = 0; s < stages; ++s) {
    cuda::cp_async_wait<kStages - 2>();  // stage s is in (groups complete in order)
    __syncthreads();                     // ... for every thread; and stage s - 1's slot is free again
    const int next = s + kStages - 1;
    if (next < stages) {
      load_weights(next);
      load_hidden(next);
    }
    cuda::cp_async_commit();
    const uint32_t a_base = smem + (s % kStages) * kStageBytes, b_base = a_base + BM * kBK * 2;
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      uint32_t a[MT][4], b[NT][2];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {  // x4: rows 0-7 / 8-15 at k 0-7, then at k 8-15 (a0..a3)
        const int row = wm * 16 * MT + mt * 16 + (lane & 15);
        ldmatrix_x4(a[mt], a_base + swizzled(row, kk * 2 + (lane >> 4)));
      }
#pragma unroll
      for (int np = 0; np < NT / 2; ++np) {  // x4: n-tile 2 np at k 0-7 / 8-15, then n-tile 2 np + 1
        const int row = wn * 8 * NT + np * 16 + ((lane >> 4) << 3) + (lane & 7);
        uint32_t r[4];
        ldmatrix_x4(r, b_base + swizzled(row, kk * 2 + ((lane >> 3) & 1)));
        b[2 * np][0] = r[0];
        b[2 * np][1] = r[1];
        b[2 * np + 1][0] = r[2];
        b[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          cuda::mma_16816<T>(acc[mt][nt], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[nt][0], b[nt][1]);
    }
  }
  cuda::cp_async_wait<0>();
  __syncthreads();  // every warp is done with the stages: their memory takes the partial tile

  // C fragment: c0, c1 at (token g, rows 2 t4, 2 t4 + 1); c2, c3 at (token g + 8, same rows).
  float(*partial)[kTileRows + kPad] = reinterpret_cast<float(*)[kTileRows + kPad]>(stage_smem);
  const int g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int tl = wm * 16 * MT + mt * 16 + g, rl = wn * 8 * NT + nt * 8 + 2 * t4;
      *reinterpret_cast<float2*>(&partial[tl][rl]) = make_float2(acc[mt][nt][0], acc[mt][nt][1]);
      *reinterpret_cast<float2*>(&partial[tl + 8][rl]) = make_float2(acc[mt][nt][2], acc[mt][nt][3]);
    }
  cuda::cluster_sync();
  // The cluster's CTAs reduce disjoint 4-row groups of the tile over all CTAs' slices of H, in rank order.
  const int cluster = p.cluster;
  for (int q = first_quad; q < kQuads; q += cluster * kMmaThreads) {
    const int tl = q / (kTileRows / 4), rl = (q % (kTileRows / 4)) * 4;
    const int token = tok_base + tl;
    if (token >= p.T) continue;
    float bias[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) bias[i] = q == first_quad ? first_bias[i] : row_bias(p, row_base + rl + i);
    float4 s = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (int c = 0; c < cluster; ++c) {
      const float4 v = *reinterpret_cast<const float4*>(cuda::cluster_map(&partial[tl][rl], c));
      s.x += v.x;
      s.y += v.y;
      s.z += v.z;
      s.w += v.w;
    }
    const float sums[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (row_base + rl + i < p.R) store_output<T>(p, token, row_base + rl + i, sums[i], bias[i]);
    }
  }
  cuda::cluster_sync();  // keep this CTA's shared memory alive until the others have read it
}

// fp32 (or unaligned) fallback: one warp per weight row, a block of tokens per CTA, fp32 FMA.
template <typename T>
__global__ void __launch_bounds__(256) router_predict_simple_kernel(const GemvParams p) {
  constexpr int kRowsPerCta = 8, kTokensPerCta = 16;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row = blockIdx.x * kRowsPerCta + warp;
  cuda::pdl_launch_dependents();
  cuda::pdl_wait();
  if (row >= p.R) return;
  const T* w = weight_row<T>(p, row);
  const int t_end = min(p.T, static_cast<int>(blockIdx.y + 1) * kTokensPerCta);
  for (int t = blockIdx.y * kTokensPerCta; t < t_end; ++t) {
    const T* x = static_cast<const T*>(p.hidden) + static_cast<int64_t>(t) * p.H;
    float acc = 0.0f;
    for (int k = lane; k < p.H; k += 32) acc = fmaf(cuda::to_float(x[k]), cuda::to_float(w[k]), acc);
    acc = cuda::warp_sum(acc);
    if (lane == 0) store_output<T>(p, t, row, acc, row_bias(p, row));
  }
}

// Whether a CTA of BM tokens with a ring of kStages fits the device's shared memory: the 6-stage rings (108-144 KB)
// do not on sm_86 / sm_89 GPUs (99 KB per CTA), which run the 4-stage ones (72-96 KB). (PyTorch caches the device
// properties.)
template <int BM, int kStages>
bool mma_fits(int device) {
  const size_t bytes = mma_smem_bytes<BM, kStages>();
  return bytes <= at::cuda::getDeviceProperties(device)->sharedMemPerBlockOptin;
}

// Largest cluster (16, 8, or 1 without clusters) the device co-schedules for this instance, asked once per device
// (which also raises the instance's shared-memory limit to what it needs; only for an instance that fits, mma_fits).
template <typename T, int MT, int NT, int WM, int WN, int kStages>
int mma_max_cluster(int device) {
  static std::atomic<int> memo[cuda::kMaxDevices];
  return cuda::once_per_device(memo, device, 1, [&] {
    constexpr int kBytes = mma_smem_bytes<16 * MT * WM, kStages>();
    auto kernel = router_predict_mma_kernel<T, MT, NT, WM, WN, kStages>;
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes));
    return cuda::device_has_clusters(device) ? cuda::largest_cluster(kernel, kMmaThreads, kBytes) : 1;
  });
}

// The grid: about one CTA per SM, the cluster splitting H as far as the tiles leave SMs free (at least one 64-column
// stage each). Clusters of 16 only while the grid stays within 64 CTAs (up to 4 tiles): there they made router_predict
// alone 0.3-3.3 us faster than clusters of 8 (Qwen3's T <= 128, DeepSeek's T <= 64), but at Qwen3's T = 256 (8 tiles,
// 128 CTAs) 0.26 us slower alone and the whole two-kernel selection 1.66 us slower (session 46, calls 2-3).
struct MmaGrid {
  int tiles, cluster;
};

template <int BM>
MmaGrid mma_grid(const GemvParams& p, bool clusters, int max_cluster, int sms) {
  MmaGrid g{((p.T + BM - 1) / BM) * ((p.R + kTileRows - 1) / kTileRows), 1};
  if (clusters) g.cluster = std::clamp((sms + g.tiles - 1) / g.tiles, 1, g.tiles <= 4 ? 16 : 8);
  g.cluster = std::max(1, std::min({g.cluster, max_cluster, (p.H + kBK - 1) / kBK}));
  return g;
}

template <typename T, int MT, int NT, int WM, int WN, int kStages>
void launch_mma(GemvParams p, const MmaGrid& g, bool clusters, cudaStream_t stream) {
  constexpr int BM = 16 * MT * WM;
  p.cluster = g.cluster;
  p.k_per_cta = ((p.H + g.cluster - 1) / g.cluster + kBK - 1) / kBK * kBK;
  const dim3 grid(g.cluster, (p.R + kTileRows - 1) / kTileRows, (p.T + BM - 1) / BM);
  cuda::launch({grid, dim3(kMmaThreads), static_cast<size_t>(mma_smem_bytes<BM, kStages>()), stream,
                clusters ? g.cluster : 0, clusters && cuda::selection_pdl()},
               router_predict_mma_kernel<T, MT, NT, WM, WN, kStages>, p);
}

// A ring of 6 stages (144 KB at BM = 64) where the grid leaves half the SMs free, 4 (96 KB) elsewhere. With 6, a CTA
// of Qwen3's T = 256 (4 stages of H) has every weight stage in flight before its PDL wait: router_predict alone 8.09 ->
// 5.73 us, the two-kernel selection 16.09 -> 15.63. Where the grid fills the SMs, the 4-stage ring leaves room for the
// next call's CTAs beside each CTA: 6 stages made DeepSeek's T = 256 (128 CTAs) 17.94 -> 21.47 alone (session 46,
// calls 4 and 8).
template <typename T, int MT, int NT, int WM, int WN>
bool launch_tile_shape(const GemvParams& p, bool clusters, cudaStream_t stream, int device) {
  constexpr int BM = 16 * MT * WM;
  if (!mma_fits<BM, 4>(device)) return false;
  const int sms = at::cuda::getDeviceProperties(device)->multiProcessorCount;
  const MmaGrid g = mma_grid<BM>(p, clusters, mma_max_cluster<T, MT, NT, WM, WN, 4>(device), sms);
  if (2 * g.tiles * g.cluster <= sms && mma_fits<BM, 6>(device) &&
      mma_max_cluster<T, MT, NT, WM, WN, 6>(device) >= g.cluster) {
    launch_mma<T, MT, NT, WM, WN, 6>(p, g, clusters, stream);
  } else {
    launch_mma<T, MT, NT, WM, WN, 4>(p, g, clusters, stream);
  }
  return true;
}

// Token tiles of 16, 32 or 64 (BM) by the batch: no more padding than a 16-token MMA needs. False where the device's
// shared memory is too small for the tiles (the simple kernel runs).
template <typename T>
bool launch_tiles(const GemvParams& p, bool clusters, cudaStream_t stream, int device) {
  if (p.T <= 16) return launch_tile_shape<T, 1, 2, 1, 8>(p, clusters, stream, device);
  if (p.T <= 32) return launch_tile_shape<T, 1, 4, 2, 4>(p, clusters, stream, device);
  return launch_tile_shape<T, 2, 4, 2, 4>(p, clusters, stream, device);
}

}  // namespace

void router_predict_launch(GemvParams p, FloatDtype dtype, bool vectorised, int device) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  const bool clusters = cuda::device_has_clusters(device);
  p.k_per_cta = p.H;
  p.cluster = 1;
  if (vectorised && dtype == FloatDtype::kBFloat16 && launch_tiles<__nv_bfloat16>(p, clusters, stream, device)) return;
  if (vectorised && dtype == FloatDtype::kHalf && launch_tiles<__half>(p, clusters, stream, device)) return;
  const dim3 grid((p.R + 7) / 8, (p.T + 15) / 16);
  if (dtype == FloatDtype::kFloat) {
    router_predict_simple_kernel<float><<<grid, 256, 0, stream>>>(p);
  } else if (dtype == FloatDtype::kHalf) {
    router_predict_simple_kernel<__half><<<grid, 256, 0, stream>>>(p);
  } else {
    router_predict_simple_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(p);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace base_moe
