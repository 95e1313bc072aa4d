"""Typed wrappers of ``torch.ops.base_moe.*`` and their fake (meta) implementations for torch.compile.

Nothing else lives here: each wrapper only turns the Python-side description (:class:`Routing`, the
enums, or the enums' lowercase names) into the op's schema arguments. See ``base_moe/reference.py`` for what each op
computes. The ops are not differentiable: their outputs carry no autograd history (decode-time inference).
"""

from __future__ import annotations

import torch

from .routing import MAX_TOP_K, Cost, Fill, Routing, exact_int

_ops = torch.ops.base_moe


def _enum_arg(name: str, cls: type, value) -> int:
    """``value`` as the op's int: a member of ``cls`` or an int (the op checks its range), or the member's lowercase
    name (``fill="drop"``, as ``apply`` takes it)."""
    if isinstance(value, str):
        number = int(cls[value.upper()]) if value.upper() in cls.__members__ else None
    else:
        number = exact_int(value)  # (bools refused: True would read as 1)
    if number is None:
        choices = ", ".join(member.name.lower() for member in cls)
        got = repr(value) if isinstance(value, str) else type(value).__name__
        raise ValueError(f"{name} must be a base_moe.{cls.__name__} or one of {choices}, got {got}")
    return number


def _flag(name: str, value) -> bool:
    """A bool argument of an op: a Python bool (not 0 / 1 or a tensor, which the schema's bool would take as truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _routing_args(routing: Routing) -> tuple:
    if not isinstance(routing, Routing):
        raise TypeError(f"routing must be a base_moe.Routing, got {type(routing).__name__}")
    return routing.op_args()


def router_predict(
    hidden: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None = None,
    predictor_weight: torch.Tensor | None = None,
    predictor_bias: torch.Tensor | None = None,
    *,
    round_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1: router logits ``[T, E]`` and predicted log-norms ``[T, E]`` (``[T, 0]`` without a
    predictor), fp32, from hidden states ``[T, H]``; reads each weight matrix once. ``round_logits``: each logit (with
    its bias) rounded once to ``hidden``'s dtype, as a linear layer in that dtype returns it (the routers of Qwen3-MoE,
    OLMoE, Mixtral and GPT-OSS rank such logits; DeepSeek-V3's computes them in fp32); else the fp32 sum.

    On CUDA the kernel starts reading the weights while the previous kernel on the stream finishes (programmatic
    dependent launch), as ``select_experts`` says: they must not be written by the kernel just before this call."""
    return _ops.router_predict(hidden, router_weight, router_bias, predictor_weight, predictor_bias,
                               _flag("round_logits", round_logits))


def route_cost(
    logits: torch.Tensor,
    routing: Routing,
    *,
    num_groups: int = 1,
    cost: Cost | str = Cost.BASE,
    log_norms: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
    voting: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 2: the model's routing ``(ids [T, k] int32, weights [T, k] fp32)`` and the per-group expert
    cost ``D [G, E]``. ``log_norms`` may broadcast its rows (``expand``) for static per-expert values.

    ``voting [T]`` bool (None: every token): only these tokens' slots add to D, and ``Cost.TOP1_UNION``'s offset counts
    them, so D is bit for bit that of the voting tokens alone (a finished sequence's pad tokens do not vote); the
    routing is every token's.

    ``logits``, ``correction_bias`` and (for ``Cost.BASE``) ``log_norms`` must be finite (checked on CPU; on CUDA,
    where a check would synchronise, a NaN ranks arbitrarily)."""
    return _ops.route_cost(logits, log_norms, correction_bias, num_groups, *_routing_args(routing),
                           _enum_arg("cost", Cost, cost), voting)


def select_fill(
    logits: torch.Tensor,
    batch_cost: torch.Tensor,
    routing: Routing,
    *,
    budget: int,
    fill: Fill | str = Fill.BACKFILL,
    correction_bias: torch.Tensor | None = None,
    voting: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 3: keep the ``budget`` routed experts of largest cost per group and fill every token's slots:
    ``(ids [T, k], weights [T, k], kept [G, min(budget, E)], counts [G, E])``; sentinel id ``E``. With ``voting [T]``
    bool only the experts its tokens route to are candidates (a group without a voting token keeps none); every token
    is filled from the kept set.

    ``batch_cost [G, E]`` ranks as ``torch.sort(descending=True)`` ranks it: a NaN before every number, equal values
    (NaNs among them) to the lower expert index.

    For softmax routing with renormalisation the CUDA kernels compute the weights as the softmax of the final slots'
    logits, the same function as the reference's softmax over the row renormalised over the slots: the two agree up
    to rounding, except where backfill leaves a token only slots ~87 or more below its top logit. There the
    reference's and the CPU op's fp32 probabilities underflow (weights 0 or a few subnormal bits) and the CUDA
    weights stay exact."""
    return _ops.select_fill(logits, batch_cost, correction_bias, *_routing_args(routing), budget,
                            _enum_arg("fill", Fill, fill), voting)


def route_select(
    logits: torch.Tensor,
    routing: Routing,
    *,
    budget: int,
    num_groups: int = 1,
    cost: Cost | str = Cost.BASE,
    fill: Fill | str = Fill.BACKFILL,
    log_norms: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
    voting: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 2 and 3 in one call: ``(ids, weights, kept, counts, batch_cost)``; the weights as select_fill's,
    ``voting`` as route_cost's and select_fill's: for the same logits, a group's voting tokens get bit for bit the
    experts, weights, kept set and D they get as a group of their own."""
    return _ops.route_select(
        logits, log_norms, correction_bias, num_groups, *_routing_args(routing), _enum_arg("cost", Cost, cost),
        budget, _enum_arg("fill", Fill, fill), voting,
    )


def select_experts(
    hidden: torch.Tensor,
    router_weight: torch.Tensor,
    routing: Routing,
    *,
    budget: int,
    num_groups: int = 1,
    cost: Cost | str = Cost.BASE,
    fill: Fill | str = Fill.BACKFILL,
    router_bias: torch.Tensor | None = None,
    predictor_weight: torch.Tensor | None = None,
    predictor_bias: torch.Tensor | None = None,
    correction_bias: torch.Tensor | None = None,
    voting: torch.Tensor | None = None,
    round_logits: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Stages 1-3 in one call: ``router_predict`` (with ``round_logits``) then ``route_select`` (with ``voting``) on
    its outputs:
    ``(logits, log_norms, ids, weights, kept, counts, batch_cost)``; on CUDA the two ops' kernels.
    ``Cost.BASE`` needs the predictor; the other costs ignore it.

    On CUDA ``router_predict`` starts reading ``router_weight`` and ``predictor_weight`` while the previous kernel on the
    stream finishes (programmatic dependent launch): they must not be written by the kernel just before this call
    (convert them once, as the HF integration does; ``BASE_MOE_PDL=0`` turns the overlap off). Hidden states and
    biases are read after the wait."""
    return _ops.select_experts(
        hidden, router_weight, router_bias, predictor_weight, predictor_bias, correction_bias, num_groups,
        *_routing_args(routing), _enum_arg("cost", Cost, cost), budget, _enum_arg("fill", Fill, fill), voting,
        _flag("round_logits", round_logits),
    )


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The decoder layer's RMSNorm before the MoE block, as Hugging Face writes it for the Llama-style families
    (Qwen3-MoE, OLMoE, Mixtral, DeepSeek): ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` with ``x`` in fp32;
    ``hidden [T, H]``, ``weight [H]`` of ``hidden``'s dtype.

    On CUDA the kernel lets the next kernel on the stream start at once (programmatic dependent launch): a selection
    op right after it (``router_predict``, alone or in ``select_experts``) then copies its weights while the norm runs. Its
    fp32 sum of squares is added in another order than torch's, so an output may differ from torch's in the last
    places; on the CPU it is torch's computation, bit for bit."""
    return _ops.rms_norm(hidden, weight, eps)


def add_rms_norm(hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layer's residual add and the norm after it in one op: ``sum = residual + hidden`` (in their dtype,
    as the decoder layer adds them) and ``rms_norm(sum, weight, eps)``; returns ``(normed, sum)``. ``hidden`` and
    ``residual`` are ``[T, H]`` of one dtype.

    On CUDA one kernel with ``rms_norm``'s launch signal, so that the selection op after it starts at once: with the
    add in a kernel of its own (torch's, or one that torch.compile fuses with its own norm) nothing would signal it.
    ``normed`` is bit for bit ``rms_norm(sum, weight, eps)``; ``sum`` is torch's addition's."""
    return _ops.add_rms_norm(hidden, residual, weight, eps)


def experts(
    hidden: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    *,
    max_active_experts: int | None = None,
) -> torch.Tensor:
    """Stage 4: ``sum_j w_tj * down(silu(gate x_t) * up x_t)`` over each token's non-sentinel slots, in
    ``hidden``'s dtype; HF v5 layout ``gate_up_proj [E, 2I, H]`` (gate rows first), ``down_proj [E, H, I]``.

    ``max_active_experts``: the most distinct experts ``expert_ids`` can hold, when the caller knows it (a
    budget: ``num_groups * M``); the CUDA kernels launch work for that many experts instead of
    ``min(E, T * k)``, and pick their tile configuration with it. Any value of at least 1 gives a correct
    result (a smaller one only costs time); two values may differ by bf16 rounding (the configurations sum in
    different orders), the same value always gives the same bits."""
    return _ops.experts(hidden, expert_ids, expert_weights, gate_up_proj, down_proj, max_active_experts)


# ---------------------------------------------------------------------------------------------
# Fake implementations: output shapes and dtypes, so the ops trace under torch.compile. They check what the outputs'
# shapes and device depend on, with the kernels' messages (csrc/checks.cpp); the kernels check the rest when they run.
# ---------------------------------------------------------------------------------------------
def _check_same_device(primary_name: str, primary: torch.Tensor, **others: torch.Tensor | None) -> None:
    # A CPU tensor among meta tensors dispatches here: without this, the op would return an unfilled CPU tensor.
    for name, t in others.items():
        if t is not None:
            torch._check(t.device == primary.device, lambda: f"{name} must be on the same device as {primary_name} "
                         f"({primary.device}), got {t.device}")


def _check_selection_args(logits, num_groups, top_k, budget=1) -> None:
    E = logits.shape[1]
    torch._check(1 <= top_k <= MAX_TOP_K, lambda: f"top_k must be in [1, {MAX_TOP_K}], got {top_k}")
    torch._check(top_k <= E, lambda: f"top_k ({top_k}) must not exceed the number of experts ({E})")
    torch._check(1 <= num_groups < 2**30, lambda: f"num_groups must be in [1, 2^30), got {num_groups}")
    torch._check(logits.shape[0] % num_groups == 0, lambda: f"the number of tokens ({logits.shape[0]}) must be a "
                 f"multiple of num_groups ({num_groups})")
    torch._check(budget >= 1, lambda: f"budget must be >= 1, got {budget}")


@torch.library.register_fake("base_moe::router_predict")
def _router_predict_fake(hidden, router_weight, router_bias, predictor_weight, predictor_bias, round_logits=False):
    _check_same_device("hidden", hidden, router_weight=router_weight, router_bias=router_bias,
                       predictor_weight=predictor_weight, predictor_bias=predictor_bias)
    torch._check(router_weight.dim() == 2 and router_weight.shape[1] == hidden.shape[1],
                 lambda: f"router_weight must have shape [experts, {hidden.shape[1]}] to match hidden, got "
                 f"{list(router_weight.shape)}")
    T, E = hidden.shape[0], router_weight.shape[0]
    logits = hidden.new_empty(T, E, dtype=torch.float32)
    return logits, hidden.new_empty(T, E if predictor_weight is not None else 0, dtype=torch.float32)


def _routing_fakes(logits, top_k):
    T = logits.shape[0]
    return logits.new_empty(T, top_k, dtype=torch.int32), logits.new_empty(T, top_k, dtype=torch.float32)


def _check_voting(logits, voting) -> None:
    _check_same_device("logits", logits, voting=voting)
    torch._check(voting is None or tuple(voting.shape) == (logits.shape[0],),
                 lambda: f"voting must have shape [{logits.shape[0]}] (one flag per token), got {list(voting.shape)}")
    torch._check(voting is None or voting.dtype == torch.bool, lambda: f"voting must be bool, got {voting.dtype}")


@torch.library.register_fake("base_moe::route_cost")
def _route_cost_fake(logits, log_norms, correction_bias, num_groups, top_k, scoring, renormalize, n_group,
                     topk_group, scaling, cost, voting=None):
    _check_same_device("logits", logits, log_norms=log_norms, correction_bias=correction_bias)
    _check_voting(logits, voting)
    _check_selection_args(logits, num_groups, top_k)
    ids, weights = _routing_fakes(logits, top_k)
    return ids, weights, logits.new_empty(num_groups, logits.shape[1], dtype=torch.float32)


def _selection_fakes(logits, num_groups, top_k, budget):
    ids, weights = _routing_fakes(logits, top_k)
    E = logits.shape[1]
    kept = logits.new_empty(num_groups, min(budget, E), dtype=torch.int32)
    return ids, weights, kept, logits.new_empty(num_groups, E, dtype=torch.int32)


@torch.library.register_fake("base_moe::select_fill")
def _select_fill_fake(logits, batch_cost, correction_bias, top_k, scoring, renormalize, n_group, topk_group,
                      scaling, budget, fill, voting=None):
    _check_same_device("logits", logits, batch_cost=batch_cost, correction_bias=correction_bias)
    _check_voting(logits, voting)
    T, G = logits.shape[0], batch_cost.shape[0]
    torch._check(1 <= G < 2**30, lambda: f"batch_cost must have 1 to 2^30 - 1 rows (groups), got {G}")
    torch._check(T % G == 0,
                 lambda: f"the number of tokens ({T}) must be a multiple of batch_cost's rows (groups, {G})")
    _check_selection_args(logits, G, top_k, budget)
    return _selection_fakes(logits, G, top_k, budget)


@torch.library.register_fake("base_moe::route_select")
def _route_select_fake(logits, log_norms, correction_bias, num_groups, top_k, scoring, renormalize, n_group,
                       topk_group, scaling, cost, budget, fill, voting=None):
    _check_same_device("logits", logits, log_norms=log_norms, correction_bias=correction_bias)
    _check_voting(logits, voting)
    _check_selection_args(logits, num_groups, top_k, budget)
    D = logits.new_empty(num_groups, logits.shape[1], dtype=torch.float32)
    return (*_selection_fakes(logits, num_groups, top_k, budget), D)


@torch.library.register_fake("base_moe::select_experts")
def _select_experts_fake(hidden, router_weight, router_bias, predictor_weight, predictor_bias, correction_bias,
                         num_groups, top_k, scoring, renormalize, n_group, topk_group, scaling, cost, budget, fill,
                         voting=None, round_logits=False):
    logits, log_norms = _router_predict_fake(hidden, router_weight, router_bias, predictor_weight, predictor_bias)
    return logits, log_norms, *_route_select_fake(logits, None, correction_bias, num_groups, top_k, scoring,
                                                  renormalize, n_group, topk_group, scaling, cost, budget, fill,
                                                  voting)


@torch.library.register_fake("base_moe::rms_norm")
def _rms_norm_fake(hidden, weight, eps):
    _check_same_device("hidden", hidden, weight=weight)
    return torch.empty_like(hidden)


@torch.library.register_fake("base_moe::add_rms_norm")
def _add_rms_norm_fake(hidden, residual, weight, eps):
    _check_same_device("hidden", hidden, residual=residual, weight=weight)
    torch._check(residual.shape == hidden.shape, lambda: f"residual must have hidden's shape {list(hidden.shape)}, "
                 f"got {list(residual.shape)}")
    return torch.empty_like(hidden), torch.empty_like(hidden)


@torch.library.register_fake("base_moe::experts")
def _experts_fake(hidden, expert_ids, expert_weights, gate_up_proj, down_proj, max_active_experts=None):
    _check_same_device("hidden", hidden, expert_ids=expert_ids, expert_weights=expert_weights,
                       gate_up_proj=gate_up_proj, down_proj=down_proj)
    return torch.empty_like(hidden)
