// The decoder layer's RMSNorm before the MoE block (ops rms_norm and add_rms_norm), on CUDA: one CTA per token row,
// fp32 inside, as Hugging Face writes it for the Llama-style families: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype).
// Its point is the launch that follows: the kernel lets its dependents start at once (programmatic dependent launch),
// so a selection kernel launched with PDL right after it (router_predict) stages its weights while the norm runs
// instead of after it; they read the norm's output only after their griddepcontrol.wait, which waits for this whole
// grid and its writes. torch's own norm kernel gives no such signal, and behind it the one-launch selection kernel of
// that time took ~4.8 us more than behind another selection (device_runs/session24.txt).
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "base_moe/cuda_utils.cuh"
#include "base_moe/launch.cuh"
#include "base_moe/norm_kernels.h"

namespace base_moe {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Sum over the CTA in a fixed order (each warp's butterfly, then the warps' sums in warp order): every thread gets
// the same bits, and a row gets the same bits on every call.
__device__ __forceinline__ float block_sum(float v, float* warp_sums) {
  v = cuda::warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += warp_sums[w];
  return total;
}

// A row is taken in chunks of 16 bytes (H = 2048 in bf16: one chunk per thread), thread j summing chunks j,
// j + kThreads, ... in element order. WIDE: one 16-byte access per chunk (rows 16-byte aligned, H a multiple of the
// chunk); else element by element, zeros past the row's end. Both add the same squares in the same order, so a row
// gets the same bits whichever path its alignment takes.
template <typename T>
constexpr int kChunk = 16 / static_cast<int>(sizeof(T));

template <typename T>
struct alignas(16) Chunk {
  T v[kChunk<T>];
};

template <typename T, bool WIDE>
__device__ __forceinline__ Chunk<T> load_chunk(const T* row, int c, int H) {
  if constexpr (WIDE) {
    return reinterpret_cast<const Chunk<T>*>(row)[c];
  } else {
    Chunk<T> out;
#pragma unroll
    for (int i = 0; i < kChunk<T>; ++i) {
      const int j = c * kChunk<T> + i;
      out.v[i] = j < H ? row[j] : cuda::from_float<T>(0.0f);
    }
    return out;
  }
}

template <typename T, bool WIDE>
__device__ __forceinline__ void store_chunk(T* row, int c, int H, const Chunk<T>& chunk) {
  if constexpr (WIDE) {
    reinterpret_cast<Chunk<T>*>(row)[c] = chunk;
  } else {
#pragma unroll
    for (int i = 0; i < kChunk<T>; ++i) {
      const int j = c * kChunk<T> + i;
      if (j < H) row[j] = chunk.v[i];
    }
  }
}

// ADD (op add_rms_norm): the row normalised is residual + hidden, rounded to T as torch's addition rounds it, and
// that sum is written to `sum` as well (each thread reads back only the chunks it wrote, so `sum` alone is not
// __restrict__).
template <typename T, bool WIDE, bool ADD>
__global__ void __launch_bounds__(kThreads)
    rms_norm_kernel(const T* __restrict__ hidden, const T* __restrict__ residual, const T* __restrict__ weight,
                    T* __restrict__ out, T* sum, int H, float inv_h, float eps) {
  // The kernel after this one may launch now: a PDL launch reads this kernel's output only after its
  // griddepcontrol.wait, which returns once this whole grid has finished and its writes are visible.
  cuda::pdl_launch_dependents();
  __shared__ float warp_sums[kWarps];
  const int64_t row = blockIdx.x;
  const int chunks = (H + kChunk<T> - 1) / kChunk<T>;
  float squares = 0.0f;
  for (int c = threadIdx.x; c < chunks; c += kThreads) {
    Chunk<T> xc = load_chunk<T, WIDE>(hidden + row * H, c, H);
    if constexpr (ADD) {
      const Chunk<T> rc = load_chunk<T, WIDE>(residual + row * H, c, H);
#pragma unroll
      for (int i = 0; i < kChunk<T>; ++i) {
        xc.v[i] = cuda::from_float<T>(cuda::to_float(rc.v[i]) + cuda::to_float(xc.v[i]));
      }
      store_chunk<T, WIDE>(sum + row * H, c, H, xc);
    }
#pragma unroll
    for (int i = 0; i < kChunk<T>; ++i) {
      const float v = cuda::to_float(xc.v[i]);
      squares += v * v;
    }
  }
  // rsqrtf, as torch.rsqrt on CUDA; the mean and the eps added with a rounding each, as torch does (not one FMA)
  const float scale = rsqrtf(__fadd_rn(__fmul_rn(block_sum(squares, warp_sums), inv_h), eps));
  T* y = out + row * H;
  for (int c = threadIdx.x; c < chunks; c += kThreads) {
    // the row normalised: the sum this thread wrote above, or the hidden states
    const Chunk<T> xc = ADD ? load_chunk<T, WIDE>(sum + row * H, c, H) : load_chunk<T, WIDE>(hidden + row * H, c, H);
    const Chunk<T> wc = load_chunk<T, WIDE>(weight, c, H);
    Chunk<T> yc;
#pragma unroll
    for (int i = 0; i < kChunk<T>; ++i) {
      const T normed = cuda::from_float<T>(cuda::to_float(xc.v[i]) * scale);  // .to(input dtype)
      yc.v[i] = cuda::from_float<T>(cuda::to_float(wc.v[i]) * cuda::to_float(normed));
    }
    store_chunk<T, WIDE>(y, c, H, yc);
  }
}

template <typename T, bool ADD>
void launch(const RmsNormParams& p, cudaStream_t stream) {
  const bool wide = p.H % kChunk<T> == 0 && aligned16(p.hidden) && aligned16(p.residual) && aligned16(p.weight) &&
                    aligned16(p.out) && aligned16(p.sum);
  // launched without PDL itself: the kernel before it (attention's output projection, a residual add) is torch's
  cuda::launch({dim3(static_cast<unsigned>(p.T)), dim3(kThreads), 0, stream},
               wide ? rms_norm_kernel<T, true, ADD> : rms_norm_kernel<T, false, ADD>, static_cast<const T*>(p.hidden),
               static_cast<const T*>(p.residual), static_cast<const T*>(p.weight), static_cast<T*>(p.out),
               static_cast<T*>(p.sum), p.H, 1.0f / static_cast<float>(p.H), p.eps);
}

template <typename T>
void launch(const RmsNormParams& p, cudaStream_t stream) {
  if (p.residual != nullptr) {
    launch<T, true>(p, stream);
  } else {
    launch<T, false>(p, stream);
  }
}

}  // namespace

void rms_norm_launch(const RmsNormParams& p, FloatDtype dtype, int device) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  if (dtype == FloatDtype::kBFloat16) {
    launch<__nv_bfloat16>(p, stream);
  } else if (dtype == FloatDtype::kHalf) {
    launch<__half>(p, stream);
  } else {
    launch<float>(p, stream);
  }
}

}  // namespace base_moe
