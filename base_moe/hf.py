"""Drop-in budgeted MoE decoding for Hugging Face models: ``apply``, ``configure``, ``restore``.

``apply(model, ...)`` finds every MoE block (:func:`base_moe.layouts.find_moe_layouts`) and re-classes it in
place: the block becomes an instance of a subclass of its own class, and so does its router. Every submodule,
parameter, buffer and hook stays where it was, so ``state_dict`` keys and shapes, ``save_pretrained`` /
``from_pretrained`` and ``output_router_logits`` (hooks matched with ``isinstance`` on the router class) keep
working; ``restore`` puts the original classes back.

What a patched block does with a call:

* the budget is off (``policy="dense"``, or ``budget=None`` with a policy that needs a budget: every one but
  ``oea``, ``topk_reduce`` and ``lynx:threshold=...``, which prune per token without one), or the call has more
  than one token per sequence (prefill): the model's own forward, unchanged;
* a decode call (``[B, 1, H]``): the B tokens are one decode batch. ``base_moe.ops.router_predict`` (router +
  predictor GEMV) -> the policy (``base_moe.ops.route_select`` for the cost-based policies) -> the routed experts
  over the kept set only (``base_moe.ops.experts`` for the fused HF v5 layout; the model's own experts module,
  with empty slots pointed at a kept expert with weight 0, for others such as GPT-OSS) -> plus shared experts.
  No host synchronisation: a decode step can be captured in a CUDA graph. With ``finished_tokens``, tokens whose
  input id is a pad or EOS id (finished sequences under ``generate``) add nothing to the batch's expert costs (the
  model's forward pre-hook reads the call's ``input_ids``; ``DecodeStep.voting``; :func:`voting_tokens` for loops
  that call the layers themselves).
* ``group_by="position"`` (the evaluation harness, base_moe.evaluate): every call is budgeted, each sequence
  position of ``[B, S, H]`` is one decode batch of B tokens (``num_groups = S``), except the first
  ``dense_positions`` positions, which get what the block's own forward computes in eval mode (the router's own
  choices, the model's experts and shared experts, the same bits; not a block's training-time noise such as Mixtral's
  router jitter). The router module sees one call on all B * S tokens in token order, so HF's
  ``output_router_logits`` records one ``[B * S, E]`` tensor per block call, as for the model (fp32: the budgeted
  positions' logits are base_moe's router GEMV). Such a call is inference only, its dense positions included.

The decoder layer's norm just before a patched block (``post_attention_layernorm``) is re-classed too where it is
Hugging Face's Llama-style RMSNorm (Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, DeepSeek-V3; not GPT-OSS's): while the
budget is on it runs ``base_moe.ops.rms_norm``, torch's computation bit for bit on the CPU, and on CUDA a kernel that
lets the block's selection kernel start copying its weights while the norm runs (a build without CUDA kernels keeps
the model's norm on a GPU). Where the decoder layer itself is
one of those families' (by class name), it is re-classed as well, so that its residual add and that norm run as one
``base_moe.ops.add_rms_norm`` (:func:`post_attention` does the same for loops that call a layer's modules).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import warnings
from dataclasses import dataclass, replace

import torch
from torch import nn

from . import ops, reference
from .layouts import MoELayout, MoELayoutError, find_moe_layouts
from .policies import (SUBSTITUTE, DecodeStep, FillRule, Policy, Selection, available_policies, get_policy,
                       has_kernel, parse_fill, substitute_dropped)
from .routing import MAX_EXPERTS, MAX_TOP_K, Fill, exact_int

__all__ = ["apply", "configure", "restore", "is_applied", "moe_layouts", "selections", "post_attention",
           "voting_tokens"]

_UNSET = object()
_GROUP_BY = ("batch", "position")
_EXPERTS = ("auto", "base_moe", "hf")
_NORMS = ("auto", "model")
_OPTIONS = {
    "group_by": "'batch' (a decode call's tokens form one batch) or 'position' (each position is one batch)",
    "dense_positions": "with group_by='position': leading positions that run the model's own routing",
    "experts": "'auto', 'base_moe' (base_moe.ops.experts) or 'hf' (the model's own experts module)",
    "norm": "'auto' (while the budget is on, base_moe.ops.add_rms_norm for the Llama-style decoder layer's residual "
    "add and norm before each block, or ops.rms_norm for the norm alone) or 'model' (the model's own modules always)",
    "record": "keep each block's last Selection (read it with base_moe.hf.selections(model))",
    "finished_tokens": "None, 'auto' (the pad and EOS ids of the model's generation config) or token ids: a decode "
    "row whose input token is one of them (a sequence generate has finished) takes no part in choosing the experts",
}


@dataclass(frozen=True)
class Settings:
    """What every patched block of one model does; ``configure`` swaps in a new one."""

    budget: int | None = None
    policy: Policy = get_policy("dense")
    fill: FillRule = Fill.BACKFILL
    group_by: str = "batch"
    dense_positions: int = 0
    experts: str = "auto"
    norm: str = "auto"
    record: bool = False
    finished_tokens: tuple[int, ...] | None = None

    @property
    def active(self) -> bool:
        return self.policy.budgeted and (self.budget is not None or not self.policy.needs_budget)

    @property
    def substitutes(self) -> bool:
        """The ``substitute`` fill applies: the policy runs with ``drop``, then ``substitute_dropped``."""
        return self.fill == SUBSTITUTE and self.policy.takes_fill

    @property
    def op_fill(self) -> Fill:
        """The fill rule the ops and the policy run with."""
        return Fill.DROP if self.fill == SUBSTITUTE else self.fill


# ---------------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------------
def apply(model: nn.Module, predictors=None, budget: int | None = None, policy: str | Policy = "base",
          fill: str | Fill = "backfill", **options) -> nn.Module:
    """Make every MoE block of ``model`` budget-aware, in place; returns ``model``.

    ``predictors``: a ``base_moe.Predictors`` or the path of a saved one (needed by ``base`` and
    ``static_energy``). ``budget``: experts kept per layer and decode batch (None: the model's own routing, for every
    policy that needs a budget; ``oea``, ``topk_reduce`` and ``lynx:threshold=...`` prune without one).
    ``policy``: a name from ``base_moe.policies.available_policies()``. ``fill``: ``backfill``, ``drop``,
    ``drop_renorm`` or ``substitute`` (needs predictors calibrated with ``similarity=True``).

    Options (keywords; ``configure`` takes them too): ``group_by``: ``"batch"`` (default: a decode call's tokens form
    one batch) or ``"position"`` (each position of the sequences is one batch: the evaluation harness).
    ``dense_positions``: with ``group_by="position"``, how many leading positions run the model's own routing (default
    0). ``experts``: ``"auto"`` (default: base_moe's expert op where it takes the layout, dtype and device, else the
    model's), ``"base_moe"`` (the same, but refused where a block lacks the fused SiLU layout, e.g. GPT-OSS) or ``"hf"``
    (the model's own experts module). ``norm``: ``"auto"`` (default: while the budget is on, base_moe's ``add_rms_norm``
    for a Llama-style decoder layer's residual add and norm before each block, or ``rms_norm`` for the norm alone, on
    the CPU and on a GPU the build has kernels for) or
    ``"model"`` (the model's own modules always). ``record``: keep each block's last selection, read with
    ``base_moe.hf.selections(model)`` (default False). ``finished_tokens``: ``None`` (default: every token of a
    decode batch votes), ``"auto"`` (the pad and EOS token ids of ``model.generation_config``, else
    ``model.config``) or an iterable of token ids: a token whose input id is one of them adds nothing to the batch's
    expert costs and routes no expert into the candidates for the kept set (it still runs on the kept experts; a
    decode batch with no live token votes as a whole; a live sequence whose input is one of the ids, such as a pad id
    it generated itself, counts as finished at that step).
    ``generate`` feeds a sequence that has finished its EOS and then pad tokens while the others go on, so with
    ``"auto"`` finished sequences stop taking budget from the live ones; pass the ids yourself where ``generate``
    gets a ``pad_token_id`` or ``eos_token_id`` the model's config does not hold (leave out a tokenizer's None). It
    needs the model called with ``input_ids`` (not ``inputs_embeds``; a loop that calls the layers itself sets the
    mask with :func:`voting_tokens`); the selection ops take the mask as their ``voting`` flags, so a step with it
    runs the same kernels as one without.

    Inference only: a decode step that autograd records runs the model's own blocks (:class:`AutogradFallbackWarning`).
    A patched model serves one forward call at a time (the voting mask and the recorded selections are per model).
    """
    if is_applied(model):
        raise ValueError(
            "base_moe.apply was already called on this model: change its settings with base_moe.configure(model, ...) "
            "or undo it with base_moe.restore(model)"
        )
    found = find_moe_layouts(model)
    if not found:
        raise ValueError(
            f"no MoE block found in {type(model).__name__}: base_moe looks for modules with a child (usually "
            "'experts') holding fused 3-D gate_up_proj / down_proj expert weights (transformers >= 5 MoE models)"
        )
    patched = [layout.name for layout in found if hasattr(layout.block, "_base_moe")]
    if patched:
        raise ValueError(
            f"MoE block '{patched[0]}' is already patched by base_moe.apply on a module that holds it (or that this "
            "model is part of): configure or restore that module instead"
        )
    predictors = _load_predictors(predictors, model)
    options = _resolve_finished_tokens(model, options)
    settings = _settings(Settings(), found, predictors, budget=budget, policy=policy, fill=fill, **options)
    _check_dtypes(found, settings)
    for layout in found:
        if "forward" in layout.block.__dict__ or "forward" in layout.router.__dict__:
            raise ValueError(
                f"MoE block '{layout.name}' has an instance-level forward (an accelerate/kernels hook?); "
                "call base_moe.apply before dispatching the model across devices"
            )
        _check_router_linear_unhooked(layout)
    around = [_norm_and_decoder_layer(model, layout) for layout in found]
    _check_not_patched_elsewhere(found, around)
    inputs = _ModelInputs()
    try:
        for layout, (norm, decoder_layer) in zip(found, around):
            _patch_block(layout, _BlockState(layout, settings, inputs), predictors, norm, decoder_layer)
    except BaseException:
        _unpatch(found)  # all or nothing: a half-patched model would decode under the budget, unrestorable
        raise
    model._base_moe_layouts = found
    model._base_moe_hooks = (
        model.register_forward_pre_hook(_record_inputs, with_kwargs=True),
        model.register_forward_hook(_forget_inputs, always_call=True),
    )
    return model


def configure(model: nn.Module, budget=_UNSET, policy=_UNSET, fill=_UNSET, predictors=_UNSET, **options) -> nn.Module:
    """Change the budget, policy, fill rule, predictors or options of a patched model; returns ``model``.

    Only the arguments given change (``configure(model)`` alone rewrites the converted copy of a router bias from the
    parameter, for a bias written through ``.data``). No re-patching; a CUDA graph captured for one budget must be
    captured again for another (the kept set's shape depends on it), and one captured before ``finished_tokens``
    changes between None and ids (the selection kernels then take the mask as an argument)."""
    found = moe_layouts(model)
    state0 = found[0].block._base_moe
    if predictors is not _UNSET:
        predictors = _load_predictors(predictors, model)
    has_predictors = state0.predictors if predictors is _UNSET else predictors
    options = _resolve_finished_tokens(model, options)
    given = {k: v for k, v in dict(budget=budget, policy=policy, fill=fill).items() if v is not _UNSET}
    settings = _settings(state0.settings, found, has_predictors, **given, **options)
    _check_dtypes(found, settings)
    for layout in found:
        state = layout.block._base_moe
        if predictors is not _UNSET:
            state.set_predictors(predictors)
        state.settings = settings
        state.last = None
        state.refresh_router_bias()
    return model


def _norm_and_decoder_layer(model: nn.Module, layout: MoELayout) -> tuple[nn.Module | None, nn.Module | None]:
    """The norm before ``layout``'s block and the decoder layer holding it, each where base_moe computes it (else
    None)."""
    layer = model.get_submodule(layout.name.rpartition(".")[0])  # the decoder layer holding the block
    norm = _norm_before(layer)
    return norm, (_llama_style_decoder_layer(layer, layout) if norm is not None else None)


def _patch_block(layout: MoELayout, state: _BlockState, predictors, norm: nn.Module | None,
                 decoder_layer: nn.Module | None) -> None:
    """Re-class ``layout``'s block and router, and ``norm`` and ``decoder_layer`` (_norm_and_decoder_layer). A norm
    (or decoder layer) shared with a block patched before keeps that patch: every block of a model holds the same
    settings, which is all a patched norm reads."""
    state.set_predictors(predictors)
    layout.block.__class__ = _patched_class(_BaseMoEBlock, type(layout.block))
    layout.router.__class__ = _patched_class(_BaseMoERouter, layout.router_class)
    layout.block._base_moe = state
    state.norm, state.decoder_layer = norm, decoder_layer
    if state.norm is not None and not _is_patched(state.norm):
        state.norm.__class__ = _patched_class(_BaseMoENorm, type(state.norm))
        state.norm._base_moe = state
    if state.decoder_layer is not None:
        state.decoder_parameters = _named_parameters_after_hidden_states(type(state.decoder_layer))
        if not _is_patched(state.decoder_layer):
            state.decoder_layer.__class__ = _patched_class(_BaseMoEDecoderLayer, type(state.decoder_layer))
            state.decoder_layer._base_moe = state


def _is_patched(module: nn.Module) -> bool:
    return "_base_moe_original_class" in type(module).__dict__


def _check_not_patched_elsewhere(found: list[MoELayout],
                                 around: list[tuple[nn.Module | None, nn.Module | None]]) -> None:
    """Refuse, before changing anything, a router, norm or decoder layer that another model's ``apply`` patched (a
    module shared between models): restoring either model would leave the other's patched block calling it.
    ``around``: each block's _norm_and_decoder_layer."""
    for layout, (norm, decoder_layer) in zip(found, around):
        for what, module in (("router", layout.router), ("norm", norm), ("decoder layer", decoder_layer)):
            if module is not None and _is_patched(module):
                raise ValueError(
                    f"the {what} of MoE block '{layout.name}' is already patched by base_moe.apply on another model "
                    "that shares it: restore that model first, or give this one its own copy"
                )


def _unpatch(found: list[MoELayout]) -> None:
    """Every patched block, router, norm and decoder layer of ``found`` back to its own class, without its state
    (each shared module once)."""
    for layout in found:
        state = layout.block.__dict__.get("_base_moe")
        for module in (layout.block, layout.router, *((state.norm, state.decoder_layer) if state else ())):
            if module is not None and _is_patched(module):
                module.__class__ = type(module)._base_moe_original_class
                module.__dict__.pop("_base_moe", None)


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`apply`: every MoE block, router, norm and decoder layer gets its original class back; returns
    ``model``."""
    _unpatch(moe_layouts(model))
    for hook in model._base_moe_hooks:
        hook.remove()
    del model._base_moe_layouts, model._base_moe_hooks
    return model


def is_applied(model: nn.Module) -> bool:
    """Whether ``apply`` patched ``model`` (and ``restore`` has not undone it)."""
    return getattr(model, "_base_moe_layouts", None) is not None


def moe_layouts(model: nn.Module) -> list[MoELayout]:
    """The MoE layouts of a patched model."""
    if not is_applied(model):
        raise ValueError("this model is not patched: call base_moe.apply(model, ...) first")
    return model._base_moe_layouts


def selections(model: nn.Module) -> dict[int, tuple[Selection, int]]:
    """With ``record=True``: each MoE layer's last budgeted ``(Selection, num_groups)``, by layer index."""
    return {lay.layer_index: lay.block._base_moe.last for lay in moe_layouts(model) if lay.block._base_moe.last}


# ---------------------------------------------------------------------------------------------------------------
# Settings and predictors
# ---------------------------------------------------------------------------------------------------------------
class SettingNotAppliedWarning(UserWarning):
    """An option given where the other settings do not use it (it stays set for later settings that do)."""


class BudgetNotAppliedWarning(SettingNotAppliedWarning):
    """A budget given with a policy that sets its own number of experts (the budget stays set for a later policy)."""


def _settings(current: Settings, found: list[MoELayout], predictors, **changes) -> Settings:
    unknown = sorted(set(changes) - {"budget", "policy", "fill", *_OPTIONS})
    if unknown:
        described = "; ".join(f"{k}: {v}" for k, v in _OPTIONS.items())
        raise TypeError(f"unknown option(s) {', '.join(map(repr, unknown))}; options are {described}")
    if "policy" in changes:
        changes["policy"] = get_policy(changes["policy"])
    if "fill" in changes:
        changes["fill"] = parse_fill(changes["fill"])
    if changes.get("budget") is not None:
        changes["budget"] = _budget(changes["budget"])
    s = replace(current, **changes)
    if s.group_by not in _GROUP_BY:
        raise ValueError(f"group_by must be one of {_GROUP_BY}, got {s.group_by!r}")
    dense_positions = exact_int(s.dense_positions)
    if dense_positions is None or dense_positions < 0:
        raise ValueError(f"dense_positions must be an int >= 0, got {s.dense_positions!r}")
    s = replace(s, dense_positions=dense_positions)
    if s.experts not in _EXPERTS:
        raise ValueError(f"experts must be one of {_EXPERTS}, got {s.experts!r}")
    if s.norm not in _NORMS:
        raise ValueError(f"norm must be one of {_NORMS}, got {s.norm!r}")
    if s.experts == "base_moe":
        for layout in found:
            if not layout.fused:
                raise ValueError(
                    f"experts='base_moe' needs the fused SiLU expert layout; MoE block '{layout.name}' has another "
                    "(e.g. GPT-OSS): use experts='auto'"
                )
    if not isinstance(s.record, bool):
        raise ValueError(f"record must be a bool, got {s.record!r}")
    if s.active:
        for layout in found:
            if layout.routing.top_k > MAX_TOP_K or layout.num_experts > MAX_EXPERTS:
                raise ValueError(
                    f"MoE block '{layout.name}' routes each token to {layout.routing.top_k} of {layout.num_experts} "
                    f"experts; base_moe's ops take at most {MAX_TOP_K} of {MAX_EXPERTS} (policy='dense' runs it as is)"
                )
            s.policy.check_layout(layout)
    if changes.get("budget") is not None and s.policy.budgeted and not s.policy.needs_budget:
        warnings.warn(
            f"policy '{s.policy.name}' sets its own number of experts and takes no budget: budget={s.budget} is not "
            "applied (it stays set for a later policy that takes one)", BudgetNotAppliedWarning, stacklevel=3,
        )
    if changes.get("dense_positions") and s.group_by == "batch":
        warnings.warn(
            f"dense_positions={s.dense_positions} applies with group_by='position' only: with group_by='batch' only "
            "single-token decode steps run the policy (it stays set for a later group_by='position')",
            SettingNotAppliedWarning, stacklevel=3,
        )
    if s.active and s.policy.needs_predictors and predictors is None:
        raise ValueError(
            f"policy '{s.policy.name}' needs predictors: run base_moe.calibrate(...) or pass predictors=path "
            f"(policies without predictors: {', '.join(_policies_without_predictors())})"
        )
    if s.active and s.substitutes:
        _require_similarity(predictors, found)
    if s.active and s.policy.needs_statistics:
        if predictors is None or not getattr(predictors, "mean_log_norm", None):
            raise ValueError(
                f"policy '{s.policy.name}' needs the calibrated per-expert mean log-norms: pass predictors=path "
                "(from base_moe.calibrate(...), which stores them)"
            )
    return s


def _policies_without_predictors() -> list[str]:
    """The registered policies that run without calibration (no predictors, no calibration statistics)."""
    return [name for name in available_policies() if not get_policy(name).needs_calibration]


def _require_similarity(predictors, layouts: list[MoELayout]) -> None:
    """Raises ``ValueError`` unless ``predictors`` hold the expert similarity of every layer (the substitute fill)."""
    similarity = getattr(predictors, "similarity", None) or {}
    if not all(layout.layer_index in similarity for layout in layouts):
        raise ValueError(
            "fill='substitute' needs predictors calibrated with similarity=True: it needs the experts' output "
            "similarity of every MoE layer (base_moe.calibrate(..., similarity=True) or "
            "`python -m base_moe calibrate --similarity`)"
        )


def _budget(budget) -> int:
    """A positive int from anything ``operator.index`` takes (int, numpy or torch integers), never a bool."""
    value = exact_int(budget)
    if value is None or not 1 <= value < 2**63:  # the ops take an int64
        raise ValueError(
            f"budget must be an int in [1, 2^63) (experts kept per MoE layer and decode batch) or None, got {budget!r}"
        )
    return value


def _resolve_finished_tokens(model: nn.Module, options: dict) -> dict:
    """``options`` with ``finished_tokens`` as :class:`Settings` holds it: None or a tuple of token ids (ints >= 0)."""
    value = options.get("finished_tokens")
    if value is None:
        return options
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"finished_tokens must be None, 'auto' or token ids, got {value!r}")
        ids = _stop_token_ids(model)
        if not ids:
            raise ValueError(
                "finished_tokens='auto': neither the model's generation_config nor its config names a pad or EOS "
                "token id; pass the ids, e.g. finished_tokens=[tokenizer.pad_token_id, tokenizer.eos_token_id]"
            )
    else:
        given = [value] if exact_int(value) is not None else value
        try:
            ids = [exact_int(i) for i in given]
        except TypeError:
            ids = [None]
        if not ids or any(i is None or not 0 <= i < 2**63 for i in ids):  # int64: the ids' tensor
            raise ValueError(f"finished_tokens must be None, 'auto' or token ids (ints in [0, 2^63)), got {value!r}")
    return {**options, "finished_tokens": tuple(dict.fromkeys(ids))}


def _stop_token_ids(model: nn.Module) -> list[int]:
    """The pad and EOS token ids that ``generate`` feeds a finished sequence: those of ``model.generation_config``,
    or of ``model.config`` where the former names none (a negative id, such as LLaMA's pad -1, names none)."""
    for config in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        ids = []
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(config, name, None)
            ids += [exact_int(i) for i in (value if isinstance(value, (list, tuple)) else [value])]
        ids = [i for i in ids if i is not None and i >= 0]
        if ids:
            return ids
    return []


def _load_predictors(predictors, model: nn.Module):
    if predictors is None:
        return None
    if isinstance(predictors, (str, os.PathLike)):
        try:
            from .predictors import Predictors
        except ImportError as error:  # pragma: no cover - until base_moe.predictors exists
            raise ImportError("loading predictors from a path needs base_moe.predictors") from error
        predictors = Predictors.load(predictors)
    if not (hasattr(predictors, "weight") and hasattr(predictors, "bias")):
        raise TypeError(
            f"predictors must be a base_moe.Predictors or the path of a saved one, got {type(predictors).__name__}"
        )
    check = getattr(predictors, "check_compatible", None)
    if check is not None:
        check(model)
    for layout in find_moe_layouts(model) if not is_applied(model) else moe_layouts(model):
        i, shape = layout.layer_index, (layout.num_experts, layout.hidden_size)
        if i not in predictors.weight or i not in predictors.bias:
            raise ValueError(
                f"the predictors have no layer {i} (MoE block '{layout.name}'); they cover layers "
                f"{sorted(predictors.weight)}: calibrate this model with base_moe.calibrate(...)"
            )
        if tuple(predictors.weight[i].shape) != shape or tuple(predictors.bias[i].shape) != shape[:1]:
            raise ValueError(
                f"the predictors of layer {i} have weight {tuple(predictors.weight[i].shape)} and bias "
                f"{tuple(predictors.bias[i].shape)}, but MoE block '{layout.name}' has {shape[0]} experts of "
                f"hidden size {shape[1]}: they were calibrated for another model"
            )
    return predictors


# ---------------------------------------------------------------------------------------------------------------
# The patched classes
# ---------------------------------------------------------------------------------------------------------------
_PATCHED_CLASSES: dict[tuple[type, type], type] = {}


def _patched_class(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin``'s forward, under ``cls``'s own name: Hugging Face's and accelerate's lists of module
    classes by name (``_no_split_modules``, which keeps a decoder layer on one device) still match the patched
    modules (``is_applied`` says whether a model is patched)."""
    key = (mixin, cls)
    if key not in _PATCHED_CLASSES:
        _PATCHED_CLASSES[key] = type(
            cls.__name__,
            (mixin, cls),
            {
                "_base_moe_original_class": cls,
                "_base_moe_mixin": mixin,
                "__module__": __name__,
                "__qualname__": cls.__qualname__,
                "__reduce_ex__": _reduce_patched,
            },
        )
    return _PATCHED_CLASSES[key]


def _reduce_patched(self, protocol):
    """Pickles a patched module by its mixin and original class, which pickle finds by name (the generated class
    is not a module attribute), so ``torch.save(model)`` and multiprocessing work; the rest as for any object."""
    _, _, *rest = object.__reduce_ex__(self, protocol)
    return (_new_patched, (self._base_moe_mixin, self._base_moe_original_class), *rest)


def _new_patched(mixin: type, cls: type) -> nn.Module:
    patched = _patched_class(mixin, cls)
    return patched.__new__(patched)


class _ModelInputs:
    """What a patched model's forward call tells its blocks: ``voting [B, S]`` bool, the tokens whose input id is
    none of ``finished_tokens`` (None without ``finished_tokens`` or without ``input_ids``); outside a model call,
    ``outside``: the mask of an enclosing :func:`voting_tokens` (None elsewhere). Class-level defaults, so that an
    instance pickled before an attribute existed reads None."""

    voting: torch.Tensor | None = None
    outside: torch.Tensor | None = None


def _record_inputs(model: nn.Module, args, kwargs) -> None:
    """Forward pre-hook of a patched model: which tokens of the call vote (compares on the device, no sync)."""
    state = model._base_moe_layouts[0].block._base_moe
    finished = state.settings.finished_tokens
    ids = kwargs.get("input_ids", args[0] if args else None)
    voting = None
    if finished is not None and isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point():
        voting = ids != finished[0]
        for token in finished[1:]:
            voting = voting & (ids != token)
        # a decode batch (a position's tokens) without a live token, e.g. prompts of a lone BOS that is also the EOS,
        # votes as a whole: its selection is the unmasked one (a group without a voter would keep no expert at all)
        voting = voting | ~voting.any(dim=0, keepdim=True)
    state.inputs.voting = voting


def _forget_inputs(model: nn.Module, args, output) -> None:
    """Forward hook of a patched model (also after an exception): a later call of its layers alone sees no mask, or
    that of an enclosing :func:`voting_tokens`."""
    inputs = model._base_moe_layouts[0].block._base_moe.inputs
    inputs.voting = inputs.outside


@contextlib.contextmanager
def voting_tokens(model: nn.Module, voting: torch.Tensor):
    """For decode loops that call a patched model's layers themselves, where no model call reads ``input_ids`` for
    ``finished_tokens``: inside the ``with`` block only the tokens that ``voting`` (``[B, S]`` bool, over the batch's
    sequences and positions as the MoE blocks get them) marks True choose the kept experts of the budgeted blocks,
    as with ``finished_tokens`` (a decode batch with no True keeps no expert: mark such a batch all True, as
    ``finished_tokens`` does). The blocks read the tensor at each call, so a CUDA graph captured inside reads its
    memory at each replay: update it in place. A model call inside the block uses its own ``input_ids``' mask (or
    none), then this one again."""
    inputs = moe_layouts(model)[0].block._base_moe.inputs
    if not isinstance(voting, torch.Tensor) or voting.dtype != torch.bool or voting.dim() != 2:
        shown = f"{voting.dtype} tensor of shape {tuple(voting.shape)}" if isinstance(voting, torch.Tensor) else voting
        raise ValueError(f"voting must be a [batch, positions] bool tensor, got {shown!r}")
    previous = inputs.outside, inputs.voting
    inputs.outside = inputs.voting = voting
    try:
        yield
    finally:
        inputs.outside, inputs.voting = previous


class _BaseMoERouter:
    """Mixed into the model's router class. Called with ``base_moe=state`` it returns ``(logits [T, E] fp32 in the
    tokens' order, _Routed)`` (:meth:`_BlockState.route`); otherwise it is the model's own router. Either way HF's
    ``output_router_logits`` hooks see one call per block call, with every token's logits in token order at index 0."""

    def forward(self, hidden_states, *args, base_moe: _BlockState | None = None, **kwargs):
        if base_moe is None:
            return super().forward(hidden_states, *args, **kwargs)
        return base_moe.route(hidden_states, **kwargs)


# Hugging Face's Llama-style RMSNorm classes, ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)``, which
# ops.rms_norm computes. GPT-OSS's multiplies by the weight before the cast and keeps its own.
_LLAMA_STYLE_NORMS = frozenset(
    {"Qwen3MoeRMSNorm", "Qwen2MoeRMSNorm", "OlmoeRMSNorm", "MixtralRMSNorm", "DeepseekV3RMSNorm"}
)


def _norm_before(layer: nn.Module) -> nn.Module | None:
    """The decoder layer's norm just before its MoE block, if it is one ``ops.rms_norm`` computes."""
    norm = getattr(layer, "post_attention_layernorm", None)
    if type(norm).__name__ not in _LLAMA_STYLE_NORMS or "forward" in norm.__dict__:
        return None
    return norm


_OP_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_dtype(dtype: torch.dtype, what: str) -> None:
    """Refuses a dtype the ops do not take (a model moved to float64, say), before the budgeted path would fail
    inside them."""
    if dtype not in _OP_DTYPES:
        raise TypeError(f"{what} is {dtype}: base_moe's budgeted path takes float32, float16 and bfloat16 models")


def _check_router_linear_unhooked(layout: MoELayout) -> None:
    """The budgeted path reads a nested router's weight (HunYuan-V1-MoE's ``gate.wg``) without calling that submodule,
    so hooks on it (accelerate's offload, which materialises the weight) would not run: refused, before or after
    dispatch alike (the top-level router's hooks do run: it is called)."""
    linear = layout.router_linear
    hooked = "forward" in linear.__dict__ or linear._forward_pre_hooks or linear._forward_hooks
    if linear is not layout.router and hooked:
        raise ValueError(
            f"MoE block '{layout.name}': its router's weight lives in '{layout.router_name}."
            f"{layout.router_linear_name}', which has forward hooks (accelerate's offload?) that base_moe's budgeted "
            "path would not run; apply base_moe to a model that is not dispatched or offloaded"
        )


def _check_routing_dtype(layout: MoELayout, dtype: torch.dtype) -> None:
    """A block whose routing depends on the model's dtype (MoELayout.routes_in_model_dtype) runs budgeted in the dtype
    its rule was verified in only: converted after apply, base_moe's fp32 scores would rank otherwise than its
    router."""
    if dtype != layout.detected_dtype and layout.routes_in_model_dtype:
        raise MoELayoutError(
            f"MoE block '{layout.name}' was detected in {layout.detected_dtype} and now runs in {dtype}: its router "
            "adds a selection bias to sigmoid scores in the model's dtype, whose rounding decides between near "
            "experts, so its rule must be verified again: call base_moe.restore(model) and apply base_moe after the "
            "conversion."
        )


def _check_dtypes(found: list[MoELayout], settings: Settings) -> None:
    """Settings that run the budgeted path need blocks of a dtype the ops take (a dense or unbudgeted model runs only
    its own code, in any dtype)."""
    if settings.active:
        for layout in found:
            _check_dtype(layout.dtype, f"MoE block '{layout.name}'")


def _records_gradients(module: nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether autograd records a call of ``module`` (a block or a norm) on ``hidden_states``: the ops have no
    backward, so the module then runs the model's own code (the gradients of its input and weights would be wrong
    otherwise)."""
    if not torch.is_grad_enabled():
        return False
    return hidden_states.requires_grad or any(p.requires_grad for p in module.parameters())


class AutogradFallbackWarning(UserWarning):
    """A budgeted decode step ran while autograd recorded it: its MoE blocks ran the model's own code, without the
    budget (decode under ``torch.no_grad()`` or ``torch.inference_mode()``, as ``generate`` does, for the budget)."""


def _runs_base_moe_norm(state: _BlockState, hidden_states: torch.Tensor, norm: nn.Module) -> bool:
    """Whether base_moe's norm op replaces ``norm``: while the budget is on with norm='auto', on a device the build has
    the norm kernels for (a build without CUDA kernels keeps the model's norm on a GPU), except where that would drop
    something the module call gives: autograd (the ops have no backward; with add_rms_norm the whole residual stream
    would lose its history) and the norm's hooks (user hooks, accelerate's offload)."""
    s = state.settings
    if not (s.active and s.norm == "auto" and hidden_states.dtype == norm.weight.dtype in _OP_DTYPES):
        return False
    if not all(has_kernel(op, hidden_states.device) for op in ("rms_norm", "add_rms_norm")):
        return False
    if _records_gradients(norm, hidden_states):
        return False
    return not (norm._forward_hooks or norm._forward_pre_hooks or "forward" in norm.__dict__)


class _BaseMoENorm:
    """Mixed into the Llama-style RMSNorm before a patched block: ``ops.rms_norm`` while the budget is on (on CUDA
    its kernel lets the block's selection kernel start during the norm) unless ``norm='model'``, the model's own norm
    otherwise."""

    def forward(self, hidden_states):
        if not _runs_base_moe_norm(self._base_moe, hidden_states, self):
            return super().forward(hidden_states)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1]).contiguous()
        return ops.rms_norm(x, self.weight, self.variance_epsilon).view(shape)


# Decoder layers whose forward is input norm, attention, ``residual + attention``, post-attention norm, MoE block,
# residual add, with the attention called as ``self_attn(hidden_states=..., <the forward's other arguments>)``
# (transformers 5.x): base_moe may run their residual add and norm as one op
_LLAMA_STYLE_DECODER_LAYERS = frozenset(
    {"Qwen3MoeDecoderLayer", "Qwen2MoeDecoderLayer", "OlmoeDecoderLayer", "MixtralDecoderLayer",
     "DeepseekV3DecoderLayer"}
)


def _llama_style_decoder_layer(layer: nn.Module, layout: MoELayout) -> nn.Module | None:
    """``layer`` if it is a Llama-style decoder layer (above) whose ``mlp`` is ``layout``'s block, else None."""
    if type(layer).__name__ not in _LLAMA_STYLE_DECODER_LAYERS or "forward" in layer.__dict__:
        return None
    return layer if getattr(layer, "mlp", None) is layout.block else None


def post_attention(layer: nn.Module, residual: torch.Tensor, attention_output: torch.Tensor):
    """What a decoder layer does between its attention and its MoE block: ``residual + attention_output`` and the
    post-attention norm of it; returns ``(normed, residual + attention_output)``. For a layer that
    :func:`apply` patched (a Llama-style one) one ``ops.add_rms_norm`` while the budget is on (so that on CUDA the
    block's selection kernel starts during it), else the model's own addition and norm module. For decode loops that
    call a layer's modules themselves (``benchmarks/bench_e2e.py``)."""
    state = getattr(layer, "_base_moe", None)
    norm = layer.post_attention_layernorm
    if (state is None or not _runs_base_moe_norm(state, attention_output, norm)
            or _records_gradients(norm, residual)  # the op would drop the residual's history
            or residual.dtype != attention_output.dtype or residual.shape != attention_output.shape):
        total = residual + attention_output
        return norm(total), total
    shape = attention_output.shape
    normed, total = ops.add_rms_norm(attention_output.reshape(-1, shape[-1]).contiguous(),
                                     residual.reshape(-1, shape[-1]).contiguous(), norm.weight,
                                     norm.variance_epsilon)
    return normed.view(shape), total.view(shape)


def _named_parameters_after_hidden_states(cls: type) -> tuple[tuple[str, object], ...]:
    """(name, default) of the parameters of ``cls.forward`` after ``hidden_states`` that are not ``*``/``**`` (read
    once, at apply: inspect has no place inside a compiled forward)."""
    params = list(inspect.signature(cls.forward).parameters.values())[2:]  # self, hidden_states
    return tuple((p.name, p.default) for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


_RENAMED_ARGUMENTS = frozenset({"past_key_values", "cache"})


class _BaseMoEDecoderLayer:
    """Mixed into a Llama-style decoder layer before a patched block: the layer's own steps, with the residual add
    and the post-attention norm as one ``ops.add_rms_norm`` (:func:`post_attention`) while the budget is on with
    ``norm='auto'``; the layer's own forward otherwise. The attention gets the arguments the layer's own forward would
    pass it: every named parameter of that forward (its default when not given) and the extra keyword arguments."""

    def forward(self, hidden_states, *args, **kwargs):
        if not _runs_base_moe_norm(self._base_moe, hidden_states, self.post_attention_layernorm):
            return super().forward(hidden_states, *args, **kwargs)
        named = self._base_moe.decoder_parameters
        # the layer's own forward where its decorators would rename an argument (past_key_values -> cache after 5.17)
        renamed = (_RENAMED_ARGUMENTS & kwargs.keys()) - {name for name, _ in named}
        if len(args) > len(named) or renamed:
            return super().forward(hidden_states, *args, **kwargs)
        call = {name: default for name, default in named if default is not inspect.Parameter.empty}
        call.update(zip((name for name, _ in named), args))
        call.update(kwargs)
        attention_output, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **call)
        normed, residual = post_attention(self, hidden_states, attention_output)
        return residual + self.mlp(normed)


class _BaseMoEBlock:
    """Mixed into the model's MoE block class: the budgeted decode path, or the block's own forward."""

    def forward(self, hidden_states, *args, **kwargs):
        state: _BlockState = self._base_moe
        s = state.settings
        if not s.active or hidden_states.dim() != 3 or args or kwargs:
            return super().forward(hidden_states, *args, **kwargs)
        B, S, H = hidden_states.shape
        budgeted = S == 1 if s.group_by == "batch" else S > s.dense_positions
        if not budgeted:
            return super().forward(hidden_states)
        if _records_gradients(self, hidden_states):
            warnings.warn(
                "autograd is recording this decode step (grad mode on, and the MoE block's input or weights require "
                "grad): the MoE blocks run the model's own code, without the budget; decode under torch.no_grad() or "
                "torch.inference_mode() for it", AutogradFallbackWarning, stacklevel=2)
            state.last = None  # no selection was made: selections() leaves the step's layers out
            return super().forward(hidden_states)
        if s.group_by == "batch":
            y, scores = state.budgeted(hidden_states.reshape(B, H), num_groups=1,
                                       voting=state.voting(B, S, hidden_states.device))
            return state.output(y.view(B, 1, H), scores)
        P = s.dense_positions
        y, scores = state.budgeted(hidden_states.reshape(B * S, H), num_groups=S - P, sequences=B,
                                   voting=state.voting(B, S, hidden_states.device))
        return state.output(y.view(B, S, H), scores)


def _experts_kernel_fits(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor) -> bool:
    """The shapes, dtypes and alignments ``ops.experts`` takes on ``x``'s device (the CUDA kernel: bf16/fp16, hidden and
    intermediate sizes multiples of 64, at most 512 experts, 16-byte aligned operands); other blocks run the model's own
    experts."""
    if x.device.type != "cuda":
        return True
    E, two_i, H = gate_up_proj.shape
    aligned = all(t.data_ptr() % 16 == 0 for t in (x, gate_up_proj, down_proj))
    sizes = H % 64 == 0 and (two_i // 2) % 64 == 0 and E <= 512
    return aligned and sizes and x.dtype in (torch.bfloat16, torch.float16)


@dataclass(eq=False)
class _Routed:
    """What a budgeted router call hands its block: the budgeted tokens' ``hidden [T, H]`` (group after group), their
    fp32 ``logits`` and predicted ``log_norms``, the ``selection`` where one ``select_experts`` call made it, and under
    group_by='position' with dense positions their tokens' ``(hidden [N, H], top_k_weights, top_k_index)`` from the
    model's own router (token order), and ``voting``, the budgeted tokens that vote (None: all)."""

    hidden: torch.Tensor
    logits: torch.Tensor
    log_norms: torch.Tensor
    selection: Selection | None
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    voting: torch.Tensor | None = None


class _BlockState:
    """One patched block's settings, predictor tensors and last selection (a plain attribute of the block, so
    nothing of it reaches ``state_dict``)."""

    def __init__(self, layout: MoELayout, settings: Settings, inputs: _ModelInputs):
        self.layout = layout
        self.settings = settings
        self.inputs = inputs  # shared by the model's blocks
        self.predictors = None
        self.predictor_weight: torch.Tensor | None = None
        self.predictor_bias: torch.Tensor | None = None
        self.mean_log_norm: torch.Tensor | None = None
        self.similarity: torch.Tensor | None = None
        self.last: tuple[Selection, int] | None = None
        self.norm: nn.Module | None = None  # the decoder layer's norm before the block, when base_moe runs it
        self.decoder_layer: nn.Module | None = None  # the decoder layer, when base_moe runs its residual add + norm
        self.decoder_parameters: tuple[tuple[str, object], ...] = ()  # its forward's named parameters and defaults
        self._router_bias_fp32: tuple[torch.Tensor, int, int, torch.Tensor] | None = None

    def set_predictors(self, predictors) -> None:
        """Take this layer's predictor, converted once to the router's dtype and device (bias fp32)."""
        self.predictors = predictors
        self.predictor_weight = self.predictor_bias = self.mean_log_norm = self.similarity = None
        if predictors is None:
            return
        i, weight = self.layout.layer_index, self.layout.router_weight
        self.predictor_weight = predictors.weight[i].to(device=weight.device, dtype=weight.dtype).contiguous()
        self.predictor_bias = predictors.bias[i].to(device=weight.device, dtype=torch.float32).contiguous()
        mean = (getattr(predictors, "mean_log_norm", None) or {}).get(i)
        if mean is not None:
            self.mean_log_norm = mean.to(device=weight.device, dtype=torch.float32).contiguous()
        similarity = (getattr(predictors, "similarity", None) or {}).get(i)
        if similarity is not None:
            self.similarity = similarity.to(device=weight.device, dtype=torch.float32).contiguous()

    def _follow(self) -> None:
        """Convert the predictor tensors again if the router moved or changed dtype after apply (python-level check,
        no sync): from the calibrated tensors, never from the converted copy, which a round trip through a narrower
        dtype (model.to(bfloat16) then back) would have rounded."""
        weight, w = self.layout.router_weight, self.predictor_weight
        if w is not None and (w.device != weight.device or w.dtype != weight.dtype):
            self.set_predictors(self.predictors)

    def router_bias_fp32(self) -> torch.Tensor | None:
        """The router's bias as the ops take it (fp32). A bias in another dtype (GPT-OSS: bf16) is converted once and
        kept until the parameter changes (another tensor, storage or in-place version: python-level checks, no sync),
        instead of a cast kernel per layer and step; under torch.compile it is cast in the graph. A write through
        ``bias.data`` bumps no version that the check could see: :func:`configure` rewrites the copy."""
        bias = self.layout.router_bias
        if bias is None or bias.dtype == torch.float32:
            return bias
        if torch.compiler.is_compiling():
            return bias.float()
        cached = self._router_bias_fp32
        if cached is None or cached[0] is not bias or cached[1] != bias.data_ptr() or cached[2] != bias._version:
            cached = (bias, bias.data_ptr(), bias._version, bias.detach().float())
            self._router_bias_fp32 = cached
        return cached[3]

    def refresh_router_bias(self) -> None:
        """Rewrites the fp32 copy of the router bias from the parameter (a write through ``.data`` bumps no version
        that :meth:`router_bias_fp32` could see), in place: a CUDA graph captured with the copy reads its memory."""
        cached, bias = self._router_bias_fp32, self.layout.router_bias
        if cached is None:
            return
        copy = cached[3]
        if bias is None or bias.shape != copy.shape or bias.device != copy.device:
            self._router_bias_fp32 = None
            return
        with torch.inference_mode(copy.is_inference()):  # (a copy made under inference mode is written there)
            copy.copy_(bias.detach())
        self._router_bias_fp32 = (bias, bias.data_ptr(), bias._version, copy)

    def voting(self, B: int, S: int, device: torch.device) -> torch.Tensor | None:
        """``[B * S]`` bool in token order on ``device`` (the block's, where a model spans devices): the tokens that
        vote under ``finished_tokens`` (None: all)."""
        voting = self.inputs.voting
        if voting is None:
            return None
        if tuple(voting.shape) != (B, S):
            raise ValueError(
                f"the voting mask (finished_tokens' from the model call's input_ids, or voting_tokens') has shape "
                f"{tuple(voting.shape)}, but MoE block '{self.layout.name}' got {B} x {S} tokens; it needs blocks that "
                f"see the mask's tokens one to one"
            )
        return voting.reshape(B * S).to(device, non_blocking=True)

    # -- stage 1, or stages 1-3 (called through the router module, so its hooks fire) -------------------------------
    def route(self, hidden: torch.Tensor, num_groups: int, sequences: int | None = None,
              voting: torch.Tensor | None = None):
        """``hidden [T, H]``: ``num_groups`` decode batches, group after group; or, with ``sequences``
        (group_by='position'), that many sequences in token order whose last ``num_groups`` positions are the decode
        batches (routed position after position) and whose earlier ones get the model's own routing. ``voting``: the
        tokens that vote, in ``hidden``'s order (None: all). Returns every token's fp32 logits in ``hidden``'s order
        (what HF's ``output_router_logits`` records: one ``[T, E]`` per block call, in token order) and the
        :class:`_Routed` the block goes on with."""
        if sequences is None:
            logits, log_norms, sel = self._route_groups(hidden, num_groups, voting)
            return logits, _Routed(hidden, logits, log_norms, sel, voting=voting)
        tokens = hidden.view(sequences, -1, hidden.shape[-1])
        P = tokens.shape[1] - num_groups
        x = tokens[:, P:].transpose(0, 1).reshape(num_groups * sequences, -1).contiguous()  # position after position
        if voting is not None:
            voting = voting.view(sequences, -1)[:, P:].transpose(0, 1).reshape(-1)
        logits, log_norms, sel = self._route_groups(x, num_groups, voting)
        token_logits, dense = logits.view(num_groups, sequences, -1).transpose(0, 1), None
        if P:
            dense_hidden = tokens[:, :P].reshape(sequences * P, -1).contiguous()
            own_logits, weights, ids = self.layout.router_choices(dense_hidden)
            dense = (dense_hidden, weights, ids)
            token_logits = torch.cat([own_logits.float().view(sequences, P, -1), token_logits], dim=1)
        return token_logits.reshape(hidden.shape[0], -1), _Routed(x, logits, log_norms, sel, dense, voting)

    def _route_groups(self, hidden: torch.Tensor, num_groups: int, voting: torch.Tensor | None):
        """Stage 1 on ``hidden`` (group after group), or stages 1-3 as one ``select_experts`` call (only ``voting``'s
        tokens choosing): ``(logits [T, E] fp32, predicted log-norms [T, E] or [T, 0], Selection or None)``."""
        weight = self.layout.router_weight
        x = hidden.to(weight.dtype).contiguous()  # DeepSeek-V3 routes in fp32
        bias = self.router_bias_fp32()
        s, pw, pb = self.settings, None, None
        if s.policy.needs_predictors:
            self._follow()
            pw, pb = self.predictor_weight, self.predictor_bias
        cost, rounds = s.policy.fused_cost, self.layout.router_rounds_logits  # (rounds: the model's router's logits)
        if cost is not None and s.budget is not None and has_kernel("select_experts", x.device):
            logits, log_norms, *selection = ops.select_experts(
                x, weight, self.layout.routing, budget=s.budget, num_groups=num_groups, cost=cost, fill=s.op_fill,
                router_bias=bias, predictor_weight=pw, predictor_bias=pb,
                correction_bias=self.layout.correction_bias(), voting=voting, round_logits=rounds,
            )
            return logits, log_norms, Selection(*selection)
        if has_kernel("router_predict", x.device):
            return *ops.router_predict(x, weight, bias, pw, pb, round_logits=rounds), None
        return *reference.router_predict(x, weight, bias, pw, pb, rounds), None

    # -- stages 1-4 -----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def budgeted(self, x: torch.Tensor, num_groups: int, sequences: int | None = None,
                 voting: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, H]`` -> ``(y [T, H], weights [T, k])``, for ``num_groups`` decode batches group after group, or,
        with ``sequences``, for the token-order layout of :meth:`route` (outputs in token order too); ``voting [T]``:
        the tokens whose costs choose the kept experts (None: all).
        Inference only: no gradient flows through the budgeted path (the ops have no backward), nor through the dense
        positions computed with it."""
        s = self.settings
        _check_dtype(x.dtype, f"the hidden state of MoE block '{self.layout.name}'")
        _check_routing_dtype(self.layout, x.dtype)
        _, routed = self.layout.router(x.contiguous(), base_moe=self, num_groups=num_groups, sequences=sequences,
                                       voting=voting)
        x, sel = routed.hidden, routed.selection
        # the step only where a policy or the substitute fill reads it (not on the fused path's every call)
        step = self._step(routed, num_groups) if sel is None or s.substitutes else None
        if sel is None:
            sel = s.policy.select(step)
        if s.substitutes:
            sel = substitute_dropped(step, sel, self.similarity)
        if s.record:
            self.last = (sel, num_groups)
        y = self.layout.plus_shared(x, self.experts(x, sel, num_groups))
        if sequences is None:
            return y, sel.weights
        return self._in_token_order(y, sel.weights, routed.dense, sequences)

    def _in_token_order(self, y: torch.Tensor, weights: torch.Tensor, dense, sequences: int):
        """The budgeted positions' ``y`` and ``weights`` (position after position) and the dense positions' (the
        model's own experts on its own routing, plus its shared experts: the block's own forward) in token order."""
        H, k = y.shape[-1], weights.shape[-1]
        y = y.view(-1, sequences, H).transpose(0, 1)
        weights = weights.view(-1, sequences, k).transpose(0, 1)
        if dense is not None:
            x, own_weights, ids = dense
            own = self.layout.plus_shared(x, self.layout.routed_experts(x, ids, own_weights))
            y = torch.cat([own.view(sequences, -1, H).to(y.dtype), y], dim=1)
            weights = torch.cat([own_weights.view(sequences, -1, k).to(weights.dtype), weights], dim=1)
        return y.reshape(-1, H), weights.reshape(-1, k)

    def _step(self, routed: _Routed, num_groups: int) -> DecodeStep:
        layout, s = self.layout, self.settings
        x, logits, log_norms = routed.hidden, routed.logits, routed.log_norms
        mean, similarity = self.mean_log_norm, self.similarity
        # (not _follow: an offloaded router's weight is back on "meta" once its forward has returned)
        if s.policy.needs_statistics and mean is not None and mean.device != x.device:
            self.mean_log_norm = mean.to(x.device)
        if s.substitutes and similarity is not None and similarity.device != x.device:
            self.similarity = similarity.to(x.device)  # once, not a copy per step (which a CUDA graph cannot hold)
        return DecodeStep(
            hidden=x,
            logits=logits,
            predicted_log_norms=log_norms if s.policy.needs_predictors else None,
            routing=layout.routing,
            correction_bias=layout.correction_bias(),
            num_groups=num_groups,
            budget=s.budget,
            fill=s.op_fill,
            layout=layout,
            mean_log_norm=self.mean_log_norm,
            voting=routed.voting,
        )

    def experts(self, x: torch.Tensor, sel: Selection, num_groups: int) -> torch.Tensor:
        layout, ex = self.layout, self.layout.experts
        use_ops = (
            layout.fused
            and self.settings.experts != "hf"
            and has_kernel("experts", x.device)
            and ex.gate_up_proj.dtype == x.dtype
            and ex.gate_up_proj.is_contiguous()
            and ex.down_proj.is_contiguous()
            and _experts_kernel_fits(x, ex.gate_up_proj, ex.down_proj)
        )
        if use_ops:
            # the final ids lie in the kept sets: at most G * M distinct experts
            bound = sel.kept.numel() if sel.kept is not None else None
            return ops.experts(x, sel.ids.contiguous(), sel.weights.contiguous(), ex.gate_up_proj, ex.down_proj,
                               max_active_experts=bound)
        fallback = None
        if sel.kept is not None:  # the group's first kept expert: loaded anyway, used with weight 0
            T = x.shape[0]
            fallback = sel.kept[:, :1].expand(num_groups, T // num_groups).reshape(T)
        return layout.routed_experts(x, sel.ids, sel.weights, fallback)

    def output(self, y: torch.Tensor, scores: torch.Tensor | None):
        if self.layout.returns_router_scores:
            return y, (None if scores is None else scores.to(y.dtype))
        return y
