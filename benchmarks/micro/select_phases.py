"""MEASUREMENT BRANCH ONLY (wip/select-phases): runs select_experts eagerly on the Qwen3 shape at a few batch sizes;
the kernel of this branch prints the clock64 cycles of each phase for CTAs 0 and C-1 (SM clock ~1.98 GHz).

    python3 setup.py build_ext --inplace && python3 benchmarks/micro/select_phases.py
"""
import torch

import base_moe.ops as ops
from base_moe.routing import Routing, Scoring

H, E = 2048, 128
routing = Routing(8, Scoring.SOFTMAX, renormalize=True)
torch.manual_seed(0)
Wr = (torch.randn(E, H, device="cuda") * H**-0.5).bfloat16()
Wp = (torch.randn(E, H, device="cuda") * 0.1 * H**-0.5).bfloat16()
bp = torch.zeros(E, device="cuda")
for T in (1, 4, 16, 64):
    x = torch.randn(T, H, device="cuda").bfloat16()
    for rep in range(3):
        print(f"T={T} call {rep}", flush=True)
        ops.select_experts(x, Wr, routing, budget=16, predictor_weight=Wp, predictor_bias=bp)
        torch.cuda.synchronize()
