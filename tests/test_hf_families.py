"""The Hugging Face MoE families beyond tests/hf_models.FAMILIES (tests/hf_more_families.py): each supported one,
patched with a budget that does not bind, gives its own model's logits (prompt and a cached decode step) and router
logits, and under a budget of 2 runs with at most 2 active experts per layer and blocks that return their selection's
output (fp32, CPU); in bf16 its budgeted blocks pass test_hf's check (CPU and GPU); each refused one raises a
MoELayoutError that says why."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers
from packaging.version import Version
from hf_models import KERNEL_SIZES, StandInPredictors, selection_output
from hf_more_families import E, FP32_ONLY, REFUSED, SINCE_TRANSFORMERS, SUPPORTED, build, has_model_type
from test_hf import check_budgeted_blocks, decode_ids, prompt_ids

import base_moe
from base_moe import hf
from base_moe.layouts import MoELayoutError, find_moe_layouts


def _supported_model(name: str, **overrides):
    model_type, keys = SUPPORTED[name]
    if not has_model_type(model_type):
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    if Version(transformers.__version__) < Version(SINCE_TRANSFORMERS.get(name, "5.0")):
        pytest.skip(f"{name}'s tiny model needs transformers >= {SINCE_TRANSFORMERS[name]} (hf_more_families)")
    return build(model_type, {**keys, **overrides})


def _decode(model, prompt, step, **kwargs):
    """The prompt's logits and one cached decode step's output."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        return out.logits, model(step, past_key_values=out.past_key_values, use_cache=True, **kwargs)


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_family_without_a_binding_budget_gives_the_models_logits(name):
    model = _supported_model(name)
    prompt, step = prompt_ids(batch=4, length=8, seed=2), decode_ids(batch=4, seed=2)
    want_prompt, want = _decode(copy.deepcopy(model), prompt, step, output_router_logits=True)
    patched = base_moe.apply(copy.deepcopy(model), budget=E, policy="router_sum")
    got_prompt, got = _decode(patched, prompt, step, output_router_logits=True)
    scale = max(float(want.logits.abs().max()), 1.0)
    assert float((got_prompt - want_prompt).abs().max()) <= 1e-5 * scale
    assert float((got.logits - want.logits).abs().max()) <= 1e-5 * scale
    mine, theirs = getattr(got, "router_logits", None), getattr(want, "router_logits", None)
    assert (mine is None) == (theirs is None) and len(mine or ()) == len(theirs or ())
    for a, b in zip(mine or (), theirs or ()):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5)
    # and the MoE blocks matter to those logits: one expert per layer changes the step (the check above can fail)
    one = base_moe.apply(copy.deepcopy(model), budget=1, policy="router_sum")
    assert float((_decode(one, prompt, step)[1].logits - want.logits).abs().max()) > 1e-4 * scale


@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_family_under_a_budget_of_two(name):
    model = _supported_model(name)
    patched = base_moe.apply(model, budget=2, policy="router_sum", record=True)
    _decode(patched, prompt_ids(batch=8, length=8, seed=3), decode_ids(batch=8, seed=3))
    layouts = hf.moe_layouts(patched)
    assert sorted(hf.selections(patched)) == sorted(layout.layer_index for layout in layouts)
    generator = torch.Generator().manual_seed(4)
    for layout in layouts:
        x = torch.randn(6, 1, layout.hidden_size, generator=generator)
        with torch.no_grad():
            y = layout.block(x)
        y = (y[0] if isinstance(y, tuple) else y).view(-1, layout.hidden_size)
        selection, _ = hf.selections(patched)[layout.layer_index]
        assert int((selection.counts > 0).sum()) <= 2
        want = selection_output(layout, x.view(-1, layout.hidden_size), selection.ids.long(), selection.weights)
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_family_refused_with_a_reason(name):
    model_type, keys, reason, bias_scale = REFUSED[name]
    if not has_model_type(model_type):
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    model = build(model_type, keys, bias_scale)
    with pytest.raises(MoELayoutError, match=reason):
        find_moe_layouts(model)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_family_refused_on_the_meta_device_too(name):
    """On the meta device the same reason refuses the family: PhiMoE's sparsemixer routing is no rule of base_moe's
    for a CPU stand-in of its router either (it was taken as the attributes' softmax), and Cohere2-MoE's average of
    its routed and shared experts is seen on a CPU stand-in of the block (it was taken as their sum)."""
    model_type, keys, reason, bias_scale = REFUSED[name]
    if not has_model_type(model_type):
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")
    model = build(model_type, keys, bias_scale).to("meta")
    with pytest.raises(MoELayoutError, match=reason):
        find_moe_layouts(model)


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("name", sorted(FP32_ONLY))
def test_family_supported_in_fp32_only_is_refused_in_bf16(name, device):
    """Also on the meta device, whose router stand-in runs in the model's dtype (an fp32 one ranked as base_moe does,
    and LFM2 in bf16 was accepted)."""
    model = _supported_model(name).to(torch.bfloat16).to(device)
    with pytest.raises(MoELayoutError, match="match none of base_moe's routing rules"):
        find_moe_layouts(model)


@pytest.mark.parametrize("name", sorted(set(SUPPORTED) - FP32_ONLY))
def test_family_rounding_of_router_logits_is_read_right(name):
    """MoELayout.router_rounds_logits (asked of a bf16 stand-in of the fp32 model's router) says whether the router of
    the model converted to bf16 returns bf16 values (in bf16, or widened after: Granite-MoE): the selection ops round
    their logits by it."""
    model = _supported_model(name)
    flags = [layout.router_rounds_logits for layout in find_moe_layouts(model)]
    x = torch.randn(5, model.config.hidden_size).to(torch.bfloat16)
    logits = [layout.router_choices(x)[0].float() for layout in find_moe_layouts(model.to(torch.bfloat16))]
    assert flags == [bool((lg == lg.to(torch.bfloat16).float()).all()) for lg in logits]


@pytest.mark.parametrize("name, converts", [("lfm2_moe", False), ("glm4_moe", True), ("qwen3_next", True),
                                            ("afmoe_scaled", True)])  # (AFMoE: sigmoid + bias on logits widened first)
def test_family_converted_after_apply(name, converts):
    """A model converted to bf16 after apply runs budgeted, unless its routing depends on the model's dtype (LFM2's
    bias on sigmoid scores in that dtype): that one must be applied after the conversion, and says so."""
    model = base_moe.apply(_supported_model(name), budget=2, policy="router_sum").to(torch.bfloat16)
    prompt, step = prompt_ids(batch=4, length=8, seed=6), decode_ids(batch=4, seed=6)
    if converts:
        assert torch.isfinite(_decode(model, prompt, step)[1].logits).all()
    else:
        with pytest.raises(MoELayoutError, match="detected in torch.float32 and now runs in torch.bfloat16"):
            _decode(model, prompt, step)


def test_nested_router_with_hooks_is_refused():
    """HunYuan-V1-MoE's router weight is read from gate.wg without calling it: hooks there (accelerate's offload,
    which materialises the weight) would not run, so apply refuses them."""
    model = _supported_model("hunyuan_v1_moe")
    for layout in find_moe_layouts(model):
        layout.router_linear.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(ValueError, match=r"'gate\.wg', which has forward hooks"):
        base_moe.apply(model, budget=2, policy="router_sum")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(SUPPORTED))
def test_meta_device_family_takes_the_probed_routing(name, dtype):
    """On the meta device (no probe of the weights can run) the routing is the one the probe finds on the CPU, for
    the families whose attributes do not tell it too (a stand-in of the router in the model's dtype is probed):
    Cohere2-MoE's ``expert_selection_fn="sigmoid"``, Jamba's renormalisation-free softmax beside an unread
    ``norm_topk_prob``. The block's output check runs on a CPU stand-in of the block there, with no warning that it
    could not."""
    if dtype == torch.bfloat16 and name in FP32_ONLY:
        pytest.skip("refused in bf16 (test_family_supported_in_fp32_only_is_refused_in_bf16)")
    model = _supported_model(name).to(dtype)
    probed = [(layout.routing, layout.returns_router_scores) for layout in find_moe_layouts(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        on_meta = find_moe_layouts(model.to("meta"))
    assert [(layout.routing, layout.returns_router_scores) for layout in on_meta] == probed


@pytest.mark.parametrize("overrides, groups", [
    ({}, (4, 1)),  # group_limited_greedy, one group for top-2: the limit binds
    ({"topk_group": 2}, (1, 1)),  # two groups for top-2: a limit by the groups' best scores cannot bind
    ({"topk_method": "greedy"}, (1, 1)),  # groups declared, not applied
])
def test_deepseek_v2_group_limit_taken_where_it_routes(overrides, groups):
    """DeepSeek-V2's routing is detected with its group limit only where the limit changes the routing: otherwise
    backfill would prefer the token's groups, which the model's own order does not."""
    model = base_moe.apply(_supported_model("deepseek_v2_group_limited", **overrides), budget=E, policy="router_sum")
    for layout in hf.moe_layouts(model):
        assert (layout.routing.n_group, layout.routing.topk_group) == groups
        assert layout.routing.scaling == 16.0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", sorted(set(SUPPORTED) - FP32_ONLY))
def test_family_bf16_budgeted_blocks(name, device):
    """bf16 at sizes the CUDA expert kernel takes (on the GPU every fused block runs base_moe's kernels): every block,
    budgeted, is as close to the fp32 sum over its selection as test_hf's families are (check_budgeted_blocks), and a
    budgeted decode step gives finite logits."""
    model = _supported_model(name, **KERNEL_SIZES).to(device, torch.bfloat16)
    base_moe.apply(model, predictors=StandInPredictors(model), budget=3, policy="base", record=True)
    check_budgeted_blocks(model, batch=32, budget=3)
    prompt, step = prompt_ids(batch=16, length=8, seed=5), decode_ids(batch=16, seed=5)
    assert torch.isfinite(_decode(model, prompt.to(device), step.to(device))[1].logits).all()
