// CUDA registration of the selection ops (router_predict, route_cost, select_fill, route_select, select_experts):
// argument checks, outputs and the calls into the kernels of csrc/router_predict.cu and csrc/route_select.cu.
// Host-compiled, so argument errors surface as Python exceptions (a throw through nvcc-compiled host frames crashed the
// process). Empty in CPU-only builds.
#ifdef BASE_MOE_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "base_moe/checks.h"
#include "base_moe/ops.h"
#include "base_moe/routing.h"
#include "base_moe/select_kernels.h"

namespace base_moe {
namespace {

// The GEMV's operands and outputs (logits [T, E], log_norms [T, E] or [T, 0]) for the kernels.
GemvParams make_gemv_params(const Tensor& hidden, const Tensor& router_weight, const OptTensor& router_bias,
                            const OptTensor& predictor_weight, const OptTensor& predictor_bias, const Tensor& logits,
                            const Tensor& log_norms, bool round_logits) {
  const bool predict = predictor_weight.has_value();
  GemvParams p{};
  p.hidden = hidden.data_ptr();
  p.router_weight = router_weight.data_ptr();
  p.predictor_weight = predict ? predictor_weight->data_ptr() : nullptr;
  p.router_bias = optional_data<float>(router_bias);
  p.predictor_bias = predict ? predictor_bias->data_ptr<float>() : nullptr;
  p.logits = logits.data_ptr<float>();
  p.log_norms = log_norms.data_ptr<float>();
  p.T = static_cast<int>(hidden.size(0));
  p.H = static_cast<int>(hidden.size(1));
  p.E = static_cast<int>(router_weight.size(0));
  p.R = static_cast<int>(predict ? 2 * p.E : p.E);
  p.round_logits = round_logits;
  return p;
}

// router_predict's checks, and its outputs: logits [T, E] and log-norms [T, E] ([T, 0] without a predictor), fp32.
std::tuple<Tensor, Tensor> checked_gemv_outputs(const Tensor& hidden, const Tensor& router_weight,
                                                const OptTensor& router_bias, const OptTensor& predictor_weight,
                                                const OptTensor& predictor_bias) {
  check_router_predict(hidden, router_weight, router_bias, predictor_weight, predictor_bias);
  const int64_t T = hidden.size(0), H = hidden.size(1), E = router_weight.size(0);
  // T: the simple kernel's grid holds 16 tokens per block row, at most 65535 rows (gridDim.y)
  BASE_MOE_CHECK(T <= int64_t{65535} * 16 && H < (int64_t{1} << 24), "router_predict on CUDA: hidden shape ",
              hidden.sizes(), " is too large");
  Tensor logits = at::empty({T, E}, hidden.options().dtype(at::kFloat));
  Tensor log_norms = at::empty({T, predictor_weight.has_value() ? E : 0}, hidden.options().dtype(at::kFloat));
  return {logits, log_norms};
}

// The GEMV into checked_gemv_outputs' tensors (the caller holds a device guard).
void launch_gemv(const Tensor& hidden, const Tensor& router_weight, const OptTensor& router_bias,
                 const OptTensor& predictor_weight, const OptTensor& predictor_bias, const Tensor& logits,
                 const Tensor& log_norms, bool round_logits) {
  if (hidden.size(0) == 0) return;
  const GemvParams p = make_gemv_params(hidden, router_weight, router_bias, predictor_weight, predictor_bias,
                                      logits, log_norms, round_logits);
  const bool vectorised = hidden.size(1) % 8 == 0 && aligned16(p.hidden) && aligned16(p.router_weight) &&
                          aligned16(p.predictor_weight);
  router_predict_launch(p, float_dtype(hidden), vectorised, hidden.get_device());
}

std::tuple<Tensor, Tensor> router_predict_cuda(const Tensor& hidden, const Tensor& router_weight,
                                               const OptTensor& router_bias, const OptTensor& predictor_weight,
                                               const OptTensor& predictor_bias, bool round_logits) {
  auto [logits, log_norms] = checked_gemv_outputs(hidden, router_weight, router_bias, predictor_weight, predictor_bias);
  const c10::cuda::CUDAGuard guard(hidden.device());  // after the checks: hidden may be on the CPU (refused there)
  launch_gemv(hidden, router_weight, router_bias, predictor_weight, predictor_bias, logits, log_norms, round_logits);
  return {logits, log_norms};
}

SelectParams make_params(const Tensor& logits, const OptTensor& correction_bias, const OptTensor& voting,
                         const RoutingParams& r, int64_t num_groups) {
  SelectParams p{};
  p.logits = logits.data_ptr<float>();
  p.correction_bias = optional_data<float>(correction_bias);
  p.voting = optional_data<bool>(voting);
  p.B = static_cast<int>(logits.size(0) / num_groups);
  p.E = static_cast<int>(r.num_experts);
  p.k = static_cast<int>(r.top_k);
  p.scoring = static_cast<int>(r.scoring);
  p.renormalize = r.renormalize;
  p.n_group = static_cast<int>(r.n_group);
  p.topk_group = static_cast<int>(r.topk_group);
  p.group_size = static_cast<int>(r.num_experts / r.n_group);
  p.scaling = static_cast<float>(r.scaling);
  p.cost = Cost::kRouterSum;
  p.fill = static_cast<int>(Fill::kBackfill);
  p.top1_scale = top1_scale(r);
  p.top1_offset = top1_offset(p.B, r.top_k, p.top1_scale);
  return p;
}

void set_cost(SelectParams& p, const OptTensor& log_norms, int64_t cost) {
  p.compute_cost = true;
  p.cost = static_cast<Cost>(cost);
  if (p.cost == Cost::kBase) {
    p.log_norms = log_norms->data_ptr<float>();
    p.ln_stride = log_norms->size(0) > 1 ? log_norms->stride(0) : 0;
  }
}

void set_selection(SelectParams& p, int64_t fill, const Tensor& kept, const Tensor& counts) {
  p.select = true;
  p.W = static_cast<int>(kept.size(1));
  p.fill = static_cast<int>(fill);
  p.kept = kept.data_ptr<int32_t>();
  p.counts = counts.data_ptr<int32_t>();
}

// The routing outputs every selection entry point writes: ids, weights [T, k]; the kernel parameters point at them.
std::tuple<Tensor, Tensor> routing_outputs(SelectParams& p, const Tensor& logits, int64_t top_k) {
  const int64_t T = logits.size(0);
  Tensor ids = at::empty({T, top_k}, logits.options().dtype(at::kInt));
  Tensor weights = at::empty({T, top_k}, logits.options());
  p.ids = ids.data_ptr<int32_t>();
  p.weights = weights.data_ptr<float>();
  return {ids, weights};
}

// The batch cost [G, E] that route_cost and route_select write.
Tensor batch_cost_output(SelectParams& p, const Tensor& logits, int64_t num_groups) {
  Tensor D = at::empty({num_groups, logits.size(1)}, logits.options());
  p.batch_cost_out = D.data_ptr<float>();
  return D;
}

// The selection outputs of select_fill and route_select: kept [G, min(budget, E)], counts [G, E].
std::tuple<Tensor, Tensor> kept_outputs(SelectParams& p, const Tensor& logits, int64_t num_groups, int64_t budget,
                                        int64_t fill) {
  const int64_t E = logits.size(1);
  Tensor kept = at::empty({num_groups, std::min(budget, E)}, logits.options().dtype(at::kInt));
  Tensor counts = at::empty({num_groups, E}, logits.options().dtype(at::kInt));
  set_selection(p, fill, kept, counts);
  return {kept, counts};
}

// route_select's outputs: ids, weights, kept, counts, batch cost.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> selection_outputs(SelectParams& p, const Tensor& logits,
                                                                     int64_t top_k, int64_t num_groups, int64_t budget,
                                                                     int64_t fill) {
  auto [ids, weights] = routing_outputs(p, logits, top_k);
  auto [kept, counts] = kept_outputs(p, logits, num_groups, budget, fill);
  return {ids, weights, kept, counts, batch_cost_output(p, logits, num_groups)};
}

void check_token_count(const Tensor& logits) {
  BASE_MOE_CHECK(logits.size(0) < (int64_t{1} << 30), "logits has too many tokens for the CUDA kernels: ",
              logits.size(0));
}

std::tuple<Tensor, Tensor, Tensor> route_cost_cuda(const Tensor& logits, const OptTensor& log_norms,
                                                   const OptTensor& correction_bias, int64_t num_groups,
                                                   int64_t top_k, int64_t scoring, bool renormalize, int64_t n_group,
                                                   int64_t topk_group, double scaling, int64_t cost,
                                                   const OptTensor& voting) {
  const RoutingParams r =
      check_routing(logits, correction_bias, top_k, scoring, renormalize, n_group, topk_group, scaling);
  check_route_cost(logits, log_norms, num_groups, cost);
  check_voting(voting, logits);
  check_token_count(logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  SelectParams p = make_params(logits, correction_bias, voting, r, num_groups);
  set_cost(p, log_norms, cost);
  auto [ids, weights] = routing_outputs(p, logits, top_k);
  Tensor D = batch_cost_output(p, logits, num_groups);
  route_select_launch(p, static_cast<int>(num_groups), logits.get_device());
  return {ids, weights, D};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> select_fill_cuda(const Tensor& logits, const Tensor& batch_cost,
                                                            const OptTensor& correction_bias, int64_t top_k,
                                                            int64_t scoring, bool renormalize, int64_t n_group,
                                                            int64_t topk_group, double scaling, int64_t budget,
                                                            int64_t fill, const OptTensor& voting) {
  const RoutingParams r =
      check_routing(logits, correction_bias, top_k, scoring, renormalize, n_group, topk_group, scaling);
  check_select_fill(logits, batch_cost, budget, fill);
  check_voting(voting, logits);
  check_token_count(logits);
  const c10::cuda::CUDAGuard guard(logits.device());
  const int64_t G = batch_cost.size(0);
  SelectParams p = make_params(logits, correction_bias, voting, r, G);
  p.compute_cost = false;
  p.batch_cost_in = batch_cost.data_ptr<float>();
  auto [ids, weights] = routing_outputs(p, logits, top_k);
  auto [kept, counts] = kept_outputs(p, logits, G, budget, fill);
  route_select_launch(p, static_cast<int>(G), logits.get_device());
  return {ids, weights, kept, counts};
}

// route_select's argument checks, kernel parameters and outputs (ids, weights, kept, counts, batch cost), ready to
// launch: route_select and select_experts check their routing arguments once, through this.
struct CheckedSelection {
  SelectParams params;
  std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> outputs;
};

CheckedSelection checked_route_select(const Tensor& logits, const OptTensor& log_norms, const OptTensor& correction_bias,
                                      int64_t num_groups, int64_t top_k, int64_t scoring, bool renormalize,
                                      int64_t n_group, int64_t topk_group, double scaling, int64_t cost, int64_t budget,
                                      int64_t fill, const OptTensor& voting) {
  const RoutingParams r =
      check_routing(logits, correction_bias, top_k, scoring, renormalize, n_group, topk_group, scaling);
  check_route_cost(logits, log_norms, num_groups, cost);
  check_budget_fill(budget, fill);
  check_voting(voting, logits);
  check_token_count(logits);
  CheckedSelection s{make_params(logits, correction_bias, voting, r, num_groups), {}};
  set_cost(s.params, log_norms, cost);
  s.outputs = selection_outputs(s.params, logits, top_k, num_groups, budget, fill);
  return s;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> route_select_cuda(
    const Tensor& logits, const OptTensor& log_norms, const OptTensor& correction_bias, int64_t num_groups,
    int64_t top_k, int64_t scoring, bool renormalize, int64_t n_group, int64_t topk_group, double scaling,
    int64_t cost, int64_t budget, int64_t fill, const OptTensor& voting) {
  CheckedSelection s = checked_route_select(logits, log_norms, correction_bias, num_groups, top_k, scoring,
                                            renormalize, n_group, topk_group, scaling, cost, budget, fill, voting);
  const c10::cuda::CUDAGuard guard(logits.device());
  route_select_launch(s.params, static_cast<int>(num_groups), logits.get_device());
  return s.outputs;
}

// router_predict, then route_select, every argument checked before the first launch. (Until session 59 a one-launch
// kernel, csrc/select_experts.cu, ran batches of up to 16 tokens: faster as one call in a row of selections, slower
// behind the norm that precedes the selection in a decode step, by 1.5-1.8 us per selection on the H200 at T <= 16 in
// bench_select and 0.8-2.1 us per layer, 1-2% of a Qwen3-30B-A3B decode step, end to end: device_runs/session59.txt,
// calls 2 and 5.)
SelectExpertsResult select_experts_cuda(const Tensor& hidden, const Tensor& router_weight, const OptTensor& router_bias,
                                        const OptTensor& predictor_weight, const OptTensor& predictor_bias,
                                        const OptTensor& correction_bias, int64_t num_groups, int64_t top_k,
                                        int64_t scoring, bool renormalize, int64_t n_group, int64_t topk_group,
                                        double scaling, int64_t cost, int64_t budget, int64_t fill,
                                        const OptTensor& voting, bool round_logits) {
  check_select_experts(predictor_weight, cost);
  auto [logits, log_norms] = checked_gemv_outputs(hidden, router_weight, router_bias, predictor_weight, predictor_bias);
  const OptTensor cost_log_norms = cost == static_cast<int64_t>(Cost::kBase) ? OptTensor(log_norms) : std::nullopt;
  CheckedSelection s = checked_route_select(logits, cost_log_norms, correction_bias, num_groups, top_k, scoring,
                                            renormalize, n_group, topk_group, scaling, cost, budget, fill, voting);
  const c10::cuda::CUDAGuard guard(hidden.device());  // after the checks: hidden may be on the CPU (refused there)
  launch_gemv(hidden, router_weight, router_bias, predictor_weight, predictor_bias, logits, log_norms, round_logits);
  route_select_launch(s.params, static_cast<int>(num_groups), hidden.get_device());
  auto [ids, weights, kept, counts, D] = s.outputs;
  return {logits, log_norms, ids, weights, kept, counts, D};
}

}  // namespace
}  // namespace base_moe

TORCH_LIBRARY_IMPL(base_moe, CUDA, m) {
  m.impl("router_predict", &base_moe::router_predict_cuda);
  m.impl("route_cost", &base_moe::route_cost_cuda);
  m.impl("select_fill", &base_moe::select_fill_cuda);
  m.impl("route_select", &base_moe::route_select_cuda);
  m.impl("select_experts", &base_moe::select_experts_cuda);
}
#endif  // BASE_MOE_WITH_CUDA
