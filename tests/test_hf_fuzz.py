"""Property-based test of base_moe.apply on the real transformers MoE classes over their config space (CPU, fp32).

tests/test_hf.py checks every family on one fixed tiny config each, and tests/test_layouts_fuzz.py fuzzes hand-written
blocks; neither varies what the real classes read from their configs (the number of experts and of experts per
token, renormalisation, DeepSeek-V3's groups, scaling and shared experts, Qwen2-MoE's shared expert, dense layers
between MoE ones, the expert activation and implementation). Hypothesis draws such configs per family
(:func:`configs`, through tests/hf_models.tiny_model's overrides) and checks:

1. ``apply(model, budget=E, policy="router_sum")`` keeps every routed expert, so the patched model gives the unpatched
   model's logits (fp32: rtol 1e-5 and test_hf's atol 1e-5 for the same claim, scaled by the logits' magnitude where
   that exceeds 1), and HF's ``output_router_logits`` / aux loss are the model's own; on a decode call (alone or after
   a prefill through the model's own path, with its cache), or with ``group_by='position'`` on every position; with
   ``experts`` and ``norm`` drawn. A refusal fails the test: every config drawn is one the family's class supports.
2. With a budget below E the patched model runs; at every MoE layer the router logits the budgeted path used (seen by a
   hook on the router) are the model's own router's on the same input, the model's own routing is
   ``reference.route`` under the layout's rule, the recorded selection (``base_moe.hf.selections``) is
   ``reference.route_select``'s for the drawn policy and fill, every token's final experts are among its group's kept
   ones (at most ``budget``), and the block outputs what the selection says (plus the shared experts).

Tokens whose routing has a near-tie (a ranking gap below ``MARGIN`` at some layer, computed from the router's
parameters as transformers routes) are left out of comparisons that a last-bit difference could flip (as the layouts
fuzz does); for property 1 the whole sequence, since attention mixes its positions.

Explored with 250-300 examples a family and property on a wider space (E 2-64, k up to E and 16, weight scales up to
2, zero-width shared experts, scalings 1e-3 to 100, batches up to 32): no config that apply accepts and computes
wrong, none refused that the family supports. A DeepSeek-V3 config with k above the allowed groups' experts (HF then
weights experts its group mask excluded) is refused with MoELayoutError: not drawn. Weight scales of 1-2 over three
layers give fp32 rounding differences up to ~2e-5 of the logits' magnitude, base_moe's as close to an fp64 run as
HF's own fp32 path: not drawn (0.5 at most). One defect outside the config space, D1 (group_by='position' and
output_router_logits: position-major router logits, two tensors per layer with dense positions), was mended in
session 66; its reproduction is the last test below.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import transformers
from hf_models import NUM_EXPERTS, VOCAB, selection_output, tiny_model
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import base_moe
from base_moe import reference
from base_moe.hf import is_applied, moe_layouts, selections
from base_moe.layouts import find_moe_layouts
from base_moe.policies import get_policy, parse_fill

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),  # past_key_values: renamed after 5.17
    pytest.mark.filterwarnings("ignore:Initializing zero-element tensors"),  # a zero-width shared expert
]

FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "gpt_oss"]
SCALINGS = (1.0, 1.003, 0.997, 1.02, 2.5, 0.4, 16.0)
"""DeepSeek-V3 routed_scaling_factor values: 1, near 1 (inside bf16-sized tolerances, either side) and far."""
POLICIES = ("router_sum", "router_sq", "frequency", "top1_union")
"""Budgeted policies that need no predictors."""
FILLS = ("backfill", "drop", "drop_renorm")
ACTIVATIONS = ("silu", "swish", "gelu", "relu", "gelu_pytorch_tanh")
"""Expert activations (``hidden_act``): SiLU runs base_moe's fused experts op, the others the model's own experts."""
IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
"""transformers' experts implementations that run on the CPU."""
MARGIN = 1e-4
"""Ranking gaps below this (in the space the family ranks in) may flip under a last-bit difference."""


@dataclass(frozen=True)
class Case:
    """One drawn model: its family, the config overrides for tests/hf_models.tiny_config, and the weights' seed."""

    family: str
    overrides: tuple[tuple[str, object], ...]
    seed: int
    experts: str = "eager"  # the model's experts_implementation (GPT-OSS's budgeted path runs the model's own)

    @property
    def config(self) -> dict:
        return dict(self.overrides)


# ---------------------------------------------------------------------------------------------------------------
# The strategy
# ---------------------------------------------------------------------------------------------------------------
@st.composite
def configs(draw, family: str) -> Case:
    """A config the family's transformers class supports: E 4-16 experts, k 1..E (DeepSeek-V3: within its allowed
    groups), 1-3 layers, small hidden and intermediate sizes (a zero-width shared expert included: HF builds it), a
    weight scale (sharper routing, larger activations), the expert activation, the experts implementation,
    output_router_logits, and the family's own knobs: renormalisation (norm_topk_prob where the router reads it),
    DeepSeek-V3's groups, routed_scaling_factor, shared experts and leading dense layers, Qwen's sparse-layer pattern
    (decoder_sparse_step, mlp_only_layers), Qwen2-MoE's gated shared expert and sliding-window layers, GPT-OSS's
    SwiGLU clamp and sliding window."""
    layers = draw(st.integers(1, 3))
    o: dict = dict(num_hidden_layers=layers, hidden_size=draw(st.sampled_from([16, 24, 32])),
                   initializer_range=draw(st.sampled_from([0.02, 0.1, 0.5])), output_router_logits=draw(st.booleans()))
    if family != "gpt_oss":  # GPT-OSS's experts have their own clamped SwiGLU
        o.update(hidden_act=draw(st.sampled_from(ACTIVATIONS)))
    experts = draw(st.sampled_from(IMPLEMENTATIONS))
    # torch's grouped_mm needs 16-byte strides: expert sizes of multiples of 4 fp32 (the hidden sizes are)
    moe_size = draw(st.integers(1, 6).map(lambda n: 4 * n) if experts == "grouped_mm" else st.integers(2, 24))
    if family == "deepseek_v3":
        E = draw(st.sampled_from([4, 6, 8, 9, 10, 12, 16]))
        groups = [g for g in range(1, E // 2 + 1) if E % g == 0]  # HF sums each group's top 2: 2 experts a group
        n_group = draw(st.sampled_from(groups))
        topk_group = draw(st.integers(1, n_group))
        k = draw(st.integers(1, min(E, topk_group * (E // n_group))))  # more: HF would weight masked experts (refused)
        o.update(n_routed_experts=E, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
                 routed_scaling_factor=draw(st.sampled_from(SCALINGS)), norm_topk_prob=draw(st.booleans()),
                 n_shared_experts=draw(st.integers(0, 2)), moe_intermediate_size=moe_size,
                 intermediate_size=draw(st.integers(4, 48)), first_k_dense_replace=draw(st.integers(0, layers - 1)))
        return Case(family, tuple(sorted(o.items())), draw(st.integers(0, 2**16)), experts)
    E = draw(st.integers(4, 16))
    k = draw(st.integers(1, E))
    o.update(num_experts_per_tok=k)
    if family in ("qwen3_moe", "qwen2_moe"):
        step = draw(st.integers(1, layers))  # a layer is MoE when (i + 1) % step == 0 and i not in mlp_only_layers
        sparse = [i for i in range(layers) if (i + 1) % step == 0]
        dense = draw(st.lists(st.sampled_from(sparse), unique=True, max_size=len(sparse) - 1))
        o.update(num_experts=E, norm_topk_prob=draw(st.booleans()), moe_intermediate_size=moe_size,
                 intermediate_size=draw(st.integers(4, 48)), decoder_sparse_step=step, mlp_only_layers=sorted(dense))
        if family == "qwen2_moe":
            kinds = draw(st.lists(st.sampled_from(["full_attention", "sliding_attention"]), min_size=layers,
                                  max_size=layers))
            o.update(shared_expert_intermediate_size=draw(st.integers(0, 48)), layer_types=kinds,
                     use_sliding_window="sliding_attention" in kinds, sliding_window=draw(st.integers(1, 4)))
    elif family == "olmoe":
        o.update(num_experts=E, norm_topk_prob=draw(st.booleans()), intermediate_size=moe_size)
    elif family == "mixtral":
        o.update(num_local_experts=E, intermediate_size=moe_size)
    elif family == "gpt_oss":
        o.update(num_local_experts=E, intermediate_size=moe_size,
                 swiglu_limit=draw(st.sampled_from([7.0, 0.5])), sliding_window=draw(st.integers(1, 4)),
                 layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    return Case(family, tuple(sorted(o.items())), draw(st.integers(0, 2**16)), experts)


def num_experts(case: Case) -> int:
    o = case.config
    return o.get("n_routed_experts") or o.get("num_experts") or o["num_local_experts"]


def build(case: Case) -> torch.nn.Module:
    model = tiny_model(case.family, seed=case.seed, **case.config)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(case.experts)
    else:  # older 5.x (as tests/test_hf.py)
        model.config._experts_implementation = case.experts
    return model


def token_ids(batch: int, length: int, seed: int) -> torch.Tensor:
    """``[batch, length]`` random token ids."""
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------
def margin(case: Case, router: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``[T]``: the smallest ranking gap of the family's routing of ``x`` (k-th against (k+1)-th choice score, and
    DeepSeek-V3's last chosen group against the next), computed from the router's parameters as transformers does,
    independently of base_moe's description of it."""
    o = case.config
    k = o["num_experts_per_tok"]
    logits = F.linear(x.float(), router.weight.float(), None if getattr(router, "bias", None) is None
                      else router.bias.float())
    choice = logits  # softmax is monotone: every softmax family ranks by its logits
    gap = torch.full((x.shape[0],), float("inf"))
    if case.family == "deepseek_v3":
        choice = torch.sigmoid(logits) + router.e_score_correction_bias.float()
        n_group, topk_group = o["n_group"], o["topk_group"]
        grouped = choice.view(x.shape[0], n_group, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1).sort(dim=-1, descending=True).values
        if topk_group < n_group:
            gap = group_scores[:, topk_group - 1] - group_scores[:, topk_group]
        top = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
        allowed = torch.zeros(x.shape[0], n_group, dtype=torch.bool).scatter_(1, top, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
    if k >= choice.shape[1]:  # every expert routed: no k-th decision
        return gap
    ranked = choice.sort(dim=-1, descending=True).values
    kth = ranked[:, k - 1] - ranked[:, k]
    return torch.minimum(gap, torch.where(torch.isinf(ranked[:, k]), float("inf"), kth))


class Recorder:
    """Forward hooks on every MoE block and router: each call's input and output (hooks on these modules leave the
    patched path as it is; only hooks on the norm would send it back to the model's own norm)."""

    def __init__(self, model):
        self.calls: dict[str, list] = {}
        self.handles = []
        for layout in find_moe_layouts(model) if not is_applied(model) else moe_layouts(model):
            for name, module in ((layout.name, layout.block), (layout.name + ":router", layout.router)):
                self.handles.append(module.register_forward_hook(self._hook(name)))

    def _hook(self, name):
        def hook(module, args, output):
            self.calls.setdefault(name, []).append((args[0].detach().clone(), output))
        return hook

    def remove(self):
        for handle in self.handles:
            handle.remove()


def tolerance(want: torch.Tensor) -> float:
    """fp32's absolute tolerance for ``want``: 1e-5 (test_hf's, for its logits of order 0.1), times the largest
    magnitude where that exceeds 1 (a weight scale of 0.5 gives logits of order 10-100, and rounding differences in
    a sum are relative to its largest terms, not to each element)."""
    return 1e-5 * max(1.0, float(want.abs().max()))


def run(model, ids: torch.Tensor, prefill: bool):
    """``ids [B, L]``: with ``prefill``, the first L - 1 tokens as a prefill call (the model's own path) and the last
    as a decode call with the cache it left (the decode call's output); else one call on ``ids``."""
    with torch.no_grad():
        if not prefill or ids.shape[1] == 1:
            return model(ids)
        cache = model(ids[:, :-1], use_cache=True).past_key_values
        return model(ids[:, -1:], past_key_values=cache)


def clear_sequences(case: Case, model, ids: torch.Tensor, prefill: bool) -> torch.Tensor:
    """``[B]``: the sequences whose tokens of the compared call (the decode call, or every position) have no
    near-tie in their routing at any MoE layer of the unpatched ``model`` (attention mixes a sequence's positions)."""
    recorder = Recorder(model)
    run(model, ids, prefill)
    recorder.remove()
    clear = torch.ones(ids.shape[0], dtype=torch.bool)
    for layout in find_moe_layouts(model):
        x = recorder.calls[layout.name + ":router"][-1][0]  # the compared call's (token order)
        gaps = margin(case, layout.router, x.reshape(-1, layout.hidden_size))
        clear &= (gaps >= MARGIN).view(ids.shape[0], -1).all(dim=1)
    return clear


# ---------------------------------------------------------------------------------------------------------------
# Property 1: a budget that keeps every expert changes nothing
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def full_budget_reproduces(case: Case, ids: torch.Tensor, prefill: bool, options: dict) -> str:
    """Patched with budget=E (and ``options``), the compared call's logits against the unpatched model's: with
    ``prefill`` a decode call after a prefill through the model's own path, else one call (a decode call, or with
    group_by='position' every position after the dense ones budgeted). Returns an event for hypothesis' statistics."""
    model = build(case)
    clear = clear_sequences(case, model, ids, prefill)
    want = run(model, ids, prefill)
    base_moe.apply(model, budget=num_experts(case), policy="router_sum", record=True, **options)
    got = run(model, ids, prefill)
    recorded = selections(model)  # every MoE layer ran the budgeted path (a position at least is budgeted)
    assert sorted(recorded) == sorted(lay.layer_index for lay in moe_layouts(model)), "the budget did not run"
    where = f"\n{case}\n{options}\n{[lay.routing for lay in moe_layouts(model)]}"
    torch.testing.assert_close(got.logits[clear], want.logits[clear], rtol=1e-5, atol=tolerance(want.logits),
                               msg=lambda m: m + where)
    # HF's hooks see the budgeted path's logits, in token order (where the family returns them: not DeepSeek-V3 in
    # transformers 5.17)
    if case.config.get("output_router_logits") and getattr(want, "router_logits", None) is not None:
        assert len(got.router_logits) == len(want.router_logits), f"router logits of other calls{where}"
        for mine, own in zip(got.router_logits, want.router_logits):
            rows = clear.repeat_interleave(own.shape[0] // ids.shape[0])  # token order: sequence after sequence
            torch.testing.assert_close(mine[rows].float(), own[rows].float(), rtol=1e-5, atol=tolerance(own),
                                       msg=lambda m: m + where)
        if getattr(want, "aux_loss", None) is not None and bool(clear.all()):
            torch.testing.assert_close(got.aux_loss, want.aux_loss, rtol=1e-5, atol=1e-6, msg=lambda m: m + where)
    return f"{int((~clear).sum())} of {ids.shape[0]} sequences near a tie"


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), batch=st.integers(1, 8), length=st.integers(1, 5), token_seed=st.integers(0, 2**16),
       positions=st.booleans(), experts=st.sampled_from(["auto", "hf"]), norm=st.sampled_from(["auto", "model"]))
def test_full_budget_gives_the_models_logits(family, data, batch, length, token_seed, positions, experts, norm):
    """Every routed expert kept: the whole budgeted path (router GEMV, route_select, experts, base_moe's norms) runs
    and must give the model's own logits, whatever the config: on a decode call after a prefill, or with
    group_by='position' on every position of a sequence."""
    case = data.draw(configs(family), label="case")
    options = dict(experts=experts, norm=norm)
    if positions:
        options.update(group_by="position", dense_positions=data.draw(st.integers(0, length - 1), label="dense"))
    event(full_budget_reproduces(case, token_ids(batch, length, token_seed), not positions, options))


# ---------------------------------------------------------------------------------------------------------------
# Property 2: a binding budget runs, routes as the model, keeps what it uses
# ---------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def budget_selects_as_the_reference(case: Case, ids: torch.Tensor, budget: int, policy: str, fill: str,
                                    dense_positions: int | None) -> str:
    """``ids [B, S]``: with ``dense_positions`` None one decode call (S = 1, group_by='batch'), else
    group_by='position' (each position after the first ``dense_positions`` is a decode batch of B tokens)."""
    model = build(case)
    options = {} if dense_positions is None else dict(group_by="position", dense_positions=dense_positions)
    base_moe.apply(model, budget=budget, policy=policy, fill=fill, record=True, **options)
    recorder = Recorder(model)
    with torch.no_grad():
        out = model(ids).logits
    recorder.remove()
    assert bool(torch.isfinite(out).all())
    recorded = selections(model)
    cost = get_policy(policy).cost
    B, S = ids.shape
    P = dense_positions or 0
    G = S - P  # decode batches per layer, position after position
    binds = False  # some layer dropped a routed expert (the budget bound)
    for layout in moe_layouts(model):
        H, E = layout.hidden_size, layout.num_experts
        where = f"\n{case}\nlayer {layout.layer_index}: {layout.routing}, budget={budget}, {policy}, {fill}, {options}"
        (x, routed), = recorder.calls[layout.name + ":router"]  # one call: every token, in token order
        (_, block_out), = recorder.calls[layout.name]
        x = x.reshape(-1, H)
        logits = routed[0]
        own_logits, own_weights, own_ids = layout.router_class.forward(layout.router, x)
        torch.testing.assert_close(logits, own_logits.float(), rtol=1e-5, atol=1e-6, msg=lambda m: m + where)
        # the decode batches: the positions after the dense ones, position after position
        x, logits, own_weights, own_ids = (t.reshape(B, S, -1)[:, P:].transpose(0, 1).reshape(G * B, -1)
                                           for t in (x, logits, own_weights, own_ids))
        clear = margin(case, layout.router, x) >= MARGIN
        bias = layout.correction_bias()
        ref_ids, ref_weights = reference.route(logits, layout.routing, bias)
        own_ids, order = own_ids.sort(dim=-1)
        own_weights = own_weights.float().gather(1, order)
        ref_ids, order = ref_ids.long().sort(dim=-1)
        ref_weights = ref_weights.gather(1, order)
        assert torch.equal(own_ids[clear], ref_ids[clear]), f"the model routes otherwise than its layout{where}"
        torch.testing.assert_close(own_weights[clear], ref_weights[clear], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: m + where)
        sel, groups = recorded[layout.layer_index]
        assert groups == G
        final = sel.ids.long()
        for g in range(G):
            kept = sel.kept[g]
            assert int((kept < E).sum()) <= budget, f"more than the budget kept{where}"
            rows = final[g * B:(g + 1) * B]
            in_kept = (rows == E) | torch.isin(rows, kept[kept < E].long())
            assert bool(in_kept.all()), f"a token uses an expert that was not kept{where}"
            binds |= not bool(torch.isin(own_ids[g * B:(g + 1) * B], kept).all())
        want = reference.route_select(logits, None, bias, G, layout.routing, cost, budget, parse_fill(fill))
        assert torch.equal(sel.ids, want[0]) and torch.equal(sel.kept, want[2]), f"not the reference's selection{where}"
        torch.testing.assert_close(sel.weights, want[1], msg=lambda m: m + where)
        expected = selection_output(layout, x, final, sel.weights)
        block_out = block_out[0] if isinstance(block_out, tuple) else block_out
        got = block_out[:, P:].transpose(0, 1).reshape(-1, H)  # position-major, as the groups
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=tolerance(expected), msg=lambda m: m + where)
    return "the budget binds" if binds else "the budget keeps every routed expert"


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=50, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), batch=st.integers(1, 8), token_seed=st.integers(0, 2**16),
       policy=st.sampled_from(POLICIES), fill=st.sampled_from(FILLS), positions=st.booleans())
def test_binding_budget_routes_as_the_model(family, data, batch, token_seed, policy, fill, positions):
    """A budget below E: the selection is made from the model's own router logits under the model's own rule, and
    the block uses only kept experts; a decode call, or group_by='position' over a short sequence."""
    case = data.draw(configs(family), label="case")
    budget = data.draw(st.integers(1, num_experts(case) - 1), label="budget")
    length = data.draw(st.integers(1, 4), label="length") if positions else 1
    dense = data.draw(st.integers(0, length - 1), label="dense_positions") if positions else None
    event(budget_selects_as_the_reference(case, token_ids(batch, length, token_seed), budget, policy, fill, dense))


# ---------------------------------------------------------------------------------------------------------------
# Defect D1 (found by the property-1 fuzz with output_router_logits and group_by='position'; mended in session 66: the
# router module gets one call per block call, on every token in token order)
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dense_positions", [0, 1, 2])
def test_position_groups_keep_hf_router_logits(family, dense_positions):
    """A drop-in keeps HF's ``output_router_logits`` contract (one ``[B * S, E]`` tensor per MoE layer, in token order,
    base_moe.hf's docstring); budget=E changes no logit, so router logits and aux loss must be the model's own."""
    ids = token_ids(2, 3, 0)
    mask = torch.tensor([[0, 0, 1], [1, 1, 1]])  # left padding
    model = tiny_model(family, output_router_logits=True)
    with torch.no_grad():
        own = model(ids, attention_mask=mask)
    if getattr(own, "router_logits", None) is None:
        pytest.skip(f"{family} returns no router logits in transformers {transformers.__version__}")
    base_moe.apply(model, budget=NUM_EXPERTS, policy="router_sum", group_by="position",
                   dense_positions=dense_positions)
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    assert len(out.router_logits) == len(own.router_logits)
    for mine, theirs in zip(out.router_logits, own.router_logits):
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.aux_loss, own.aux_loss, rtol=1e-5, atol=1e-6)
