// CPU twin of the routing, cost-reduction and top-budget selection kernels (stages 2 and 3).
// One token at a time, written like base_moe/reference.py: rank by preference flags, then score
// descending, then expert index ascending; the batch cost is summed over tokens in token order.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "base_moe/ops.h"

namespace base_moe {
namespace {

struct Candidate {
  bool eligible;   // may be chosen at all
  bool preferred;  // ranks before non-preferred eligible experts
  float score;
  int32_t index;
};

// Scores descending as torch.sort(descending=True) orders them: a NaN before every number, NaNs tied with each other
// (so the ranking stays a strict weak order, as std::partial_sort needs). Only a batch cost can be NaN: select_fill's
// input, or a base cost of 0 x inf (a slot whose weight is 0 or squares to 0, on an expert whose log-norm exceeds
// ~44). The routing's scores come from finite inputs.
bool score_before(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return !std::isnan(b);
  return a > b;
}

bool ranks_before(const Candidate& a, const Candidate& b) {
  if (a.eligible != b.eligible) return a.eligible;
  if (a.preferred != b.preferred) return a.preferred;
  if (score_before(a.score, b.score)) return true;
  if (score_before(b.score, a.score)) return false;
  return a.index < b.index;
}

// Writes the first `k` eligible candidates in rank order to `ids`, the sentinel E after them.
void top_k_ids(std::vector<Candidate>& candidates, int64_t k, int32_t sentinel, int32_t* ids) {
  std::partial_sort(candidates.begin(), candidates.begin() + k, candidates.end(), ranks_before);
  for (int64_t j = 0; j < k; ++j) ids[j] = candidates[j].eligible ? candidates[j].index : sentinel;
}

// Softmax probabilities + selection bias (ERNIE-4.5), as the CUDA routing warp computes them: exp_rounded_once(x - max)
// over the denominator summed lane by lane (each lane's experts in index order), then over the lanes in warp_sum's
// butterfly order, so that the CPU, the GPU and the reference rank the same experts bit for bit.
void biased_probabilities(const float* logits, const float* correction_bias, int64_t E, float* choice) {
  constexpr int kLanes = 32;
  const float max_logit = *std::max_element(logits, logits + E);
  const int64_t epl = experts_per_lane(E);
  float lane_sum[kLanes] = {};
  for (int64_t u = 0; u < E; ++u) {
    choice[u] = exp_rounded_once(logits[u] - max_logit);
    lane_sum[u / epl] += choice[u];
  }
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    float level[kLanes];
    for (int lane = 0; lane < kLanes; ++lane) level[lane] = lane_sum[lane] + lane_sum[lane ^ offset];
    std::copy(level, level + kLanes, lane_sum);
  }
  for (int64_t u = 0; u < E; ++u) choice[u] = choice[u] / lane_sum[0] + correction_bias[u];
}

// The score experts are ranked by: logits for softmax scorings (softmax is monotone), softmax probabilities + bias for
// softmax with a selection bias, sigmoid (+ bias) for sigmoid.
void choice_scores(const float* logits, const float* correction_bias, const RoutingParams& r, float* choice) {
  if (r.scoring == Scoring::kSoftmax && correction_bias != nullptr) {
    biased_probabilities(logits, correction_bias, r.num_experts, choice);
    return;
  }
  for (int64_t u = 0; u < r.num_experts; ++u) {
    if (r.scoring != Scoring::kSigmoid) {
      choice[u] = logits[u];
    } else {
      const float s = sigmoid(logits[u]);
      choice[u] = correction_bias != nullptr ? s + correction_bias[u] : s;
    }
  }
}

// Group limit (DeepSeek-V3, DeepSeek-V2's group_limited_greedy): experts of the token's top `topk_group` groups
// (group_score: the sum of its best two choice scores under sigmoid scoring, its best one under softmax).
void allowed_experts(const float* choice, const RoutingParams& r, std::vector<uint8_t>& allowed) {
  std::fill(allowed.begin(), allowed.end(), 1);
  if (r.n_group <= 1) return;
  const int64_t group_size = r.num_experts / r.n_group;
  std::vector<Candidate> groups(r.n_group);
  for (int64_t grp = 0; grp < r.n_group; ++grp) {
    const float score = group_score(choice, static_cast<int>(grp * group_size), static_cast<int>(group_size),
                                    r.scoring == Scoring::kSigmoid);
    groups[grp] = Candidate{true, true, score, static_cast<int32_t>(grp)};
  }
  std::partial_sort(groups.begin(), groups.begin() + r.topk_group, groups.end(), ranks_before);
  std::fill(allowed.begin(), allowed.end(), 0);
  for (int64_t i = 0; i < r.topk_group; ++i) {
    std::fill_n(allowed.begin() + groups[i].index * group_size, group_size, 1);
  }
}

// The model's weights for the expert set `ids` (sentinel slots get 0).
void routing_weights(const float* logits, const int32_t* ids, const RoutingParams& r, float* w) {
  const int64_t E = r.num_experts;
  if (r.scoring == Scoring::kSoftmax) {
    float max_logit = -INFINITY, denom = 0.0f;
    for (int64_t u = 0; u < E; ++u) max_logit = std::max(max_logit, logits[u]);
    for (int64_t u = 0; u < E; ++u) denom += std::exp(logits[u] - max_logit);
    for (int64_t j = 0; j < r.top_k; ++j) w[j] = ids[j] < E ? std::exp(logits[ids[j]] - max_logit) / denom : 0.0f;
  } else if (r.scoring == Scoring::kSoftmaxAfterTopk) {
    float max_logit = -INFINITY, denom = 0.0f;
    for (int64_t j = 0; j < r.top_k; ++j) {
      if (ids[j] < E) max_logit = std::max(max_logit, logits[ids[j]]);
    }
    for (int64_t j = 0; j < r.top_k; ++j) {
      w[j] = ids[j] < E ? std::exp(logits[ids[j]] - max_logit) : 0.0f;
      denom += w[j];
    }
    for (int64_t j = 0; j < r.top_k; ++j) w[j] = denom > 0.0f ? w[j] / denom : 0.0f;
  } else {
    for (int64_t j = 0; j < r.top_k; ++j) w[j] = ids[j] < E ? sigmoid(logits[ids[j]]) : 0.0f;
  }
  if (r.renormalize && r.scoring != Scoring::kSoftmaxAfterTopk) {
    float total = 0.0f;
    for (int64_t j = 0; j < r.top_k; ++j) total += w[j];
    if (r.scoring == Scoring::kSigmoid) total += 1e-20f;  // DeepSeek-V3's guard
    for (int64_t j = 0; j < r.top_k; ++j) w[j] = total > 0.0f ? w[j] / total : 0.0f;
  }
  const float scaling = static_cast<float>(r.scaling);
  for (int64_t j = 0; j < r.top_k; ++j) w[j] *= scaling;
}

void check_finite(const Tensor& t, const char* name) {
  BASE_MOE_CHECK(at::isfinite(t).all().item<bool>(), name, " must be finite (found NaN or infinity)");
}

// The values the routing and the costs read must be finite: a NaN or infinite logit, bias or log-norm makes the routing
// meaningless, so the CPU ops refuse them (the CUDA ops do not check: it would synchronise). `log_norms` only where the
// cost reads them.
void check_finite_inputs(const Tensor& logits, const OptTensor& correction_bias, const OptTensor& log_norms) {
  check_finite(logits, "logits");
  if (correction_bias.has_value()) check_finite(*correction_bias, "correction_bias");
  if (log_norms.has_value()) check_finite(*log_norms, "log_norms");
}

OptTensor log_norms_read(const OptTensor& log_norms, int64_t cost) {
  return static_cast<Cost>(cost) == Cost::kBase ? log_norms : std::nullopt;
}

// Per-token scratch space for the routing of one token.
struct TokenScratch {
  explicit TokenScratch(int64_t E) : choice(E), allowed(E), candidates(E) {}
  std::vector<float> choice;
  std::vector<uint8_t> allowed;
  std::vector<Candidate> candidates;
};

// The model's own routing of token t: ids and weights [k]. Leaves choice scores and group mask in `s`.
void route_token(const float* logits, const float* correction_bias, const RoutingParams& r, TokenScratch& s,
                 int32_t* ids, float* w) {
  choice_scores(logits, correction_bias, r, s.choice.data());
  allowed_experts(s.choice.data(), r, s.allowed);
  for (int64_t u = 0; u < r.num_experts; ++u) {
    s.candidates[u] = Candidate{s.allowed[u] != 0, true, s.choice[u], static_cast<int32_t>(u)};
  }
  top_k_ids(s.candidates, r.top_k, static_cast<int32_t>(r.num_experts), ids);
  routing_weights(logits, ids, r, w);
}

void route_all(const Tensor& logits, const OptTensor& correction_bias, const RoutingParams& r, Tensor& ids,
               Tensor& weights) {
  const int64_t T = logits.size(0), E = r.num_experts, k = r.top_k;
  const float* l = logits.data_ptr<float>();
  const float* bias = optional_data<float>(correction_bias);
  int32_t* id = ids.data_ptr<int32_t>();
  float* w = weights.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    TokenScratch scratch(E);
    for (int64_t t = begin; t < end; ++t) route_token(l + t * E, bias, r, scratch, id + t * k, w + t * k);
  });
}

// D[g, u]: the group's slot costs summed in token order, plus the TOP1_UNION seed offset; only the voting tokens' slots
// (every token's where `voting` is null), and the offset counts them.
Tensor batch_cost(const Tensor& ids, const Tensor& weights, const OptTensor& log_norms, int64_t num_groups,
                  const RoutingParams& r, Cost cost, const bool* voting) {
  const int64_t T = ids.size(0), E = r.num_experts, k = r.top_k, B = T / num_groups;
  Tensor D = at::zeros({num_groups, E}, weights.options());
  const int32_t* id = ids.data_ptr<int32_t>();
  const float* w = weights.data_ptr<float>();
  const float* g = cost == Cost::kBase ? log_norms->data_ptr<float>() : nullptr;
  const int64_t g_stride = cost == Cost::kBase ? log_norms->stride(0) : 0;
  float* d = D.data_ptr<float>();
  for (int64_t grp = 0; grp < num_groups; ++grp) {
    float* d_row = d + grp * E;
    std::vector<uint8_t> seeded(E, 0);
    int64_t voters = 0;
    for (int64_t t = grp * B; t < (grp + 1) * B; ++t) {
      if (voting != nullptr && !voting[t]) continue;
      ++voters;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t u = id[t * k + j];
        if (u == E) continue;
        d_row[u] += slot_cost(cost, w[t * k + j], g != nullptr ? g[t * g_stride + u] : 0.0f);
      }
      if (id[t * k] < E) seeded[id[t * k]] = 1;
    }
    if (cost != Cost::kTop1Union) continue;
    const float offset = top1_offset(voters, r.top_k, top1_scale(r));
    for (int64_t u = 0; u < E; ++u) {
      if (seeded[u]) d_row[u] += offset;
    }
  }
  return D;
}

// kept[g, :]: the budget experts of largest D (ties to the lower index) that some (voting) token of the group routes
// to, padded with E.
Tensor keep_experts(const Tensor& routed_ids, const Tensor& D, int64_t budget, const RoutingParams& r,
                    const bool* voting) {
  const int64_t G = D.size(0), E = r.num_experts, k = r.top_k, B = routed_ids.size(0) / G;
  const int64_t width = std::min(budget, E);
  Tensor kept = at::empty({G, width}, routed_ids.options());
  const int32_t* id = routed_ids.data_ptr<int32_t>();
  const float* d = D.data_ptr<float>();
  std::vector<Candidate> candidates(E);
  for (int64_t grp = 0; grp < G; ++grp) {
    for (int64_t u = 0; u < E; ++u) candidates[u] = Candidate{false, true, d[grp * E + u], static_cast<int32_t>(u)};
    for (int64_t i = grp * B * k; i < (grp + 1) * B * k; ++i) {
      if (id[i] < E && (voting == nullptr || voting[i / k])) candidates[id[i]].eligible = true;
    }
    top_k_ids(candidates, width, static_cast<int32_t>(E), kept.data_ptr<int32_t>() + grp * width);
  }
  return kept;
}

// Final ids and weights of every token under the fill rule, given the model's routing and the kept sets.
void fill_tokens(const Tensor& logits, const OptTensor& correction_bias, const RoutingParams& r,
                 const Tensor& routed_ids, const Tensor& routed_weights, const Tensor& kept, Fill fill,
                 Tensor& ids, Tensor& weights) {
  const int64_t T = logits.size(0), E = r.num_experts, k = r.top_k, G = kept.size(0), B = T / G;
  const float* l = logits.data_ptr<float>();
  const float* bias = optional_data<float>(correction_bias);
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    TokenScratch s(E);
    std::vector<uint8_t> in_kept(E + 1);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(in_kept.begin(), in_kept.end(), 0);
      const int32_t* kept_row = kept.data_ptr<int32_t>() + (t / B) * kept.size(1);
      for (int64_t i = 0; i < kept.size(1); ++i) in_kept[kept_row[i]] = 1;
      in_kept[E] = 0;
      int32_t* id = ids.data_ptr<int32_t>() + t * k;
      float* w = weights.data_ptr<float>() + t * k;
      const float* row = l + t * E;
      if (fill == Fill::kBackfill) {
        choice_scores(row, bias, r, s.choice.data());
        allowed_experts(s.choice.data(), r, s.allowed);
        for (int64_t u = 0; u < E; ++u) {
          s.candidates[u] = Candidate{in_kept[u] != 0, s.allowed[u] != 0, s.choice[u], static_cast<int32_t>(u)};
        }
        top_k_ids(s.candidates, k, static_cast<int32_t>(E), id);
        routing_weights(row, id, r, w);
        continue;
      }
      // drop: routed experts that survive keep their order and weights; dropped slots move to the end
      const int32_t* routed = routed_ids.data_ptr<int32_t>() + t * k;
      const float* routed_w = routed_weights.data_ptr<float>() + t * k;
      int64_t n = 0;
      float total = 0.0f, kept_total = 0.0f;
      for (int64_t j = 0; j < k; ++j) total += routed_w[j];
      for (int64_t j = 0; j < k; ++j) {
        if (!in_kept[routed[j]]) continue;
        id[n] = routed[j];
        w[n] = routed_w[j];
        kept_total += routed_w[j];
        ++n;
      }
      for (int64_t j = n; j < k; ++j) {
        id[j] = static_cast<int32_t>(E);
        w[j] = 0.0f;
      }
      if (fill == Fill::kDropRenorm) {
        const float scale = drop_renorm_scale(total, kept_total);
        for (int64_t j = 0; j < k; ++j) w[j] = drop_renormalised(w[j], scale, total, kept_total);
      }
    }
  });
}

Tensor count_experts(const Tensor& ids, int64_t num_groups, int64_t E) {
  const int64_t T = ids.size(0), k = ids.size(1), B = T / num_groups;
  Tensor counts = at::zeros({num_groups, E}, ids.options());
  const int32_t* id = ids.data_ptr<int32_t>();
  int32_t* c = counts.data_ptr<int32_t>();
  for (int64_t i = 0; i < T * k; ++i) {
    if (id[i] < E) ++c[(i / k / B) * E + id[i]];
  }
  return counts;
}

// The model's own routing of every token: ids and weights [T, k].
std::tuple<Tensor, Tensor> route_tokens(const Tensor& logits, const OptTensor& correction_bias,
                                        const RoutingParams& r) {
  Tensor ids = at::empty({logits.size(0), r.top_k}, logits.options().dtype(at::kInt));
  Tensor weights = at::empty({logits.size(0), r.top_k}, logits.options());
  route_all(logits, correction_bias, r, ids, weights);
  return {ids, weights};
}

// Stage 3 given the model's routing and the batch cost: (ids, weights, kept, counts).
std::tuple<Tensor, Tensor, Tensor, Tensor> keep_and_fill(const Tensor& logits, const OptTensor& correction_bias,
                                                         const RoutingParams& r, const Tensor& routed,
                                                         const Tensor& routed_w, const Tensor& D, int64_t budget,
                                                         int64_t fill, const bool* voting) {
  Tensor kept = keep_experts(routed, D, budget, r, voting);
  Tensor ids = at::empty_like(routed);
  Tensor weights = at::empty_like(routed_w);
  fill_tokens(logits, correction_bias, r, routed, routed_w, kept, static_cast<Fill>(fill), ids, weights);
  return {ids, weights, kept, count_experts(ids, D.size(0), r.num_experts)};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor> route_cost_cpu(const Tensor& logits, const OptTensor& log_norms,
                                                  const OptTensor& correction_bias, int64_t num_groups,
                                                  int64_t top_k, int64_t scoring, bool renormalize,
                                                  int64_t n_group, int64_t topk_group, double scaling,
                                                  int64_t cost, const OptTensor& voting) {
  check_on_cpu(logits, "logits");
  const RoutingParams r =
      check_routing(logits, correction_bias, top_k, scoring, renormalize, n_group, topk_group, scaling);
  check_route_cost(logits, log_norms, num_groups, cost);
  check_voting(voting, logits);
  check_finite_inputs(logits, correction_bias, log_norms_read(log_norms, cost));
  auto [ids, weights] = route_tokens(logits, correction_bias, r);
  Tensor D = batch_cost(ids, weights, log_norms, num_groups, r, static_cast<Cost>(cost), optional_data<bool>(voting));
  return {ids, weights, D};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> select_fill_cpu(const Tensor& logits, const Tensor& batch_cost,
                                                           const OptTensor& correction_bias, int64_t top_k,
                                                           int64_t scoring, bool renormalize, int64_t n_group,
                                                           int64_t topk_group, double scaling, int64_t budget,
                                                           int64_t fill, const OptTensor& voting) {
  check_on_cpu(logits, "logits");
  const RoutingParams r =
      check_routing(logits, correction_bias, top_k, scoring, renormalize, n_group, topk_group, scaling);
  check_select_fill(logits, batch_cost, budget, fill);
  check_voting(voting, logits);
  check_finite_inputs(logits, correction_bias, std::nullopt);
  auto [routed, routed_w] = route_tokens(logits, correction_bias, r);
  return keep_and_fill(logits, correction_bias, r, routed, routed_w, batch_cost, budget, fill,
                       optional_data<bool>(voting));
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> route_select_cpu(
    const Tensor& logits, const OptTensor& log_norms, const OptTensor& correction_bias, int64_t num_groups,
    int64_t top_k, int64_t scoring, bool renormalize, int64_t n_group, int64_t topk_group, double scaling,
    int64_t cost, int64_t budget, int64_t fill, const OptTensor& voting) {
  check_on_cpu(logits, "logits");
  const RoutingParams r =
      check_routing(logits, correction_bias, top_k, scoring, renormalize, n_group, topk_group, scaling);
  check_route_cost(logits, log_norms, num_groups, cost);
  check_budget_fill(budget, fill);
  check_voting(voting, logits);
  check_finite_inputs(logits, correction_bias, log_norms_read(log_norms, cost));
  auto [routed, routed_w] = route_tokens(logits, correction_bias, r);
  const bool* votes = optional_data<bool>(voting);
  Tensor D = batch_cost(routed, routed_w, log_norms, num_groups, r, static_cast<Cost>(cost), votes);
  auto [ids, weights, kept, counts] =
      keep_and_fill(logits, correction_bias, r, routed, routed_w, D, budget, fill, votes);
  return {ids, weights, kept, counts, D};
}

}  // namespace base_moe
