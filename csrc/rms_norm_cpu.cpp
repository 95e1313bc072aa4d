// CPU twin of rms_norm: Hugging Face's Llama-style RMSNorm through ATen, operation for operation.
#include <ATen/ATen.h>

#include "base_moe/ops.h"

namespace base_moe {

Tensor rms_norm_cpu(const Tensor& hidden, const Tensor& weight, double eps) {
  check_rms_norm(hidden, weight, eps);
  at::AutoDispatchBelowAutograd no_autograd;  // the op has no backward
  const Tensor x = hidden.to(at::kFloat);
  const Tensor normed = x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps);
  return weight * normed.to(hidden.scalar_type());
}

}  // namespace base_moe
