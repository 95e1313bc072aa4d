"""End-to-end decode throughput on a Qwen3-30B-A3B-shaped model (random weights), CUDA-graph decode loop.

The model is ``Qwen3MoeForCausalLM`` built from a config (48 layers, H=2048, 128 experts, top-8, I=768,
bf16: about 61 GB) with random weights, so routing is close to uniform (real routing is a bit more skewed).
The decode loop is a minimal loop over the model's own modules (embedding, norms, attention projections,
rotary embedding, MoE blocks, LM head) with a static KV cache of ``prompt + decode`` positions; one decode
step, greedy next token included, is captured in one CUDA graph and replayed. Prompts of ``--prompt`` random
tokens are prefilled (dense routing) and ``--decode`` tokens decoded.

Compared in the same run, per batch size:
  * ``hf_grouped_mm``: the model's own MoE blocks with ``experts_implementation="grouped_mm"``;
  * ``base_moe_dense``: base_moe's kernels (router GEMV, selection, expert kernel) with no effective budget
    (budget = E, which reproduces the model's own routing exactly);
  * ``base_M{10,16,32}``: BASE with budget M (predictors are random: quality is not measured here, and the
    predictor GEMV costs the same whatever its values).
The share of a step spent in MoE layers is 1 - (time of the same step with MoE blocks skipped) / (step time).

    python benchmarks/bench_e2e.py --json benchmarks/results/bench_e2e.json
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from common import run_metadata, write_json

import base_moe


def qwen3_30b_config(layers: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
    )


def build_model(layers: int):
    from transformers import Qwen3MoeForCausalLM

    config = qwen3_30b_config(layers)
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM._from_config(config, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


def random_predictors(model):
    E, H = model.config.num_experts, model.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    layers = range(model.config.num_hidden_layers)
    return base_moe.Predictors(
        weight={i: torch.randn(E, H, generator=gen) * 0.01 for i in layers},
        bias={i: torch.zeros(E) for i in layers},
        mean_log_norm={i: torch.zeros(E) for i in layers},
        metadata={"model_type": "qwen3_moe", "hidden_size": H, "num_experts": E, "note": "random, for timing"},
    )


class DecodeLoop:
    """A static-KV-cache decode loop over the model's own modules; ``step`` is graph-capturable."""

    def __init__(self, model, batch: int, max_len: int, skip_moe: bool = False):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

        self.apply_rotary = apply_rotary_pos_emb
        self.model, self.batch, self.max_len, self.skip_moe = model, batch, max_len, skip_moe
        cfg = model.config
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k_cache = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
        self.v_cache = torch.zeros_like(self.k_cache)
        self.position = torch.zeros((), device="cuda", dtype=torch.long)
        self.tokens = torch.zeros(batch, device="cuda", dtype=torch.long)

    def _attention(self, layer, i, x, positions, mask):
        attn = self.model.model.layers[i].self_attn
        B, S, _ = x.shape
        q = attn.q_norm(attn.q_proj(x).view(B, S, -1, attn.head_dim)).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(x).view(B, S, -1, attn.head_dim)).transpose(1, 2)
        v = attn.v_proj(x).view(B, S, -1, attn.head_dim).transpose(1, 2)
        cos, sin = self.model.model.rotary_emb(x, positions)
        q, k = self.apply_rotary(q, k, cos, sin)
        self.k_cache[i].index_copy_(2, positions[0], k)
        self.v_cache[i].index_copy_(2, positions[0], v)
        o = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask, scale=attn.scaling,
                                           enable_gqa=True)
        return attn.o_proj(o.transpose(1, 2).reshape(B, S, -1))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens [B, S] at positions [1, S] (device tensors) -> logits of the last position [B, V]."""
        m = self.model.model
        slots = torch.arange(self.max_len, device="cuda")
        mask = slots[None, :] <= positions[0][:, None]  # [S, max_len]: causal over the static cache
        h = m.embed_tokens(tokens)
        for i, layer in enumerate(m.layers):
            h = h + self._attention(layer, i, layer.input_layernorm(h), positions, mask)
            if not self.skip_moe:
                out = layer.mlp(layer.post_attention_layernorm(h))
                h = h + (out[0] if isinstance(out, tuple) else out)
        return self.model.lm_head(m.norm(h[:, -1]))

    def prefill(self, prompt: torch.Tensor) -> None:
        S = prompt.shape[1]
        logits = self.forward(prompt, torch.arange(S, device="cuda")[None])
        self.tokens.copy_(logits.argmax(-1))
        self.position.fill_(S)

    def step(self) -> None:
        """One decode step: the current tokens at the current position; greedy next tokens."""
        logits = self.forward(self.tokens[:, None], self.position.view(1, 1))
        self.tokens.copy_(logits.argmax(-1))
        self.position.add_(1)


@torch.no_grad()
def time_decode(model, batch: int, prompt_len: int, decode_len: int, repeats: int, skip_moe: bool = False):
    """Median seconds of one decode step over ``repeats`` runs of ``decode_len`` graph replays."""
    loop = DecodeLoop(model, batch, prompt_len + decode_len, skip_moe)
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(batch))
    loop.prefill(prompt)
    saved = (loop.tokens.clone(), loop.position.clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside capture (allocations, lazy init)
            loop.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loop.step()
    per_step = []
    for _ in range(repeats):
        loop.tokens.copy_(saved[0])
        loop.position.copy_(saved[1])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(decode_len):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        per_step.append(start.elapsed_time(end) / 1e3 / decode_len)
    del graph
    return sorted(per_step)[len(per_step) // 2]


def configure_variant(model, name: str, predictors) -> None:
    if name == "hf_grouped_mm":
        if base_moe.hf.is_applied(model):
            base_moe.restore(model)
        model.set_experts_implementation("grouped_mm")
        return
    E = model.config.num_experts
    if not base_moe.hf.is_applied(model):
        base_moe.apply(model, predictors=predictors, budget=E, policy="router_sum", experts="base_moe")
    if name == "base_moe_dense":
        base_moe.configure(model, budget=E, policy="router_sum")
    else:
        base_moe.configure(model, budget=int(name.removeprefix("base_M")), policy="base")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--budgets", default="10,16,32")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/bench_e2e.json")
    args = parser.parse_args()
    if not base_moe.cuda_available():
        sys.exit("bench_e2e needs a CUDA GPU and base_moe built with its CUDA kernels")

    t0 = time.time()
    model = build_model(args.layers)
    print(f"model: {args.layers} layers, {sum(p.numel() for p in model.parameters()) * 2 / 1e9:.1f} GB bf16, "
          f"built in {time.time() - t0:.0f} s", flush=True)
    predictors = random_predictors(model)
    variants = ["hf_grouped_mm", "base_moe_dense"] + [f"base_M{m}" for m in args.budgets.split(",")]
    rows = []
    for batch in map(int, args.batches.split(",")):
        configure_variant(model, "hf_grouped_mm", predictors)
        attention_only = time_decode(model, batch, args.prompt, args.decode, args.repeats, skip_moe=True)
        for name in variants:
            configure_variant(model, name, predictors)
            step = time_decode(model, batch, args.prompt, args.decode, args.repeats)
            row = dict(batch=batch, variant=name, step_ms=step * 1e3, tokens_per_s=batch / step,
                       moe_share=max(0.0, 1.0 - attention_only / step), non_moe_step_ms=attention_only * 1e3)
            rows.append(row)
            print(f"batch {batch:3d} {name:15s} step {step * 1e3:7.2f} ms  {batch / step:9.1f} tok/s  "
                  f"MoE share {row['moe_share']:.0%}", flush=True)

    by = {(r["batch"], r["variant"]): r for r in rows}
    print("\n| batch | variant | ms / step | tokens / s | MoE share | vs base_moe dense | vs HF grouped_mm |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        dense, hf = by[(r["batch"], "base_moe_dense")], by[(r["batch"], "hf_grouped_mm")]
        r["speedup_vs_dense"] = r["tokens_per_s"] / dense["tokens_per_s"]
        r["speedup_vs_hf"] = r["tokens_per_s"] / hf["tokens_per_s"]
        print(f"| {r['batch']} | {r['variant']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['moe_share']:.0%} | {r['speedup_vs_dense']:.2f}x | {r['speedup_vs_hf']:.2f}x |")
    result = run_metadata(
        benchmark="bench_e2e",
        config=dict(layers=args.layers, hidden=2048, experts=128, top_k=8, intermediate=768, dtype="bfloat16",
                    prompt=args.prompt, decode=args.decode, repeats=args.repeats, weights="random"),
        rows=rows,
    )
    write_json(args.json, result)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
