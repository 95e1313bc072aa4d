"""Batched generation with BASE: load a Hugging Face MoE model, cap the experts each MoE layer loads per decode
step, generate.

    python examples/generate.py MODEL_DIR --predictors predictors.safetensors --budget 16
    python examples/generate.py MODEL_DIR --policy router_sq --budget 16      # a baseline without predictors
    python examples/generate.py MODEL_DIR                                     # dense (the model's own routing)

Make predictors once per model with ``base_moe.calibrate`` (``python -m base_moe calibrate ...``).
"""

import argparse
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import base_moe

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "In 1905, Albert Einstein published",
    "The three primary colours are",
]


class ByteTokenizer:
    """For byte-level models (vocab 256, no tokenizer files): raw UTF-8 bytes are the token ids."""

    pad_token_id = 0

    def __call__(self, texts, return_tensors="pt", padding=True):
        rows = [list(text.encode()) for text in texts]
        width = max(map(len, rows))
        ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])  # left padding
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        return {"input_ids": ids, "attention_mask": mask}

    def decode(self, tokens, skip_special_tokens=True):
        return bytes(t for t in tokens.tolist() if 0 < t < 256).decode(errors="replace")


def load_tokenizer(path, model):
    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    local_without_files = os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in files)
    if model.config.vocab_size == 256 and local_without_files:
        return ByteTokenizer()
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(model, tokenizer) -> list[int]:
    """The tokenizer's pad and EOS ids and the model's EOS ids: what generate feeds a sequence that has ended."""
    eos = model.generation_config.eos_token_id
    ids = [tokenizer.pad_token_id, getattr(tokenizer, "eos_token_id", None), *(eos if isinstance(eos, list) else [eos])]
    return sorted({i for i in ids if i is not None})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a model directory or Hugging Face id (transformers >= 5 MoE model)")
    parser.add_argument("--predictors", help="predictors file from base_moe.calibrate (needed by policy 'base')")
    parser.add_argument("--budget", type=int, help="experts kept per MoE layer and decode step (default: dense)")
    parser.add_argument("--policy", help=f"one of {', '.join(base_moe.policies.available_policies())} "
                        "(default: base)")
    parser.add_argument("--fill", choices=["backfill", "drop", "drop_renorm"], help="default: backfill")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    try:  # before the model loads (minutes for a large one)
        policy = base_moe.policies.get_policy(args.policy or "base")
    except ValueError as err:
        parser.error(str(err))
    if args.budget is not None and args.budget < 1:
        parser.error(f"--budget must be >= 1, got {args.budget}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.predictors and not os.path.isfile(args.predictors):
        parser.error(f"--predictors {args.predictors!r} is not a file")
    active = base_moe.hf.Settings(budget=args.budget, policy=policy).active
    if active and (policy.needs_predictors or policy.needs_statistics) and not args.predictors:
        parser.error(f"policy '{policy.name}' needs --predictors FILE (from python -m base_moe calibrate)")
    ignored = [flag for flag, value in (("--budget", args.budget), ("--fill", args.fill), ("--predictors",
               args.predictors)) if value is not None]
    if not active and (ignored or (args.policy and policy.name != "dense")):
        parser.error(f"{', '.join(ignored or ['--policy'])} given, but this setting runs the model dense: give "
                     "--budget with a budgeted policy, or a policy that sizes its own sets (oea, topk_reduce, "
                     "lynx:threshold=X)")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    tokenizer = load_tokenizer(args.model, model)

    # one call: every MoE block now applies the budget to each decode step (prefill stays dense)
    # finished_tokens: once a sequence has ended, the EOS and pad tokens generate feeds it no longer vote for the
    # experts the other sequences get
    base_moe.apply(model, predictors=args.predictors, budget=args.budget, policy=policy, fill=args.fill or "backfill",
                   finished_tokens=stop_token_ids(model, tokenizer))

    inputs = {k: v.to(device) for k, v in tokenizer(PROMPTS, return_tensors="pt", padding=True).items()}
    pad = tokenizer.pad_token_id
    start = time.perf_counter()
    with torch.inference_mode():
        # use_cache: decode steps of one new token each, where the budget applies (without the cache every step
        # re-runs the whole sequence as a dense prefill)
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=pad,
                             use_cache=True)
    seconds = time.perf_counter() - start
    for prompt, tokens in zip(PROMPTS, out[:, inputs["input_ids"].shape[1] :]):
        print(f"--- {prompt}{tokenizer.decode(tokens, skip_special_tokens=True)}")
    size = f"budget {args.budget}" if args.budget is not None and policy.needs_budget else "no budget"
    setting = f"{size}, policy {policy.name}, fill {args.fill or 'backfill'}" if active else "dense"
    print(f"\n{len(PROMPTS)} x {args.max_new_tokens} tokens in {seconds:.2f} s ({setting})")

    # base_moe.configure(model, budget=8) changes the budget in place; base_moe.restore(model) undoes apply


if __name__ == "__main__":
    main()
