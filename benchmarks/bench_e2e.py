"""End-to-end decode throughput on a Qwen3-30B-A3B-shaped model (random weights), CUDA-graph decode loop.

The model is ``Qwen3MoeForCausalLM`` built from a config (48 layers, H=2048, 128 experts, top-8, I=768,
bf16: about 61 GB) with random weights, so routing is close to uniform (real routing is a bit more skewed).
The decode loop is a minimal loop over the model's own modules (embedding, norms, attention projections,
rotary embedding, MoE blocks, LM head) with a static KV cache of ``prompt + decode`` positions; one decode
step, greedy next token included, is captured in one CUDA graph and replayed. Prompts of ``--prompt`` random
tokens are prefilled (dense routing, eager) and ``--decode`` tokens decoded.

The non-MoE part of each layer (norms, attention, KV-cache update; ``attention_block``) is the same code for
every variant: by default it runs through one ``torch.compile`` (inductor kernels inside the step's CUDA graph,
as HF's generate with a static cache and compile, or a serving engine, would run it); ``--non-moe eager`` runs
it op by op instead, which makes every variant's step slower by the same amount.

Compared in the same run, per batch size:
  * ``hf_grouped_mm``: the model's own MoE blocks with ``experts_implementation="grouped_mm"``, eager inside
    the CUDA graph;
  * ``hf_grouped_mm_compiled``: the same blocks through ``torch.compile`` (fuses HF's routing ops);
  * ``base_moe_dense``: base_moe's kernels (router GEMV, selection, expert kernel) with no effective budget
    (budget = E, which reproduces the model's own routing exactly);
  * ``base_M{10,16,32}``: BASE with budget M (predictors are random: quality is not measured here, and the
    predictor GEMV costs the same whatever its values), the residual add and norm before each block as one
    ``base_moe.ops.add_rms_norm`` (``base_moe.hf.post_attention``, what the patched decoder layers run);
    ``base_M16_model_norm`` (in ``--variants``) keeps the model's own add and norm (``apply``'s ``norm='model'``).
The share of a step spent in MoE layers is 1 - (time of the same step with MoE blocks skipped) / (step time), the
skipped step run with the variant's own residual add and norm (the model's, or base_moe's ``add_rms_norm``).

    python benchmarks/bench_e2e.py --json benchmarks/results/bench_e2e.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from common import median, positive_ints, require_cuda, run_metadata, write_json
from transformers.models.qwen3_moe.modeling_qwen3_moe import apply_rotary_pos_emb

import base_moe
from base_moe.cli import positive_int


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


def attention_block(layer, h, moe_out, cos, sin, positions, mask, k_cache, v_cache):
    """The non-MoE part of one decoder layer with the layer's own modules, over a static KV cache.

    Adds the previous layer's MoE output to the residual stream (``moe_out``, None for the first layer), runs the
    input norm, self-attention (q/k norms, rotary, KV-cache update, SDPA) and o_proj, and returns the new residual
    stream and the post-attention norm of it (the MoE block's input). Written as one function so that one
    ``torch.compile`` of it serves every layer and every variant (layers differ only in their weights).
    """
    if moe_out is not None:
        h = h + moe_out
    attn = layer.self_attn
    x = layer.input_layernorm(h)
    B, S, _ = x.shape
    q = attn.q_norm(attn.q_proj(x).view(B, S, -1, attn.head_dim)).transpose(1, 2)
    k = attn.k_norm(attn.k_proj(x).view(B, S, -1, attn.head_dim)).transpose(1, 2)
    v = attn.v_proj(x).view(B, S, -1, attn.head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k_cache.index_copy_(2, positions[0], k)
    v_cache.index_copy_(2, positions[0], v)
    o = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=attn.scaling, enable_gqa=True)
    # the residual add and the post-attention norm as the layer runs them: one base_moe op once applied
    normed, h = base_moe.hf.post_attention(layer, h, attn.o_proj(o.transpose(1, 2).reshape(B, S, -1)))
    return h, normed


def moe_block(layer, x):
    """The MoE block of one decoder layer (the layer's own module: HF's, or base_moe's once applied)."""
    out = layer.mlp(x)
    return out[0] if isinstance(out, tuple) else out


class DecodeLoop:
    """A static-KV-cache decode loop over the model's own modules; ``step`` is graph-capturable.

    ``compile_attention`` runs the non-MoE part of each decode step (``attention_block``) through one
    ``torch.compile`` (inductor, no CUDA graphs of its own: the caller captures the whole step), the same compiled
    code for every layer and every variant. ``compile_moe`` does the same for the MoE blocks (``moe_block``);
    otherwise they run as they are (eager modules inside the step's CUDA graph). Prefill always runs eagerly.
    """

    def __init__(self, model, batch: int, max_len: int, skip_moe: bool = False, compile_attention: bool = False,
                 compile_moe: bool = False):
        self.model, self.batch, self.max_len, self.skip_moe = model, batch, max_len, skip_moe
        cfg, device, dtype = model.config, model.device, model.dtype
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k_cache = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v_cache = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.position = torch.zeros((), device=device, dtype=torch.long)
        self.tokens = torch.zeros(batch, device=device, dtype=torch.long)
        self.decode_attention = torch.compile(attention_block, dynamic=False) if compile_attention else attention_block
        self.decode_moe = torch.compile(moe_block, dynamic=False) if compile_moe else moe_block

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attention=attention_block, moe=moe_block):
        """tokens [B, S] at positions [1, S] (device tensors) -> logits of the last position [B, V]."""
        m = self.model.model
        slots = torch.arange(self.max_len, device=tokens.device)
        mask = slots[None, :] <= positions[0][:, None]  # [S, max_len]: causal over the static cache
        h = m.embed_tokens(tokens)
        cos, sin = m.rotary_emb(h, positions)  # once per step, shared by the layers (as the HF model does)
        moe_out = None
        for i, layer in enumerate(m.layers):
            h, x = attention(layer, h, moe_out, cos, sin, positions, mask, self.k_cache[i], self.v_cache[i])
            if not self.skip_moe:
                moe_out = moe(layer, x)
        if moe_out is not None:
            h = h + moe_out
        return self.model.lm_head(m.norm(h[:, -1]))

    def prefill(self, prompt: torch.Tensor) -> None:
        S = prompt.shape[1]
        logits = self.forward(prompt, torch.arange(S, device=prompt.device)[None])
        self.tokens.copy_(logits.argmax(-1))
        self.position.fill_(S)

    def step(self) -> torch.Tensor:
        """One decode step: the current tokens at the current position; greedy next tokens. Returns the logits."""
        logits = self.forward(self.tokens[:, None], self.position.view(1, 1), self.decode_attention,
                              self.decode_moe)
        self.tokens.copy_(logits.argmax(-1))
        self.position.add_(1)
        return logits


def random_prompt(model, batch: int, prompt_len: int) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (batch, prompt_len), device=model.device,
                         generator=torch.Generator(device=model.device).manual_seed(batch))


@torch.no_grad()
def active_experts(model, batch: int, prompt_len: int) -> float | None:
    """Mean experts per MoE layer that one eager decode step of the configured variant runs (base_moe's recorded
    selections), so that the JSON shows what each budget left; None for the model's own blocks."""
    if not base_moe.hf.is_applied(model):
        return None
    loop = DecodeLoop(model, batch, prompt_len + 1)
    loop.prefill(random_prompt(model, batch, prompt_len))
    base_moe.configure(model, record=True)
    try:
        loop.step()
        chosen = base_moe.hf.selections(model)
    finally:
        base_moe.configure(model, record=False)
    return statistics.fmean(int((sel.counts > 0).sum()) for sel, _ in chosen.values())


@torch.no_grad()
def time_decode(model, batch: int, prompt_len: int, decode_len: int, repeats: int, **loop_options):
    """Median seconds of one decode step over ``repeats`` runs of ``decode_len`` graph replays."""
    loop = DecodeLoop(model, batch, prompt_len + decode_len, **loop_options)
    loop.prefill(random_prompt(model, batch, prompt_len))
    saved = (loop.tokens.clone(), loop.position.clone())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up outside capture (allocations, lazy init, torch.compile)
            loop.step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loop.step()
    graph.replay()  # the first launch of a graph uploads it: keep that out of the timed runs
    torch.cuda.synchronize()
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
    return median(per_step)


VARIANTS = ("hf_grouped_mm", "hf_grouped_mm_compiled", "base_moe_dense")


def parse_base_variant(name: str) -> tuple[int, str] | None:
    """(budget, norm option) of a BASE variant name (base_M<budget>, base_M<budget>_model_norm); None for the
    baselines. Raises on any other name."""
    if name in VARIANTS:
        return None
    budget, _, suffix = name.removeprefix("base_M").partition("_")
    if not name.startswith("base_M") or not budget.isdigit() or int(budget) < 1 or suffix not in ("", "model_norm"):
        raise ValueError(
            f"unknown variant {name!r}: {', '.join(VARIANTS)}, base_M<budget> or base_M<budget>_model_norm "
            "(budget >= 1)"
        )
    return int(budget), "model" if suffix else "auto"


def runs_base_moe_norm(name: str) -> bool:
    """Whether the variant's decode step runs base_moe's add_rms_norm before each MoE block (every base_moe variant
    but the *_model_norm ones: base_moe_dense's budget E is a budget too), so that its non-MoE step is timed so."""
    base = parse_base_variant(name)
    return name == "base_moe_dense" or (base is not None and base[1] == "auto")


def configure_variant(model, name: str, predictors) -> None:
    base = parse_base_variant(name)
    if name in ("hf_grouped_mm", "hf_grouped_mm_compiled"):
        if base_moe.hf.is_applied(model):
            base_moe.restore(model)
        model.set_experts_implementation("grouped_mm")
        return
    E = model.config.num_experts
    if not base_moe.hf.is_applied(model):
        base_moe.apply(model, predictors=predictors, budget=E, policy="router_sum", experts="base_moe")
    if base is None:  # base_moe_dense
        base_moe.configure(model, budget=E, policy="router_sum", norm="auto")
    else:
        base_moe.configure(model, budget=base[0], policy="base", norm=base[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=positive_int, default=48)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--budgets", default="10,16,32")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="baselines to run, and BASE rows such as base_M16_model_norm (BASE rows: --budgets)")
    parser.add_argument("--non-moe", choices=("compiled", "eager"), default="compiled",
                        help="run the non-MoE part of each decode step through torch.compile, or eagerly")
    parser.add_argument("--prompt", type=positive_int, default=128)
    parser.add_argument("--decode", type=positive_int, default=128)
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--json", default="benchmarks/results/bench_e2e.json")
    args = parser.parse_args()
    torch._dynamo.config.recompile_limit = 64  # one graph per batch size and per first/other layer
    budgets = positive_ints(args.budgets, "--budgets") if args.budgets else []  # (empty: no BASE rows)
    variants = [v for v in args.variants.split(",") if v] + [f"base_M{m}" for m in budgets]
    for name in variants:
        try:  # a misspelt name fails here, not after building the model
            parse_base_variant(name)
        except ValueError as err:
            parser.error(str(err))
    batches = positive_ints(args.batches, "--batches")
    require_cuda("bench_e2e.py")

    t0 = time.time()
    model = build_model(args.layers)
    print(f"model: {args.layers} layers, {sum(p.numel() for p in model.parameters()) * 2 / 1e9:.1f} GB bf16, "
          f"built in {time.time() - t0:.0f} s", flush=True)
    predictors = random_predictors(model)
    compile_attention = args.non_moe == "compiled"
    rows = []
    for batch in batches:
        non_moe = {}  # the step with the MoE blocks skipped, per residual add + norm (the model's, base_moe's)
        for name in variants:
            configure_variant(model, name, predictors)
            norm_kind = runs_base_moe_norm(name)
            if norm_kind not in non_moe:
                non_moe[norm_kind] = time_decode(model, batch, args.prompt, args.decode, args.repeats, skip_moe=True,
                                                 compile_attention=compile_attention)
            attention_only = non_moe[norm_kind]
            step = time_decode(model, batch, args.prompt, args.decode, args.repeats,
                               compile_attention=compile_attention, compile_moe=name == "hf_grouped_mm_compiled")
            row = dict(batch=batch, variant=name, step_ms=step * 1e3, tokens_per_s=batch / step,
                       moe_share=max(0.0, 1.0 - attention_only / step), non_moe_step_ms=attention_only * 1e3,
                       active_experts=active_experts(model, batch, args.prompt))
            rows.append(row)
            active = "" if row["active_experts"] is None else f"  {row['active_experts']:.1f} experts per layer"
            print(f"batch {batch:3d} {name:23s} step {step * 1e3:7.2f} ms  {batch / step:9.1f} tok/s  "
                  f"MoE share {row['moe_share']:.0%}{active}", flush=True)

    by = {(r["batch"], r["variant"]): r for r in rows}
    baselines = [v for v in ("base_moe_dense", "hf_grouped_mm", "hf_grouped_mm_compiled") if v in variants]
    print("\n| batch | variant | ms / step | tokens / s | MoE share |"
          + "".join(f" vs {b} |" for b in baselines))
    print("| --- " * (5 + len(baselines)) + "|")
    for r in rows:
        ratios = []
        for b in baselines:
            r[f"speedup_vs_{b}"] = r["tokens_per_s"] / by[(r["batch"], b)]["tokens_per_s"]
            ratios.append(f"{r[f'speedup_vs_{b}']:.2f}x")
        print(f"| {r['batch']} | {r['variant']} | {r['step_ms']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['moe_share']:.0%} |" + "".join(f" {x} |" for x in ratios))
    result = run_metadata(
        benchmark="bench_e2e",
        config=dict(layers=args.layers, hidden=2048, experts=128, top_k=8, intermediate=768, dtype="bfloat16",
                    prompt=args.prompt, decode=args.decode, repeats=args.repeats, weights="random",
                    non_moe=args.non_moe),
        rows=rows,
    )
    write_json(args.json, result)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
