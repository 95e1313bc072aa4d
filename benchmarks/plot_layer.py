"""bench_layer.py's JSON as a figure, one row of panels per model.

Left: the expert op's time against the experts a batch activates, one line per batch size, next to HF's grouped_mm
experts module alone, no router (dashed, same colour), vLLM's fused_moe where DESIGN section 8 has a point (crosses)
and the HBM floor (the active experts' bytes at the run's copy bandwidth, dotted). Right: the op's share of the copy
bandwidth, with the 75% target. Where several budgets of one batch activate the same number of experts (batch 1: every
budget routes to 8), the point is their mean.

    python benchmarks/plot_layer.py benchmarks/results/bench_layer.json benchmarks/results/bench_layer.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from typing import Any


def points_by_batch(rows: list[dict[str, Any]]) -> dict[int, list[dict[str, float]]]:
    """Per batch size, one point per active-expert count (the mean over budgets that activate as many), in order."""
    grouped: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        grouped[(r["batch"], r["active"])].append(r)
    out: dict[int, list[dict[str, float]]] = defaultdict(list)
    for (batch, active), same in sorted(grouped.items()):
        point = {"active": active}
        for key in ("ours_us", "hf_grouped_mm_us", "floor_us", "ours_frac_copy"):
            values = [r[key] for r in same if r.get(key) is not None]
            point[key] = statistics.fmean(values) if values else float("nan")
        vllm = [r["vllm_us"] for r in same if r.get("vllm_us") is not None and r["vllm_us"] == r["vllm_us"]]
        point["vllm_us"] = vllm[0] if vllm else float("nan")
        out[batch].append(point)
    return dict(out)


def plot(result: dict[str, Any], path: str) -> None:
    """Writes the figure (PNG) for bench_layer.py's ``result`` to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in result.get("rows", [])))
    if not models:
        raise ValueError("the result has no rows to plot")
    fig, axes = plt.subplots(len(models), 2, figsize=(13, 4.6 * len(models)), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (time_ax, share_ax), model in zip(axes, models):
        by_batch = points_by_batch([r for r in result["rows"] if r["model"] == model])
        floor: dict[int, float] = {}
        for i, (batch, points) in enumerate(sorted(by_batch.items())):
            colour = colours[i % len(colours)]
            active = [p["active"] for p in points]
            time_ax.plot(active, [p["ours_us"] for p in points], marker="o", color=colour, label=f"batch {batch}")
            time_ax.plot(active, [p["hf_grouped_mm_us"] for p in points], linestyle="--", color=colour, alpha=0.6)
            time_ax.scatter(active, [p["vllm_us"] for p in points], marker="x", s=60, color=colour, zorder=5)
            share_ax.plot(active, [100 * p["ours_frac_copy"] for p in points], marker="o", color=colour,
                          label=f"batch {batch}")
            floor.update({p["active"]: p["floor_us"] for p in points})
        xs = sorted(floor)
        time_ax.plot(xs, [floor[x] for x in xs], linestyle=":", color="black", label="HBM floor (copy bandwidth)")
        time_ax.plot([], [], linestyle="--", color="grey", label="HF grouped_mm (same colour)")
        time_ax.scatter([], [], marker="x", color="grey", label="vLLM fused_moe (DESIGN section 8)")
        time_ax.set_xlabel("active experts")
        time_ax.set_ylabel("microseconds per layer call (median, CUDA graph)")
        time_ax.set_title(f"{model}: base_moe expert op")
        time_ax.grid(True, alpha=0.3)
        time_ax.legend(fontsize=8)
        share_ax.axhline(75, linestyle="--", color="black", linewidth=1, label="target (16+ active experts)")
        share_ax.set_xlabel("active experts")
        share_ax.set_ylabel("% of the copy bandwidth")
        share_ax.set_ylim(0, 110)
        share_ax.set_title(f"{model}: expert op, share of copy bandwidth")
        share_ax.grid(True, alpha=0.3)
        share_ax.legend(fontsize=8)
    save(fig, path, result, f"copy {result.get('copy_bandwidth_TBps', float('nan')):.2f} TB/s")


def save(fig, path: str, result: dict[str, Any], detail: str) -> None:
    """Titles a benchmark figure with the machine, torch, commit and date of ``result``, then ``detail``, and writes it
    to ``path`` (PNG)."""
    import matplotlib.pyplot as plt

    fig.suptitle(f"{result.get('machine', '?')}, torch {result.get('torch', '?')}, commit "
                 f"{short_commit(result.get('git_commit', '?'))}, {result.get('date', '?')}; {detail}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def short_commit(commit: str) -> str:
    """The commit's first 12 digits, and how many patches the measured tree had on top of it (benchmarks' git_commit
    reads "SHA + a.patch b.patch" for a tree with patches applied)."""
    sha, _, patches = str(commit).partition(" + ")
    n = len(patches.split())
    return sha[:12] + (f" + {n} patch{'es' if n > 1 else ''}" if n else "")


def cli(draw, doc: str, benchmark: str, argv: list[str] | None) -> int:
    """The command line of a plot script: ``draw(result, path)`` on the JSON that ``benchmark`` wrote."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("json", help=f"{benchmark}'s --out file")
    ap.add_argument("png", help="where to write the figure")
    args = ap.parse_args(argv)
    with open(args.json) as f:
        draw(json.load(f), args.png)
    print(f"wrote {args.png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli(plot, __doc__, "bench_layer.py", argv)


if __name__ == "__main__":
    raise SystemExit(main())
