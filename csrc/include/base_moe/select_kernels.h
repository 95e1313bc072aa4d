// Kernel parameters and launchers of the selection stages (csrc/router_predict.cu, csrc/route_select.cu).
// The op wrappers (argument checks, outputs, registration) live in host-compiled csrc/select_cuda.cpp: an
// exception thrown through nvcc-compiled host frames crashed the process on the H200 machine.
#pragma once

#include <cstdint>

#include "base_moe/float_dtype.h"
#include "base_moe/routing.h"

namespace base_moe {

struct GemvParams {
  const void* hidden;            // [T, H]
  const void* router_weight;     // [E, H]
  const void* predictor_weight;  // [E, H] or null
  const float* router_bias;      // [E] or null
  const float* predictor_bias;   // [E] or null
  float* logits;                 // [T, E]
  float* log_norms;              // [T, E] (unused without predictor)
  int T, H, E, R;                // R = E or 2E
  int k_per_cta;                 // slice of H per CTA of a cluster (multiple of 64); set by the launcher
  int cluster;                   // CTAs per cluster (split of H); set by the launcher
  bool round_logits;             // each logit (with its bias) rounded once to the inputs' dtype, as a linear layer
                                 // in that dtype returns it
};

struct SelectParams {
  const float* logits;           // [G * B, E]
  const float* log_norms;        // rows of E, row stride ln_stride (0: broadcast); BASE cost only
  int64_t ln_stride;
  const float* correction_bias;  // [E] or null (sigmoid, or softmax: ERNIE-4.5)
  const float* batch_cost_in;    // [G, E] (select_fill)
  const bool* voting;            // [G * B]: the tokens whose slots add to D and make candidates; null: every token
  int32_t* ids;                  // [G * B, k]: routed ids (route_cost), final ids (select_fill / route_select)
  float* weights;                // [G * B, k]
  int32_t* kept;                 // [G, W]
  int32_t* counts;               // [G, E]
  float* batch_cost_out;         // [G, E] (route_cost / route_select)
  int B, E, k, W;
  int scoring;                   // Scoring
  bool renormalize;
  int n_group, topk_group, group_size;
  float scaling;
  Cost cost;
  int fill;                      // Fill
  bool compute_cost;             // route_cost / route_select
  bool select;                   // select_fill / route_select
  double top1_scale;             // TOP1_UNION's offset per seeding slot (top1_scale)
  float top1_offset;             // TOP1_UNION's offset where every token votes (B tokens)
  int cluster;                   // CTAs per group; set by the launcher
  int experts_per_cta;           // experts each CTA of the cluster reduces (owned_experts_per_cta); set by the launcher
};

// Experts whose batch cost each CTA of a C-CTA cluster adds up (CTA r: [r n, (r + 1) n)): the smallest power of two n
// with C n >= E, so that a token warp finds an expert's owner with a shift, not a division (a ~20-instruction chain on
// the routing warp's path).
inline int owned_experts_per_cta(int E, int C) {
  int n = 1;
  while (n * C < E) n *= 2;
  return n;
}

// Whether a selection needs the generic instances that score the softmax rules with a selection bias (ERNIE-4.5) or a
// group limit (DeepSeek-V2: groups by their best score); route_select asks this before needs_generic_routing.
inline bool needs_softmax_bias_or_groups(const SelectParams& p) {
  return p.scoring != static_cast<int>(Scoring::kSigmoid) && (p.correction_bias != nullptr || p.n_group > 1);
}

// Whether a selection needs the kernels' generic instances: a scoring mode other than softmax, DeepSeek's group limit
// or more than 32 kept experts (backfill's path over them; the drop fills would not need it). Softmax models at budgets
// up to 32 (Qwen3-MoE, OLMoE) run instances without that code (GENERIC = false), which are shorter and faster per call.
inline bool needs_generic_routing(const SelectParams& p) {
  return p.scoring != static_cast<int>(Scoring::kSoftmax) || p.n_group > 1 || p.W > 32;
}

// Launch on the current CUDA stream of `device` (the caller holds a device guard).
void router_predict_launch(GemvParams p, FloatDtype dtype, bool vectorised, int device);
void route_select_launch(SelectParams p, int groups, int device);

}  // namespace base_moe
