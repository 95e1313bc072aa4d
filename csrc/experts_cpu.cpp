// CPU twin of the decode expert kernel: per used expert, gather its tokens and run the SiLU-gated
// MLP in fp32 through ATen; contributions are added in (token, slot) order, so the result is deterministic.
#include <ATen/ATen.h>

#include <vector>

#include "base_moe/ops.h"

namespace base_moe {

Tensor experts_cpu(const Tensor& hidden, const Tensor& expert_ids, const Tensor& expert_weights,
                   const Tensor& gate_up_proj, const Tensor& down_proj, const std::optional<int64_t>& max_active_experts) {
  check_on_cpu(hidden, "hidden");
  check_experts(hidden, expert_ids, expert_weights, gate_up_proj, down_proj, max_active_experts);
  // The op has no backward: the ATen calls below must not record an autograd graph (they would
  // save index tensors that live only during this call).
  at::AutoDispatchBelowAutograd no_autograd;
  const int64_t T = hidden.size(0), k = expert_ids.size(1), E = gate_up_proj.size(0);
  const int64_t I = gate_up_proj.size(1) / 2;
  const int32_t* ids = expert_ids.data_ptr<int32_t>();

  // token and slot lists per expert, in token order
  std::vector<std::vector<int64_t>> tokens(E), slots(E);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t u = ids[t * k + j];
      BASE_MOE_CHECK(u >= 0 && u <= E, "expert_ids must be in [0, ", E, "] (", E, " = empty slot), got ", u);
      if (u == E) continue;
      tokens[u].push_back(t);
      slots[u].push_back(t * k + j);
    }
  }

  const Tensor x = hidden.to(at::kFloat);
  // y_slot[t * k + j] holds the weighted output of slot j of token t; summed over j at the end
  Tensor y_slot = at::zeros({T * k, hidden.size(1)}, x.options());
  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  for (int64_t u = 0; u < E; ++u) {
    if (tokens[u].empty()) continue;
    const Tensor tok = at::from_blob(tokens[u].data(), {(int64_t)tokens[u].size()}, long_opts);
    const Tensor slot = at::from_blob(slots[u].data(), {(int64_t)slots[u].size()}, long_opts);
    const Tensor gate_up = at::matmul(x.index_select(0, tok), gate_up_proj[u].to(at::kFloat).t());
    const Tensor act = at::silu(gate_up.narrow(1, 0, I)).mul_(gate_up.narrow(1, I, I));
    const Tensor y = at::matmul(act, down_proj[u].to(at::kFloat).t());
    const Tensor slot_w = expert_weights.view({-1}).index_select(0, slot).unsqueeze(1);
    y_slot.index_copy_(0, slot, y.mul_(slot_w));
  }
  return y_slot.view({T, k, hidden.size(1)}).sum(1).to(hidden.scalar_type());
}

}  // namespace base_moe
