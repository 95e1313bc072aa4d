"""CUDA selection kernels (router_predict, route_cost, select_fill, route_select) against base_moe.reference.

Indices must equal the reference exactly whenever they are a function of the same inputs (routing ranks by logits or
by sigmoid + bias, which the kernels compute like torch). Where the kept set depends on exp/softmax-derived batch costs,
the kept set must be exactly the ranking of the kernel's own D, and agree with the reference's up to experts whose
reference D values are within 1e-5 of each other; the fill is then checked exactly given the kernel's kept set.

``BASE_MOE_TEST_DEVICE=cpu python -m pytest tests/test_select_cuda.py -p no:cacheprovider`` runs the same checks
against the CPU ops (a dry run of the test logic on machines without a GPU; the ``cuda`` marker still skips them
there, so call the test functions directly, see ``__main__``). ``python tests/test_select_cuda.py sanitize`` runs a
few calls of every op for compute-sanitizer.
"""

from __future__ import annotations

import os
import random
import sys
import zlib

import pytest
import torch

from base_moe import Cost, Fill, Routing, Scoring, ops, reference
from test_experts_cuda import TWO_GPUS, assert_same_on_a_non_current_gpu, launched_kernels
from test_ops import assert_kept_matches

pytestmark = pytest.mark.cuda
DEVICE = os.environ.get("BASE_MOE_TEST_DEVICE", "cuda")

EXPERTS = (8, 60, 64, 128, 256, 512)
TOP_K = (1, 2, 4, 6, 8, 16)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------
def routings(E: int, k: int) -> dict[str, tuple[Routing, bool]]:
    """Every scoring the ops support, as (routing, uses a correction bias)."""
    cases = {
        "softmax_renorm": (Routing(k, Scoring.SOFTMAX, renormalize=True), False),
        "softmax": (Routing(k, Scoring.SOFTMAX), False),
        "softmax_after_topk": (Routing(k, Scoring.SOFTMAX_AFTER_TOPK), False),
        "softmax_bias_renorm": (Routing(k, Scoring.SOFTMAX, renormalize=True), True),  # ERNIE-4.5
        "sigmoid_bias_renorm": (Routing(k, Scoring.SIGMOID, renormalize=True, scaling=2.5), True),
        "sigmoid": (Routing(k, Scoring.SIGMOID), False),
    }
    for n_group, topk_group in ((8, 4), (4, 1)):
        if E % n_group == 0 and E // n_group >= 2 and topk_group * (E // n_group) >= k:
            cases[f"sigmoid_groups{n_group}_{topk_group}"] = (
                Routing(k, Scoring.SIGMOID, renormalize=True, n_group=n_group, topk_group=topk_group, scaling=2.5),
                True,
            )
            # DeepSeek-V2 (softmax, groups by their best score, a routed scaling); renormalised at (4, 1)
            renormalize = n_group == 4
            cases[f"softmax_groups{n_group}_{topk_group}"] = (
                Routing(k, Scoring.SOFTMAX, renormalize, n_group=n_group, topk_group=topk_group, scaling=16.0), False
            )
            if n_group == 8:  # a selection bias and a group limit together (the group's best probability + bias)
                cases["softmax_bias_groups8_4"] = (
                    Routing(k, Scoring.SOFTMAX, True, n_group=8, topk_group=4), True
                )
            if n_group == 4:
                cases["softmax_after_topk_groups4_1"] = (
                    Routing(k, Scoring.SOFTMAX_AFTER_TOPK, n_group=4, topk_group=1), False
                )
    return cases


def make_logits(T: int, E: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    if kind == "ties":  # many equal logits: ties broken by index
        x = torch.randint(0, 3, (T, E), generator=gen).float()
    elif kind == "dup":  # duplicated columns: pairs of experts with equal logits
        x = torch.randn(T, E, generator=gen) * 2
        x[:, 1::2] = x[:, 0::2]
    else:
        x = torch.randn(T, E, generator=gen) * 2
    return x.to(DEVICE)


def make_inputs(G: int, B: int, E: int, uses_bias: bool, kind: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = make_logits(G * B, E, kind, gen)
    log_norms = (torch.randn(G * B, E, generator=gen) * 0.5).to(DEVICE)
    bias = None
    if uses_bias:
        bias = torch.zeros(E) if kind == "ties" else torch.randn(E, generator=gen) * 0.1
        bias = bias.to(DEVICE)
    return logits, log_norms, bias


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------
def assert_weights_close(w: torch.Tensor, w_ref: torch.Tensor):
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a, b)


def check_fill(logits, bias, routing, kept, fill, ids, weights, counts, G):
    ids_ref, w_ref = reference.fill(logits, bias, routing, kept, fill)
    assert torch.equal(ids, ids_ref), "fill ids differ from the reference given the same kept set"
    assert_weights_close(weights, w_ref)
    assert torch.equal(counts, reference.expert_counts(ids_ref, G, logits.shape[1]))


def assert_gemv_close(out: torch.Tensor, hidden: torch.Tensor, W: torch.Tensor, b: torch.Tensor | None):
    """``out`` ~ hidden @ W.T + b (fp64 truth) within twice the error of torch's fp32 product of the same inputs, or
    test_ops' fp32-accumulation tolerance (1e-5 sqrt(H) per unit of the largest value), whichever is larger. The
    kernel returns fp32 sums: a bound from torch's product in the inputs' dtype, rounded to bf16, let partial sums or
    logits rounded to bf16 pass (~1e-2 off at H = 7168)."""
    assert not torch.backends.cuda.matmul.allow_tf32, "the fp32 baseline needs full-precision matmuls"
    ref = hidden.double() @ W.double().T
    fp32 = hidden.float() @ W.float().T
    if b is not None:
        ref, fp32 = ref + b.double(), fp32 + b
    err = (out.double() - ref).abs().max().item()
    torch_err = (fp32.double() - ref).abs().max().item()
    bound = max(2 * torch_err, 1e-5 * hidden.shape[1] ** 0.5 * max(1.0, ref.abs().max().item()))
    assert err <= bound, f"max error {err} exceeds {bound} (torch's fp32 product: {torch_err})"


def check_selection(outputs, logits, bias, routing, G, cost, budget, fill, union, D_ref):
    """An op's (ids, weights, kept, counts, D) on ``logits`` against the reference: D close to the reference's,
    kept exactly the ranking of the op's own D over the routed union and the reference's kept set up to near-ties
    of the reference D, and the fill exact given the op's kept set."""
    ids, weights, kept, counts, D = outputs
    torch.testing.assert_close(D, D_ref, rtol=1e-4, atol=1e-6)
    assert torch.equal(kept, reference.keep_experts(D, union, budget)), f"{cost.name}: kept vs own D"
    assert_kept_matches(kept, reference.keep_experts(D_ref, union, budget), D_ref)
    check_fill(logits, bias, routing, kept, fill, ids, weights, counts, G)


def budgets(E: int, k: int) -> list[int]:
    return sorted({1, max(1, k - 1), k, 16, E, E + 3})


# ---------------------------------------------------------------------------------------------
# Stage 1: router_predict
# ---------------------------------------------------------------------------------------------
GEMV_CASES = [
    # (T, H, E, dtype, predictor, router bias)
    (1, 2048, 128, torch.bfloat16, True, False),
    (4, 2048, 128, torch.bfloat16, True, True),
    (16, 2048, 128, torch.float16, True, False),
    (17, 1024, 60, torch.bfloat16, True, True),
    (33, 2048, 128, torch.bfloat16, False, False),
    (64, 2048, 128, torch.bfloat16, True, False),
    (65, 512, 8, torch.float16, True, True),
    (256, 2048, 128, torch.bfloat16, True, False),
    (256, 7168, 256, torch.bfloat16, True, True),
    (3, 7168, 256, torch.bfloat16, True, False),
    (1000, 1024, 512, torch.bfloat16, True, False),
    (4096, 2048, 128, torch.bfloat16, True, False),
    (4096, 512, 64, torch.float16, False, True),
    (9, 1088, 61, torch.bfloat16, True, True),  # odd E; H / 64 = 17 stages over up to 16 CTAs: some get none
    (40, 1088, 61, torch.float16, True, False),
    (7, 204, 64, torch.bfloat16, True, True),  # H % 8 != 0: scalar kernel
    (5, 64, 8, torch.float32, True, True),
    (130, 2048, 128, torch.float32, True, False),
    (1, 32, 8, torch.bfloat16, True, False),
]


@pytest.mark.parametrize("T,H,E,dtype,predict,router_bias", GEMV_CASES)
def test_router_predict(T, H, E, dtype, predict, router_bias):
    gen = torch.Generator().manual_seed(T * 7919 + H + E)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE, dtype)
    Wr = (torch.randn(E, H, generator=gen) / H**0.5).to(DEVICE, dtype)
    Wp = (torch.randn(E, H, generator=gen) / H**0.5).to(DEVICE, dtype) if predict else None
    br = torch.randn(E, generator=gen).to(DEVICE) if router_bias else None
    bp = torch.randn(E, generator=gen).to(DEVICE) if predict else None
    logits, log_norms = ops.router_predict(hidden, Wr, br, Wp, bp)
    assert logits.dtype == torch.float32 and logits.shape == (T, E) and logits.is_contiguous()
    assert log_norms.shape == (T, E if predict else 0)

    pairs = [(logits, Wr, br)] + ([(log_norms, Wp, bp)] if predict else [])
    for out, W, b in pairs:
        assert_gemv_close(out, hidden, W, b)


def test_router_predict_deterministic():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, 2048, generator=gen).to(DEVICE, torch.bfloat16)
    Wr = torch.randn(128, 2048, generator=gen).to(DEVICE, torch.bfloat16)
    Wp = torch.randn(128, 2048, generator=gen).to(DEVICE, torch.bfloat16)
    bp = torch.randn(128, generator=gen).to(DEVICE)
    first = ops.router_predict(hidden, Wr, None, Wp, bp)
    for _ in range(5):
        again = ops.router_predict(hidden, Wr, None, Wp, bp)
        assert all(bitwise_equal(a, b) for a, b in zip(first, again))


# ---------------------------------------------------------------------------------------------
# Stages 2 and 3
# ---------------------------------------------------------------------------------------------
def _select_cases(count: int, seed: int) -> list[tuple]:
    """A fixed random sample of (G, B, E, k, routing name, logits kind): every E, k, scoring and tie kind occur, and
    every E with every tie kind (the i-th case of an E takes kind (E's index + i) % 3)."""
    rng = random.Random(seed)
    shapes = [(1, 1), (3, 1), (1, 7), (4, 16), (2, 33), (3, 64), (1, 256), (2, 300), (1, 1000)]
    cases = []
    for i in range(count):
        E = EXPERTS[i % len(EXPERTS)]
        k = rng.choice([k for k in TOP_K if k <= E])
        names = sorted(routings(E, k))
        G, B = shapes[(i * 5 + rng.randrange(3)) % len(shapes)]
        kind = ("normal", "ties", "dup")[(i + i // len(EXPERTS)) % 3]
        cases.append((G, B, E, k, names[(i // len(EXPERTS)) % len(names)], kind))
    return cases


SELECT_CASES = _select_cases(48, seed=3) + [
    (1, 4096, 128, 8, "softmax_renorm", "normal"),
    (2, 2048, 256, 8, "sigmoid_groups8_4", "normal"),
    (1, 4096, 512, 16, "softmax", "ties"),
    (2, 16, 128, 8, "softmax_renorm", "ties"),
    (4, 64, 256, 8, "sigmoid_groups8_4", "dup"),
    # E not a power of two on route_select's 4-warp CTAs (9-64 tokens): CTAs that own no expert, padded rank keys
    (2, 40, 100, 8, "softmax_renorm", "normal"),
    (1, 20, 200, 8, "sigmoid_groups8_4", "ties"),
    (3, 100, 128, 8, "softmax_renorm", "ties"),  # 65-128 tokens: 8-warp CTAs
    (2, 128, 256, 8, "sigmoid_groups8_4", "normal"),
    # the softmax-with-bias-or-groups instances (ERNIE-4.5, DeepSeek-V2) at every experts-per-lane count, one and
    # several chunks (the fill scores each token again), 4-, 8- and 16-warp CTAs; bias 0.1 N(0, 1) (make_inputs)
    (2, 300, 60, 8, "softmax_bias_renorm", "normal"),
    (1, 4096, 64, 6, "softmax_bias_renorm", "dup"),
    (4, 16, 8, 2, "softmax_bias_renorm", "normal"),
    (3, 100, 128, 8, "softmax_bias_renorm", "normal"),
    (2, 40, 256, 8, "softmax_bias_renorm", "normal"),
    (1, 64, 512, 16, "softmax_bias_renorm", "normal"),
    (4, 16, 128, 8, "softmax_groups8_4", "normal"),
    (2, 300, 256, 8, "softmax_groups8_4", "ties"),
    (1, 1000, 64, 6, "softmax_groups4_1", "normal"),
    (3, 64, 512, 16, "softmax_groups8_4", "dup"),
    (2, 40, 128, 8, "softmax_after_topk_groups4_1", "normal"),
    (2, 300, 256, 8, "softmax_bias_groups8_4", "normal"),
    (4, 16, 64, 6, "softmax_bias_groups8_4", "normal"),
]


def _seed_of(case) -> int:
    return zlib.crc32(repr(case).encode()) % 10_000


def _case_id(case):
    return "G{}-B{}-E{}-k{}-{}-{}".format(*case)


@pytest.mark.parametrize("case", SELECT_CASES, ids=_case_id)
def test_route_cost(case):
    G, B, E, k, name, kind = case
    routing, uses_bias = routings(E, k)[name]
    logits, log_norms, bias = make_inputs(G, B, E, uses_bias, kind, seed=_seed_of(case))
    for cost in Cost:
        ids, weights, D = ops.route_cost(logits, routing, num_groups=G, cost=cost, log_norms=log_norms,
                                         correction_bias=bias)
        ids_ref, w_ref, D_ref = reference.route_cost(logits, log_norms, bias, G, routing, cost)
        assert torch.equal(ids, ids_ref), f"{cost.name}: routed ids differ"
        assert_weights_close(weights, w_ref)
        torch.testing.assert_close(D, D_ref, rtol=1e-4, atol=1e-6)
        # the kernel sums in token order: slot costs computed exactly like torch give D bit for bit
        # (the kernel's sigmoid is reference.sigmoid's, bit for bit: routing.h)
        exact_costs = cost == Cost.FREQUENCY or (
            DEVICE == "cuda" and routing.scoring == Scoring.SIGMOID and not routing.renormalize and routing.scaling == 1.0
            and cost in (Cost.ROUTER_SUM, Cost.TOP1_UNION)
        )
        if exact_costs:
            assert bitwise_equal(D, D_ref), f"{cost.name}: D is not bitwise equal to the token-order sum"


@pytest.mark.parametrize("case", SELECT_CASES, ids=_case_id)
def test_select_fill(case):
    G, B, E, k, name, kind = case
    routing, uses_bias = routings(E, k)[name]
    logits, _, bias = make_inputs(G, B, E, uses_bias, kind, seed=_seed_of(case) + 1)
    gen = torch.Generator().manual_seed(5)
    D = torch.randint(0, 4, (G, E), generator=gen).float().to(DEVICE)  # ties on purpose: lower index wins
    for budget in budgets(E, k):
        for fill in Fill:
            ids, weights, kept, counts = ops.select_fill(logits, D, routing, budget=budget, fill=fill,
                                                         correction_bias=bias)
            ids_ref, w_ref, kept_ref, counts_ref = reference.select_fill(logits, D, bias, routing, budget, fill)
            assert torch.equal(kept, kept_ref), f"budget {budget}, {fill.name}: kept differs"
            assert torch.equal(ids, ids_ref), f"budget {budget}, {fill.name}: ids differ"
            assert_weights_close(weights, w_ref)
            assert torch.equal(counts, counts_ref)


@pytest.mark.parametrize("case", SELECT_CASES, ids=_case_id)
def test_route_select(case):
    G, B, E, k, name, kind = case
    routing, uses_bias = routings(E, k)[name]
    logits, log_norms, bias = make_inputs(G, B, E, uses_bias, kind, seed=_seed_of(case) + 2)
    routed_ref, _ = reference.route(logits, routing, bias)
    union = reference.routed_union(routed_ref, G, E)
    for cost in Cost:
        _, _, D_ref = reference.route_cost(logits, log_norms, bias, G, routing, cost)
        # route_cost's D, summed by the experts' owners: route_select's instances that sum every expert in every CTA
        # must add the same values in the same order (compared where both ops run the same routing code: at budgets
        # above 32 route_select's softmax models take the generic instances, whose weights may round otherwise)
        _, _, D_owners = ops.route_cost(logits, routing, num_groups=G, cost=cost, log_norms=log_norms,
                                        correction_bias=bias)
        for budget in budgets(E, k):
            for fill in Fill:
                outputs = ops.route_select(
                    logits, routing, budget=budget, num_groups=G, cost=cost, fill=fill, log_norms=log_norms,
                    correction_bias=bias,
                )
                check_selection(outputs, logits, bias, routing, G, cost, budget, fill, union, D_ref)
                if min(budget, E) <= 32:
                    assert bitwise_equal(outputs[4], D_owners), f"{cost.name}: D differs from route_cost's"


def test_zero_tokens_match_the_cpu_ops():
    """No tokens (any number of groups divides 0): every selection op gives the CPU op's outputs."""
    routing = Routing(2, Scoring.SOFTMAX, renormalize=True)
    logits, hidden, W = torch.zeros(0, 8), torch.zeros(0, 64, dtype=torch.bfloat16), torch.randn(8, 64).bfloat16()
    batch_cost = torch.rand(3, 8)
    calls = [
        lambda dev: ops.route_cost(logits.to(dev), routing, num_groups=3, cost=Cost.ROUTER_SUM),
        lambda dev: ops.select_fill(logits.to(dev), batch_cost.to(dev), routing, budget=2),
        lambda dev: ops.route_select(logits.to(dev), routing, budget=2, num_groups=3, cost=Cost.ROUTER_SUM),
        lambda dev: ops.select_experts(hidden.to(dev), W.to(dev), routing, budget=2, num_groups=3,
                                       cost=Cost.ROUTER_SUM),
    ]
    for call in calls:
        for got, want in zip(call(DEVICE), call("cpu")):
            assert got.shape == want.shape and torch.equal(got.cpu(), want)
    with pytest.raises(RuntimeError, match="num_groups must be in"):
        ops.route_select(logits.to(DEVICE), routing, budget=2, num_groups=2**31, cost=Cost.ROUTER_SUM)


def test_router_predict_token_limit():
    """The simple GEMV (fp32 here) holds up to 65535 x 16 tokens in its grid; one more is refused, not launched."""
    T, H, E = 65535 * 16, 8, 8
    x, W = torch.randn(T, H, device=DEVICE), torch.randn(E, H, device=DEVICE)
    logits, _ = ops.router_predict(x, W)
    torch.testing.assert_close(logits[-5:].cpu(), ops.router_predict(x[-5:].cpu(), W.cpu())[0])
    with pytest.raises(RuntimeError, match="too large"):
        ops.router_predict(torch.randn(T + 1, H, device=DEVICE), W)


def test_route_select_broadcast_log_norms():
    G, B, E, k = 2, 16, 64, 4
    routing = Routing(k, Scoring.SOFTMAX, renormalize=True)
    logits, _, _ = make_inputs(G, B, E, False, "normal", seed=11)
    static = torch.randn(E, device=DEVICE).expand(G * B, E)  # static per-expert log-norms
    outputs = ops.route_select(logits, routing, budget=8, num_groups=G, log_norms=static)
    routed, _, D_ref = reference.route_cost(logits, static, None, G, routing, Cost.BASE)
    union = reference.routed_union(routed, G, E)
    check_selection(outputs, logits, None, routing, G, Cost.BASE, 8, Fill.BACKFILL, union, D_ref)


def test_route_select_nan_costs_rank_like_torch_sort():
    """What CUDA selects from non-finite logits is unspecified (the CPU op raises), but NaN batch costs rank like
    torch.sort ranks them (first, ties to the lower index), so the kept list stays the ranking of the op's own D; with
    float compares every NaN candidate and the best finite one shared rank 0 and overwrote each other in kept[0]."""
    if DEVICE == "cpu":
        pytest.skip("the CPU op rejects non-finite logits")
    G, B, E, k = 2, 100, 64, 4
    routing = Routing(k, Scoring.SOFTMAX)  # no renormalisation: its total > 0 guard would turn NaN weights into 0
    logits, log_norms, _ = make_inputs(G, B, E, False, "normal", seed=13)
    logits[::7, :] = float("nan")  # whole rows: NaN weights, so NaN costs for the experts those tokens route to
    routed, _, _ = reference.route_cost(logits, log_norms, None, G, routing, Cost.BASE)
    union = reference.routed_union(routed, G, E)
    for budget in (12, E):
        _, _, kept, _, D = ops.route_select(logits, routing, budget=budget, num_groups=G, log_norms=log_norms)
        assert (D.isnan() & union).sum(dim=1).min() >= 2, "the test needs several NaN candidates per group"
        assert torch.equal(kept, reference.keep_experts(D, union, budget)), f"budget {budget}: kept vs own D"


def test_route_select_deterministic():
    G, B, E, k = 3, 1000, 128, 8
    routing = Routing(k, Scoring.SOFTMAX, renormalize=True)
    logits, log_norms, _ = make_inputs(G, B, E, False, "normal", seed=12)
    first = ops.route_select(logits, routing, budget=16, num_groups=G, log_norms=log_norms)
    for _ in range(5):
        again = ops.route_select(logits, routing, budget=16, num_groups=G, log_norms=log_norms)
        assert all(bitwise_equal(a, b) for a, b in zip(first, again))


# ---------------------------------------------------------------------------------------------
# Stages 1-3 in one op: select_experts (router_predict, then route_select)
# ---------------------------------------------------------------------------------------------
SELECT_EXPERTS_CASES = [
    # (G, B, H, E, k, routing name, dtype, predictor, router bias, duplicated router rows)
    (1, 1, 2048, 128, 8, "softmax_renorm", torch.bfloat16, True, False, False),
    (1, 4, 2048, 128, 8, "softmax_renorm", torch.bfloat16, True, False, True),
    (1, 16, 2048, 128, 8, "softmax_renorm", torch.float16, True, True, False),
    (1, 64, 2048, 128, 8, "softmax_renorm", torch.bfloat16, True, False, False),
    (1, 256, 2048, 128, 8, "softmax_renorm", torch.bfloat16, True, False, True),
    (3, 16, 1024, 60, 4, "softmax", torch.bfloat16, True, True, False),
    (2, 100, 512, 64, 8, "softmax_after_topk", torch.bfloat16, False, True, False),
    (1, 16, 1024, 256, 8, "sigmoid_groups8_4", torch.bfloat16, True, False, False),
    (4, 64, 1024, 256, 8, "sigmoid_groups8_4", torch.bfloat16, True, False, True),
    (1, 33, 512, 512, 16, "sigmoid_bias_renorm", torch.bfloat16, True, False, False),
    (1, 13, 512, 512, 16, "sigmoid_bias_renorm", torch.bfloat16, True, False, False),
    (4, 64, 7168, 256, 8, "sigmoid_groups8_4", torch.bfloat16, True, False, True),  # DeepSeek-V3's H and E
    (5, 7, 64, 8, 2, "sigmoid", torch.float16, True, True, False),
    (2, 3, 256, 12, 3, "softmax_renorm", torch.bfloat16, False, False, True),
    (3, 1, 64, 8, 2, "softmax", torch.bfloat16, True, False, False),  # B = 1, E < 16
    (1, 1, 256, 12, 3, "sigmoid", torch.float16, False, True, True),  # the same
    (1, 300, 2048, 128, 8, "softmax_renorm", torch.bfloat16, True, False, False),
    (2, 5, 1000, 64, 4, "softmax_renorm", torch.bfloat16, True, True, False),  # H not a multiple of 64
    (2, 5, 1000, 32, 4, "softmax_renorm", torch.bfloat16, True, False, False),
    (1, 2, 512, 129, 4, "softmax_renorm", torch.bfloat16, True, False, False),  # E odd
    (2, 9, 204, 64, 4, "softmax_renorm", torch.bfloat16, True, False, False),  # H % 8 != 0: the unvectorised GEMV
    (1, 4, 0, 16, 4, "softmax_renorm", torch.bfloat16, True, True, False),  # H = 0: the logits are the biases
    (1, 16, 512, 64, 4, "softmax_renorm", torch.float32, True, True, False),  # fp32
]


def _select_experts_id(case):
    G, B, H, E, k, name, dtype, predict, router_bias, dup = case
    return f"G{G}-B{B}-H{H}-E{E}-k{k}-{name}-{str(dtype)[6:]}-{'pred' if predict else 'nopred'}" + (
        "-rbias" if router_bias else "") + ("-dup" if dup else "")


def select_experts_inputs(G, B, H, E, dtype, predict, router_bias, dup, uses_bias, seed):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(G * B, H, generator=gen).to(DEVICE, dtype)
    Wr = torch.randn(E, H, generator=gen) / H**0.5 * 3
    br = torch.randn(E, generator=gen) if router_bias else None
    if dup:  # pairs of experts with equal logits: ties to the lower index
        Wr[1::2] = Wr[0::2]
        if br is not None:
            br[1::2] = br[0::2]
    Wp = (torch.randn(E, H, generator=gen) / H**0.5).to(DEVICE, dtype) if predict else None
    bp = (torch.randn(E, generator=gen) * 0.5).to(DEVICE) if predict else None
    bias = (torch.randn(E, generator=gen) * 0.1).to(DEVICE) if uses_bias else None
    return hidden, Wr.to(DEVICE, dtype), None if br is None else br.to(DEVICE), Wp, bp, bias


@pytest.mark.parametrize("case", SELECT_EXPERTS_CASES, ids=_select_experts_id)
def test_select_experts(case):
    G, B, H, E, k, name, dtype, predict, router_bias, dup = case
    routing, uses_bias = routings(E, k)[name]
    hidden, Wr, br, Wp, bp, bias = select_experts_inputs(G, B, H, E, dtype, predict, router_bias, dup, uses_bias,
                                                         seed=zlib.crc32(repr(case).encode()) % 10_000)
    costs = [c for c in Cost if predict or c != Cost.BASE]
    checked_gemv = False
    for cost in costs:
        for budget in sorted({1, k, 16, E + 3}):
            for fill in Fill:
                logits, log_norms, *outputs = ops.select_experts(
                    hidden, Wr, routing, budget=budget, num_groups=G, cost=cost, fill=fill, router_bias=br,
                    predictor_weight=Wp, predictor_bias=bp, correction_bias=bias,
                )
                if not checked_gemv:  # stage 1 against fp64, like router_predict
                    assert_gemv_close(logits, hidden, Wr, br)
                    if predict:
                        assert_gemv_close(log_norms, hidden, Wp, bp)
                    checked_gemv = True
                # stages 2-3 against the reference on the op's own logits and log-norms
                cost_log_norms = log_norms if cost == Cost.BASE else None
                routed_ref, _ = reference.route(logits, routing, bias)
                union = reference.routed_union(routed_ref, G, E)
                _, _, D_ref = reference.route_cost(logits, cost_log_norms, bias, G, routing, cost)
                check_selection(outputs, logits, bias, routing, G, cost, budget, fill, union, D_ref)


@pytest.mark.parametrize("case", SELECT_EXPERTS_CASES, ids=_select_experts_id)
def test_select_experts_launch_path(case):
    """select_experts launches router_predict, then route_select, and nothing else (no copies, no third kernel):
    test_select_experts passes whatever runs, so extra launches on the decode path would go unseen there."""
    if DEVICE != "cuda":
        pytest.skip("launch paths are the CUDA kernels'")
    G, B, H, E, k, name, dtype, predict, router_bias, dup = case
    routing, uses_bias = routings(E, k)[name]
    hidden, Wr, br, Wp, bp, bias = select_experts_inputs(G, B, H, E, dtype, predict, router_bias, dup, uses_bias,
                                                         seed=7)
    cost = Cost.BASE if predict else Cost.ROUTER_SUM
    names = launched_kernels(lambda: ops.select_experts(hidden, Wr, routing, budget=k, num_groups=G, cost=cost,
                                                        router_bias=br, predictor_weight=Wp, predictor_bias=bp,
                                                        correction_bias=bias))
    assert len(names) == 2 and "router_predict" in names[0] and "route_select_kernel" in names[1], names


@pytest.mark.parametrize("bad,message", [
    (dict(budget=0), "budget"),
    (dict(routing=Routing(17, Scoring.SOFTMAX)), "top_k must be in"),
    (dict(num_groups=3), "multiple of num_groups"),
    (dict(correction_bias=True, routing=Routing(4, Scoring.SOFTMAX_AFTER_TOPK)), "only used with sigmoid"),
])
def test_select_experts_checks_before_launching(bad, message):
    """An argument that route_select refuses is refused before router_predict runs: a failing call launches nothing,
    where the same call with valid arguments launches both kernels (so the profiler does see them)."""
    if DEVICE != "cuda":
        pytest.skip("launches are the CUDA kernels'")
    hidden, Wr, _, Wp, bp, _ = select_experts_inputs(1, 4, 256, 16, torch.bfloat16, True, False, False, False, seed=3)
    args = dict(routing=Routing(4, Scoring.SOFTMAX), budget=4, num_groups=1, correction_bias=None)
    zero_bias = torch.zeros(16, device=DEVICE)  # made here: its fill kernel would count as a launch of the call

    def select(**changes):
        a = dict(args, **changes)
        if a["correction_bias"] is True:
            a["correction_bias"] = zero_bias
        return ops.select_experts(hidden, Wr, a["routing"], budget=a["budget"], num_groups=a["num_groups"],
                                  predictor_weight=Wp, predictor_bias=bp, correction_bias=a["correction_bias"])

    def refused():
        with pytest.raises(RuntimeError, match=message):
            select(**bad)

    assert len(launched_kernels(select)) == 2
    assert launched_kernels(refused) == []


@TWO_GPUS
@pytest.mark.parametrize("B", [4, 64])
def test_select_experts_on_a_non_current_gpu(B):
    routing = Routing(8, Scoring.SOFTMAX, renormalize=True)
    hidden, Wr, _, Wp, bp, _ = select_experts_inputs(2, B, 2048, 128, torch.bfloat16, True, False, False, False, seed=B)

    def select(hidden, Wr, Wp, bp):
        return ops.select_experts(hidden, Wr, routing, budget=16, num_groups=2, predictor_weight=Wp, predictor_bias=bp)

    assert_same_on_a_non_current_gpu(select, hidden, Wr, Wp, bp)


def test_select_experts_deterministic():
    G, B, E, H = 2, 64, 128, 2048
    routing = Routing(8, Scoring.SOFTMAX, renormalize=True)
    hidden, Wr, _, Wp, bp, _ = select_experts_inputs(G, B, H, E, torch.bfloat16, True, False, False, False, seed=21)
    first = ops.select_experts(hidden, Wr, routing, budget=16, num_groups=G, predictor_weight=Wp, predictor_bias=bp)
    for _ in range(5):
        again = ops.select_experts(hidden, Wr, routing, budget=16, num_groups=G, predictor_weight=Wp,
                                   predictor_bias=bp)
        assert all(bitwise_equal(a, b) for a, b in zip(first, again))


def test_select_experts_alternating_inputs():
    """Calls on two inputs in turn give each input's first outputs bit for bit. On the GPU route_select runs each group
    on its own cluster, whose CTAs rank the keys pushed to their inboxes, so a CTA that ranked before all the keys
    pushed to it had landed would see the other input's keys, left in the same SM's shared memory by the call
    before."""
    G, B, E, H = 8, 16, 128, 2048
    routing = Routing(8, Scoring.SOFTMAX, renormalize=True)
    inputs = [select_experts_inputs(G, B, H, E, torch.bfloat16, True, False, False, False, seed=seed)
              for seed in (31, 32)]

    def select(x):
        hidden, Wr, _, Wp, bp, _ = x
        return ops.select_experts(hidden, Wr, routing, budget=16, num_groups=G, predictor_weight=Wp,
                                  predictor_bias=bp)

    firsts = [select(x) for x in inputs]
    kept = 4
    assert not torch.equal(firsts[0][kept], firsts[1][kept])  # else a stale read could not show
    for i in range(100):
        again = select(inputs[i % 2])
        assert all(bitwise_equal(a, b) for a, b in zip(firsts[i % 2], again))


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
@pytest.mark.parametrize("E,H,T,G", [(128, 2048, 16, 1), (256, 1024, 64, 4), (128, 512, 512, 1)])
def test_cuda_graph_replay(E, H, T, G):
    k = 8
    routing = Routing(k, Scoring.SIGMOID, renormalize=True, n_group=8, topk_group=4, scaling=2.5)
    hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    Wr = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) / H**0.5
    Wp = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) / H**0.5
    bp = torch.randn(E, device="cuda") * 0.1
    bias = torch.randn(E, device="cuda") * 0.1

    def step():
        logits, log_norms = ops.router_predict(hidden, Wr, None, Wp, bp)
        two_kernels = (logits, log_norms) + ops.route_select(logits, routing, budget=16, num_groups=G,
                                                             log_norms=log_norms, correction_bias=bias)
        one_op = ops.select_experts(hidden, Wr, routing, budget=16, num_groups=G, predictor_weight=Wp,
                                    predictor_bias=bp, correction_bias=bias)
        return two_kernels + one_op

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for trial in range(3):
        hidden.copy_(torch.randn(T, H, device="cuda", dtype=torch.bfloat16))
        bias.copy_(torch.randn(E, device="cuda") * 0.1)
        graph.replay()
        eager = step()
        names = ("logits", "log_norms", "ids", "weights", "kept", "counts", "D")
        for name, a, b in zip(names + tuple(f"select_experts {n}" for n in names), static_out, eager):
            assert bitwise_equal(a, b), f"replay {trial}: {name} differs from an eager call"


# ---------------------------------------------------------------------------------------------
# Op registration and argument checks
# ---------------------------------------------------------------------------------------------
def test_opcheck():
    G, B, E, k, H = 2, 8, 64, 4, 256
    hidden = torch.randn(G * B, H, device=DEVICE, dtype=torch.bfloat16)
    Wr = torch.randn(E, H, device=DEVICE, dtype=torch.bfloat16)
    Wp = torch.randn(E, H, device=DEVICE, dtype=torch.bfloat16)
    br = torch.randn(E, device=DEVICE)
    bp = torch.randn(E, device=DEVICE)
    torch.library.opcheck(torch.ops.base_moe.router_predict.default, (hidden, Wr, br, Wp, bp))
    torch.library.opcheck(torch.ops.base_moe.router_predict.default, (hidden, Wr, None, None, None))
    logits, log_norms, bias = make_inputs(G, B, E, True, "normal", seed=13)
    D = torch.rand(G, E, device=DEVICE)
    routing = (k, int(Scoring.SIGMOID), True, 8, 4, 2.5)
    torch.library.opcheck(torch.ops.base_moe.route_cost.default, (logits, log_norms, bias, G, *routing, 0))
    torch.library.opcheck(torch.ops.base_moe.select_fill.default, (logits, D, bias, *routing, 6, 0))
    torch.library.opcheck(torch.ops.base_moe.route_select.default, (logits, log_norms, bias, G, *routing, 0, 6, 2))
    softmax = (k, int(Scoring.SOFTMAX), False, 1, 1, 1.0)
    torch.library.opcheck(torch.ops.base_moe.route_select.default, (logits, None, None, G, *softmax, 3, 100, 1))
    torch.library.opcheck(torch.ops.base_moe.select_experts.default,
                          (hidden, Wr, br, Wp, bp, bias, G, *routing, 0, 6, 0))
    torch.library.opcheck(torch.ops.base_moe.select_experts.default,
                          (hidden, Wr, None, None, None, None, G, *softmax, 4, 3, 2))


_BAD_INPUTS = {
    # name: (expected message, statement run with ops, Routing, Scoring, Cost, torch, E=64, H=128, k=4 in scope)
    "router_weight_device": ("same device", "ops.router_predict(hidden, Wr.cpu())"),
    "select_experts_weight_device": ("same device", "ops.select_experts(hidden, Wr.cpu(), softmax, budget=4, cost=Cost.FREQUENCY)"),
    "select_experts_budget_zero": ("budget", "ops.select_experts(hidden, Wr, softmax, budget=0, cost=Cost.FREQUENCY)"),
    "select_experts_base_without_predictor": ("predictor_weight", "ops.select_experts(hidden, Wr, softmax, budget=4)"),
    "router_weight_dtype": ("dtype", "ops.router_predict(hidden, Wr.half())"),
    "predictor_without_bias": ("predictor_bias", "ops.router_predict(hidden, Wr, None, Wr, None)"),
    "log_norms_device": ("same device", "ops.route_select(logits, softmax, budget=4, log_norms=torch.randn(4, E))"),
    "logits_dtype": ("float32", "ops.route_select(logits.half(), softmax, budget=4, cost=Cost.FREQUENCY)"),
    "budget_zero": ("budget", "ops.route_select(logits, softmax, budget=0, cost=Cost.FREQUENCY)"),
    "select_fill_budget_zero": ("budget", "ops.select_fill(logits, torch.rand(1, E, device=dev), softmax, budget=0)"),
    "groups_not_dividing": ("multiple of num_groups", "ops.route_cost(logits, softmax, num_groups=3, cost=Cost.FREQUENCY)"),
    "batch_cost_device": ("same device", "ops.select_fill(logits, torch.rand(1, E), softmax, budget=4)"),
    "correction_bias_device": (
        "same device",
        "ops.route_cost(logits, Routing(k, Scoring.SIGMOID), cost=Cost.FREQUENCY, correction_bias=torch.zeros(E))",
    ),
}

_BAD_INPUT_SCRIPT = """
import sys, torch, base_moe
from base_moe import Cost, Routing, Scoring, ops
dev, expected, statement = sys.argv[1], sys.argv[2], sys.argv[3]
E, H, k = 64, 128, 4
hidden = torch.randn(4, H, device=dev, dtype=torch.bfloat16)
Wr = torch.randn(E, H, device=dev, dtype=torch.bfloat16)
logits = torch.randn(4, E, device=dev)
softmax = Routing(k, Scoring.SOFTMAX, renormalize=True)
try:
    exec(statement)
except RuntimeError as error:
    sys.exit(0 if expected in str(error) else 3)
sys.exit(2)
"""


@pytest.mark.skipif(DEVICE != "cuda", reason="device mixes")
@pytest.mark.parametrize("name", sorted(_BAD_INPUTS))
def test_bad_inputs_raise(name):
    """Each bad call raises a RuntimeError naming the problem. Run in a subprocess: one of them (budget=0 on CUDA)
    crashed the interpreter on the H200 machine instead of raising, and a crash must not take the suite down."""
    import subprocess

    expected, statement = _BAD_INPUTS[name]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", _BAD_INPUT_SCRIPT, DEVICE, expected, statement], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (
        f"{statement}: exit code {done.returncode} (2: no error raised, 3: wrong message, negative: crashed by "
        f"signal)\n{done.stderr[-2000:]}"
    )


# ---------------------------------------------------------------------------------------------
# A few calls of every op, for compute-sanitizer (memcheck / racecheck)
# ---------------------------------------------------------------------------------------------
def _sanitize(small: bool = False):
    torch.manual_seed(0)
    # (48 and 24 tokens: route_select on clusters of 4-warp CTAs)
    shapes = ((3, 256, 64), (70, 512, 128), (48, 256, 128), (24, 512, 256))
    shapes = shapes if small else shapes + ((300, 256, 256),)
    for T, H, E in shapes:
        hidden = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        Wr = torch.randn(E, H, device="cuda", dtype=torch.bfloat16)
        Wp = torch.randn(E, H, device="cuda", dtype=torch.bfloat16)
        bp = torch.randn(E, device="cuda")
        logits, log_norms = ops.router_predict(hidden, Wr, None, Wp, bp)
        ops.router_predict(hidden.float(), Wr.float(), None, Wp.float(), bp)
        bias = torch.randn(E, device="cuda") * 0.1
        for routing, b in (
            (Routing(8, Scoring.SOFTMAX, renormalize=True), None),
            (Routing(8, Scoring.SIGMOID, renormalize=True, n_group=8, topk_group=4, scaling=2.5), bias),
        ):
            for G in (1, T // 3 if T % 3 == 0 else 1):
                for fill in Fill:
                    ops.route_select(logits, routing, budget=6, num_groups=G, fill=fill, log_norms=log_norms,
                                     correction_bias=b)
                    ops.select_experts(hidden, Wr, routing, budget=6, num_groups=G, fill=fill, predictor_weight=Wp,
                                       predictor_bias=bp, correction_bias=b)
                ids, w, D = ops.route_cost(logits, routing, num_groups=G, cost=Cost.TOP1_UNION, correction_bias=b)
                ops.select_fill(logits, D, routing, budget=20, fill=Fill.DROP_RENORM, correction_bias=b)
                # voting flags: TOP1_UNION counts the voters (a CTA-wide count), BASE through every plan
                voting = torch.rand(T, device="cuda") < 0.5
                ops.route_select(logits, routing, budget=6, num_groups=G, cost=Cost.TOP1_UNION, correction_bias=b,
                                 voting=voting)
                ops.select_experts(hidden, Wr, routing, budget=6, num_groups=G, predictor_weight=Wp, predictor_bias=bp,
                                   correction_bias=b, voting=voting)
                ops.select_fill(logits, D, routing, budget=20, correction_bias=b, voting=voting)
    # route_select on its largest cluster (one token per warp over 256 tokens), once: racecheck is slow there
    logits = torch.randn(256, 128, device="cuda")
    softmax = Routing(8, Scoring.SOFTMAX, renormalize=True)
    ops.route_select(logits, softmax, budget=16, log_norms=torch.randn_like(logits))
    ops.route_select(logits, softmax, budget=16, cost=Cost.TOP1_UNION, voting=torch.rand(256, device="cuda") < 0.5)
    if not small:
        big = torch.randn(2 * 700, 512, device="cuda")
        ops.route_select(big, Routing(16, Scoring.SOFTMAX), budget=40, num_groups=2, cost=Cost.FREQUENCY)
    torch.cuda.synchronize()
    print("sanitize: ok")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "sanitize":
        # every tensor its own allocation, so that memcheck sees an access past a tensor's end (the caching
        # allocator's blocks hold several tensors; set before the first CUDA allocation)
        os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
        _sanitize(small=len(sys.argv) > 2 and sys.argv[2] == "small")
    else:
        sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
