// Kernel parameters and launchers of the selection stages (csrc/router_predict.cu, csrc/route_select.cu,
// csrc/select_experts.cu).
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
};

struct SelectParams {
  const float* logits;           // [G * B, E]
  const float* log_norms;        // rows of E, row stride ln_stride (0: broadcast); BASE cost only
  int64_t ln_stride;
  const float* correction_bias;  // [E] or null (sigmoid only)
  const float* batch_cost_in;    // [G, E] (select_fill)
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
  int cost;                      // Cost
  int fill;                      // Fill
  bool compute_cost;             // route_cost / route_select
  bool select;                   // select_fill / route_select
  float top1_offset;
  int cluster;                   // CTAs per group; set by the launcher
  int experts_per_cta;           // experts each CTA of the cluster reduces (owned_experts_per_cta); set by the launcher
};

// x / d for 0 <= x < 2^31 by a multiply-high and a shift whose multiplier the host computes (the method of CUTLASS's
// FastDivmod): on a kernel's critical path an integer division by a runtime value is a ~20-instruction chain.
struct FastDiv {
  int d;
  unsigned mul, shift;
};

inline FastDiv make_fast_div(int d) {
  FastDiv f{d, 0u, 0u};  // d = 1: the quotient is x itself (fast_div tests d)
  if (d > 1) {
    int ceil_log2 = 0;
    while ((int64_t{1} << ceil_log2) < d) ++ceil_log2;
    const int p = 31 + ceil_log2;  // 2^p / d in [2^31, 2^32): exact for every x < 2^31
    f.mul = static_cast<unsigned>(((uint64_t{1} << p) + static_cast<uint64_t>(d) - 1) / static_cast<uint64_t>(d));
    f.shift = static_cast<unsigned>(p - 32);
  }
  return f;
}

// select_experts (csrc/select_experts.cu): the GEMV's inputs and logits / log-norms outputs, the selection's
// routing parameters and outputs (sel.logits / sel.log_norms unused), and the cluster shape (set by the launcher).
struct FusedSelectParams {
  GemvParams gemv;
  SelectParams sel;
  bool predict;         // predictor rows present (required for the BASE cost)
  int token_groups;     // TG: the group's tokens split over TG x RG CTAs of one cluster
  int row_groups;       // RG
  int experts_per_cta;  // EC: experts (router rows, and as many predictor rows) of each CTA's GEMV tile
  FastDiv ec_div;       // division by EC
  int cluster_shift;    // log2(TG RG): a group's CTAs
  int row_group_shift;  // log2(RG)
  int gemv_slice;       // columns of H per k slice (a multiple of 32)
  int tokens_per_cta;   // TC: tokens of each token group
  int owned_experts;    // EO (owned_experts_per_cta): CTA r sums the batch costs of experts [r EO, (r + 1) EO) below E
  int owned_shift;      // log2(EO)
  int k_slices;         // warps splitting H in the GEMV
};

// Experts whose batch cost each CTA of a C-CTA cluster adds up (CTA r: [r n, (r + 1) n)): the smallest power of two n
// with C n >= E, so that a token warp finds an expert's owner with a shift, not a division (a ~20-instruction chain on
// the routing warp's path).
inline int owned_experts_per_cta(int E, int C) {
  int n = 1;
  while (n * C < E) n *= 2;
  return n;
}

// Whether a selection needs the kernels' generic instances: a scoring mode other than softmax, DeepSeek's group limit
// or more than 32 kept experts (backfill's path over them; the drop fills would not need it). Softmax models at budgets
// up to 32 (Qwen3-MoE, OLMoE) run instances without that code (GENERIC = false), which are shorter and faster per call.
inline bool needs_generic_routing(const SelectParams& p) {
  return p.scoring != static_cast<int>(Scoring::kSoftmax) || p.n_group > 1 || p.W > 32;
}

// Tokens per group up to which select_experts runs as one launch (csrc/select_experts.cu: above, the two kernels are
// faster behind the norm that precedes the selection in a decode step; device_runs/session48.txt, call 2).
constexpr int kMaxFusedTokens = 16;

// Launch on the current CUDA stream of `device` (the caller holds a device guard).
void router_predict_launch(GemvParams p, FloatDtype dtype, bool vectorised, int device);
void route_select_launch(SelectParams p, int groups, int device);
// False (nothing launched) when the shape does not fit the fused kernel: the caller runs the two kernels instead.
bool select_experts_launch(const FusedSelectParams& f, FloatDtype dtype, int groups, int device);

}  // namespace base_moe
