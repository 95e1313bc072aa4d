// Stages 2 and 3 on CUDA: routing + cost reduction (route_cost), top-budget selection + fill (select_fill),
// and both fused (route_select). One kernel serves the three ops.
//
// Layout: one thread-block cluster per group (decode batch); its C CTAs (C <= 16) split the group's tokens,
// one warp per token at a time (a "chunk" is C * NW consecutive tokens). Per token, a warp holds the E scores
// in registers (lane l owns experts [l * EPL, (l + 1) * EPL)), and picks the top k with k rounds of a hardware
// warp max (redux.sync) over order-preserving 32-bit keys; equal scores go to the lowest lane, and within a
// lane to the lowest register, i.e. to the lower expert index, as in the reference.
//
// The batch cost D[g, u] must equal the reference's sequential fp32 sum in token order, bit for bit. Each warp
// writes its token's slot costs into a dense row [E] in shared memory; after a cluster barrier, CTA r owns
// experts [r * EPC, (r + 1) * EPC), copies the chunk's rows for them out of every CTA's shared memory
// (distributed shared memory), and one thread per expert adds them in token order to a register accumulator.
// Top-budget selection ranks every candidate expert against all others (D descending, index ascending) in
// parallel; the fill rules run per token again; per-expert counts are summed over the cluster in rank order.
// No float atomics, no host synchronisation, fixed output shapes.
// The op wrappers (argument checks, outputs, registration) are in csrc/select_cuda.cpp.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>

#include "base_moe/cuda_utils.cuh"
#include "base_moe/launch.cuh"
#include "base_moe/routing.h"
#include "base_moe/routing_device.cuh"
#include "base_moe/select_kernels.h"

namespace base_moe {
namespace {

using cuda::kFullMask;
using namespace routing_device;

struct SharedLayout {
  // Offsets in 4-byte words into dynamic shared memory.
  int dense, scratch, flags, state, counts, batch_cost, cost_key, kept, total;
};

__host__ __device__ inline SharedLayout shared_layout(int NW, int E, int W, int cluster, int experts_per_cta,
                                                      int n_group) {
  SharedLayout s{};
  int at = 0;
  s.dense = at;
  at += NW * E;
  // copy buffer of the D reduction, or per warp the group scores of the group limit and the fill's scratch words
  // (never both at once)
  s.scratch = at + (at & 1);  // 8-byte aligned: the fill's words hold 8-byte keys
  at = s.scratch + max(cluster * NW * experts_per_cta, NW * (2 * n_group + kFillScratchWords));
  s.flags = at;  // per expert: bit 0 routed by some token of this CTA, bit 1 some token's top-1
  at += E;
  s.state = at;  // per expert: bit 0 routed in the group (candidate), bit 1 kept
  at += E;
  s.counts = at;
  at += E;
  s.batch_cost = at;
  at += E;
  s.cost_key = at;  // batch_cost as ordered integer keys, for the ranking
  at += E;
  s.kept = at;
  at += W;
  s.total = at;
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
  const bool base_cost = p.compute_cost && p.cost == static_cast<int>(Cost::kBase);
  const float* g = base_cost ? p.log_norms + t * p.ln_stride : nullptr;
#pragma unroll
  for (int j = 0; j < EPL; ++j) {
    const int u = lane * EPL + j;
    s.log_norm[j] = base_cost && u < E ? g[u] : 0.0f;
  }
}

template <int EPL, int NW>
__global__ void __launch_bounds__(NW * 32, 1) route_select_kernel(const SelectParams p) {
  extern __shared__ __align__(16) float smem[];
  const int E = p.E, k = p.k, B = p.B, C = p.cluster, EPC = p.experts_per_cta;
  const SharedLayout L = shared_layout(NW, E, p.W, C, EPC, p.n_group);
  float* dense = smem + L.dense;
  float* scratch = smem + L.scratch;
  int* flags = reinterpret_cast<int*>(smem + L.flags);
  int* state = reinterpret_cast<int*>(smem + L.state);
  int* counts = reinterpret_cast<int*>(smem + L.counts);
  float* batch_cost = smem + L.batch_cost;
  uint32_t* cost_key = reinterpret_cast<uint32_t*>(smem + L.cost_key);
  int* kept = reinterpret_cast<int*>(smem + L.kept);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  constexpr int kThreads = NW * 32;
  const unsigned rank = cuda::cluster_rank();
  const int group = blockIdx.x / C;
  const int64_t first_token = static_cast<int64_t>(group) * B;
  float* my_row = dense + warp * E;
  float* my_group_scratch = scratch + warp * 2 * p.n_group;
  float* my_fill_words = scratch + NW * 2 * p.n_group + warp * kFillScratchWords;  // 8-byte aligned

  cuda::pdl_launch_dependents();
  for (int u = tid; u < E; u += kThreads) {
    flags[u] = 0;
    counts[u] = 0;
  }
  __syncthreads();
  cuda::pdl_wait();  // the logits come from the previous kernel

  const int per_chunk = C * NW;
  const int chunks = (B + per_chunk - 1) / per_chunk;
  const bool single_chunk = chunks <= 1;
  const bool base_cost = p.cost == static_cast<int>(Cost::kBase);
  Token<EPL> s;
  constexpr int kOwned = (static_cast<int>(kMaxExperts) + kThreads - 1) / kThreads;
  float acc[kOwned];  // D of this thread's owned experts (u_local = tid + i * kThreads), in token order
#pragma unroll
  for (int i = 0; i < kOwned; ++i) acc[i] = 0.0f;

  // ---- routing (and the batch cost, chunk by chunk) ----
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const int local = chunk * per_chunk + static_cast<int>(rank) * NW + warp;
    if (local < B) {
      const int64_t t = first_token + local;
      load_token<EPL>(p, t, lane, s);
      score_token<EPL>(p, lane, my_row, my_group_scratch, s);
      float w, log_norm;
      int32_t id;
      route_token<EPL>(p, s, lane, id, w, log_norm);
      if (p.compute_cost) {
        for (int u = lane; u < E; u += 32) my_row[u] = 0.0f;
        __syncwarp();
        if (id < E) my_row[id] = slot_cost(p.cost, w, base_cost ? log_norm : 0.0f);
      }
      if (id < E) atomicOr(&flags[id], lane == 0 ? 3 : 1);
      if (lane < k) {
        p.ids[t * k + lane] = id;  // final output of route_cost; scratch for the fill otherwise
        p.weights[t * k + lane] = w;
      }
    } else if (p.compute_cost) {
      for (int u = lane; u < E; u += 32) my_row[u] = 0.0f;
    }
    if (!p.compute_cost) continue;
    cuda::cluster_sync();
    // Copy this CTA's experts' columns of the chunk from every CTA, then add them in token order.
    const float* columns = dense;
    int stride = E, offset = static_cast<int>(rank) * EPC;
    if (C > 1) {
      for (int i = tid; i < C * NW * EPC; i += kThreads) {
        const int src = i / (NW * EPC), rem = i % (NW * EPC), w = rem / EPC, ul = rem % EPC;
        const int u = static_cast<int>(rank) * EPC + ul;
        scratch[i] = u < E ? cuda::cluster_map(dense, src)[w * E + u] : 0.0f;
      }
      __syncthreads();
      columns = scratch;
      stride = EPC;
      offset = 0;
    }
#pragma unroll
    for (int i = 0; i < kOwned; ++i) {
      const int ul = tid + i * kThreads;
      if (ul < EPC) {
        float d = acc[i];
        const float* col = columns + offset + ul;
#pragma unroll 8
        for (int r = 0; r < C * NW; ++r) d += col[r * stride];  // token order (zeros for absent tokens)
        acc[i] = d;
      }
    }
    if (chunk + 1 < chunks) cuda::cluster_sync();  // before the dense rows are overwritten
  }

  // ---- exchange: candidates (routed union), top-1 seeds, the finished D ----
  cuda::cluster_sync();
  for (int u = tid; u < E; u += kThreads) {
    int f = 0;
    for (int c = 0; c < C; ++c) f |= cuda::cluster_map(flags, c)[u];
    state[u] = f & 1;
    if (!p.compute_cost) batch_cost[u] = p.batch_cost_in[static_cast<int64_t>(group) * E + u];
  }
  if (p.compute_cost) {
#pragma unroll
    for (int i = 0; i < kOwned; ++i) {
      const int ul = tid + i * kThreads, u = static_cast<int>(rank) * EPC + ul;
      if (ul >= EPC || u >= E) continue;
      float d = acc[i];
      if (p.cost == static_cast<int>(Cost::kTop1Union)) {
        int f = 0;
        for (int c = 0; c < C; ++c) f |= cuda::cluster_map(flags, c)[u];
        if (f & 2) d = d + p.top1_offset;
      }
      batch_cost[u] = d;
      p.batch_cost_out[static_cast<int64_t>(group) * E + u] = d;
    }
  }
  if (!p.select) {
    cuda::cluster_sync();
    return;
  }
  if (p.compute_cost && C > 1) {
    cuda::cluster_sync();
    for (int u = tid; u < E; u += kThreads) {
      const int owner = u / EPC;
      if (owner != static_cast<int>(rank)) batch_cost[u] = cuda::cluster_map(batch_cost, owner)[u];
    }
  }
  for (int i = tid; i < p.W; i += kThreads) kept[i] = E;
  // D as order-preserving integer keys, 0 for non-candidates (a copy: the other CTAs may still read batch_cost):
  // integer compares give every candidate a distinct rank even for NaN costs, where float compares would give them
  // all rank 0 and collide in kept[0] (NaN ranks first, as in torch.sort; the CPU op rejects non-finite logits).
  for (int u = tid; u < E; u += kThreads) cost_key[u] = (state[u] & 1) ? candidate_key(batch_cost[u]) : 0u;
  __syncthreads();

  // ---- top-budget selection: rank each candidate against all (D descending, index ascending) ----
  {
    int tpe = 1;  // threads per expert (power of two, within a warp)
    while (tpe < 32 && tpe * 2 * E <= kThreads) tpe *= 2;
    const int experts_per_pass = kThreads / tpe;
    const int passes = (E + experts_per_pass - 1) / experts_per_pass;
    const int sub = tid % tpe;
    for (int pass = 0; pass < passes; ++pass) {
      const int u = pass * experts_per_pass + tid / tpe;
      const uint32_t du = u < E ? cost_key[u] : 0u;
      const bool cand = du != 0u;  // candidate_key is never 0
      int r = 0;
      if (cand) {
        for (int v = sub; v < E; v += tpe) {
          const uint32_t dv = cost_key[v];
          r += (dv > du || (dv == du && v < u)) ? 1 : 0;  // a non-candidate's key 0 is below every candidate's
        }
      }
      for (int o = tpe / 2; o > 0; o >>= 1) r += __shfl_xor_sync(kFullMask, r, o);
      if (cand && sub == 0 && r < p.W) kept[r] = u;
    }
  }
  __syncthreads();
  for (int i = tid; i < p.W; i += kThreads) {
    if (kept[i] < E) state[kept[i]] |= 2;
    if (rank == 0) p.kept[static_cast<int64_t>(group) * p.W + i] = kept[i];
  }
  __syncthreads();

  // ---- fill ----
  for (int chunk = 0; chunk < chunks; ++chunk) {
    const int local = chunk * per_chunk + static_cast<int>(rank) * NW + warp;
    if (local >= B) continue;
    const int64_t t = first_token + local;
    if (!single_chunk) {
      load_token<EPL>(p, t, lane, s);
      score_token<EPL>(p, lane, my_row, my_group_scratch, s);
      s.slot_id = lane < k ? p.ids[t * k + lane] : E;
      s.slot_weight = lane < k ? p.weights[t * k + lane] : 0.0f;
      __syncwarp();  // every lane has read its routed slot before any lane overwrites it
    }
    int slot;
    int32_t id;
    float w;
    const FillScratch scratch{my_row, reinterpret_cast<uint32_t*>(my_fill_words)};  // my_row: free after the cost
    fill_token<EPL, true>(p, s, lane, kept, [&](int u) { return (state[u] & 2) != 0; }, scratch, slot, id, w);
    if (lane < k) {
      p.ids[t * k + slot] = id;
      p.weights[t * k + slot] = w;
      if (id < E) atomicAdd(&counts[id], 1);
    }
  }

  // ---- counts: sum over the cluster's CTAs ----
  cuda::cluster_sync();
  for (int u = static_cast<int>(rank) * EPC + tid; u < min(E, (static_cast<int>(rank) + 1) * EPC); u += kThreads) {
    int c = 0;
    for (int src = 0; src < C; ++src) c += cuda::cluster_map(counts, src)[u];
    p.counts[static_cast<int64_t>(group) * E + u] = c;
  }
  cuda::cluster_sync();  // keep shared memory alive until the other CTAs have read it
}

// Dynamic shared memory of a launch on clusters of C CTAs.
size_t select_smem(const SelectParams& p, int NW, int C) {
  return static_cast<size_t>(shared_layout(NW, p.E, p.W, C, (p.E + C - 1) / C, p.n_group).total) * 4;
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t smem) {
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  }
}

// The largest cluster an instance may use: 16 CTAs where the device co-schedules them, else the portable 8. Asked once
// per device with the first call's shared memory: one CTA per SM whatever the shape (at most ~100 KB), so the answer
// is the GPCs' and holds for every call.
template <int EPL, int NW>
int max_select_cluster(size_t smem, int device) {
  static std::atomic<int> cached[64];  // 0 unknown; host threads may launch on a new device at once
  if (device < 0 || device >= 64) return 8;
  int known = cached[device].load(std::memory_order_acquire);
  if (known == 0) {
    auto kernel = route_select_kernel<EPL, NW>;
    allow_smem(kernel, smem);
    known = cuda::cluster_fits(kernel, 16, NW * 32, smem) ? 16 : 8;
    cached[device].store(known, std::memory_order_release);
  }
  return known;
}

template <int EPL, int NW>
void launch_select(SelectParams p, int groups, bool clusters, int device, cudaStream_t stream) {
  // One token per warp per chunk: as many CTAs as the group's tokens need (routing and fill are issue-bound, so 16
  // warps per SM on 16 SMs beat 32 on 8: Qwen3 shape, T = 256, 26.1 -> 23.1 us, session 39).
  int C = clusters ? std::clamp((p.B + NW - 1) / NW, 1, 16) : 1;
  if (C > 8) C = std::min(C, max_select_cluster<EPL, NW>(select_smem(p, NW, C), device));
  p.cluster = C;
  p.experts_per_cta = (p.E + C - 1) / C;
  const size_t smem = select_smem(p, NW, C);
  auto kernel = route_select_kernel<EPL, NW>;
  allow_smem(kernel, smem);
  cuda::launch({dim3(groups * C), dim3(NW * 32), smem, stream, clusters ? C : 0, clusters && cuda::selection_pdl()},
               kernel, p);
}

}  // namespace

void route_select_launch(SelectParams p, int groups, int device) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device);
  const bool clusters = cuda::device_has_clusters(device);
  const int epl = (p.E + 31) / 32;
  if (epl <= 1) {
    launch_select<1, 16>(p, groups, clusters, device, stream);
  } else if (epl <= 2) {
    launch_select<2, 16>(p, groups, clusters, device, stream);
  } else if (epl <= 4) {
    launch_select<4, 16>(p, groups, clusters, device, stream);
  } else if (epl <= 8) {
    launch_select<8, 16>(p, groups, clusters, device, stream);
  } else {
    launch_select<16, 8>(p, groups, clusters, device, stream);
  }
}

}  // namespace base_moe
