"""Train base_moe's testbed: a small byte-level Qwen3-MoE language model with learned routing.

The model reads raw bytes (vocabulary 256, no tokenizer) and is trained on the Python source files of installed
libraries (``transformers`` and ``torch`` by default), read at training time. Files are split by their directory
(so near-identical sibling files stay on one side) with a hash of the directory's path: ~2% of directories give
the calibration text, ~2% the held-out text, the rest is training data. The split, the order of the files and
the training windows are all deterministic (sorted paths, sha256, a seeded generator).

Writes into ``--out``: ``testbed/`` (``save_pretrained``: config.json, model.safetensors in bf16,
generation_config.json), ``calib.txt``, ``heldout.txt`` (each ``--text-bytes`` bytes of Python source from files
not used for training, at most ``--text-file-bytes`` from one file) and ``train_log.json`` (the command, machine, versions, every logged loss and the final
bits per byte).

    python scripts/train_testbed.py --out /tmp/testbed --seconds 150      # GPU: steps chosen from a timed probe
    python scripts/train_testbed.py --out /tmp/tb --steps 3 --batch 2 --corpus-bytes 2000000 --device cpu  # smoke test

With ``--steps auto`` a few probe steps on a throwaway copy of the model time one step and the number of steps is
set to fit ``--seconds``; the chosen number is printed and logged, and ``--steps N`` reproduces the run.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import importlib
import json
import math
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------
def python_files(packages: list[str]) -> list[tuple[str, str]]:
    """``(display path, absolute path)`` of every ``.py`` file of the packages, sorted by display path
    (``package/relative/path.py``)."""
    files = []
    for name in packages:
        root = os.path.dirname(importlib.import_module(name).__file__)
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for filename in filenames:
                if filename.endswith(".py"):
                    path = os.path.join(dirpath, filename)
                    files.append((name + "/" + os.path.relpath(path, root).replace(os.sep, "/"), path))
    return sorted(files)


def split_of(display_path: str, calib_fraction: float, heldout_fraction: float) -> str:
    """``'calib'``, ``'heldout'`` or ``'train'`` from a hash of the file's directory."""
    directory = display_path.rsplit("/", 1)[0]
    h = int.from_bytes(hashlib.sha256(directory.encode()).digest()[:8], "little") / 2**64
    if h < calib_fraction:
        return "calib"
    if h < calib_fraction + heldout_fraction:
        return "heldout"
    return "train"


def read_corpus(args) -> dict[str, bytes]:
    """The training bytes and the calibration and held-out texts, plus file statistics."""
    parts: dict[str, list[bytes]] = {"train": [], "calib": [], "heldout": []}
    sizes = {"train": 0, "calib": 0, "heldout": 0}
    counts = {"train": 0, "calib": 0, "heldout": 0}
    limit = {"train": args.corpus_bytes or float("inf"), "calib": args.text_bytes, "heldout": args.text_bytes}
    for display, path in python_files(args.packages):
        split = split_of(display, args.calib_fraction, args.heldout_fraction)
        if sizes[split] >= limit[split]:
            continue
        with open(path, "rb") as f:
            data = f.read()
        if not data or len(data) > args.max_file_bytes:
            continue
        if split != "train" and len(data) > args.text_file_bytes:  # many files, not one long one
            data = data[: data.rfind(b"\n", 0, args.text_file_bytes) + 1] or data[: args.text_file_bytes]
        if not data.endswith(b"\n"):
            data += b"\n"
        parts[split].append(data)
        sizes[split] += len(data)
        counts[split] += 1
    out = {split: b"".join(chunks) for split, chunks in parts.items()}
    for split in ("calib", "heldout"):
        if len(out[split]) < args.text_bytes:
            raise SystemExit(f"only {len(out[split])} bytes of {split} text (need {args.text_bytes})")
        out[split] = out[split][: args.text_bytes]
    print(
        "corpus: " + ", ".join(f"{s} {counts[s]} files {sizes[s] / 1e6:.1f} MB" for s in counts)
        + f" (calib/heldout cut to {args.text_bytes} bytes)",
        flush=True,
    )
    return out, counts


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------
def make_config(args):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,  # unused: every layer is an MoE layer
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        moe_intermediate_size=args.moe_intermediate,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=args.aux_coef,
        tie_word_embeddings=False,
        use_cache=False,
    )


def make_model(config, seed: int, device: torch.device, experts_impl: str):
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).to(device)
    set_experts_impl(model, experts_impl)
    return model


def set_experts_impl(model, impl: str) -> None:
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
    else:
        model.config._experts_implementation = impl


def make_optimizer(model, args):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": other, "weight_decay": 0.0}]
    kwargs = {"fused": True} if next(model.parameters()).is_cuda else {}
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, **kwargs)


def lr_at(step: int, total: int, args) -> float:
    warmup = min(args.warmup, max(1, total // 10))
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


class Windows:
    """Random ``[batch, seq]`` windows of the training bytes from a seeded CPU generator."""

    def __init__(self, data: torch.Tensor, batch: int, seq: int, seed: int):
        self.data, self.batch, self.seq = data, batch, seq
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(seq, device=data.device)

    def next(self) -> torch.Tensor:
        starts = torch.randint(0, self.data.numel() - self.seq, (self.batch,), generator=self.generator)
        return self.data[starts.to(self.data.device)[:, None] + self.offsets].long()


def train_step(model, optimizer, ids: torch.Tensor, lr: float, args):
    for group in optimizer.param_groups:
        group["lr"] = lr
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=args.autocast):
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
    optimizer.zero_grad(set_to_none=True)
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    optimizer.step()
    return out, grad_norm


@torch.no_grad()
def bits_per_byte(model, data: torch.Tensor, seq: int, batch: int, autocast: bool, max_windows: int | None = None):
    """Mean next-byte cross-entropy in bits over non-overlapping windows of ``seq`` bytes (the first byte of
    every window has no context and is not scored)."""
    n = data.numel() // seq
    if max_windows is not None:
        n = min(n, max_windows)
    windows = data[: n * seq].view(n, seq).long()
    total, count = 0.0, 0
    model.eval()
    for i in range(0, n, batch):
        ids = windows[i : i + batch]
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, output_router_logits=False).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, 256), ids[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += ids[:, 1:].numel()
    model.train()
    return total / count / math.log(2)


@torch.no_grad()
def expert_load(model, data: torch.Tensor, seq: int, batch: int, autocast: bool) -> list[dict]:
    """Per MoE layer: the fraction of routed slots of the busiest and the idlest expert (held-out text)."""
    n = min(data.numel() // seq, batch)
    ids = data[: n * seq].view(n, seq).long()
    model.eval()
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(input_ids=ids, output_router_logits=True)
    model.train()
    k, E = model.config.num_experts_per_tok, model.config.num_experts
    stats = []
    for logits in out.router_logits:
        top = logits.float().topk(k, dim=-1).indices.reshape(-1)
        load = torch.bincount(top, minlength=E).float() / top.numel()
        stats.append({"max": round(load.max().item(), 4), "min": round(load.min().item(), 4)})
    return stats


# ---------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--packages", default="transformers,torch", type=lambda s: s.split(","))
    p.add_argument("--corpus-bytes", type=int, default=0, help="cap on training bytes (0: all)")
    p.add_argument("--text-bytes", type=int, default=262144, help="bytes of calib.txt and of heldout.txt")
    p.add_argument("--text-file-bytes", type=int, default=32768, help="at most this much of one file in those texts")
    p.add_argument("--calib-fraction", type=float, default=0.02)
    p.add_argument("--heldout-fraction", type=float, default=0.02)
    p.add_argument("--max-file-bytes", type=int, default=1 << 20, help="skip larger (generated) files")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--moe-intermediate", type=int, default=96)
    p.add_argument("--aux-coef", type=float, default=0.01)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", default="auto", help="number of steps, or 'auto' to fit --seconds")
    p.add_argument("--seconds", type=float, default=150.0, help="training time for --steps auto")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=0, help="cap on windows for the final bits per byte (0: all)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--experts-impl", default="grouped_mm,eager", help="experts implementations to try, in order")
    p.add_argument("--no-autocast", dest="autocast", action="store_false")
    args = p.parse_args(argv)

    start = time.perf_counter()
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    corpus, file_counts = read_corpus(args)
    with open(os.path.join(args.out, "calib.txt"), "wb") as f:
        f.write(corpus["calib"])
    with open(os.path.join(args.out, "heldout.txt"), "wb") as f:
        f.write(corpus["heldout"])
    train = torch.frombuffer(bytearray(corpus["train"]), dtype=torch.uint8).to(device)
    heldout = torch.frombuffer(bytearray(corpus["heldout"]), dtype=torch.uint8).to(device)
    config = make_config(args)
    print(f"corpus read in {time.perf_counter() - start:.1f} s; {train.numel() / 1e6:.1f} MB of training bytes", flush=True)

    # Probe: which experts implementation works here, and how long one step takes (throwaway model).
    impl, step_seconds = None, None
    for candidate in args.experts_impl.split(","):
        try:
            probe = make_model(config, args.seed + 1, device, candidate)
            probe_opt = make_optimizer(probe, args)
            windows = Windows(train, args.batch, args.seq, args.seed + 1)
            times = []
            for i in range(6):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                train_step(probe, probe_opt, windows.next(), args.lr * 0.01, args)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            impl, step_seconds = candidate, sorted(times[2:])[len(times[2:]) // 2]
            del probe, probe_opt
            break
        except Exception as err:  # noqa: BLE001 - try the next implementation
            print(f"experts implementation {candidate!r} failed: {type(err).__name__}: {err}", flush=True)
    if impl is None:
        raise SystemExit("no experts implementation works")
    steps = int(args.seconds / step_seconds) if args.steps == "auto" else int(args.steps)
    print(f"experts implementation {impl}: {step_seconds * 1e3:.1f} ms/step -> {steps} steps", flush=True)

    model = make_model(config, args.seed, device, impl)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = make_optimizer(model, args)
    windows = Windows(train, args.batch, args.seq, args.seed)
    log = []
    t_train = time.perf_counter()
    deadline = t_train + 1.5 * args.seconds if args.steps == "auto" else float("inf")
    done = 0
    for step in range(steps):
        lr = lr_at(step, steps, args)
        out, grad_norm = train_step(model, optimizer, windows.next(), lr, args)
        done = step + 1
        if step % args.log_every == 0 or step == steps - 1:
            ce = (out.loss - args.aux_coef * out.aux_loss).item()
            entry = {
                "step": step, "lr": lr, "loss": round(out.loss.item(), 4), "bpb": round(ce / math.log(2), 4),
                "aux": round(out.aux_loss.item(), 4), "grad_norm": round(grad_norm.item(), 3),
                "seconds": round(time.perf_counter() - t_train, 1),
            }
            log.append(entry)
            print(json.dumps(entry), flush=True)
        if time.perf_counter() > deadline:
            print(f"stopping at step {done}: past 1.5x --seconds", flush=True)
            break
    train_seconds = time.perf_counter() - t_train

    # Final numbers: bits per byte on training windows and on the held-out text.
    g = torch.Generator().manual_seed(args.seed + 2)
    starts = torch.randint(0, train.numel() - args.seq, (256,), generator=g).to(device)
    train_sample = train[starts[:, None] + torch.arange(args.seq, device=device)].reshape(-1)
    cap = args.eval_windows or None
    train_bpb = bits_per_byte(model, train_sample, args.seq, args.batch, args.autocast, cap)
    heldout_bpb = bits_per_byte(model, heldout, args.seq, args.batch, args.autocast, cap)
    load = expert_load(model, heldout, args.seq, args.batch, args.autocast)
    print(f"final: train {train_bpb:.4f} bits/byte, held-out {heldout_bpb:.4f} bits/byte (bf16 autocast)", flush=True)
    print("expert load on held-out (fraction of slots, max/min per layer): "
          + " ".join(f"{s['max']:.3f}/{s['min']:.3f}" for s in load), flush=True)

    model.config.output_router_logits = False  # training only: inference does not need the router logits
    model.config.use_cache = True
    model.generation_config.use_cache = True  # else generate() runs without a KV cache: no decode steps to budget
    model = model.to(torch.bfloat16)
    model.save_pretrained(os.path.join(args.out, "testbed"))
    heldout_bpb_bf16 = bits_per_byte(model, heldout, args.seq, args.batch, False, cap)
    print(f"held-out with bf16 weights (no autocast): {heldout_bpb_bf16:.4f} bits/byte", flush=True)
    size = os.path.getsize(os.path.join(args.out, "testbed", "model.safetensors"))

    import transformers

    record = {
        "command": " ".join([sys.executable.rsplit("/", 1)[-1]] + sys.argv),
        "args": vars(args),
        "machine": {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "platform": platform.platform(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "files": file_counts,
        "train_bytes": train.numel(),
        "parameters": n_params,
        "model_safetensors_bytes": size,
        "experts_implementation": impl,
        "step_seconds_probe": step_seconds,
        "steps": done,
        "steps_planned": steps,
        "train_seconds": train_seconds,
        "bytes_seen": done * args.batch * args.seq,
        "train_bpb": train_bpb,
        "heldout_bpb": heldout_bpb,
        "heldout_bpb_bf16_weights": heldout_bpb_bf16,
        "expert_load_heldout": load,
        "log": log,
        "total_seconds": time.perf_counter() - start,
    }
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(f"{n_params / 1e6:.2f} M parameters, model.safetensors {size / 1e6:.2f} MB; "
          f"total {record['total_seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
