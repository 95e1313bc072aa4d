// The expert op's warp-specialised tile configuration "WS" (csrc/experts_ws.cu), called by csrc/experts.cu.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

namespace base_moe {

// act [T*k, I] and yslot [T*k, H] (both in hidden's dtype) as in csrc/experts.cu: fills them for every non-sentinel
// slot (act rows in expert-sorted order of the slots, yslot rows token-major); the caller's slot sum then adds each
// token's rows. columns: the token columns of one work item (64, 80, 128 or 160; an expert with more slots takes
// several).
// Returns false, having launched nothing, where it cannot run: a device without this build's sm_90a code (checked
// once per device, outside stream capture), a tensor the driver cannot describe for TMA, shared memory refused, or
// columns not one of its instances.
bool experts_ws_launch(const at::Tensor& hidden, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                       const at::Tensor& gate_up_proj, const at::Tensor& down_proj, at::Tensor& act, at::Tensor& yslot,
                       int columns, cudaStream_t stream, bool pdl);

// How evenly WS's persistent CTAs, one per SM, share its work items when `experts` experts are active and each takes
// one item per weight tile (all its tokens in one item): items / (rounds x SMs) for gate_up's and for down's items, the
// smaller. Items past a multiple of the SM count leave SMs idle in the last round (csrc/experts.cu pick_config).
double experts_ws_round_fill(int64_t experts, int64_t I, int64_t H, int sms);

}  // namespace base_moe
