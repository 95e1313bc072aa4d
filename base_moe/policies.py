"""Expert-selection policies for budgeted decoding: BASE and the baselines it is judged against.

A policy turns one decode step of one MoE layer (:class:`DecodeStep`: the tokens, their router logits, the
model's routing rule, the budget, the fill rule) into each token's final experts and weights
(:class:`Selection`). Most policies differ only in the per-slot cost that ranks experts for the keep set A; they
are :class:`CostPolicy` instances and run the fused ``route_select`` op. A policy that chooses A some other way
(OEA, Lynx, per-token top-k reduction) subclasses :class:`Policy`, implements :meth:`Policy.select`
(and :meth:`Policy.check_layout` where an option must fit the model, e.g. its top-k) and calls
:func:`register_policy` (or is passed as an instance: ``apply(model, policy=MyPolicy(k0=2))``); nothing else in
base_moe needs to change.

| name | keep set A (top-M by the batch sum of) |
| --- | --- |
| ``dense`` | no budget: the model's own routing |
| ``base`` | w^2 exp(2 g), g the calibrated linear prediction of log ||E_u(z)|| |
| ``oracle`` | w^2 ||E_u(z)||^2, the true norms (runs every expert: evaluation only) |
| ``static_energy`` | w^2 exp(2 mean log-norm_u) (calibration statistics) |
| ``router_sum`` | w |
| ``router_sq`` | w^2 |
| ``frequency`` | 1 per routed token |
| ``top1_union`` | every token's top-1 first, then w |

Policies that choose A another way (plain PyTorch over :mod:`base_moe.reference`'s routing helpers):

| name | rule |
| --- | --- |
| ``oea`` (``oea:k0=K``) | OEA(k0): A = union of every token's top-k0 (no budget); each token then takes its top-k within A |
| ``lynx`` (``lynx:threshold=X``) | Lynx-style confidence bins: a routed slot scores ``decay^bin``, ``bin = floor(log(w_top1 / w) / width)``
  (at most ``bins - 1``); A = top-M by the batch sum, or every expert whose sum reaches ``threshold`` (no budget) |
| ``topk_reduce`` (``topk_reduce:k=K``) | every token keeps its top-k' of k (default max(1, k // 2)), rescaled to its
  routed total (not batch-aware) |

Fill rules (:func:`parse_fill`): ``backfill``, ``drop`` and ``drop_renorm`` are the ops' (:class:`Fill`);
``substitute`` (SERE-like) runs the policy with ``drop`` and then moves each dropped slot, with its
weight, to the kept expert most similar to the dropped one (:func:`substitute_dropped`; predictors calibrated with
``similarity=True``).

Where ``DecodeStep.voting`` is given (``apply``'s ``finished_tokens``), only its tokens choose the kept set: the
cost policies pass it to ``route_select`` (their slot costs are summed over the voting tokens alone, and only the
experts those route to are candidates), OEA seeds A from them and Lynx counts them; every token is then filled from
the kept set as before.

A name with options (``"oea:k0=2"``, ``"lynx:threshold=4:bins=3"``) builds an instance through the policy's factory
(:func:`register_policy_factory`); ``apply``, ``configure`` and the ``eval`` command accept such names.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch

from . import ops, reference
from .routing import Cost, Fill, Routing, exact_int

if TYPE_CHECKING:
    from .layouts import MoELayout

__all__ = [
    "CostPolicy",
    "DecodeStep",
    "Policy",
    "SUBSTITUTE",
    "Selection",
    "available_policies",
    "get_policy",
    "parse_fill",
    "register_policy",
    "register_policy_factory",
    "substitute_dropped",
    "OEAPolicy",
    "LynxPolicy",
    "TopKReducePolicy",
]

SUBSTITUTE = "substitute"
"""The SERE-like fill rule: not an op's :class:`Fill` (see :func:`substitute_dropped`)."""
FillRule = Fill | Literal["substitute"]
FILLS: dict[str, FillRule] = {
    "backfill": Fill.BACKFILL, "drop": Fill.DROP, "drop_renorm": Fill.DROP_RENORM, SUBSTITUTE: SUBSTITUTE
}


@dataclass
class DecodeStep:
    """One MoE layer's decode step, as a policy sees it. Tokens are stored group after group (``num_groups``
    independent decode batches of ``T / num_groups`` tokens each)."""

    hidden: torch.Tensor
    """``[T, H]`` the tokens' hidden states (the block's input dtype)."""
    logits: torch.Tensor
    """``[T, E]`` fp32 router logits."""
    predicted_log_norms: torch.Tensor | None
    """``[T, E]`` fp32 predictor output g (only when the policy sets ``needs_predictors``)."""
    routing: Routing
    correction_bias: torch.Tensor | None
    num_groups: int
    budget: int | None
    fill: Fill
    layout: MoELayout
    mean_log_norm: torch.Tensor | None = None
    """``[E]`` fp32 calibrated mean log-norm per expert (when the predictors carry it)."""
    voting: torch.Tensor | None = None
    """``[T]`` bool: the tokens whose costs choose the kept experts (None: every token). The others (a finished
    sequence's padding, see ``apply``'s ``finished_tokens``) add nothing to the batch sums and are still filled from
    the kept set."""


@dataclass
class Selection:
    """A policy's decision: each token's final experts ``ids [T, k]`` (int32, sentinel ``E`` = empty slot) and
    fp32 ``weights [T, k]``; ``kept [G, M]`` (sentinel-padded), ``counts [G, E]`` and the batch cost
    ``D [G, E]`` when the policy has them."""

    ids: torch.Tensor
    weights: torch.Tensor
    kept: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    batch_cost: torch.Tensor | None = None


class Policy:
    """Base class of every policy. Subclasses set the class attributes and implement :meth:`select`."""

    name: str = ""
    description: str = ""
    budgeted: bool = True
    """False only for ``dense``: the model's own block runs, the policy is never asked."""
    needs_budget: bool = True
    """False for a policy with its own size rule (OEA's k0, Lynx's threshold, top-k reduction): it runs on
    decode calls whatever the budget (``DecodeStep.budget`` may then be None)."""
    needs_predictors: bool = False
    """the router GEMV also computes the predictor's g (``DecodeStep.predicted_log_norms``)."""
    needs_statistics: bool = False
    """needs the calibrated per-expert mean log-norm (``DecodeStep.mean_log_norm``)."""
    takes_fill: bool = True
    """False for a policy whose tokens keep no batch-level set (per-token top-k reduction): the fill does not apply."""
    fused_cost: Cost | None = None
    """Set when the policy is ``route_select`` with this cost on the router's own outputs (the predicted or no
    log-norms): the decode path then runs stages 1-3 as one ``select_experts`` call."""

    @property
    def needs_calibration(self) -> bool:
        """Whether the policy runs only with calibrated predictors (their weights or their per-expert statistics)."""
        return self.needs_predictors or self.needs_statistics

    def check_layout(self, layout: MoELayout) -> None:
        """Raises ``ValueError`` when an option of the policy is out of range for this MoE layer's routing (e.g. more
        experts per token than the model routes); ``apply`` / ``configure`` ask it for every layer up front."""

    def select(self, step: DecodeStep) -> Selection:  # pragma: no cover - interface
        """The decode step's experts: every token's final ``ids`` and ``weights`` (see :class:`Selection`), at
        most ``step.budget`` distinct experts per group of ``T / step.num_groups`` tokens when the policy
        ``needs_budget``. Called once per MoE layer and decode call, possibly inside a CUDA graph capture: no
        host synchronisation, and output shapes that depend only on the input shapes and the budget. A batch-aware
        policy lets only ``step.voting``'s tokens choose the kept set, where it is given."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class DensePolicy(Policy):
    name = "dense"
    description = "no budget: the model's own routing, bit-compatible with the HF module"
    budgeted = False

    def select(self, step: DecodeStep) -> Selection:
        ids, weights, _ = route_cost(step, Cost.FREQUENCY, None)
        return Selection(ids, weights)


LogNorms = Literal["none", "predicted", "static", "oracle"]


class CostPolicy(Policy):
    """Keep the top-``budget`` routed experts by the batch sum of a per-slot cost, then fill (``route_select``).

    ``log_norms`` says where ``Cost.BASE`` takes log ||E_u(z)|| from: the predictor (``predicted``), the
    calibrated per-expert mean broadcast over the tokens (``static``) or the experts themselves (``oracle``)."""

    def __init__(self, name: str, cost: Cost, log_norms: LogNorms = "none", description: str = ""):
        self.name = name
        self.cost = cost
        self.log_norms = log_norms
        self.description = description
        self.needs_predictors = log_norms == "predicted"
        self.needs_statistics = log_norms == "static"
        self.fused_cost = cost if log_norms in ("none", "predicted") else None

    def batch_log_norms(self, step: DecodeStep) -> torch.Tensor | None:
        """The ``[T, E]`` fp32 log-norms ``Cost.BASE`` weighs the routing weights with (None for other costs)."""
        if self.log_norms == "predicted":
            return step.predicted_log_norms
        if self.log_norms == "static":
            return step.mean_log_norm.expand(step.logits.shape[0], -1)
        if self.log_norms == "oracle":
            return step.layout.expert_log_norms(step.hidden)
        return None

    def select(self, step: DecodeStep) -> Selection:
        return Selection(*route_select(step, self.cost, self.batch_log_norms(step)))


# ---------------------------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------------------------
_REGISTRY: dict[str, Policy] = {}


def register_policy(policy: Policy, *, replace: bool = False) -> Policy:
    """Make ``policy`` available by its name to ``base_moe.apply``/``configure``."""
    if not isinstance(policy, Policy):
        raise TypeError(f"register_policy takes a base_moe.policies.Policy, got {type(policy).__name__}")
    if not policy.name or ":" in policy.name:
        raise ValueError(f"a policy needs a name without ':' (which separates options), got {policy.name!r}")
    if policy.name in _REGISTRY and not replace:
        raise ValueError(f"policy '{policy.name}' is already registered (pass replace=True to override it)")
    _REGISTRY[policy.name] = policy
    return policy


def get_policy(policy: str | Policy) -> Policy:
    """The registered policy of that name (a :class:`Policy` instance is returned as is); a name with options,
    ``"oea:k0=2"``, builds one through the policy's factory (:func:`register_policy_factory`)."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str) and ":" in policy:
        return policy_from_spec(policy)
    try:
        return _REGISTRY[policy]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown policy {policy!r}; available: {', '.join(available_policies())} "
            "(or register your own with base_moe.policies.register_policy)"
        ) from None


def available_policies() -> list[str]:
    """The names :func:`get_policy` (and ``base_moe.apply(policy=...)``) takes, built-in and registered, in
    registration order; ``name:key=value`` forms of the registered factories (``oea``, ``lynx``,
    ``topk_reduce``) set their options."""
    return list(_REGISTRY)


_FACTORIES: dict[str, type] = {}


def register_policy_factory(name: str, factory) -> None:
    """Let ``"name:key=value:..."`` build a policy: ``factory(key=value, ...)`` must return a :class:`Policy`."""
    _FACTORIES[name] = factory


def _parse_value(text: str):
    if text.lower() in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def policy_from_spec(spec: str) -> Policy:
    """``"oea:k0=2"`` -> ``OEAPolicy(k0=2)``: a policy name, then ``:key=value`` options (ints, floats, ``none``)."""
    name, *options = spec.split(":")
    factory = _FACTORIES.get(name)
    if factory is None:
        raise ValueError(
            f"policy {spec!r}: only {', '.join(sorted(_FACTORIES))} take options (name:key=value); "
            f"available policies: {', '.join(available_policies())}"
        )
    kwargs = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key:
            raise ValueError(f"policy {spec!r}: options are written key=value, got {option!r}")
        if key in kwargs:
            raise ValueError(f"policy {spec!r}: option {key!r} given twice")
        kwargs[key] = _parse_value(value)
    try:
        return factory(**kwargs)
    except TypeError as err:
        raise ValueError(f"policy {spec!r}: {err} ({factory.__name__}: {factory.__init__.__doc__ or ''})") from None


def fill_name(fill: FillRule) -> str:
    """The name :func:`parse_fill` takes for a fill rule: ``Fill.DROP_RENORM`` -> ``'drop_renorm'``."""
    return fill if isinstance(fill, str) else fill.name.lower()


def parse_fill(fill: str | Fill) -> FillRule:
    """``'backfill'``, ``'drop'`` or ``'drop_renorm'`` (or a :class:`Fill`) as a :class:`Fill`; ``'substitute'``
    as :data:`SUBSTITUTE`."""
    if isinstance(fill, Fill):
        return fill
    try:
        return FILLS[fill]
    except (KeyError, TypeError):
        raise ValueError(f"unknown fill rule {fill!r}; available: {', '.join(FILLS)}") from None


register_policy(DensePolicy())
register_policy(CostPolicy("base", Cost.BASE, "predicted", "top-M by sum_t w^2 exp(2g), g predicted"))
register_policy(CostPolicy("oracle", Cost.BASE, "oracle", "top-M by sum_t w^2 ||E_u(z_t)||^2 (runs every expert)"))
register_policy(
    CostPolicy("static_energy", Cost.BASE, "static", "top-M by sum_t w^2 exp(2 mean log-norm_u) (calibrated)")
)
register_policy(CostPolicy("router_sum", Cost.ROUTER_SUM, description="top-M by sum_t w (XShare)"))
register_policy(CostPolicy("router_sq", Cost.ROUTER_SQ, description="top-M by sum_t w^2"))
register_policy(CostPolicy("frequency", Cost.FREQUENCY, description="top-M by the number of routed tokens"))
register_policy(CostPolicy("top1_union", Cost.TOP1_UNION, description="every token's top-1 first, then sum_t w"))


# ---------------------------------------------------------------------------------------------------------------
# Op dispatch: base_moe's kernels where they exist for the device, the plain-PyTorch reference elsewhere
# ---------------------------------------------------------------------------------------------------------------
def _has_cuda_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"base_moe::{op}", "CUDA")


_CUDA_KERNELS = {
    op: _has_cuda_kernel(op)
    for op in ("router_predict", "route_cost", "route_select", "select_fill", "select_experts", "experts", "rms_norm",
               "add_rms_norm")
}


def has_kernel(op: str, device: torch.device) -> bool:
    """Whether ``base_moe::op`` runs natively on ``device`` (CPU always; CUDA when built with kernels)."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and _CUDA_KERNELS.get(op, False)


def route_select(step: DecodeStep, cost: Cost, log_norms: torch.Tensor | None):
    """``ops.route_select`` for the step (only ``step.voting``'s tokens choose): ``(ids, weights, kept, counts,
    batch_cost)``."""
    if has_kernel("route_select", step.logits.device):
        return ops.route_select(
            step.logits,
            step.routing,
            budget=step.budget,
            num_groups=step.num_groups,
            cost=cost,
            fill=step.fill,
            log_norms=log_norms,
            correction_bias=step.correction_bias,
            voting=step.voting,
        )
    return reference.route_select(
        step.logits, log_norms, step.correction_bias, step.num_groups, step.routing, cost, step.budget, step.fill,
        step.voting,
    )


def route_cost(step: DecodeStep, cost: Cost, log_norms: torch.Tensor | None):
    """``ops.route_cost`` for the step: the model's own routing and the batch cost ``(ids, weights, D)``."""
    if has_kernel("route_cost", step.logits.device):
        return ops.route_cost(
            step.logits,
            step.routing,
            num_groups=step.num_groups,
            cost=cost,
            log_norms=log_norms,
            correction_bias=step.correction_bias,
        )
    return reference.route_cost(step.logits, log_norms, step.correction_bias, step.num_groups, step.routing, cost)


def select_fill(step: DecodeStep, batch_cost: torch.Tensor, budget: int):
    """``ops.select_fill`` for the step and a given batch cost ``D [G, E]`` (candidates: the experts ``step.voting``'s
    tokens route to): ``(ids, weights, kept, counts)``."""
    if has_kernel("select_fill", step.logits.device):
        return ops.select_fill(
            step.logits, batch_cost, step.routing, budget=budget, fill=step.fill, correction_bias=step.correction_bias,
            voting=step.voting,
        )
    return reference.select_fill(step.logits, batch_cost, step.correction_bias, step.routing, budget, step.fill,
                                 step.voting)


# ---------------------------------------------------------------------------------------------------------------
# Policies with their own keep rule (OEA, Lynx, top-k reduction): plain PyTorch over the reference's routing helpers
# ---------------------------------------------------------------------------------------------------------------
def substitute_dropped(step: DecodeStep, dropped: Selection, similarity: torch.Tensor) -> Selection:
    """The ``substitute`` fill (SERE-like) from ``dropped``, the policy's selection under ``drop``:
    each token's routed slot whose expert was not kept moves, with its routing weight, to the kept expert of its
    group most similar to the dropped one by ``similarity [E, E]`` (calibrated; ties to the lower index); slots that
    land on the same expert add their weights in the first of them; the token's experts come first, in slot order,
    then sentinels ``E``. The kept set is ``dropped.kept``, or where a policy gives none the experts of
    ``dropped.ids`` in the group, so no expert outside it runs. Plain PyTorch, no host synchronisation."""
    E, T, G = step.logits.shape[1], step.logits.shape[0], step.num_groups
    routed, weights = reference.route(step.logits, step.routing, step.correction_bias)
    routed = routed.long()
    kept = torch.zeros(G, E + 1, dtype=torch.bool, device=routed.device)
    kept.scatter_(1, (dropped.kept if dropped.kept is not None else dropped.ids.reshape(G, -1)).long(), True)
    kept = kept[:, :E].repeat_interleave(T // G, dim=0)  # [T, E]: the token's group's kept set
    closeness = similarity.to(routed.device)[routed].masked_fill(~kept[:, None, :], -math.inf)  # [T, k, E]
    target = torch.where(kept.gather(1, routed), routed, closeness.argmax(dim=-1))  # argmax: the first maximum
    target = torch.where(kept.any(dim=-1, keepdim=True), target, E)
    same = target[:, :, None] == target[:, None, :]  # [T, k, k]
    first = ~torch.tril(same, diagonal=-1).any(dim=-1)
    ids = torch.where(first & (target < E), target, E)
    merged = torch.where(ids < E, (same * weights[:, None, :]).sum(dim=-1), 0.0)
    order = torch.sort((ids == E).to(torch.int8), dim=1, stable=True).indices  # experts first, in slot order
    ids, merged = ids.gather(1, order).to(torch.int32), merged.gather(1, order)
    return Selection(ids, merged, dropped.kept, reference.expert_counts(ids, G, E), dropped.batch_cost)


def kept_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Boolean ``[G, E]`` -> ``kept [G, E]`` int32: the experts of the mask in ascending order, then sentinels ``E``."""
    E = mask.shape[1]
    index = torch.arange(E, device=mask.device).expand_as(mask)
    return torch.sort(torch.where(mask, index, E), dim=1).values.to(torch.int32)


def _fill_from_mask(step: DecodeStep, mask: torch.Tensor, batch_cost: torch.Tensor | None = None) -> Selection:
    kept = kept_from_mask(mask)
    ids, weights = reference.fill(step.logits, step.correction_bias, step.routing, kept, step.fill)
    counts = reference.expert_counts(ids, step.num_groups, step.logits.shape[1])
    return Selection(ids, weights, kept, counts, batch_cost)


def _check_int(name: str, value, low: int) -> int:
    number = exact_int(value)
    if number is None or number < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return number


def _number(value: float) -> str:
    """An option's value as text that parses back to it exactly (numpy scalars as plain numbers)."""
    return str(int(value)) if isinstance(value, int) else repr(float(value))


def _check_experts_per_token(policy: str, option: str, value: int, layout: MoELayout) -> None:
    if value > layout.routing.top_k:
        raise ValueError(
            f"policy '{policy}': {option}={value} is more experts per token than MoE block '{layout.name}' routes "
            f"(top-{layout.routing.top_k})"
        )


class OEAPolicy(Policy):
    """OEA(k0): A = the union of every token's top-``k0`` experts in its decode batch (no budget: |A| follows the
    batch); each token then takes its top-k experts within A in its own rank order (the ``backfill`` rule; the
    weights follow the model's rule, renormalised over the new set when the model renormalises). ``fill='drop'``
    keeps only the token's routed experts that are in A."""

    needs_budget = False

    def __init__(self, k0: int = 1):
        """k0: experts of each token that seed A (>= 1)."""
        self.k0 = _check_int("oea k0", k0, 1)
        self.name = "oea" if k0 == 1 else f"oea:k0={k0}"
        self.description = f"A = union of every token's top-{k0}; tokens re-routed within A (no budget)"

    def check_layout(self, layout: MoELayout) -> None:
        _check_experts_per_token(self.name, "k0", self.k0, layout)

    def select(self, step: DecodeStep) -> Selection:
        routing, E = step.routing, step.logits.shape[1]
        seeds, _ = reference.route(step.logits, replace(routing, top_k=min(self.k0, routing.top_k)), step.correction_bias)
        return _fill_from_mask(step, reference.routed_union(seeds, step.num_groups, E, step.voting))


class LynxPolicy(Policy):
    """Lynx-style confidence binning. Every routed slot ``(t, u)`` falls into the bin
    ``min(bins - 1, floor(log(w_t,top1 / w_t,u) / width))`` (bin 0: within a factor ``e^width`` of the token's
    top-1) and scores ``decay ** bin``; an expert's batch score is the sum over the tokens routed to it (a count of
    tokens, discounted by their confidence). A = the top-``budget`` experts by that score, or, with ``threshold``,
    every routed expert whose score reaches it (at least the best one; no budget). Then the fill rule."""

    def __init__(self, threshold: float | None = None, bins: int = 4, width: float = math.log(2.0), decay: float = 0.5):
        """threshold: keep experts whose score reaches it (None: keep the top-budget); bins, width (nats), decay."""
        self.bins = _check_int("lynx bins", bins, 1)
        if not width > 0 or not 0 < decay <= 1:
            raise ValueError(f"lynx needs width > 0 and 0 < decay <= 1, got width={width!r}, decay={decay!r}")
        if threshold is not None and (
            isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or not 0 < threshold < math.inf
        ):
            raise ValueError(f"lynx threshold must be a number > 0 (a discounted count of tokens) or None, "
                             f"got {threshold!r}")
        if threshold is not None:  # a plain int or float (numpy scalars too), so that the name parses back to it
            integer = exact_int(threshold)
            threshold = float(threshold) if integer is None else integer
        self.threshold, self.width, self.decay = threshold, float(width), float(decay)
        self.needs_budget = threshold is None
        # options as exact numbers: the name parses back to the same policy (and two policies never share a name)
        options = [f"threshold={_number(threshold)}"] if threshold is not None else []
        options += [f"bins={self.bins}"] if self.bins != 4 else []
        options += [f"width={_number(width)}"] if width != math.log(2.0) else []
        options += [f"decay={_number(decay)}"] if decay != 0.5 else []
        self.name = ":".join(["lynx", *options])
        threshold_text = "" if threshold is None else f", threshold {_number(threshold)}"
        self.description = "Lynx-style confidence bins" + threshold_text

    def batch_scores(self, step: DecodeStep) -> torch.Tensor:
        """``D [G, E]``: each expert's confidence-discounted count of routed tokens."""
        E = step.logits.shape[1]
        ids, weights = reference.route(step.logits, step.routing, step.correction_bias)
        valid = ids < E
        top = weights.amax(dim=-1, keepdim=True)
        ratio = torch.where(valid & (weights > 0), torch.log(top / weights), math.inf)  # inf: the last bin
        bins = torch.floor(ratio / self.width).clamp(max=self.bins - 1)
        score = torch.where(valid, torch.pow(self.decay, bins), 0.0).float()
        return reference.batch_cost(ids, score, step.num_groups, E, Cost.FREQUENCY, step.routing, step.voting)

    def select(self, step: DecodeStep) -> Selection:
        D = self.batch_scores(step)
        if self.threshold is None:
            return Selection(*select_fill(step, D, step.budget), D)
        mask = D >= self.threshold
        mask.scatter_(1, D.argmax(dim=1, keepdim=True), True)  # never empty
        return _fill_from_mask(step, mask & (D > 0), D)


class TopKReducePolicy(Policy):
    """Every token keeps its top-k' of its k routed experts (not batch-aware), the weights rescaled so they sum to
    the token's routed total (the ``drop_renorm`` rule: renormalised for models that renormalise; the ``fill``
    setting does not apply, as no kept set is imposed on the tokens)."""

    needs_budget = False
    takes_fill = False

    def __init__(self, k: int | None = None):
        """k: experts each token keeps (None: half the model's top-k, at least 1)."""
        self.k = None if k is None else _check_int("topk_reduce k", k, 1)
        self.name = "topk_reduce" if k is None else f"topk_reduce:k={k}"
        self.description = f"per-token top-{k if k is not None else 'k/2'} (not batch-aware), renormalised"

    def check_layout(self, layout: MoELayout) -> None:
        if self.k is not None:
            _check_experts_per_token(self.name, "k", self.k, layout)

    def select(self, step: DecodeStep) -> Selection:
        E, top_k = step.logits.shape[1], step.routing.top_k
        keep = min(self.k if self.k is not None else max(1, top_k // 2), top_k)
        ids, weights = reference.route(step.logits, step.routing, step.correction_bias)
        slot = torch.arange(top_k, device=ids.device) < keep
        kept_weights = torch.where(slot, weights, 0.0)
        total, kept_total = weights.sum(dim=-1, keepdim=True), kept_weights.sum(dim=-1, keepdim=True)
        kept_weights = reference.renormalised(kept_weights, total, kept_total)
        ids = torch.where(slot, ids, E).to(torch.int32)
        return Selection(ids, kept_weights, None, reference.expert_counts(ids, step.num_groups, E))


register_policy(OEAPolicy())
register_policy(LynxPolicy())
register_policy(TopKReducePolicy())
register_policy_factory("oea", OEAPolicy)
register_policy_factory("lynx", LynxPolicy)
register_policy_factory("topk_reduce", TopKReducePolicy)
