"""bench_select's plain-PyTorch selection path (the baseline its speed-up is measured against) computes what the
ops compute: the same routing, batch cost, kept set, fill and counts as ``ops.select_experts`` on random inputs."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_select  # noqa: E402

from base_moe import ops  # noqa: E402


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
