// Calls base_moe::route_select through the dispatcher from C++ and prints what it kept; then the CPU kernel itself
// through the installed header base_moe/ops.h, which must give the same selection.
#include <torch/torch.h>

#include <iostream>

#include "base_moe/ops.h"

int main() {
  torch::manual_seed(0);
  const int64_t groups = 2, tokens = 8, experts = 16, top_k = 4, budget = 5;
  auto logits = torch::randn({groups * tokens, experts});
  auto op = c10::Dispatcher::singleton().findSchemaOrThrow("base_moe::route_select", "").typed<
      std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
          const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t, int64_t,
          int64_t, bool, int64_t, int64_t, double, int64_t, int64_t, int64_t, const std::optional<at::Tensor>&)>();
  // softmax scoring, renormalised, no groups; cost router_sum (1); fill backfill (0)
  auto [ids, weights, kept, counts, cost] =
      op.call(logits, std::nullopt, std::nullopt, groups, top_k, 0, true, 1, 1, 1.0, 1, budget, 0, std::nullopt);
  std::cout << "kept experts per group:\n" << kept << "\n";
  TORCH_CHECK(kept.size(1) == budget, "expected ", budget, " kept slots");
  TORCH_CHECK(counts.sum().item<int64_t>() == ids.lt(experts).sum().item<int64_t>(),
              "counts must count every non-empty slot");
  static_assert(base_moe::kMaxExperts >= experts && base_moe::kMaxTopK >= top_k);
  auto direct = base_moe::route_select_cpu(logits, std::nullopt, std::nullopt, groups, top_k, 0, true, 1, 1, 1.0, 1,
                                           budget, 0, std::nullopt);
  TORCH_CHECK(std::get<2>(direct).equal(kept) && std::get<0>(direct).equal(ids),
              "ops.h's route_select_cpu must give the dispatcher's selection");
  std::cout << "ok\n";
  return 0;
}
