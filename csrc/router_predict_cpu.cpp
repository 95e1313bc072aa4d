// CPU twin of the fused router + predictor GEMV: fp32 matrix products through ATen (the logits rounded to hidden's
// dtype where round_logits asks).
#include <ATen/ATen.h>

#include "base_moe/ops.h"

namespace base_moe {

std::tuple<Tensor, Tensor> router_predict_cpu(const Tensor& hidden, const Tensor& router_weight,
                                              const OptTensor& router_bias, const OptTensor& predictor_weight,
                                              const OptTensor& predictor_bias, bool round_logits) {
  check_router_predict(hidden, router_weight, router_bias, predictor_weight, predictor_bias);
  // The op has no backward: the ATen calls below must not record an autograd graph (they would
  // save index tensors that live only during this call).
  at::AutoDispatchBelowAutograd no_autograd;
  const Tensor x = hidden.to(at::kFloat);
  Tensor logits = at::matmul(x, router_weight.to(at::kFloat).t());
  if (router_bias.has_value()) logits.add_(*router_bias);
  if (round_logits) logits = logits.to(hidden.scalar_type()).to(at::kFloat);
  if (!predictor_weight.has_value()) return {logits.contiguous(), x.new_empty({x.size(0), 0})};
  Tensor log_norms = at::matmul(x, predictor_weight->to(at::kFloat).t()).add_(*predictor_bias);
  return {logits.contiguous(), log_norms.contiguous()};
}

}  // namespace base_moe
