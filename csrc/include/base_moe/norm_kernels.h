// Host interface of the RMSNorm kernel (csrc/rms_norm.cu), called by csrc/rms_norm_cuda.cpp.
#pragma once

#include <cstdint>

#include "base_moe/float_dtype.h"

namespace base_moe {

struct RmsNormParams {
  const void* hidden;    // [T, H], contiguous
  const void* residual;  // [T, H] like hidden (add_rms_norm: the row normalised is residual + hidden), or null
  const void* weight;    // [H], hidden's dtype
  void* out;             // [T, H]
  void* sum;             // [T, H]: residual + hidden (with residual), else null
  int64_t T;           // rows, 1 <= T < 2^31
  int H;               // 1 <= H < 2^30
  float eps;
};

void rms_norm_launch(const RmsNormParams& p, FloatDtype dtype, int device);

}  // namespace base_moe
