// Per-token routing on one warp, for route_select (csrc/route_select.cu):
// a token's E scores live in registers (lane l owns experts [l * EPL, (l + 1) * EPL)); the top k come from k
// rounds of a hardware warp max (redux.sync) over order-preserving 32-bit keys, so equal scores go to the lowest
// lane and within a lane to the lowest register: to the lower expert index, as in the reference.
#pragma once

#include <cuda_runtime.h>

#include "base_moe/cuda_utils.cuh"
#include "base_moe/routing.h"
#include "base_moe/select_kernels.h"

namespace base_moe {
namespace routing_device {

using cuda::kFullMask;

template <int EPL>
struct Token {
  float logit[EPL];
  float choice[EPL];
  float log_norm[EPL];
  uint32_t allowed;    // bit j: expert lane * EPL + j is in one of the token's top groups
  float max_logit;     // softmax over all experts, without renormalisation (softmax_of_slots)
  float denominator;
  int32_t slot_id;     // lane r < k: slot r (routed set)
  float slot_weight;
};

// The scoring mode an instance routes by: the model's, or softmax where GENERIC = false (the caller knows the model
// scores by softmax, and the other modes' code is left out).
template <bool GENERIC>
__device__ __forceinline__ int scoring_mode(const SelectParams& p) {
  return GENERIC ? p.scoring : static_cast<int>(Scoring::kSoftmax);
}

// Whether the weights are the softmax of the slots' logits: softmax after the top k, and softmax over all experts
// renormalised over the top k, which is the same function (the denominator over all E cancels). Computed over the
// slots, the latter's weights need neither the token's maximum nor its denominator over all experts, which
// score_token then skips (a warp max and a warp sum on the routing warp's chain, ~0.3 us at one token per call); they
// differ from the reference's softmax-then-divide by rounding (a few ulps; the tests allow 1e-5), except where
// backfill's slots all lie ~87 or more below the token's top logit: there the reference's exponentials underflow
// (weights 0 or denormal-rounded) and these stay accurate.
__device__ __forceinline__ bool softmax_of_slots(const SelectParams& p, int scoring) {
  return scoring == static_cast<int>(Scoring::kSoftmaxAfterTopk) ||
         (scoring == static_cast<int>(Scoring::kSoftmax) && p.renormalize);
}

// Softmax probabilities + selection bias (ERNIE-4.5) into s.choice, as the CPU op and the reference compute them
// (route_select_cpu.cpp's biased_probabilities): exp_rounded_once(logit - max) over the denominator summed by each lane
// over its experts in index order, then by warp_sum's butterfly.
template <int EPL>
__device__ __forceinline__ void biased_probabilities(int E, int lane, const float (&bias)[EPL], Token<EPL>& s) {
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    if (lane * EPL + j < E) m = max(m, cuda::ordered_bits(s.logit[j]));
  }
  const float max_logit = cuda::from_ordered_bits(cuda::warp_max_u32(m));
  float e[EPL], sum = 0.0f;
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    e[j] = lane * EPL + j < E ? exp_rounded_once(s.logit[j] - max_logit) : 0.0f;
    sum += e[j];  // (+0 past E: exact, as the CPU's sum that skips them)
  }
  const float denominator = cuda::warp_sum(sum);
#pragma unroll
  for (int j = 0; j < EPL; ++j) s.choice[j] = e[j] / denominator + bias[j];
}

// Computes the token's choice scores, group limit and softmax statistics from s.logit (and s.log_norm), which
// the caller has loaded: lane l holds experts [l * EPL, (l + 1) * EPL). scratch_row: E floats, group_scratch:
// 2 * n_group floats, both private to the warp. GENERIC = false: the caller knows the model scores by softmax
// (Scoring::kSoftmax) without a group limit (n_group <= 1), and the other modes' code is left out.
// SOFTMAX_BIAS_OR_GROUPS (with GENERIC): the caller knows a softmax scoring with a selection bias (ERNIE-4.5:
// biased_probabilities) or a group limit (DeepSeek-V2: groups by their best score) comes, which only those instances
// carry; the others score groups by their best two (DeepSeek-V3's sigmoid rule). In the generic instances the float64
// exps, inlined, grew the code by up to 27% and made a DeepSeek-like call 0.9 us slower on an H100, though it never ran
// them (device_runs/session76.txt, call 4).
template <int EPL, bool GENERIC = true, bool SOFTMAX_BIAS_OR_GROUPS = false>
__device__ __forceinline__ void score_token(const SelectParams& p, int lane, float* scratch_row, float* group_scratch,
                                            Token<EPL>& s) {
  const int E = p.E, scoring = scoring_mode<GENERIC>(p);
  const bool sig = scoring == static_cast<int>(Scoring::kSigmoid);
  // the lane's correction biases loaded together: ptxas issued one load per expert after the previous expert's
  // sigmoid, a memory round trip each
  float bias[EPL];
  const bool biased = (sig || SOFTMAX_BIAS_OR_GROUPS) && p.correction_bias != nullptr;
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int u = lane * EPL + j;
    bias[j] = biased && u < E ? p.correction_bias[u] : 0.0f;
  }
  if (SOFTMAX_BIAS_OR_GROUPS && biased) {
    biased_probabilities<EPL>(E, lane, bias, s);
  } else {
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      float c = s.logit[j];
      if (sig) c = sigmoid(c) + bias[j];
      s.choice[j] = c;
    }
  }
  s.allowed = (1u << EPL) - 1u;
  if (GENERIC && p.n_group > 1) {
    // group limit: keep the top topk_group groups by group_score (DeepSeek-V3's best two choice scores, V2's best one)
    __syncwarp();  // earlier readers of the scratch are done
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      const int u = lane * EPL + j;
      if (u < E) scratch_row[u] = s.choice[j];
    }
    __syncwarp();
    const int gs = p.group_size, ng = p.n_group;
    for (int grp = lane; grp < ng; grp += 32) {
      group_scratch[grp] = group_score(scratch_row, grp * gs, gs, !SOFTMAX_BIAS_OR_GROUPS);
    }
    __syncwarp();
    for (int grp = lane; grp < ng; grp += 32) {
      const float mine = group_scratch[grp];
      int rank = 0;
      for (int o = 0; o < ng; ++o) {
        const float v = group_scratch[o];
        rank += (v > mine || (v == mine && o < grp)) ? 1 : 0;
      }
      group_scratch[ng + grp] = rank < p.topk_group ? 1.0f : 0.0f;
    }
    __syncwarp();
    s.allowed = 0;
    // the lane's first expert's group, then a step per register: one division on the routing warp's chain, not EPL
    int grp = lane * EPL / gs, in_group = lane * EPL - grp * gs;
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      const int u = lane * EPL + j;
      if (u < E && group_scratch[ng + grp] != 0.0f) s.allowed |= 1u << j;
      if (++in_group == gs) {
        in_group = 0;
        ++grp;
      }
    }
    __syncwarp();  // the scratch row is reused by the caller
  }
  if (scoring == static_cast<int>(Scoring::kSoftmax) && !p.renormalize) {  // slot_weight's statistics
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      if (lane * EPL + j < E) m = max(m, cuda::ordered_bits(s.logit[j]));
    }
    s.max_logit = cuda::from_ordered_bits(cuda::warp_max_u32(m));
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < EPL; ++j) {
      if (lane * EPL + j < E) sum += expf(s.logit[j] - s.max_logit);
    }
    s.denominator = cuda::warp_sum(sum);
  } else {
    s.max_logit = 0.0f;
    s.denominator = 1.0f;
  }
}

// Sorts a lane's keys in descending order, equal keys keeping the lower register first (a stable insertion sort,
// unrolled); at[i] is the register that now holds position i.
template <int EPL>
__device__ __forceinline__ void sort_lane_keys(uint32_t (&key)[EPL], int (&at)[EPL]) {
#pragma unroll
  for (int j = 0; j < EPL; ++j) at[j] = j;
#pragma unroll
  for (int a = 1; a < EPL; ++a) {
#pragma unroll
    for (int b = a; b > 0; --b) {
      const bool swap = key[b] > key[b - 1];
      const uint32_t hi = swap ? key[b] : key[b - 1], lo = swap ? key[b - 1] : key[b];
      const int at_hi = swap ? at[b] : at[b - 1], at_lo = swap ? at[b - 1] : at[b];
      key[b - 1] = hi;
      key[b] = lo;
      at[b - 1] = at_hi;
      at[b] = at_lo;
    }
  }
}

// Picks slots [first_slot, k) in descending key order (key 0 = not eligible), equal keys to the lower expert: lane r
// in that range gets its slot's expert in `id` (other lanes keep theirs). Returns the slot after the last one picked
// (fewer than k when the eligible keys run out). The keys are consumed.
// Each lane sorts its keys first, so a round compares the lanes' heads only: one warp max, one ballot, one shuffle
// of the winner's expert, and the winning lane (the lowest among equal heads: the lower expert) pops its head. Ids
// stay in registers: no shared memory, and nothing but the pop on the rounds' dependent chain
// (benchmarks/micro/route_token.cu on the H200, k 8 of E 128: 1080 cycles against 2070 for a scan of every key).
template <int EPL>
__device__ __forceinline__ int warp_top_k(uint32_t (&key)[EPL], int first_slot, int k, int lane, int32_t& id) {
  int at[EPL];
  sort_lane_keys<EPL>(key, at);
  int slot = first_slot;
  for (; slot < k; ++slot) {
    const uint32_t top = cuda::warp_max_u32(key[0]);
    if (top == 0) break;
    const int owner = __ffs(__ballot_sync(kFullMask, key[0] == top)) - 1;
    const int32_t winner = __shfl_sync(kFullMask, lane * EPL + at[0], owner);
    if (lane == owner) {
#pragma unroll
      for (int j = 0; j + 1 < EPL; ++j) {
        key[j] = key[j + 1];
        at[j] = at[j + 1];
      }
      key[EPL - 1] = 0;
    }
    if (lane == slot) id = winner;
  }
  return slot;
}

// The lane whose registers hold expert u's per-expert values (register u % EPL); any lane for the sentinel u = E.
template <int EPL>
__device__ __forceinline__ int holder_lane(int u) {
  return (u / EPL) & 31;
}

// Ranking key of a candidate expert with batch cost d, for the top-budget selection (key descending, lower expert
// first): keys order like the costs, NaN above +inf as in torch.sort; 0 is left for the experts that are no
// candidate, which rank below every candidate.
__device__ __forceinline__ uint32_t candidate_key(float d) {
  return max(cuda::ordered_bits(d), 1u);
}

// The batch-cost tables flag each expert: bit 0, some token of the group routed to it; bit 1, it is some token's top-1.
// D of an expert from the sum of its slot costs: TOP1_UNION adds its offset where the expert is some token's top-1.
__device__ __forceinline__ float with_top1_offset(const SelectParams& p, float d, int flags, float offset) {
  if (p.cost == Cost::kTop1Union && (flags & 2)) d = d + offset;
  return d;
}

// values[j] of expert u (lane holder_lane(u), register u % EPL) to the calling lane; every lane calls it (shuffles).
// Any value for the sentinel u = E.
template <int EPL>
__device__ __forceinline__ float expert_value(const float (&values)[EPL], int u) {
  const int holder = holder_lane<EPL>(u), reg = u % EPL;
  float out = 0.0f;
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const float v = __shfl_sync(kFullMask, values[j], holder);
    out = j == reg ? v : out;
  }
  return out;
}

// The model's weight rule for the picked slots: lane r's weight for its slot's expert `id` (E: empty slot, weight 0)
// with router logit `logit`. GENERIC = false: softmax scoring (score_token).
template <int EPL, bool GENERIC = true>
__device__ __forceinline__ float slot_weight(const SelectParams& p, const Token<EPL>& s, int32_t id, float logit) {
  const bool valid = id < p.E;
  const int scoring = scoring_mode<GENERIC>(p);
  float w;
  if (softmax_of_slots(p, scoring)) {
    // GENERIC = false: one REDUX for the max and the sum over the slot lanes only (the lanes past k hold no slot,
    // e = 0), on the routing warp's chain: the one-launch select_experts kernel of sessions 22-58 (Qwen3) 0.04-0.19 us
    // faster at T <= 64. Not in the generic instances: there the same code made route_select's DeepSeek (sigmoid) calls
    // 0.2-0.5 us slower though it does not run for them (its micro, k 8 of E 128: route_token 2293 -> 1987 cycles;
    // device_runs/session44.txt, calls 2-3).
    const float head = valid ? logit : -INFINITY;
    const float m =
        GENERIC ? cuda::warp_max(head) : cuda::from_ordered_bits(cuda::warp_max_u32(cuda::ordered_bits(head)));
    const float e = valid ? expf(logit - m) : 0.0f;
    const float total = GENERIC ? cuda::warp_sum(e) : cuda::warp_sum_first(e, p.k);
    w = total > 0.0f ? e / total : 0.0f;
  } else if (scoring == static_cast<int>(Scoring::kSoftmax)) {
    w = valid ? expf(logit - s.max_logit) / s.denominator : 0.0f;
  } else {
    w = valid ? sigmoid(logit) : 0.0f;
  }
  if (p.renormalize && scoring == static_cast<int>(Scoring::kSigmoid)) {  // (softmax_of_slots covers softmax's)
    const float total = cuda::warp_sum(w) + 1e-20f;  // DeepSeek-V3's guard
    w = total > 0.0f ? w / total : 0.0f;
  }
  return w * p.scaling;
}

// d + the values of row[0, n) in that order, the zeros skipped, by one warp (a batch cost D is a few routed tokens'
// costs among many zeros), for n <= 32 * kWindows. The non-zero values move, in order, to the front of the row (each to
// its rank among them: a ballot per 32 values, all loaded first), then every lane adds them in turn from shared memory:
// their loads are independent and only the adds form a chain. Adding each value from its lane by a shuffle put a
// shuffle's latency on the chain per value: this form made route_select alone at 256 tokens 8.60 -> 7.45 us (Qwen3;
// DeepSeek-like 19.53 -> 16.72) and the one-launch kernel then used at 64 tokens 12.24 -> 12.17, but at T <= 16, where
// an expert has a value or two, 0.04-0.05 us slower (device_runs/session47.txt, call 4). The row is consumed: its front
// is overwritten, and every lane reads all of it, so a caller that writes the row again needs a __syncwarp first.
// Skipping a zero (+0 or -0) is exact unless d is -0, which a sum starting at +0 never is (an exact zero sum rounds to
// +0; no flush-to-zero in these builds). Every lane returns the sum.
template <int kWindows>
__device__ __forceinline__ float warp_add_nonzero_in_order(float d, float* row, int n, int lane) {
  float v[kWindows];
#pragma unroll
  for (int w = 0; w < kWindows; ++w) v[w] = w * 32 + lane < n ? row[w * 32 + lane] : 0.0f;
  __syncwarp();  // every lane holds its values: the row may be overwritten
  const unsigned below = (1u << lane) - 1u;
  int count = 0;
#pragma unroll
  for (int w = 0; w < kWindows; ++w) {
    const unsigned m = __ballot_sync(kFullMask, v[w] != 0.0f);
    if (v[w] != 0.0f) row[count + __popc(m & below)] = v[w];
    count += __popc(m);
  }
  __syncwarp();
#pragma unroll 4
  for (int i = 0; i < count; ++i) d += row[i];
  return d;
}

// The same sum by one thread (bit for bit: the same additions in the same order). kMaxN > 0: n <= kMaxN, and all the
// loads are issued before the first add (a loop of runtime length waits for each load in turn).
template <int kMaxN = 0>
__device__ __forceinline__ float thread_add_nonzero_in_order(float d, const float* row, int n) {
  if constexpr (kMaxN > 0) {
    float v[kMaxN];
#pragma unroll
    for (int i = 0; i < kMaxN; ++i) v[i] = i < n ? row[i] : 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxN; ++i) {
      if (v[i] != 0.0f) d += v[i];
    }
  } else {
    for (int i = 0; i < n; ++i) {
      const float v = row[i];
      if (v != 0.0f) d += v;
    }
  }
  return d;
}

// The model's routing of a scored token: lane r < k gets slot r's expert id, weight and log-norm (other lanes
// (E, 0, 0)); the token remembers its routed slot. GENERIC as in score_token.
template <int EPL, bool GENERIC = true>
__device__ __forceinline__ void route_token(const SelectParams& p, Token<EPL>& s, int lane, int32_t& id,
                                            float& weight, float& log_norm) {
  uint32_t key[EPL];
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    key[j] = ((s.allowed >> j) & 1u) && lane * EPL + j < p.E ? cuda::ordered_bits(s.choice[j]) : 0u;
  }
  id = p.E;
  warp_top_k<EPL>(key, 0, p.k, lane, id);
  const float logit = expert_value<EPL>(s.logit, id);
  const float norm = expert_value<EPL>(s.log_norm, id);
  weight = slot_weight<EPL, GENERIC>(p, s, id, logit);
  log_norm = id < p.E ? norm : 0.0f;
  s.slot_id = id;
  s.slot_weight = weight;
}

// Backfill's per-warp shared scratch besides an E-float row (FillScratch): 32 group masks, 32 slots, 32 64-bit keys.
constexpr int kFillScratchWords = 128;

// Where backfill's slow path keeps the token's scores and keys: choice, E floats (the warp's score_token scratch row
// serves; it is free once the token is scored); words, kFillScratchWords and 8-byte aligned. Private to the warp.
struct FillScratch {
  float* choice;
  uint32_t* words;
};

// Backfill's top k over a short kept list (W <= 32, one kept expert per lane): lane r < k gets the expert of slot r
// (E past the kept ones). The order is warp_top_k's over the kept experts' choice scores, group-allowed experts first
// (grouped routing), ties to the lower expert: the token's choice scores and group masks go to the warp's shared
// scratch once, each lane counts the kept keys above its own by broadcast loads, and the lane with r keys above
// writes slot r. Shuffling each kept expert's score and electing each slot's holder by ballot rounds took 10-20%
// more cycles (benchmarks/micro/route_token.cu, H200, session 16: 2075 -> 1839 at W = 16, 1806 -> 1451 at W = 4).
template <int EPL>
__device__ __forceinline__ int32_t top_k_of_kept(const SelectParams& p, const Token<EPL>& s, const int* kept,
                                                 int lane, FillScratch scratch) {
  const int W = p.W, E = p.E;
  static_assert(kMaxExperts <= 1024, "the key packs 1023 - expert into 10 bits");
  uint32_t* allowed = scratch.words;
  int32_t* slot_expert = reinterpret_cast<int32_t*>(scratch.words + 32);
  uint64_t* keys = reinterpret_cast<uint64_t*>(scratch.words + 64);
  __syncwarp();  // earlier readers of the scratch are done
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int u = lane * EPL + j;
    if (u < E) scratch.choice[u] = s.choice[j];
  }
  allowed[lane] = s.allowed;
  const int u = lane < W ? kept[lane] : E;
  const bool valid = u < E;
  __syncwarp();
  const bool preferred = p.n_group <= 1 || (valid && ((allowed[holder_lane<EPL>(u)] >> (u % EPL)) & 1u) != 0);
  // (group tier, choice score, lower expert first): distinct and non-zero for every kept expert
  const uint64_t key = valid ? (static_cast<uint64_t>(preferred) << 42) |
                                   (static_cast<uint64_t>(cuda::ordered_bits(scratch.choice[u])) << 10) |
                                   static_cast<uint64_t>(1023 - u)
                             : 0u;
  if (lane < W) keys[lane] = key;
  if (lane < p.k) slot_expert[lane] = E;  // the slots past the kept experts stay empty (kept experts are distinct)
  __syncwarp();
  int above = 0;
#pragma unroll 4
  for (int m = 0; m < W; ++m) above += keys[m] > key ? 1 : 0;
  if (valid && above < p.k) slot_expert[above] = u;
  __syncwarp();
  return lane < p.k ? slot_expert[lane] : E;
}

// The token's final slots once the kept set is known (is_kept(u) for u < E; kept: the W kept experts in rank order,
// E past the last): lane r < k gets the expert id and weight of final slot `slot`. Backfill: the top k of the kept
// experts (group-allowed ones first), slot = lane; scratch serves its slow path over up to 32 kept experts. The drop
// fills: the routed slots whose expert is kept, in their order, then the sentinel (E, 0). GENERIC = false: also
// W <= 32 (score_token).
template <int EPL, bool GENERIC, typename IsKept>
__device__ __forceinline__ void fill_token(const SelectParams& p, const Token<EPL>& s, int lane, const int* kept,
                                           IsKept is_kept, FillScratch scratch, int& slot, int32_t& id,
                                           float& weight) {
  const int E = p.E, k = p.k;
  if (p.fill == static_cast<int>(Fill::kBackfill)) {
    slot = lane;
    // Every routed expert kept: the top k of the kept experts are the routed ones, in the same order, with the same
    // weights (the weight rule sees the same slots), so the second top-k can be skipped.
    if (__all_sync(kFullMask, lane >= k || (s.slot_id < E && is_kept(s.slot_id)))) {
      id = s.slot_id;
      weight = s.slot_weight;
      return;
    }
    if (!GENERIC || p.W <= 32) {
      id = top_k_of_kept<EPL>(p, s, kept, lane, scratch);
    } else {
      uint32_t preferred[EPL], other[EPL];
      const bool grouped = p.n_group > 1;
#pragma unroll
      for (int j = 0; j < EPL; ++j) {
        const int u = lane * EPL + j;
        const bool in_kept = u < E && is_kept(u);
        const bool allowed = (s.allowed >> j) & 1u;
        const uint32_t key = cuda::ordered_bits(s.choice[j]);
        preferred[j] = in_kept && (allowed || !grouped) ? key : 0u;
        other[j] = in_kept && grouped && !allowed ? key : 0u;
      }
      id = E;
      const int next = warp_top_k<EPL>(preferred, 0, k, lane, id);
      if (grouped && next < k) warp_top_k<EPL>(other, next, k, lane, id);
    }
    weight = slot_weight<EPL, GENERIC>(p, s, id, expert_value<EPL>(s.logit, id));
    return;
  }
  const bool in_slot = lane < k;
  const bool survives = in_slot && s.slot_id < E && is_kept(s.slot_id);
  const unsigned mask = __ballot_sync(kFullMask, survives);
  const float total = cuda::warp_sum(in_slot ? s.slot_weight : 0.0f);
  const float kept_total = cuda::warp_sum(survives ? s.slot_weight : 0.0f);
  const float scale = p.fill == static_cast<int>(Fill::kDropRenorm) ? drop_renorm_scale(total, kept_total) : 1.0f;
  const unsigned below = (1u << lane) - 1u;
  slot = survives ? __popc(mask & below) : __popc(mask) + __popc(~mask & below);
  id = survives ? s.slot_id : E;
  weight = survives ? drop_renormalised(s.slot_weight, scale, total, kept_total) : 0.0f;
}

}  // namespace routing_device
}  // namespace base_moe
