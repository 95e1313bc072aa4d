"""A few calls of one MoE-layer op on a bench_layer.py point, for profilers (ncu, nsys, compute-sanitizer).

The hidden states and routing are bench_layer.py's for (model, batch, budget); the weights are drawn the same way.
Example, the expert kernels' DRAM throughput and stall reasons at batch 64 with 16 experts:

    ncu --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\\
sm__warps_active.avg.pct_of_peak_sustained_active,smsp__warp_issue_stalled_barrier_per_warp_active.pct \\
        -k regex:expert_gemm --launch-skip 2 --launch-count 2 python3 benchmarks/profile_layer.py --batch 64 --budget 16

(the first call warms up: skip its launches). BASE_MOE_EXPERTS_CONFIG=T16|T32|W64|W128 forces a tile configuration.
"""

from __future__ import annotations

import argparse

import torch
from bench_layer import MODELS, draw_point, expert_weights, router_weights, select_experts

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
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, ids, w, _ = draw_point(args.model, cfg, args.batch, args.budget)
    if args.op == "experts":
        gate_up, down = expert_weights(cfg, gen)
        for _ in range(args.calls):
            torch.ops.base_moe.experts(x, ids, w, gate_up, down, args.budget)
    else:
        router, predictor, predictor_bias = router_weights(cfg, gen)
        for _ in range(args.calls):
            select_experts(x, cfg, router, predictor, predictor_bias, args.budget or cfg["E"])
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
