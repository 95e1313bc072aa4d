"""bench_select.py's JSON as a figure, one row of panels per layer shape.

Left: microseconds per selection against the batch's tokens (log scale): ``select_experts`` as one call, after torch's
norm and after base_moe's norm (the three ways bench_select.py times the whole path), and its two kernels alone, with
issue #3's targets on the Qwen3 shape (at most 6 us at T <= 64 and 10 us at T = 256, one call). Right: the speed-up of
one call over the same selection in plain PyTorch (issue #3: at least 5x on the Qwen3 shape) and over HF's router
alone.

    python benchmarks/plot_select.py benchmarks/results/bench_select_s51.json benchmarks/results/bench_select.png
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from plot_layer import cli, save

# (JSON key, legend label) of the time panel's lines
TIMES = (
    ("select_experts_us", "select_experts, one call"),
    ("select_experts_after_norm_us", "after torch's norm"),
    ("select_experts_after_our_norm_us", "after base_moe's norm"),
    # JSONs from before session 59's removal of the one-launch kernel timed the two kernels apart from select_experts
    ("two_kernels_us", "router_predict + route_select, one call"),
    ("two_kernels_after_our_norm_us", "router_predict + route_select, after base_moe's norm"),
    ("router_predict_us", "router_predict alone"),
    ("route_select_us", "route_select alone"),
)
SPEEDUPS = (("speedup_vs_pytorch", "over plain PyTorch"), ("speedup_vs_hf_router", "over HF's router alone"))
# issue #3's acceptance on the Qwen3 shape, one call: the most microseconds allowed at each batch size it names
TARGET_MODEL = "qwen3-30b-a3b"


def target_us(tokens: int) -> float | None:
    """Issue #3's bound for one call at ``tokens`` tokens (Qwen3 shape), or None where it sets none."""
    if tokens <= 64:
        return 6.0
    return 10.0 if tokens == 256 else None


def series_by_model(rows: list[dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Per model, the token counts in ascending order ("T") and every TIMES / SPEEDUPS key's values at them (NaN where
    a row lacks one)."""
    by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        by_model[r["model"]].append(r)
    out: dict[str, dict[str, list[float]]] = {}
    for model, model_rows in by_model.items():
        model_rows = sorted(model_rows, key=lambda r: r["T"])
        series = {"T": [r["T"] for r in model_rows]}
        for key, _ in TIMES + SPEEDUPS:
            series[key] = [float(r[key]) if r.get(key) is not None else math.nan for r in model_rows]
        out[model] = series
    return out


def drawn(series: dict[str, list[float]], keys) -> list:
    """The (key, label) pairs of ``keys`` with a value at some token count in ``series``: a column a JSON lacks
    (bench_select.py's columns changed over time) gets no line and no legend entry."""
    return [(key, label) for key, label in keys if any(not math.isnan(v) for v in series[key])]


def plot(result: dict[str, Any], path: str) -> None:
    """Writes the figure (PNG) for bench_select.py's ``result`` to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_model = series_by_model(result.get("rows", []))
    if not by_model:
        raise ValueError("the result has no rows to plot")
    fig, axes = plt.subplots(len(by_model), 2, figsize=(13, 4.6 * len(by_model)), squeeze=False)
    for (time_ax, speed_ax), (model, series) in zip(axes, by_model.items()):
        tokens = series["T"]
        for key, label in drawn(series, TIMES):
            style = {"linewidth": 2.5} if key == "select_experts_us" else {"alpha": 0.8}
            time_ax.plot(tokens, series[key], marker="o", label=label, **style)
        if model == TARGET_MODEL:
            bounds = sorted({target_us(t) for t in tokens} - {None})
            for i, bound in enumerate(bounds):  # one segment over the batch sizes each bound covers
                covered = [t for t in tokens if target_us(t) == bound]
                time_ax.hlines(bound, min(covered), max(covered), color="black", linewidth=1.5, zorder=5,
                               label="issue #3 target (one call)" if i == 0 else None)
                time_ax.scatter(covered, [bound] * len(covered), marker="_", s=300, color="black", zorder=5)
        for key, label in drawn(series, SPEEDUPS):
            speed_ax.plot(tokens, series[key], marker="o", label=label)
        if model == TARGET_MODEL:
            speed_ax.axhline(5, linestyle="--", color="black", linewidth=1, label="issue #3 target over PyTorch (5x)")
        for ax, ylabel, title in ((time_ax, "microseconds per call (median, CUDA graph)", "selection path"),
                                  (speed_ax, "speed-up of one call", "speed-up")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(tokens, [str(t) for t in tokens])
            ax.set_xlabel("tokens per call (T)")
            ax.set_ylabel(ylabel)
            # headroom above the lines for the legend, so that it hides none of them
            ax.set_ylim(0, ax.get_ylim()[1] * 1.5)
            ax.set_title(f"{model}: {title}")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8, loc="upper left")
    save(fig, path, result, f"budget {result.get('budget', '?')}, cost {result.get('cost', '?')}, fill "
                            f"{result.get('fill', '?')}")


def main(argv: list[str] | None = None) -> int:
    return cli(plot, __doc__, "bench_select.py", argv)


if __name__ == "__main__":
    raise SystemExit(main())
