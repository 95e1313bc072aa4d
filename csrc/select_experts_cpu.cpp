// CPU twin of select_experts: router_predict, then route_select on its outputs.
#include <ATen/ATen.h>

#include "base_moe/ops.h"

namespace base_moe {

SelectExpertsResult select_experts_cpu(const Tensor& hidden, const Tensor& router_weight, const OptTensor& router_bias,
                                       const OptTensor& predictor_weight, const OptTensor& predictor_bias,
                                       const OptTensor& correction_bias, int64_t num_groups, int64_t top_k,
                                       int64_t scoring, bool renormalize, int64_t n_group, int64_t topk_group,
                                       double scaling, int64_t cost, int64_t budget, int64_t fill,
                                       const OptTensor& voting, bool round_logits) {
  check_select_experts(predictor_weight, cost);
  auto [logits, log_norms] = router_predict_cpu(hidden, router_weight, router_bias, predictor_weight, predictor_bias,
                                                round_logits);
  const OptTensor cost_log_norms = cost == static_cast<int64_t>(Cost::kBase) ? OptTensor(log_norms) : std::nullopt;
  auto [ids, weights, kept, counts, D] = route_select_cpu(logits, cost_log_norms, correction_bias, num_groups, top_k,
                                                          scoring, renormalize, n_group, topk_group, scaling, cost,
                                                          budget, fill, voting);
  return {logits, log_norms, ids, weights, kept, counts, D};
}

}  // namespace base_moe
