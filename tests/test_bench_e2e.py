"""bench_e2e's decode loop computes what the model computes: greedy decode logits equal the HF forward's; and its
figures (seconds per step, tokens / s, MoE share, speed-ups, active experts) are what they say."""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_e2e  # noqa: E402
from test_bench_common import fake_cuda  # noqa: E402
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


@torch.no_grad()
def test_time_decode_is_the_median_seconds_per_step(monkeypatch):
    """Each repeat times decode_len replays of the one-step graph: its milliseconds / 1e3 / decode_len."""
    fake_cuda(monkeypatch, elapsed_ms=[12.0, 4.0, 5.0])
    step = bench_e2e.time_decode(tiny_model(), batch=2, prompt_len=3, decode_len=4, repeats=3)
    assert step == pytest.approx(5.0 / 1e3 / 4)  # the median repeat (not the mean or the fastest)


def test_active_experts_is_the_mean_over_layers(monkeypatch):
    """Experts with at least one token in each layer's recorded selection, averaged over the layers."""
    import base_moe

    model = tiny_model()
    bench_e2e.configure_variant(model, "base_M3", bench_e2e.random_predictors(model))
    layers = {i: (types.SimpleNamespace(counts=torch.tensor([[1, 0, 2, 0, 0, 0, 0, 0]])), None) for i in range(2)}
    layers[2] = (types.SimpleNamespace(counts=torch.tensor([[1, 1, 0, 3, 0, 0, 0, 1]])), None)
    monkeypatch.setattr(base_moe.hf, "selections", lambda model: layers)
    assert bench_e2e.active_experts(model, batch=2, prompt_len=3) == pytest.approx((2 + 2 + 4) / 3)


# seconds per decode step of each (batch, variant), and with the MoE blocks skipped, per (batch, base_moe's norm)
STEP_S = {(2, "hf_grouped_mm"): 0.020, (2, "base_moe_dense"): 0.016, (2, "base_M3"): 0.010,
          (4, "hf_grouped_mm"): 0.030, (4, "base_moe_dense"): 0.024, (4, "base_M3"): 0.012}
NON_MOE_S = {(2, False): 0.008, (2, True): 0.006, (4, False): 0.009, (4, True): 0.007}


def test_e2e_figures(monkeypatch, tmp_path, capsys):
    """main()'s rows from its step times (faked): ms per step, tokens / s, the MoE share against the same batch's
    non-MoE step with the variant's own norm, the speed-ups (tokens / s over the same batch's baseline's)."""
    variant = []
    configure = bench_e2e.configure_variant
    monkeypatch.setattr(bench_e2e, "configure_variant",
                        lambda model, name, predictors: variant.append(name) or configure(model, name, predictors))

    def time_decode(model, batch, prompt_len, decode_len, repeats, skip_moe=False, **options):
        if skip_moe:
            return NON_MOE_S[batch, bench_e2e.runs_base_moe_norm(variant[-1])]
        return STEP_S[batch, variant[-1]]

    monkeypatch.setattr(bench_e2e, "time_decode", time_decode)
    monkeypatch.setattr(bench_e2e, "build_model", lambda layers: tiny_model())
    monkeypatch.setattr(bench_e2e, "require_cuda", lambda script: None)
    out = tmp_path / "e2e.json"
    monkeypatch.setattr(sys, "argv", ["bench_e2e.py", "--batches", "2,4", "--budgets", "3", "--variants",
                                      "hf_grouped_mm,base_moe_dense", "--prompt", "4", "--json", str(out)])
    # main() raises dynamo's recompile limit: restored by config.patch (a monkeypatch of the config module's attribute
    # left it hidden, "torch._dynamo.config.recompile_limit does not exist", for every later compile of the session)
    with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.recompile_limit):
        bench_e2e.main()
    result = json.loads(out.read_text())
    config = bench_e2e.qwen3_30b_config(48)
    assert [result["config"][key] for key in ("hidden", "experts", "top_k", "intermediate")] == [
        config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size]
    assert [(r["batch"], r["variant"]) for r in result["rows"]] == list(STEP_S)
    for r in result["rows"]:
        step, non_moe = STEP_S[r["batch"], r["variant"]], NON_MOE_S[r["batch"], r["variant"] != "hf_grouped_mm"]
        assert r["step_ms"] == pytest.approx(step * 1e3) and r["non_moe_step_ms"] == pytest.approx(non_moe * 1e3)
        assert r["tokens_per_s"] == pytest.approx(r["batch"] / step)
        assert r["moe_share"] == pytest.approx(1 - non_moe / step)
        for baseline in ("hf_grouped_mm", "base_moe_dense"):
            assert r[f"speedup_vs_{baseline}"] == pytest.approx(STEP_S[r["batch"], baseline] / step)
        assert (r["active_experts"] is None) == (r["variant"] == "hf_grouped_mm")
    assert result["rows"][5]["active_experts"] == 3  # batch 4, base_M3
    assert "| 4 | base_M3 | 12.00 | 333 | 42% | 2.00x | 2.50x |" in capsys.readouterr().out
