"""Run the BASE selection pipeline on random inputs and print what it kept.

One Qwen3-30B-A3B-shaped MoE layer (H=2048, E=128, top-8, I=768, scaled down in I on CPU), a decode
batch of 16 tokens, an expert budget of 16: router + predictor GEMV, routing and cost reduction,
top-budget selection with backfill, then the kept experts only.
"""

import argparse
import time

import torch

import base_moe
from base_moe import Cost, Fill, Routing, Scoring, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--device", default="cuda" if base_moe.cuda_available() else "cpu")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = args.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    H, E, k = 2048, 128, 8
    I = 768 if device == "cuda" else 128
    hidden = torch.randn(args.batch, H, device=device).to(dtype)
    router = (torch.randn(E, H, device=device) / H**0.5).to(dtype)
    predictor = (torch.randn(E, H, device=device) * 0.1 / H**0.5).to(dtype)
    predictor_bias = torch.zeros(E, device=device)
    gate_up = (torch.randn(E, 2 * I, H, device=device) / H**0.5).to(dtype)
    down = (torch.randn(E, H, I, device=device) / I**0.5).to(dtype)
    routing = Routing(k, Scoring.SOFTMAX, renormalize=True)

    start = time.perf_counter()
    logits, log_norms = ops.router_predict(hidden, router, None, predictor, predictor_bias)
    ids, weights, kept, counts, cost = ops.route_select(
        logits, routing, budget=args.budget, cost=Cost.BASE, fill=Fill.BACKFILL, log_norms=log_norms)
    out = ops.experts(hidden, ids, weights, gate_up, down)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start

    routed, _, _ = ops.route_cost(logits, routing, cost=Cost.BASE, log_norms=log_norms)
    union = torch.unique(routed).numel()
    kept_list = [u for u in kept[0].tolist() if u < E]
    retained = cost[0, kept_list].sum() / cost[0].sum()
    dense_out = ops.experts(hidden, routed, ops.route_cost(logits, routing, cost=Cost.ROUTER_SUM)[1], gate_up, down)
    rel_change = (out.float() - dense_out.float()).norm() / dense_out.float().norm()

    print(f"base_moe {base_moe.__version__} on {device} ({dtype}), batch {args.batch}, budget {args.budget}")
    print(f"experts routed by the batch (dense union): {union} of {E}")
    print(f"experts kept (descending predicted cost):  {kept_list}")
    print(f"tokens per kept expert:                    {counts[0, kept_list].tolist()}")
    print(f"predicted removal cost retained:           {retained.item():.1%}")
    print(f"relative change of the layer output:       {rel_change.item():.3f}")
    print(f"time of the three stages (eager, first call): {elapsed * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
