"""Property tests of the selection ops on inputs drawn by hypothesis: the CPU kernels everywhere, the CUDA kernels
(``-m cuda``) where a GPU and base_moe's CUDA build are there."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from base_moe import Cost, Fill, Routing, Scoring, ops
from base_moe import reference as ref
from test_ops import assert_kept_matches


@st.composite
def selection_problems(draw):
    scoring = draw(st.sampled_from(list(Scoring)))
    n_group, topk_group = 1, 1
    if draw(st.booleans()):
        n_group = draw(st.sampled_from([2, 4]))
        topk_group = draw(st.integers(1, n_group))
    E = n_group * draw(st.integers(2, 16))
    k = draw(st.integers(1, min(8, E, topk_group * (E // n_group))))
    routing = Routing(k, scoring, renormalize=draw(st.booleans()), n_group=n_group, topk_group=topk_group,
                      scaling=draw(st.sampled_from([0.25, 0.5, 1.0, 2.5])))
    G = draw(st.integers(1, 4))
    B = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    if draw(st.booleans()):
        logits = torch.randint(0, 3, (G * B, E), generator=gen).float()  # many ties
    else:
        logits = torch.randn(G * B, E, generator=gen) * 3
    log_norms = torch.randn(G * B, E, generator=gen)
    # without a bias, sigmoid group scores tie as often as the logits do
    biased = scoring in (Scoring.SIGMOID, Scoring.SOFTMAX) and draw(st.booleans())  # (ERNIE-4.5: softmax + bias)
    bias = torch.randn(E, generator=gen) * 0.1 if biased else None
    return dict(
        logits=logits, log_norms=log_norms, bias=bias, routing=routing, G=G,
        budget=draw(st.integers(1, E + 2)), cost=draw(st.sampled_from(list(Cost))),
        fill=draw(st.sampled_from(list(Fill))),
    )


# every property on both kernels: the problems are drawn on the CPU and moved
DEVICES = pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])


def on(device: str, p: dict) -> dict:
    return {name: value.to(device) if isinstance(value, torch.Tensor) else value for name, value in p.items()}


def run(p, budget=None, fill=None, cost=None):
    return ops.route_select(
        p["logits"], p["routing"], budget=p["budget"] if budget is None else budget, num_groups=p["G"],
        cost=p["cost"] if cost is None else cost,
        fill=p["fill"] if fill is None else fill, log_norms=p["log_norms"], correction_bias=p["bias"],
    )


@DEVICES
@settings(max_examples=150, deadline=None)
@given(p=selection_problems())
def test_kept_sets_and_final_ids(p, device):
    p = on(device, p)
    ids, weights, kept, counts, D = run(p)
    E = p["logits"].shape[1]
    G, T = p["G"], p["logits"].shape[0]
    routed, _, _ = ops.route_cost(p["logits"], p["routing"], num_groups=G, cost=Cost.ROUTER_SUM,
                                  correction_bias=p["bias"])
    for g in range(G):
        kept_set = set(kept[g].tolist()) - {E}
        rows = slice(g * (T // G), (g + 1) * (T // G))
        union = set(routed[rows].flatten().tolist()) - {E}
        assert len(kept_set) <= p["budget"]  # at most M experts per decode batch
        assert len(kept_set) == min(p["budget"], len(union))  # the budget is used when routing needs it
        assert kept_set <= union  # never an expert nobody routed to
        assert set(ids[rows].flatten().tolist()) - {E} <= kept_set  # every final id is kept
        # kept experts come in descending cost order
        kept_costs = D[g, kept[g][kept[g] < E].long()]
        assert torch.all(kept_costs[:-1] >= kept_costs[1:])
    # each token names an expert at most once; empty slots weigh nothing; counts agree with ids
    for row, w in zip(ids.tolist(), weights):
        real = [u for u in row if u < E]
        assert len(real) == len(set(real))
        assert torch.all(w[torch.tensor(row, device=w.device) == E] == 0)
    assert counts.sum() == (ids < E).sum()


@DEVICES
@settings(max_examples=150, deadline=None)
@given(p=selection_problems())
def test_route_select_matches_the_reference(p, device):
    """The op against reference.route_select on drawn problems (every scoring, cost and fill, tied logits): the
    batch costs agree, the kept lists agree up to near-ties of the costs, and where the kept lists are equal the
    final ids, weights and counts are the reference's."""
    p = on(device, p)
    ids, weights, kept, counts, D = run(p)
    exp_ids, exp_weights, exp_kept, exp_counts, exp_D = ref.route_select(
        p["logits"], p["log_norms"], p["bias"], p["G"], p["routing"], p["cost"], p["budget"], p["fill"])
    torch.testing.assert_close(D, exp_D, atol=1e-6, rtol=1e-5)
    assert_kept_matches(kept, exp_kept, exp_D)
    if torch.equal(kept, exp_kept):
        assert torch.equal(ids, exp_ids)
        torch.testing.assert_close(weights, exp_weights, atol=1e-6, rtol=1e-5)
        assert torch.equal(counts, exp_counts)


@DEVICES
@settings(max_examples=100, deadline=None)
@given(p=selection_problems())
def test_weights_follow_the_renormalisation_rule(p, device):
    p = on(device, p)
    routing = p["routing"]
    ids, weights, *_ = run(p)
    E = p["logits"].shape[1]
    nonempty = (ids < E).any(dim=1)
    total = weights.sum(dim=1)
    if p["fill"] == Fill.BACKFILL and (routing.renormalize or routing.scoring == Scoring.SOFTMAX_AFTER_TOPK):
        torch.testing.assert_close(total[nonempty], torch.full_like(total[nonempty], routing.scaling))
    if p["fill"] == Fill.DROP_RENORM:
        _, routed_w, _ = ops.route_cost(p["logits"], routing, num_groups=p["G"], cost=Cost.ROUTER_SUM,
                                        correction_bias=p["bias"])
        torch.testing.assert_close(total[nonempty], routed_w.sum(dim=1)[nonempty])
    if p["fill"] == Fill.DROP:
        _, routed_w, _ = ops.route_cost(p["logits"], routing, num_groups=p["G"], cost=Cost.ROUTER_SUM,
                                        correction_bias=p["bias"])
        assert torch.all(total <= routed_w.sum(dim=1) + 1e-6)


@DEVICES
@settings(max_examples=100, deadline=None)
@given(p=selection_problems())
def test_budget_of_all_experts_is_dense_routing(p, device):
    p = on(device, p)
    E = p["logits"].shape[1]
    routed, routed_w, _ = ops.route_cost(p["logits"], p["routing"], num_groups=p["G"], cost=Cost.ROUTER_SUM,
                                         correction_bias=p["bias"])
    for fill in Fill:
        ids, weights, *_ = run(p, budget=E, fill=fill)
        assert torch.equal(ids, routed)
        assert torch.equal(weights, routed_w)


@DEVICES
@settings(max_examples=60, deadline=None)
@given(p=selection_problems())
def test_top_budget_minimises_the_dropped_cost(p, device):
    """Top-M by D is the exact minimiser of the summed cost of the routed experts left out."""
    p = on(device, p)
    ids, weights, kept, counts, D = run(p)
    E = p["logits"].shape[1]
    routed, _, _ = ops.route_cost(p["logits"], p["routing"], num_groups=p["G"], cost=Cost.ROUTER_SUM,
                                  correction_bias=p["bias"])
    T = routed.shape[0]
    for g in range(p["G"]):
        union = sorted(set(routed[g * (T // p["G"]):(g + 1) * (T // p["G"])].flatten().tolist()) - {E})
        kept_set = set(kept[g].tolist()) - {E}
        left_out = sum(D[g, u].item() for u in union if u not in kept_set)
        best_possible = sum(sorted(D[g, union].tolist())[: max(0, len(union) - p["budget"])])
        assert left_out <= best_possible * (1 + 1e-6) + 1e-12


@DEVICES
@settings(max_examples=60, deadline=None)
@given(p=selection_problems(), H=st.integers(1, 48), router_bias=st.booleans())
def test_select_experts_is_router_predict_then_route_select(p, H, router_bias, device):
    """The fused op returns stage 1's outputs and stages 2-3 computed on them, for every routing, cost and fill."""
    p = on(device, p)
    T, E = p["logits"].shape
    gen = torch.Generator().manual_seed(H)
    hidden = torch.randn(T, H, generator=gen).to(device)
    wr, wp = torch.randn(E, H, generator=gen).to(device), torch.randn(E, H, generator=gen).to(device)
    br = torch.randn(E, generator=gen).to(device) if router_bias else None
    bp = torch.randn(E, generator=gen).to(device)
    predict = p["cost"] == Cost.BASE or H % 2 == 0  # the predictor is optional for the other costs
    out = ops.select_experts(
        hidden, wr, p["routing"], budget=p["budget"], num_groups=p["G"], cost=p["cost"], fill=p["fill"],
        router_bias=br, predictor_weight=wp if predict else None, predictor_bias=bp if predict else None,
        correction_bias=p["bias"],
    )
    logits, log_norms = ops.router_predict(hidden, wr, br, wp if predict else None, bp if predict else None)
    staged = ops.route_select(
        logits, p["routing"], budget=p["budget"], num_groups=p["G"], cost=p["cost"], fill=p["fill"],
        log_norms=log_norms if p["cost"] == Cost.BASE else None, correction_bias=p["bias"],
    )
    for got, expected in zip(out, (logits, log_norms, *staged)):
        assert torch.equal(got, expected)
