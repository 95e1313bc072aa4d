"""A few calls of one MoE-layer op on a bench_layer.py point, for profilers (ncu, nsys, compute-sanitizer).

Same weights, routing and hidden states as bench_layer.py draws for (model, batch, budget). Example, the expert
kernels' DRAM throughput and stall reasons at batch 64 with 16 experts:

    ncu --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\\
sm__warps_active.avg.pct_of_peak_sustained_active,smsp__warp_issue_stalled_barrier_per_warp_active.pct \\
        -k regex:expert_gemm --launch-skip 2 --launch-count 2 python3 benchmarks/profile_layer.py --batch 64 --budget 16

(the first call warms up: skip its launches). BASE_MOE_EXPERTS_CONFIG=T16|T32|T64|T128 forces a tile configuration.
"""

from __future__ import annotations

import argparse

import torch
from bench_layer import MODELS, point_generator, random_routing

import base_moe.ops  # noqa: F401


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--budget", type=int, default=None, help="route to this many random experts (default: dense)")
    ap.add_argument("--op", choices=("experts", "select"), default="experts")
    ap.add_argument("--calls", type=int, default=2)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_layer.py needs a CUDA device")
    cfg = MODELS[args.model]
    H, E, k, I = cfg["H"], cfg["E"], cfg["k"], cfg["I"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    point = point_generator(args.model, args.batch, args.budget)
    x = torch.randn(args.batch, H, device="cuda", generator=point).to(torch.bfloat16)
    if args.op == "experts":
        gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H**-0.5).to(torch.bfloat16)
        down = (torch.randn(E, H, I, device="cuda", generator=gen) * I**-0.5).to(torch.bfloat16)
        ids, w = random_routing(args.batch, E, k, args.budget, cfg["renormalize"], point)
        for _ in range(args.calls):
            torch.ops.base_moe.experts(x, ids, w, gate_up, down, args.budget)
    else:
        router = (torch.randn(E, H, device="cuda", generator=gen) * H**-0.5).to(torch.bfloat16)
        predictor = (torch.randn(E, H, device="cuda", generator=gen) * 0.1 * H**-0.5).to(torch.bfloat16)
        bias = torch.zeros(E, device="cuda")
        for _ in range(args.calls):
            torch.ops.base_moe.select_experts(x, router, None, predictor, bias, None, 1, k, 0, cfg["renormalize"], 1, 1,
                                              1.0, 0, args.budget or E, 0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
