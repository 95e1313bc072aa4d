"""bench_e2e's decode loop computes what the model computes: greedy decode logits equal the HF forward's."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_e2e  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402


def tiny_model() -> Qwen3MoeForCausalLM:
    config = Qwen3MoeConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, max_position_embeddings=64, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(config).eval()


@pytest.mark.parametrize("compile_attention,compile_moe,patched", [(False, False, False), (True, True, False),
                                                                   (False, False, True), (True, False, True)])
@torch.no_grad()
def test_decode_loop_matches_model_forward(compile_attention, compile_moe, patched):
    """Patched: base_moe applied with a budget that does not bind, so the loop's post_attention and the patched
    decoder layers both run add_rms_norm."""
    model = tiny_model()
    if patched:
        import base_moe

        base_moe.apply(model, budget=model.config.num_experts, policy="router_sum")
    batch, prompt_len, decode_len = 3, 5, 4
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=torch.Generator().manual_seed(1))
    loop = bench_e2e.DecodeLoop(model, batch, prompt_len + decode_len, compile_attention=compile_attention,
                                compile_moe=compile_moe)
    loop.prefill(prompt)
    sequence = torch.cat([prompt, loop.tokens[:, None]], 1)
    assert torch.equal(loop.tokens, model(prompt).logits[:, -1].argmax(-1))
    for _ in range(decode_len - 1):
        logits = loop.step()
        torch.testing.assert_close(logits, model(sequence).logits[:, -1], rtol=1e-5, atol=1e-5)
        sequence = torch.cat([sequence, loop.tokens[:, None]], 1)
    assert int(loop.position) == prompt_len + decode_len - 1


def test_configure_variant_sets_budget_and_norm():
    import base_moe

    model = tiny_model()
    predictors = bench_e2e.random_predictors(model)

    def settings():
        return base_moe.hf.moe_layouts(model)[0].block._base_moe.settings

    bench_e2e.configure_variant(model, "base_M4_model_norm", predictors)
    assert (settings().budget, settings().norm) == (4, "model")
    bench_e2e.configure_variant(model, "base_M3", predictors)
    assert (settings().budget, settings().norm) == (3, "auto")
    for name in ("base_M4_ours", "base_Mx", "base_M", "hf_grouped_mm_compile"):
        with pytest.raises(ValueError, match="unknown variant"):
            bench_e2e.configure_variant(model, name, predictors)


def test_active_experts_counts_what_the_budget_leaves():
    """The JSON's active_experts: one eager decode step's experts per layer; the budget bounds it, the dense variant
    runs the routed union, the model's own blocks report None."""
    import base_moe

    model = tiny_model()
    predictors = bench_e2e.random_predictors(model)
    bench_e2e.configure_variant(model, "base_moe_dense", predictors)
    dense = bench_e2e.active_experts(model, batch=6, prompt_len=4)
    bench_e2e.configure_variant(model, "base_M3", predictors)
    budgeted = bench_e2e.active_experts(model, batch=6, prompt_len=4)
    assert budgeted == 3 and 3 < dense <= model.config.num_experts
    assert all(not layout.block._base_moe.settings.record for layout in base_moe.hf.moe_layouts(model))
    bench_e2e.configure_variant(model, "hf_grouped_mm", predictors)
    assert bench_e2e.active_experts(model, batch=6, prompt_len=4) is None


def test_non_moe_step_of_base_variants_runs_base_moes_norm(monkeypatch):
    """moe_share = 1 - non-MoE step / step: base_moe's variants run add_rms_norm in their non-MoE part (base_moe_dense
    too, budget E being a budget), the HF ones the model's add and norm, so each needs its own skipped-MoE step."""
    import base_moe

    assert [bench_e2e.runs_base_moe_norm(v) for v in
            ("hf_grouped_mm", "hf_grouped_mm_compiled", "base_moe_dense", "base_M16", "base_M16_model_norm")] == [
        False, False, True, True, False]
    model = tiny_model()
    predictors = bench_e2e.random_predictors(model)
    calls = []
    real = base_moe.ops.add_rms_norm
    monkeypatch.setattr(base_moe.ops, "add_rms_norm", lambda *a: calls.append(1) or real(*a))
    layer = model.model.layers[0]
    h = torch.randn(2, 1, model.config.hidden_size)
    for name in ("hf_grouped_mm", "base_moe_dense", "base_M4", "base_M4_model_norm"):
        bench_e2e.configure_variant(model, name, predictors)
        calls.clear()
        with torch.no_grad():
            base_moe.hf.post_attention(layer, h, torch.randn_like(h))
        assert bool(calls) == bench_e2e.runs_base_moe_norm(name), name
