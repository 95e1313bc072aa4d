// Every schema of the base_moe op library, and its CPU kernels. The CUDA kernels register themselves
// in their own files (csrc/*_cuda.cpp) for the CUDA dispatch key.
// Enumerated int arguments (scoring, cost, fill) take the values of base_moe/routing.py.
#include <torch/library.h>

#include "base_moe/ops.h"

TORCH_LIBRARY(base_moe, m) {
  // Stage 1: router logits and predicted log-norms [T, E] (fp32) in one pass over the weights. round_logits: each
  // logit (with its bias) rounded once to hidden's dtype, as a linear layer in that dtype returns it (the routers of
  // most Hugging Face MoE models rank such logits; a model whose router upcasts, DeepSeek-V3's, keeps fp32 ones).
  m.def(
      "router_predict(Tensor hidden, Tensor router_weight, Tensor? router_bias, Tensor? predictor_weight, "
      "Tensor? predictor_bias, bool round_logits=False) -> (Tensor logits, Tensor log_norms)");
  // voting [T] bool (stages 2-3, optional): only its tokens' slots add to D and make experts candidates for the kept
  // set (TOP1_UNION's offset counts them); every token is still routed and filled. A finished sequence's pad tokens.
  // Stage 2: the model's routing (ids, weights [T, k]) and the per-group expert cost D [G, E].
  m.def(
      "route_cost(Tensor logits, Tensor? log_norms, Tensor? correction_bias, int num_groups, int top_k, "
      "int scoring, bool renormalize, int n_group, int topk_group, float scaling, int cost, Tensor? voting=None) "
      "-> (Tensor topk_ids, Tensor topk_weights, Tensor batch_cost)");
  // Stage 3: keep the top-budget experts of each group by D, fill each token's slots from them.
  m.def(
      "select_fill(Tensor logits, Tensor batch_cost, Tensor? correction_bias, int top_k, int scoring, "
      "bool renormalize, int n_group, int topk_group, float scaling, int budget, int fill, Tensor? voting=None) "
      "-> (Tensor expert_ids, Tensor expert_weights, Tensor kept, Tensor counts)");
  // Stages 2 and 3 in one call.
  m.def(
      "route_select(Tensor logits, Tensor? log_norms, Tensor? correction_bias, int num_groups, int top_k, "
      "int scoring, bool renormalize, int n_group, int topk_group, float scaling, int cost, int budget, int fill, "
      "Tensor? voting=None) -> (Tensor expert_ids, Tensor expert_weights, Tensor kept, Tensor counts, "
      "Tensor batch_cost)");
  // Stages 1-3 in one call (router_predict, then route_select): the logits and log-norms of router_predict
  // and the outputs of route_select (log-norms are used only by the BASE cost; [T, 0] without a predictor).
  m.def(
      "select_experts(Tensor hidden, Tensor router_weight, Tensor? router_bias, Tensor? predictor_weight, "
      "Tensor? predictor_bias, Tensor? correction_bias, int num_groups, int top_k, int scoring, bool renormalize, "
      "int n_group, int topk_group, float scaling, int cost, int budget, int fill, Tensor? voting=None, "
      "bool round_logits=False) -> "
      "(Tensor logits, Tensor log_norms, Tensor expert_ids, Tensor expert_weights, Tensor kept, Tensor counts, "
      "Tensor batch_cost)");
  // The decoder layer's RMSNorm before the MoE block (Llama-style, as HF writes it for Qwen3-MoE, OLMoE, Mixtral,
  // DeepSeek): weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), fp32 inside. On CUDA it lets the selection kernel
  // after it start (programmatic dependent launch), so select_experts stages its weights while the norm runs.
  m.def("rms_norm(Tensor hidden, Tensor weight, float eps) -> Tensor");
  // The same norm of residual + hidden, with that sum (the decoder layer's residual add fused into the norm, so that
  // no kernel without the PDL signal runs between the attention and the selection): (normed, sum).
  m.def("add_rms_norm(Tensor hidden, Tensor residual, Tensor weight, float eps) -> (Tensor normed, Tensor sum)");
  // Stage 4: the routed experts' output for the final ids and weights (SiLU-gated, HF v5 layout).
  // max_active_experts: an upper bound on the distinct experts in expert_ids that the caller knows (a budget);
  // the CUDA kernels size their grid by it and pick their tile configuration with it (any value >= 1 gives a
  // correct result, it is not a promise; two values may differ by bf16 rounding, the same value gives the same bits).
  m.def(
      "experts(Tensor hidden, Tensor expert_ids, Tensor expert_weights, Tensor gate_up_proj, Tensor down_proj, "
      "int? max_active_experts=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(base_moe, CPU, m) {
  m.impl("router_predict", &base_moe::router_predict_cpu);
  m.impl("route_cost", &base_moe::route_cost_cpu);
  m.impl("select_fill", &base_moe::select_fill_cpu);
  m.impl("route_select", &base_moe::route_select_cpu);
  m.impl("select_experts", &base_moe::select_experts_cpu);
  m.impl("rms_norm", &base_moe::rms_norm_cpu);
  m.impl("add_rms_norm", &base_moe::add_rms_norm_cpu);
  m.impl("experts", &base_moe::experts_cpu);
}

// The ops are not differentiable (inference-time selection and decode kernels): their outputs carry no
// autograd history, whatever the inputs.
TORCH_LIBRARY_IMPL(base_moe, Autograd, m) {
  for (const char* op : {"router_predict", "route_cost", "select_fill", "route_select", "select_experts", "rms_norm",
                          "add_rms_norm", "experts"}) {
    m.impl(op, torch::CppFunction::makeFallthrough());
  }
}
