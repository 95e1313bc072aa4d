// CPU twins of rms_norm and add_rms_norm: Hugging Face's Llama-style RMSNorm (and the decoder layer's residual add
// before it) through ATen, operation for operation.
#include <ATen/ATen.h>

#include "base_moe/ops.h"

namespace base_moe {

namespace {

Tensor llama_rms_norm(const Tensor& hidden, const Tensor& weight, double eps) {
  at::AutoDispatchBelowAutograd no_autograd;  // the ops have no backward
  const Tensor x = hidden.to(at::kFloat);
  const Tensor normed = x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(hidden.scalar_type());
}

}  // namespace

Tensor rms_norm_cpu(const Tensor& hidden, const Tensor& weight, double eps) {
  check_rms_norm(hidden, weight, eps);
  return llama_rms_norm(hidden, weight, eps);
}

std::tuple<Tensor, Tensor> add_rms_norm_cpu(const Tensor& hidden, const Tensor& residual, const Tensor& weight,
                                            double eps) {
  check_add_rms_norm(hidden, residual, weight, eps);
  at::AutoDispatchBelowAutograd no_autograd;
  Tensor sum = residual + hidden;  // as the decoder layer writes it
  return {llama_rms_norm(sum, weight, eps), sum};
}

}  // namespace base_moe
