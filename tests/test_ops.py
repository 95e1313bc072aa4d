"""Every op against base_moe.reference, on every device the build has; opcheck; argument errors.

Indices (routing ids, kept sets, counts) must be equal exactly; float outputs within tolerances of
fp32 accumulation. Selection that depends on float costs (route_select) is compared position by position, exactly
unless the two experts at a position have reference costs within 1e-5 of each other (a near-tie).
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from base_moe import Cost, Fill, Routing, Scoring, ops
from base_moe import reference as ref
from base_moe.routing import MAX_EXPERTS

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]

BIASED_SOFTMAX = Routing(6, Scoring.SOFTMAX, renormalize=True, scaling=1.0)
"""ERNIE-4.5-21B-A3B's rule: softmax probabilities + a selection bias, top-6 of 64, renormalised (random_bias)."""

# (E, k, routing) combinations covering every scoring rule
ROUTINGS = [
    (8, 2, Routing(2, Scoring.SOFTMAX, renormalize=True)),
    (16, 4, Routing(4, Scoring.SOFTMAX, renormalize=False, scaling=2.5)),
    (60, 4, Routing(4, Scoring.SOFTMAX, renormalize=True)),
    (128, 8, Routing(8, Scoring.SOFTMAX, renormalize=True)),
    (32, 4, Routing(4, Scoring.SOFTMAX_AFTER_TOPK)),
    (64, 6, Routing(6, Scoring.SIGMOID, renormalize=True, n_group=8, topk_group=4, scaling=2.5)),
    (16, 3, Routing(3, Scoring.SIGMOID, renormalize=False)),
    (24, 4, Routing(4, Scoring.SOFTMAX, renormalize=True, scaling=0.5)),  # TOP1_UNION's offset: max(1, scaling)
    (64, 6, BIASED_SOFTMAX),
]


def random_logits(T: int, E: int, device: str, ties: bool) -> torch.Tensor:
    """Random logits; with ``ties``, drawn from a few values so equal logits are common."""
    if ties:
        return torch.randint(0, 3, (T, E), device=device).float()
    return torch.randn(T, E, device=device) * 2.0


def random_bias(routing: Routing, E: int, device: str) -> torch.Tensor | None:
    """A selection bias for the sigmoid rules and BIASED_SOFTMAX (of the scale of its probabilities, ~1 / E)."""
    if routing == BIASED_SOFTMAX:
        return torch.randn(E, device=device) * 0.01
    return torch.randn(E, device=device) * 0.05 if routing.scoring == Scoring.SIGMOID else None


def assert_kept_matches(kept: torch.Tensor, kept_ref: torch.Tensor, D_ref: torch.Tensor, rel: float = 1e-5):
    """kept equals the reference's kept list, except at positions where the two experts' reference batch costs are
    within ``rel`` of each other (a near-tie that fp32 rounding of exp-derived costs may flip)."""
    E = D_ref.shape[1]
    kept, kept_ref, D_ref = kept.cpu(), kept_ref.cpu(), D_ref.double().cpu()
    assert kept.shape == kept_ref.shape
    for g in range(kept.shape[0]):
        for i in torch.nonzero(kept[g] != kept_ref[g]).flatten().tolist():
            a, b = int(kept[g, i]), int(kept_ref[g, i])
            assert a < E and b < E, f"group {g} slot {i}: kept {a}, reference {b} (sentinel mismatch)"
            da, db = float(D_ref[g, a]), float(D_ref[g, b])
            assert abs(da - db) <= rel * max(abs(da), abs(db)), (
                f"group {g} slot {i}: kept expert {a} (D={da}) but the reference keeps {b} (D={db})"
            )


# ---------------------------------------------------------------------------------------------
# router_predict
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H,E", [(1, 64, 8), (7, 128, 60), (64, 256, 128), (300, 512, 32)])
@pytest.mark.parametrize("with_predictor", [True, False])
def test_router_predict_matches_reference(device, dtype, T, H, E, with_predictor):
    x = torch.randn(T, H, device=device).to(dtype)
    wr = (torch.randn(E, H, device=device) / H**0.5).to(dtype)
    br = torch.randn(E, device=device)
    wp = (torch.randn(E, H, device=device) / H**0.5).to(dtype) if with_predictor else None
    bp = torch.randn(E, device=device) if with_predictor else None
    logits, log_norms = ops.router_predict(x, wr, br, wp, bp)
    exp_logits, exp_norms = ref.router_predict(x.double(), wr.double(), br.double(),
                                               None if wp is None else wp.double(),
                                               None if bp is None else bp.double())
    assert logits.dtype == torch.float32 and logits.shape == (T, E)
    # fp32 accumulation of products of exactly representable inputs: error ~ H * eps32 * |x||w|
    tol = 1e-5 * H**0.5
    torch.testing.assert_close(logits.double(), exp_logits.to(device).double(), atol=tol, rtol=1e-5)
    if with_predictor:
        torch.testing.assert_close(log_norms.double(), exp_norms.to(device).double(), atol=tol, rtol=1e-5)
    else:
        assert log_norms.shape == (T, 0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H,E", [(1, 64, 8), (16, 2048, 128), (300, 512, 32), (5, 100, 12)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_router_predict_round_logits(device, dtype, T, H, E, with_bias):
    """round_logits rounds each logit (with its bias) once to hidden's dtype: the fp32 sum of the same call without it,
    rounded (the same kernel: the same sum), within half a step of the reference's; the log-norms stay fp32 sums.
    (H = 100: CUDA's fp32 FMA kernel, not the tensor-core one.)"""
    g = torch.Generator().manual_seed(T * H + E)
    x = torch.randn(T, H, generator=g).to(device=device, dtype=dtype)
    wr = (torch.randn(E, H, generator=g) / H**0.5).to(device=device, dtype=dtype)
    br = torch.randn(E, generator=g).to(device).to(dtype).float() if with_bias else None
    wp = (torch.randn(E, H, generator=g) / H**0.5).to(device=device, dtype=dtype)
    bp = torch.randn(E, generator=g).to(device)
    exact, exact_norms = ops.router_predict(x, wr, br, wp, bp)
    rounded, norms = ops.router_predict(x, wr, br, wp, bp, round_logits=True)
    assert rounded.dtype == torch.float32 and torch.equal(norms, exact_norms)
    assert torch.equal(rounded, exact.to(dtype).float())
    expected, _ = ref.router_predict(x, wr, br, wp, bp, round_logits=True)
    # a step of the type, or the fp32 sums' difference (test_router_predict_matches_reference's) where the logit is
    # so small that that difference spans more than a step
    step = torch.finfo(dtype).eps * expected.abs() + 1e-5 * H**0.5
    assert bool(((rounded - expected).abs() <= step).all())
    if dtype != torch.float32:  # (the reference's own check: a rounded logit is a value of the half type)
        assert torch.equal(expected, expected.to(dtype).float()) and not torch.equal(exact, rounded)


def test_round_logits_takes_a_bool():
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    for value in (1, torch.tensor(True)):
        with pytest.raises(TypeError, match="round_logits must be a bool"):
            ops.router_predict(x, w, round_logits=value)
    with pytest.raises(TypeError, match="round_logits must be a bool"):
        ops.select_experts(x, w, Routing(2), budget=2, cost="router_sum", round_logits=0)


# ---------------------------------------------------------------------------------------------
# route_cost
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E,k,routing", ROUTINGS)
@pytest.mark.parametrize("cost", list(Cost))
@pytest.mark.parametrize("ties", [False, True])
def test_route_cost_matches_reference(device, E, k, routing, cost, ties):
    G, B = 3, 5
    logits = random_logits(G * B, E, device, ties)
    log_norms = torch.randn(G * B, E, device=device)
    bias = random_bias(routing, E, device)
    ids, weights, D = ops.route_cost(logits, routing, num_groups=G, cost=cost, log_norms=log_norms,
                                     correction_bias=bias)
    exp_ids, exp_weights, exp_D = ref.route_cost(logits.cpu(), log_norms.cpu(), None if bias is None else bias.cpu(),
                                                 G, routing, cost)
    assert ids.dtype == torch.int32 and ids.shape == (G * B, k)
    assert torch.equal(ids.cpu(), exp_ids)
    torch.testing.assert_close(weights.cpu(), exp_weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(D.cpu(), exp_D, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_route_cost_accepts_broadcast_log_norms(device):
    """static_energy passes one per-expert row expanded over the tokens (row stride 0)."""
    routing = Routing(4, Scoring.SOFTMAX, renormalize=True)
    logits = torch.randn(8, 16, device=device)
    static = torch.randn(1, 16, device=device)
    _, _, D = ops.route_cost(logits, routing, num_groups=2, log_norms=static.expand(8, 16))
    _, _, exp_D = ops.route_cost(logits, routing, num_groups=2, log_norms=static.expand(8, 16).contiguous())
    assert torch.equal(D, exp_D)


@pytest.mark.parametrize("device", DEVICES)
def test_route_cost_accepts_one_expert_log_norms_of_any_column_stride(device):
    """With one expert, [T, 1] log-norms are contiguous whatever their column stride, as torch counts them (a
    transposed [1, T] row has stride T there)."""
    routing = Routing(1, Scoring.SOFTMAX)
    logits = torch.randn(6, 1, device=device)
    transposed = torch.randn(1, 6, device=device).t()
    packed = torch.empty(6, 1, device=device).copy_(transposed)
    assert transposed.stride(1) == 6 and packed.stride(1) == 1
    _, _, D = ops.route_cost(logits, routing, num_groups=3, log_norms=transposed)
    _, _, exp_D = ops.route_cost(logits, routing, num_groups=3, log_norms=packed)
    assert torch.equal(D, exp_D)


# ---------------------------------------------------------------------------------------------
# select_fill and route_select
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E,k,routing", ROUTINGS)
@pytest.mark.parametrize("fill", list(Fill))
@pytest.mark.parametrize("budget_fraction", [0.0, 0.25, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("ties", [False, True])
def test_select_fill_matches_reference(device, E, k, routing, fill, budget_fraction, ties):
    G, B = 4, 6
    budget = max(1, int(budget_fraction * E))
    logits = random_logits(G * B, E, device, ties)
    bias = random_bias(routing, E, device)
    D = torch.rand(G, E, device=device)
    if ties:
        D = (D * 3).floor()
    cpu_bias = None if bias is None else bias.cpu()
    ids, weights, kept, counts = ops.select_fill(logits, D, routing, budget=budget, fill=fill, correction_bias=bias)
    exp = ref.select_fill(logits.cpu(), D.cpu(), cpu_bias, routing, budget, fill)
    assert kept.shape == (G, min(budget, E)) and counts.shape == (G, E)
    assert torch.equal(kept.cpu(), exp[2])
    assert torch.equal(ids.cpu(), exp[0])
    assert torch.equal(counts.cpu(), exp[3])
    torch.testing.assert_close(weights.cpu(), exp[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E,k,routing", ROUTINGS)
@pytest.mark.parametrize("cost,fill", [(Cost.BASE, Fill.BACKFILL), (Cost.ROUTER_SUM, Fill.DROP),
                                       (Cost.TOP1_UNION, Fill.DROP_RENORM), (Cost.FREQUENCY, Fill.BACKFILL),
                                       (Cost.ROUTER_SQ, Fill.BACKFILL)])
@pytest.mark.parametrize("G,B,budget", [(1, 1, 1), (2, 16, 3), (5, 7, 8), (1, 64, 1000)])
def test_route_select_matches_reference(device, E, k, routing, cost, fill, G, B, budget):
    logits = random_logits(G * B, E, device, ties=False)
    log_norms = torch.randn(G * B, E, device=device)
    bias = random_bias(routing, E, device)
    cpu_bias = None if bias is None else bias.cpu()
    ids, weights, kept, counts, D = ops.route_select(logits, routing, budget=budget, num_groups=G, cost=cost,
                                                     fill=fill, log_norms=log_norms, correction_bias=bias)
    exp_ids, exp_w, exp_kept, exp_counts, exp_D = ref.route_select(logits.cpu(), log_norms.cpu(), cpu_bias, G,
                                                                   routing, cost, budget, fill)
    torch.testing.assert_close(D.cpu(), exp_D, atol=1e-6, rtol=1e-5)
    assert_kept_matches(kept, exp_kept, exp_D)
    # given the op's own kept sets, the fill is exact
    fill_ids, fill_w = ref.fill(logits.cpu(), cpu_bias, routing, kept.cpu(), fill)
    assert torch.equal(ids.cpu(), fill_ids)
    torch.testing.assert_close(weights.cpu(), fill_w, atol=1e-6, rtol=1e-5)
    assert torch.equal(counts.cpu(), ref.expert_counts(ids.cpu(), G, E))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens_per_group", [5, 40, 100])
@pytest.mark.parametrize("second_logit,second_cost", [(150.0, 0.0), (240.0, 0.0), (260.0, float("inf"))])
def test_base_cost_of_tiny_weights_on_huge_log_norms(device, tokens_per_group, second_logit, second_cost):
    """Every token routes expert 6 (logit 300: weight 1, log-norm 0, cost 1) and experts 0 and 3 (second_logit,
    log-norm 50: exp(2 x 50) = inf in fp32). Their weight is 0 (gap 150), or ~1e-26 with a square of 0 (gap 60): the
    slots cost 0, not 0 x inf = NaN. At gap 40 the square is ~2e-35 and the cost inf, which ranks first, ties to the
    lower index. Through route_select (several of its CUDA instances, by tokens per group) and select_experts (logits
    and log-norms made by the GEMV)."""
    G, E, H, k = 2, 8, 64, 3
    T = G * tokens_per_group
    routing = Routing(k, Scoring.SOFTMAX)
    x = torch.ones(T, H, dtype=torch.bfloat16, device=device)
    wr = torch.zeros(E, H, dtype=torch.bfloat16, device=device)
    wr[6] = 300.0 / H  # exact in bf16, as are the second logits / H: the logits are exactly these values
    wr[[0, 3]] = second_logit / H
    wp = torch.zeros(E, H, dtype=torch.bfloat16, device=device)
    bp = torch.full((E,), 50.0, device=device)
    bp[6] = 0.0
    logits, log_norms = ops.router_predict(x, wr, None, wp, bp)
    expected_D = torch.zeros(G, E)
    expected_D[:, 6] = tokens_per_group
    expected_D[:, [0, 3]] = second_cost
    union = torch.zeros(G, E, dtype=torch.bool)
    union[:, [0, 3, 6]] = True
    _, _, ref_D = ref.route_cost(logits.cpu(), log_norms.cpu(), None, G, routing, Cost.BASE)
    assert torch.equal(ref_D, expected_D)
    for budget in (1, 2, E):
        expected_kept = ref.keep_experts(expected_D, union, budget)
        fused = ops.route_select(logits, routing, budget=budget, num_groups=G, log_norms=log_norms)
        selected = ops.select_experts(x, wr, routing, budget=budget, num_groups=G, predictor_weight=wp,
                                      predictor_bias=bp)
        for kept, D in ((fused[2], fused[4]), (selected[4], selected[6])):
            assert torch.equal(D.cpu(), expected_D)
            assert torch.equal(kept.cpu(), expected_kept)


def assert_stages_give_route_select(logits, routing, budget, num_groups, cost, fill, log_norms, bias, voting):
    """route_cost, then select_fill on its batch cost, with the same flags: route_select's outputs bit for bit."""
    fused = ops.route_select(logits, routing, budget=budget, num_groups=num_groups, cost=cost, fill=fill,
                             log_norms=log_norms, correction_bias=bias, voting=voting)
    D = ops.route_cost(logits, routing, num_groups=num_groups, cost=cost, log_norms=log_norms, correction_bias=bias,
                       voting=voting)[2]
    staged = ops.select_fill(logits, D, routing, budget=budget, fill=fill, correction_bias=bias, voting=voting)
    for a, b in zip((*staged, D), fused):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_route_select_equals_its_stages(device):
    routing = Routing(8, Scoring.SOFTMAX, renormalize=True)
    logits = torch.randn(32, 128, device=device)
    log_norms = torch.randn(32, 128, device=device)
    assert_stages_give_route_select(logits, routing, 16, 2, Cost.BASE, Fill.BACKFILL, log_norms, None, None)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E,k,routing", ROUTINGS)
@pytest.mark.parametrize("cost,fill,predict", [(Cost.BASE, Fill.BACKFILL, True), (Cost.ROUTER_SUM, Fill.DROP, False),
                                               (Cost.TOP1_UNION, Fill.DROP_RENORM, True)])
@pytest.mark.parametrize("round_logits", [False, True])
def test_select_experts_equals_router_predict_then_route_select(device, E, k, routing, cost, fill, predict,
                                                                round_logits):
    """select_experts returns stage 1's outputs (round_logits passed on) and stages 2-3 run on them."""
    G, B, H = 2, 9, 64
    x = torch.randn(G * B, H, device=device).to(torch.bfloat16)
    wr = (torch.randn(E, H, device=device) / H**0.5).to(torch.bfloat16)
    wp = (torch.randn(E, H, device=device) / H**0.5).to(torch.bfloat16) if predict else None
    bp = torch.randn(E, device=device) if predict else None
    bias = random_bias(routing, E, device)
    out = ops.select_experts(x, wr, routing, budget=max(1, E // 3), num_groups=G, cost=cost, fill=fill,
                             predictor_weight=wp, predictor_bias=bp, correction_bias=bias, round_logits=round_logits)
    logits, log_norms = out[0], out[1]
    exp_logits, exp_norms = ops.router_predict(x, wr, None, wp, bp, round_logits=round_logits)
    assert torch.equal(logits, exp_logits) and torch.equal(log_norms, exp_norms)  # the same kernels, deterministic
    staged = ops.route_select(logits, routing, budget=max(1, E // 3), num_groups=G, cost=cost, fill=fill,
                              log_norms=log_norms if cost == Cost.BASE else None, correction_bias=bias)
    for a, b in zip(out[2:], staged):
        assert torch.equal(a, b)


def test_select_experts_base_cost_needs_predictor():
    x, w = torch.randn(4, 32), torch.randn(8, 32)
    with pytest.raises(RuntimeError, match="predictor_weight"):
        ops.select_experts(x, w, Routing(2), budget=4, cost=Cost.BASE)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E,k,routing", ROUTINGS)
def test_no_budget_reproduces_model_routing(device, E, k, routing):
    logits = random_logits(24, E, device, ties=False)
    bias = random_bias(routing, E, device)
    exp_ids, exp_w = ops.route_cost(logits, routing, num_groups=3, cost=Cost.ROUTER_SUM, correction_bias=bias)[:2]
    for budget in (E, E + 5):
        ids, w, *_ = ops.route_select(logits, routing, budget=budget, num_groups=3, cost=Cost.ROUTER_SUM,
                                      correction_bias=bias)
        assert torch.equal(ids, exp_ids)
        assert torch.equal(w, exp_w)


@pytest.mark.parametrize("device", DEVICES)
def test_selection_is_deterministic(device):
    routing = Routing(8, Scoring.SOFTMAX, renormalize=True)
    logits = torch.randn(256, 128, device=device)
    log_norms = torch.randn(256, 128, device=device)
    first = ops.route_select(logits, routing, budget=16, num_groups=4, log_norms=log_norms)
    for _ in range(3):
        again = ops.route_select(logits, routing, budget=16, num_groups=4, log_norms=log_norms)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


# ---------------------------------------------------------------------------------------------
# experts
# ---------------------------------------------------------------------------------------------
def random_expert_problem(T, H, I, E, k, device, dtype, drop_fraction=0.2):
    x = torch.randn(T, H, device=device).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, device=device) / H**0.5).to(dtype)
    down = (torch.randn(E, H, I, device=device) / I**0.5).to(dtype)
    ids = torch.stack([torch.randperm(E, device=device)[:k] for _ in range(T)]).to(torch.int32)
    weights = torch.rand(T, k, device=device)
    dropped = torch.rand(T, k, device=device) < drop_fraction
    ids = torch.where(dropped, E, ids).to(torch.int32)
    weights = torch.where(dropped, 0.0, weights)
    return x, ids, weights, gate_up, down


@pytest.mark.parametrize("T,H,I,E,k", [(1, 64, 32, 4, 2), (9, 128, 64, 8, 3), (33, 64, 128, 16, 8)])
def test_experts_matches_reference_fp32(T, H, I, E, k):
    """The CPU op in fp32 (the CUDA kernel is bf16/fp16 only: tests/test_experts_cuda.py checks it)."""
    x, ids, weights, gate_up, down = random_expert_problem(T, H, I, E, k, "cpu", torch.float32)
    out = ops.experts(x, ids, weights, gate_up, down)
    expected = ref.experts(x.double(), ids, weights.double(), gate_up.double(), down.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_reference_experts_adds_nothing_for_an_id_outside_the_experts():
    """The reference reads a negative id as no expert (as the CUDA kernel reads any id outside [0, E)), not as the
    last expert through Python's negative indexing."""
    x, ids, weights, gate_up, down = random_expert_problem(5, 64, 32, 4, 2, "cpu", torch.float32)
    weights[1, 0] = 1.0  # (a slot the problem may have dropped: with weight 0 any expert would add nothing)
    with_sentinel, with_negative, with_last = ids.clone(), ids.clone(), ids.clone()
    with_sentinel[1, 0], with_negative[1, 0], with_last[1, 0] = 4, -1, 3
    out = ref.experts(x, with_negative, weights, gate_up, down)
    assert torch.equal(out, ref.experts(x, with_sentinel, weights, gate_up, down))
    assert not torch.equal(out, ref.experts(x, with_last, weights, gate_up, down))


def test_experts_sums_a_tokens_slots_in_fp32_on_cpu():
    """bf16 on the CPU: a token's two slots are two copies of one expert with weights a and -a (1 - 2^-9), so their
    sum is a 2^-9 (a tiny fraction of either). Summed in fp32 and rounded once, the output is within bf16 rounding of
    the fp64 reference; rounding each slot to bf16 first would leave errors as large as the result."""
    g = torch.Generator().manual_seed(3)
    T, H, I = 6, 64, 32
    x = torch.randn(T, H, generator=g).bfloat16()
    gate_up = (torch.randn(1, 2 * I, H, generator=g) / H**0.5).bfloat16().repeat(2, 1, 1)
    down = (torch.randn(1, H, I, generator=g) / I**0.5).bfloat16().repeat(2, 1, 1)
    ids = torch.tensor([[0, 1]] * T, dtype=torch.int32)
    a = 1.0 + torch.rand(T, generator=g)
    weights = torch.stack([a, -a * (1.0 - 2.0**-9)], dim=1)
    out = ops.experts(x, ids, weights, gate_up, down)
    expected = ref.experts(x.double(), ids, weights.double(), gate_up.double(), down.double())
    assert ((out.double() - expected).norm() / expected.norm()).item() < 2e-2


@pytest.mark.parametrize("device", DEVICES)
def test_experts_all_slots_dropped_gives_zero(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x, ids, weights, gate_up, down = random_expert_problem(5, 64, 64, 4, 2, device, dtype, drop_fraction=1.0)
    assert torch.equal(ops.experts(x, ids, weights, gate_up, down), torch.zeros_like(x))


# ---------------------------------------------------------------------------------------------
# rms_norm and add_rms_norm (their CUDA kernel: tests/test_norm_cuda.py)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H", [(1, 64), (5, 7), (33, 2048), (2, 0)])
def test_rms_norm_matches_reference_on_cpu(dtype, T, H):
    gen = torch.Generator().manual_seed(T * 1000 + H)
    hidden = (torch.randn(T, H, generator=gen) * 3.0).to(dtype)
    weight = (torch.rand(H, generator=gen) + 0.5).to(dtype)
    out = ops.rms_norm(hidden, weight, 1e-6)
    assert out.dtype == dtype and out.shape == (T, H)
    torch.testing.assert_close(out, ref.rms_norm(hidden, weight, 1e-6), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H", [(1, 64), (5, 7), (33, 2048), (2, 0)])
def test_add_rms_norm_matches_reference_on_cpu(dtype, T, H):
    gen = torch.Generator().manual_seed(T * 1000 + H + 1)
    hidden, residual = ((torch.randn(T, H, generator=gen) * 3.0).to(dtype) for _ in range(2))
    weight = (torch.rand(H, generator=gen) + 0.5).to(dtype)
    normed, total = ops.add_rms_norm(hidden, residual, weight, 1e-6)
    want_normed, want_total = ref.add_rms_norm(hidden, residual, weight, 1e-6)
    assert normed.dtype == total.dtype == dtype and normed.shape == total.shape == (T, H)
    assert torch.equal(total, want_total) and torch.equal(normed, want_normed)


# ---------------------------------------------------------------------------------------------
# voting: only some tokens choose the kept set (a finished sequence's pad tokens do not)
# ---------------------------------------------------------------------------------------------
def random_voting(T: int, num_groups: int, device: str, generator: torch.Generator | None = None) -> torch.Tensor:
    """About half the tokens vote; in every group of more than one token the first votes and the last does not."""
    voting = torch.rand(T, generator=generator) < 0.5
    B = T // num_groups
    voting[::B] = True
    if B > 1:
        voting[B - 1 :: B] = False
    return voting.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E,k,routing", ROUTINGS)
@pytest.mark.parametrize("cost", list(Cost))
@pytest.mark.parametrize("fill", list(Fill))
def test_voting_matches_reference(device, E, k, routing, cost, fill):
    G, B, budget = 3, 11, max(1, E // 4)
    logits = random_logits(G * B, E, device, ties=False)
    log_norms = torch.randn(G * B, E, device=device)
    bias = random_bias(routing, E, device)
    voting = random_voting(G * B, G, device)
    cpu_bias = None if bias is None else bias.cpu()
    ids, weights, kept, counts, D = ops.route_select(logits, routing, budget=budget, num_groups=G, cost=cost,
                                                     fill=fill, log_norms=log_norms, correction_bias=bias,
                                                     voting=voting)
    exp_D = ref.route_cost(logits.cpu(), log_norms.cpu(), cpu_bias, G, routing, cost, voting.cpu())[2]
    exp_kept = ref.select_fill(logits.cpu(), exp_D, cpu_bias, routing, budget, fill, voting.cpu())[2]
    torch.testing.assert_close(D.cpu(), exp_D, atol=1e-6, rtol=1e-5)
    assert_kept_matches(kept, exp_kept, exp_D)
    fill_ids, fill_w = ref.fill(logits.cpu(), cpu_bias, routing, kept.cpu(), fill)  # every token, from the kept set
    assert torch.equal(ids.cpu(), fill_ids)
    torch.testing.assert_close(weights.cpu(), fill_w, atol=1e-6, rtol=1e-5)
    assert torch.equal(counts.cpu(), ref.expert_counts(ids.cpu(), G, E))
    assert_stages_give_route_select(logits, routing, budget, G, cost, fill, log_norms, bias, voting)


# Tokens per group that reach each CUDA instance of the selection kernel for the expert counts of its instances
# (experts per lane 1, 2, 4, 8, 8 with E >= 256, 16; CTAs of 4 warps at 9-64 tokens, 8 at 65-128 and 16 else for E
# 65-256, 8 for E > 256), with each plan (one chunk of up to 32 tokens, one chunk of more, several chunks).
VOTING_SHAPES = [(E, B) for E in (32, 60, 128, 200, 256, 512) for B in (5, 24, 50, 100, 200, 700)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E,B", VOTING_SHAPES)
@pytest.mark.parametrize("cost,fill", [(Cost.BASE, Fill.BACKFILL), (Cost.ROUTER_SUM, Fill.DROP),
                                       (Cost.ROUTER_SQ, Fill.DROP_RENORM), (Cost.FREQUENCY, Fill.BACKFILL),
                                       (Cost.TOP1_UNION, Fill.BACKFILL)])
def test_voting_tokens_get_what_they_get_alone(device, E, B, cost, fill):
    """Per group, the voting tokens of a step get bit for bit the ids, weights, kept set and batch cost they get as a
    group of their own (which the kernels run on another instance); the others are filled from that kept set. The
    stages with the flags (route_cost, then select_fill) give the fused op's outputs."""
    G, k = 2, 8 if E >= 128 else 4
    routing = Routing(k, Scoring.SOFTMAX, renormalize=True)
    gen = torch.Generator().manual_seed(E * 1000 + B)
    logits = (torch.randn(G * B, E, generator=gen) * 2).to(device)
    log_norms = torch.randn(G * B, E, generator=gen).to(device)
    voting = random_voting(G * B, G, device, gen)
    budget = 12
    ids, weights, kept, counts, D = ops.route_select(logits, routing, budget=budget, num_groups=G, cost=cost,
                                                     fill=fill, log_norms=log_norms, voting=voting)
    for g in range(G):
        rows = torch.arange(g * B, (g + 1) * B, device=device)
        rows = rows[voting[rows]]
        alone = ops.route_select(logits[rows], routing, budget=budget, num_groups=1, cost=cost, fill=fill,
                                 log_norms=log_norms[rows])
        assert torch.equal(ids[rows], alone[0]) and torch.equal(weights[rows], alone[1])
        assert torch.equal(kept[g], alone[2][0]) and torch.equal(D[g], alone[4][0])
    assert_stages_give_route_select(logits, routing, budget, G, cost, fill, log_norms, None, voting)
    # select_experts' voting is route_select's on its own logits
    H = 64
    x = torch.randn(G * B, H, generator=gen).to(device, torch.bfloat16)
    wr, wp = ((torch.randn(E, H, generator=gen) / H**0.5).to(device, torch.bfloat16) for _ in range(2))
    bp = torch.randn(E, generator=gen).to(device)
    out = ops.select_experts(x, wr, routing, budget=budget, num_groups=G, cost=cost, fill=fill, predictor_weight=wp,
                             predictor_bias=bp, voting=voting)
    staged = ops.route_select(out[0], routing, budget=budget, num_groups=G, cost=cost, fill=fill,
                              log_norms=out[1] if cost == Cost.BASE else None, voting=voting)
    for a, b in zip(out[2:], staged):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cost", list(Cost))
def test_voting_all_true_is_no_flags_and_no_voter_keeps_nothing(device, cost):
    """Flags that are all True give no flags' bits; a group without a voting token has no candidate: it keeps nothing,
    costs nothing, and its tokens' slots are all empty (backfill) or dropped, while the other group is unchanged."""
    G, B, E = 2, 20, 64
    routing = Routing(4, Scoring.SOFTMAX, renormalize=True)
    logits = torch.randn(G * B, E, device=device)
    log_norms = torch.randn(G * B, E, device=device)
    plain = ops.route_select(logits, routing, budget=8, num_groups=G, cost=cost, log_norms=log_norms)
    every = ops.route_select(logits, routing, budget=8, num_groups=G, cost=cost, log_norms=log_norms,
                             voting=torch.ones(G * B, dtype=torch.bool, device=device))
    for a, b in zip(plain, every):
        assert torch.equal(a, b)
    voting = torch.ones(G * B, dtype=torch.bool, device=device)
    voting[B:] = False
    ids, weights, kept, counts, D = ops.route_select(logits, routing, budget=8, num_groups=G, cost=cost,
                                                     log_norms=log_norms, voting=voting)
    assert torch.equal(kept[1].cpu(), torch.full((8,), E, dtype=torch.int32))
    assert torch.equal(D[1].cpu(), torch.zeros(E)) and torch.equal(counts[1].cpu(), torch.zeros(E, dtype=torch.int32))
    assert (ids[B:] == E).all() and (weights[B:] == 0).all()
    first_group = (ids[:B], weights[:B], kept[0], counts[0], D[0])
    for a, b in zip(first_group, (plain[0][:B], plain[1][:B], plain[2][0], plain[3][0], plain[4][0])):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# opcheck: schema, fake tensor and autograd registration of every op
# ---------------------------------------------------------------------------------------------
def opcheck_cases(device):
    routing = Routing(4, Scoring.SOFTMAX, renormalize=True)
    args = routing.op_args()
    logits = torch.randn(8, 16, device=device)
    log_norms = torch.randn(8, 16, device=device)
    D = torch.rand(2, 16, device=device)
    x, ids, w, gate_up, down = random_expert_problem(
        6, 64, 64, 4, 2, device, torch.float32 if device == "cpu" else torch.bfloat16)
    hidden = torch.randn(8, 64, device=device)
    yield torch.ops.base_moe.router_predict.default, (hidden, torch.randn(16, 64, device=device), None,
                                                      torch.randn(16, 64, device=device),
                                                      torch.randn(16, device=device))
    yield torch.ops.base_moe.route_cost.default, (logits, log_norms, None, 2, *args, int(Cost.BASE))
    yield torch.ops.base_moe.select_fill.default, (logits, D, None, *args, 5, int(Fill.BACKFILL))
    yield torch.ops.base_moe.route_select.default, (logits, log_norms, None, 2, *args, int(Cost.BASE), 5,
                                                    int(Fill.DROP))
    voting = torch.rand(8, device=device) < 0.5
    yield torch.ops.base_moe.route_cost.default, (logits, None, None, 2, *args, int(Cost.TOP1_UNION), voting)
    yield torch.ops.base_moe.select_fill.default, (logits, D, None, *args, 5, int(Fill.DROP), voting)
    yield torch.ops.base_moe.route_select.default, (logits, log_norms, None, 2, *args, int(Cost.BASE), 5,
                                                    int(Fill.BACKFILL), voting)
    bf16 = hidden.to(torch.bfloat16)
    wr, wp = (torch.randn(16, 64, device=device).to(torch.bfloat16) for _ in range(2))
    yield torch.ops.base_moe.select_experts.default, (bf16, wr, None, wp, torch.randn(16, device=device), None, 2,
                                                      *args, int(Cost.BASE), 5, int(Fill.BACKFILL), voting)
    yield torch.ops.base_moe.select_experts.default, (bf16, wr, None, wp, torch.randn(16, device=device), None, 2,
                                                      *args, int(Cost.BASE), 5, int(Fill.BACKFILL))
    yield torch.ops.base_moe.select_experts.default, (bf16, wr, None, None, None, None, 1, *args,
                                                      int(Cost.FREQUENCY), 3, int(Fill.DROP))
    # round_logits (the last argument of both)
    yield torch.ops.base_moe.router_predict.default, (bf16, wr, None, wp, torch.randn(16, device=device), True)
    yield torch.ops.base_moe.select_experts.default, (bf16, wr, None, wp, torch.randn(16, device=device), None, 2,
                                                      *args, int(Cost.BASE), 5, int(Fill.BACKFILL), None, True)
    yield torch.ops.base_moe.experts.default, (x, ids, w, gate_up, down)
    yield torch.ops.base_moe.experts.default, (x, ids, w, gate_up, down, 2)
    # a budget past the expert count: kept is [G, min(budget, E)]
    yield torch.ops.base_moe.select_fill.default, (logits, D, None, *args, 20, int(Fill.BACKFILL))
    yield torch.ops.base_moe.route_select.default, (logits, log_norms, None, 2, *args, int(Cost.BASE), 20,
                                                    int(Fill.BACKFILL))
    for h in (hidden, bf16):  # the norms' outputs in hidden's dtype
        yield torch.ops.base_moe.rms_norm.default, (h, torch.rand(64, device=device).to(h.dtype) + 0.5, 1e-6)
        yield torch.ops.base_moe.add_rms_norm.default, (h, torch.randn(8, 64, device=device).to(h.dtype),
                                                        torch.rand(64, device=device).to(h.dtype) + 0.5, 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    for op, args in opcheck_cases(device):
        torch.library.opcheck(op, args)


# ---------------------------------------------------------------------------------------------
# bad input: clear errors naming the argument
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_bad_arguments_raise_clear_errors(device):
    routing = Routing(4, Scoring.SOFTMAX, renormalize=True)
    logits = torch.randn(8, 16, device=device)
    log_norms = torch.randn(8, 16, device=device)
    cases = [
        (lambda: ops.route_cost(logits.double(), routing, log_norms=log_norms), "logits must be float32"),
        (lambda: ops.route_cost(logits, Routing(17), log_norms=log_norms), "top_k"),
        (lambda: ops.route_cost(logits, routing, num_groups=3, log_norms=log_norms), "multiple of num_groups"),
        (lambda: ops.route_cost(logits, routing), "needs log_norms"),
        (lambda: ops.route_cost(logits, routing, log_norms=log_norms[:, :8]), "log_norms must have"),
        (lambda: ops.select_fill(logits, torch.rand(2, 16, device=device), routing, budget=0), "budget"),
        (lambda: ops.select_fill(logits, torch.rand(2, 15, device=device), routing, budget=4), "batch_cost"),
        (lambda: ops.route_select(logits, Routing(4, Scoring.SIGMOID, n_group=3, topk_group=2), budget=4,
                                  cost=Cost.ROUTER_SUM), "multiple of n_group"),
        (lambda: ops.route_select(logits, Routing(4, Scoring.SOFTMAX_AFTER_TOPK), budget=4, cost=Cost.ROUTER_SUM,
                                  correction_bias=torch.zeros(16, device=device)), "correction_bias is only used"),
        (lambda: ops.route_select(logits, routing, budget=4, cost=Cost.ROUTER_SUM,
                                  voting=torch.ones(8, dtype=torch.int32, device=device)), "voting must be bool"),
        (lambda: ops.route_cost(logits, routing, cost=Cost.ROUTER_SUM,
                                voting=torch.ones(7, dtype=torch.bool, device=device)),
         "voting must have shape \\[8\\]"),
        (lambda: ops.select_fill(logits, torch.rand(2, 16, device=device), routing, budget=4,
                                 voting=torch.ones(8, 2, dtype=torch.bool, device=device)[:, 0]), "voting must be "
         "contiguous"),
        (lambda: ops.router_predict(torch.randn(4, 32, device=device), torch.randn(16, 31, device=device)),
         "router_weight must have shape"),
        (lambda: ops.router_predict(torch.randn(4, 32, device=device), torch.randn(16, 32, device=device),
                                    predictor_weight=torch.randn(16, 32, device=device)), "together"),
        (lambda: ops.experts(*random_expert_problem(3, 64, 64, 4, 2, device, torch.bfloat16), max_active_experts=0),
         "max_active_experts"),
        (lambda: ops.rms_norm(torch.randn(4, 32, device=device), torch.ones(31, device=device), 1e-6),
         "weight must have shape"),
        (lambda: ops.rms_norm(torch.randn(4, 32, device=device), torch.ones(32, device=device).half(), 1e-6),
         "weight must have hidden's dtype"),
        (lambda: ops.rms_norm(torch.randn(4, 32, device=device), torch.ones(32, device=device), -1.0), "eps"),
        (lambda: ops.rms_norm(torch.randn(4, 32, 2, device=device)[..., 0], torch.ones(32, device=device), 1e-6),
         "contiguous"),
        (lambda: ops.add_rms_norm(torch.randn(4, 32, device=device), torch.randn(4, 31, device=device),
                                  torch.ones(32, device=device), 1e-6), "residual must have hidden's shape"),
        (lambda: ops.add_rms_norm(torch.randn(4, 32, device=device), torch.randn(4, 32, device=device).half(),
                                  torch.ones(32, device=device), 1e-6), "residual must have hidden's dtype"),
        (lambda: ops.add_rms_norm(torch.randn(4, 32, device=device), torch.randn(32, 4, device=device).t(),
                                  torch.ones(32, device=device), 1e-6), "residual must be contiguous"),
        (lambda: ops.add_rms_norm(torch.randn(4, 32, device=device), torch.randn(4, 32, device=device),
                                  torch.ones(31, device=device), 1e-6), "weight must have shape"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


def test_non_finite_logits_raise_on_cpu():
    routing = Routing(2, Scoring.SOFTMAX, renormalize=True)
    for bad in (float("nan"), float("inf")):
        logits = torch.randn(4, 8)
        logits[2, 3] = bad
        with pytest.raises(RuntimeError, match="finite"):
            ops.route_select(logits, routing, budget=2, cost=Cost.ROUTER_SUM)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["correction_bias", "log_norms"])
def test_non_finite_routing_inputs_raise_on_cpu(where, bad):
    routing = Routing(2, Scoring.SIGMOID, renormalize=True)
    logits, log_norms, bias = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8)
    {"correction_bias": bias, "log_norms": log_norms}[where][torch.randint(0, 8, ()).item()] = bad
    with pytest.raises(RuntimeError, match=f"{where} must be finite"):
        ops.route_cost(logits, routing, log_norms=log_norms, correction_bias=bias)
    with pytest.raises(RuntimeError, match=f"{where} must be finite"):
        ops.route_select(logits, routing, budget=3, log_norms=log_norms, correction_bias=bias)
    if where == "correction_bias":
        with pytest.raises(RuntimeError, match="correction_bias must be finite"):
            ops.select_fill(logits, torch.rand(1, 8), routing, budget=3, correction_bias=bias)
    else:  # only Cost.BASE reads the log-norms
        ops.route_select(logits, routing, budget=3, log_norms=log_norms, correction_bias=torch.randn(8),
                         cost=Cost.ROUTER_SUM)


def test_nan_predictor_weight_raises_on_cpu():
    hidden, W, P = torch.randn(4, 16), torch.randn(8, 16), torch.randn(8, 16)
    P[3, 5] = float("nan")
    with pytest.raises(RuntimeError, match="log_norms must be finite"):
        ops.select_experts(hidden, W, Routing(2, Scoring.SOFTMAX, renormalize=True), budget=3, predictor_weight=P,
                           predictor_bias=torch.zeros(8))


def test_no_tokens_with_base_cost_on_cpu():
    routing = Routing(2, Scoring.SOFTMAX, renormalize=True)
    logits, log_norms = torch.randn(0, 8), torch.randn(0, 8)
    ids, weights, kept, counts, D = ops.route_select(logits, routing, budget=3, log_norms=log_norms)
    assert ids.shape == (0, 2) and kept.shape == (1, 3) and torch.equal(D, torch.zeros(1, 8))
    with pytest.raises(RuntimeError, match="cost=0 \\(base\\) needs log_norms"):  # router_predict's [T, 0]
        ops.route_select(logits, routing, budget=3, log_norms=torch.randn(0, 0))


def test_reference_sigmoid_ties_go_to_the_lower_index():
    """Equal logits score equally wherever they sit in a row (torch's fp32 CPU sigmoid rounds a row's vectorised body
    and its tail differently: 44 of 2,000 random values routed to expert 32 of 40), so ties go to the lower index in
    the reference as in the op."""
    routing = Routing(2, Scoring.SIGMOID, renormalize=True)
    first_two = torch.tensor([[0, 1]], dtype=torch.int32)
    for value in (torch.randn(300, generator=torch.Generator().manual_seed(0)) * 4).tolist():
        logits = torch.full((1, 40), value)  # one row: its last elements are the vectorised loop's tail
        assert torch.equal(ref.route(logits, routing)[0], first_two), value
        assert torch.equal(ops.route_cost(logits, routing, cost=Cost.ROUTER_SUM)[0], first_two), value


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fill", list(Fill))
def test_softmax_weights_of_kept_experts_far_below_the_row_max(device, fill):
    """Softmax routing renormalises over the whole row's softmax: where every kept expert of a token lies 89-109 below
    the row's maximum, their fp32 probabilities underflow (to zero or subnormals). The CPU op must give the reference's
    weights (finite; zero where the total is zero), not a renormalisation against the kept experts' own maximum. The
    CUDA kernels compute backfill's weights as the softmax of the final slots' logits (routing_device.cuh,
    softmax_of_slots: the same function), which does not underflow there: they must give the exact weights, the
    float64 reference's. Drop fills keep the routed slots' weights, which underflow alike on both devices."""
    g = torch.Generator().manual_seed(11)
    G, B, E = 3, 4, 16
    routing = Routing(4, Scoring.SOFTMAX, renormalize=True)
    logits = torch.randn(G * B, E, generator=g)
    D = torch.rand(G, E, generator=g)
    for group in range(G):
        top = int(torch.randint(E, (1,), generator=g))
        rows = slice(group * B, (group + 1) * B)
        logits[rows, top] += 89.0 + 20.0 * torch.rand(B, generator=g)
        D[group, top] = -1.0  # never kept at budget 1: every token loses its top expert
    ids, weights, kept, _ = ops.select_fill(logits.to(device), D.to(device), routing, budget=1, fill=fill)
    exact = device == "cuda" and fill == Fill.BACKFILL
    reference_logits = logits.double() if exact else logits
    exp_ids, exp_weights, exp_kept, _ = ref.select_fill(reference_logits, D, None, routing, 1, fill)
    assert torch.equal(kept.cpu(), exp_kept) and torch.equal(ids.cpu(), exp_ids)
    assert torch.isfinite(weights).all()
    torch.testing.assert_close(weights.cpu(), exp_weights.float(), atol=1e-6, rtol=1e-5)
    if exact:  # the case is one where the fp32 reference's weights underflow: else it tests nothing CPU's does not
        underflowed = ref.select_fill(logits, D, None, routing, 1, fill)[1]
        assert (underflowed - exp_weights.float()).abs().max() > 0.5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scoring", [Scoring.SIGMOID, Scoring.SOFTMAX, Scoring.SOFTMAX_AFTER_TOPK])
@pytest.mark.parametrize("n_group", [4, 8])
def test_group_score_ties_go_to_the_lower_group(device, scoring, n_group):
    """Group-limited routing without a correction bias, on logits drawn from three values: groups whose scores (top-two
    sums under sigmoid, best logits under softmax) tie are common, and the lower group wins, as in the reference
    (every other sigmoid test adds a random bias, under which group scores never tie)."""
    g = torch.Generator().manual_seed(n_group)
    E = 4 * n_group
    routing = Routing(4, scoring, renormalize=scoring != Scoring.SOFTMAX_AFTER_TOPK, n_group=n_group, topk_group=2)
    logits = torch.randint(0, 3, (512, E), generator=g).float()
    ids, weights, D = ops.route_cost(logits.to(device), routing, cost=Cost.ROUTER_SUM)
    exp_ids, exp_weights, exp_D = ref.route_cost(logits, None, None, 1, routing, Cost.ROUTER_SUM)
    assert torch.equal(ids.cpu(), exp_ids)
    torch.testing.assert_close(weights.cpu(), exp_weights, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(D.cpu(), exp_D, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E", [8, 64, 160])
def test_biased_softmax_ties_go_to_the_lower_expert(device, E):
    """Softmax probabilities + a zero selection bias, on logits drawn from three values: equal probabilities are
    common, and the ops compute them bit for bit as the reference (the denominator in the CUDA warp's order), so ties
    go to the lower expert in both, in the routing and in backfill."""
    g = torch.Generator().manual_seed(E)
    routing = Routing(4, Scoring.SOFTMAX, renormalize=True)
    logits = torch.randint(0, 3, (256, E), generator=g).float()
    bias = torch.zeros(E)
    ids, _, D = ops.route_cost(logits.to(device), routing, cost=Cost.ROUTER_SUM, correction_bias=bias.to(device))
    exp_ids, _, exp_D = ref.route_cost(logits, None, bias, 1, routing, Cost.ROUTER_SUM)
    assert torch.equal(ids.cpu(), exp_ids)
    out = ops.select_fill(logits.to(device), exp_D.to(device), routing, budget=E // 2, correction_bias=bias.to(device))
    assert torch.equal(out[0].cpu(), ref.select_fill(logits, exp_D, bias, routing, E // 2, Fill.BACKFILL)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E", [20, 64, 128, 160, 512])  # 1, 2, 4, 8 and 16 experts per lane of the CUDA warp
def test_biased_softmax_ranks_bit_for_bit_like_the_reference(device, E):
    """A bias of 0.5 - softmax (in float64) puts every choice score within a few ulps of 0.5, so the ranking rests on
    the probabilities' last bits: the ops must compute them as the reference does (exp through float64, the denominator
    in the CUDA warp's order). torch's own softmax + bias ranks ~7% of these tokens otherwise."""
    g = torch.Generator().manual_seed(E)
    routing = Routing(6, Scoring.SOFTMAX, renormalize=True)
    for _ in range(100):
        logits = torch.randn(1, E, generator=g) * 2
        bias = (0.5 - torch.softmax(logits.double(), -1)).float().reshape(-1)
        ids = ops.route_cost(logits.to(device), routing, cost=Cost.ROUTER_SUM, correction_bias=bias.to(device))[0]
        assert torch.equal(ids.cpu(), ref.route(logits, routing, bias)[0])


def test_biased_probabilities_are_softmax_plus_bias():
    """reference.biased_probabilities is softmax + bias to fp32 rounding (its summation order is the ops', not
    torch's)."""
    g = torch.Generator().manual_seed(0)
    for E in (4, 33, 64, 512):
        logits, bias = torch.randn(64, E, generator=g) * 3, torch.randn(E, generator=g) * 0.01
        got = ref.biased_probabilities(logits, bias)
        torch.testing.assert_close(got, torch.softmax(logits.double(), -1).float() + bias, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("device", DEVICES)
def test_sigmoid_rounds_like_the_reference(device):
    """The ops' sigmoid scores and weights are reference.sigmoid's, bit for bit: with fp32 1 / (1 + exp(-x)) (two
    roundings) two logits 3e-5 apart tie to the lower index, and DeepSeek group scores equal in exact math
    (s(2) + s(-2), s(1) + s(-1)) pick another group than the reference's."""
    top1 = Routing(1, Scoring.SIGMOID)
    logits = torch.tensor([[8.000112533569336, 8.000140190124512]], device=device)
    assert torch.equal(ops.route_cost(logits, top1, cost=Cost.ROUTER_SUM)[0].cpu(), ref.route(logits.cpu(), top1)[0])
    grouped = Routing(2, Scoring.SIGMOID, n_group=2, topk_group=1)
    logits = torch.tensor([[-2.0, 2.0, -1.0, 1.0], [-1.0, 1.0, -2.0, 2.0]], device=device)
    got, want = ops.route_cost(logits, grouped, cost=Cost.ROUTER_SUM)[:2], ref.route(logits.cpu(), grouped)[:2]
    assert torch.equal(got[0].cpu(), want[0]) and torch.equal(got[1].cpu(), want[1])
    every = Routing(16, Scoring.SIGMOID)  # k = E: every expert's weight is its sigmoid
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.linspace(-100.0, 100.0, 16 * 2000), 8 * torch.randn(16 * 2000, generator=g)]).view(-1, 16)
    ids, weights, _ = ops.route_cost(logits.to(device), every, cost=Cost.ROUTER_SUM)
    scores = torch.zeros_like(logits).scatter_(1, ids.long().cpu(), weights.cpu())
    assert torch.equal(scores, ref.sigmoid(logits))


@pytest.mark.parametrize("device", DEVICES)
def test_sigmoid_of_logits_whose_exp_overflows_scores_zero(device):
    """Below about -88.72, exp(-x) overflows fp32 and the ops' sigmoid is 0, as fp32 1 / (1 + exp(-x)) is: those
    experts tie and rank by index, in the reference as in the ops, behind every expert whose score is above 0; their
    weights are 0."""
    routing = Routing(3, Scoring.SIGMOID, renormalize=True)
    g = torch.Generator().manual_seed(0)
    logits = -89.0 - 10.0 * torch.rand(16, 12, generator=g)  # every score 0: ids 0, 1, 2
    logits[8:, 7] = -88.0  # a subnormal score (~6e-39) ranks first, then the ties by index
    ids, weights, _ = ops.route_cost(logits.to(device), routing, cost=Cost.ROUTER_SUM)
    ref_ids, ref_weights = ref.route(logits, routing, None)
    assert torch.equal(ref_ids[:8], torch.tensor([[0, 1, 2]] * 8, dtype=torch.int32))
    assert torch.equal(ref_ids[8:], torch.tensor([[7, 0, 1]] * 8, dtype=torch.int32))
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights, rtol=1e-5, atol=0.0)
    assert (ref_weights[:8] == 0).all() and (ref_weights[8:, 1:] == 0).all()
    # the two fp32 values either side of the threshold: exp(-x) overflows at the first, not at the second
    logits = torch.full((1, 4), -200.0)
    logits[0, :2] = torch.tensor([-88.72283935546875, -88.72283172607422])
    routing = Routing(2, Scoring.SIGMOID, renormalize=False)
    ids, weights, _ = ops.route_cost(logits.to(device), routing, cost=Cost.ROUTER_SUM)
    ref_ids, ref_weights = ref.route(logits, routing, None)
    assert ref_ids.tolist() == [[1, 0]] and ref_weights[0, 1] == 0 and 0 < ref_weights[0, 0] < 3e-39
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(weights.cpu(), ref_weights, rtol=1e-5, atol=0.0)


def test_num_groups_is_bounded_without_tokens():
    """Any group count divides zero tokens: the bound keeps the outputs' [G, E] allocation and the kernels' int."""
    routing = Routing(2, Scoring.SOFTMAX, renormalize=True)
    with pytest.raises(RuntimeError, match="num_groups must be in \\[1, 2\\^30\\), got 1073741824"):
        ops.route_select(torch.zeros(0, 8), routing, budget=2, num_groups=2**30, cost=Cost.ROUTER_SUM)
    assert ops.route_select(torch.zeros(0, 8), routing, budget=2, num_groups=3, cost=Cost.ROUTER_SUM)[2].shape == (3, 2)


def test_fakes_check_devices_and_output_shapes():
    """On meta tensors the fakes run: a CPU tensor among them, or arguments the outputs' shapes depend on that the
    kernels refuse, must raise instead of returning unfilled tensors or impossible shapes."""
    routing = Routing(2, Scoring.SOFTMAX, renormalize=True)
    hidden = torch.randn(4, 16, device="meta")
    with pytest.raises(RuntimeError, match="router_weight must be on the same device as hidden"):
        ops.router_predict(hidden, torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="router_weight must have shape"):
        ops.router_predict(hidden, torch.randn(8, 17, device="meta"))
    with pytest.raises(RuntimeError, match="weight must be on the same device as hidden"):
        ops.rms_norm(hidden, torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="gate_up_proj must be on the same device as hidden"):
        ops.experts(hidden, torch.zeros(4, 2, dtype=torch.int32, device="meta"), torch.zeros(4, 2, device="meta"),
                    torch.randn(8, 32, 16), torch.randn(8, 16, 16, device="meta"))
    logits = torch.randn(4, 8, device="meta")
    with pytest.raises(RuntimeError, match="top_k \\(9\\) must not exceed"):
        ops.route_cost(logits, Routing(9, Scoring.SOFTMAX, renormalize=True), cost=Cost.ROUTER_SUM)
    with pytest.raises(RuntimeError, match="budget must be >= 1"):
        ops.select_fill(logits, torch.rand(1, 8, device="meta"), routing, budget=0)
    with pytest.raises(RuntimeError, match="multiple of num_groups"):
        ops.route_select(logits, routing, budget=2, num_groups=3, cost=Cost.ROUTER_SUM)
    kept = ops.route_select(logits, routing, budget=3, num_groups=2, cost=Cost.ROUTER_SUM)[2]
    assert kept.shape == (2, 3) and kept.device.type == "meta"
    with pytest.raises(RuntimeError, match="voting must be on the same device as logits"):
        ops.route_select(logits, routing, budget=2, cost=Cost.ROUTER_SUM, voting=torch.ones(4, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="voting must be bool"):
        ops.route_cost(logits, routing, cost=Cost.ROUTER_SUM, voting=torch.ones(4, device="meta"))
    with pytest.raises(RuntimeError, match="voting must have shape \\[4\\]"):
        ops.select_fill(logits, torch.rand(1, 8, device="meta"), routing, budget=2,
                        voting=torch.ones(5, dtype=torch.bool, device="meta"))


def test_add_rms_norm_fake_checks_the_residual_shape():
    """The fake (on meta tensors and under torch.compile's FakeTensorMode) returns ``(normed, sum)`` of hidden's shape
    and dtype, and refuses a residual of another shape, even one of as many elements, as the kernels do: the sum's
    shape is hidden's only because the two shapes are equal."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def meta(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device="meta")

    def check(make):
        hidden, weight = make(4, 16), make(16)
        normed, total = ops.add_rms_norm(hidden, make(4, 16), weight, 1e-6)
        for out in (normed, total):
            assert out.shape == (4, 16) and out.dtype == torch.bfloat16 and out.device == hidden.device
        for shape in ((4, 15), (16, 4), (64,), (1, 16)):
            with pytest.raises(RuntimeError, match=r"residual must have hidden's shape \[4, 16\], got "
                               + re.escape(str(list(shape)))):
                ops.add_rms_norm(hidden, make(*shape), weight, 1e-6)

    check(meta)
    with FakeTensorMode():
        check(lambda *shape: torch.empty(*shape, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="residual must be on the same device as hidden"):
        ops.add_rms_norm(meta(4, 16), torch.zeros(4, 16, dtype=torch.bfloat16), meta(16), 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_batch_costs_rank_like_the_reference(device):
    """select_fill ranks any batch cost as the reference (torch.sort) does: NaN first, infinities by value."""
    routing = Routing(2, Scoring.SOFTMAX, renormalize=True)
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    logits[0, 5] = logits[1, 6] = 5.0  # experts 5 and 6 are candidates
    for values in ([float("inf")], [-1.0], [-float("inf")], [float("nan")], [float("nan"), float("nan")]):
        cost = torch.rand(1, 8, generator=torch.Generator().manual_seed(len(values)))
        cost[0, 5:5 + len(values)] = torch.tensor(values)
        ids, weights, kept, counts = ops.select_fill(logits.to(device), cost.to(device), routing, budget=3)
        ids_ref, weights_ref, kept_ref, counts_ref = ref.select_fill(logits, cost, None, routing, 3, Fill.BACKFILL)
        assert torch.equal(kept.cpu(), kept_ref) and torch.equal(ids.cpu(), ids_ref)
        assert torch.equal(counts.cpu(), counts_ref)
        torch.testing.assert_close(weights.cpu(), weights_ref)
        assert values[0] == values[0] or kept_ref[0, 0] == 5  # a NaN cost ranks first


@pytest.mark.parametrize("device", DEVICES)
def test_drop_renorm_of_subnormal_kept_weights(device):
    """Every token routes experts 7, 1 and 2 (logits 200, 100, 99; scaling 2.5: weights 2.5, ~9e-44, ~3e-44, the last
    two subnormal); the frequency cost ties them, so a budget of 2 keeps experts 1 and 2 and drops every token's top-1.
    drop_renorm scales the kept weights back to the routed total: total / kept_total overflows to inf there, and the
    weights must come out finite, in proportion, summing to the total. Compared with the op's own routed weights (two
    devices' exp of a subnormal result may differ by an ulp, which is a few percent here)."""
    T, E, k = 6, 8, 3
    routing = Routing(k, Scoring.SOFTMAX, scaling=2.5)
    logits = torch.zeros(T, E)
    logits[:, 7], logits[:, 1], logits[:, 2] = 200.0, 100.0, 99.0
    logits = logits.to(device)
    _, routed_weights, _ = ops.route_cost(logits, routing, cost=Cost.FREQUENCY)
    routed_weights = routed_weights.cpu()
    assert (routed_weights[:, 1:] > 0).all() and (routed_weights[:, 1:] < torch.finfo(torch.float32).tiny).all()
    total = routed_weights.sum(dim=1, keepdim=True)
    expected = torch.cat([routed_weights[:, 1:] / routed_weights[:, 1:].sum(dim=1, keepdim=True) * total,
                          torch.zeros(T, 1)], dim=1)
    fused = ops.route_select(logits, routing, budget=2, cost=Cost.FREQUENCY, fill=Fill.DROP_RENORM)
    staged = ops.select_fill(logits, fused[4], routing, budget=2, fill=Fill.DROP_RENORM)
    ref_ids, ref_weights = ref.select_fill(logits.cpu(), fused[4].cpu(), None, routing, 2, Fill.DROP_RENORM)[:2]
    for ids, weights, kept in (fused[:3], staged[:3]):
        assert torch.equal(kept.cpu(), torch.tensor([[1, 2]], dtype=torch.int32))
        assert torch.equal(ids.cpu(), torch.tensor([[1, 2, E]] * T, dtype=torch.int32))
        assert torch.equal(ids.cpu(), ref_ids)
        torch.testing.assert_close(weights.cpu(), expected, rtol=1e-5, atol=0.0)
        torch.testing.assert_close(weights.cpu(), ref_weights, rtol=0.15, atol=0.0)


@pytest.mark.cuda
def test_mixed_devices_raise():
    """Operands on two devices are refused by name, whichever device the dispatcher picks (here CUDA, by the weight)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU to mix devices")
    hidden, weight = torch.randn(4, 32), torch.randn(16, 32, device="cuda")
    with pytest.raises(RuntimeError, match="same device"):
        ops.router_predict(hidden, weight)
    with pytest.raises(RuntimeError, match="same device"):
        ops.select_experts(hidden, weight, Routing(2, Scoring.SOFTMAX), budget=4, cost=Cost.FREQUENCY)


@pytest.mark.parametrize("device", ["meta", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_cpu_kernels_refuse_other_devices(device):
    """The CPU kernels read their operands on the host: reached with tensors of another device (as a C++ caller of
    ops.h's *_cpu functions could; here through the dispatcher's CPU key) they refuse them by name instead of reading
    device memory."""
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    logits = torch.randn(8, 16, device=device)
    args = (logits, None, None, 1, *Routing(2).op_args(), int(Cost.ROUTER_SUM))
    x, ids, weights, gate_up, down = random_expert_problem(4, 64, 32, 4, 2, device, torch.float32, drop_fraction=0.0)
    calls = [
        (lambda: torch.ops.base_moe.route_cost.default.redispatch(cpu, *args, None), "logits"),
        (lambda: torch.ops.base_moe.route_select.default.redispatch(cpu, *args, 4, 0, None), "logits"),
        (lambda: torch.ops.base_moe.select_fill.default.redispatch(
            cpu, logits, torch.zeros(1, 16, device=device), None, *Routing(2).op_args(), 4, 0, None), "logits"),
        (lambda: torch.ops.base_moe.experts.default.redispatch(cpu, x, ids, weights, gate_up, down, None), "hidden"),
    ]
    for call, name in calls:
        with pytest.raises(RuntimeError, match=f"the CPU op needs {name} on the CPU, got {device}"):
            call()
    # the same calls on CPU tensors run (the redispatch reaches the CPU kernels)
    assert torch.ops.base_moe.route_cost.default.redispatch(cpu, torch.randn(8, 16), *args[1:], None)[0].shape == (8, 2)


def test_every_enum_value_is_accepted():
    for scoring, cost, fill in itertools.product(Scoring, Cost, Fill):
        routing = Routing(2, scoring, renormalize=True)
        out = ops.route_select(torch.randn(6, 8), routing, budget=3, num_groups=2, cost=cost, fill=fill,
                               log_norms=torch.randn(6, 8))
        assert out[0].shape == (6, 2)


def test_ops_carry_no_autograd_history():
    """The ops are not differentiable: outputs have no grad_fn even when inputs require grad."""
    x, ids, w, gate_up, down = random_expert_problem(5, 64, 32, 4, 2, "cpu", torch.float32)
    out = ops.experts(x.requires_grad_(), ids, w, gate_up.requires_grad_(), down)
    logits, _ = ops.router_predict(x, torch.randn(8, 64, requires_grad=True))
    normed = ops.rms_norm(x, torch.ones(64, requires_grad=True), 1e-6)
    added, total = ops.add_rms_norm(x, torch.randn(5, 64, requires_grad=True), torch.ones(64), 1e-6)
    assert out.grad_fn is None and logits.grad_fn is None and normed.grad_fn is None
    assert added.grad_fn is None and total.grad_fn is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("E,k,routing", [r for r in ROUTINGS if r[2].scoring != Scoring.SIGMOID])
@pytest.mark.parametrize("shift", [-120.0, 120.0])
def test_shifted_logits_match_reference(device, E, k, routing, shift):
    """Softmax is shift-invariant: logits around +-120 (exp over- or underflows fp32 unless the row's max is
    subtracted first) route and weigh as the reference does, in the model's routing and in backfill. (Sigmoid
    saturates there: it has no shift invariance to test.)"""
    G, B = 2, 6
    gen = torch.Generator().manual_seed(E * 100 + k)
    logits = (torch.randn(G * B, E, generator=gen) * 2.0 + shift).to(device)
    ids, weights, _ = ops.route_cost(logits, routing, num_groups=G, cost=Cost.ROUTER_SUM)
    exp_ids, exp_weights, _ = ref.route_cost(logits.cpu(), None, None, G, routing, Cost.ROUTER_SUM)
    assert torch.equal(ids.cpu(), exp_ids)
    torch.testing.assert_close(weights.cpu(), exp_weights, atol=1e-6, rtol=1e-5)
    D = torch.rand(G, E, generator=gen).to(device)
    out = ops.select_fill(logits, D, routing, budget=max(1, E // 4), fill=Fill.BACKFILL)
    exp = ref.select_fill(logits.cpu(), D.cpu(), None, routing, max(1, E // 4), Fill.BACKFILL)
    assert torch.equal(out[0].cpu(), exp[0]) and torch.equal(out[2].cpu(), exp[2])
    torch.testing.assert_close(out[1].cpu(), exp[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_routing_and_shape_arguments_raise_clear_errors(device):
    """Argument checks of csrc/checks.cpp that test_bad_arguments_raise_clear_errors does not reach."""
    logits = torch.randn(8, 16, device=device)
    sigmoid = Scoring.SIGMOID
    cases = [
        (lambda: ops.route_cost(torch.randn(8, 16, device=device), Routing(2, sigmoid, n_group=16, topk_group=4),
                                cost=Cost.ROUTER_SUM), "each expert group needs at least 2 experts"),
        (lambda: ops.route_cost(logits, Routing(6, sigmoid, n_group=4, topk_group=1), cost=Cost.ROUTER_SUM),
         "cannot hold top_k=6"),
        (lambda: ops.route_cost(logits, Routing(2, sigmoid, n_group=4, topk_group=5), cost=Cost.ROUTER_SUM),
         "topk_group must be in"),
        (lambda: ops.route_cost(logits, Routing(2, sigmoid), cost=Cost.ROUTER_SUM,
                                correction_bias=torch.zeros(15, device=device)), "correction_bias must have shape"),
        (lambda: ops.router_predict(torch.randn(4, 32, device=device), torch.randn(16, 32, device=device),
                                    torch.zeros(17, device=device)), "router_bias must have shape"),
        (lambda: ops.route_cost(logits, Routing(2), log_norms=torch.randn(16, 8, device=device).t()),
         "log_norms must be contiguous along experts"),
        (lambda: ops.route_cost(torch.randn(4, MAX_EXPERTS + 1, device=device), Routing(2), cost=Cost.ROUTER_SUM),
         f"logits must have 1 to {MAX_EXPERTS} experts"),  # routing.MAX_EXPERTS is the ops' own limit
        (lambda: ops.route_cost(logits, Routing(2, 3), cost=Cost.ROUTER_SUM), "scoring must be 0"),
        (lambda: ops.route_select(logits, Routing(2), budget=0, cost=Cost.ROUTER_SUM), "budget must be >= 1"),
        (lambda: ops.route_select(logits, Routing(2), budget=2, cost=Cost.ROUTER_SUM, fill=3), "fill must be 0"),
    ]
    # (1e20, 1e-46: weights whose squares overflow to inf or whose scaling is 0 in fp32)
    for scaling in (0.0, -1.0, float("inf"), float("nan"), 1e20, 2.0**63 * 1.01, 1e-46, 2.0**-64):
        cases.append((lambda scaling=scaling: ops.route_cost(logits, Routing(2, scaling=scaling), cost=Cost.ROUTER_SUM),
                      r"scaling must be in \[2\^-63, 2\^63\]"))
    hidden = torch.randn(4, 8, device=device)
    for eps in (-1.0, float("inf"), float("nan"), 1e39):
        cases.append((lambda eps=eps: ops.rms_norm(hidden, torch.ones(8, device=device), eps),
                      "eps must be a finite fp32 number >= 0"))
    for rows, message in ((0, r"batch_cost must have 1 to 2\^30 - 1 rows \(groups\), got 0"),
                          (3, r"multiple of batch_cost's rows \(groups, 3\)")):
        cases.append((lambda rows=rows: ops.select_fill(logits, torch.zeros(rows, 16, device=device), Routing(2),
                                                        budget=2), message))
    for cost in (-1, 5):
        cases.append((lambda cost=cost: ops.route_cost(logits, Routing(2), cost=cost), "cost must be 0"))
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()
    named = [  # the wrappers' own checks: names as apply takes them, and a routing that is not a Routing
        (lambda: ops.route_select(logits, Routing(2), budget=2, cost="router_sum", fill="dropped"), ValueError,
         "fill must be a base_moe.Fill or one of backfill, drop, drop_renorm, got 'dropped'"),
        (lambda: ops.route_cost(logits, Routing(2), cost="base_cost"), ValueError,
         "cost must be a base_moe.Cost or one of base, router_sum, router_sq, frequency, top1_union, got 'base_cost'"),
        (lambda: ops.route_cost(logits, Routing(2), cost=1.0), ValueError, "cost must be .*, got float"),
        (lambda: ops.route_select(logits, Routing(2), budget=2, cost="router_sum", fill=True), ValueError,
         "fill must be .*, got bool"),  # (operator.index(True) is 1: drop)
        (lambda: ops.route_select(logits, Routing(2), budget=2, cost="router_sum", fill=torch.tensor(True)), ValueError,
         "fill must be .*, got Tensor"),
        (lambda: ops.route_select(logits, (2, 0), budget=2), TypeError,
         "routing must be a base_moe.Routing, got tuple"),
    ]
    for call, error, message in named:
        with pytest.raises(error, match=message):
            call()
    ops.route_cost(torch.randn(4, MAX_EXPERTS, device=device), Routing(2), cost=Cost.ROUTER_SUM)  # the limit runs
    # scaling's limits run, and even there a weight's square is finite: a slot whose exp(2 log-norm) underflows to 0
    # costs 0, not inf x 0
    for scaling in (2.0**63, 2.0**-63):
        routing = Routing(1, renormalize=True, scaling=scaling)
        _, _, D = ops.route_cost(logits, routing, log_norms=torch.full((8, 16), -60.0, device=device))
        assert not D.isnan().any()


def test_experts_rejects_out_of_range_ids_on_cpu():
    x, ids, weights, gate_up, down = random_expert_problem(4, 64, 32, 4, 2, "cpu", torch.float32, drop_fraction=0.0)
    for bad in (-1, 5):
        bad_ids = ids.clone()
        bad_ids[2, 1] = bad
        with pytest.raises(RuntimeError, match="expert_ids must be in \\[0, 4\\]"):
            ops.experts(x, bad_ids, weights, gate_up, down)


@pytest.mark.parametrize("device", DEVICES)
def test_cost_and_fill_by_name_are_the_enums(device):
    """``cost="router_sum"``, ``fill="drop"`` (any case, as apply takes fills) and the plain ints give the enums'
    outputs bit for bit."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(12, 32, generator=g).to(device)
    routing = Routing(4, Scoring.SOFTMAX, renormalize=True)
    for cost, fill in itertools.product(list(Cost)[1:], list(Fill)):
        want = ops.route_select(logits, routing, budget=5, num_groups=2, cost=cost, fill=fill)
        for c, f in ((cost.name.lower(), fill.name.lower()), (cost.name, fill.name.title()), (int(cost), int(fill))):
            got = ops.route_select(logits, routing, budget=5, num_groups=2, cost=c, fill=f)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (c, f)
