"""benchmarks/plot_select.py: the series it draws from bench_select.py's rows, issue #3's targets, and the figure."""

from __future__ import annotations

import math
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import plot_select  # noqa: E402

KEYS = [key for key, _ in plot_select.TIMES + plot_select.SPEEDUPS]


def random_rows(seed: int) -> list[dict]:
    """bench_select.py-shaped rows for two models, in shuffled order, some without a column."""
    rng = random.Random(seed)
    rows = []
    for model in ("qwen3-30b-a3b", "deepseek-v3-like"):
        for T in (1, 4, 16, 32, 64, 128, 256):
            row = {"model": model, "T": T}
            row.update({key: rng.uniform(1, 100) for key in KEYS if rng.random() > 0.1})
            rows.append(row)
    rng.shuffle(rows)
    return rows


@pytest.mark.parametrize("seed", range(3))
def test_series_are_each_models_rows_in_token_order(seed):
    rows = random_rows(seed)
    series = plot_select.series_by_model(rows)
    assert sorted(series) == ["deepseek-v3-like", "qwen3-30b-a3b"]
    for model, s in series.items():
        assert s["T"] == sorted(r["T"] for r in rows if r["model"] == model)
        for i, T in enumerate(s["T"]):
            (row,) = [r for r in rows if r["model"] == model and r["T"] == T]
            for key in KEYS:
                assert (key not in row and math.isnan(s[key][i])) or s[key][i] == row[key]


@pytest.mark.parametrize("T,bound", [(1, 6.0), (16, 6.0), (64, 6.0), (65, None), (128, None), (256, 10.0),
                                     (512, None)])
def test_targets_are_issue_3s(T, bound):
    assert plot_select.target_us(T) == bound


def test_draws_only_the_columns_a_json_has():
    rows = [{"model": "m", "T": t, "select_experts_us": float(t)} for t in (1, 4)]
    rows[1]["route_select_us"] = 2.0
    series = plot_select.series_by_model(rows)["m"]
    assert [key for key, _ in plot_select.drawn(series, plot_select.TIMES)] == ["select_experts_us", "route_select_us"]


def test_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    result = {"machine": "test", "torch": "x", "git_commit": "abc + notes/a.patch", "date": "today", "budget": 16,
              "cost": "base", "fill": "backfill", "rows": random_rows(0)}
    out = tmp_path / "select.png"
    plot_select.plot(result, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_refuses_a_result_without_rows(tmp_path):
    with pytest.raises(ValueError, match="no rows"):
        plot_select.plot({"rows": []}, str(tmp_path / "x.png"))
