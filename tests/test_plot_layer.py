"""benchmarks/plot_layer.py: the points it draws from bench_layer.py's rows, and the figure it writes."""

from __future__ import annotations

import math
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import plot_layer  # noqa: E402


def random_rows(seed: int) -> list[dict]:
    """bench_layer.py-shaped rows: two models, three batches, budgets whose active counts sometimes coincide."""
    rng = random.Random(seed)
    rows = []
    for model in ("qwen3-30b-a3b", "olmoe-1b-7b"):
        for batch in (1, 16, 64):
            for budget in (None, 8, 16, 32):
                active = 8 if batch == 1 else (budget or 60)
                vllm = rng.choice([None, float("nan"), rng.uniform(30, 300)])
                rows.append({"model": model, "batch": batch, "budget": budget, "active": active,
                             "ours_us": rng.uniform(20, 300), "hf_grouped_mm_us": rng.uniform(100, 500),
                             "floor_us": 2.3 * active, "ours_frac_copy": rng.uniform(0.3, 1.0), "vllm_us": vllm})
    return rows


@pytest.mark.parametrize("seed", range(3))
def test_points_average_the_budgets_of_one_active_count(seed):
    rows = [r for r in random_rows(seed) if r["model"] == "qwen3-30b-a3b"]
    points = plot_layer.points_by_batch(rows)
    assert sorted(points) == [1, 16, 64]
    for batch, batch_points in points.items():
        actives = [p["active"] for p in batch_points]
        assert actives == sorted(set(actives))
        for p in batch_points:
            same = [r for r in rows if r["batch"] == batch and r["active"] == p["active"]]
            assert math.isclose(p["ours_us"], sum(r["ours_us"] for r in same) / len(same))
            assert math.isclose(p["ours_frac_copy"], sum(r["ours_frac_copy"] for r in same) / len(same))
            vllm = [r["vllm_us"] for r in same if r["vllm_us"] is not None and not math.isnan(r["vllm_us"])]
            assert (math.isnan(p["vllm_us"]) and not vllm) or p["vllm_us"] == vllm[0]


def test_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    result = {"machine": "test", "torch": "x", "git_commit": "abc", "date": "today", "copy_bandwidth_TBps": 4.0,
              "rows": random_rows(0)}
    out = tmp_path / "layer.png"
    plot_layer.plot(result, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_refuses_a_result_without_rows(tmp_path):
    with pytest.raises(ValueError, match="no rows"):
        plot_layer.plot({"rows": []}, str(tmp_path / "x.png"))


@pytest.mark.parametrize("commit,expected", [
    ("0123456789abcdef0123", "0123456789ab"),
    ("0123456789abcdef0123 + notes/a.patch", "0123456789ab + 1 patch"),
    ("0123456789abcdef0123 + notes/a.patch notes/b.patch", "0123456789ab + 2 patches"),
    ("?", "?"),
])
def test_short_commit_names_the_patches_on_top(commit, expected):
    assert plot_layer.short_commit(commit) == expected
