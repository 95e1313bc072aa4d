// The expert op's warp-specialised tile configuration "WS" (csrc/experts_ws.cu), called by csrc/experts.cu.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime.h>

namespace base_moe {

// act [T*k, I] and yslot [T*k, H] (fp32) as in csrc/experts.cu: fills them for every non-sentinel slot (act rows in
// expert-sorted order of the slots, yslot rows token-major); the caller's slot sum then adds each token's rows.
// Returns false, having launched nothing, where it cannot run: a device without this build's sm_90a code (checked
// once per device, outside stream capture), a tensor the driver cannot describe for TMA, or shared memory refused.
bool experts_ws_launch(const at::Tensor& hidden, const at::Tensor& expert_ids, const at::Tensor& expert_weights,
                       const at::Tensor& gate_up_proj, const at::Tensor& down_proj, at::Tensor& act, at::Tensor& yslot,
                       cudaStream_t stream, bool pdl);

}  // namespace base_moe
