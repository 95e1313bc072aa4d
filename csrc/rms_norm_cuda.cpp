// CUDA registration of rms_norm and add_rms_norm: the argument checks (host-compiled, so errors surface as Python
// exceptions) and the call into csrc/rms_norm.cu. Empty in CPU-only builds.
#ifdef BASE_MOE_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "base_moe/checks.h"
#include "base_moe/norm_kernels.h"

namespace base_moe {
namespace {

// out = the norm of residual + hidden (or of hidden without residual); sum = residual + hidden, if given
void launch_norm(const Tensor& hidden, const Tensor* residual, const Tensor& weight, double eps, Tensor& out,
                 Tensor* sum) {
  const int64_t T = hidden.size(0), H = hidden.size(1);
  // rows are the grid (below 2^31); a row's chunks an int loop stepping by the block size
  BASE_MOE_CHECK(T < (int64_t{1} << 31) && H < (int64_t{1} << 30), "rms_norm / add_rms_norm on CUDA: hidden shape ",
              hidden.sizes(), " is too large (tokens must be below 2^31, hidden_size below 2^30)");
  if (T == 0 || H == 0) return;
  const RmsNormParams p{hidden.data_ptr(), residual ? residual->data_ptr() : nullptr, weight.data_ptr(),
                        out.data_ptr(),    sum ? sum->data_ptr() : nullptr,           T,
                        static_cast<int>(H), static_cast<float>(eps)};
  rms_norm_launch(p, float_dtype(hidden), hidden.get_device());
}

Tensor rms_norm_cuda(const Tensor& hidden, const Tensor& weight, double eps) {
  check_rms_norm(hidden, weight, eps);
  const c10::cuda::CUDAGuard guard(hidden.device());
  Tensor out = at::empty_like(hidden);
  launch_norm(hidden, nullptr, weight, eps, out, nullptr);
  return out;
}

std::tuple<Tensor, Tensor> add_rms_norm_cuda(const Tensor& hidden, const Tensor& residual, const Tensor& weight,
                                             double eps) {
  check_add_rms_norm(hidden, residual, weight, eps);
  const c10::cuda::CUDAGuard guard(hidden.device());
  Tensor out = at::empty_like(hidden), sum = at::empty_like(hidden);
  launch_norm(hidden, &residual, weight, eps, out, &sum);
  return {out, sum};
}

}  // namespace

TORCH_LIBRARY_IMPL(base_moe, CUDA, m) {
  m.impl("rms_norm", &rms_norm_cuda);
  m.impl("add_rms_norm", &add_rms_norm_cuda);
}

}  // namespace base_moe
#endif  // BASE_MOE_WITH_CUDA
