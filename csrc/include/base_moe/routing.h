// Routing enumerations and parameters shared by the CPU and CUDA implementations.
// The integer values are part of the op schemas and match base_moe/routing.py.
#pragma once

#include <cstdint>

namespace base_moe {

enum class Scoring : int64_t { kSoftmax = 0, kSoftmaxAfterTopk = 1, kSigmoid = 2 };
enum class Cost : int64_t { kBase = 0, kRouterSum = 1, kRouterSq = 2, kFrequency = 3, kTop1Union = 4 };
enum class Fill : int64_t { kBackfill = 0, kDrop = 1, kDropRenorm = 2 };

// Largest shapes the kernels are written for (warp-level top-k over E, register arrays of k).
constexpr int64_t kMaxExperts = 512;
constexpr int64_t kMaxTopK = 16;

// A model's routing rule: how logits become routed experts and weights.
struct RoutingParams {
  int64_t num_experts;
  int64_t top_k;
  Scoring scoring;
  bool renormalize;
  int64_t n_group;     // DeepSeek-V3 group-limited top-k; 1 = no groups
  int64_t topk_group;  // groups each token may use
  double scaling;      // multiplies the final weights (routed_scaling_factor)
};

// What TOP1_UNION adds to every expert that is some token's top-1 (see reference.top1_offset).
inline float top1_offset(int64_t tokens_per_group, const RoutingParams& routing) {
  const double scale = routing.scaling > 1.0 ? routing.scaling : 1.0;
  return static_cast<float>(static_cast<double>(tokens_per_group * routing.top_k) * scale);
}

}  // namespace base_moe
