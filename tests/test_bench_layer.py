"""bench_layer's figures (issue 8), from its main() run on the CPU on a small layer with the GPU timings faked: the
bytes of the active experts over the expert op's median time, as a fraction of the copy measured in the same run,
the HBM floor, the BASE layer's times behind a norm, and the JSON fields and table they are printed in."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_layer  # noqa: E402

SMALL = dict(H=64, E=16, k=4, I=32, renormalize=True)
# median microseconds of each timed graph; the expert op's depends on the point
US = {"layer": 30.0, "norm": 5.0, "layer+norm": 38.0, "our_norm": 4.0, "layer+our_norm": 36.0, "hf": 300.0}


def ours_us(T, M):
    return 10.0 + T + (M or 0) / 4


class CpuTorch:
    """bench_layer's torch, its "cuda" tensors and generators made on the CPU."""

    cuda = types.SimpleNamespace(get_device_name=lambda: "cpu", empty_cache=lambda: None)

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in ("Generator", "full", "ones", "randn", "randperm", "zeros"):
            return lambda *args, device=None, **kwargs: attr(*args, **kwargs)
        return attr


def fake_graph_time_us(calls, replays=25, rounds=1):
    """Replays around each path's time (median: the time; min and mean: others). Paths are told apart by what
    their calls use: the expert op, the layer (after which norm), a norm alone, or HF's block."""
    assert rounds == bench_layer.CALLS_PER_COPY and len(calls) == bench_layer.COPIES
    code = calls[0].__code__
    names = set(code.co_names) | set(code.co_freevars)
    if "experts" in names:  # expert_op_us: its time depends on the point (T, M) it was passed
        free = dict(zip(code.co_freevars, (cell.cell_contents for cell in calls[0].__closure__)))
        us = ours_us(free["x"].shape[0], free["M"])
    elif calls[0].__name__ in ("norm", "our_norm"):
        us = US[calls[0].__name__]
    elif "layer" in names:
        routers = {id(call.__defaults__[2]) for call in calls}  # (gu, dp, router): each copy its own router weights
        assert len(routers) == len(calls)
        us = US["layer" + "".join(f"+{norm}" for norm in ("norm", "our_norm") if norm in names)]
    else:
        us = US["hf"]
    return [us / 2, us, 3 * us]


def test_layer_figures(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(bench_layer, "torch", CpuTorch())
    monkeypatch.setattr(bench_layer, "MODELS", {"qwen3-30b-a3b": SMALL})
    monkeypatch.setattr(bench_layer, "BATCHES", [1, 4, 16])
    monkeypatch.setattr(bench_layer, "BUDGETS", [None, 8])
    monkeypatch.setattr(bench_layer, "require_cuda", lambda script: None)
    copies = iter([4e12, 5e12])  # bytes / s at the start and the end: fractions divide by the faster
    monkeypatch.setattr(bench_layer, "copy_bandwidth", lambda: next(copies))
    monkeypatch.setattr(bench_layer, "graph_time_us", fake_graph_time_us)
    monkeypatch.setattr(bench_layer, "hf_experts_modules", lambda cfg, copies: [object()] * len(copies))
    selected = {}
    select = bench_layer.select_experts

    def recording_select(x, cfg, *weights_and_budget):
        ids, w = select(x, cfg, *weights_and_budget)
        selected[x.shape[0], weights_and_budget[-1]] = ids
        return ids, w

    monkeypatch.setattr(bench_layer, "select_experts", recording_select)
    out = tmp_path / "layer.json"
    monkeypatch.setattr(sys, "argv", ["bench_layer.py", "--out", str(out), "--variants", "default,T16"])
    bench_layer.main()
    result = json.loads(out.read_text())

    E = SMALL["E"]
    gate_up, down = bench_layer.expert_weights(SMALL, torch.Generator())  # [E, 2I, H] and [E, H, I] bf16
    expert_bytes = (gate_up.nbytes + down.nbytes) / E
    assert result["copy_bandwidth_TBps"] == 5.0 and result["copy_bandwidth_start_end_TBps"] == [4.0, 5.0]
    assert len(result["rows"]) == 6
    for r in result["rows"]:
        T, M = r["batch"], r["budget"]
        _, ids, _, _ = bench_layer.draw_point("qwen3-30b-a3b", SMALL, T, M)
        assert r["active"] == len(set(ids.flatten().tolist())) <= (M or E), (T, M)
        sid = selected[T, M or E]
        assert r["base_layer_active"] == len(set(sid[sid < E].tolist())), (T, M)
        assert r["ours_us"] == ours_us(T, M)
        bandwidth = r["active"] * expert_bytes / (r["ours_us"] * 1e-6)
        assert r["ours_bw_TBps"] == pytest.approx(bandwidth / 1e12)
        assert r["ours_frac_copy"] == pytest.approx(bandwidth / 5e12)
        assert r["floor_us"] == pytest.approx(r["active"] * expert_bytes / 5e12 * 1e6)
        assert (r["base_layer_us"], r["norm_us"], r["our_norm_us"], r["hf_grouped_mm_us"]) == (30.0, 5.0, 4.0, 300.0)
        assert r["base_layer_after_norm_us"] == pytest.approx(38.0 - 5.0)  # (norm + layer) - norm
        assert r["base_layer_after_our_norm_us"] == pytest.approx(36.0 - 5.0)  # (our norm + layer) - torch's norm
        assert r["base_layer_behind_our_norm_us"] == pytest.approx(36.0 - 4.0)  # (our norm + layer) - our norm
        assert r["vllm_us"] == bench_layer.VLLM_US.get((T, M))
    for v in result["variants"]:
        assert v["us"] == {"default": ours_us(v["batch"], v["budget"]), "T16": ours_us(v["batch"], v["budget"])}

    table = capsys.readouterr().out.split("after_our_norm_us\n")[1].splitlines()
    for r, line in zip(result["rows"], table):
        assert line.split()[3:6] == [str(r["active"]), f"{r['ours_us']:.1f}", f"{100 * r['ours_frac_copy']:.0f}%"]
