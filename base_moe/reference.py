"""Plain-PyTorch reference of every base_moe op: written to be read, and the oracle of every test.

Conventions shared with the C++/CUDA ops:

* Tokens are ``[T, ...]`` with ``T = G * B``: ``G`` independent decode batches ("groups") of ``B`` tokens,
  stored group after group.
* All ranking is deterministic: larger score first, equal scores to the lower expert index.
  Softmax is monotone, so softmax scorings rank experts by their logits (but for a selection bias added to the
  probabilities: ERNIE-4.5).
* The sentinel expert id ``E`` (= number of experts) marks an empty slot; its weight is 0.
* The batch cost ``D[g, u]`` is summed over the tokens of group ``g`` in token order, in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .routing import Cost, Fill, Routing, Scoring


# ---------------------------------------------------------------------------------------------
# Stage 1: fused router + predictor GEMV
# ---------------------------------------------------------------------------------------------
def router_predict(
    hidden: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None = None,
    predictor_weight: torch.Tensor | None = None,
    predictor_bias: torch.Tensor | None = None,
    round_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[T, E]`` and predicted log-norms ``g = a_u . z + b_u`` ``[T, E]`` (``[T, 0]``
    without a predictor), both fp32, accumulated in fp32; with ``round_logits`` each logit (with its bias) rounded once
    to ``hidden``'s dtype, as a linear layer in that dtype returns it."""
    x = hidden.float()
    logits = x @ router_weight.float().T
    if router_bias is not None:
        logits = logits + router_bias.float()
    if round_logits:
        logits = logits.to(hidden.dtype).float()
    if predictor_weight is None:
        return logits, logits.new_empty(x.shape[0], 0)
    log_norms = x @ predictor_weight.float().T + predictor_bias.float()
    return logits, log_norms


# ---------------------------------------------------------------------------------------------
# Ranking helpers
# ---------------------------------------------------------------------------------------------
def _rank(score: torch.Tensor, *preferences: torch.Tensor) -> torch.Tensor:
    """Indices of the last dimension, ordered by each boolean preference (True first, the first one
    most significant), then by score descending, then by index ascending."""
    order = torch.sort(score, dim=-1, descending=True, stable=True).indices
    for preferred in reversed(preferences):
        flag = torch.gather(preferred, -1, order).to(torch.int8)
        order = torch.gather(order, -1, torch.sort(flag, dim=-1, descending=True, stable=True).indices)
    return order


_SIGMOID_ZERO_AT_OR_BELOW = -88.72283935546875
"""The largest fp32 x whose exp(-x) rounds to inf in fp32 (exp(-x) >= FLT_MAX + half its ulp = 2^128 - 2^103); the next
fp32 above it, -88.72283172607422, has a finite exp(-x) and a subnormal sigmoid."""


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """fp32 sigmoid through float64, rounded once, as the ops compute it (csrc/include/base_moe/routing.h): fp32
    arithmetic rounds twice and differs in the last place for about a third of all logits, and torch's fp32 CPU
    sigmoid even rounds its vectorised body and its scalar tail differently, so equal logits could score unequally by
    their position in the row. 0 where exp(-x) overflows fp32 (x below about -88.72), as fp32 1 / (1 + exp(-x))
    gives: such logits score, and tie, as zeros (float64 alone would give them distinct subnormal scores)."""
    return torch.where(x <= _SIGMOID_ZERO_AT_OR_BELOW, 0.0, torch.sigmoid(x.double())).float()


def experts_per_lane(num_experts: int) -> int:
    """Experts per lane of the CUDA routing warp (``experts_per_lane`` in csrc/include/base_moe/routing.h): lane ``l``
    holds experts ``[l * EPL, (l + 1) * EPL)``, ``EPL`` = ``ceil(E / 32)`` rounded up to a power of two."""
    epl = 1
    while 32 * epl < num_experts:
        epl *= 2
    return epl


def biased_probabilities(logits: torch.Tensor, correction_bias: torch.Tensor) -> torch.Tensor:
    """Softmax probabilities + selection bias (ERNIE-4.5's choice scores), computed as the ops compute them, so that all
    three rank the same experts bit for bit: ``exp(x - max)`` through float64, rounded once, over a denominator summed
    in the CUDA routing warp's order (each lane's experts in index order, then the 32 lanes' sums by an xor butterfly,
    offsets 16, 8, 4, 2, 1)."""
    T, E = logits.shape
    exps = (logits - logits.max(dim=-1, keepdim=True).values).double().exp().float()
    epl = experts_per_lane(E)
    lanes = F.pad(exps, (0, 32 * epl - E)).view(T, 32, epl)
    lane_sum = torch.zeros(T, 32, dtype=torch.float32, device=logits.device)
    for j in range(epl):
        lane_sum = lane_sum + lanes[..., j]
    for offset in (16, 8, 4, 2, 1):
        partner = torch.arange(32, device=logits.device) ^ offset
        lane_sum = lane_sum + lane_sum[:, partner]
    return exps / lane_sum[:, :1] + correction_bias.float()


def choice_scores(logits: torch.Tensor, routing: Routing, correction_bias: torch.Tensor | None) -> torch.Tensor:
    """The score experts are ranked by: the logits for softmax scorings (softmax is monotone), softmax probabilities +
    bias for SOFTMAX with a selection bias (ERNIE-4.5), sigmoid (+ bias) for SIGMOID."""
    if routing.scoring == Scoring.SOFTMAX and correction_bias is not None:
        return biased_probabilities(logits, correction_bias)
    if routing.scoring != Scoring.SIGMOID:
        return logits
    scores = sigmoid(logits)
    return scores + correction_bias.float() if correction_bias is not None else scores


def allowed_groups(choice: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Boolean ``[T, E]``: experts in the token's top ``topk_group`` groups. A group's score is the sum of its two
    best choice scores under SIGMOID scoring (DeepSeek-V3) and its best one under the softmax scorings (DeepSeek-V2's
    ``group_limited_greedy`` takes the best softmax score; the choice scores are the logits, which softmax orders
    alike, or with a selection bias the probabilities + the bias). All True without groups."""
    T, E = choice.shape
    if routing.n_group <= 1:
        return torch.ones_like(choice, dtype=torch.bool)
    grouped = choice.view(T, routing.n_group, E // routing.n_group)
    best_two = torch.sort(grouped, dim=-1, descending=True).values[..., :2]
    group_score = best_two[..., 0] + best_two[..., 1] if routing.scoring == Scoring.SIGMOID else best_two[..., 0]
    top_groups = _rank(group_score)[:, : routing.topk_group]
    allowed = torch.zeros(T, routing.n_group, dtype=torch.bool, device=choice.device)
    allowed.scatter_(1, top_groups, True)
    return allowed.repeat_interleave(E // routing.n_group, dim=1)


def routing_weights(logits: torch.Tensor, ids: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The model's weights for the expert set ``ids [T, k]`` (sentinel ``E`` = empty slot, weight 0)."""
    E = logits.shape[1]
    valid = ids < E
    safe = torch.where(valid, ids, 0)
    chosen_logits = torch.gather(logits, 1, safe)
    if routing.scoring == Scoring.SOFTMAX:
        w = torch.gather(torch.softmax(logits, dim=-1), 1, safe)
    elif routing.scoring == Scoring.SOFTMAX_AFTER_TOPK:
        masked = chosen_logits.masked_fill(~valid, float("-inf"))
        w = torch.softmax(masked, dim=-1).nan_to_num(0.0)  # a token with no expert left: all zero
    else:
        w = sigmoid(chosen_logits)
    w = torch.where(valid, w, 0.0)
    if routing.renormalize and routing.scoring != Scoring.SOFTMAX_AFTER_TOPK:
        total = w.sum(dim=-1, keepdim=True)
        if routing.scoring == Scoring.SIGMOID:
            total = total + 1e-20  # DeepSeek-V3's guard
        w = torch.where(total > 0, w / total, 0.0)
    return w * routing.scaling


def _top_k_ids(order: torch.Tensor, eligible: torch.Tensor, k: int, num_experts: int) -> torch.Tensor:
    """The first ``k`` entries of ``order`` that are eligible (eligible ones come first in ``order``),
    the rest filled with the sentinel."""
    ids = order[:, :k]
    return torch.where(torch.gather(eligible, 1, ids), ids, num_experts)


# ---------------------------------------------------------------------------------------------
# Stage 2: routing and cost reduction
# ---------------------------------------------------------------------------------------------
def route(
    logits: torch.Tensor, routing: Routing, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own routing: ids ``[T, k]`` (int32, descending score) and weights ``[T, k]`` fp32."""
    E = logits.shape[1]
    choice = choice_scores(logits, routing, correction_bias)
    allowed = allowed_groups(choice, routing)
    ids = _top_k_ids(_rank(choice, allowed), allowed, routing.top_k, E)
    return ids.to(torch.int32), routing_weights(logits, ids, routing)


def slot_costs(
    ids: torch.Tensor, weights: torch.Tensor, log_norms: torch.Tensor | None, cost: Cost
) -> torch.Tensor:
    """Cost of each routed slot ``[T, k]`` (fp32)."""
    if cost == Cost.BASE:
        g = torch.gather(log_norms, 1, ids.long().clamp(max=log_norms.shape[1] - 1))
        w2 = weights * weights
        return torch.where(w2 == 0, 0.0, w2 * torch.exp(2.0 * g))  # squared weight 0: cost 0, never 0 x inf
    if cost == Cost.ROUTER_SQ:
        return weights * weights
    if cost == Cost.FREQUENCY:
        return torch.ones_like(weights)
    return weights.clone()  # ROUTER_SUM, TOP1_UNION


def top1_offset(tokens_per_group: int | torch.Tensor, routing: Routing) -> torch.Tensor:
    """What TOP1_UNION adds to the cost of every expert that is some token's top-1: more than any sum of
    routing weights in one group can reach, so seeded experts rank first. ``tokens_per_group``: the tokens that seed
    (an int, or a count per group); fp32 of its shape, rounded once from double as the kernels round it."""
    tokens = torch.as_tensor(tokens_per_group, dtype=torch.long)
    return ((tokens * routing.top_k).double() * max(1.0, routing.scaling)).float()


def voting_slots(ids: torch.Tensor, voting: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """``ids [T, k]`` with every slot of a non-voting token (``voting [T]`` False) made empty (the sentinel)."""
    return ids if voting is None else torch.where(voting[:, None], ids, num_experts)


def batch_cost(
    ids: torch.Tensor, costs: torch.Tensor, num_groups: int, num_experts: int, cost: Cost, routing: Routing,
    voting: torch.Tensor | None = None,
) -> torch.Tensor:
    """``D [G, E]``: per group, the sum over its tokens (in token order, fp32) of each expert's slot cost.
    ``voting [T]`` bool (None: every token): only these tokens' slots are summed and seed ``TOP1_UNION`` experts,
    whose offset counts them, so D is bit for bit that of the voting tokens alone."""
    T, k = ids.shape
    B = T // num_groups
    ids = voting_slots(ids, voting, num_experts)
    dense = torch.zeros(T, num_experts + 1, dtype=torch.float32, device=ids.device)
    dense.scatter_(1, ids.long(), costs.float())  # each token names an expert at most once
    dense = dense[:, :num_experts].view(num_groups, B, num_experts)
    D = torch.zeros(num_groups, num_experts, dtype=torch.float32, device=ids.device)
    for b in range(B):  # sequential on purpose: the kernels sum in this order
        D = D + dense[:, b]
    if cost == Cost.TOP1_UNION:
        is_top1 = torch.zeros(T, num_experts + 1, dtype=torch.bool, device=ids.device)
        is_top1.scatter_(1, ids[:, :1].long(), True)
        seeded = is_top1[:, :num_experts].view(num_groups, B, num_experts).any(dim=1)
        voters = B if voting is None else voting.view(num_groups, B).sum(dim=1, keepdim=True)
        D = torch.where(seeded, D + top1_offset(voters, routing).to(D.device), D)
    return D


def route_cost(
    logits: torch.Tensor,
    log_norms: torch.Tensor | None,
    correction_bias: torch.Tensor | None,
    num_groups: int,
    routing: Routing,
    cost: Cost,
    voting: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 2: the model's routing and the per-group expert costs: ``(ids, weights, D)``; D summed over the
    ``voting`` tokens (None: all)."""
    ids, weights = route(logits, routing, correction_bias)
    costs = slot_costs(ids, weights, log_norms, cost)
    D = batch_cost(ids, costs, num_groups, logits.shape[1], cost, routing, voting)
    return ids, weights, D


# ---------------------------------------------------------------------------------------------
# Stage 3: top-budget selection and fill
# ---------------------------------------------------------------------------------------------
def routed_union(ids: torch.Tensor, num_groups: int, num_experts: int,
                 voting: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean ``[G, E]``: experts routed by at least one (voting, where ``voting [T]`` is given) token of the
    group."""
    T = ids.shape[0]
    hit = torch.zeros(T, num_experts + 1, dtype=torch.bool, device=ids.device)
    hit.scatter_(1, voting_slots(ids, voting, num_experts).long(), True)
    return hit[:, :num_experts].view(num_groups, T // num_groups, num_experts).any(dim=1)


def keep_experts(D: torch.Tensor, candidates: torch.Tensor, budget: int) -> torch.Tensor:
    """``kept [G, min(budget, E)]`` int32: the ``budget`` candidates of largest D (ties to the lower index),
    in that order, padded with the sentinel ``E``."""
    E = D.shape[1]
    width = min(budget, E)
    order = _rank(D, candidates)[:, :width]
    return torch.where(torch.gather(candidates, 1, order), order, E).to(torch.int32)


def renormalised(kept_weights: torch.Tensor, total: torch.Tensor, kept_total: torch.Tensor) -> torch.Tensor:
    """``kept_weights x total / kept_total`` (0 where nothing is kept). Where that scale overflows fp32 (a tiny kept
    total: a correction bias can rank first an expert whose sigmoid is ~1e-39), the weights are divided first."""
    scale = torch.where(kept_total > 0, total / kept_total, 0.0)
    return torch.where(scale.isinf(), kept_weights / kept_total * total, kept_weights * scale)


def fill(
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None,
    routing: Routing,
    kept: torch.Tensor,
    fill_rule: Fill,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's final ids ``[T, k]`` (int32, sentinel ``E`` for empty slots) and weights ``[T, k]``."""
    T, E = logits.shape
    G = kept.shape[0]
    in_kept = torch.zeros(G, E + 1, dtype=torch.bool, device=logits.device)
    in_kept.scatter_(1, kept.long(), True)
    in_kept = in_kept[:, :E].repeat_interleave(T // G, dim=0)  # [T, E]

    choice = choice_scores(logits, routing, correction_bias)
    allowed = allowed_groups(choice, routing)
    if fill_rule == Fill.BACKFILL:
        ids = _top_k_ids(_rank(choice, in_kept, allowed), in_kept, routing.top_k, E)
        return ids.to(torch.int32), routing_weights(logits, ids, routing)

    routed, weights = route(logits, routing, correction_bias)
    survives = torch.gather(torch.cat([in_kept, in_kept.new_zeros(T, 1)], dim=1), 1, routed.long())
    # survivors keep their order; dropped slots move to the end
    order = torch.sort(survives.to(torch.int8), dim=-1, descending=True, stable=True).indices
    ids = torch.where(torch.gather(survives, 1, order), torch.gather(routed, 1, order), E)
    kept_weights = torch.where(torch.gather(survives, 1, order), torch.gather(weights, 1, order), 0.0)
    if fill_rule == Fill.DROP_RENORM:
        kept_total = kept_weights.sum(dim=-1, keepdim=True)
        kept_weights = renormalised(kept_weights, weights.sum(dim=-1, keepdim=True), kept_total)
    return ids.to(torch.int32), kept_weights


def expert_counts(ids: torch.Tensor, num_groups: int, num_experts: int) -> torch.Tensor:
    """``counts [G, E]`` int32: tokens of each group whose final set holds the expert."""
    T = ids.shape[0]
    hit = torch.zeros(T, num_experts + 1, dtype=torch.int32, device=ids.device)
    hit.scatter_(1, ids.long(), 1)
    return hit[:, :num_experts].view(num_groups, T // num_groups, num_experts).sum(dim=1, dtype=torch.int32)


def select_fill(
    logits: torch.Tensor,
    batch_cost: torch.Tensor,
    correction_bias: torch.Tensor | None,
    routing: Routing,
    budget: int,
    fill_rule: Fill,
    voting: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 3: keep the top-``budget`` routed experts of each group by ``batch_cost`` and fill every
    token's slots from them: ``(ids, weights, kept, counts)``. With ``voting [T]`` bool, only the experts its tokens
    route to are candidates (a group without a voting token keeps none); every token is filled."""
    E = logits.shape[1]
    G = batch_cost.shape[0]
    routed, _ = route(logits, routing, correction_bias)
    kept = keep_experts(batch_cost, routed_union(routed, G, E, voting), budget)
    ids, weights = fill(logits, correction_bias, routing, kept, fill_rule)
    return ids, weights, kept, expert_counts(ids, G, E)


def route_select(
    logits: torch.Tensor,
    log_norms: torch.Tensor | None,
    correction_bias: torch.Tensor | None,
    num_groups: int,
    routing: Routing,
    cost: Cost,
    budget: int,
    fill_rule: Fill,
    voting: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stages 2 and 3 fused: ``(ids, weights, kept, counts, D)``; only the ``voting`` tokens (None: all) choose."""
    _, _, D = route_cost(logits, log_norms, correction_bias, num_groups, routing, cost, voting)
    ids, weights, kept, counts = select_fill(logits, D, correction_bias, routing, budget, fill_rule, voting)
    return ids, weights, kept, counts, D


def select_experts(
    hidden: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None,
    predictor_weight: torch.Tensor | None,
    predictor_bias: torch.Tensor | None,
    correction_bias: torch.Tensor | None,
    num_groups: int,
    routing: Routing,
    cost: Cost,
    budget: int,
    fill_rule: Fill,
    voting: torch.Tensor | None = None,
    round_logits: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Stages 1-3: ``(logits, log_norms, ids, weights, kept, counts, D)``; the log-norms feed only ``Cost.BASE``."""
    logits, log_norms = router_predict(hidden, router_weight, router_bias, predictor_weight, predictor_bias,
                                       round_logits)
    cost_log_norms = log_norms if cost == Cost.BASE else None
    return logits, log_norms, *route_select(logits, cost_log_norms, correction_bias, num_groups, routing, cost, budget,
                                            fill_rule, voting)


# ---------------------------------------------------------------------------------------------
# The decoder layer's norm before the MoE block
# ---------------------------------------------------------------------------------------------
def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's Llama-style RMSNorm (``Qwen3MoeRMSNorm``, ``OlmoeRMSNorm``, ``MixtralRMSNorm``, ...):
    fp32 inside, the normalised states cast back to the input dtype before the weight multiplies them."""
    x = hidden.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(hidden.dtype)


def add_rms_norm(hidden: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder layer's ``residual + hidden`` and the norm of it: ``(rms_norm(sum), sum)``."""
    total = residual + hidden
    return rms_norm(total, weight, eps), total


# ---------------------------------------------------------------------------------------------
# Stage 4: routed experts
# ---------------------------------------------------------------------------------------------
def experts(
    hidden: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
) -> torch.Tensor:
    """``y_t = sum_j w_tj * down_u(silu(gate_u x_t) * up_u x_t)`` over the token's non-sentinel slots, in fp32,
    returned in ``hidden``'s dtype. HF v5 layout: ``gate_up_proj [E, 2I, H]`` (gate rows first),
    ``down_proj [E, H, I]``."""
    E = gate_up_proj.shape[0]
    x = hidden.float()
    out = torch.zeros_like(x)
    # a negative id adds nothing either (the CUDA kernel reads any id outside [0, E) as an empty slot; the CPU op
    # refuses ids outside [0, E])
    for u in torch.unique(ids[(ids >= 0) & (ids < E)]).tolist():
        token, slot = torch.nonzero(ids == u, as_tuple=True)
        gate, up = (x[token] @ gate_up_proj[u].float().T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ down_proj[u].float().T
        out.index_add_(0, token, y * weights[token, slot, None].float())
    return out.to(hidden.dtype)
