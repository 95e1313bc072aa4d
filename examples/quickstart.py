"""BASE on a real (small) MoE language model: calibrate, apply, and compare expert-selection policies.

The testbed (``testbed/``) is a byte-level Qwen3-MoE (6 MoE layers, 32 experts, top-4) trained on Python source.
This script

1. calibrates BASE's removal-cost predictors on ``testbed/calib.txt`` (each byte is a token),
2. measures how many experts a decode batch of 16 sequences routes to per layer (the dense union),
3. evaluates dense decoding and the policies below at budgets between a third and a half of that union, with the
   forced-token protocol on ``testbed/heldout.txt`` (16 sequences, the first 32 bytes dense, then every position
   one decode batch of 16 tokens under the policy),
4. prints bits per byte, the loss over dense, the retained expert energy and the active experts per layer.

    python examples/quickstart.py                    # CPU: 35-95 s on 2 cores, with the machine's load
    python examples/quickstart.py --device cuda      # GPU (with base_moe's CUDA kernels)
    python examples/quickstart.py --batches 16 --json out.json --plot out.png

The same from the command line: ``python -m base_moe calibrate ...`` then ``python -m base_moe eval ...``
(see README).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

import base_moe
from base_moe.cli import check_output_file, check_plot_output, require_transformers, resolve_device, resolve_seq
from base_moe.evaluate import (DENSE_UNION_BATCHES, budgets_between, check_prefill, dense_union, evaluate, format_table,
                               json_ready, plot, standard_error)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTBED = os.path.join(ROOT, "testbed")
POLICIES = ["base", "router_sum", "router_sq", "frequency", "top1_union", "static_energy", "oracle"]


def read_bytes(path: str, limit: int | None = None) -> torch.Tensor:
    with open(path, "rb") as f:
        data = f.read(limit) if limit else f.read()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def paired_gap(baseline: dict, base: dict) -> str:
    """The baseline's loss minus base's, paired over the evaluation batches (every batch has the same tokens), with
    its standard error: whether a gap between the two is larger than the batches' spread."""
    gaps = [b - a for a, b in zip(base["bits_per_batch"], baseline["bits_per_batch"])]
    mean, stderr = statistics.fmean(gaps), standard_error(gaps)
    return f"{mean:+.3f}" if math.isnan(stderr) else f"{mean:+.3f} +- {stderr:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if base_moe.cuda_available() else "cpu")
    parser.add_argument("--calib-bytes", type=int, default=65536, help="calibration tokens (bytes, >= --seq)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per decode batch")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--prefill", type=int, default=32)
    parser.add_argument("--batches", type=int, default=4, help="evaluation batches of --batch x --seq bytes")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--json", help="write the full result here")
    parser.add_argument("--plot", help="write the plot (PNG) here")
    args = parser.parse_args()
    if min(args.batch, args.seq, args.batches) < 1 or args.calib_bytes < args.seq:
        parser.error("--batch, --seq and --batches must be >= 1, and --calib-bytes at least one sequence (--seq)")
    # every check the CLI makes before its work: a bad device or output path fails now, not after the evaluation
    args.device = resolve_device(args.device)
    require_transformers()
    if args.json:
        check_output_file(args.json, "--json")
    if args.plot:
        check_plot_output(args.plot)
    resolve_seq(args.seq, TESTBED, args.seq)  # refuses a --seq past the testbed's context, as the CLI does
    try:
        check_prefill(args.prefill, args.seq)
    except ValueError:
        parser.error(f"--prefill must be in [0, --seq - 2], got {args.prefill}")
    heldout_bytes = os.path.getsize(os.path.join(TESTBED, "heldout.txt"))
    if args.batches * args.batch * args.seq > heldout_bytes:
        parser.error(f"--batches {args.batches} of --batch {args.batch} x --seq {args.seq} bytes need "
                     f"{args.batches * args.batch * args.seq} held-out bytes; the testbed's held-out text has "
                     f"{heldout_bytes}")
    policies = [name for name in args.policies.split(",") if name]
    try:  # before calibration and the dense-union pass
        [base_moe.policies.get_policy(name) for name in policies]
    except ValueError as err:
        parser.error(str(err))

    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(TESTBED, dtype=dtype, local_files_only=True).to(device).eval()
    print(f"testbed: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, "
          f"{model.config.num_hidden_layers} MoE layers x {model.config.num_experts} experts, "
          f"top-{model.config.num_experts_per_tok}, on {device} ({dtype})")

    # 1. calibration: one ridge-regression log-norm predictor per MoE layer
    calib = read_bytes(os.path.join(TESTBED, "calib.txt"), args.calib_bytes)
    calib = calib[: calib.numel() // args.seq * args.seq].view(-1, args.seq)
    predictors = base_moe.calibrate(model, calib, batch_size=16, device=device)
    print("held-out R^2 of the predictors per layer: "
          + ", ".join(f"{i}: {r2:.2f}" for i, r2 in predictors.r2.items()))

    # 2. the dense union at this batch size, and the budgets between a third and a half of it
    heldout = read_bytes(os.path.join(TESTBED, "heldout.txt"))
    union_batches = min(args.batches, DENSE_UNION_BATCHES)
    union = dense_union(model, heldout, batch=args.batch, seq=args.seq, prefill=args.prefill,
                        batches=union_batches, device=device)
    budgets = budgets_between(union)
    budgets = sorted({budgets[0], budgets[-1]})
    print(f"dense union: {union:.1f} experts per layer and decode batch of {args.batch} (first {union_batches} "
          f"batches); budgets {budgets}")

    # 3. apply and evaluate (evaluate patches the model for the run: base_moe.apply(model, ...,
    #    group_by="position"); in a serving loop one would call base_moe.apply(model, predictors, budget=M))
    result = evaluate(model, heldout, predictors=predictors, policies=policies, budgets=budgets,
                      batch=args.batch, seq=args.seq, prefill=args.prefill, batches=args.batches, device=device)
    print(format_table(result))

    # 4. the headline: BASE against the best baseline at each budget
    for budget in budgets:
        rows = {r["policy"]: r for r in result["results"] if r["budget"] == budget}
        if "base" in rows:
            others = {p: r["delta_bits"] for p, r in rows.items() if p not in ("base", "oracle")}
            best = min(others, key=others.get) if others else None
            line = f"budget {budget}: base +{rows['base']['delta_bits']:.3f} {result['unit']}"
            if best:
                line += (f", best baseline {best} +{others[best]:.3f} ({best} minus base, paired over "
                         f"{len(rows['base']['bits_per_batch'])} batches: {paired_gap(rows[best], rows['base'])})")
            if "oracle" in rows:
                line += f", oracle +{rows['oracle']['delta_bits']:.3f}"
            print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(json_ready(result), f, indent=1, allow_nan=False)
    if args.plot:
        plot(result, args.plot)
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
