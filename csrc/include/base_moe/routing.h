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
  int64_t n_group;     // group-limited top-k (DeepSeek-V3, V2; group_score); 1 = no groups
  int64_t topk_group;  // groups each token may use
  double scaling;      // multiplies the final weights (routed_scaling_factor)
};

// TOP1_UNION's offset per seeding slot, max(1, scaling): the offset then exceeds any group's sum of routing weights.
inline double top1_scale(const RoutingParams& routing) {
  return routing.scaling > 1.0 ? routing.scaling : 1.0;
}

// What TOP1_UNION adds to every expert that is some (voting) token's top-1, for `tokens` tokens that vote: rounded once
// from double (reference.top1_offset). On the device too: the kernels count a group's voting tokens themselves.
BASE_MOE_HOST_DEVICE inline float top1_offset(int64_t tokens, int64_t top_k, double scale) {
  return static_cast<float>(static_cast<double>(tokens * top_k) * scale);
}

// The fp32 sigmoid that scores and weights SIGMOID routing (reference.sigmoid): through double and rounded once, so
// that the CPU, the GPU and the reference agree bit for bit (fp32 1 / (1 + exp(-x)) rounds twice and differs in the
// last place for about a third of all logits, enough to flip ties between close logits and between DeepSeek group
// scores that are equal in exact math). 0 where fp32 exp(-x) would overflow, as fp32 arithmetic gives.
BASE_MOE_HOST_DEVICE inline float sigmoid(float x) {
  return x <= -88.72283935546875f ? 0.0f : static_cast<float>(1.0 / (1.0 + ::exp(-static_cast<double>(x))));
}

// Experts per lane of the CUDA routing warp, which holds expert u in lane u / EPL, register u % EPL (the instances of
// csrc/route_select.cu): ceil(E / 32) rounded up to a power of two.
BASE_MOE_HOST_DEVICE inline int experts_per_lane(int64_t E) {
  int epl = 1;
  while (32 * epl < E) epl *= 2;
  return epl;
}

// exp(x) through double, rounded once: sigmoid's reason (the CPU, the GPU and the reference agree bit for bit).
BASE_MOE_HOST_DEVICE inline float exp_rounded_once(float x) {
  return static_cast<float>(::exp(static_cast<double>(x)));
}

// A group's score for the group limit (reference.allowed_groups), over its n >= 2 choice scores [first, first + n):
// under sigmoid scoring DeepSeek-V3's sum of the two largest, under the softmax scorings the largest (DeepSeek-V2's
// group_limited_greedy takes the largest softmax score; the choice scores there are the logits, which softmax orders
// alike, or with a selection bias the probabilities + the bias).
BASE_MOE_HOST_DEVICE inline float group_score(const float* score, int first, int n, bool sum_of_two) {
  float best = -INFINITY, second = -INFINITY;
  for (int i = 0; i < n; ++i) {
    const float v = score[first + i];
    if (v > best) {
      second = best;
      best = v;
    } else if (v > second) {
      second = v;
    }
  }
  return sum_of_two ? best + second : best;
}

// One routed slot's contribution to its expert's batch cost (reference.slot_costs): BASE's w^2 exp(2 log-norm), where a
// slot of squared weight 0 costs 0, never 0 x inf (log-norms above ~44); the router-only costs of the other policies.
BASE_MOE_HOST_DEVICE inline float slot_cost(Cost cost, float w, float log_norm) {
  switch (cost) {
    case Cost::kBase: {
      const float w2 = w * w;
      return w2 == 0.0f ? 0.0f : w2 * ::expf(2.0f * log_norm);
    }
    case Cost::kRouterSq:
      return w * w;
    case Cost::kFrequency:
      return 1.0f;
    default:  // kRouterSum, kTop1Union
      return w;
  }
}

// drop_renorm's scale of a token's surviving weights: total / kept_total over its routed and surviving weights (0 where
// nothing survives; reference.renormalised).
BASE_MOE_HOST_DEVICE inline float drop_renorm_scale(float total, float kept_total) {
  return kept_total > 0.0f ? total / kept_total : 0.0f;
}

// A surviving weight w times that scale; where a tiny kept total overflowed the scale to inf, w is divided first.
BASE_MOE_HOST_DEVICE inline float drop_renormalised(float w, float scale, float total, float kept_total) {
  return std::isinf(scale) ? w / kept_total * total : w * scale;
}

}  // namespace base_moe
