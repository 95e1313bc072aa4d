"""``python -m base_moe COMMAND``: command-line entry points.

Each subcommand is an ``add_<name>(subparsers)`` function that builds its parser and sets ``func`` to the
function that runs it; :data:`COMMANDS` lists them. :func:`load_ids_and_model` (over :func:`load_token_ids` and
:func:`load_model`) is shared by every command that reads a local model directory and a text file.
"""

from __future__ import annotations

import argparse
import math
import os
import resource
import shlex
import sys
import time
from collections.abc import Callable

import torch

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------
def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(arg: str | None) -> str:
    """``--device`` checked before any work: the default (cuda when available, else cpu), or a device torch
    knows and this machine has."""
    if arg is None:
        return default_device()
    try:
        device = torch.device(arg)
    except RuntimeError:
        raise SystemExit(f"error: --device {arg!r} is not a device (cuda, cpu, cuda:1, ...)") from None
    if device.type not in ("cpu", "cuda"):
        raise SystemExit(f"error: --device {arg}: base_moe runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {arg}: no CUDA device is available here (use --device cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise SystemExit(f"error: --device {arg}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return arg


def model_dtype(arg: str, device: str) -> str:
    """``--dtype``: ``auto`` is the checkpoint's dtype, except float32 on the CPU (whose bf16 matmuls are slow and
    round more), for calibration and evaluation alike."""
    return "float32" if arg == "auto" and torch.device(device).type == "cpu" else arg


def check_input_file(path: str, flag: str) -> None:
    if not os.path.isfile(path):
        raise SystemExit(f"error: {flag} {path!r} is not a file")


def check_distinct_files(inputs: dict[str, str | None], outputs: dict[str, str | None]) -> None:
    """No output file may be an input or another output (the run would overwrite the one with the other); ``None``
    paths are flags not given."""
    seen = {os.path.realpath(path): flag for flag, path in inputs.items() if path}
    for flag, path in outputs.items():
        if not path:
            continue
        other = seen.setdefault(os.path.realpath(path), flag)
        if other != flag:
            raise SystemExit(f"error: {flag} {path!r} is the file {other} names too; give {flag} another file")


def check_output_file(path: str, flag: str) -> None:
    """Before the work, not after it: the file's folder must exist and be writable (and the file, if it exists)."""
    folder = os.path.dirname(os.path.abspath(path))
    if not path or os.path.isdir(path) or path.endswith(tuple(filter(None, (os.sep, os.altsep)))):
        raise SystemExit(f"error: {flag} {path!r} is a directory or empty; give a file name")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise SystemExit(f"error: {flag} {path!r} exists and is not writable")
    if not os.path.isdir(folder):
        raise SystemExit(f"error: {flag} {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK):
        raise SystemExit(f"error: {flag} {path!r}: the folder {folder!r} is not writable")


def bounded(kind: type, low: float, high: float | None = None, high_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` that parses ``kind`` (finite) and checks ``low <= value`` (and ``value <= high``, or
    ``< high`` with ``high_open``), so that a bad value is a usage error before the model loads."""
    name = "an integer" if kind is int else "a number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
        above = high is not None and (value >= high if high_open else value > high)
        if (kind is float and not math.isfinite(value)) or value < low or above:
            upper = "" if high is None else f" and {'<' if high_open else '<='} {high}"
            raise argparse.ArgumentTypeError(f"expected {name} >= {low}{upper}, got {text}")
        return value

    return parse


positive_int = bounded(int, 1)
nonnegative_float = bounded(float, 0.0)


def holdout_value(text: str) -> float:
    """``--holdout``: a fraction calibrate's split can take, checked as a usage error before the model loads."""
    from .calibrate import check_holdout

    value = bounded(float, 0.0, 1.0, high_open=True)(text)
    try:
        check_holdout(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def check_plot_output(path: str) -> None:
    """``--plot`` before the work: a writable file (:func:`check_output_file`) in a format matplotlib writes."""
    check_output_file(path, "--plot")
    check_plot_format(path)


def check_plot_format(path: str) -> None:
    """Before the evaluation: matplotlib must be able to write the file's format (named by its extension)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib (pip install matplotlib)") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    extension = os.path.splitext(path)[1].lstrip(".").lower()
    if extension and extension not in formats:  # (no extension: matplotlib writes a PNG)
        raise SystemExit(f"error: --plot {path!r}: matplotlib writes {', '.join(sorted(formats))}; name the file "
                         "with one of these extensions")


def model_context(path: str) -> int | None:
    """The checkpoint's context (``max_position_embeddings`` in its config.json, or its text model's), if it says."""
    import json

    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        sections = (config, config.get("text_config") or {})
        values = [section.get("max_position_embeddings") for section in sections]
    except (OSError, ValueError, AttributeError) as err:
        raise SystemExit(f"error: --model {path!r}: its config.json is not a readable JSON object ({err})") from None
    return next((v for v in values if isinstance(v, int) and not isinstance(v, bool) and v > 0), None)


def resolve_seq(seq: int | None, model_path: str, default: int) -> int:
    """``--seq`` checked against the model's context (positions past it are off the model's distribution); without
    one, ``default`` or the context if shorter."""
    context = model_context(model_path)
    if seq is None:
        return min(default, context) if context else default
    if context and seq > context:
        raise SystemExit(f"error: --seq {seq} is longer than the model's context (max_position_embeddings "
                         f"{context})")
    return seq


def check_model_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise SystemExit(f"error: --model {path!r} is not a directory (a local Hugging Face checkpoint is needed)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"error: --model {path!r} has no config.json: not a Hugging Face checkpoint folder")


def require_transformers() -> None:
    """The commands load Hugging Face checkpoints, and transformers is an extra (``base_moe[hf]``), not a core
    dependency: say so before any work instead of failing at the model load."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit('error: this command loads Hugging Face models and needs transformers: '
                         'pip install "transformers>=5.0" (or install base_moe with its extra: ".[hf]")') from None


def load_model(path: str, device: str, dtype: str = "auto") -> torch.nn.Module:
    """A causal LM from a local directory (never the network), in eval mode, on ``device``; the commands call
    :func:`require_transformers` before any work."""
    from transformers import AutoModelForCausalLM

    check_model_dir(path)
    kwargs = dict(local_files_only=True, dtype=DTYPES[dtype])
    try:
        model = AutoModelForCausalLM.from_pretrained(path, device_map=device, **kwargs)
    except (ImportError, ValueError, TypeError):  # device_map not usable here: load on the CPU, then move
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device)
    return model.eval()


def load_token_ids(text_path: str, model_path: str, tokens: int, seq: int, byte_level: bool) -> torch.Tensor:
    """The first ``tokens`` tokens of the text file as ``[tokens // seq, seq]`` int64 (a shorter file gives
    fewer sequences; any remainder shorter than ``seq`` is dropped). ``byte_level``: each byte of the file
    is a token id (models with a 256-entry vocabulary and no tokenizer files); otherwise the model
    directory's tokenizer encodes the text (no special tokens)."""
    if seq < 1 or tokens < seq:
        raise SystemExit(f"error: need --tokens >= --seq >= 1, got --tokens {tokens} --seq {seq}")
    if byte_level:
        with open(text_path, "rb") as f:
            data = f.read(tokens)
        ids = torch.tensor(list(data), dtype=torch.int64)  # (torch.frombuffer refuses an empty file)
    else:
        ids = _tokenize(text_path, model_path, tokens)
    n = ids.numel() // seq
    if n == 0:
        raise SystemExit(f"error: {text_path} gives {ids.numel()} tokens, fewer than one sequence of --seq {seq}")
    if n * seq < tokens:
        print(f"note: {text_path} gives {ids.numel()} tokens; using {n} sequences of {seq} ({n * seq} tokens)")
    return ids[: n * seq].reshape(n, seq).clone()


def load_ids_and_model(args: argparse.Namespace, device: str, tokens: int,
                       check_ids: Callable[[torch.Tensor], None] | None = None) -> tuple[torch.Tensor, torch.nn.Module]:
    """The text's token ids first (a bad text fails before the model loads, as does ``check_ids(ids)``), then the
    model, whose vocabulary ``--bytes`` must fit."""
    ids = load_token_ids(args.text, args.model, tokens, args.seq, args.bytes)
    if check_ids is not None:
        check_ids(ids)
    model = load_model(args.model, device, model_dtype(args.dtype, device))
    if args.bytes:
        check_byte_vocabulary(getattr(model.config, "vocab_size", None))
    return ids, model


def check_byte_vocabulary(vocab_size: int | None) -> None:
    """``--bytes`` feeds byte values as token ids: the model's vocabulary must hold all 256."""
    if vocab_size is not None and vocab_size < 256:
        raise SystemExit(f"error: --bytes needs a vocabulary of at least 256 tokens, the model has {vocab_size}")


def _tokenize(text_path: str, model_path: str, tokens: int) -> torch.Tensor:
    """Encode the start of the file, reading more of it only while fewer than ``tokens`` tokens came out."""
    from transformers import AutoTokenizer

    # transformers 5 builds an empty tokenizer for a directory without tokenizer files: look for them first
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
    if not any(os.path.exists(os.path.join(model_path, name)) for name in files):
        raise SystemExit(f"error: no tokenizer files in {model_path}; for a byte-level model pass --bytes")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: cannot load the tokenizer in {model_path} ({err}); for a byte-level model pass --bytes") from None
    chars = max(16 * tokens, 1 << 16)
    with open(text_path, encoding="utf-8", errors="replace") as f:
        text = f.read(chars)
        while True:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            more = f.read(len(text)) if len(ids) < tokens else ""
            if not more:
                return torch.tensor(ids[:tokens], dtype=torch.int64)
            text += more


def _peak_memory(device: str) -> str:
    parts = []
    if torch.device(device).type == "cuda":
        parts.append(f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
    parts.append(f"peak host RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------
# calibrate
# ---------------------------------------------------------------------------------------------
def add_calibrate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "calibrate",
        help="fit BASE's removal-cost predictors for a local MoE checkpoint",
        description="Run calibration text through the dense model, fit one linear log-norm predictor per MoE "
        "layer (closed-form ridge), print the held-out R^2 per layer and write a safetensors file that "
        "base_moe.apply(model, predictors=FILE) accepts.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="local Hugging Face model directory")
    p.add_argument("--text", required=True, metavar="FILE", help="calibration text file (UTF-8, or raw bytes with --bytes)")
    p.add_argument("--out", required=True, metavar="FILE", help="predictors file to write (.safetensors)")
    p.add_argument("--tokens", type=positive_int, default=65536, metavar="N",
                   help="calibration tokens (default: 65536)")
    p.add_argument("--seq", type=positive_int, default=None, metavar="S",
                   help="tokens per sequence (default: 512, or the model's context if shorter)")
    p.add_argument("--bytes", action="store_true", help="byte-level model: each byte of --text is a token id")
    p.add_argument("--device", default=None, help="cuda, cpu, cuda:1, ... (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=sorted(DTYPES), help="model dtype (default: the checkpoint's; "
                   "float32 on CPU)")
    p.add_argument("--batch-size", type=positive_int, default=8, metavar="B",
                   help="sequences per forward pass (default: 8)")
    p.add_argument("--ridge", type=nonnegative_float, default=1e-3, metavar="L",
                   help="relative ridge strength, >= 0 (default: 1e-3)")
    p.add_argument(
        "--ridge-sweep", type=_ridge_list, default=[], metavar="L1,L2,...",
        help="also fit these ridge values from the same sums and print their held-out R^2 (to choose --ridge)",
    )
    p.add_argument("--holdout", type=holdout_value, default=0.1, metavar="H",
                   help="held-out fraction of sequences: 0, or strictly between 1/20000 and 1 - 1/20000 "
                   "(default: 0.1)")
    p.add_argument("--similarity", action="store_true", help="also measure the experts' output similarity, which "
                   "eval's --fill substitute needs (runs every expert a second time)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_calibrate)


def run_calibrate(args: argparse.Namespace) -> int:
    from .calibrate import calibrate

    device = resolve_device(args.device)
    require_transformers()
    check_model_dir(args.model)
    args.seq = resolve_seq(args.seq, args.model, 512)
    check_input_file(args.text, "--text")
    check_output_file(args.out, "--out")
    check_distinct_files({"--text": args.text}, {"--out": args.out})
    start = time.perf_counter()
    ids, model = load_ids_and_model(args, device, args.tokens)
    loaded = time.perf_counter() - start
    try:
        predictors = calibrate(
            model, ids, batch_size=args.batch_size, ridge=args.ridge, holdout=args.holdout,
            progress=not args.no_progress, device=device, ridge_sweep=args.ridge_sweep, similarity=args.similarity,
        )
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    print(format_table(predictors))  # before the save: a failed save still shows the fit
    if "r2_by_ridge" in predictors.stats:
        print(format_sweep(predictors))
    predictors.save(args.out)
    stats = predictors.stats
    print(
        f"{stats['tokens']} tokens ({predictors.metadata['tokens_holdout']} held out) on {device}: calibration "
        f"{stats['seconds']:.1f} s ({stats['tokens'] / max(stats['seconds'], 1e-9):.0f} tok/s), model and text "
        f"loading {loaded:.1f} s; {_peak_memory(device)}"
    )
    print(f"wrote {args.out}")
    return 0


def format_table(predictors) -> str:
    """One row per MoE layer: held-out R^2 (pooled, and the worst expert), mean target, tokens."""
    meta = predictors.metadata
    tokens = f"{meta.get('tokens_train', '?')}/{meta.get('tokens_holdout', '?')}"
    rows = [f"{'layer':>5}  {'experts':>7}  {'R^2':>7}  {'worst R^2':>9}  {'mean log||E||':>13}  {'tokens train/held':>17}"]
    for i in predictors.layers:
        expert_r2 = predictors.expert_r2.get(i)
        worst = float(expert_r2.nan_to_num(nan=float("inf")).min()) if expert_r2 is not None else float("nan")
        worst = worst if worst != float("inf") else float("nan")
        rows.append(
            f"{i:>5}  {predictors.weight[i].shape[0]:>7}  {predictors.r2[i]:>7.4f}  {worst:>9.4f}  "
            f"{float(predictors.mean_log_norm[i].mean()):>13.4f}  {tokens:>17}"
        )
    finite = [v for v in predictors.r2.values() if v == v]
    if finite:
        rows.append(f"mean R^2 over {len(finite)} layers: {sum(finite) / len(finite):.4f}")
    return "\n".join(rows)


def format_sweep(predictors) -> str:
    """Held-out R^2 per layer for each swept ridge value (and the one used)."""
    sweep = {predictors.metadata["ridge"]: predictors.r2, **predictors.stats["r2_by_ridge"]}
    rows = [f"{'ridge':>10}  {'mean R^2':>8}  per layer"]
    for ridge in sorted(sweep):
        r2 = sweep[ridge]
        mean = sum(r2.values()) / len(r2)
        used = "  (used)" if ridge == predictors.metadata["ridge"] else ""
        rows.append(f"{ridge:>10.3g}  {mean:>8.4f}  " + " ".join(f"{v:.3f}" for v in r2.values()) + used)
    return "\n".join(rows)


def _comma_list(text: str, parse: Callable[[str], object]) -> list:
    """The comma-separated values of ``text``, each through ``parse``: at least one (``,`` alone gave none)."""
    values = [parse(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated values, got {text!r}")
    return values


def _ridge_list(text: str) -> list[float]:
    return _comma_list(text, nonnegative_float)


# ---------------------------------------------------------------------------------------------
# eval
# ---------------------------------------------------------------------------------------------
def _budget_list(text: str) -> list[int]:
    return _comma_list(text, positive_int)


def add_eval(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "eval",
        help="compare expert-selection policies with the forced-token batched-decode protocol",
        description="B sequences of S tokens from --text; positions < P run dense (prefill); every later position's "
        "B tokens are one decode batch under the policy. Prints bits per token (per byte with --bytes) and its "
        "increase over dense, retained energy, active experts per layer and decode batch (and, on CUDA, the MoE "
        "layer time) per policy and budget; writes JSON and optionally a PNG plot.",
    )
    p.add_argument("--model", required=True, metavar="DIR", help="local Hugging Face model directory")
    p.add_argument("--text", required=True, metavar="FILE", help="held-out text (UTF-8, or raw bytes with --bytes)")
    p.add_argument("--bytes", action="store_true", help="byte-level model: each byte of --text is a token id")
    p.add_argument("--predictors", metavar="FILE", help="predictors from `calibrate` (needed by base, static_energy)")
    p.add_argument("--batch", type=positive_int, default=16, metavar="B",
                   help="sequences per decode batch (default: 16)")
    p.add_argument("--seq", type=positive_int, default=None, metavar="S",
                   help="tokens per sequence (default: 256, or the model's context if shorter)")
    p.add_argument("--prefill", type=bounded(int, 0), default=32, metavar="P",
                   help="dense prefill positions, at most S - 2 (default: 32)")
    p.add_argument("--batches", type=positive_int, default=8, metavar="N", help="evaluation batches (default: 8)")
    p.add_argument("--budgets", type=_budget_list, default=None, metavar="M,M,...",
                   help="expert budgets (default: every integer between a third and a half of the measured dense "
                   "union)")
    p.add_argument("--policies", default="base,router_sum,router_sq,frequency,top1_union,static_energy,oracle",
                   metavar="P,P,...", help="policies; options as name:key=value, e.g. oea:k0=2, topk_reduce:k=2, "
                   "lynx:threshold=4 (default: %(default)s)")
    p.add_argument("--fill", default="backfill", choices=["backfill", "drop", "drop_renorm", "substitute"],
                   help="a token whose routed experts were not all kept: re-routed to its top-k among the kept "
                   "(backfill), keeps only its kept ones (drop), or those rescaled to its original total weight "
                   "(drop_renorm), or each dropped slot's weight moved to the kept expert most similar to the "
                   "dropped one (substitute: predictors calibrated with --similarity) (default: %(default)s)")
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: cuda when available)")
    p.add_argument("--dtype", default="auto", choices=sorted(DTYPES), help="model dtype (default: the checkpoint's; "
                   "float32 on CPU)")
    p.add_argument("--no-energy", action="store_true", help="skip the retained energy (saves expert compute)")
    p.add_argument("--json", required=True, metavar="OUT", help="write every number here (JSON)")
    p.add_argument("--plot", metavar="OUT.png", help="plot quality loss against active experts (and time on CUDA)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_eval)


def load_predictors(path: str, fill: str):
    """``--predictors``, read before the model loads: a file that is not one, or ``--fill substitute`` with
    predictors that hold no expert similarity, is an error before any work."""
    from .predictors import Predictors

    check_input_file(path, "--predictors")
    try:
        predictors = Predictors.load(path)
    except ValueError as err:
        raise SystemExit(f"error: --predictors {err}") from None
    if fill == "substitute" and set(predictors.similarity) != set(predictors.layers):
        raise SystemExit(f"error: --fill substitute needs predictors calibrated with --similarity; {path} holds "
                         f"the expert similarity of {len(predictors.similarity)} of its {len(predictors.layers)} "
                         "MoE layers")
    return predictors


def run_eval(args: argparse.Namespace) -> int:
    import json

    from .evaluate import (DENSE_UNION_BATCHES, budgets_between, check_policies_fit, check_prefill, dense_union,
                           evaluate, format_table, json_ready, make_batches, plot)
    from .layouts import find_moe_layouts
    from .policies import get_policy

    device = resolve_device(args.device)
    require_transformers()
    try:
        policies = [get_policy(name) for name in args.policies.split(",") if name]
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    if args.budgets and not any(p.budgeted and p.needs_budget for p in policies):
        print(f"note: --budgets not applied: none of --policies {args.policies} takes a budget", file=sys.stderr)
    if any(p.needs_calibration for p in policies) and not args.predictors:
        needing = ", ".join(p.name for p in policies if p.needs_calibration)
        raise SystemExit(f"error: policies {needing} need --predictors FILE (from `python -m base_moe calibrate`)")
    check_model_dir(args.model)
    args.seq = resolve_seq(args.seq, args.model, 256)
    try:
        check_prefill(args.prefill, args.seq)
    except ValueError:
        raise SystemExit(f"error: --prefill {args.prefill} leaves no scored decode position in --seq {args.seq} "
                         "(at most --seq - 2)") from None
    check_input_file(args.text, "--text")
    predictors = load_predictors(args.predictors, args.fill) if args.predictors else None
    if args.fill == "substitute" and predictors is None:
        raise SystemExit("error: --fill substitute needs --predictors FILE calibrated with --similarity")
    check_output_file(args.json, "--json")
    if args.plot:
        check_plot_output(args.plot)
    check_distinct_files({"--text": args.text, "--predictors": args.predictors},
                         {"--json": args.json, "--plot": args.plot})

    def enough_tokens(ids: torch.Tensor) -> None:
        try:
            make_batches(ids, args.batch, args.seq, args.batches)
        except ValueError as err:
            raise SystemExit(f"error: {err}") from None

    ids, model = load_ids_and_model(args, device, args.batches * args.batch * args.seq, check_ids=enough_tokens)
    budgets = args.budgets
    try:
        if predictors is not None:  # before the dense-union pass, like the policies' fit
            predictors.check_compatible(model)
        check_policies_fit(policies, find_moe_layouts(model))
        if budgets is None and not any(p.needs_budget for p in policies):
            budgets = []  # no budget to choose: no dense-union pass
        elif budgets is None:
            union_batches = min(args.batches, DENSE_UNION_BATCHES)
            union = dense_union(model, ids, batch=args.batch, seq=args.seq, prefill=args.prefill,
                                batches=union_batches, device=device)
            budgets = budgets_between(union)
            print(f"dense union {union:.2f} experts per layer and decode batch (first {union_batches} batches): "
                  f"budgets {budgets}")
        result = evaluate(
            model, ids, predictors=predictors, policies=policies, budgets=budgets, batch=args.batch,
            seq=args.seq, prefill=args.prefill, batches=args.batches, fill=args.fill, device=device,
            progress=not args.no_progress, energy=not args.no_energy, byte_level=args.bytes,
        )
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None
    result["command"] = " ".join(["python -m base_moe", *map(shlex.quote, args.argv)])
    result["args"] = {k: v for k, v in vars(args).items() if k not in ("func", "argv")}
    print(format_table(result))
    with open(args.json, "w") as f:
        json.dump(json_ready(result), f, indent=1, allow_nan=False)
    print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


# ---------------------------------------------------------------------------------------------
COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [add_calibrate, add_eval]
"""Every subcommand's parser builder; a new command appends its ``add_<name>`` here."""


def version_line() -> str:
    """base_moe's version, torch's, and whether this build has the CUDA kernels (and a GPU to run them)."""
    from . import __version__
    from .policies import has_kernel

    kernels = has_kernel("route_select", torch.device("cuda"))
    gpu = "a GPU is visible" if torch.cuda.is_available() else "no GPU visible"
    return (f"base_moe {__version__}, torch {torch.__version__}; CUDA kernels "
            f"{'built' if kernels else 'not built'}, {gpu}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m base_moe", description="BASE: batch-aware selection of MoE experts")
    parser.add_argument("--version", action="version", version=version_line())
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in COMMANDS:
        add(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
