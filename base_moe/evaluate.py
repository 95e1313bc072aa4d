"""The forced-token evaluation harness: quality of budgeted decoding, policy against policy.

``B`` sequences of ``S`` tokens from held-out text form one evaluation batch. Positions ``< P`` are prefill and run
the model's own (dense) routing; at every later position the ``B`` tokens of that position are one decode batch,
and every MoE layer applies the policy to that batch. The model is patched with ``base_moe.apply(...,
group_by="position", dense_positions=P)``, so one forward over ``[B, S]`` evaluates all ``S - P`` decode steps at
once (teacher forcing: every position sees the true previous tokens, and the states of earlier positions carry the
policy's effect through attention, as they would in real decoding).

Per policy and budget (:func:`evaluate`):

* ``bits``: the mean next-token cross-entropy in bits (bits per byte for byte-level models) of the predictions
  made at decode positions (logits of positions ``P .. S-2`` for the tokens ``P+1 .. S-1``), and ``delta_bits``,
  its increase over the dense model on the same tokens, with the standard error of the per-batch differences;
* ``retained_energy``: over every routed slot ``(t, u)`` (the model's own routing of the policy run's inputs
  ``z_t``), ``sum w_tu^2 ||E_u(z_t)||^2`` of the slots the token still uses, divided by the sum over all routed
  slots, from the true expert outputs; pooled over tokens per layer, then averaged over layers;
* ``active``: the mean number of experts in use (the union of the tokens' final experts) per layer and decode
  batch; ``dense.union`` is the same for the model's own routing;
* on CUDA, ``time_us``: one MoE block's time for one decode batch of ``B`` tokens (``[B, 1, H]``, CUDA-graph
  replay when the block captures, else eager; median over repeats, averaged over layers), and ``time_mode``: how
  it was timed (``graph``, ``eager``, or ``mixed`` over the layers; per layer in ``time_graphed_per_layer``).
  :func:`format_table` and :func:`plot` mark the rows not timed by graph replay.

:func:`format_table` prints the result, :func:`plot` draws quality loss against active experts (and against time
on CUDA), one line per policy, and ``python -m base_moe eval`` runs it all from the command line.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F

from . import hf, reference
from .inputs import check_token_ids, vocab_size, warn_past_context
from .policies import SUBSTITUTE, Policy, fill_name, get_policy, parse_fill

__all__ = [
    "evaluate", "format_table", "plot", "make_batches", "budgets_between", "dense_union", "machine_info", "git_commit",
    "check_prefill", "json_ready", "standard_error", "DENSE_UNION_BATCHES",
]

DENSE_UNION_BATCHES = 4
"""How many batches :func:`dense_union` reads by default: enough to place the budgets (the report counts every
batch)."""


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------
def make_batches(input_ids: torch.Tensor, batch: int, seq: int, batches: int,
                 vocab_size: int | None = None) -> torch.Tensor:
    """``[batches, batch, seq]`` consecutive, non-overlapping sequences from the start of ``input_ids`` (a 1-D
    token stream, or ``[N, L]`` rows that are flattened in order) of integer token ids, each in ``[0, vocab_size)``
    (without ``vocab_size``: ``>= 0``)."""
    for name, value in (("batch", batch), ("seq", seq), ("batches", batches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    ids = torch.as_tensor(input_ids).reshape(-1)
    need = batches * batch * seq
    if ids.numel() < need:
        have = ids.numel() // (batch * seq)
        raise ValueError(
            f"{batches} batches of {batch} x {seq} tokens need {need} tokens, the text gives {ids.numel()} "
            f"(enough for {have} batches): use a longer text or fewer --batches"
        )
    check_token_ids(ids[:need], vocab_size)
    return ids[:need].reshape(batches, batch, seq).long()


def budgets_between(union: float, low: float = 1 / 3, high: float = 1 / 2) -> list[int]:
    """Every integer budget in ``[low * union, high * union]`` (at least one: the nearest to their middle)."""
    if not 0 < union < math.inf:
        raise ValueError(f"the dense union must be a positive number of experts, got {union}")
    lo, hi = math.ceil(low * union - 1e-9), math.floor(high * union + 1e-9)
    return list(range(lo, hi + 1)) if lo <= hi else [max(1, round((low + high) / 2 * union))]


def check_policies_fit(policies, layouts) -> None:
    """Raises ``ValueError`` when an option of a policy is out of range for one of the MoE layers (e.g. OEA's k0 past
    the model's top-k): before any pass over the data, so that a bad option costs no evaluation time."""
    for layout in layouts:
        for policy in policies:
            policy.check_layout(layout)


@torch.no_grad()
def dense_union(model, input_ids, *, batch: int, seq: int, prefill: int, batches: int = DENSE_UNION_BATCHES,
                device: torch.device | str | None = None) -> float:
    """The mean number of experts the model's own routing uses per MoE layer and decode batch (the union of the
    ``batch`` tokens' routed experts at each decode position), over the first ``batches`` batches: the
    reference for choosing budgets (e.g. :func:`budgets_between`)."""
    from .layouts import find_moe_layouts

    check_prefill(prefill, seq)
    layouts = hf.moe_layouts(model) if hf.is_applied(model) else find_moe_layouts(model)
    if hf.is_applied(model) and hf.moe_layouts(model)[0].block._base_moe.settings.active:
        raise ValueError("dense_union needs the model's own routing: configure(model, policy='dense') first")
    device = torch.device(device) if device is not None else _device_of(model)
    data = make_batches(input_ids, batch, seq, batches, vocab_size(model))
    capture = _Capture(layouts, prefill)
    total, count = 0.0, 0
    try:
        for ids in data:
            model(input_ids=ids.to(device), use_cache=False)
            for lay in layouts:
                x = capture.inputs[lay.layer_index]
                routed, _ = reference.route(lay.router_logits(x), lay.routing, lay.correction_bias())
                total += float(_active_per_group(routed, seq - prefill, lay.num_experts).sum())
                count += seq - prefill
    finally:
        capture.remove()
    return total / count


# ---------------------------------------------------------------------------------------------
# Accumulators
# ---------------------------------------------------------------------------------------------
@dataclass
class _Run:
    """Sums of one (policy, budget) over the batches."""

    policy: str
    budget: int | None
    nll_bits: list[float] = field(default_factory=list)  # per batch: summed bits over the scored tokens
    tokens: list[int] = field(default_factory=list)
    active: dict[int, list[float]] = field(default_factory=dict)  # layer -> summed |A| over groups, group count
    energy: dict[int, list[float]] = field(default_factory=dict)  # layer -> [kept, routed]
    time_us: dict[int, float] = field(default_factory=dict)
    time_graphed: dict[int, bool] = field(default_factory=dict)  # layer -> timed by CUDA-graph replay (else eager)


def _add(d: dict[int, list[float]], key: int, *values: float) -> None:
    acc = d.setdefault(key, [0.0] * len(values))
    for i, v in enumerate(values):
        acc[i] += v


class _Capture:
    """Forward pre-hooks that keep each MoE block's decode-position inputs, group after group ``[(S-P)*B, H]``."""

    def __init__(self, layouts, prefill: int):
        self.inputs: dict[int, torch.Tensor] = {}
        self.prefill = prefill
        self.enabled = True
        self.handles = [lay.block.register_forward_pre_hook(self._hook(lay)) for lay in layouts]

    def _hook(self, layout):
        def hook(module, args):
            x = args[0]
            if self.enabled and x.dim() == 3:
                B, S, H = x.shape
                self.inputs[layout.layer_index] = x[:, self.prefill :].transpose(0, 1).reshape(-1, H).detach()

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def standard_error(values: Sequence[float]) -> float:
    """The standard error of the mean of ``values`` (sample standard deviation / sqrt(n)); NaN for fewer than two."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def _per_layer(values: dict[int, int]) -> int | dict[int, int]:
    """The one value every MoE layer has, else the value per layer index (the report's model section)."""
    distinct = set(values.values())
    return distinct.pop() if len(distinct) == 1 else values


def _active_per_group(ids: torch.Tensor, num_groups: int, num_experts: int) -> torch.Tensor:
    """``[G]``: number of distinct experts among the final ids of each group (sentinels excluded)."""
    return reference.routed_union(ids, num_groups, num_experts).sum(dim=1)


@torch.no_grad()
def _energy(layout, x: torch.Tensor, final_ids: torch.Tensor | None) -> tuple[float, float]:
    """``(kept, routed)`` sums of ``w^2 ||E_u(x_t)||^2`` over the model's routed slots of ``x`` (kept: the token's
    final set still holds the expert; ``final_ids=None``: all kept). Runs each expert on its routed tokens only."""
    E = layout.num_experts
    logits = layout.router_logits(x)
    ids, weights = reference.route(logits, layout.routing, layout.correction_bias())
    ids = ids.long()
    energy = torch.zeros_like(weights)
    for u in torch.unique(ids[ids < E]).tolist():
        token, slot = torch.nonzero(ids == u, as_tuple=True)
        out = layout.expert_output(x[token], u)
        energy[token, slot] = weights[token, slot] ** 2 * out.float().pow(2).sum(dim=-1)
    routed = float(energy.sum())
    if final_ids is None:
        return routed, routed
    still = (ids[:, :, None] == final_ids.long()[:, None, :]).any(dim=-1) & (ids < E)
    return float(energy[still].sum()), routed


# ---------------------------------------------------------------------------------------------
# Timing (CUDA)
# ---------------------------------------------------------------------------------------------
def _time_block(block, x: torch.Tensor, repeats: int) -> tuple[float, bool]:
    """Median microseconds of ``block(x)``: CUDA-graph replay if the call captures, else eager with events."""

    def call():
        return block(x)

    with torch.no_grad():
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        graph, graphed = None, False
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                call()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            graph.replay()
            torch.cuda.synchronize()
            graphed = True
        except Exception:  # noqa: BLE001 - host syncs or data-dependent shapes: time it eagerly
            graph = None
            torch.cuda.synchronize()
        run = graph.replay if graphed else call
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times), graphed


def _time_layers(model, layouts, inputs: dict[int, torch.Tensor], batch: int,
                 repeats: int) -> tuple[dict[int, float], dict[int, bool]]:
    """Per MoE layer, one decode batch (the first decode position's ``B`` tokens) through the patched block in
    ``group_by='batch'`` mode: its microseconds, and whether they are a CUDA-graph replay's (else eager)."""
    settings = hf.moe_layouts(model)[0].block._base_moe.settings
    hf.configure(model, group_by="batch", record=False)
    times, graphed = {}, {}
    try:
        for lay in layouts:
            x = inputs[lay.layer_index][:batch].reshape(batch, 1, -1).contiguous()
            times[lay.layer_index], graphed[lay.layer_index] = _time_block(lay.block, x, repeats)
    finally:
        hf.configure(model, group_by=settings.group_by, record=settings.record)
    return times, graphed


def _timing(run: _Run) -> dict[str, Any]:
    """A result row's time fields: the mean over layers, per layer, and how they were timed (``time_mode``:
    ``graph`` where every layer replayed a CUDA graph, ``eager`` where none did, else ``mixed``)."""
    if not run.time_us:
        return {"time_us": None, "time_us_per_layer": None, "time_mode": None, "time_graphed_per_layer": None}
    graphed = [run.time_graphed[i] for i in run.time_us]
    return {
        "time_us": statistics.fmean(run.time_us.values()),
        "time_us_per_layer": {str(i): t for i, t in sorted(run.time_us.items())},
        "time_mode": "graph" if all(graphed) else "mixed" if any(graphed) else "eager",
        "time_graphed_per_layer": {str(i): run.time_graphed[i] for i in sorted(run.time_us)},
    }


# ---------------------------------------------------------------------------------------------
# The harness
# ---------------------------------------------------------------------------------------------
def check_prefill(prefill: int, seq: int) -> None:
    """Raises ``ValueError`` unless ``prefill`` dense positions leave a scored decode position in ``seq``: the
    protocol's rule, for callers that check their arguments before loading a model (the CLI, the examples)."""
    if not 0 <= prefill < seq - 1:
        raise ValueError(f"prefill must be in [0, seq - 2] (at least one scored decode position), got {prefill}")


def _budgets(budgets: Sequence[int] | int) -> list[int]:
    """Sorted distinct budgets, each as ``apply`` takes one (2.9 is refused, not run as 2); one value is a list of
    one."""
    if not isinstance(budgets, Iterable):
        budgets = [budgets]
    try:
        return sorted({hf._budget(b) for b in budgets})
    except ValueError:
        raise ValueError(f"budgets must be ints >= 1, got {list(budgets)}") from None


def json_ready(value: Any) -> Any:
    """``value`` (e.g. :func:`evaluate`'s result) with every NaN or infinity as None: strict JSON (a one-batch
    run has no standard error)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v) for v in value]
    return value


def _resolve_policies(policies: Sequence[str | Policy] | str | Policy) -> list[Policy]:
    if isinstance(policies, (str, Policy)):  # one policy, not its name's letters
        policies = [policies]
    out = []
    for p in policies:
        pol = get_policy(p)
        if pol.name not in [q.name for q in out]:
            out.append(pol)
    return out


def _settings_dict(settings: hf.Settings) -> dict[str, Any]:
    """Every field of a patched model's settings, as ``configure`` takes them."""
    return {f.name: getattr(settings, f.name) for f in fields(settings)}


def _device_of(model) -> torch.device:
    try:
        return model.get_input_embeddings().weight.device
    except (AttributeError, NotImplementedError):
        return next(model.parameters()).device


def evaluate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
    predictors=None,
    policies: Sequence[str | Policy] | str | Policy = ("base", "router_sum", "oracle"),
    budgets: Sequence[int] | int = (),
    batch: int = 16,
    seq: int = 256,
    prefill: int = 32,
    batches: int = 8,
    fill: str = "backfill",
    device: torch.device | str | None = None,
    progress: bool = True,
    energy: bool = True,
    timing: bool | None = None,
    repeats: int = 50,
    byte_level: bool | None = None,
) -> dict[str, Any]:
    """Evaluate budgeted decoding under each policy and budget with the forced-token protocol (module docstring).

    Args:
        model: a Hugging Face MoE causal LM (patched by ``base_moe.apply`` or not: it is patched for the run and
            left as it was found). The run takes ``apply``'s defaults for every option it does not set (``experts``,
            ``norm``, ``finished_tokens=None``: every token of the text votes, pad and EOS ids included), so a model
            patched for serving gives the numbers of an unpatched one; the user's settings come back afterwards.
        input_ids: held-out token ids (integers in ``[0, vocab_size)``), a 1-D stream or ``[N, L]`` rows (read in
            order); the first ``batches * batch * seq`` are used.
        predictors: a ``base_moe.Predictors`` or its file (needed by ``base`` and ``static_energy``).
        policies: policy names (``"oea:k0=2"`` style options allowed) or :class:`~base_moe.policies.Policy`
            instances, or one of them; ``dense`` is always measured as the reference. Policies with their own size
            rule (``oea``, ``lynx:threshold=X``, ``topk_reduce``) run once, whatever the budgets.
        budgets: experts kept per layer and decode batch (one or several), for the budgeted policies.
        batch, seq, prefill, batches: ``B`` sequences of ``S`` tokens per batch, ``P`` dense prefill positions,
            number of batches.
        fill: ``backfill`` (default), ``drop``, ``drop_renorm`` or ``substitute`` (predictors calibrated with
            ``similarity=True``).
        device: where to run (default: the model's device; the model is moved there).
        progress: show a progress bar (tqdm) over the runs.
        energy: compute the retained energy (runs each expert on its routed tokens once more per run).
        timing: time one MoE block per decode batch (default: on CUDA only; CUDA needed).
        repeats: timing repeats (median).
        byte_level: each token is a byte, so the unit is bits per byte (default: a vocabulary of exactly 256).

    Returns a dict (pass it through :func:`json_ready` for strict JSON: a one-batch run's standard errors are NaN):
    ``protocol``, ``model``, ``predictors``, ``unit``, ``dense`` (bits, union per layer, time), ``results`` (one entry
    per policy and budget), ``machine`` and ``seconds``.
    """
    start = time.perf_counter()
    check_prefill(prefill, seq)
    warn_past_context(model, seq, stacklevel=2)
    fill_rule = parse_fill(fill)
    pols = [p for p in _resolve_policies(policies) if p.budgeted]
    budgets = _budgets(budgets)
    if not budgets and any(p.needs_budget for p in pols):
        raise ValueError(
            "policies " + ", ".join(p.name for p in pols if p.needs_budget) + " need budgets (e.g. budgets=[8, 16])"
        )
    device = torch.device(device) if device is not None else _device_of(model)
    if _device_of(model) != device:
        model.to(device)
    timing = device.type == "cuda" if timing is None else bool(timing)
    if timing and device.type != "cuda":
        raise ValueError(f"timing=True needs a CUDA device, the run is on {device}")
    data = make_batches(input_ids, batch, seq, batches, vocab_size(model))

    patched_here = not hf.is_applied(model)
    has_predictors = predictors is not None or (
        not patched_here and hf.moe_layouts(model)[0].block._base_moe.predictors is not None)
    for pol in pols:
        if pol.needs_calibration and not has_predictors:
            raise ValueError(
                f"policy '{pol.name}' needs predictors: run base_moe.calibrate(...) or pass predictors=path"
            )
    run_settings = dict(budget=None, policy="dense", fill=fill_rule, group_by="position", dense_positions=prefill,
                        record=True)
    if patched_here:
        hf.apply(model, predictors=predictors, **run_settings)
    else:
        old = hf.moe_layouts(model)[0].block._base_moe.settings
        old_predictors = hf.moe_layouts(model)[0].block._base_moe.predictors
        extra = {} if predictors is None else {"predictors": predictors}
        # every other setting at apply's default, as on an unpatched model: a model patched for serving with
        # finished_tokens would leave the text's pad/EOS tokens out of the vote, experts='hf' would time other code
        hf.configure(model, **{**_settings_dict(hf.Settings()), **run_settings}, **extra)
    layouts = hf.moe_layouts(model)
    used_predictors = layouts[0].block._base_moe.predictors  # the finally below puts the user's back

    runs = [(pol, None) for pol in pols if not pol.needs_budget]
    runs += [(pol, b) for b in budgets for pol in pols if pol.needs_budget]
    dense = _Run("dense", None)
    results = [_Run(pol.name, b) for pol, b in runs]
    schedule = [(dense, get_policy("dense"), None)] + [(acc, pol, b) for acc, (pol, b) in zip(results, runs)]
    capture = _Capture(layouts, prefill)
    was_training = model.training
    model.eval()
    try:
        if fill_rule == SUBSTITUTE and any(p.takes_fill for p in pols):  # before the dense pass, not after it
            hf._require_similarity(used_predictors, layouts)
        check_policies_fit(pols, layouts)  # fails here, not after the dense pass (the finally restores the model)
        from tqdm.auto import tqdm

        with torch.no_grad(), tqdm(total=batches * (1 + len(runs)), desc="evaluate", unit="run",
                                   disable=not progress) as bar:
            for b_index in range(batches):
                ids = data[b_index].to(device)
                targets = ids[:, prefill + 1 :]
                for acc, pol, budget in schedule:
                    hf.configure(model, policy=pol, budget=budget)
                    logits = model(input_ids=ids, use_cache=False).logits
                    scored = logits[:, prefill:-1].float()
                    nll = F.cross_entropy(scored.reshape(-1, scored.shape[-1]), targets.reshape(-1), reduction="sum")
                    acc.nll_bits.append(float(nll) / math.log(2))
                    acc.tokens.append(targets.numel())
                    chosen = hf.selections(model) if acc is not dense else {}
                    groups = seq - prefill
                    for lay in layouts:
                        i, x = lay.layer_index, capture.inputs[lay.layer_index]
                        if acc is dense:
                            logits_i = lay.router_logits(x)
                            ids_i, _ = reference.route(logits_i, lay.routing, lay.correction_bias())
                            final = None
                        else:
                            sel, num_groups = chosen[i]
                            assert num_groups == groups
                            ids_i = final = sel.ids
                        _add(acc.active, i, float(_active_per_group(ids_i, groups, lay.num_experts).sum()), groups)
                        if energy and acc is not dense:
                            _add(acc.energy, i, *_energy(lay, x, final))
                    if timing and b_index == 0:
                        capture.enabled = False
                        acc.time_us, acc.time_graphed = _time_layers(model, layouts, capture.inputs, batch, repeats)
                        capture.enabled = True
                    bar.update(1)
    finally:
        capture.remove()
        model.train(was_training)
        if patched_here:
            hf.restore(model)
        else:
            with warnings.catch_warnings():  # the user's own settings back (a budget kept for a later policy)
                warnings.simplefilter("ignore", hf.SettingNotAppliedWarning)
                hf.configure(model, **_settings_dict(old), predictors=old_predictors)

    return _report(model, layouts, dense, results, runs, used_predictors, locals_=dict(
        batch=batch, seq=seq, prefill=prefill, batches=batches, fill=fill_name(fill_rule), device=str(device),
        timing=timing, energy=energy, repeats=repeats, byte_level=byte_level, seconds=time.perf_counter() - start))


def _layer_means(d: dict[int, list[float]]) -> dict[str, float]:
    return {str(i): v[0] / v[1] if v[1] else math.nan for i, v in sorted(d.items())}


def _report(model, layouts, dense: _Run, results: list[_Run], runs, predictors, locals_) -> dict[str, Any]:
    config = getattr(model, "config", None)
    vocab = vocab_size(model)
    byte_level = vocab == 256 if locals_["byte_level"] is None else locals_["byte_level"]
    dense_bits_batches = [n / t for n, t in zip(dense.nll_bits, dense.tokens)]
    dense_bits = sum(dense.nll_bits) / sum(dense.tokens)
    union = _layer_means(dense.active)
    out: dict[str, Any] = {
        "protocol": {
            "batch": locals_["batch"], "seq": locals_["seq"], "prefill": locals_["prefill"],
            "batches": locals_["batches"], "fill": locals_["fill"], "device": locals_["device"],
            "decode_positions": locals_["seq"] - locals_["prefill"],
            "scored_tokens": sum(dense.tokens),
            "scoring": "logits of positions P..S-2 for tokens P+1..S-1 (every prediction made by a decode step)",
            "energy": "sum over routed slots still used of w^2 ||E_u(z)||^2 / sum over routed slots (true outputs)",
            "timing": ("one MoE block, one decode batch [B, 1, H], median of repeats; CUDA-graph replay where the "
                       "block captures, else eager (time_mode: graph, eager or mixed over the layers)")
            if locals_["timing"] else None,
        },
        "model": {
            "type": getattr(config, "model_type", None),
            "name_or_path": str(getattr(config, "_name_or_path", "") or ""),
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "moe_layers": [lay.layer_index for lay in layouts],
            "num_experts": _per_layer({lay.layer_index: lay.num_experts for lay in layouts}),
            "top_k": _per_layer({lay.layer_index: lay.routing.top_k for lay in layouts}),
            "hidden_size": layouts[0].hidden_size,
            "vocab_size": vocab,
        },
        "predictors": None if predictors is None else {
            k: predictors.metadata.get(k) for k in ("tokens", "tokens_holdout", "ridge", "r2", "model_dtype")
        },
        "unit": "bits/byte" if byte_level else "bits/token",
        "dense": {
            "bits": dense_bits,
            "bits_per_batch": dense_bits_batches,
            "union": statistics.fmean(union.values()),
            "union_per_layer": union,
            **_timing(dense),
        },
        "results": [],
    }
    for run, (pol, budget) in zip(results, runs):
        bits = sum(run.nll_bits) / sum(run.tokens)
        deltas = [n / t - d for n, t, d in zip(run.nll_bits, run.tokens, dense_bits_batches)]
        stderr = standard_error(deltas)
        active = _layer_means(run.active)
        energy = {str(i): v[0] / v[1] if v[1] else math.nan for i, v in sorted(run.energy.items())}
        out["results"].append({
            "policy": run.policy,
            "budget": budget,
            "bits": bits,
            "delta_bits": bits - dense_bits,
            "delta_bits_stderr": stderr,
            "bits_per_batch": [n / t for n, t in zip(run.nll_bits, run.tokens)],
            "retained_energy": statistics.fmean(energy.values()) if energy else None,
            "retained_energy_per_layer": energy or None,
            "active": statistics.fmean(active.values()),
            "active_per_layer": active,
            **_timing(run),
            "description": pol.description,
        })
    out["machine"] = machine_info(locals_["device"])
    out["seconds"] = locals_["seconds"]
    return out


def machine_info(device: str = "cpu") -> dict[str, Any]:
    """Machine, versions and git commit, for result files."""
    import transformers

    from . import __version__

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "base_moe": __version__,
        "threads": torch.get_num_threads(),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
    info["git_commit"] = git_commit()
    return info


def git_commit(root: str = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) -> str | None:
    """The commit measured: $BASE_MOE_COMMIT where set (a copy of the tree whose .git does not follow the commits, as on
    a lent GPU machine), else the git HEAD of the source tree ``root`` (the package's parent folder), else None: an
    installed copy in site-packages has no tree of its own, and a repository around it (a project's .venv) is not
    the one measured."""
    if os.environ.get("BASE_MOE_COMMIT"):
        return os.environ["BASE_MOE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=root).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    if len(out) != 2 or os.path.realpath(out[0]) != os.path.realpath(root):
        return None
    return out[1]


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------
_TIME_MARKS = {"graph": " ", "eager": "*", "mixed": "~"}  # any other (a result written before time_mode): "?"
_TIME_NOTES = {"*": "* timed eagerly (the block does not capture in a CUDA graph)",
               "~": "~ some layers timed eagerly", "?": "? not recorded how"}


def _time_mark(row: dict[str, Any]) -> str:
    """How a timed row was timed, as its table mark (blank: every layer a CUDA-graph replay)."""
    return _TIME_MARKS.get(row.get("time_mode"), "?")


def _time_cell(row: dict[str, Any]) -> str:
    """A row's ``us/layer`` cell: the time and its :func:`_time_mark`."""
    if row.get("time_us") is None:
        return f" {'-':>8} "
    return f" {row['time_us']:>8.1f}{_time_mark(row)}"


def format_table(result: dict[str, Any]) -> str:
    """The result as a text table: one row per policy and budget, sorted by budget then quality loss; a timed row
    marks a time that is not a CUDA-graph replay (footnote)."""
    unit = result["unit"]
    d = result["dense"]
    p = result["protocol"]
    timed = d.get("time_us") is not None
    head = (f"{'policy':<22} {'budget':>6} {'active':>7} {unit:>10} {'+' + unit:>10} {'+-':>7} {'energy':>7}"
            + (f" {'us/layer':>8} " if timed else ""))
    lines = [
        f"B={p['batch']} sequences x S={p['seq']} tokens, P={p['prefill']} prefill, {p['batches']} batches, "
        f"{p['scored_tokens']} scored tokens, fill={p['fill']}, device={p['device']}",
        head,
        "-" * len(head),
        f"{'dense':<22} {'-':>6} {d['union']:>7.2f} {d['bits']:>10.4f} {0.0:>10.4f} {'':>7} {1.0:>7.3f}"
        + (_time_cell(d) if timed else ""),
    ]
    rows = sorted(result["results"], key=lambda r: (r["budget"] is not None, r["budget"] or 0, r["delta_bits"]))
    last_budget = object()
    for r in rows:
        if r["budget"] != last_budget:
            lines.append("")
            last_budget = r["budget"]
        energy = f"{r['retained_energy']:.3f}" if r["retained_energy"] is not None else "-"
        budget = str(r["budget"]) if r["budget"] is not None else "-"
        t = _time_cell(r) if timed else ""
        stderr = r["delta_bits_stderr"]  # NaN (null once through JSON) from a single batch
        stderr = f"{stderr:.4f}" if stderr is not None and math.isfinite(stderr) else "-"
        lines.append(
            f"{r['policy']:<22} {budget:>6} {r['active']:>7.2f} {r['bits']:>10.4f} {r['delta_bits']:>+10.4f} "
            f"{stderr:>7} {energy:>7}{t}"
        )
    lines.append(f"active: mean experts in use per layer and decode batch (dense: the routed union); "
                 f"+-: standard error of the per-batch increase; energy: retained w^2||E||^2")
    if timed:
        marks = {_time_mark(r) for r in [d, *result["results"]] if r.get("time_us") is not None} - {" "}
        lines.append("us/layer: one MoE block per decode batch, CUDA-graph replay"
                     + "".join(f"; {_TIME_NOTES[m]}" for m in sorted(marks, key="*~?".index)))
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """Quality loss against active experts (and against time when timed), one line per policy; PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = result["dense"].get("time_us") is not None
    fig, axes = plt.subplots(1, 2 if timed else 1, figsize=(12 if timed else 7, 5), squeeze=False)
    # one line per budgeted policy over its budgets, and one per family of policies with their own size rule over
    # their options (oea, oea:k0=2, ...), marked when the family also runs budgeted (lynx, lynx:threshold=4)
    budgeted = {r["policy"] for r in result["results"] if r["budget"] is not None}
    by_policy: dict[str, list[dict]] = {}
    for r in result["results"]:
        family = r["policy"] if r["budget"] is not None else r["policy"].split(":")[0]
        if r["budget"] is None and family in budgeted:
            family += " (no budget)"
        by_policy.setdefault(family, []).append(r)
    xs = [("active", "active experts per layer and decode batch", result["dense"]["union"])]
    if timed:
        xs.append(("time_us", "MoE layer time per decode step (us)", result["dense"]["time_us"]))
    for ax, (key, label, dense_x) in zip(axes[0], xs):
        for name, rows in by_policy.items():
            rows = sorted(rows, key=lambda r: r[key])
            ax.plot([r[key] for r in rows], [r["delta_bits"] for r in rows], marker="o", label=name)
        ax.scatter([dense_x], [0.0], marker="*", s=150, color="black", zorder=5, label="dense")
        if key == "time_us":  # ring the times that are not a CUDA-graph replay's
            eager = [(r["time_us"], r["delta_bits"]) for r in [{**result["dense"], "delta_bits": 0.0},
                                                                *result["results"]]
                     if r.get("time_us") is not None and r.get("time_mode") in ("eager", "mixed")]
            if eager:
                ax.scatter(*zip(*eager), marker="o", s=200, facecolors="none", edgecolors="red", zorder=6,
                           label="timed eagerly (no CUDA graph), all or some layers")
                ax.legend(fontsize=8)
        ax.set_xlabel(label)
        ax.set_ylabel(f"quality loss ({result['unit']} over dense)")
        ax.set_yscale("symlog", linthresh=0.01)
        ax.grid(True, alpha=0.3)
    p = result["protocol"]
    fig.suptitle(f"{result['model'].get('name_or_path') or result['model']['type']}: B={p['batch']}, "
                 f"P={p['prefill']}, S={p['seq']}, {p['batches']} batches, fill={p['fill']}")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
