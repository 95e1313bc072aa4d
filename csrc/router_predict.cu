// Stage 1 on CUDA: the fused router + predictor GEMV.
//
// Both weight matrices are one virtual [R, H] matrix (R = E router rows, then E predictor rows), read once per
// call. The product out[T, R] = hidden[T, H] . W[R, H]^T runs on tensor cores (mma.sync m16n8k16, bf16/fp16 in,
// fp32 accumulate): the m dimension is tokens, n is weight rows, k is H. Operands come straight from global memory
// with 16-byte loads: within each 32-wide k step, lane (g, t) loads elements [8t, 8t + 8) of its token / row and
// feeds them to two MMAs as logical k {2t, 2t+1, 2t+8, 2t+9}; A and B use the same permutation of k, so the dot
// products are unchanged. A CTA owns a tile of tokens x rows and a slice of H; the CTAs of one thread-block
// cluster split H and reduce their partial tiles through distributed shared memory in rank order, so the result
// is deterministic and the grid has enough CTAs (~130-260) to pull the weights from HBM at decode sizes.
// fp32 inputs (and unaligned or H % 8 != 0 shapes) take a plain fp32 FMA kernel.
// The op wrappers (argument checks, outputs, registration) are in csrc/select_cuda.cpp.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdlib>

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

__device__ __forceinline__ void store_output(const GemvParams& p, int token, int row, float acc) {
  if (row < p.E) {
    if (p.router_bias != nullptr) acc += p.router_bias[row];
    p.logits[static_cast<int64_t>(token) * p.E + row] = acc;
  } else {
    const int u = row - p.E;
    p.log_norms[static_cast<int64_t>(token) * p.E + u] = acc + p.predictor_bias[u];
  }
}

// Warp tile: 16*MT tokens x 8*NT rows. CTA: WM x WN warp tiles, WK warps splitting the CTA's slice of H.
template <typename T, int MT, int NT, int WM, int WN, int WK, int U>
__global__ void __launch_bounds__(WM* WN* WK * 32)
    router_predict_mma_kernel(const GemvParams p) {
  constexpr int kTM = 16 * MT * WM, kTN = 8 * NT * WN, kPad = 1;
  __shared__ float partial[WK][kTM][kTN + kPad];

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t4 = lane & 3;
  const int wk = warp / (WM * WN), wm = (warp % (WM * WN)) / WN, wn = warp % WN;
  const unsigned rank = cuda::cluster_rank();
  const int tok_base = blockIdx.z * kTM + wm * 16 * MT;
  const int row_base = blockIdx.y * kTN + wn * 8 * NT;
  const int k_begin = static_cast<int>(rank) * p.k_per_cta;
  const int k_end = min(p.H, k_begin + p.k_per_cta);
  const int steps = k_end > k_begin ? (k_end - k_begin + 31) / 32 : 0;

  const T* a_ptr[MT][2];
  bool a_ok[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tok = tok_base + mt * 16 + h * 8 + g;
      a_ok[mt][h] = tok < p.T;
      a_ptr[mt][h] = static_cast<const T*>(p.hidden) + static_cast<int64_t>(a_ok[mt][h] ? tok : 0) * p.H;
    }
  }
  const T* b_ptr[NT];
  bool b_ok[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int row = row_base + nt * 8 + g;
    b_ok[nt] = row < p.R;
    b_ptr[nt] = weight_row<T>(p, b_ok[nt] ? row : 0);
  }

  // The weights do not depend on the previous kernel: start pulling this warp's slice into L2, then wait for the
  // previous kernel (programmatic dependent launch) before reading hidden states.
  cuda::pdl_launch_dependents();
  for (int s = wk; s < steps; s += WK) {
    const int k = k_begin + s * 32 + t4 * 8;
    if (k >= k_end) break;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      if (b_ok[nt]) cuda::prefetch_l2(b_ptr[nt] + k);
    }
  }
  cuda::pdl_wait();

  float acc[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.0f;

  const uint4 zero = make_uint4(0, 0, 0, 0);
  for (int s0 = wk; s0 < steps; s0 += WK * U) {
    uint4 a[U][MT][2], b[U][NT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k_begin + (s0 + u * WK) * 32 + t4 * 8;
      const bool ok = k < k_end;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) a[u][mt][h] = ok && a_ok[mt][h] ? cuda::load16(a_ptr[mt][h] + k) : zero;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) b[u][nt] = ok && b_ok[nt] ? cuda::load16(b_ptr[nt] + k) : zero;
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          cuda::mma_16816<T>(acc[mt][nt], a[u][mt][0].x, a[u][mt][1].x, a[u][mt][0].y, a[u][mt][1].y, b[u][nt].x,
                             b[u][nt].y);
          cuda::mma_16816<T>(acc[mt][nt], a[u][mt][0].z, a[u][mt][1].z, a[u][mt][0].w, a[u][mt][1].w, b[u][nt].z,
                             b[u][nt].w);
        }
  }

  // Accumulator (m16n8 C fragment): c0, c1 at (token g, rows 2t, 2t+1); c2, c3 at (token g + 8, same rows).
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int tl = wm * 16 * MT + mt * 16 + g, rl = wn * 8 * NT + nt * 8 + t4 * 2;
      partial[wk][tl][rl] = acc[mt][nt][0];
      partial[wk][tl][rl + 1] = acc[mt][nt][1];
      partial[wk][tl + 8][rl] = acc[mt][nt][2];
      partial[wk][tl + 8][rl + 1] = acc[mt][nt][3];
    }
  __syncthreads();
  // Sum the warps' k slices in order into partial[0].
  if constexpr (WK > 1) {
    for (int e = threadIdx.x; e < kTM * kTN; e += blockDim.x) {
      const int tl = e / kTN, rl = e % kTN;
      float s = partial[0][tl][rl];
#pragma unroll
      for (int w = 1; w < WK; ++w) s += partial[w][tl][rl];
      partial[0][tl][rl] = s;
    }
  }
  cuda::cluster_sync();
  // The cluster's CTAs reduce disjoint parts of the tile over all CTAs' slices of H, in rank order.
  const int cluster = p.cluster;
  for (int e = static_cast<int>(rank) * blockDim.x + threadIdx.x; e < kTM * kTN; e += cluster * blockDim.x) {
    const int tl = e / kTN, rl = e % kTN;
    const int token = blockIdx.z * kTM + tl, row = blockIdx.y * kTN + rl;
    if (token >= p.T || row >= p.R) continue;
    float s = 0.0f;
    for (int c = 0; c < cluster; ++c) s += cuda::cluster_map(&partial[0][tl][rl], c)[0];
    store_output(p, token, row, s);
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
    if (lane == 0) store_output(p, t, row, acc);
  }
}

template <typename T, int MT, int NT, int WM, int WN, int WK, int U>
void launch_mma(GemvParams p, bool clusters, cudaStream_t stream) {
  constexpr int kTM = 16 * MT * WM, kTN = 8 * NT * WN;
  const int tiles = ((p.T + kTM - 1) / kTM) * ((p.R + kTN - 1) / kTN);
  // Enough CTAs to have the whole weight read in flight at once (~2 per SM), at most 8 per cluster.
  int cluster = clusters ? std::clamp((264 + tiles - 1) / tiles, 1, 8) : 1;
  cluster = std::max(1, std::min(cluster, p.H / 256));
  p.cluster = cluster;
  p.k_per_cta = (((p.H + cluster - 1) / cluster) + 31) / 32 * 32;

  const dim3 grid(cluster, (p.R + kTN - 1) / kTN, (p.T + kTM - 1) / kTM);
  cuda::launch({grid, dim3(WM * WN * WK * 32), 0, stream, clusters ? cluster : 0, clusters && cuda::selection_pdl()},
               router_predict_mma_kernel<T, MT, NT, WM, WN, WK, U>, p);
}

template <typename T>
void launch_tiles(const GemvParams& p, bool clusters, cudaStream_t stream) {
  if (p.T <= 16) {
    launch_mma<T, 1, 2, 1, 1, 4, 4>(p, clusters, stream);
  } else if (p.T <= 32) {
    launch_mma<T, 2, 2, 1, 1, 4, 2>(p, clusters, stream);
  } else if (p.T <= 64) {
    launch_mma<T, 4, 2, 1, 1, 4, 2>(p, clusters, stream);
  } else {
    launch_mma<T, 4, 4, 1, 1, 4, 2>(p, clusters, stream);
  }
}

}  // namespace

void router_predict_launch(GemvParams p, FloatDtype dtype, bool vectorised, int device) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  const bool clusters = cuda::device_has_clusters(device);
  p.k_per_cta = p.H;
  p.cluster = 1;
  if (vectorised && dtype == FloatDtype::kBFloat16) {
    launch_tiles<__nv_bfloat16>(p, clusters, stream);
  } else if (vectorised && dtype == FloatDtype::kHalf) {
    launch_tiles<__half>(p, clusters, stream);
  } else {
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
}

}  // namespace base_moe
