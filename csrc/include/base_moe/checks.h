// Argument checks at the op boundary, shared by the CPU and CUDA implementations so that both
// reject bad input with the same message. Kernels themselves check nothing.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "base_moe/check.h"
#include "base_moe/float_dtype.h"
#include "base_moe/routing.h"

namespace base_moe {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// An optional operand's data, or null where it is not given (how the kernels and CPU loops read "absent").
template <typename T>
T* optional_data(const OptTensor& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

void check_router_predict(const Tensor& hidden, const Tensor& router_weight, const OptTensor& router_bias,
                          const OptTensor& predictor_weight, const OptTensor& predictor_bias);

// Checks the routing arguments against logits [T, E] and returns them as RoutingParams.
RoutingParams check_routing(const Tensor& logits, const OptTensor& correction_bias, int64_t top_k,
                            int64_t scoring, bool renormalize, int64_t n_group, int64_t topk_group,
                            double scaling);

void check_route_cost(const Tensor& logits, const OptTensor& log_norms, int64_t num_groups, int64_t cost);

void check_select_fill(const Tensor& logits, const Tensor& batch_cost, int64_t budget, int64_t fill);

// voting (route_cost, select_fill, route_select, select_experts): None, or [T] bool on logits' device, contiguous.
void check_voting(const OptTensor& voting, const Tensor& logits);

// The budget and fill arguments alone (route_select, which computes its batch cost itself).
void check_budget_fill(int64_t budget, int64_t fill);

// select_experts: the BASE cost needs the predictor's rows.
void check_select_experts(const OptTensor& predictor_weight, int64_t cost);

// rms_norm: hidden [T, H] contiguous float, weight [H] of hidden's dtype on its device, eps >= 0.
void check_rms_norm(const Tensor& hidden, const Tensor& weight, double eps);
// add_rms_norm: as rms_norm, and residual of hidden's shape, dtype and device, contiguous.
void check_add_rms_norm(const Tensor& hidden, const Tensor& residual, const Tensor& weight, double eps);

// The CPU ops that read their operands' data on the host (route_cost, select_fill, route_select and through it
// select_experts, experts): `t`, whose device the checks above tie the others to, must be a CPU tensor (the
// dispatcher guarantees it; a C++ caller of ops.h's *_cpu functions may not). The norms and router_predict run ATen
// calls, on any device.
void check_on_cpu(const Tensor& t, const char* name);

// The kernels' enum for a tensor that the checks above accepted (float32, float16 or bfloat16).
FloatDtype float_dtype(const Tensor& t);

void check_experts(const Tensor& hidden, const Tensor& expert_ids, const Tensor& expert_weights,
                   const Tensor& gate_up_proj, const Tensor& down_proj, const std::optional<int64_t>& max_active_experts);

}  // namespace base_moe
