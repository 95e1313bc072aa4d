// CUDA registration of the decode expert op: the argument checks (host-compiled, so errors surface as
// Python exceptions) and the call into the kernels of csrc/experts.cu. Empty in CPU-only builds.
#ifdef BASE_MOE_WITH_CUDA
#include <ATen/ATen.h>
#include <torch/library.h>

#include "base_moe/checks.h"
#include "base_moe/routing.h"

namespace base_moe {

Tensor experts_cuda_launch(const Tensor& hidden, const Tensor& expert_ids, const Tensor& expert_weights,
                           const Tensor& gate_up_proj, const Tensor& down_proj,
                           int64_t max_active_experts);  // csrc/experts.cu

namespace {

Tensor experts_cuda(const Tensor& hidden, const Tensor& expert_ids, const Tensor& expert_weights,
                    const Tensor& gate_up_proj, const Tensor& down_proj,
                    const std::optional<int64_t>& max_active_experts) {
  check_experts(hidden, expert_ids, expert_weights, gate_up_proj, down_proj, max_active_experts);
  BASE_MOE_CHECK(hidden.scalar_type() == at::kBFloat16 || hidden.scalar_type() == at::kHalf,
              "experts on CUDA takes bfloat16 or float16 hidden states and weights, got ", hidden.scalar_type(),
              " (cast the inputs, or run the op on the CPU)");
  const int64_t T = hidden.size(0), H = hidden.size(1), k = expert_ids.size(1);
  const int64_t E = gate_up_proj.size(0), I = gate_up_proj.size(1) / 2;
  // positive: the kernels' k loops then run at least once (their barriers publish each pass's shared tables)
  BASE_MOE_CHECK(H > 0 && H % 64 == 0, "experts on CUDA needs hidden_size to be a positive multiple of 64, got ", H);
  BASE_MOE_CHECK(I > 0 && I % 64 == 0, "experts on CUDA needs the intermediate size (gate_up_proj.size(1) / 2) to be "
              "a positive multiple of 64, got ", I);
  BASE_MOE_CHECK(E >= 1 && E <= 512, "experts on CUDA supports 1 to 512 experts, got ", E);
  BASE_MOE_CHECK(T * k < (int64_t{1} << 30), "experts on CUDA: too many (token, slot) pairs: ", T * k);
  for (const Tensor* t : {&hidden, &gate_up_proj, &down_proj}) {
    BASE_MOE_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "experts on CUDA needs 16-byte aligned hidden, gate_up_proj and down_proj");
  }
  return experts_cuda_launch(hidden, expert_ids, expert_weights, gate_up_proj, down_proj,
                             max_active_experts.value_or(E));
}

}  // namespace
}  // namespace base_moe

TORCH_LIBRARY_IMPL(base_moe, CUDA, m) { m.impl("experts", &base_moe::experts_cuda); }
#endif  // BASE_MOE_WITH_CUDA
