// Declarations of the CPU op implementations; csrc/registration.cpp binds them to the schemas.
// The CUDA ops are registered for the CUDA dispatch key (TORCH_LIBRARY_IMPL) by the host-compiled
// csrc/select_cuda.cpp and csrc/experts_cuda.cpp, built only where CUDA is.
#pragma once

#include <tuple>

#include "base_moe/checks.h"

namespace base_moe {

// round_logits: each logit (with its bias) rounded once to hidden's dtype, as a linear layer in that dtype returns
// it (the routers of most Hugging Face MoE models); false: the fp32 sum.
std::tuple<Tensor, Tensor> router_predict_cpu(const Tensor& hidden, const Tensor& router_weight,
                                              const OptTensor& router_bias, const OptTensor& predictor_weight,
                                              const OptTensor& predictor_bias, bool round_logits = false);

std::tuple<Tensor, Tensor, Tensor> route_cost_cpu(const Tensor& logits, const OptTensor& log_norms,
                                                  const OptTensor& correction_bias, int64_t num_groups,
                                                  int64_t top_k, int64_t scoring, bool renormalize,
                                                  int64_t n_group, int64_t topk_group, double scaling,
                                                  int64_t cost, const OptTensor& voting);

std::tuple<Tensor, Tensor, Tensor, Tensor> select_fill_cpu(const Tensor& logits, const Tensor& batch_cost,
                                                           const OptTensor& correction_bias, int64_t top_k,
                                                           int64_t scoring, bool renormalize, int64_t n_group,
                                                           int64_t topk_group, double scaling, int64_t budget,
                                                           int64_t fill, const OptTensor& voting);

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> route_select_cpu(
    const Tensor& logits, const OptTensor& log_norms, const OptTensor& correction_bias, int64_t num_groups,
    int64_t top_k, int64_t scoring, bool renormalize, int64_t n_group, int64_t topk_group, double scaling,
    int64_t cost, int64_t budget, int64_t fill, const OptTensor& voting);

using SelectExpertsResult = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

SelectExpertsResult select_experts_cpu(const Tensor& hidden, const Tensor& router_weight, const OptTensor& router_bias,
                                       const OptTensor& predictor_weight, const OptTensor& predictor_bias,
                                       const OptTensor& correction_bias, int64_t num_groups, int64_t top_k,
                                       int64_t scoring, bool renormalize, int64_t n_group, int64_t topk_group,
                                       double scaling, int64_t cost, int64_t budget, int64_t fill,
                                       const OptTensor& voting, bool round_logits = false);

Tensor rms_norm_cpu(const Tensor& hidden, const Tensor& weight, double eps);
std::tuple<Tensor, Tensor> add_rms_norm_cpu(const Tensor& hidden, const Tensor& residual, const Tensor& weight,
                                            double eps);

Tensor experts_cpu(const Tensor& hidden, const Tensor& expert_ids, const Tensor& expert_weights,
                   const Tensor& gate_up_proj, const Tensor& down_proj, const std::optional<int64_t>& max_active_experts);

}  // namespace base_moe
