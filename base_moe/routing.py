"""Enumerations and the routing description shared by the op layer, the reference and the policies.

The integer values are part of the op schemas (``torch.ops.base_moe.*`` take them as ``int``), so they
must never be renumbered.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass

import torch


class Scoring(enum.IntEnum):
    """How a model turns router logits into routed experts and routing weights."""

    SOFTMAX = 0
    """softmax over all experts, then top-k (Qwen2/3-MoE, OLMoE, Mixtral); with a correction bias, top-k of the
    probabilities + the bias (ERNIE-4.5)."""
    SOFTMAX_AFTER_TOPK = 1
    """top-k on the logits, then softmax over the chosen k (GPT-OSS)."""
    SIGMOID = 2
    """sigmoid scores; top-k on score + correction bias (DeepSeek-V3)."""


class Cost(enum.IntEnum):
    """What one routed (token, expert) slot contributes to the expert's batch cost D."""

    BASE = 0
    """w^2 * exp(2 g): predicted removal error (``static_energy``/``oracle`` pass other log-norms); 0 where w^2 is 0 in
    fp32, whatever g (not 0 x inf)."""
    ROUTER_SUM = 1
    """w (XShare's objective)."""
    ROUTER_SQ = 2
    """w^2."""
    FREQUENCY = 3
    """1 per routed token."""
    TOP1_UNION = 4
    """w, and every expert that is some token's top-1 ranks above all others."""


MAX_EXPERTS = 512
"""Routed experts per MoE layer that the ops take at most (``kMaxExperts`` in csrc/include/base_moe/routing.h)."""
MAX_TOP_K = 16
"""Experts per token that the ops take at most (``kMaxTopK`` there)."""


class Fill(enum.IntEnum):
    """What a token does when some of its routed experts were not kept."""

    BACKFILL = 0
    """re-route the token to its top-k experts among the kept ones (the model's weight rule)."""
    DROP = 1
    """keep only the routed experts that were kept, with their original weights."""
    DROP_RENORM = 2
    """keep only the routed experts that were kept, rescaled to the original total weight."""


@dataclass(frozen=True)
class Routing:
    """A model's routing rule, as the ops take it.

    ``n_group``/``topk_group`` describe a group-limited top-k (``n_group=1``: no groups): a token's experts come from
    its ``topk_group`` best groups, a group scored by the sum of its two best choice scores under SIGMOID scoring
    (DeepSeek-V3) and by its best one under the softmax scorings (DeepSeek-V2's ``group_limited_greedy``);
    ``scaling`` multiplies the final weights (DeepSeek-V3's ``routed_scaling_factor``).
    """

    top_k: int
    scoring: Scoring = Scoring.SOFTMAX
    renormalize: bool = False
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0

    def op_args(self) -> tuple[int, int, bool, int, int, float]:
        """The routing arguments in the order every op schema takes them."""
        return (self.top_k, int(self.scoring), self.renormalize, self.n_group, self.topk_group, self.scaling)


def exact_int(value) -> int | None:
    """``value`` as an int where ``operator.index`` takes it (int, numpy or torch integers) and it is no bool (a
    Python, numpy or torch bool, which ``operator.index`` would read as 0 or 1); None otherwise. How the op wrappers
    and the policies read integer arguments."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None
