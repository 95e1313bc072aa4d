"""Calibration of the removal-cost predictors.

Calibration text runs once through the dense model. A forward pre-hook on every MoE block captures the
block's input ``z`` (one batch, one layer at a time), runs **every** routed expert on it to get the targets
``y_u = log ||E_u(z)||`` (fp32 norms, floored at ``1e-12`` so that ``log 0`` cannot occur), and folds ``z`` and
``y`` into that layer's streamed sums in fp64 -- ``X^T X`` and ``X^T Y`` with a bias column, and ``sum y^2`` --
then drops them. Sequences are split deterministically into a training and a held-out part, each with its
own sums. At the end each layer's ridge regression is solved in closed form from the training sums (the
bias is not penalised), and its R^2 is evaluated on the held-out sums.

Memory, beyond the model itself: the fp64 sums of all MoE layers, ``16 L ((H+1)^2 + (H+1) E + E)`` bytes
(Qwen3-30B-A3B: L=48, H=2048, E=128 -> 3.4 GB), plus one batch's activations at one layer -- its input in fp32
and fp64 (``[N, H+1]``, twice while split into training and held-out rows) and one expert's fp32 output
``[N, H]`` and intermediate ``[N, 2I]`` at a time, ``N = batch_size x seq`` tokens (N = 4096: ~0.3 GB) -- and
the model's own forward activations for that batch. Nothing grows with the number of calibration tokens, and
the forward stops after the last MoE layer (no LM-head logits).
"""

from __future__ import annotations

import math
import numbers
import resource
import time
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch

from .inputs import check_token_ids, vocab_size, warn_past_context
from .layouts import LOG_NORM_FLOOR, cosine_similarity_from_gram, expert_log_norms, expert_output_gram
from .predictors import FORMAT, Predictors, model_type


# ---------------------------------------------------------------------------------------------
# Ridge regression from streamed sums
# ---------------------------------------------------------------------------------------------
@dataclass
class RidgeFit:
    """One layer's fitted predictor (fp64) and its held-out quality."""

    weight: torch.Tensor  # [E, H]
    bias: torch.Tensor  # [E]
    mean_target: torch.Tensor  # [E], over all (training and held-out) tokens
    r2: float  # held-out, pooled over experts: 1 - sum SSE / sum SST (nan without held-out tokens)
    expert_r2: torch.Tensor  # [E], held-out R^2 of each expert (nan where undefined)
    tokens_train: int
    tokens_holdout: int


class _Sums:
    """``A = Xa^T Xa [H+1, H+1]``, ``B = Xa^T Y [H+1, E]`` and ``yy = sum Y^2 [E]`` in fp64, where
    ``Xa = [X, 1]``: ``A[H, H]`` is the token count, ``A[H, :H]`` the feature sums, ``B[H]`` the target sums."""

    def __init__(self, hidden_size: int, num_experts: int, device: torch.device) -> None:
        self.A = torch.zeros(hidden_size + 1, hidden_size + 1, dtype=torch.float64, device=device)
        self.B = torch.zeros(hidden_size + 1, num_experts, dtype=torch.float64, device=device)
        self.yy = torch.zeros(num_experts, dtype=torch.float64, device=device)

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        xa = torch.cat([x.to(torch.float64), x.new_ones(x.shape[0], 1, dtype=torch.float64)], dim=1)
        y = y.to(torch.float64)
        self.A += xa.T @ xa
        self.B += xa.T @ y
        self.yy += (y * y).sum(dim=0)

    @property
    def count(self) -> int:
        return int(round(self.A[-1, -1].item()))


class RidgeAccumulator:
    """Streamed sums for one layer's ridge regression ``y [N, E] ~ x [N, H] @ W.T + b``, kept separately for
    training and held-out rows; :meth:`fit` solves it in closed form."""

    def __init__(self, hidden_size: int, num_experts: int, device: torch.device | str = "cpu") -> None:
        self.hidden_size, self.num_experts = hidden_size, num_experts
        self.train = _Sums(hidden_size, num_experts, torch.device(device))
        self.holdout = _Sums(hidden_size, num_experts, torch.device(device))

    def add(self, x: torch.Tensor, y: torch.Tensor, held_out: torch.Tensor | None = None) -> None:
        """Fold rows ``x [N, H]``, ``y [N, E]`` in; ``held_out [N]`` (bool) marks the held-out rows."""
        device = self.train.A.device
        x, y = x.to(device), y.to(device)
        if held_out is None:
            self.train.add(x, y)
            return
        held_out = held_out.to(device)
        self.train.add(x[~held_out], y[~held_out])
        self.holdout.add(x[held_out], y[held_out])

    def fit(self, ridge: float) -> RidgeFit:
        """Closed-form ridge on the training sums: centre (so the bias is not penalised), solve
        ``(C + ridge * diag(C)) W = C_xy`` -- ridge regression on standardised features, so ``ridge`` does not
        depend on the token count or on the (very uneven) scales of the hidden-state dimensions -- then
        ``b = mean_y - mean_x @ W``. R^2 on the held-out sums."""
        H = self.hidden_size
        A, B = self.train.A, self.train.B
        n = A[H, H]
        if n < 2:
            raise ValueError(f"ridge fit needs at least 2 training tokens, got {int(n.item())}")
        mean_x, mean_y = A[H, :H] / n, B[H] / n
        C = A[:H, :H] - n * torch.outer(mean_x, mean_x)
        Cxy = B[:H] - n * torch.outer(mean_x, mean_y)
        variance = torch.diagonal(C).clamp_min(0)
        # A feature is constant when its centred sum of squares is at the fp64 rounding level of its raw one; it
        # carries no information once centred and gets weight 0. Every other feature is standardised by its own
        # variance, however small next to the others' (a floor relative to the mean variance would raise the
        # penalty of the ordinary dimensions whenever a few massive ones dominate the mean).
        constant = variance <= 1e-10 * torch.diagonal(A)[:H]
        scale = torch.where(constant, 0.0, variance.clamp_min(torch.finfo(torch.float64).tiny).rsqrt())
        system = C * scale[:, None] * scale[None, :]  # standardised coordinates (unit diagonal): better conditioned
        system.diagonal().add_(ridge)
        system.diagonal()[constant] = 1.0  # their rows, columns and right-hand sides are 0: weight 0
        factor, info = torch.linalg.cholesky_ex(system)
        if int(info.item()) != 0:
            raise ValueError(
                f"ridge system is singular (ridge={ridge}, {int(n.item())} training tokens for {H} features): "
                "calibrate on more tokens or pass a larger ridge"
            )
        W = torch.cholesky_solve(Cxy * scale[:, None], factor) * scale[:, None]  # [H, E]
        b = mean_y - mean_x @ W

        n_all = n + self.holdout.A[H, H]
        mean_target = (B[H] + self.holdout.B[H]) / n_all
        r2, expert_r2 = self._heldout_r2(W, b)
        return RidgeFit(W.T.contiguous(), b, mean_target, r2, expert_r2, self.train.count, self.holdout.count)

    def _heldout_r2(self, W: torch.Tensor, b: torch.Tensor) -> tuple[float, torch.Tensor]:
        """``R^2 = 1 - SSE / SST`` on the held-out rows, from their sums: with ``theta = [W; b]``,
        ``SSE_u = sum y^2 - 2 theta_u . B_u + theta_u^T A theta_u`` and ``SST_u = sum y^2 - n mean_y^2``."""
        H = self.hidden_size
        A, B, yy = self.holdout.A, self.holdout.B, self.holdout.yy
        n = A[H, H]
        if n < 2:
            return math.nan, torch.full_like(b, math.nan)
        theta = torch.cat([W, b[None]], dim=0)  # [H+1, E]
        sse = (yy - 2 * (theta * B).sum(dim=0) + (theta * (A @ theta)).sum(dim=0)).clamp_min(0)
        # a constant target's SST, a difference of two equal sums, may round to a tiny positive number (the R^2 would
        # then read 1): at the fp64 rounding level of sum y^2 it counts as 0, as a constant feature does in fit
        sst = (yy - B[H] * B[H] / n).clamp_min(0)
        sst = torch.where(sst <= 1e-10 * yy, 0.0, sst)
        expert_r2 = torch.where(sst > 0, 1 - sse / sst.clamp_min(1e-300), math.nan)
        total = sst.sum().item()
        return (1 - sse.sum().item() / total if total > 0 else math.nan), expert_r2


# ---------------------------------------------------------------------------------------------
# Calibration driver
# ---------------------------------------------------------------------------------------------
class _StopForward(Exception):
    """Raised by the last MoE layer's hook: nothing after it is needed."""


def holdout_fraction(holdout: float) -> Fraction:
    return Fraction(holdout).limit_denominator(10_000)


def check_holdout(holdout: float) -> None:
    """Raises ValueError unless ``holdout`` is 0 or a fraction the split can take (it takes holdout as a fraction
    of denominator at most 10,000: above 0 it must not round to 0 or 1)."""
    if not 0 <= holdout < 1 or (holdout > 0 and not 0 < holdout_fraction(holdout) < 1):
        raise ValueError(f"holdout must be 0 or strictly between 1/20000 and 1 - 1/20000, got {holdout}")


def held_out_sequences(first: int, count: int, holdout: float) -> torch.Tensor:
    """Boolean ``[count]``: which of the sequences ``first .. first+count-1`` are held out. Sequence ``i`` is
    held out when ``floor((i+1) h) > floor(i h)`` (``h = 0.1``: sequences 9, 19, 29, ...): the fraction ``h``
    of sequences, spread evenly, independent of batching."""
    frac = holdout_fraction(holdout)
    i = torch.arange(first, first + count, dtype=torch.int64)
    return ((i + 1) * frac.numerator) // frac.denominator > (i * frac.numerator) // frac.denominator


def _batches(input_ids: torch.Tensor | Iterable[torch.Tensor], batch_size: int,
             vocab: int | None = None) -> Iterator[torch.Tensor]:
    items = [input_ids] if isinstance(input_ids, torch.Tensor) else input_ids
    for item in items:
        if not isinstance(item, torch.Tensor):
            raise TypeError(f"input_ids must be an integer tensor [N, S] or an iterable of them, got "
                            f"{type(item).__name__}")
        if item.dim() == 1:
            item = item[None]
        if item.dim() != 2:
            raise ValueError(f"input_ids batches must be [N, S], got shape {tuple(item.shape)}")
        if item.numel() == 0:
            raise ValueError(f"input_ids batches must hold tokens, got shape {tuple(item.shape)}")
        check_token_ids(item, vocab)
        for batch in item.split(batch_size):
            yield batch.long()  # any integer dtype (bytes from torch.frombuffer are uint8)


def _total_tokens(input_ids: Any) -> int | None:
    """The progress bar's total, where it is known before the run (a tensor, or a list or tuple of them; anything
    else reaches _batches' type check)."""
    if isinstance(input_ids, torch.Tensor):
        return input_ids.numel()
    if isinstance(input_ids, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in input_ids):
        return sum(t.numel() for t in input_ids)
    return None


def _input_device(model: torch.nn.Module) -> torch.device:
    try:
        return model.get_input_embeddings().weight.device
    except (AttributeError, NotImplementedError):
        return next(model.parameters()).device


def calibrate(
    model: torch.nn.Module,
    input_ids: torch.Tensor | Iterable[torch.Tensor],
    *,
    batch_size: int = 8,
    ridge: float = 1e-3,
    holdout: float = 0.1,
    progress: bool = True,
    device: torch.device | str | None = None,
    ridge_sweep: Iterable[float] | float = (),
    similarity: bool = False,
) -> Predictors:
    """Fit BASE's removal-cost predictors for every MoE layer of ``model``.

    Args:
        model: a Hugging Face MoE model (any layout :func:`base_moe.layouts.find_moe_layouts` knows), dense.
        input_ids: calibration token ids, an integer tensor ``[N, S]`` (any integer dtype) or an iterable of such
            batches. Every position is fitted (the model runs without an attention mask): give unpadded text; pad
            tokens would be fitted like text (their near-constant outputs inflate the held-out R^2).
        batch_size: sequences per forward pass (the activation memory scales with ``batch_size x S``).
        ridge: ridge strength on standardised features (each weight's penalty is ``ridge`` x its feature's
            sum of squared deviations), so independent of the token count and of the features' scales.
        holdout: fraction of the sequences held out for R^2 (deterministic: every ``1/holdout``-th sequence;
            with fewer sequences than that none is held out, R^2 is NaN and a UserWarning says so); 0, or strictly
            between 1/20000 and 1 - 1/20000 (the split rounds it to a fraction of denominator at most 10,000).
        progress: show a tqdm progress bar (tokens).
        device: where input ids are sent; defaults to the device of the model's input embeddings. The sums
            of each layer live on the device of that layer's inputs.
        ridge_sweep: other ridge values (one, or an iterable of them) to fit from the same sums, for choosing
            ``ridge``: their held-out R^2 per layer go to ``.stats["r2_by_ridge"]`` (not saved; NaN where that
            ridge's system is singular); the predictors use ``ridge``.
        similarity: also measure every two experts' output similarity (cosine over all calibration tokens, per
            layer: ``Predictors.similarity``), which the ``substitute`` fill rule needs. It runs every expert a
            second time, on token chunks whose outputs of all experts take at most 256 MB (fp32).

    Returns a :class:`Predictors`; ``.r2`` holds each layer's held-out R^2 and ``.stats`` the time and peak
    memory of the run. The result depends only on the model, the tokens and these options (fixed split, fp64
    sums in a fixed order). Memory: see the docstring of the module ``base_moe/calibrate.py``, independent of ``N``.
    """
    from .layouts import find_moe_layouts

    layouts = find_moe_layouts(model)
    if not layouts:
        raise ValueError(f"no MoE blocks found in {type(model).__name__}: nothing to calibrate")
    return calibrate_layouts(
        model, layouts, input_ids, batch_size=batch_size, ridge=ridge, holdout=holdout, progress=progress,
        device=device, ridge_sweep=ridge_sweep, similarity=similarity,
    )


def calibrate_layouts(
    model: torch.nn.Module,
    layouts: list[Any],
    input_ids: torch.Tensor | Iterable[torch.Tensor],
    *,
    batch_size: int = 8,
    ridge: float = 1e-3,
    holdout: float = 0.1,
    progress: bool = True,
    device: torch.device | str | None = None,
    ridge_sweep: Iterable[float] | float = (),
    similarity: bool = False,
) -> Predictors:
    """:func:`calibrate` on explicitly given MoE layouts (objects with ``layer_index``, ``block``,
    ``num_experts``, ``hidden_size`` and ``expert_output(x, u)``)."""
    from tqdm.auto import tqdm

    check_holdout(holdout)
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if isinstance(ridge_sweep, numbers.Real):  # one value: a sweep of one
        ridge_sweep = [ridge_sweep]
    ridge_sweep = [float(r) for r in ridge_sweep]
    if not all(math.isfinite(r) and r >= 0 for r in [ridge, *ridge_sweep]):
        raise ValueError(f"ridge must be finite and >= 0, got {ridge} (sweep: {ridge_sweep})")
    layouts = sorted(layouts, key=lambda layout: layout.layer_index)
    for layout in layouts:
        state = getattr(layout.block, "_base_moe", None)  # set by base_moe.apply
        if getattr(getattr(state, "settings", None), "active", False):
            raise ValueError(
                "calibration runs the dense model, but this model has an expert budget (base_moe.apply): call "
                "base_moe.configure(model, policy='dense') or base_moe.restore(model) first"
            )
    device = torch.device(device) if device is not None else _input_device(model)
    sums: dict[int, RidgeAccumulator] = {}
    grams: dict[int, torch.Tensor] = {}
    rows_seen = {layout.layer_index: 0 for layout in layouts}
    current: dict[str, Any] = {}  # the batch in flight: its held-out row mask

    def make_hook(layout: Any, last: bool):
        def hook(module, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            x = x.reshape(-1, layout.hidden_size)
            held = current["held_rows"]
            if x.shape[0] != held.shape[0]:
                raise RuntimeError(
                    f"MoE layer {layout.layer_index} got {x.shape[0]} tokens for a batch of {held.shape[0]}"
                )
            if layout.layer_index not in sums:
                sums[layout.layer_index] = RidgeAccumulator(layout.hidden_size, layout.num_experts, x.device)
            sums[layout.layer_index].add(x, expert_log_norms(layout, x), held)
            if similarity:
                gram = expert_output_gram(layout, x)
                grams[layout.layer_index] = grams[layout.layer_index] + gram if layout.layer_index in grams else gram
            rows_seen[layout.layer_index] += x.shape[0]
            if last:
                raise _StopForward

        return hook

    use_cuda = device.type == "cuda"
    if use_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    was_training = model.training
    model.eval()
    handles = [
        layout.block.register_forward_pre_hook(make_hook(layout, i == len(layouts) - 1), with_kwargs=True)
        for i, layout in enumerate(layouts)
    ]
    sequences, tokens_fed, seq_lens = 0, 0, set()
    vocab = vocab_size(model)
    try:
        with torch.no_grad(), tqdm(
            total=_total_tokens(input_ids), unit="tok", unit_scale=True, desc="calibrate", disable=not progress
        ) as bar:
            for batch in _batches(input_ids, batch_size, vocab):
                b, s = batch.shape
                if s not in seq_lens:
                    warn_past_context(model, s, stacklevel=3)  # calibrate's caller
                held_seq = held_out_sequences(sequences, b, holdout)
                current["held_rows"] = held_seq.repeat_interleave(s).to(device)
                try:
                    model(input_ids=batch.to(device), use_cache=False)
                except _StopForward:
                    pass
                sequences += b
                tokens_fed += batch.numel()
                seq_lens.add(s)
                bar.update(batch.numel())
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    if tokens_fed == 0:
        raise ValueError("input_ids holds no sequences: nothing to calibrate on")
    if any(n != tokens_fed for n in rows_seen.values()):
        raise RuntimeError(f"every MoE layer must see every calibration token; tokens seen per layer: {rows_seen}")

    weight, bias, mean, r2, expert_r2 = {}, {}, {}, {}, {}
    fits: dict[int, RidgeFit] = {}
    r2_by_ridge: dict[float, dict[int, float]] = {}
    for layout in layouts:
        i = layout.layer_index
        fit = sums[i].fit(ridge)
        for r in ridge_sweep:
            try:
                swept_r2 = sums[i].fit(r).r2
            except ValueError:  # a swept value too small for these tokens: no fit there, not a failed calibration
                swept_r2 = math.nan
            r2_by_ridge.setdefault(r, {})[i] = swept_r2
        fits[i] = fit
        weight[i], bias[i], mean[i] = fit.weight.float().cpu(), fit.bias.float().cpu(), fit.mean_target.float().cpu()
        expert_r2[i], r2[i] = fit.expert_r2.float().cpu(), fit.r2
    del sums
    elapsed = time.perf_counter() - start

    first = fits[layouts[0].layer_index]
    if holdout > 0 and first.tokens_holdout == 0:
        needed = math.ceil(1 / holdout_fraction(holdout))  # 0-based sequence needed - 1 is the first held out
        warnings.warn(
            f"no sequence was held out: the held-out R^2 needs at least {needed} sequences with holdout={holdout}, "
            f"got {sequences}; it is NaN", stacklevel=3)
    elif holdout > 0 and first.tokens_holdout == 1:
        warnings.warn("one token was held out: the held-out R^2 needs at least 2; it is NaN (calibrate on longer "
                      "or more sequences)", stacklevel=3)
    experts = sorted({layout.num_experts for layout in layouts})
    routing = getattr(layouts[0], "routing", None)
    config = getattr(model, "config", None)
    metadata = {
        "format": FORMAT,
        "model_type": model_type(model),
        "model_name_or_path": str(getattr(config, "_name_or_path", "") or ""),
        "model_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "hidden_size": layouts[0].hidden_size,
        "num_experts": experts[0] if len(experts) == 1 else {str(x.layer_index): x.num_experts for x in layouts},
        "layers": [layout.layer_index for layout in layouts],
        "routing": _routing_dict(routing),
        "tokens": first.tokens_train + first.tokens_holdout,
        "tokens_train": first.tokens_train,
        "tokens_holdout": first.tokens_holdout,
        "sequences": sequences,
        "seq_len": seq_lens.pop() if len(seq_lens) == 1 else None,
        "ridge": ridge,
        "ridge_scale": "per feature: ridge * its variance x tokens (ridge on standardised features); bias not penalised",
        "holdout": float(holdout_fraction(holdout)),  # the fraction the split used (denominator <= 10,000)
        "holdout_split": "sequence i held out when floor((i+1)*holdout) > floor(i*holdout)",
        "target": f"log(max(||E_u(z)||_2, {LOG_NORM_FLOOR})): unweighted routed-expert output at the MoE block input z",
        "base_moe_version": _version(),
    }
    if similarity:
        metadata["similarity"] = "cosine of the experts' outputs (unweighted, at the MoE block input z) over all tokens"
    similarities = {i: cosine_similarity_from_gram(gram).cpu() for i, gram in grams.items()}
    predictors = Predictors(weight, bias, mean, r2, metadata, expert_r2, similarities)
    predictors.stats = {"seconds": elapsed, "tokens": first.tokens_train + first.tokens_holdout, "device": str(device)}
    if r2_by_ridge:
        predictors.stats["r2_by_ridge"] = r2_by_ridge
    if use_cuda:
        predictors.stats["peak_cuda_bytes"] = torch.cuda.max_memory_allocated(device)
    predictors.stats["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return predictors


def _routing_dict(routing: Any) -> dict[str, Any] | None:
    if routing is None:
        return None
    return {
        "top_k": int(routing.top_k),
        "scoring": getattr(routing.scoring, "name", str(routing.scoring)),
        "renormalize": bool(routing.renormalize),
        "n_group": int(routing.n_group),
        "topk_group": int(routing.topk_group),
        "scaling": float(routing.scaling),
    }


def _version() -> str:
    from . import __version__

    return __version__
