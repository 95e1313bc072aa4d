"""bench_select's plain-PyTorch selection path (the baseline its speed-up is measured against) computes what the
ops compute: the same routing, batch cost, kept set, fill and counts as ``ops.select_experts`` on random inputs; and
the figures derived from the timings (medians, differences behind a norm, speed-ups, weight bandwidth) are what they
say."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_select  # noqa: E402

from base_moe import ops, reference  # noqa: E402


@pytest.mark.parametrize("name", list(bench_select.MODELS))
@pytest.mark.parametrize("T,budget", [(1, 16), (16, 16), (64, 8), (64, 300)])
def test_plain_pytorch_path_matches_the_ops(name, T, budget):
    cfg = bench_select.MODELS[name]
    E, routing, H = cfg["E"], cfg["routing"], 256  # the model's routing on a narrower hidden size
    gen = torch.Generator().manual_seed(T + budget)
    x = torch.randn(T, H, generator=gen)
    Wr, Wp = torch.randn(E, H, generator=gen) / H**0.5, torch.randn(E, H, generator=gen) / H**0.5
    bp = torch.randn(E, generator=gen) * 0.1
    bias = torch.randn(E, generator=gen) * 0.1 if cfg["bias"] else None
    ids, w, kept, counts, D = bench_select.torch_select(x, torch.cat([Wr, Wp]), torch.cat([torch.zeros(E), bp]),
                                                        routing, bias, E, budget)
    _, _, ids_op, w_op, kept_op, counts_op, D_op = ops.select_experts(
        x, Wr, routing, budget=budget, predictor_weight=Wp, predictor_bias=bp, correction_bias=bias)
    torch.testing.assert_close(D, D_op, rtol=1e-5, atol=1e-6)
    assert torch.equal(kept.int(), kept_op) and torch.equal(counts, counts_op)
    # the same slots, whatever order each token lists them in
    order, order_op = ids.argsort(dim=1), ids_op.long().argsort(dim=1)
    assert torch.equal(ids.gather(1, order), ids_op.long().gather(1, order_op))
    torch.testing.assert_close(w.gather(1, order), w_op.gather(1, order_op), rtol=1e-5, atol=1e-6)


def fake_graph_time(seen):
    """Stands in for graph_time_us: records, per timed path, the hidden-state buffers its calls read (a call's first
    default argument) and returns a time that differs between paths."""

    def graph_time_us(calls, replays=25, rounds=1):
        defaults = calls[0].__defaults__
        path = "route_select" if isinstance(defaults[-1], int) else defaults[-1].__name__
        seen[path] = {call.__defaults__[0].data_ptr() for call in calls}
        return [1.0 + len(path)]

    return graph_time_us


@pytest.mark.parametrize("name", list(bench_select.MODELS))
def test_norm_alone_reads_its_input_where_the_chained_norm_does(monkeypatch, name):
    """"After a norm" subtracts the norm alone from norm + selection: both must read the same (decode-like, one buffer)
    hidden states. With rotated copies the norm alone read ROT x T x H x 2 bytes, which fit in L2 at small T, while
    the chained norm ran ~2 L2 of weights after its last use of the same copy."""
    cfg = bench_select.MODELS[name]
    monkeypatch.setattr(bench_select, "L2_BYTES", cfg["E"] * cfg["H"] * 2)  # a small rotation (3 copies)
    seen = {}
    monkeypatch.setattr(bench_select, "graph_time_us", fake_graph_time(seen))
    (row,) = bench_select.bench_model(name, cfg, replays=1, tokens=(2,), device="cpu")
    assert row["rotation"] >= 2
    for path in bench_select.NORM_PATHS:
        assert len(seen[path]) == 1, path
    for path in ("select_experts", "pytorch", "hf", "gemv_only"):
        assert len(seen[path]) == row["rotation"], path  # HBM-bound paths still rotate
    assert row["speedup_vs_pytorch_after_norm"] == pytest.approx(
        (row["norm_pytorch_us"] - row["norm_us"]) / (row["norm_select_us"] - row["norm_us"]))


def test_hf_deepseek_router_gets_fp32_weights(monkeypatch):
    """HF keeps DeepSeek-V3's gate.weight in fp32: the HF baseline must not pay a per-call bf16 -> fp32 cast."""
    cfg = bench_select.MODELS["deepseek-v3-like"]
    monkeypatch.setattr(bench_select, "L2_BYTES", cfg["E"] * cfg["H"] * 2)
    dtypes = []
    real = bench_select.hf_router
    monkeypatch.setattr(bench_select, "hf_router", lambda x, W, r, b: dtypes.append(W.dtype) or real(x, W, r, b))

    def graph_time_us(calls, replays=25, rounds=1):
        if getattr(calls[0].__defaults__[-1], "__name__", None) == "hf":
            calls[0]()
        return [2.0]

    monkeypatch.setattr(bench_select, "graph_time_us", graph_time_us)
    count = iter(range(1, 100))
    monkeypatch.setattr(bench_select, "median", lambda v: float(next(count)))  # nonzero differences
    bench_select.bench_model("deepseek-v3-like", cfg, replays=1, tokens=(2,), device="cpu")
    assert dtypes == [torch.float32]


# median microseconds of each timed path (fake_replays: the median is the time, the min half of it)
PATH_US = dict(gemv_only=1.5, route_select=1.2, select_experts=2.0, pytorch=50.0, hf=20.0, norm=3.0, norm_select=8.0,
               norm_pytorch=60.0, our_norm=2.5, our_norm_select=7.0)


def fake_replays(seen):
    """Stands in for graph_time_us: replay times around each path's PATH_US (median: it; min: half of it; mean: more),
    and records the weight sets each path's calls read."""

    def graph_time_us(calls, replays=25, rounds=1):
        defaults = calls[0].__defaults__
        path = "route_select" if isinstance(defaults[-1], int) else defaults[-1].__name__
        seen[path] = [call.__defaults__[1] for call in calls]
        us = PATH_US[path]
        return [us / 2, us, 3 * us]

    return graph_time_us


def test_selection_figures(monkeypatch, tmp_path, capsys):
    """Issue 3's figures, from main() run on the CPU with the timings faked: medians, the "after a norm" differences,
    the speed-ups (reference path / ours), the bytes of the router and predictor weights and their bandwidth."""
    cfg = bench_select.MODELS["qwen3-30b-a3b"]
    monkeypatch.setattr(bench_select, "L2_BYTES", cfg["E"] * cfg["H"] * 2)  # a small rotation (3 copies)
    seen = {}
    monkeypatch.setattr(bench_select, "graph_time_us", fake_replays(seen))
    monkeypatch.setattr(bench_select, "require_cuda", lambda script: None)
    monkeypatch.setattr(bench_select, "copy_bandwidth", lambda: 4e12)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "cpu")
    monkeypatch.setattr(torch.backends.cuda, "matmul", types.SimpleNamespace(allow_tf32=True))  # main() sets it
    bench_model = bench_select.bench_model
    monkeypatch.setattr(bench_select, "bench_model", lambda *args: bench_model(*args, device="cpu"))
    out = tmp_path / "select.json"
    monkeypatch.setattr(sys, "argv", ["bench_select.py", "--models", "qwen3-30b-a3b", "--tokens", "2",
                                      "--out", str(out)])
    bench_select.main()
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert result["copy_bandwidth_TBps"] == 4.0
    weights = seen["select_experts"][0]
    assert row["weight_bytes"] == weights["Wr"].nbytes + weights["Wp"].nbytes  # router + predictor, bf16
    rot = row["rotation"]
    assert rot * weights["Wr"].nbytes > 2 * bench_select.L2_BYTES  # HF's router alone cycles through twice the L2
    assert len({id(s) for s in seen["select_experts"]}) == rot
    assert (row["router_predict_us"], row["route_select_us"]) == (1.5, 1.2)
    assert (row["select_experts_us"], row["select_experts_us_min"], row["pytorch_us"]) == (2.0, 1.0, 50.0)
    assert row["select_experts_after_norm_us"] == pytest.approx(8.0 - 3.0)
    assert row["select_experts_after_our_norm_us"] == pytest.approx(7.0 - 3.0)  # our norm's step - torch's norm
    assert row["pytorch_after_norm_us"] == pytest.approx(60.0 - 3.0)
    assert row["speedup_vs_pytorch"] == pytest.approx(50.0 / 2.0)
    assert row["speedup_vs_pytorch_after_norm"] == pytest.approx(57.0 / 5.0)
    assert row["speedup_vs_hf_router"] == pytest.approx(20.0 / 2.0)
    assert row["weight_bandwidth_TBps"] == pytest.approx(row["weight_bytes"] / 2e-6 / 1e12)
    cells = capsys.readouterr().out.split("| qwen3-30b-a3b | 2 | ")[1].split(" | ")
    assert cells[:1] + cells[7:9] == ["2.00", "25.0x", f"{row['weight_bytes'] / 1e6:.2f} MB"]

    monkeypatch.setattr(sys, "argv", sys.argv + ["--weights", "hot"])  # weights from L2: no HBM bandwidth
    bench_select.main()
    assert json.loads(out.read_text())["rows"][0]["weight_bandwidth_TBps"] is None


@pytest.mark.parametrize("name", list(bench_select.MODELS))
def test_hf_router_routes_as_the_reference(name):
    """The HF baseline computes each model's own rule: on fp32 inputs its experts and weights are base_moe's
    reference routing's (DeepSeek-V2's groups by their best probability, ERNIE-4.5's probabilities + bias)."""
    cfg = bench_select.MODELS[name]
    E, routing, H = cfg["E"], cfg["routing"], 256
    gen = torch.Generator().manual_seed(E)
    x, Wr = torch.randn(64, H, generator=gen), torch.randn(E, H, generator=gen) / H**0.5
    bias = torch.randn(E, generator=gen) * 0.01 if cfg["bias"] else None
    ids, w = bench_select.hf_router(x, Wr, routing, bias)
    ref_ids, ref_w = reference.route(x @ Wr.T, routing, bias)
    order, ref_order = ids.argsort(dim=1), ref_ids.long().argsort(dim=1)
    assert torch.equal(ids.gather(1, order), ref_ids.long().gather(1, ref_order))
    torch.testing.assert_close(w.float().gather(1, order), ref_w.gather(1, ref_order), rtol=1e-5, atol=1e-6)
