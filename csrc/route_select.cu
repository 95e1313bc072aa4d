// Stages 2 and 3 on CUDA: routing + cost reduction (route_cost), top-budget selection + fill (select_fill),
// and both fused (route_select). One kernel serves the three ops.
//
// Layout: one thread-block cluster per group (decode batch); its C CTAs (C <= 16) split the group's tokens,
// one warp per token at a time (a "chunk" is C * NW consecutive tokens). Per token, a warp holds the E scores
// in registers (lane l owns experts [l * EPL, (l + 1) * EPL)), and picks the top k with k rounds of a hardware
// warp max (redux.sync) over order-preserving 32-bit keys; equal scores go to the lowest lane, and within a
// lane to the lowest register, i.e. to the lower expert index, as in the reference.
//
// The batch cost D[g, u] must equal the reference's sequential fp32 sum in token order, bit for bit. CTA r owns experts
// [r * EPC, (r + 1) * EPC): each token warp stores its slots' costs and routed flags straight into their owners' shared
// memory (distributed shared memory; one row per owned expert, one column per token of the chunk), and after a cluster
// barrier one warp per owned expert (one thread, where a chunk has at most 32 tokens) adds its row's non-zero costs in
// token order (zeros add nothing) to the expert's running D. Each owner then pushes its experts' ranking keys into
// every CTA's shared memory (st.async, counted by the receiver's mbarrier: cuda::inbox_push), and every CTA ranks every
// candidate expert against all others (D descending, index ascending) in parallel once its E keys are in; the fill
// rules run per token again; per-expert counts are integer atomics in global memory (their sum does not depend on the
// order). After the last chunk's barrier no CTA reads or writes another's shared memory except through the inbox, whose
// owner waits for it, so no barrier is needed before exit.
// route_select on one chunk of up to 32 tokens, or of 256 or more experts (Plan::kBroadcast, broadcast_wins) exchanges
// less: each token warp pushes its k slot records (expert, cost) into every CTA's inbox (cuda::inbox_push, 8 bytes),
// and every CTA, once all B k records are in, scatters them into an [E][tokens] table and adds each expert's row in
// token order itself (every CTA the same values in the same order: the same bits). No cluster barrier after the
// routing, no owners' sums, no key exchange.
// With voting flags (a finished sequence's pad tokens do not vote), a non-voting token's slots add no cost and set no
// flag, so its experts are no candidates, and TOP1_UNION's offset counts the voting tokens; it is still filled.
// No float atomics, no host synchronisation, fixed output shapes.
// The op wrappers (argument checks, outputs, registration) are in csrc/select_cuda.cpp.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "base_moe/cuda_utils.cuh"
#include "base_moe/launch.cuh"
#include "base_moe/routing.h"
#include "base_moe/routing_device.cuh"
#include "base_moe/select_kernels.h"

namespace base_moe {
namespace {

using cuda::kFullMask;
using namespace routing_device;

constexpr int kMaxCluster = 16;  // CTAs per group (the non-portable cluster size; 8 where the device lacks it)

struct SharedLayout {
  // Offsets in 4-byte words into dynamic shared memory.
  int rows, scratch, records, own, own_flags, own_cost, kept_flag, cost_key, kept, inbox, total;
};

// How an instance exchanges the batch costs (each instance carries one plan's code).
enum class Plan {
  kChunks,     // any number of chunks: slot costs to the experts' owners, their sums' ranking keys to every CTA
  kOneChunk,   // the same, where the launcher guarantees one chunk of more than 32 tokens
  kBroadcast,  // route_select on one chunk: every slot's record to every CTA, which sums every expert itself
};

// Which routing code an instance carries: softmax without a group limit at budgets up to 32, without (kSoftmax) or with
// (kSoftmaxVoting) the voting flags' code, or every scoring mode, group limit and budget with the flags' code (kGeneric:
// needs_generic_routing) for sigmoid scoring and softmax without a selection bias or group limit, or the same code for
// softmax with one of those (kSoftmaxBiasOrGroups: needs_softmax_bias_or_groups, score_token's
// SOFTMAX_BIAS_OR_GROUPS).
enum class Variant { kSoftmax, kSoftmaxVoting, kGeneric, kSoftmaxBiasOrGroups };

// The ranking reads the keys 16 bytes at a time: ceil(E / 4) of them, the keys past E zero (no candidate).
__host__ __device__ inline int key_quads(int E) {
  return (E + 3) / 4;
}

// The row stride of the owned experts' slot costs: one more than a chunk's tokens, odd (NW is even), so that the
// threads of a warp reading one row each (thread_add_nonzero_in_order) hit distinct banks.
__host__ __device__ inline int own_stride(int cluster, int NW) {
  return cluster * NW + 1;
}

// table_rows: the experts whose slot costs the CTA adds up (its owned experts; every expert for kBroadcast); records:
// the 8-byte slot records it receives (kBroadcast: the chunk's C NW k; 0 otherwise).
__host__ __device__ inline SharedLayout shared_layout(int NW, int E, int W, int cluster, int table_rows, int n_group,
                                                      int records) {
  SharedLayout s{};
  int at = 0;
  s.rows = at;  // per warp an E-float row: score_token's scratch for the group limit, the fill's choice scores
  at += NW * E;
  s.scratch = at + (at & 1);  // per warp the group scores and the fill's words (8-byte aligned: 8-byte keys)
  at = s.scratch + NW * (2 * n_group + kFillScratchWords);
  s.records = at;  // (at is even) [C * NW][k] (expert, cost bits), pushed by the tokens' warps
  at += 2 * records;
  s.own = (at + 3) & ~3;  // slot costs, one row of C * NW tokens (the chunk) per expert; 16-byte aligned
  at = s.own + (table_rows * own_stride(cluster, NW) + 3) / 4 * 4;  // (whole quads: kBroadcast zeroes them as such)
  s.own_flags = at;  // per expert of the table: bit 0 routed by some token of the group, bit 1 some token's top-1
  at += table_rows;
  s.own_cost = at;  // per owned expert: D over the chunks so far
  at += table_rows;
  s.kept_flag = at;  // per expert: kept
  at += E;
  s.cost_key = (at + 3) & ~3;  // per expert: the ranking key its owner pushed; 16-byte aligned, 0 past E (quads)
  at = s.cost_key + key_quads(E) * 4;
  s.kept = at;
  at += W;
  s.inbox = at + (at & 1);  // the mbarrier counting the pushed keys (8 bytes)
  s.total = s.inbox + 2;
  return s;
}

// Loads token t's logits (and, for the BASE cost, its log-norms) from global memory.
template <int EPL>
__device__ __forceinline__ void load_token(const SelectParams& p, int64_t t, int lane, Token<EPL>& s) {
  const int E = p.E;
  const float* row = p.logits + t * E;
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int u = lane * EPL + j;
    s.logit[j] = u < E ? row[u] : 0.0f;
  }
  const bool base_cost = p.compute_cost && p.cost == Cost::kBase;
  const float* g = base_cost ? p.log_norms + t * p.ln_stride : nullptr;
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int u = lane * EPL + j;
    s.log_norm[j] = base_cost && u < E ? g[u] : 0.0f;
  }
}

// Plan::kBroadcast: the group's n = B k slot records (record i: token i / k, slot i % k) into the [E][stride] cost
// table (a column per token) and the experts' flags (bit 0 routed, bit 1 some token's top-1), a thread per record. The
// thread's first (token, slot) and its step per `threads` records come from before the PDL wait (no division after it).
__device__ __forceinline__ void scatter_records(const uint2* records, int n, int k, int E, int stride, float* table,
                                                int* flags, int token, int slot, int step_tokens, int step_slots,
                                                int threads) {
  for (int i = static_cast<int>(threadIdx.x); i < n; i += threads) {
    const uint2 record = records[i];
    const int u = static_cast<int>(record.x);
    if (u < E) {
      table[u * stride + token] = __uint_as_float(record.y);
      atomicOr(flags + u, slot == 0 ? 3 : 1);
    }
    token += step_tokens;
    slot += step_slots;
    if (slot >= k) {
      slot -= k;
      ++token;
    }
  }
}

// Plan::kBroadcast: D of every expert, a thread per expert adding its row's non-zero costs in token order (the
// reference's sequential fp32 sum, bit for bit; 16 loads issued ahead of their adds), plus TOP1_UNION's offset
// (top1); its ranking key (0 where no token routed to it) and, where batch_cost is given (CTA 0), D.
__device__ __forceinline__ void sum_every_expert(const SelectParams& p, const float* table, int stride,
                                                 const int* flags, float top1, uint32_t* cost_key, float* batch_cost,
                                                 int threads) {
  for (int u = static_cast<int>(threadIdx.x); u < p.E; u += threads) {
    const float* row = table + u * stride;
    float d = 0.0f;
#pragma unroll 1
    for (int first = 0; first < p.B; first += 16) {
      d = thread_add_nonzero_in_order<16>(d, row + first, min(16, p.B - first));
    }
    const int f = flags[u];
    d = with_top1_offset(p, d, f, top1);
    if (batch_cost != nullptr) batch_cost[u] = d;
    cost_key[u] = (f & 1) ? candidate_key(d) : 0u;
  }
}

// TOP1_UNION's offset for the group of tokens [first_token, first_token + B): B tokens' where every token votes, else
// its voting tokens' (counted by the whole CTA, a barrier per kThreads tokens; each CTA of the cluster counts the
// same). Called by every thread of the CTA, after the PDL wait (the flags may come from the previous kernel).
template <int kThreads, bool VOTING>
__device__ __forceinline__ float group_top1_offset(const SelectParams& p, int64_t first_token) {
  if (!VOTING || p.voting == nullptr || p.cost != Cost::kTop1Union || !p.compute_cost) return p.top1_offset;
  int voters = 0;
  for (int first = 0; first < p.B; first += kThreads) {
    const int i = first + static_cast<int>(threadIdx.x);
    voters += __syncthreads_count(i < p.B && p.voting[first_token + i]);
  }
  return top1_offset(voters, p.k, p.top1_scale);
}

// Variant::kSoftmax(Voting): softmax routing without a group limit at budgets up to 32 (score_token), whose instances
// leave the other modes' code out (Qwen3's instance 4728 -> 3032 SASS instructions; route_select alone at Qwen3's T = 1
// / 16 / 64 / 256 4.84 / 6.80 / 7.74 / 9.51 -> 4.64 / 6.18 / 6.97 / 8.60 us, the two-kernel selection at T = 256 15.63
// -> 14.73; the generic instances' SASS is unchanged; device_runs/session47.txt, call 3). kSoftmax also leaves the
// voting flags' code out (it cost route_select alone up to 0.2 us: device_runs/session70.txt), and a softmax call with
// flags takes kSoftmaxVoting rather than the generic instance (~1 us more per Qwen3 block, same record).
// Plan::kOneChunk: the launcher guarantees one chunk of more than 32 tokens (B <= C * NW, C * NW > 32: a T = 256 decode
// batch on 16 CTAs), and the instance leaves the other chunk shapes' code out (Qwen3's T = 256 instance 3264 -> 2728
// SASS instructions; route_select alone at T = 64 / 256 6.80 / 7.47 -> 6.52 / 7.01 us; device_runs/session48.txt,
// call 1). Plan::kBroadcast: route_select (costs and selection) on one chunk, each CTA routing at least one token.
template <int EPL, int NW, Variant V, Plan kPlan>
__global__ void __launch_bounds__(NW * 32, 1) route_select_kernel(const SelectParams p) {
  static_assert(NW % 2 == 0, "own_stride is odd only for an even NW");
  constexpr bool SOFTMAX_BIAS_OR_GROUPS = V == Variant::kSoftmaxBiasOrGroups;
  constexpr bool GENERIC = V == Variant::kGeneric || SOFTMAX_BIAS_OR_GROUPS, VOTING = V != Variant::kSoftmax;
  constexpr bool kBroadcast = kPlan == Plan::kBroadcast;
  extern __shared__ __align__(16) float smem[];
  const int E = p.E, k = p.k, B = p.B, C = p.cluster, EPC = p.experts_per_cta;
  const int per_chunk = C * NW, stride = own_stride(C, NW);
  const int table_rows = kBroadcast ? E : EPC;
  const SharedLayout L = shared_layout(NW, E, p.W, C, table_rows, p.n_group, kBroadcast ? per_chunk * k : 0);
  float* rows = smem + L.rows;
  uint2* records = reinterpret_cast<uint2*>(smem + L.records);
  float* scratch = smem + L.scratch;
  float* own = smem + L.own;
  int* own_flags = reinterpret_cast<int*>(smem + L.own_flags);
  float* own_cost = smem + L.own_cost;
  int* kept_flag = reinterpret_cast<int*>(smem + L.kept_flag);
  uint32_t* cost_key = reinterpret_cast<uint32_t*>(smem + L.cost_key);
  int* kept = reinterpret_cast<int*>(smem + L.kept);
  uint64_t* inbox = reinterpret_cast<uint64_t*>(smem + L.inbox);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int kThreads = NW * 32;
  const unsigned rank = cuda::cluster_rank();
  const int group = blockIdx.x / C;
  const int first_owned = static_cast<int>(rank) * EPC;
  const int owned = max(0, min(EPC, E - first_owned));  // this CTA's experts: [first_owned, first_owned + owned)
  const int64_t first_token = static_cast<int64_t>(group) * B;
  const int column = static_cast<int>(rank) * NW + warp;  // this warp's token in each chunk
  float* my_row = rows + warp * E;
  float* my_group_scratch = scratch + warp * 2 * p.n_group;
  float* my_fill_words = scratch + NW * 2 * p.n_group + warp * kFillScratchWords;  // 8-byte aligned

  cuda::pdl_launch_dependents();
  if constexpr (kBroadcast) {  // every expert's row (up to ~150 KB: 16-byte stores)
    float4* table = reinterpret_cast<float4*>(own);
    for (int i = tid; i < (E * stride + 3) / 4; i += kThreads) table[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  } else if (p.compute_cost) {
    for (int i = tid; i < owned * stride; i += kThreads) own[i] = 0.0f;
  }
  for (int e = tid; e < (kBroadcast ? E : owned); e += kThreads) {
    own_flags[e] = 0;
    own_cost[e] = 0.0f;
  }
  for (int u = tid; u < E; u += kThreads) kept_flag[u] = 0;
  for (int u = E + tid; u < key_quads(E) * 4; u += kThreads) cost_key[u] = 0u;  // no owner pushes these
  for (int i = tid; i < p.W; i += kThreads) kept[i] = E;
  if (p.select) cuda::inbox_init(inbox, tid == 0);
  // Arithmetic that needs no input, done while the previous kernel finishes: each division here would be a
  // ~20-instruction chain after the wait (the chunk count, the first key push's cell, the ranking's geometry).
  const int chunks = kPlan != Plan::kChunks ? 1 : (B + per_chunk - 1) / per_chunk;
  // EPC is a power of two (owned_experts_per_cta): its shift by __ffs here, not from a params field, which measured
  // slower (device_runs/session45.txt and session44.txt, call 1 each).
  const int owner_shift = __ffs(EPC) - 1;
  const int receivers = p.select ? C : 1;
  const int push_expert = tid / receivers, push_receiver = tid - push_expert * receivers;
  int tpe = 1;  // ranking: threads per expert (a power of two, within a warp)
  while (tpe < 32 && tpe * 2 * E <= kThreads) tpe *= 2;
  const int tpe_shift = __ffs(tpe) - 1, experts_per_pass = kThreads >> tpe_shift;
  const int rank_passes = (E + experts_per_pass - 1) / experts_per_pass;
  // kBroadcast: the first record (token, slot) this thread scatters, and how far kThreads records move it
  const int scatter_token = tid / k, scatter_slot = tid - scatter_token * k;
  const int step_tokens = kThreads / k, step_slots = kThreads - step_tokens * k;
  // Every CTA's zeros and inbox before any other CTA's slot costs, flags and keys arrive: the barrier's arrive (a
  // release) before the PDL wait, so its cost overlaps the previous kernel, the wait after it.
  cuda::cluster_arrive();
  cuda::pdl_wait();  // the logits come from the previous kernel (and the one before may still read the counts)
  cuda::cluster_wait();
  // every key from its owner, or (kBroadcast) every token's k slot records
  const uint32_t inbox_bytes = kBroadcast ? 8u * static_cast<uint32_t>(B * k) : 4u * static_cast<uint32_t>(E);
  if (p.select) cuda::inbox_expect(inbox, inbox_bytes, tid == 0);
  int* group_counts = p.select ? p.counts + static_cast<int64_t>(group) * E : nullptr;  // (route_cost: none)
  if (p.select) {  // the cluster barriers before the fill order these zeros before every CTA's counts
    for (int e = tid; e < owned; e += kThreads) group_counts[first_owned + e] = 0;
  }
  // kBroadcast has no cluster barrier before the fill: the zeros come before this CTA's pushes (this barrier), whose
  // complete_tx releases them to every receiver's inbox wait (an acquire); every CTA routes a token, so pushes to all.
  if constexpr (kBroadcast) __syncthreads();
  const float top1 = group_top1_offset<kThreads, VOTING>(p, first_token);

  const bool single_chunk = chunks <= 1;
  const bool base_cost = p.cost == Cost::kBase;
  Token<EPL> s;

  // ---- routing; slot costs and flags to their owners, who add the costs up chunk by chunk ----
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const int local = chunk * per_chunk + column;
    if (local < B) {
      const int64_t t = first_token + local;
      const bool votes = !VOTING || p.voting == nullptr || p.voting[t];  // a non-voting token: no cost, no candidate
      load_token<EPL>(p, t, lane, s);
      score_token<EPL, GENERIC, SOFTMAX_BIAS_OR_GROUPS>(p, lane, my_row, my_group_scratch, s);
      float w, log_norm;
      int32_t id;
      route_token<EPL, GENERIC>(p, s, lane, id, w, log_norm);
      if constexpr (kBroadcast) {  // the slot's record (expert, cost) into every CTA's inbox, at the token's cell
        const float cost =
            id < E ? slot_cost(p.cost, w, base_cost ? log_norm : 0.0f) : 0.0f;
        if (lane < k) {
          uint2* cell = records + column * k + lane;
#pragma unroll 1
          for (int receiver = 0; receiver < C; ++receiver) {
            cuda::inbox_push(cell, static_cast<unsigned>(receiver),
                             make_uint2(static_cast<uint32_t>(votes ? id : E), __float_as_uint(cost)), inbox);
          }
        }
      } else if (id < E && votes) {
        const unsigned owner = static_cast<unsigned>(id >> owner_shift);
        const int e = id & (EPC - 1);
        if (p.compute_cost) {
          cuda::cluster_map(own, owner)[e * stride + column] =
              slot_cost(p.cost, w, base_cost ? log_norm : 0.0f);
        }
        atomicOr(cuda::cluster_map(own_flags, owner) + e, lane == 0 ? 3 : 1);
      }
      if (lane < k) {
        p.ids[t * k + lane] = id;  // final output of route_cost; scratch for the fill otherwise
        p.weights[t * k + lane] = w;
      }
    }
    if (kBroadcast) break;  // one chunk, summed below
    if (!p.compute_cost && chunk + 1 < chunks) continue;  // the flags only need the last chunk's barrier
    cuda::cluster_sync();  // the chunk's slot costs and flags are at their owners
    if (!p.compute_cost) continue;
    if (kPlan == Plan::kChunks && per_chunk <= 32) {
      // Few tokens per chunk, many owned experts (up to all E at C = 1): a thread per expert, not a warp.
      for (int e = tid; e < owned; e += kThreads) {
        float* row = own + e * stride;
        own_cost[e] = thread_add_nonzero_in_order(own_cost[e], row, per_chunk);
        if (chunk + 1 < chunks) {
          for (int i = 0; i < per_chunk; ++i) row[i] = 0.0f;
        }
      }
    } else {
      for (int e = warp; e < owned; e += NW) {
        float* row = own + e * stride;
        const float d = warp_add_nonzero_in_order<kMaxCluster * NW / 32>(own_cost[e], row, per_chunk, lane);
        // every lane has read the row (every lane adds all its values) and own_cost[e] (the sum's start) before any
        // lane clears the row or lane 0 overwrites own_cost[e]
        __syncwarp();
        if (chunk + 1 < chunks) {
          for (int i = lane; i < per_chunk; i += 32) row[i] = 0.0f;
        }
        if (lane == 0) own_cost[e] = d;
      }
    }
    if (chunk + 1 < chunks) cuda::cluster_sync();  // the rows are cleared before the next chunk's costs arrive
  }

  if constexpr (kBroadcast) {
    cuda::inbox_wait(inbox);  // every token's k records
    scatter_records(records, B * k, k, E, stride, own, own_flags, scatter_token, scatter_slot, step_tokens,
                    step_slots, kThreads);
    __syncthreads();
    float* batch_cost = rank == 0 ? p.batch_cost_out + static_cast<int64_t>(group) * E : nullptr;
    sum_every_expert(p, own, stride, own_flags, top1, cost_key, batch_cost, kThreads);
    __syncthreads();
  } else {
    __syncthreads();  // the last own_cost writes before other threads read them

    // ---- the owned experts' batch costs; their ranking keys to every CTA, a thread per (expert, receiving CTA) ----
    // (the first cell comes from before the wait; a plain for loop dividing only past it left Qwen3 unchanged and made
    // DeepSeek 0.1-0.45 us slower: device_runs/session45.txt, call 1)
    for (int i = tid, e = push_expert, receiver = push_receiver; i < owned * receivers;) {
      const int u = first_owned + e, f = own_flags[e];
      float d;
      if (p.compute_cost) {
        d = with_top1_offset(p, own_cost[e], f, top1);
        if (receiver == 0) p.batch_cost_out[static_cast<int64_t>(group) * E + u] = d;
      } else {
        d = p.batch_cost_in[static_cast<int64_t>(group) * E + u];
      }
      // D as order-preserving integer keys, 0 for non-candidates: integer compares give every candidate a distinct
      // rank even for NaN costs, where float compares would give them all rank 0 and collide in kept[0] (NaN ranks
      // first, as in torch.sort; the CPU op rejects non-finite logits).
      if (p.select) {
        cuda::inbox_push(cost_key + u, static_cast<unsigned>(receiver), (f & 1) ? candidate_key(d) : 0u, inbox);
      }
      i += kThreads;
      if (i >= owned * receivers) break;
      e = i / receivers;
      receiver = i - e * receivers;
    }
    if (!p.select) return;
    cuda::inbox_wait(inbox);
  }

  // ---- top-budget selection: rank each candidate against all (D descending, index ascending) ----
  {
    const int sub = tid & (tpe - 1);
    for (int pass = 0; pass < rank_passes; ++pass) {
      const int u = pass * experts_per_pass + (tid >> tpe_shift);
      const uint32_t du = u < E ? cost_key[u] : 0u;
      const bool cand = du != 0u;  // candidate_key is never 0
      int r = 0;
      if (cand) {
        // the keys 4 at a time, the tpe threads of an expert on consecutive quads (distinct banks); a non-candidate's
        // key 0 (and the zeros past E) is below every candidate's
        const uint4* quads = reinterpret_cast<const uint4*>(cost_key);
        for (int q = sub; q < key_quads(E); q += tpe) {
          const uint4 dv = quads[q];
          const int v = 4 * q;
          r += (dv.x > du || (dv.x == du && v < u)) ? 1 : 0;
          r += (dv.y > du || (dv.y == du && v + 1 < u)) ? 1 : 0;
          r += (dv.z > du || (dv.z == du && v + 2 < u)) ? 1 : 0;
          r += (dv.w > du || (dv.w == du && v + 3 < u)) ? 1 : 0;
        }
      }
      for (int o = tpe / 2; o > 0; o >>= 1) r += __shfl_xor_sync(kFullMask, r, o);
      if (cand && sub == 0 && r < p.W) kept[r] = u;
    }
  }
  __syncthreads();
  for (int i = tid; i < p.W; i += kThreads) {
    if (kept[i] < E) kept_flag[kept[i]] = 1;
    if (rank == 0) p.kept[static_cast<int64_t>(group) * p.W + i] = kept[i];
  }
  __syncthreads();

  // ---- fill ----
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const int local = chunk * per_chunk + column;
    if (local >= B) continue;
    const int64_t t = first_token + local;
    if (!single_chunk) {
      load_token<EPL>(p, t, lane, s);
      score_token<EPL, GENERIC, SOFTMAX_BIAS_OR_GROUPS>(p, lane, my_row, my_group_scratch, s);
      s.slot_id = lane < k ? p.ids[t * k + lane] : E;
      s.slot_weight = lane < k ? p.weights[t * k + lane] : 0.0f;
      __syncwarp();  // every lane has read its routed slot before any lane overwrites it
    }
    int slot;
    int32_t id;
    float w;
    const FillScratch fill_scratch{my_row, reinterpret_cast<uint32_t*>(my_fill_words)};
    fill_token<EPL, GENERIC>(p, s, lane, kept, [&](int u) { return kept_flag[u] != 0; }, fill_scratch, slot, id, w);
    if (lane < k) {
      p.ids[t * k + slot] = id;
      p.weights[t * k + slot] = w;
      if (id < E) atomicAdd(group_counts + id, 1);
    }
  }
}

// Dynamic shared memory of a launch of `plan` on clusters of C CTAs.
size_t select_smem(const SelectParams& p, int NW, int C, Plan plan = Plan::kChunks) {
  const bool broadcast = plan == Plan::kBroadcast;
  const int table_rows = broadcast ? p.E : owned_experts_per_cta(p.E, C);
  return static_cast<size_t>(
             shared_layout(NW, p.E, p.W, C, table_rows, p.n_group, broadcast ? C * NW * p.k : 0).total) *
         4;
}

// Plan::kBroadcast keeps every expert's row of the chunk's slot costs in every CTA: at most this much shared memory
// (E 256 at 128 tokens takes ~166 KB); larger tables keep the owners' exchange.
constexpr size_t kMaxBroadcastSmem = 176 * 1024;

// Where kBroadcast beats the owners' exchange: every CTA adds a B-long chain per expert (a thread per expert) where the
// owners add only the non-zero costs of their few experts, so it pays off for short batches, and for many experts,
// whose keys the owners' exchange pushes to every CTA. route_select alone, H200, us, owners -> kBroadcast everywhere
// it fits (device_runs/session51.txt, call 2): Qwen3 shape (E 128) at T = 16 / 64 / 128 / 256 5.44 / 5.39 / 6.47 /
// 6.99 -> 4.64 / 5.51 / 6.76 / 8.44, DeepSeek-like (E 256) at T = 16 / 64 / 128 11.85 / 12.52 / 15.79 -> 11.13 / 12.29
// / 15.45. With this rule (call 3), Qwen3 at T = 1 / 4 / 16 / 32: 4.64 / 5.46 / 5.44 / 5.87 (session 48) -> 3.59 /
// 4.38 / 4.63 / 4.99 (the two-kernel selection behind our norm at T = 1 / 4 / 16 7.39 / 8.26 / 9.15 -> 6.33 / 7.43 /
// 8.22).
bool broadcast_wins(const SelectParams& p) {
  return p.B <= 32 || p.E >= 256;
}

size_t broadcast_smem_limit(int device) {
  return std::min(kMaxBroadcastSmem, at::cuda::getDeviceProperties(device)->sharedMemPerBlockOptin);
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t smem) {
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
}

// The largest cluster an instance may use: 16 CTAs where the device co-schedules them, else the portable 8. Asked once
// per device with the first call's shared memory: every shape needs at most ~59 KB per CTA (E 256 at C 15, where the
// owned experts' power of two rounds 18 up to 32; ~92 KB with as many groups as experts), far below an SM's, so
// whether 16 CTAs fit depends on the device's GPCs, not on the call, and the answer holds for every call.
// Plan::kBroadcast instances take up to broadcast_smem_limit and are asked with it.
template <int EPL, int NW, Variant V, Plan kPlan>
int max_select_cluster(size_t smem, int device) {
  static std::atomic<int> memo[cuda::kMaxDevices];
  return cuda::once_per_device(memo, device, 8, [&] {
    auto kernel = route_select_kernel<EPL, NW, V, kPlan>;
    allow_smem(kernel, smem);
    return cuda::cluster_fits(kernel, kMaxCluster, NW * 32, smem) ? kMaxCluster : 8;
  });
}

// C is final here: for C > 8 the caller has asked this instance's max_select_cluster, which also allows its
// non-portable cluster size.
template <int EPL, int NW, Variant V, Plan kPlan>
void launch_instance(SelectParams p, int groups, int C, bool clusters, int device, cudaStream_t stream) {
  p.cluster = C;
  p.experts_per_cta = owned_experts_per_cta(p.E, C);
  const size_t smem = select_smem(p, NW, C, kPlan);
  auto kernel = route_select_kernel<EPL, NW, V, kPlan>;
  allow_smem(kernel, smem);
  cuda::launch({dim3(groups * C), dim3(NW * 32), smem, stream, clusters ? C : 0, clusters && cuda::selection_pdl()},
               kernel, p);
}

// CTAs per group on CTAs of NW warps: one token per warp per chunk, as many CTAs as the group's tokens need (routing
// and fill are issue-bound, so 16 warps per SM on 16 SMs beat 32 on 8: Qwen3 shape, T = 256, 26.1 -> 23.1 us, session
// 39), within the device's cluster limit.
template <int EPL, int NW, Variant V>
int select_cluster(const SelectParams& p, bool clusters, int device) {
  const int C = clusters ? std::clamp((p.B + NW - 1) / NW, 1, kMaxCluster) : 1;
  return C > 8 ? std::min(C, max_select_cluster<EPL, NW, V, Plan::kChunks>(select_smem(p, NW, C), device)) : C;
}

template <int EPL, int NW, Variant V>
void launch_select(SelectParams p, int groups, bool clusters, int device, cudaStream_t stream) {
  const int C = select_cluster<EPL, NW, V>(p, clusters, device);
  // The one-chunk instances only where their own cluster limit also holds C (they route tokens [0, C * NW) only).
  // One chunk means C = ceil(B / NW) (no cluster limit cut it), so every CTA routes a token, as kBroadcast needs.
  const bool one_chunk = p.B <= C * NW;
  const size_t broadcast_limit = broadcast_smem_limit(device);
  if (one_chunk && p.compute_cost && p.select && broadcast_wins(p) &&
      select_smem(p, NW, C, Plan::kBroadcast) <= broadcast_limit &&
      (C <= 8 || max_select_cluster<EPL, NW, V, Plan::kBroadcast>(broadcast_limit, device) >= C)) {
    launch_instance<EPL, NW, V, Plan::kBroadcast>(p, groups, C, clusters, device, stream);
  } else if (one_chunk && C * NW > 32 &&
             (C <= 8 || max_select_cluster<EPL, NW, V, Plan::kOneChunk>(select_smem(p, NW, C), device) >= C)) {
    launch_instance<EPL, NW, V, Plan::kOneChunk>(p, groups, C, clusters, device, stream);
  } else {
    launch_instance<EPL, NW, V, Plan::kChunks>(p, groups, C, clusters, device, stream);
  }
}

// Whether CTAs of NW warps hold the whole batch in one pass on a cluster this device allows.
template <int EPL, int NW, Variant V>
bool one_pass(const SelectParams& p, bool clusters, int device) {
  return clusters && p.B <= kMaxCluster * NW && p.B <= select_cluster<EPL, NW, V>(p, clusters, device) * NW;
}

// Batches of more than 8 tokens with E 65-256 run on CTAs of the fewest warps (4, else 8) that hold the batch in one
// pass, one token per warp, so that the routing and the fill, issue-bound per SM, spread over up to 16 SMs instead of
// 1-8, and the cost sums over the owned experts of more CTAs (route_select alone, us, 16 warps -> 4: Qwen3 shape at
// T = 16 / 32 / 64 6.10 / 6.45 / 6.51 -> 5.44 / 5.87 / 5.38, DeepSeek-like 15.00 / 15.20 / 16.21 -> 11.84 / 12.01 /
// 12.52; the selection at Qwen3's T = 64 11.79 -> 10.68; 16 -> 8 warps at T = 128: 6.46 -> 5.71 and 15.74 -> 12.87).
// Up to 4 tokens the batch is on one CTA either way: 4 warps lost there for DeepSeek-like (T = 1 / 4 8.66 / 10.63 ->
// 10.19 / 11.88), gained 0.1-0.2 us for Qwen3; device_runs/session48.txt, call 4 (5-8 tokens, two CTAs, not
// measured: they keep 16 warps).
template <int EPL, Variant V>
void launch_by_tokens(const SelectParams& p, int groups, bool clusters, int device, cudaStream_t stream) {
  if (p.B > 8 && one_pass<EPL, 4, V>(p, clusters, device)) {
    launch_select<EPL, 4, V>(p, groups, clusters, device, stream);
  } else if (p.B > 8 && one_pass<EPL, 8, V>(p, clusters, device)) {
    launch_select<EPL, 8, V>(p, groups, clusters, device, stream);
  } else {
    launch_select<EPL, 16, V>(p, groups, clusters, device, stream);
  }
}

// One instance per (experts per lane, variant), and for E 65-256 one per warps per CTA.
template <Variant V>
void launch_by_experts(const SelectParams& p, int groups, bool clusters, int device, cudaStream_t stream) {
  const int epl = (p.E + 31) / 32;
  if (epl <= 1) {
    launch_select<1, 16, V>(p, groups, clusters, device, stream);
  } else if (epl <= 2) {
    launch_select<2, 16, V>(p, groups, clusters, device, stream);
  } else if (epl <= 4) {
    launch_by_tokens<4, V>(p, groups, clusters, device, stream);
  } else if (epl <= 8) {
    launch_by_tokens<8, V>(p, groups, clusters, device, stream);
  } else {
    launch_select<16, 8, V>(p, groups, clusters, device, stream);
  }
}

}  // namespace

void route_select_launch(SelectParams p, int groups, int device) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  const bool clusters = cuda::device_has_clusters(device);
  if (needs_softmax_bias_or_groups(p)) {
    launch_by_experts<Variant::kSoftmaxBiasOrGroups>(p, groups, clusters, device, stream);
  } else if (needs_generic_routing(p)) {
    launch_by_experts<Variant::kGeneric>(p, groups, clusters, device, stream);
  } else if (p.voting != nullptr) {
    launch_by_experts<Variant::kSoftmaxVoting>(p, groups, clusters, device, stream);
  } else {
    launch_by_experts<Variant::kSoftmax>(p, groups, clusters, device, stream);
  }
}

}  // namespace base_moe
