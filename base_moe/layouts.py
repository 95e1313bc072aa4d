"""Find the MoE blocks of a Hugging Face model by their structure, and describe each one.

A transformers 5.x MoE block has a router child (a ``weight [E, H]``, optionally a ``bias [E]``) that returns
``(logits, top_k_weights, top_k_index)``, an experts child holding fused 3-D weights (``gate_up_proj``,
``down_proj``), and optionally shared experts. Nothing here looks at class names: blocks are found by their
parameters, and the routing rule (softmax/top-k, top-k/softmax, sigmoid with correction bias; groups,
renormalisation, scaling) is read from the router's attributes and then *verified* by running the router once
on a probe input and comparing its output with :func:`base_moe.reference.route`.

:class:`MoELayout` is what the rest of base_moe (the drop-in module, calibration, evaluation) codes against:
the router's logits, one expert's output, the shared experts' output, all in plain PyTorch.
"""

from __future__ import annotations

import copy
import inspect
import re
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn

from . import reference
from .routing import Routing, Scoring

__all__ = ["MoELayout", "MoELayoutError", "find_moe_layouts"]

LOG_NORM_FLOOR = 1e-12
"""Expert-output norms are clamped to at least this before the log (a zero output would give -inf)."""


def expert_log_norms(layout, x: torch.Tensor) -> torch.Tensor:
    """``log max(||E_u(x_t)||, LOG_NORM_FLOOR)`` for every token and expert ``u``, ``[N, E]`` fp32: calibration's
    targets and the oracle policy's log-norms. Runs every expert; ``layout`` is anything with ``hidden_size``,
    ``num_experts`` and ``expert_output(x, u)`` (an ``MoELayout``, or a test's stand-in)."""
    x = x.reshape(-1, layout.hidden_size).float()  # once, not once per expert (expert_output computes in fp32)
    norms = torch.empty(x.shape[0], layout.num_experts, dtype=torch.float32, device=x.device)
    for u in range(layout.num_experts):
        norms[:, u] = torch.linalg.vector_norm(layout.expert_output(x, u), dim=-1, dtype=torch.float32)
    return norms.clamp_min_(LOG_NORM_FLOOR).log_()


def expert_output_gram(layout, x: torch.Tensor, max_chunk_bytes: int = 1 << 28) -> torch.Tensor:
    """``sum_t O_t O_t^T`` ``[E, E]``, ``O_t [E, H]`` every expert's output for token ``t``: the inner products of the
    experts' outputs over the tokens of ``x``, from which calibration's expert similarity is made. Runs every expert
    on chunks of tokens whose ``E`` fp32 outputs fill one buffer of at most ``max_chunk_bytes``; each chunk's products
    are fp32 matrix products, summed over the chunks in fp64. ``layout`` as for :func:`expert_log_norms`."""
    E, H = layout.num_experts, layout.hidden_size
    x = x.reshape(-1, H)
    chunk = max(1, max_chunk_bytes // (4 * E * H))
    outputs = torch.empty(E, min(chunk, x.shape[0]), H, dtype=torch.float32, device=x.device)
    gram = torch.zeros(E, E, dtype=torch.float64, device=x.device)
    for rows in x.split(chunk):
        n = rows.shape[0]
        for u in range(E):
            outputs[u, :n] = layout.expert_output(rows, u)
        flat = outputs[:, :n].reshape(E, -1)
        gram += (flat @ flat.T).double()
    return gram


def cosine_similarity_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """``G_uv / sqrt(G_uu G_vv)`` fp32: the cosine similarity of every two experts' outputs over the tokens summed
    in ``gram`` (an expert whose outputs were all zero is similar to none: 0, and 1 to itself)."""
    norms = gram.diagonal().clamp_min(0).sqrt()
    similarity = gram / (norms[:, None] * norms[None, :]).clamp_min(torch.finfo(torch.float64).tiny)
    similarity = torch.where((norms[:, None] > 0) & (norms[None, :] > 0), similarity, 0.0).clamp(-1.0, 1.0)
    similarity.fill_diagonal_(1.0)
    return similarity.float()


class MoELayoutError(ValueError):
    """A module looks like an MoE block but base_moe does not understand its layout."""


@dataclass(eq=False)
class MoELayout:
    """One MoE block of a model, as base_moe sees it.

    ``name`` is the block's qualified module name (``"model.layers.3.mlp"``), ``layer_index`` the decoder layer
    it sits in (the key of a layer's predictor). The methods compute, in plain PyTorch and fp32, what the HF
    block computes internally.
    """

    name: str
    layer_index: int
    block: nn.Module
    routing: Routing
    num_experts: int
    hidden_size: int
    router_name: str = "gate"
    """attribute of ``block`` holding the router (``gate``; ``router`` for GPT-OSS)."""
    router_linear_name: str = ""
    """the router's submodule holding its ``[E, H]`` weight (and bias), "" for the router itself (``wg`` for
    HunYuan-V1-MoE's gate)."""
    experts_name: str = "experts"
    shared_names: tuple[str, ...] = ()
    """children of ``block`` that are always-on shared experts (added to the routed output)."""
    shared_gate_name: str | None = None
    """a child ``Linear(H, 1)`` whose sigmoid scales the shared experts' output (Qwen2-MoE)."""
    fused: bool = True
    """experts in the HF v5 layout ``base_moe.ops.experts`` takes: ``gate_up_proj [E, 2I, H]`` (gate rows first),
    ``down_proj [E, H, I]``, SiLU, no biases. False for GPT-OSS (transposed, interleaved, biases, clamped SwiGLU)
    and for other activations: those run through the model's own experts module."""
    returns_router_scores: bool = False
    """the block returns ``(hidden, router_scores)`` rather than a tensor (GPT-OSS)."""
    router_returns_model_dtype: bool = True
    """the router's logits come out in its weight's dtype (not only rounded to it)."""
    router_takes_sequences: bool = False
    """the router's forward takes hidden states ``[B, S, H]`` (AFMoE's unpacks three dimensions), not ``[N, H]``."""
    router_rounds_logits: bool = True
    """the router's logits come out rounded to its weight's dtype, as a linear layer returns them (a half model's
    router ranks logits rounded to that type: Qwen3-MoE, OLMoE, Mixtral, GPT-OSS; Granite-MoE widens them after),
    rather than computed in fp32 whatever that dtype (DeepSeek-V3); the selection ops round theirs alike
    (``round_logits``)."""
    detected_dtype: torch.dtype | None = None
    """the experts' dtype at detection (``dtype`` then; the routing rule was verified in it, unless on the meta
    device)."""
    router_class: type = field(default=nn.Module, repr=False)
    """the router's own (unpatched) class."""

    # -- the modules -------------------------------------------------------------------------------------------
    @property
    def router(self) -> nn.Module:
        return getattr(self.block, self.router_name)

    @property
    def experts(self) -> nn.Module:
        return getattr(self.block, self.experts_name)

    @property
    def router_linear(self) -> nn.Module:
        """The module holding the router's weight and bias: the router, or its submodule ``router_linear_name``."""
        return self.router.get_submodule(self.router_linear_name)

    @property
    def router_weight(self) -> torch.Tensor:
        return self.router_linear.weight

    @property
    def router_bias(self) -> torch.Tensor | None:
        bias = getattr(self.router_linear, "bias", None)
        return bias if isinstance(bias, torch.Tensor) else None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the hidden states the block sees (its experts' weights)."""
        return self.experts.gate_up_proj.dtype

    @property
    def routes_in_model_dtype(self) -> bool:
        """The router adds its selection bias to sigmoid scores of logits in the model's dtype (LFM2-MoE): that dtype's
        rounding decides between near experts, so the rule verified in ``detected_dtype`` holds in that dtype only.
        (AFMoE widens its logits to fp32 first: not so.)"""
        sigmoid = self.routing.scoring == Scoring.SIGMOID
        return sigmoid and self.router_returns_model_dtype and _correction_bias(self.router, self.block) is not None

    # -- the public contract -----------------------------------------------------------------------------------
    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, H]`` -> the HF router's logits ``[N, E]`` as fp32 (computed by the router's own forward)."""
        return _logits_of(_router_forward(self, x.reshape(-1, self.hidden_size))).float()

    def router_choices(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [N, H]`` -> the model's own routing of it, ``(logits [N, E], top_k_weights [N, k], top_k_index [N, k])``
        as its router's own forward returns them (or, for a router that returns logits only, as the block's
        ``route_tokens_to_experts`` makes them): the choices the block's own forward acts on."""
        return _router_choices(self, x)

    def correction_bias(self) -> torch.Tensor | None:
        """The selection bias (DeepSeek-V3's ``e_score_correction_bias``, ERNIE-4.5's, LFM2's ``expert_bias``) as an
        fp32, contiguous ``[E]`` vector, or None."""
        bias = _correction_bias(self.router, self.block)
        return None if bias is None else bias.float().reshape(-1).contiguous()

    def expert_output(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """``E_u(x) [N, H]``: expert ``u``'s output, unweighted, computed in fp32 (no shared experts)."""
        ex = self.experts
        xf = x.reshape(-1, self.hidden_size).float()
        transposed = bool(getattr(ex, "is_transposed", False))
        h = _linear(xf, ex.gate_up_proj[expert].float(), transposed)
        gate_up_bias = getattr(ex, "gate_up_proj_bias", None)
        if gate_up_bias is not None:
            h = h + gate_up_bias[expert].float()
        act = ex._apply_gate(h) if hasattr(ex, "_apply_gate") else _silu_gate(ex, h)
        y = _linear(act, ex.down_proj[expert].float(), transposed)
        down_bias = getattr(ex, "down_proj_bias", None)
        if down_bias is not None:
            y = y + down_bias[expert].float()
        if getattr(ex, "has_post_expert_norm", False):
            y = ex.post_expert_norm(y)
        return y

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' contribution ``[N, H]`` in ``x``'s dtype, as the block adds it, or None."""
        if not self.shared_names:
            return None
        x = x.reshape(-1, self.hidden_size)
        out = None
        for name in self.shared_names:
            y = getattr(self.block, name)(x)
            out = y if out is None else out + y
        if self.shared_gate_name is not None:
            out = torch.sigmoid(getattr(self.block, self.shared_gate_name)(x)) * out
        return out

    def plus_shared(self, x: torch.Tensor, routed_output: torch.Tensor) -> torch.Tensor:
        """``routed_output [N, H]`` (the routed experts' output for ``x [N, H]``) plus the shared experts', as the
        block adds them."""
        shared = self.shared_output(x)
        return routed_output if shared is None else routed_output + shared

    # -- helpers for the drop-in module and the oracle policy ---------------------------------------------------
    def expert_log_norms(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, E]`` fp32: see the module function ``expert_log_norms`` (the oracle policy's log-norms)."""
        return expert_log_norms(self, x)

    def routed_experts(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, fallback_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The routed output through the model's own experts module (its ``experts_implementation``), for
        ``ids [T, k]`` that may hold the sentinel ``E``: a sentinel slot is pointed at ``fallback_ids [T]`` (an
        expert the token's group loads anyway) with weight 0, so no other expert runs and every HF
        implementation (eager, grouped_mm, batched_mm) accepts the ids."""
        E = self.num_experts
        empty = ids >= E
        fallback = ids[:, :1] if fallback_ids is None else fallback_ids.reshape(-1, 1).to(ids.dtype)
        fallback = torch.where(fallback >= E, torch.zeros_like(fallback), fallback)
        safe_ids = torch.where(empty, fallback, ids).long()
        safe_weights = torch.where(empty, torch.zeros_like(weights), weights)
        return self.experts(x, safe_ids, safe_weights)


# ---------------------------------------------------------------------------------------------------------------
# Detection
# ---------------------------------------------------------------------------------------------------------------
def find_moe_layouts(model: nn.Module) -> list[MoELayout]:
    """Every MoE block of ``model``, in module order.

    A module is an MoE block when it has a child named ``experts`` or a child holding fused 3-D ``gate_up_proj``
    and ``down_proj`` weights (so a hybrid model's convolutions, also 3-D, are not taken for experts). Raises
    :class:`MoELayoutError` (a ``ValueError``) naming the module when such a block is not understood.
    """
    layouts, stand_in_checks = [], {}
    for name, module in model.named_modules():
        experts_name = _experts_child(module)
        if experts_name is None:
            continue
        layouts.append(_describe(name, module, experts_name, len(layouts), stand_in_checks))
    _check_distinct_layer_indices(layouts)
    return layouts


def _check_distinct_layer_indices(layouts: list[MoELayout]) -> None:
    """The layer index keys predictors, selections and calibration: two blocks sharing one (a model with two
    decoder stacks, each counting its layers from 0) would silently share or lose them."""
    seen: dict[int, str] = {}
    for layout in layouts:
        first = seen.setdefault(layout.layer_index, layout.name)
        if first != layout.name:
            raise MoELayoutError(
                f"MoE blocks '{first}' and '{layout.name}' both have layer index {layout.layer_index}: base_moe "
                "supports models with one stack of MoE decoder layers"
            )


def _experts_child(module: nn.Module) -> str | None:
    for child_name, child in module.named_children():
        fused = [getattr(child, w, None) for w in ("gate_up_proj", "down_proj")]
        if child_name == "experts" or all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in fused):
            return child_name
    return None


def _describe(name: str, block: nn.Module, experts_name: str, ordinal: int, stand_in_checks: dict) -> MoELayout:
    """The layout of one block (``stand_in_checks``: _returns_tuple's answers for blocks on the meta device, by
    _structure_key, for this model's detection)."""
    where = f"MoE block '{name}' ({type(block).__name__})"
    experts = getattr(block, experts_name)
    if isinstance(experts, nn.ModuleList):
        raise MoELayoutError(
            f"{where}: its experts are a per-expert ModuleList (the transformers 4.x layout), which base_moe does "
            "not support; load the model with transformers >= 5 (fused 3-D expert weights)."
        )
    gate_up = getattr(experts, "gate_up_proj", None)
    down = getattr(experts, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor) and gate_up.dim() == down.dim() == 3):
        raise MoELayoutError(
            f"{where}: its experts module '{experts_name}' has no fused 3-D 'gate_up_proj'/'down_proj' weights; "
            "base_moe understands the transformers 5.x expert layout only."
        )
    E = gate_up.shape[0]

    router_name, router_linear_name = _find_router(block, experts_name, E)
    if router_name is None:
        raise MoELayoutError(
            f"{where}: no router found (a child with a 'weight' of shape [{E}, hidden_size], or one submodule holding "
            f"it, next to '{experts_name}')."
        )
    router = getattr(block, router_name)
    H = router.get_submodule(router_linear_name).weight.shape[1]

    shared_names, shared_gate_name = [], None
    for child_name, child in block.named_children():
        if child_name in (router_name, experts_name) or not any(True for _ in child.parameters()):
            continue
        if "shared" not in child_name:
            raise MoELayoutError(
                f"{where}: unexpected submodule '{child_name}' ({type(child).__name__}); base_moe knows routers, "
                "experts and shared experts ('shared*')."
            )
        weight = getattr(child, "weight", None)
        if isinstance(child, nn.Linear) and weight is not None and weight.shape == (1, H):
            shared_gate_name = child_name
        else:
            shared_names.append(child_name)
    if shared_gate_name is not None and not shared_names:
        raise MoELayoutError(f"{where}: a shared-expert gate '{shared_gate_name}' without a shared expert.")

    transposed = bool(getattr(experts, "is_transposed", False))
    inter2 = gate_up.shape[2] if transposed else gate_up.shape[1]
    expected_gate_up = (E, H, inter2) if transposed else (E, inter2, H)
    expected_down = (E, inter2 // 2, H) if transposed else (E, H, inter2 // 2)
    if tuple(gate_up.shape) != expected_gate_up or tuple(down.shape) != expected_down or inter2 % 2:
        raise MoELayoutError(
            f"{where}: expert weights gate_up_proj {tuple(gate_up.shape)} / down_proj {tuple(down.shape)} do not "
            f"match hidden size {H} and {E} experts in the {'transposed ' if transposed else ''}HF v5 layout."
        )
    if not transposed and not getattr(experts, "is_concatenated", True) and not hasattr(experts, "_apply_gate"):
        raise MoELayoutError(f"{where}: interleaved gate/up rows without an '_apply_gate' method.")
    fused = (
        not transposed
        and getattr(experts, "is_concatenated", True)
        and getattr(experts, "gate_up_proj_bias", None) is None
        and getattr(experts, "down_proj_bias", None) is None
        and not getattr(experts, "has_post_expert_norm", False)
        and _is_default_gate(experts)
        and _is_silu(getattr(experts, "act_fn", None))
    )

    layout = MoELayout(
        name=name,
        layer_index=_layer_index(name, ordinal),
        block=block,
        routing=Routing(top_k=1),  # replaced below
        num_experts=E,
        hidden_size=H,
        router_name=router_name,
        router_linear_name=router_linear_name,
        experts_name=experts_name,
        shared_names=tuple(shared_names),
        shared_gate_name=shared_gate_name,
        fused=fused,
        router_class=getattr(type(router), "_base_moe_original_class", type(router)),
    )
    layout.detected_dtype = layout.dtype
    try:
        _probe_router_stand_in(layout)
        layout.routing = _infer_routing(layout, where)
        _check_selection_biases_used(layout, where)
        layout.returns_router_scores = _returns_tuple(layout, where, stand_in_checks)
    except (MoELayoutError, torch.OutOfMemoryError):
        raise
    except Exception as error:  # a router or block that fails on base_moe's probe: say which, not only where in HF
        raise MoELayoutError(
            f"{where}: running its router '{router_name}' or the block on a probe failed "
            f"({type(error).__name__}: {error}), so base_moe cannot tell how it routes."
        ) from error
    return layout


def _has_router_weight(module: nn.Module, E: int) -> bool:
    w = getattr(module, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 2 and w.shape[0] == E


def _find_router(block: nn.Module, experts_name: str, E: int) -> tuple[str | None, str]:
    """``(child, submodule)``: the block's child that holds a ``[E, H]`` weight, or else the child (not a shared
    expert) with exactly one submodule, at any depth, holding one (HunYuan-V1-MoE's ``gate.wg``); ``(None, "")`` if
    neither. The routing and output probes then check the choice."""
    candidates = [(name, child) for name, child in block.named_children() if name != experts_name]
    for name, child in candidates:
        if _has_router_weight(child, E):
            return name, ""
    for name, child in candidates:
        inner = [sub for sub, module in child.named_modules() if sub and _has_router_weight(module, E)]
        if "shared" not in name and len(inner) == 1:
            return name, inner[0]
    return None, ""


def _logits_of(router_output) -> torch.Tensor:
    return router_output[0] if isinstance(router_output, tuple) else router_output


def _layer_index(name: str, ordinal: int) -> int:
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    return int(match.group(1)) if match else ordinal


def _linear(x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    return x @ weight if transposed else F.linear(x, weight)


def _silu_gate(experts: nn.Module, h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def _is_default_gate(experts: nn.Module) -> bool:
    apply_gate = getattr(type(experts), "_apply_gate", None)
    return apply_gate is None or getattr(apply_gate, "__name__", "") == "_default_apply_gate"


def _is_silu(act_fn) -> bool:
    if not callable(act_fn):
        return False
    probe = torch.linspace(-6.0, 6.0, 49)
    try:
        return torch.allclose(act_fn(probe), F.silu(probe), rtol=1e-6, atol=1e-6)
    except Exception:  # noqa: BLE001 - an activation that cannot run on a CPU probe is not SiLU for us
        return False


_SELECTION_BIAS_NAMES = ("e_score_correction_bias", "expert_bias")
"""names of a bias a router adds to its expert scores for the top-k only (DeepSeek-V3 and its kin; LFM2's block holds
``expert_bias``; ERNIE-4.5's router holds one in ``moe_statics``, added to softmax probabilities)."""


def _own_selection_bias(router: nn.Module, block: nn.Module) -> torch.Tensor | None:
    """A selection bias held as the router's or the block's own attribute (DeepSeek-V3, LFM2), or None."""
    for owner in (router, block):
        for name in _SELECTION_BIAS_NAMES:
            bias = getattr(owner, name, None)
            if isinstance(bias, torch.Tensor):
                return bias
    return None


def _correction_bias(router: nn.Module, block: nn.Module) -> torch.Tensor | None:
    """The selection bias the router adds to its expert scores: the router's or the block's own attribute, else one a
    submodule of the router holds (ERNIE-4.5's ``gate.moe_statics.e_score_correction_bias``, shaped ``[1, E]``)."""
    bias = _own_selection_bias(router, block)
    if bias is not None:
        return bias
    for name, tensor in [*router.named_parameters(), *router.named_buffers()]:
        if name.rsplit(".", 1)[-1] in _SELECTION_BIAS_NAMES:
            return tensor
    return None


def _check_selection_biases_used(layout: MoELayout, where: str) -> None:
    """A selection bias base_moe would not apply (a second one, or any under top-k-then-softmax, which the ops rank
    by the logits alone) is refused: a small one passes the routing probe and would then be ignored."""
    used = _correction_bias(layout.router, layout.block) if _takes_selection_bias(layout.routing) else None
    tensors = [(f"{layout.router_name}.{n}" if n else layout.router_name, t)
               for n, t in [*layout.router.named_parameters(), *layout.router.named_buffers()]]
    tensors += [*layout.block.named_parameters(recurse=False), *layout.block.named_buffers(recurse=False)]
    for name, tensor in tensors:
        if name.rsplit(".", 1)[-1] in _SELECTION_BIAS_NAMES and tensor is not used:
            raise MoELayoutError(
                f"{where}: it holds a selection bias '{name}' that base_moe's routing rules would not apply (they "
                "add one, the router's or the block's e_score_correction_bias or expert_bias, to sigmoid scores or "
                "softmax probabilities)."
            )


def _takes_selection_bias(routing: Routing) -> bool:
    """The rules the ops add a selection bias to the scores of: sigmoid (DeepSeek-V3) and softmax (ERNIE-4.5)."""
    return routing.scoring in (Scoring.SIGMOID, Scoring.SOFTMAX)


def _attr(modules, *names, default=None):
    for module in modules:
        for name in names:
            value = getattr(module, name, None)
            if value is not None and not isinstance(value, (nn.Module, torch.Tensor)):
                return value
    return default


# ---------------------------------------------------------------------------------------------------------------
# Routing rule: read from attributes, verified on a probe
# ---------------------------------------------------------------------------------------------------------------
def _candidate_routings(layout: MoELayout) -> list[Routing]:
    """Routing rules to try, the one the router's attributes describe first."""
    router, block = layout.router, layout.block
    top_k = _attr((router, block), "top_k", "num_experts_per_tok")
    if top_k is None:
        config = getattr(router, "config", None) or getattr(block, "config", None)
        top_k = getattr(config, "num_experts_per_tok", None)
    if top_k is None:
        raise MoELayoutError(f"MoE block '{layout.name}': cannot tell its top-k (no 'top_k' attribute on the router).")
    n_group = int(_attr((router, block), "n_group", "num_group", default=1) or 1)
    topk_group = int(_attr((router, block), "topk_group", default=1) or 1)
    scaling = float(_attr((router, block), "routed_scaling_factor", "route_scale", default=1.0))  # AFMoE: route_scale

    # DeepSeek-V2's topk_method names its softmax rules; a bias held deeper in the router is ERNIE-4.5's, on softmax
    topk_method = _attr((router, block), "topk_method")
    softmax_rule = topk_method in ("greedy", "group_limited_greedy")
    own_bias = _own_selection_bias(router, block) is not None
    sigmoid_like = not softmax_rule and (own_bias or n_group > 1 or scaling != 1.0)
    norm = _attr((router, block), "norm_topk_prob")
    if norm is None and softmax_rule:
        norm = False  # DeepSeek-V2's router never renormalises (its config's norm_topk_prob goes unread)
    renorm_order = [bool(norm), not bool(norm)] if norm is not None else [True, False]
    if sigmoid_like:
        scorings = [Scoring.SIGMOID, Scoring.SOFTMAX, Scoring.SOFTMAX_AFTER_TOPK]
    elif layout.router_bias is not None:
        scorings = [Scoring.SOFTMAX_AFTER_TOPK, Scoring.SOFTMAX, Scoring.SIGMOID]
    else:
        scorings = [Scoring.SOFTMAX, Scoring.SOFTMAX_AFTER_TOPK, Scoring.SIGMOID]
    # the attributes' factor is the first guess; a block may carry one it does not apply
    scales = dict.fromkeys([scaling, 1.0])
    candidates = []
    for scoring in scorings:
        renorms = [False] if scoring == Scoring.SOFTMAX_AFTER_TOPK else renorm_order
        for groups in _group_options(topk_method == "greedy", scoring, int(top_k), n_group, topk_group):
            for scale in scales:
                for renorm in renorms:
                    candidates.append(Routing(int(top_k), scoring, renorm, groups[0], groups[1], scale))
    return candidates


def _group_options(greedy: bool, scoring: Scoring, top_k: int, n_group: int, topk_group: int) -> list[tuple]:
    """The group limits to try, ``(n_group, topk_group)``, the likelier first. A declared limit comes first unless the
    block says it routes greedily (DeepSeek-V2's ``topk_method="greedy"`` ignores its n_group) or, under softmax,
    the limit cannot bind: a group scored by its best logit holds the token's best expert outside the other top
    groups, so the top k always lie within the top ``k`` groups and ``topk_group >= top_k`` changes no routing (the
    probe could not tell; backfill would then prefer the token's groups, which the model's own order does not)."""
    if n_group <= 1:
        return [(1, 1)]
    unbound = scoring != Scoring.SIGMOID and topk_group >= top_k
    return [(1, 1), (n_group, topk_group)] if greedy or unbound else [(n_group, topk_group), (1, 1)]


_NO_RULE = ("match none of base_moe's routing rules (softmax then top-k, top-k then softmax, sigmoid with correction "
            "bias; with or without groups, renormalisation, scaling)")


def _infer_routing(layout: MoELayout, where: str) -> Routing:
    candidates = _candidate_routings(layout)
    weight = layout.router_weight
    if weight.device.type == "meta":
        return _stand_in_routing(layout, candidates, where)
    generator = torch.Generator().manual_seed(0)
    # 512 tokens: a rule that differs from a candidate on ~5% of tokens (an undeclared group limit) went unseen by
    # 64 about once in 150 random blocks; the router alone is cheap to run on them
    probe = torch.randn(512, layout.hidden_size, generator=generator, device="cpu").to(weight.device, layout.dtype)
    with torch.no_grad():
        logits, weights, ids = _router_choices(layout, probe, where)
        _check_router_logits(layout, probe, logits, where)
    routing = _first_match(candidates, logits, weights, ids, layout.correction_bias())
    if routing is None:
        raise MoELayoutError(f"{where}: its router's top-k weights {_NO_RULE}.")
    return routing


def _first_match(candidates: list[Routing], logits, weights, ids, bias) -> Routing | None:
    """The first of ``candidates`` that reproduces a router's choices (``ids``, ``weights``) from its ``logits``
    and selection ``bias``; None if none does."""
    # weights the router computes in fp32 are matched to fp32 rounding, others to a half type's
    exact = weights.dtype == torch.float32 and logits.dtype == torch.float32
    logits, weights, ids = logits.float(), weights.float(), ids.long()
    for routing in candidates:
        if _matches(logits, weights, ids, routing, bias if _takes_selection_bias(routing) else None, exact):
            return routing
    return None


def _stand_in_routing(layout: MoELayout, candidates: list[Routing], where: str) -> Routing:
    """The routing rule of a router on the meta device, whose weights hold no values to probe: the rule lies in its
    code and attributes, so a stand-in of the router (and of the block, whose ``route_tokens_to_experts`` may route
    its logits) with random weights and selection bias on the CPU, in the model's dtype (in which a router may rank:
    LFM2-MoE's bf16 sums), is probed instead. The attributes alone cannot tell every rule (Cohere2-MoE's
    ``expert_selection_fn="sigmoid"``, Jamba's unread ``norm_topk_prob``).
    Where a stand-in cannot be built or run, the attributes' guess (the first candidate), with a warning. An error,
    as on a real device, where the router's interface is one base_moe does not call (arguments, outputs) or where the
    stand-in runs and matches no rule (a parameter that is a constant in the model, made random here, could cause
    that: the message says to apply to the loaded model)."""
    generator = torch.Generator().manual_seed(0)
    try:
        router = _stand_in(layout.router, generator, layout.dtype)
        block = _block_stand_in(layout, router, generator, layout.dtype)
        bias = _correction_bias(router, block)
        if bias is not None:
            bias.mul_(0.1)  # of a trained bias's size: a unit one beside unit logits would hide a group limit
        # logits of about unit size, as a trained router's: random unit weights on unit hidden states would give
        # ~sqrt(H), whose saturated softmax could not tell a renormalisation
        probe = (torch.randn(512, layout.hidden_size, generator=generator, device="cpu") / layout.hidden_size**0.5).to(
            layout.dtype)
        with torch.no_grad():
            logits, weights, ids = _router_choices(layout, probe, where, router, block, bias)
    except MoELayoutError:  # an interface base_moe does not call (arguments, outputs): refused, as on a real device
        raise
    except Exception as error:  # noqa: BLE001 - a router or block the stand-in cannot copy or run: the guess
        warnings.warn(
            f"{where}: on the meta device, and a CPU copy of its router with random weights could not run "
            f"({type(error).__name__}: {error}); its routing is taken from its attributes, unverified: "
            f"{candidates[0]}. Apply base_moe to the loaded model to have it verified."
        )
        return candidates[0]
    routing = _first_match(candidates, logits, weights, ids, None if bias is None else bias.reshape(-1))
    if routing is None:
        raise MoELayoutError(
            f"{where}: on the meta device, the top-k weights of a CPU copy of its router with random weights "
            f"{_NO_RULE}. If the router holds a constant that random values change, apply base_moe to the loaded "
            "model."
        )
    return routing


def _block_stand_in(layout: MoELayout, router: nn.Module, generator: torch.Generator, dtype: torch.dtype) -> nn.Module:
    """A shallow copy of the block (hooks dropped) whose own floating-point parameters and buffers are random CPU
    tensors in ``dtype`` and whose router is ``router``; its other submodules (the experts) are the block's own,
    unused."""
    block = _without_hooks(layout.block)
    block._parameters, block._buffers = _random_tensors(layout.block, generator, dtype)
    block._modules = dict(layout.block._modules)
    block._modules[layout.router_name] = router  # (router_name names a child: found among named_children)
    return block


def _probe_router_stand_in(layout: MoELayout) -> None:
    """Reads, from a bf16 stand-in of the router with random weights on the CPU (so that neither the model's device,
    its dtype nor its weights change the answers: a model on the meta device, an fp32 model later converted, a router
    still all zero):
    - router_takes_sequences: the forward fails on ``[N, H]`` hidden states and runs on ``[1, N, H]`` ones (AFMoE);
    - router_rounds_logits: its logits come out rounded to its weight's dtype, in that dtype or computed in it and
      returned wider (Granite-MoE's ``.float()``);
    - router_returns_model_dtype: they come out in that dtype (the choice scores after them too: LFM2-MoE).
    Where the stand-in cannot be built or returns no logits tensor on either shape, both rounding flags are True (a
    linear layer's rule, most routers'; the routing probe on the real router then says what fails, if anything)."""
    generator = torch.Generator().manual_seed(0)
    probe = torch.randn(8, layout.hidden_size, generator=generator, device="cpu").to(torch.bfloat16)
    layout.router_rounds_logits = layout.router_returns_model_dtype = True
    layout.router_takes_sequences, logits = False, None
    try:
        router = _stand_in(layout.router, generator, torch.bfloat16)
        bias = _correction_bias(layout.router, layout.block)  # (a block's: the stand-in must not meet the real one)
        bias = None if bias is None else _random_like(bias, generator, torch.bfloat16)
    except Exception:  # noqa: BLE001 - a router the stand-in cannot copy: the fallback above
        return
    with torch.no_grad():
        for sequences in (False, True):
            layout.router_takes_sequences = sequences
            try:
                logits = _logits_of(_router_forward(layout, probe, None, router, bias))
            except Exception:  # noqa: BLE001 - a router that fails on this shape: try the next
                continue
            if isinstance(logits, torch.Tensor):
                break
    if not isinstance(logits, torch.Tensor):
        layout.router_takes_sequences = False
        return
    layout.router_returns_model_dtype = logits.dtype == torch.bfloat16
    # logits the router computes in fp32 from random weights are almost never all bf16 values (8 x E of them)
    rounded = bool((logits.float() == logits.to(torch.bfloat16).float()).all())
    layout.router_rounds_logits = layout.router_returns_model_dtype or rounded


def _stand_in(module: nn.Module, generator: torch.Generator, dtype: torch.dtype,
              view_above: int | None = None) -> nn.Module:
    """A shallow copy of ``module`` and its submodules on the CPU (hooks dropped: _without_hooks) whose
    floating-point parameters and buffers are random tensors of their shapes in ``dtype`` (_random_like; views for
    those of more than ``view_above`` elements). Other attributes are shared with ``module``, but for its containers
    (_without_hooks)."""
    stand_in = _without_hooks(module)
    stand_in._parameters, stand_in._buffers = _random_tensors(module, generator, dtype, view_above)
    stand_in._modules = {name: None if m is None else _stand_in(m, generator, dtype, view_above)
                         for name, m in module._modules.items()}
    return stand_in


def _without_hooks(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` without hooks or an instance-level forward (an offload hook would move its
    tensors), whose own lists, dicts and sets are copies (a forward that records into one, such as a count of routed
    tokens, records the probe's into the stand-in's)."""
    copied = copy.copy(module)
    copied.__dict__.pop("forward", None)
    for name, value in vars(module).items():
        if not name.startswith("_") and isinstance(value, (list, dict, set)):
            setattr(copied, name, copy.copy(value))
    for hooks in ("_forward_pre_hooks", "_forward_hooks", "_forward_pre_hooks_with_kwargs",
                  "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_backward_pre_hooks",
                  "_backward_hooks"):
        setattr(copied, hooks, OrderedDict())
    return copied


def _random_tensors(module: nn.Module, generator: torch.Generator, dtype: torch.dtype,
                    view_above: int | None = None) -> tuple[dict, dict]:
    """``module``'s own parameters and buffers (not its submodules') as random stand-ins (_random_like)."""
    parameters = {name: None if p is None else nn.Parameter(_random_like(p, generator, dtype, view_above),
                                                            requires_grad=False)
                  for name, p in module._parameters.items()}
    buffers = {name: None if b is None else _random_like(b, generator, dtype, view_above)
               for name, b in module._buffers.items()}
    return parameters, buffers


def _random_like(t: torch.Tensor, generator: torch.Generator, dtype: torch.dtype,
                 view_above: int | None = None) -> torch.Tensor:
    """A CPU tensor of ``t``'s shape: random values in ``dtype`` where ``t`` is floating point (as ``module.to(dtype)``
    leaves it), else a copy of ``t`` (an integer buffer's values may matter; zeros for one on the meta device).
    Where ``t`` is a bank of matrices ``[E, ...]`` (an experts module's weights) of more than ``view_above`` elements,
    a view whose matrix ``e`` starts ``e`` elements into one random matrix's storage: distinct, contiguous matrices
    (the matmuls' fast path) in the memory of one."""
    if not t.is_floating_point():
        return torch.zeros(t.shape, dtype=t.dtype, device="cpu") if t.is_meta else t.detach().to("cpu")
    if view_above is not None and t.dim() >= 3 and t.numel() > view_above:
        matrix = t[0].numel()
        storage = torch.randn(matrix + t.shape[0] - 1, generator=generator, device="cpu").to(dtype)
        return storage.as_strided(t.shape, (1, *torch.empty(t.shape[1:], device="meta").stride()))
    return torch.randn(t.shape, generator=generator, device="cpu").to(dtype)


# banks of expert matrices in a block's stand-in (_stand_in_returns_tuple) stored as overlapping views above this size
# (16 MB in fp32): Qwen3-30B-A3B's gate_up_proj alone would be 1.6 GB of random values per block
_VIEW_ABOVE_NUMEL = 1 << 22


def _check_router_logits(layout: MoELayout, probe: torch.Tensor, logits: torch.Tensor, where: str) -> None:
    """The budgeted path computes the logits as ``probe @ weight.T + bias`` (router_predict): a router whose forward
    computes anything else (a temperature, an offset, a bias it does not add) is refused, not silently replaced."""
    expected, _ = reference.router_predict(probe, layout.router_weight, layout.router_bias)
    scale = float(expected.abs().max())
    # of the largest logit: fp32 GEMMs may run in TF32 (~1e-3 of it; ours here too), half types round to ~4e-3
    tolerance = 5e-3 if logits.dtype == torch.float32 else 2e-2
    difference = float((logits.float() - expected).abs().max())
    if difference > tolerance * max(scale, 1e-6):
        raise MoELayoutError(
            f"{where}: its router '{layout.router_name}' computes logits other than hidden @ weight.T + bias (largest "
            f"difference {difference:.3g} at logits up to {scale:.3g}), which base_moe's ops compute in its place."
        )


def _matches(logits, weights, ids, routing: Routing, bias, exact: bool) -> bool:
    if ids.shape[1] != routing.top_k:
        return False
    try:
        ref_ids, ref_weights = reference.route(logits, routing, bias)
    except Exception:  # noqa: BLE001 - e.g. an impossible group split: not this rule
        return False
    # tokens whose k-th and (k+1)-th choices (nearly) tie may legitimately differ: leave them out
    choice = reference.choice_scores(logits, routing, bias)
    if ids.shape[1] < logits.shape[1]:
        top = torch.sort(choice, dim=-1, descending=True).values
        gap = top[:, routing.top_k - 1] - top[:, routing.top_k]
        clear = gap > 1e-3 * top[:, 0].abs().clamp_min(1.0)
    else:
        clear = torch.ones(logits.shape[0], dtype=torch.bool)
    if not bool(clear.any()):
        return True  # degenerate router (e.g. all-zero weights): cannot tell, accept the attributes' rule
    ids_sorted, order = torch.sort(ids, dim=-1)
    ref_sorted, ref_order = torch.sort(ref_ids.long(), dim=-1)
    if not torch.equal(ids_sorted[clear], ref_sorted[clear]):
        return False
    w = torch.gather(weights, 1, order)[clear]
    ref_w = torch.gather(ref_weights, 1, ref_order)[clear]
    rtol, atol, ratio_tolerance = (1e-4, 1e-6, 1e-4) if exact else (2e-2, 1e-3, 5e-3)
    if not torch.allclose(w, ref_w, rtol=rtol, atol=atol * max(1.0, routing.scaling)):
        return False
    # The element tolerance admits a bf16 router's rounding (up to ~0.4% a weight), and with it any scale within 2% of
    # the rule's. Over the probe's tokens the rounding errors average out: the totals' ratio tells such a scale.
    # (The tiny test models of every family in bf16 and fp16 give ratios within 5e-4 of 1 for their rules.)
    total = float(ref_w.sum())
    return total == 0.0 or abs(float(w.sum()) / total - 1.0) < ratio_tolerance


def _router_forward(layout: MoELayout, x: torch.Tensor, where: str | None = None, router: nn.Module | None = None,
                    bias: torch.Tensor | None = None):
    """The router's own (unpatched) forward on ``x [N, H]`` (of ``router``, a copy of it, where given), given the
    block's correction bias (``bias``, a stand-in of it, where given) where the forward takes it as an argument,
    required (``gate(hidden_states, self.e_score_correction_bias)``: MiniMax-M2, HY-V3) or defaulting to None (LFM2's
    ``expert_bias=None``, which its block passes). A router that takes ``[B, S, H]`` (MoELayout.router_takes_sequences)
    gets ``[1, N, H]``, and its ``[1, N, X]`` outputs come back as ``[N, X]``."""
    if not layout.router_takes_sequences:
        return _call_router(layout, x, where, router, bias)
    out = _call_router(layout, x.unsqueeze(0), where, router, bias)
    flat = [t.squeeze(0) if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == 1 else t
            for t in (out if isinstance(out, tuple) else (out,))]
    return tuple(flat) if isinstance(out, tuple) else flat[0]


def _call_router(layout: MoELayout, x: torch.Tensor, where: str | None, router: nn.Module | None,
                 bias: torch.Tensor | None):
    forward, router = layout.router_class.forward, layout.router if router is None else router
    extra = [p for p in list(inspect.signature(forward).parameters.values())[2:]  # self, hidden_states
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    required = [p for p in extra if p.default is inspect.Parameter.empty]
    bias = _correction_bias(router, layout.block) if bias is None else bias
    first = extra[0] if extra else None
    takes_bias = [first] if first is not None and "bias" in first.name and (
        first.default is inspect.Parameter.empty or first.default is None) else []
    if bias is None or not takes_bias:
        if not required:
            return forward(router, x)
    elif required in ([], takes_bias):
        if takes_bias[0].kind is inspect.Parameter.KEYWORD_ONLY:
            return forward(router, x, **{takes_bias[0].name: bias})
        return forward(router, x, bias)
    raise MoELayoutError(
        f"{where or layout.name}: its router '{layout.router_name}' takes arguments base_moe does not know "
        f"({', '.join(p.name for p in required)})."
    )


def _router_choices(layout: MoELayout, x: torch.Tensor, where: str | None = None, router: nn.Module | None = None,
                    block: nn.Module | None = None, bias: torch.Tensor | None = None):
    """The router's own choices on ``x [N, H]``: ``(logits, top_k_weights, top_k_index)``, from its output or, where
    it returns logits only, from the block's ``route_tokens_to_experts`` (of ``router``, ``block`` and ``bias``,
    stand-ins of them, where given: _router_forward)."""
    out = _router_forward(layout, x, where, router, bias)
    route = getattr(layout.block if block is None else block, "route_tokens_to_experts", None)
    if isinstance(out, tuple) and len(out) >= 3:  # (logits, top_k_weights, top_k_index)
        return out[0], out[1], out[2]
    if isinstance(out, torch.Tensor) and callable(route):  # logits; the block routes them
        first, second = route(out)
        ids, weights = (first, second) if not first.is_floating_point() else (second, first)
        return out, weights, ids
    raise MoELayoutError(
        f"{where or layout.name}: its router '{layout.router_name}' returns neither (logits, top_k_weights, "
        "top_k_index) nor logits that the block routes with route_tokens_to_experts (the transformers 5.x shapes)."
    )


# blocks whose probe run passed -> whether they return a tuple: apply() detects the layouts more than once (its own
# pass, the predictors' checks), and each probe runs the block's experts twice, which an offloaded model pays in loads
_VERIFIED_BLOCKS: weakref.WeakKeyDictionary[nn.Module, bool] = weakref.WeakKeyDictionary()


def _returns_tuple(layout: MoELayout, where: str, stand_in_checks: dict) -> bool:
    """Whether the block's forward returns ``(hidden, router_scores)``. Run once, in eval mode, on a few probe
    tokens, and verified: the block's output must be what base_moe computes from the router's own choices (its
    routed experts, weighted, plus its shared experts), so that a block that combines them otherwise (Cohere2-MoE's
    ``(routed + shared) / 2``) is refused rather than computed wrongly. A block on the meta device is run as a CPU
    stand-in with random fp32 weights (_stand_in_returns_tuple), once per structure in a model (a decoder's blocks
    are alike: DeepSeek-V3's 58 would take ~50 s), and not kept with the block, whose weights may be loaded later."""
    block = layout.block
    if layout.router_weight.device.type == "meta":
        key = _structure_key(block)
        if key not in stand_in_checks:
            stand_in_checks[key] = _stand_in_returns_tuple(layout, where)
        return stand_in_checks[key]
    if block not in _VERIFIED_BLOCKS:
        _VERIFIED_BLOCKS[block] = _checked_output_is_tuple(layout, where)
    return _VERIFIED_BLOCKS[block]


def _structure_key(block: nn.Module) -> tuple:
    """What a block's stand-in check depends on: its modules' names and classes, their attributes (numbers, strings
    and tuples of them by value, other objects, such as the model's config, by identity; not an instance-level
    ``forward``, an offload hook's, which the stand-in drops) and their tensors' names, shapes and dtypes. Two blocks
    with one key run the same code on the same shapes."""
    def value(v):
        plain = (int, float, str, bool, type(None))
        if isinstance(v, plain) or isinstance(v, tuple) and all(isinstance(x, plain) for x in v):
            return v
        return ("id", id(v))

    return tuple(
        (name, type(module), tuple(sorted((k, value(v)) for k, v in vars(module).items()
                                          if not k.startswith("_") and k != "forward")),
         tuple((n, tuple(t.shape), t.dtype) for n, t in [*module._parameters.items(), *module._buffers.items()]
               if t is not None))
        for name, module in block.named_modules()
    )


def _stand_in_returns_tuple(layout: MoELayout, where: str) -> bool:
    """_checked_output_is_tuple on a CPU stand-in of the whole block (router, experts, shared experts) with random
    fp32 weights, the experts' as overlapping views of one matrix (a bank of experts would take gigabytes): a block on
    the meta device whose output is a tuple (GPT-OSS) or that combines its experts otherwise (Cohere2-MoE's average)
    is told as on a real device. Where the stand-in cannot run (an experts implementation without a CPU path), the
    guess that it returns a tensor, with a warning."""
    generator = torch.Generator().manual_seed(1)
    try:
        stand_in = replace(layout, block=_stand_in(layout.block, generator, torch.float32, _VIEW_ABOVE_NUMEL))
        _run_experts_eagerly(stand_in.experts)
        return _checked_output_is_tuple(stand_in, f"{where} (on the meta device, checked on a CPU copy of the block "
                                                  "with random weights: apply base_moe to the loaded model if the "
                                                  "block holds a constant that random values change)")
    except MoELayoutError:
        raise
    except Exception as error:  # noqa: BLE001 - a block the stand-in cannot copy or run: the guess
        warnings.warn(
            f"{where}: on the meta device, and a CPU copy of the block with random weights could not "
            f"run ({type(error).__name__}: {error}); base_moe takes it to return its output as one tensor, the sum "
            "of its routed and shared experts, unverified. Apply base_moe to the loaded model to have it verified."
        )
        return False


def _run_experts_eagerly(experts: nn.Module) -> None:
    """Has a stand-in's experts module (a transformers experts class, which dispatches on its config's
    ``_experts_implementation``) loop over the chosen experts: ``batched_mm`` gathers a copy of an expert's matrices
    per token slot (1.6 GB each for Jamba-1.5-Large's), and the stand-in's config is a copy, the model's untouched."""
    config = getattr(experts, "config", None)
    if getattr(config, "_experts_implementation", "eager") != "eager":
        experts.config = copy.copy(config)
        experts.config._experts_implementation = "eager"


def _checked_output_is_tuple(layout: MoELayout, where: str) -> bool:
    """Runs the block on probe tokens and checks its output against its router's choices (_returns_tuple); whether
    that output is a tuple."""
    block, weight = layout.block, layout.router_weight
    generator = torch.Generator().manual_seed(1)
    # two tokens: each expert they choose multiplies a whole matrix pair on the CPU (a stand-in's, fp32)
    probe = torch.randn(1, 2, layout.hidden_size, generator=generator, device="cpu").to(weight.device, layout.dtype)
    forward = getattr(type(block), "_base_moe_original_class", type(block)).forward
    modes = [(module, module.training) for module in block.modules()]
    try:
        block.eval()  # no dropout or router jitter in the comparison
        with torch.no_grad():
            out = forward(block, probe)
            hidden = _logits_of(out)
            x = probe.reshape(-1, layout.hidden_size)
            _, weights, ids = _router_choices(layout, x, where)
            expected = layout.plus_shared(x, layout.routed_experts(x, ids.long(), weights))
    finally:
        for module, training in modes:
            module.training = training
    got, want = hidden.reshape(-1, layout.hidden_size).float(), expected.float()
    tolerance = 1e-5 if layout.dtype == torch.float32 else 2e-2
    difference = float((got - want).norm())
    if not difference <= tolerance * float(want.norm()) + 1e-6:  # (a NaN is a mismatch)
        relative = difference / max(float(want.norm()), 1e-30)
        raise MoELayoutError(
            f"{where}: its output is not the weighted sum of its routed experts plus its shared "
            f"experts (relative difference {relative:.3g} on a probe); "
            "base_moe does not understand how this block combines them."
        )
    return isinstance(out, tuple)
