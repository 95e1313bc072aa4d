"""Expert-selection policies for budgeted decoding: BASE and the baselines it is judged against (DESIGN section 5).

A policy turns one decode step of one MoE layer (:class:`DecodeStep`: the tokens, their router logits, the
model's routing rule, the budget, the fill rule) into each token's final experts and weights
(:class:`Selection`). Most policies differ only in the per-slot cost that ranks experts for the keep set A; they
are :class:`CostPolicy` instances and run the fused ``route_select`` op. A policy that chooses A some other way
(OEA, Lynx, per-token top-k reduction: issue 6) subclasses :class:`Policy`, implements :meth:`Policy.select`
and calls :func:`register_policy` (or is passed as an instance: ``apply(model, policy=MyPolicy(k0=2))``);
nothing else in base_moe needs to change.

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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from . import ops, reference
from .routing import Cost, Fill, Routing

if TYPE_CHECKING:
    from .layouts import MoELayout

__all__ = [
    "CostPolicy",
    "DecodeStep",
    "Policy",
    "Selection",
    "available_policies",
    "get_policy",
    "parse_fill",
    "register_policy",
]

FILLS = {"backfill": Fill.BACKFILL, "drop": Fill.DROP, "drop_renorm": Fill.DROP_RENORM}


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

    def select(self, step: DecodeStep) -> Selection:  # pragma: no cover - interface
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
    if not policy.name:
        raise ValueError("a policy needs a name")
    if policy.name in _REGISTRY and not replace:
        raise ValueError(f"policy '{policy.name}' is already registered (pass replace=True to override it)")
    _REGISTRY[policy.name] = policy
    return policy


def get_policy(policy: str | Policy) -> Policy:
    """The registered policy of that name (a :class:`Policy` instance is returned as is)."""
    if isinstance(policy, Policy):
        return policy
    try:
        return _REGISTRY[policy]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown policy {policy!r}; available: {', '.join(available_policies())} "
            "(or register your own with base_moe.policies.register_policy)"
        ) from None


def available_policies() -> list[str]:
    return list(_REGISTRY)


def parse_fill(fill: str | Fill) -> Fill:
    """``'backfill'``, ``'drop'`` or ``'drop_renorm'`` (or a :class:`Fill`) as a :class:`Fill`."""
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


_CUDA_KERNELS = {op: _has_cuda_kernel(op) for op in ("router_predict", "route_cost", "route_select", "experts")}


def has_kernel(op: str, device: torch.device) -> bool:
    """Whether ``base_moe::op`` runs natively on ``device`` (CPU always; CUDA when built with kernels)."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and _CUDA_KERNELS.get(op, False)


def route_select(step: DecodeStep, cost: Cost, log_norms: torch.Tensor | None):
    """``ops.route_select`` for the step: ``(ids, weights, kept, counts, batch_cost)``."""
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
        )
    return reference.route_select(
        step.logits, log_norms, step.correction_bias, step.num_groups, step.routing, cost, step.budget, step.fill
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
