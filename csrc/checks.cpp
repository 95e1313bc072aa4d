#include "base_moe/checks.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

namespace base_moe {
namespace {

bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

void check_same_device(const Tensor& t, const Tensor& primary, const char* name, const char* primary_name) {
  BASE_MOE_CHECK(t.device() == primary.device(), name, " must be on the same device as ", primary_name, " (",
              primary.device(), "), got ", t.device());
}

void check_fp32_vector(const OptTensor& t, int64_t size, const Tensor& primary, const char* name) {
  if (!t.has_value()) return;
  BASE_MOE_CHECK(t->dim() == 1 && t->size(0) == size, name, " must have shape [", size, "], got ", t->sizes());
  BASE_MOE_CHECK(t->scalar_type() == at::kFloat, name, " must be float32, got ", t->scalar_type());
  BASE_MOE_CHECK(t->is_contiguous(), name, " must be contiguous");
  check_same_device(*t, primary, name, "the first argument");
}

// hidden states [tokens, hidden_size]: the first operand of router_predict, select_experts, the norms and experts
void check_hidden(const Tensor& hidden) {
  BASE_MOE_CHECK(hidden.dim() == 2, "hidden must be 2-D [tokens, hidden_size], got shape ", hidden.sizes());
  BASE_MOE_CHECK(is_float_dtype(hidden.scalar_type()), "hidden must be float32, float16 or bfloat16, got ",
              hidden.scalar_type());
  BASE_MOE_CHECK(hidden.is_contiguous(), "hidden must be contiguous");
}

// An operand read together with hidden (a weight, the residual): hidden's dtype, contiguous, on hidden's device
void check_like_hidden(const Tensor& t, const Tensor& hidden, const char* name) {
  BASE_MOE_CHECK(t.scalar_type() == hidden.scalar_type(), name, " must have hidden's dtype (", hidden.scalar_type(),
              "), got ", t.scalar_type());
  BASE_MOE_CHECK(t.is_contiguous(), name, " must be contiguous");
  check_same_device(t, hidden, name, "hidden");
}

void check_logits(const Tensor& logits) {
  BASE_MOE_CHECK(logits.dim() == 2, "logits must be 2-D [tokens, experts], got shape ", logits.sizes());
  BASE_MOE_CHECK(logits.scalar_type() == at::kFloat, "logits must be float32, got ", logits.scalar_type());
  BASE_MOE_CHECK(logits.is_contiguous(), "logits must be contiguous");
  BASE_MOE_CHECK(logits.size(1) >= 1 && logits.size(1) <= kMaxExperts, "logits must have 1 to ", kMaxExperts,
              " experts, got ", logits.size(1));
}

void check_num_groups(int64_t num_groups, int64_t tokens) {
  // with tokens, num_groups divides them; without, any count would pass that test (the kernels take an int)
  BASE_MOE_CHECK(num_groups >= 1 && num_groups < (int64_t{1} << 30), "num_groups must be in [1, 2^30), got ",
              num_groups);
  BASE_MOE_CHECK(tokens % num_groups == 0, "the number of tokens (", tokens, ") must be a multiple of num_groups (",
              num_groups, ")");
}

}  // namespace

void check_router_predict(const Tensor& hidden, const Tensor& router_weight, const OptTensor& router_bias,
                          const OptTensor& predictor_weight, const OptTensor& predictor_bias) {
  check_hidden(hidden);
  const int64_t H = hidden.size(1);
  BASE_MOE_CHECK(router_weight.dim() == 2 && router_weight.size(1) == H,
              "router_weight must have shape [experts, ", H, "] to match hidden, got ", router_weight.sizes());
  check_like_hidden(router_weight, hidden, "router_weight");
  const int64_t E = router_weight.size(0);
  BASE_MOE_CHECK(E >= 1 && E <= kMaxExperts, "router_weight must have 1 to ", kMaxExperts, " experts, got ", E);
  check_fp32_vector(router_bias, E, hidden, "router_bias");
  BASE_MOE_CHECK(predictor_weight.has_value() == predictor_bias.has_value(),
              "predictor_weight and predictor_bias must be given together");
  if (!predictor_weight.has_value()) return;
  BASE_MOE_CHECK(predictor_weight->sizes() == router_weight.sizes(), "predictor_weight must have router_weight's shape ",
              router_weight.sizes(), ", got ", predictor_weight->sizes());
  check_like_hidden(*predictor_weight, hidden, "predictor_weight");
  check_fp32_vector(predictor_bias, E, hidden, "predictor_bias");
}

RoutingParams check_routing(const Tensor& logits, const OptTensor& correction_bias, int64_t top_k,
                            int64_t scoring, bool renormalize, int64_t n_group, int64_t topk_group,
                            double scaling) {
  check_logits(logits);
  const int64_t E = logits.size(1);
  BASE_MOE_CHECK(top_k >= 1 && top_k <= kMaxTopK, "top_k must be in [1, ", kMaxTopK, "], got ", top_k);
  BASE_MOE_CHECK(top_k <= E, "top_k (", top_k, ") must not exceed the number of experts (", E, ")");
  BASE_MOE_CHECK(scoring >= 0 && scoring <= 2, "scoring must be 0 (softmax), 1 (softmax after top-k) or 2 (sigmoid), got ",
              scoring);
  const auto kind = static_cast<Scoring>(scoring);
  BASE_MOE_CHECK(!correction_bias.has_value() || kind == Scoring::kSigmoid || kind == Scoring::kSoftmax,
              "correction_bias is only used with sigmoid (scoring=2) or softmax (scoring=0) scoring");
  check_fp32_vector(correction_bias, E, logits, "correction_bias");
  BASE_MOE_CHECK(n_group >= 1, "n_group must be >= 1, got ", n_group);
  if (n_group > 1) {
    BASE_MOE_CHECK(E % n_group == 0, "the number of experts (", E, ") must be a multiple of n_group (", n_group, ")");
    BASE_MOE_CHECK(E / n_group >= 2, "each expert group needs at least 2 experts, got ", E / n_group);
    BASE_MOE_CHECK(topk_group >= 1 && topk_group <= n_group, "topk_group must be in [1, n_group=", n_group, "], got ",
                topk_group);
    BASE_MOE_CHECK(topk_group * (E / n_group) >= top_k, "topk_group (", topk_group, ") groups of ", E / n_group,
                " experts cannot hold top_k=", top_k, " experts");
  }
  // the weights (at most scaling) are fp32 and BASE's slot cost squares them: in this range a weight's square is
  // finite, so a cost is never inf x 0 = NaN, and the scaling itself is a normal fp32 number
  BASE_MOE_CHECK(scaling >= 0x1p-63 && scaling <= 0x1p63,
                 "scaling must be in [2^-63, 2^63] (its square a finite, normal fp32 number), got ", scaling);
  return RoutingParams{E, top_k, kind, renormalize, n_group, n_group > 1 ? topk_group : 1, scaling};
}

void check_route_cost(const Tensor& logits, const OptTensor& log_norms, int64_t num_groups, int64_t cost) {
  check_num_groups(num_groups, logits.size(0));
  BASE_MOE_CHECK(cost >= 0 && cost <= 4,
              "cost must be 0 (base), 1 (router_sum), 2 (router_sq), 3 (frequency) or 4 (top1_union), got ", cost);
  if (static_cast<Cost>(cost) != Cost::kBase) return;
  // router_predict without a predictor gives [tokens, 0] log-norms
  BASE_MOE_CHECK(log_norms.has_value() && !(log_norms->dim() == 2 && log_norms->size(1) == 0),
              "cost=0 (base) needs log_norms [tokens, experts]: pass a predictor to router_predict");
  BASE_MOE_CHECK(log_norms->dim() == 2 && log_norms->sizes() == logits.sizes(), "log_norms must have logits' shape ",
              logits.sizes(), ", got ", log_norms->sizes());
  BASE_MOE_CHECK(log_norms->scalar_type() == at::kFloat, "log_norms must be float32, got ", log_norms->scalar_type());
  // (with one expert, any column stride: torch counts a [T, 1] tensor as contiguous whatever it is)
  BASE_MOE_CHECK(log_norms->size(1) == 1 || log_norms->stride(1) == 1,
                 "log_norms must be contiguous along experts (rows may be broadcast)");
  check_same_device(*log_norms, logits, "log_norms", "logits");
}

void check_select_fill(const Tensor& logits, const Tensor& batch_cost, int64_t budget, int64_t fill) {
  BASE_MOE_CHECK(batch_cost.dim() == 2 && batch_cost.size(1) == logits.size(1),
              "batch_cost must have shape [groups, ", logits.size(1), "], got ", batch_cost.sizes());
  BASE_MOE_CHECK(batch_cost.scalar_type() == at::kFloat, "batch_cost must be float32, got ", batch_cost.scalar_type());
  BASE_MOE_CHECK(batch_cost.is_contiguous(), "batch_cost must be contiguous");
  check_same_device(batch_cost, logits, "batch_cost", "logits");
  const int64_t groups = batch_cost.size(0);
  BASE_MOE_CHECK(groups >= 1 && groups < (int64_t{1} << 30), "batch_cost must have 1 to 2^30 - 1 rows (groups), got ",
                 groups);
  BASE_MOE_CHECK(logits.size(0) % groups == 0, "the number of tokens (", logits.size(0),
                 ") must be a multiple of batch_cost's rows (groups, ", groups, ")");
  check_budget_fill(budget, fill);
}

void check_voting(const OptTensor& voting, const Tensor& logits) {
  if (!voting.has_value()) return;
  BASE_MOE_CHECK(voting->dim() == 1 && voting->size(0) == logits.size(0), "voting must have shape [",
                 logits.size(0), "] (one flag per token), got ", voting->sizes());
  BASE_MOE_CHECK(voting->scalar_type() == at::kBool, "voting must be bool, got ", voting->scalar_type());
  BASE_MOE_CHECK(voting->is_contiguous(), "voting must be contiguous");
  check_same_device(*voting, logits, "voting", "logits");
}

void check_budget_fill(int64_t budget, int64_t fill) {
  BASE_MOE_CHECK(budget >= 1, "budget must be >= 1, got ", budget);
  BASE_MOE_CHECK(fill >= 0 && fill <= 2, "fill must be 0 (backfill), 1 (drop) or 2 (drop_renorm), got ", fill);
}

void check_select_experts(const OptTensor& predictor_weight, int64_t cost) {
  BASE_MOE_CHECK(cost != static_cast<int64_t>(Cost::kBase) || predictor_weight.has_value(),
              "cost=0 (base) needs the predicted log-norms: pass predictor_weight and predictor_bias");
}

FloatDtype float_dtype(const Tensor& t) {
  const auto dtype = t.scalar_type();
  return dtype == at::kFloat ? FloatDtype::kFloat : dtype == at::kHalf ? FloatDtype::kHalf : FloatDtype::kBFloat16;
}

void check_on_cpu(const Tensor& t, const char* name) {
  BASE_MOE_CHECK(t.device().is_cpu(), "the CPU op needs ", name, " on the CPU, got ", t.device());
}

void check_rms_norm(const Tensor& hidden, const Tensor& weight, double eps) {
  check_hidden(hidden);
  const int64_t H = hidden.size(1);
  BASE_MOE_CHECK(weight.dim() == 1 && weight.size(0) == H, "weight must have shape [", H, "] to match hidden, got ",
              weight.sizes());
  check_like_hidden(weight, hidden, "weight");
  // the kernels add eps as an fp32 number: one past fp32's range would be inf and every output 0
  BASE_MOE_CHECK(eps >= 0.0 && eps <= std::numeric_limits<float>::max(), "eps must be a finite fp32 number >= 0, got ",
                 eps);
}

void check_add_rms_norm(const Tensor& hidden, const Tensor& residual, const Tensor& weight, double eps) {
  check_rms_norm(hidden, weight, eps);
  BASE_MOE_CHECK(residual.sizes() == hidden.sizes(), "residual must have hidden's shape ", hidden.sizes(), ", got ",
              residual.sizes());
  check_like_hidden(residual, hidden, "residual");
}

void check_experts(const Tensor& hidden, const Tensor& expert_ids, const Tensor& expert_weights,
                   const Tensor& gate_up_proj, const Tensor& down_proj, const std::optional<int64_t>& max_active_experts) {
  check_hidden(hidden);
  const int64_t T = hidden.size(0), H = hidden.size(1);
  BASE_MOE_CHECK(expert_ids.dim() == 2 && expert_ids.size(0) == T, "expert_ids must have shape [", T,
              ", top_k], got ", expert_ids.sizes());
  BASE_MOE_CHECK(expert_ids.scalar_type() == at::kInt, "expert_ids must be int32, got ", expert_ids.scalar_type());
  BASE_MOE_CHECK(expert_ids.size(1) >= 1 && expert_ids.size(1) <= kMaxTopK, "expert_ids must have 1 to ", kMaxTopK,
              " slots per token, got ", expert_ids.size(1));
  BASE_MOE_CHECK(expert_weights.sizes() == expert_ids.sizes(), "expert_weights must have expert_ids' shape ",
              expert_ids.sizes(), ", got ", expert_weights.sizes());
  BASE_MOE_CHECK(expert_weights.scalar_type() == at::kFloat, "expert_weights must be float32, got ",
              expert_weights.scalar_type());
  BASE_MOE_CHECK(expert_ids.is_contiguous() && expert_weights.is_contiguous(),
              "expert_ids and expert_weights must be contiguous");
  BASE_MOE_CHECK(gate_up_proj.dim() == 3 && gate_up_proj.size(2) == H && gate_up_proj.size(1) % 2 == 0,
              "gate_up_proj must have shape [experts, 2 * intermediate, ", H, "], got ", gate_up_proj.sizes());
  const int64_t E = gate_up_proj.size(0), I = gate_up_proj.size(1) / 2;
  BASE_MOE_CHECK(down_proj.dim() == 3 && down_proj.size(0) == E && down_proj.size(1) == H && down_proj.size(2) == I,
              "down_proj must have shape [", E, ", ", H, ", ", I, "] to match gate_up_proj, got ", down_proj.sizes());
  BASE_MOE_CHECK(gate_up_proj.scalar_type() == hidden.scalar_type() && down_proj.scalar_type() == hidden.scalar_type(),
              "gate_up_proj and down_proj must have hidden's dtype (", hidden.scalar_type(), "), got ",
              gate_up_proj.scalar_type(), " and ", down_proj.scalar_type());
  BASE_MOE_CHECK(gate_up_proj.is_contiguous() && down_proj.is_contiguous(), "gate_up_proj and down_proj must be contiguous");
  BASE_MOE_CHECK(!max_active_experts.has_value() || *max_active_experts >= 1,
              "max_active_experts must be at least 1 (or None), got ", max_active_experts.value_or(0));
  check_same_device(expert_ids, hidden, "expert_ids", "hidden");
  check_same_device(expert_weights, hidden, "expert_weights", "hidden");
  check_same_device(gate_up_proj, hidden, "gate_up_proj", "hidden");
  check_same_device(down_proj, hidden, "down_proj", "hidden");
}

}  // namespace base_moe
