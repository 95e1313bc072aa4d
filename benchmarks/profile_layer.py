"""A few calls of one MoE-layer op on a bench_layer.py point, for profilers (ncu, nsys, compute-sanitizer).

The hidden states and routing are bench_layer.py's for (model, batch, budget); the weights are drawn the same way.
Example, the expert kernels' DRAM throughput and stall reasons at batch 64 with 16 experts:

    ncu --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,\\
sm__warps_active.avg.pct_of_peak_sustained_active,smsp__warp_issue_stalled_barrier_per_warp_active.pct \\
        -k regex:expert_gemm --launch-skip 2 --launch-count 2 python3 benchmarks/profile_layer.py --batch 64 --budget 16

(the first call warms up: skip its launches). BASE_MOE_EXPERTS_CONFIG=T16|T32|W64|W128 forces a tile configuration.
--op layer runs the selection and then the expert op on its routing, call after call (the BASE layer), so a profiler
sees each kernel after the other one, as in decode; e.g. with ncu --cache-control none, whether select_experts waits
on instruction fetches more after the expert kernels than after another selection (--op select).

--timeline replays the calls (--op layer: selection + expert op, as bench_layer.py's BASE layer) back to back on three
weight copies in one CUDA graph under torch.profiler and prints, per kernel, the median start and end in microseconds from the call's
first kernel start: where the op's time goes between kernels (programmatic dependent launch lets a kernel start
before the previous one ends; it then waits inside).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from bench_layer import MODELS, draw_point, expert_weights, router_weights, select_experts

import base_moe.ops  # noqa: F401


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--budget", type=int, default=None, help="route to this many random experts (default: dense)")
    ap.add_argument("--op", choices=("experts", "select", "layer"), default="experts")
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--timeline", action="store_true", help="kernel start / end per call under torch.profiler")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_layer.py needs a CUDA device")
    cfg = MODELS[args.model]
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, ids, w, _ = draw_point(args.model, cfg, args.batch, args.budget)
    if args.timeline:
        timeline(args, cfg, gen, x, ids, w)
        return
    selection = router_weights(cfg, gen) if args.op != "experts" else None
    gate_up, down = expert_weights(cfg, gen) if args.op != "select" else (None, None)
    for _ in range(args.calls):
        route = (ids, w)
        if selection is not None:
            route = select_experts(x, cfg, *selection, args.budget or cfg["E"])
        if args.op != "select":
            torch.ops.base_moe.experts(x, *route, gate_up, down, args.budget)
    torch.cuda.synchronize()


def timeline(args, cfg, gen, x, ids, w):
    """Median start / end (us from the call's first kernel start) of each kernel of a call, over args.calls calls."""
    copies = [] if args.op == "select" else [expert_weights(cfg, gen) for _ in range(3)]  # 1.2 GB each for Qwen3
    router, predictor, predictor_bias = router_weights(cfg, gen)
    budget = args.budget or cfg["E"]

    def call(i):
        if args.op == "select":
            return select_experts(x, cfg, router, predictor, predictor_bias, budget)
        gate_up, down = copies[i % len(copies)]
        route = (ids, w) if args.op == "experts" else select_experts(x, cfg, router, predictor, predictor_bias, budget)
        return torch.ops.base_moe.experts(x, *route, gate_up, down, args.budget)

    for i in range(3):  # warm-up: kernels loaded, attributes set
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()  # replayed, so that no launch gap of the host's shows in the timeline
    with torch.cuda.graph(graph):
        for i in range(args.calls):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()),
                     key=lambda e: e.time_range.start)
    per_call = len(kernels) // args.calls
    if per_call == 0 or per_call * args.calls != len(kernels):
        raise SystemExit(f"{len(kernels)} kernels for {args.calls} calls: cannot split them into calls")
    print(f"{args.op} batch {args.batch} budget {args.budget}: {per_call} kernels per call, medians of "
          f"{args.calls} calls (us from the call's first kernel start)")
    starts = [kernels[c * per_call].time_range.start for c in range(args.calls)]
    print(f"  call to call: {statistics.median(b - a for a, b in zip(starts, starts[1:])):7.1f}")
    for j in range(per_call):
        ev = [kernels[c * per_call + j] for c in range(args.calls)]
        start = statistics.median(e.time_range.start - s for e, s in zip(ev, starts))
        end = statistics.median(e.time_range.end - s for e, s in zip(ev, starts))
        name = ev[0].name.replace("void ", "").replace("(anonymous namespace)::", "").replace("base_moe::", "")
        print(f"  {name[:70]:70s} start {start:7.1f} end {end:7.1f}")


if __name__ == "__main__":
    main()
