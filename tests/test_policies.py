"""OEA, Lynx and per-token top-k reduction (issue 6) against loop-by-loop plain-PyTorch references, on CPU, under every
scoring and fill rule; policy names with options; every policy of DESIGN section 5 reachable through
``apply``/``configure``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hf_models import FAMILIES, StandInPredictors, random_similarity, tiny_model

import base_moe
from base_moe import Cost, Fill, Routing, Scoring, reference
from base_moe.hf import moe_layouts, selections
from base_moe.policies import (
    SUBSTITUTE,
    CostPolicy,
    DecodeStep,
    LynxPolicy,
    OEAPolicy,
    TopKReducePolicy,
    available_policies,
    get_policy,
    parse_fill,
    register_policy,
    substitute_dropped,
)

DESIGN_POLICIES = ["dense", "base", "oracle", "static_energy", "router_sum", "router_sq", "frequency", "top1_union",
                   "oea", "lynx", "topk_reduce"]


# ---------------------------------------------------------------------------------------------
# Loop references (softmax routing, with or without renormalisation)
# ---------------------------------------------------------------------------------------------
def ranked(row: torch.Tensor) -> list[int]:
    """Experts by descending logit, ties to the lower index."""
    return sorted(range(row.numel()), key=lambda u: (-float(row[u]), u))


def weights_of(logits_row: torch.Tensor, experts: list[int], renormalize: bool) -> list[float]:
    p = torch.softmax(logits_row.double(), dim=-1)
    w = [float(p[u]) for u in experts]
    total = sum(w)
    return [x / total for x in w] if renormalize and total > 0 else w


def backfill_ref(logits: torch.Tensor, groups: int, keep: list[set[int]], k: int, renormalize: bool):
    """Every token's top-k among its group's keep set, and its weights; sentinel-padded ids [T, k]."""
    T, E = logits.shape
    B = T // groups
    ids = torch.full((T, k), E, dtype=torch.int32)
    w = torch.zeros(T, k, dtype=torch.float64)
    for t in range(T):
        chosen = [u for u in ranked(logits[t]) if u in keep[t // B]][:k]
        ids[t, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
        w[t, : len(chosen)] = torch.tensor(weights_of(logits[t], chosen, renormalize), dtype=torch.float64)
    return ids, w


def softmax_routed(logits: torch.Tensor, k: int, renormalize: bool) -> list[list[tuple[int, float]]]:
    """Each token's routed slots, (expert, weight) in rank order, of softmax routing."""
    out = []
    for row in logits:
        experts = ranked(row)[:k]
        out.append(list(zip(experts, weights_of(row, experts, renormalize))))
    return out


def routed_union(routed, groups: int, slots: int | None = None) -> list[set[int]]:
    """Per group, the experts in the first ``slots`` routed slots (all with None) of its tokens."""
    B = len(routed) // groups
    return [{u for token in routed[g * B:(g + 1) * B] for u, _ in token[:slots]} for g in range(groups)]


def oea_ref(logits, groups, k, k0, renormalize):
    keep = routed_union(softmax_routed(logits, k0, renormalize), groups)
    return backfill_ref(logits, groups, keep, k, renormalize), keep


def lynx_scores_ref(routed, groups, E, bins=4, width=math.log(2.0), decay=0.5):
    """Each slot scores decay ** its bin, the bin counted from the token's largest weight."""
    B = len(routed) // groups
    D = torch.zeros(groups, E, dtype=torch.float64)
    for t, slots in enumerate(routed):
        top = max(w for _, w in slots)
        for u, w in slots:
            D[t // B, u] += decay ** min(bins - 1, math.floor(math.log(top / w) / width))
    return D


def lynx_threshold_keep(D: torch.Tensor, threshold: float) -> list[set[int]]:
    """Every expert whose score reaches the threshold, and the best one (ties to the lower index)."""
    E = D.shape[1]
    best = [min(range(E), key=lambda u: (-float(row[u]), u)) for row in D]
    return [{u for u in range(E) if row[u] >= threshold and row[u] > 0} | {b} for row, b in zip(D, best)]


def top_by(D_row: torch.Tensor, candidates: set[int], m: int) -> set[int]:
    return set(sorted(candidates, key=lambda u: (-float(D_row[u]), u))[:m])


def make_step(logits, routing, groups, budget=None, fill=Fill.BACKFILL) -> DecodeStep:
    T = logits.shape[0]
    return DecodeStep(hidden=torch.zeros(T, 4), logits=logits, predicted_log_norms=None, routing=routing,
                      correction_bias=None, num_groups=groups, budget=budget, fill=fill, layout=None)


def random_logits(T, E, seed, ties=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 2
    if ties:  # equal logits on purpose: ranking must go to the lower index
        logits = torch.round(logits)
    return logits


CASES = [(1, 8, 16, 4), (3, 5, 12, 3), (2, 1, 8, 2), (4, 16, 32, 4)]  # groups, tokens per group, experts, top-k


# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("groups,B,E,k", CASES)
@pytest.mark.parametrize("k0", [1, 2])
def test_oea_matches_loop_reference(groups, B, E, k, k0, renormalize, ties):
    logits = random_logits(groups * B, E, seed=groups * 100 + B, ties=ties)
    routing = Routing(k, Scoring.SOFTMAX, renormalize)
    sel = OEAPolicy(k0).select(make_step(logits, routing, groups))
    (ids, w), keep = oea_ref(logits, groups, k, k0, renormalize)
    assert torch.equal(sel.ids, ids)
    torch.testing.assert_close(sel.weights.double(), w, rtol=1e-5, atol=1e-6)
    for g in range(groups):  # kept: the seed union, ascending, then sentinels
        kept = [u for u in sel.kept[g].tolist() if u < E]
        assert kept == sorted(keep[g])
        assert all(u == E for u in sel.kept[g, len(kept):].tolist())
    assert torch.equal(sel.counts, reference.expert_counts(ids, groups, E))


def test_oea_with_k0_equal_k_is_dense():
    logits = random_logits(24, 16, seed=5)
    routing = Routing(4, Scoring.SOFTMAX, True)
    sel = OEAPolicy(4).select(make_step(logits, routing, 3))
    ids, w = reference.route(logits, routing)
    assert torch.equal(sel.ids, ids)
    torch.testing.assert_close(sel.weights, w)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("groups,B,E,k", CASES)
@pytest.mark.parametrize("budget", [1, 3, 6, 100])
def test_lynx_budgeted_matches_loop_reference(groups, B, E, k, budget, renormalize):
    logits = random_logits(groups * B, E, seed=7 + groups + B)
    routing = Routing(k, Scoring.SOFTMAX, renormalize)
    sel = LynxPolicy().select(make_step(logits, routing, groups, budget=budget))
    routed = softmax_routed(logits, k, renormalize)
    D = lynx_scores_ref(routed, groups, E)
    torch.testing.assert_close(sel.batch_cost.double(), D, rtol=1e-6, atol=1e-6)
    union = routed_union(routed, groups)
    keep = [top_by(D[g], union[g], budget) for g in range(groups)]
    ids, w = backfill_ref(logits, groups, keep, k, renormalize)
    assert torch.equal(sel.ids, ids)
    torch.testing.assert_close(sel.weights.double(), w, rtol=1e-5, atol=1e-6)
    for g in range(groups):
        assert {u for u in sel.kept[g].tolist() if u < E} == keep[g]


@pytest.mark.parametrize("groups,B,E,k", CASES)
@pytest.mark.parametrize("threshold", [0.5, 2.0, 3.0, 1000.0])
def test_lynx_threshold_matches_loop_reference(groups, B, E, k, threshold):
    logits = random_logits(groups * B, E, seed=11 + groups)
    routing = Routing(k, Scoring.SOFTMAX, True)
    policy = get_policy(f"lynx:threshold={threshold}:bins=3:decay=0.25")
    assert not policy.needs_budget
    sel = policy.select(make_step(logits, routing, groups))
    D = lynx_scores_ref(softmax_routed(logits, k, True), groups, E, bins=3, decay=0.25)
    keep = lynx_threshold_keep(D, threshold)
    ids, w = backfill_ref(logits, groups, keep, k, True)
    assert torch.equal(sel.ids, ids)
    torch.testing.assert_close(sel.weights.double(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("keep", [None, 1, 3, 8])
@pytest.mark.parametrize("k", [3, 4, 5])  # the default keeps k // 2: odd k rounds down
def test_topk_reduce_matches_loop_reference(keep, renormalize, k):
    T, E = 10, 12
    logits = random_logits(T, E, seed=3)
    routing = Routing(k, Scoring.SOFTMAX, renormalize)
    sel = TopKReducePolicy(keep).select(make_step(logits, routing, 2))
    kk = min(keep if keep is not None else k // 2, k)
    for t in range(T):
        routed = ranked(logits[t])[:k]
        w = weights_of(logits[t], routed, renormalize)
        scale = sum(w) / sum(w[:kk])
        assert sel.ids[t].tolist() == routed[:kk] + [E] * (k - kk)
        torch.testing.assert_close(sel.weights[t].double(), torch.tensor(
            [x * scale for x in w[:kk]] + [0.0] * (k - kk), dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_topk_reduce_keeps_the_total_of_tiny_weights():
    """Sigmoid scores of logits near -80 are ~1e-35 (normal fp32, below the 1e-30 that the scale's divisor was once
    clamped to): the kept weights must still sum to the routed total."""
    T, E, k = 6, 16, 4
    logits = random_logits(T, E, seed=5) - 80.0
    routing = Routing(k, Scoring.SIGMOID, renormalize=False)
    sel = TopKReducePolicy(2).select(make_step(logits, routing, 2))
    _, routed_weights = reference.route(logits, routing, None)
    assert (routed_weights < 1e-30).all() and (routed_weights > 0).all()
    torch.testing.assert_close(sel.weights.sum(dim=1), routed_weights.sum(dim=1), rtol=1e-5, atol=0.0)
    assert (sel.weights[:, 2:] == 0).all() and (sel.weights[:, :2] > 0).all()


def test_lynx_bins_tiny_weights_by_their_ratio():
    """Sigmoid scores of logits near -80 are ~1e-35 (normal fp32, below the 1e-30 that both sides of the ratio were
    once clamped to, which put every slot in bin 0): the bins follow top / w at any scale."""
    T, E, k = 12, 16, 4
    logits = random_logits(T, E, seed=7) - 80.0
    routing = Routing(k, Scoring.SIGMOID, renormalize=False)
    ids, w = reference.route(logits, routing, None)
    assert (w < 1e-30).all() and (w > 0).all()
    routed = [list(zip(ids[t].tolist(), w[t].double().tolist())) for t in range(T)]
    D = get_policy("lynx").batch_scores(make_step(logits, routing, 2))
    expected = lynx_scores_ref(routed, 2, E)
    assert len({float(x) for x in expected.flatten()}) > 2  # several bins, not only 0
    torch.testing.assert_close(D.double(), expected)


def test_topk_reduce_of_a_tiny_first_weight_stays_finite():
    """A correction bias ranks first an expert whose sigmoid is ~6e-39 (DeepSeek-V3-style routing): keeping it alone,
    total / kept_total overflows fp32. Its weight becomes the routed total, the empty slots weigh 0 (not inf, NaN)."""
    E, k = 16, 8
    routing = Routing(k, Scoring.SIGMOID, renormalize=True, scaling=2.5)
    logits = torch.full((1, E), 4.0)
    logits[0, 0], logits[0, 9:] = -88.0, -5.0
    bias = torch.zeros(E)
    bias[0] = 1.5
    step = make_step(logits, routing, 1)
    step.correction_bias = bias
    sel = TopKReducePolicy(1).select(step)
    _, routed_weights = reference.route(logits, routing, bias)
    assert routed_weights[0, 0] < torch.finfo(torch.float32).tiny
    assert sel.ids.tolist() == [[0] + [E] * (k - 1)]
    assert torch.equal(sel.weights[0, 1:], torch.zeros(k - 1))
    torch.testing.assert_close(sel.weights[0, 0], routed_weights.sum(), rtol=1e-6, atol=0.0)


# ---------------------------------------------------------------------------------------------
# Every scoring and fill rule: loop references over the model's routing (reference.route, itself checked against
# the ops in tests/test_ops.py), so the policies' own rules are what these tests check
# ---------------------------------------------------------------------------------------------
SCORINGS = {  # routing, correction bias
    "softmax": (Routing(3, Scoring.SOFTMAX, renormalize=True), None),
    # the bias reorders the routed slots, so the top-1 slot is often not the largest weight
    "sigmoid_grouped": (Routing(3, Scoring.SIGMOID, renormalize=True, n_group=4, topk_group=2, scaling=2.5),
                        torch.linspace(1.0, -1.0, 16)),
    "softmax_after_topk": (Routing(3, Scoring.SOFTMAX_AFTER_TOPK, renormalize=False), None),
}


def scoring_step(scoring, fill=Fill.BACKFILL, budget=3, seed=21):
    routing, bias = SCORINGS[scoring]
    logits = random_logits(12, 16, seed=seed)
    step = make_step(logits, routing, 2, budget=budget, fill=fill)
    step.correction_bias = bias
    ids, w = reference.route(logits, routing, bias)
    routed = [list(zip(ids[t].tolist(), w[t].double().tolist())) for t in range(12)]
    if scoring == "sigmoid_grouped":
        assert any(slots[0][1] < max(x for _, x in slots) for slots in routed)
    return step, routed


def drop_fill_loop(routed, groups, keep, E, renormalize):
    """``drop`` / ``drop_renorm``: each token's routed experts in the keep set, in routing order, sentinels after;
    with renormalisation the survivors' weights scaled to the routed total (0 when none survives)."""
    B, k = len(routed) // groups, len(routed[0])
    ids = torch.full((len(routed), k), E, dtype=torch.int32)
    w = torch.zeros(len(routed), k, dtype=torch.float64)
    for t, slots in enumerate(routed):
        survivors = [(u, x) for u, x in slots if u in keep[t // B]]
        kept_total = sum(x for _, x in survivors)
        scale = sum(x for _, x in slots) / kept_total if renormalize and kept_total > 0 else 1.0
        for j, (u, x) in enumerate(survivors):
            ids[t, j], w[t, j] = u, x * scale
    return ids, w


def kept_tensor(keep, E):
    return torch.tensor([sorted(s) + [E] * (E - len(s)) for s in keep], dtype=torch.int32)


@pytest.mark.parametrize("fill", list(Fill))
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("policy", ["oea", "oea:k0=2", "lynx", "lynx:threshold=1.5"])
def test_keep_rule_policies_match_loop_reference(policy, scoring, fill):
    step, routed = scoring_step(scoring, fill)
    E = 16
    sel = get_policy(policy).select(step)
    if policy.startswith("oea"):
        keep = routed_union(routed, 2, slots=2 if policy == "oea:k0=2" else 1)
    else:
        D = lynx_scores_ref(routed, 2, E)
        torch.testing.assert_close(sel.batch_cost.double(), D, rtol=1e-6, atol=1e-6)
        if policy == "lynx":  # the top 3 routed experts by D, ties to the lower index
            keep = [top_by(D[g], union, 3) for g, union in enumerate(routed_union(routed, 2))]
        else:
            keep = lynx_threshold_keep(D, 1.5)
    assert [{u for u in row.tolist() if u < E} for row in sel.kept] == keep
    if fill == Fill.BACKFILL:  # the fill rule itself is checked against the ops in tests/test_ops.py
        ids, w = reference.fill(step.logits, step.correction_bias, step.routing, kept_tensor(keep, E), fill)
    else:
        ids, w = drop_fill_loop(routed, 2, keep, E, fill == Fill.DROP_RENORM)
    assert torch.equal(sel.ids, ids)
    torch.testing.assert_close(sel.weights.double(), w.double(), rtol=1e-5, atol=1e-6)
    assert torch.equal(sel.counts, reference.expert_counts(ids, 2, E))


@pytest.mark.parametrize("scoring", SCORINGS)
def test_topk_reduce_follows_every_scoring(scoring):
    step, routed = scoring_step(scoring)
    sel = TopKReducePolicy(2).select(step)
    counts = torch.zeros(2, 16, dtype=torch.int32)
    for t, slots in enumerate(routed):
        kept = slots[:2]
        scale = sum(x for _, x in slots) / sum(x for _, x in kept)
        assert sel.ids[t].tolist() == [u for u, _ in kept] + [16]
        torch.testing.assert_close(sel.weights[t].double(), torch.tensor([x * scale for _, x in kept] + [0.0],
                                                                         dtype=torch.float64), rtol=1e-5, atol=1e-6)
        for u, _ in kept:
            counts[t // 6, u] += 1
    assert torch.equal(sel.counts, counts)


# ---------------------------------------------------------------------------------------------
# Names, options, reachability
# ---------------------------------------------------------------------------------------------
def test_every_design_policy_is_registered():
    assert set(DESIGN_POLICIES) <= set(available_policies())


def test_has_kernel_knows_every_op_of_the_library():
    """has_kernel answers for every base_moe op from the build's registrations: an op left out of its table would
    never run its CUDA kernel (the HF integration would take the reference or the model's own module instead)."""
    ops = {name.split("::")[1] for name in torch._C._dispatch_get_all_op_names() if name.startswith("base_moe::")}
    assert ops and set(base_moe.policies._CUDA_KERNELS) == ops


@pytest.mark.parametrize("spec,cls,attrs", [
    ("oea:k0=3", OEAPolicy, {"k0": 3, "name": "oea:k0=3"}),
    ("oea", OEAPolicy, {"k0": 1, "name": "oea"}),
    ("topk_reduce:k=2", TopKReducePolicy, {"k": 2}),
    ("lynx:threshold=2.5", LynxPolicy, {"threshold": 2.5, "needs_budget": False}),
    ("lynx:bins=2", LynxPolicy, {"bins": 2, "needs_budget": True, "threshold": None}),
    ("lynx:threshold=1234567", LynxPolicy, {"threshold": 1234567, "name": "lynx:threshold=1234567"}),
    ("lynx:threshold=2.5000001", LynxPolicy, {"threshold": 2.5000001, "name": "lynx:threshold=2.5000001"}),
    ("lynx:threshold=4.0:decay=0.25", LynxPolicy, {"name": "lynx:threshold=4.0:decay=0.25"}),
])
def test_policy_specs(spec, cls, attrs):
    policy = get_policy(spec)
    assert isinstance(policy, cls)
    for key, value in attrs.items():
        assert getattr(policy, key) == value
    assert get_policy(policy.name).name == policy.name  # the name round-trips


@pytest.mark.parametrize("spec,message", [
    ("oea:k0=0", "k0 must be an int >= 1"),
    ("oea:k=2", "unexpected keyword"),
    ("oea:k0", "key=value"),
    ("base:x=1", "take options"),
    ("topk_reduce:k=1.5", "must be an int"),
    ("lynx:decay=2", "decay"),
    ("lynx:threshold=0", "threshold must be a number > 0"),
    ("lynx:threshold=-5", "threshold must be a number > 0"),
    ("lynx:threshold=nan", "threshold must be a number > 0"),
    ("lynx:threshold=inf", "threshold must be a number > 0"),
    ("oea:k0=2:k0=3", "option 'k0' given twice"),
    ("lynx:bins=2:decay=0.5:bins=3", "option 'bins' given twice"),
])
def test_bad_policy_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        get_policy(spec)


def test_numpy_scalars_are_numbers():
    """Policies built in a sweep over numpy values take them as the plain numbers, and their names parse back."""
    assert OEAPolicy(k0=np.int64(2)).k0 == 2 and TopKReducePolicy(k=np.int32(2)).k == 2
    lynx = LynxPolicy(threshold=np.float32(4.0), bins=np.int64(3))
    assert (lynx.threshold, lynx.bins, lynx.name) == (4.0, 3, "lynx:threshold=4.0:bins=3")
    assert type(lynx.threshold) is float and get_policy(lynx.name).name == lynx.name
    assert LynxPolicy(threshold=np.int64(5)).name == "lynx:threshold=5"
    for bad in (np.float64(1.5), True, np.bool_(True)):
        with pytest.raises(ValueError, match="k0 must be an int >= 1"):
            OEAPolicy(k0=bad)


@pytest.mark.parametrize("spec", ["oea:k0=3", "topk_reduce:k=3"])
def test_more_experts_per_token_than_routed_is_refused_at_apply(spec):
    """The tiny models route top-2: an option above it would silently run the dense model."""
    model = tiny_model("qwen3_moe")
    with pytest.raises(ValueError, match=r"=3 is more experts per token than MoE block .* routes \(top-2\)"):
        base_moe.apply(model, policy=spec)
    base_moe.apply(model, policy=spec.replace("3", "2"))  # top-2 itself is allowed (and dense)


def test_lynx_names_of_numpy_values_parse_back():
    import numpy as np

    policy = LynxPolicy(threshold=np.float64(4.0), decay=np.float32(0.25))
    assert policy.name == "lynx:threshold=4.0:decay=0.25" and get_policy(policy.name).threshold == 4.0


def test_register_policy_checks_its_argument():
    with pytest.raises(TypeError, match="takes a base_moe.policies.Policy"):
        register_policy("router_sq")
    renamed = get_policy("router_sq")
    with pytest.raises(ValueError, match="without ':'"):
        register_policy(CostPolicy("router_sq:v2", renamed.cost, renamed.log_norms))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["oea", "oea:k0=2", "lynx", "lynx:threshold=2", "topk_reduce", "topk_reduce:k=1"])
def test_new_policies_run_in_every_family(family, policy):
    model = tiny_model(family)
    ids = torch.randint(3, 64, (6, 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        dense = model(ids).logits
    base_moe.apply(model, policy=policy, budget=3 if get_policy(policy).needs_budget else None, record=True)
    with torch.no_grad():
        out = model(ids).logits
    assert torch.isfinite(out).all()
    for layout in moe_layouts(model):
        sel, groups = selections(model)[layout.layer_index]
        assert groups == 1 and sel.ids.shape == (6, layout.routing.top_k)
        E = layout.num_experts
        active = set(sel.ids[sel.ids < E].tolist())
        if policy == "lynx":
            assert len(active) <= 3
        if sel.kept is not None:
            assert active <= set(sel.kept[0][sel.kept[0] < E].tolist())
    base_moe.configure(model, policy="dense")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, dense)


@pytest.mark.parametrize("policy", DESIGN_POLICIES)
def test_every_design_policy_through_apply_and_configure(policy):
    model = tiny_model("qwen3_moe")
    ids = torch.randint(3, 64, (5, 1), generator=torch.Generator().manual_seed(1))
    takes_budget = get_policy(policy).needs_budget  # the others warn that a budget does not apply to them
    base_moe.apply(model, predictors=StandInPredictors(model), policy=policy, budget=2 if takes_budget else None)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    base_moe.configure(model, policy="dense", budget=None)
    base_moe.configure(model, policy=policy, budget=3 if takes_budget else None, fill="drop")
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


# ---------------------------------------------------------------------------------------------
# The substitute fill (SERE-like)
# ---------------------------------------------------------------------------------------------
def substitute_loop(routed, groups, keep, similarity, E):
    """Each routed slot whose expert is not in its group's keep set moves, with its weight, to the kept expert most
    similar to it (ties to the lower index); slots landing on one expert add up in the first of them; the token's
    experts in slot order, then sentinels. A group that keeps nothing gives its tokens no expert."""
    B, k = len(routed) // groups, len(routed[0])
    ids = torch.full((len(routed), k), E, dtype=torch.int32)
    w = torch.zeros(len(routed), k, dtype=torch.float64)
    for t, slots in enumerate(routed):
        keep_t = sorted(keep[t // B])
        merged: dict[int, float] = {}
        for u, x in slots:
            if keep_t:
                v = u if u in keep_t else max(keep_t, key=lambda c: (float(similarity[u, c]), -c))
                merged[v] = merged.get(v, 0.0) + x
        for j, (v, x) in enumerate(merged.items()):
            ids[t, j], w[t, j] = v, x
    return ids, w


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("policy", ["router_sum", "frequency", "oea", "lynx"])
def test_substitute_matches_loop_reference(policy, scoring, ties):
    E = 16
    step, routed = scoring_step(scoring, Fill.DROP, budget=3)
    dropped = get_policy(policy).select(step)
    keep = [set(dropped.ids[g * 6:(g + 1) * 6].flatten().tolist()) - {E} for g in range(2)]
    if dropped.kept is not None:  # the union of the dropped selection's ids is the kept set
        assert keep == [set(row.tolist()) - {E} for row in dropped.kept]
    similarity = random_similarity(E, torch.Generator().manual_seed(5), ties=ties)
    sel = substitute_dropped(step, dropped, similarity)
    ids, w = substitute_loop(routed, 2, keep, similarity, E)
    assert torch.equal(sel.ids, ids)
    torch.testing.assert_close(sel.weights.double(), w, rtol=1e-6, atol=1e-7)
    assert torch.equal(sel.counts, reference.expert_counts(sel.ids, 2, E))
    # the weight moves, none is lost: every token keeps its routed total
    routed_total = torch.tensor([sum(x for _, x in r) for r in routed], dtype=torch.float64)
    torch.testing.assert_close(sel.weights.double().sum(-1), routed_total, rtol=1e-6, atol=1e-7)


def test_substitute_of_a_group_that_keeps_nothing():
    """A group whose dropped selection holds no expert (every slot a sentinel) gets no expert at all, never a
    default one that nobody loads."""
    E = 8
    step = make_step(random_logits(4, E, seed=3), Routing(2, Scoring.SOFTMAX), 2, budget=2, fill=Fill.DROP)
    dropped = get_policy("router_sum").select(step)
    dropped.ids[2:], dropped.kept[1] = E, E
    sel = substitute_dropped(step, dropped, random_similarity(E, torch.Generator().manual_seed(1)))
    assert torch.all(sel.ids[2:] == E) and torch.all(sel.weights[2:] == 0)
    assert set(sel.ids[:2].flatten().tolist()) - {E} <= set(dropped.ids[:2].flatten().tolist())


def test_parse_fill_takes_substitute():
    assert parse_fill("substitute") == SUBSTITUTE
    with pytest.raises(ValueError, match="available: backfill, drop, drop_renorm, substitute"):
        parse_fill("swap")


@pytest.mark.parametrize("family", FAMILIES)
def test_substitute_through_apply(family):
    """fill='substitute' runs the policy with drop, then moves the dropped slots: the first layer's recorded selection
    is substitute_dropped of the drop selection of its own inputs, every layer's final experts lie in its kept set,
    and the output differs from drop's; it needs the predictors' similarity; per-token top-k reduction, which imposes
    no kept set, ignores it."""
    model = tiny_model(family)
    ids = torch.randint(3, 64, (6, 1), generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="needs the experts' output similarity"):
        base_moe.apply(model, predictors=StandInPredictors(model), policy="router_sum", budget=2, fill="substitute")
    predictors = StandInPredictors(model, with_similarity=True)
    base_moe.apply(model, predictors=predictors, policy="router_sum", budget=2, fill="drop", record=True)
    with torch.no_grad():
        dropped_logits = model(ids).logits
    first = moe_layouts(model)[0]
    inputs = []
    hook = first.block.register_forward_pre_hook(lambda module, args: inputs.append(args[0].reshape(6, -1)))
    base_moe.configure(model, fill="substitute")
    with torch.no_grad():
        logits = model(ids).logits
    hook.remove()
    assert torch.isfinite(logits).all() and not torch.equal(logits, dropped_logits)
    x = inputs[0]
    step = DecodeStep(hidden=x, logits=first.router_logits(x), predicted_log_norms=None, routing=first.routing,
                      correction_bias=first.correction_bias(), num_groups=1, budget=2, fill=Fill.DROP, layout=first)
    expected = substitute_dropped(step, get_policy("router_sum").select(step), predictors.similarity[first.layer_index])
    sel, _ = selections(model)[first.layer_index]
    assert torch.equal(sel.ids, expected.ids)
    torch.testing.assert_close(sel.weights, expected.weights)
    routed_total = reference.route(step.logits, first.routing, step.correction_bias)[1].sum(-1)
    torch.testing.assert_close(sel.weights.sum(-1), routed_total)  # no weight is lost
    for layout in moe_layouts(model):
        sel, _ = selections(model)[layout.layer_index]
        E = layout.num_experts
        kept = set(sel.kept.flatten().tolist()) - {E}
        assert set(sel.ids.flatten().tolist()) - {E} <= kept and len(kept) <= 2
    base_moe.configure(model, policy="topk_reduce", budget=None, fill="drop")
    with torch.no_grad():
        reduced = model(ids).logits
    base_moe.configure(model, fill="substitute")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reduced)


# ---------------------------------------------------------------------------------------------
# Edge cases found by mutation testing
# ---------------------------------------------------------------------------------------------
def test_topk_reduce_default_keeps_the_top_expert_of_top1_routing():
    """Half of top-1 rounds down to 0: the default keeps at least one expert (the routed one, its whole weight)."""
    logits = random_logits(8, 12, seed=13)
    for renormalize in (False, True):
        routing = Routing(1, Scoring.SOFTMAX, renormalize)
        sel = TopKReducePolicy().select(make_step(logits, routing, 2))
        ids, w = reference.route(logits, routing)
        assert torch.equal(sel.ids, ids)
        torch.testing.assert_close(sel.weights, w)
        assert torch.equal(sel.counts, reference.expert_counts(ids, 2, 12))


def test_register_policy_refuses_a_taken_name():
    before = get_policy("router_sq")
    with pytest.raises(ValueError, match="'router_sq' is already registered"):
        register_policy(CostPolicy("router_sq", before.cost, description="another"))
    assert get_policy("router_sq") is before


def test_lynx_scores_a_token_without_weight_in_the_last_bin():
    """Sigmoid scores of logits below about -88.72 are exactly 0: a token whose routed weights are all 0 (0 / 0 for
    its ratios) scores each of its slots in the last bin, never NaN."""
    T, E, k = 6, 16, 3
    logits = random_logits(T, E, seed=17)
    logits[1] = -100.0 - torch.arange(E, dtype=torch.float32)  # every sigmoid 0
    routing = Routing(k, Scoring.SIGMOID, renormalize=False)
    ids, w = reference.route(logits, routing, None)
    assert (w[1] == 0).all() and (w[0] > 0).all()
    for bins, decay in ((4, 0.5), (2, 0.25)):
        D = LynxPolicy(bins=bins, decay=decay).batch_scores(make_step(logits, routing, 2))
        expected = torch.zeros(2, E, dtype=torch.float64)
        for t in range(T):
            top = float(w[t].max())
            for u, x in zip(ids[t].tolist(), w[t].double().tolist()):
                b = bins - 1 if x == 0 else min(bins - 1, math.floor(math.log(top / x) / math.log(2.0)))
                expected[t // 3, u] += decay ** b
        torch.testing.assert_close(D.double(), expected)


def test_lynx_without_decay_counts_routed_tokens():
    """decay = 1 (the largest the policy takes): every bin scores 1, so an expert's score is the number of its group's
    tokens routed to it, the frequency cost."""
    groups, T, E, k = 2, 12, 16, 4
    logits = random_logits(T, E, seed=19)
    routing = Routing(k, Scoring.SOFTMAX, renormalize=True)
    D = LynxPolicy(decay=1.0).batch_scores(make_step(logits, routing, groups))
    ids, w = reference.route(logits, routing)
    expected = reference.batch_cost(ids, torch.ones_like(w), groups, E, Cost.FREQUENCY, routing)
    assert torch.equal(D, expected)


# ---------------------------------------------------------------------------------------------
# Voting tokens (apply's finished_tokens): the others take no part in choosing the kept set
# ---------------------------------------------------------------------------------------------
VOTING_POLICIES = {
    **{f"cost_{cost.name.lower()}": CostPolicy(f"cost_{cost.name.lower()}", cost,
                                               "predicted" if cost == Cost.BASE else "none") for cost in Cost},
    "static_energy": get_policy("static_energy"),
    "oea:k0=2": OEAPolicy(2),
    "lynx": LynxPolicy(),
    "lynx:threshold=1.5": LynxPolicy(threshold=1.5),
    "topk_reduce": TopKReducePolicy(),
}


def voting_step(scoring, fill, budget, seed, device, T=18, groups=2):
    """A random step of ``groups`` groups with a random voting mask (every group keeps at least one voting token)."""
    routing, bias = SCORINGS[scoring]
    g = torch.Generator().manual_seed(seed)
    E = 16
    logits = torch.randn(T, E, generator=g) * 2
    step = make_step(logits, routing, groups, budget=budget, fill=fill)
    step.predicted_log_norms = torch.randn(T, E, generator=g)
    step.mean_log_norm = torch.randn(E, generator=g)
    step.correction_bias = bias
    voting = torch.rand(T, generator=g) < 0.5
    voting[:: T // groups] = True
    step.voting = voting
    for name in ("logits", "predicted_log_norms", "mean_log_norm", "correction_bias", "voting", "hidden"):
        value = getattr(step, name)
        setattr(step, name, None if value is None else value.to(device))
    return step


def voting_tokens_alone(step, group):
    """The step of ``group``'s voting tokens alone (one group, every token voting)."""
    B = step.logits.shape[0] // step.num_groups
    rows = torch.arange(group * B, (group + 1) * B, device=step.logits.device)
    rows = rows[step.voting[rows]]
    alone = make_step(step.logits[rows], step.routing, 1, budget=step.budget, fill=step.fill)
    alone.predicted_log_norms = step.predicted_log_norms[rows]
    alone.mean_log_norm, alone.correction_bias, alone.hidden = step.mean_log_norm, step.correction_bias, step.hidden
    return alone, rows


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("budget", [2, 5, 16])
@pytest.mark.parametrize("fill", list(Fill))
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("policy", VOTING_POLICIES)
def test_non_voting_tokens_do_not_change_what_the_voting_ones_get(policy, scoring, fill, budget, seed, device):
    """Per group, the selection of a step with non-voting tokens is, for its voting tokens, the selection of those
    tokens alone: the same ids and weights bit for bit, the same batch costs and the same kept set (the experts only
    non-voting tokens route to are no candidates). Every token's experts come from its group's kept set."""
    step = voting_step(scoring, fill, budget, seed, device)
    chosen = VOTING_POLICIES[policy].select(step)
    E = step.logits.shape[1]
    assert not step.voting.all() and step.voting.any()
    for group in range(step.num_groups):
        alone, rows = voting_tokens_alone(step, group)
        own = VOTING_POLICIES[policy].select(alone)
        assert torch.equal(chosen.ids[rows], own.ids) and torch.equal(chosen.weights[rows], own.weights)
        if own.batch_cost is not None:
            assert torch.equal(chosen.batch_cost[group], own.batch_cost[0])
        if own.kept is not None:
            assert torch.equal(chosen.kept[group], own.kept[0])
    if chosen.kept is not None:
        B = step.logits.shape[0] // step.num_groups
        kept = torch.zeros(step.num_groups, E + 1, dtype=torch.bool, device=device)
        kept.scatter_(1, chosen.kept.long(), True)
        kept[:, E] = True  # sentinel slots
        assert kept.repeat_interleave(B, dim=0).gather(1, chosen.ids.long()).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fill", list(Fill))
@pytest.mark.parametrize("scoring", SCORINGS)
@pytest.mark.parametrize("policy", VOTING_POLICIES)
def test_every_token_voting_is_no_mask(policy, scoring, fill, device):
    """A voting mask of all True selects what no mask does, bit for bit (the ops' voting paths against the plain ones,
    OEA's and Lynx's masks)."""
    step = voting_step(scoring, fill, 5, 7, device)
    step.voting = torch.ones_like(step.voting)
    masked = VOTING_POLICIES[policy].select(step)
    step.voting = None
    plain = VOTING_POLICIES[policy].select(step)
    for field in ("ids", "weights", "kept", "counts", "batch_cost"):
        a, b = getattr(masked, field), getattr(plain, field)
        assert (a is None and b is None) or torch.equal(a, b), field


@pytest.mark.parametrize("device", DEVICES)
def test_top1_union_offset_counts_the_voting_tokens(device):
    """TOP1_UNION's seed offset grows with the tokens it covers; counting the non-voting ones too would round away the
    gap between two seeded experts' sums (here ~3e-6) and tie them, so the lower index would win against the voting
    tokens alone."""
    routing = Routing(2, Scoring.SOFTMAX, renormalize=True)
    live = torch.tensor([[1.0, -10, 0.0, -10], [-10, 1.0 + 1.5e-5, -10, 0.0]])
    finished = torch.tensor([[-10, -10, 5.0, 4.0]]).repeat(62, 1)
    policy = get_policy("top1_union")
    alone = policy.select(make_step(live.to(device), routing, 1, budget=1))
    step = make_step(torch.cat([live, finished]).to(device), routing, 1, budget=1)
    step.voting = (torch.arange(64) < 2).to(device)
    chosen = policy.select(step)
    assert alone.kept.tolist() == [[1]] and torch.equal(chosen.kept, alone.kept)
    assert torch.equal(chosen.batch_cost, alone.batch_cost) and torch.equal(chosen.ids[:2], alone.ids)
