"""Issue 6's acceptance measurement on the testbed: BASE against the batch-aware baselines at B=16.

Calibrates on ``testbed/calib.txt`` (or loads ``--predictors``), measures the dense union, evaluates every
policy at every budget between a third and a half of it on ``testbed/heldout.txt`` (forced-token protocol,
``base_moe.evaluate``), prints the table and the acceptance check (``base`` below ``router_sum``, ``router_sq``,
``frequency``, ``top1_union`` and ``static_energy`` at every budget, ``oracle`` lowest; with the paired standard
error of each difference over the batches), and writes JSON and PNG.

    python benchmarks/bench_quality.py --batches 16            # CPU, ~10 minutes on one core
    python benchmarks/bench_quality.py --device cuda --batches 64
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

import base_moe
from base_moe.evaluate import budgets_between, dense_union, evaluate, format_table, json_ready, plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINES = ["router_sum", "router_sq", "frequency", "top1_union", "static_energy"]
EXTRA = ["oea", "oea:k0=2", "topk_reduce", "lynx"]


def acceptance(result: dict) -> tuple[bool, list[str]]:
    """Per budget: base's loss against each baseline's, the paired standard error of the difference, and the
    oracle's; True when base beats every baseline and the oracle beats every policy at every budget (point estimates,
    issue 6's rule; a win by less than two standard errors is marked "within 2 SE")."""
    lines, ok = [], True
    budgets = sorted({r["budget"] for r in result["results"] if r["budget"] is not None})
    for budget in budgets:
        rows = {r["policy"]: r for r in result["results"] if r["budget"] == budget}
        base = rows["base"]
        parts = []
        for name in BASELINES:
            diff = [a - b for a, b in zip(rows[name]["bits_per_batch"], base["bits_per_batch"])]
            se = statistics.stdev(diff) / math.sqrt(len(diff)) if len(diff) > 1 else math.nan
            won = rows[name]["delta_bits"] > base["delta_bits"]
            ok &= won
            note = " (LOST)" if not won else " (within 2 SE)" if not statistics.fmean(diff) > 2 * se else ""
            parts.append(f"{name} {statistics.fmean(diff):+.4f}+-{se:.4f}{note}")
        oracle_best = all(rows["oracle"]["delta_bits"] <= r["delta_bits"] for r in rows.values())
        ok &= oracle_best
        lines.append(f"M={budget}: base +{base['delta_bits']:.4f}; baselines minus base: " + ", ".join(parts)
                     + f"; oracle +{rows['oracle']['delta_bits']:.4f}{'' if oracle_best else ' (NOT lowest)'}")
    return ok, lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if base_moe.cuda_available() else "cpu")
    p.add_argument("--predictors", help="predictors file (default: calibrate on testbed/calib.txt)")
    p.add_argument("--calib-bytes", type=int, default=262144)
    p.add_argument("--ridge", type=float, default=1e-3)
    p.add_argument("--batches", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--extra", default=",".join(EXTRA), help="policies beyond the acceptance set")
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks/results/testbed_quality.json"))
    p.add_argument("--plot", default=os.path.join(ROOT, "benchmarks/results/testbed_quality.png"))
    args = p.parse_args()

    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "testbed"), dtype=dtype).to(device).eval()
    read = lambda name: torch.frombuffer(bytearray(open(os.path.join(ROOT, "testbed", name), "rb").read()),
                                         dtype=torch.uint8).long()
    if args.predictors:
        predictors = base_moe.Predictors.load(args.predictors)
    else:
        calib = read("calib.txt")[: args.calib_bytes]
        predictors = base_moe.calibrate(model, calib[: calib.numel() // 256 * 256].view(-1, 256), batch_size=16,
                                        ridge=args.ridge, device=device)
    heldout = read("heldout.txt")
    union = dense_union(model, heldout, batch=args.batch, seq=256, prefill=32, batches=4, device=device)
    budgets = budgets_between(union)
    policies = ["base", *BASELINES, "oracle", *[x for x in args.extra.split(",") if x]]
    result = evaluate(model, heldout, predictors=predictors, policies=policies, budgets=budgets, batch=args.batch,
                      seq=256, prefill=32, batches=args.batches, device=device)
    ok, lines = acceptance(result)
    result["command"] = " ".join(["python", *sys.argv])
    result["acceptance"] = {"passed": ok, "lines": lines, "budgets": budgets, "union_for_budgets": union,
                            "predictor_r2": predictors.r2}
    print(format_table(result))
    print("\n".join(lines))
    print(f"acceptance (issue 6): {'PASSED' if ok else 'NOT PASSED'}")
    with open(args.json, "w") as f:
        json.dump(json_ready(result), f, indent=1, allow_nan=False)
    plot(result, args.plot)
    print(f"wrote {args.json} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
