// Routing enumerations and parameters shared by the CPU and CUDA implementations.
// The integer values are part of the op schemas and match base_moe/routing.py.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define BASE_MOE_HOST_DEVICE __host__ __device__
#else
#define BASE_MOE_HOST_DEVICE
#endif

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

// The fp32 sigmoid that scores and weights SIGMOID routing (reference.sigmoid): through double and rounded once, so
// that the CPU, the GPU and the reference agree bit for bit (fp32 1 / (1 + exp(-x)) rounds twice and differs in the
// last place for about a third of all logits, enough to flip ties between close logits and between DeepSeek group
// scores that are equal in exact math). 0 where fp32 exp(-x) would overflow, as fp32 arithmetic gives.
BASE_MOE_HOST_DEVICE inline float sigmoid(float x) {
  return x <= -88.72283935546875f ? 0.0f : static_cast<float>(1.0 / (1.0 + ::exp(-static_cast<double>(x))));
}

}  // namespace base_moe
