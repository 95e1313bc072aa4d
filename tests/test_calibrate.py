"""Calibration: the streamed ridge regression, the hold-out split, the hook-driven driver, real tiny models."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import base_moe
from base_moe.calibrate import RidgeAccumulator, calibrate_layouts, held_out_sequences


# ---------------------------------------------------------------------------------------------
# Helpers shared with test_predictors.py and test_cli.py
# ---------------------------------------------------------------------------------------------
def tiny_qwen3_moe(layers: int = 2, hidden: int = 32, experts: int = 8, seed: int = 0):
    """A randomly initialised byte-level (vocab 256) Qwen3-MoE, fp32, eval mode."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=256, hidden_size=hidden, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=experts, num_experts_per_tok=2,
        max_position_embeddings=256, tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).eval()


# ---------------------------------------------------------------------------------------------
# Ridge regression from streamed sums
# ---------------------------------------------------------------------------------------------
def planted(n: int, h: int, e: int, noise: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g) * torch.linspace(0.1, 3.0, h) + torch.randn(h, generator=g)  # uneven scales, offset
    w = torch.randn(e, h, generator=g) / math.sqrt(h)
    b = torch.randn(e, generator=g)
    y = x @ w.T + b + noise * torch.randn(n, e, generator=g)
    return x, y, w, b


def test_ridge_recovers_planted_linear_relationship():
    x, y, w, b = planted(4000, 24, 6, noise=0.01)
    held = torch.arange(4000) % 10 == 9
    acc = RidgeAccumulator(24, 6)
    for xs, ys, hs in zip(x.split(700), y.split(700), held.split(700)):  # streamed in uneven chunks
        acc.add(xs, ys, hs)
    fit = acc.fit(ridge=1e-6)
    assert fit.tokens_train == 3600 and fit.tokens_holdout == 400
    torch.testing.assert_close(fit.weight.float(), w, atol=1e-2, rtol=0)  # feature 0 has scale 0.1
    torch.testing.assert_close(fit.bias.float(), b, atol=5e-3, rtol=0)
    assert fit.r2 > 0.999
    assert fit.expert_r2.shape == (6,) and bool((fit.expert_r2 > 0.999).all())
    torch.testing.assert_close(fit.mean_target, y.double().mean(0))


def test_heldout_r2_from_sums_matches_direct_computation():
    x, y, _, _ = planted(3000, 16, 5, noise=0.5)
    held = torch.arange(3000) % 4 == 0
    acc = RidgeAccumulator(16, 5)
    acc.add(x, y, held)
    fit = acc.fit(ridge=1e-2)
    pred = x[held].double() @ fit.weight.T + fit.bias
    yh = y[held].double()
    sse = ((yh - pred) ** 2).sum(0)
    sst = ((yh - yh.mean(0)) ** 2).sum(0)
    torch.testing.assert_close(fit.expert_r2, 1 - sse / sst, rtol=0, atol=1e-9)
    assert fit.r2 == pytest.approx(1 - sse.sum().item() / sst.sum().item(), abs=1e-9)
    assert 0.3 < fit.r2 < 0.99  # noisy: the held-out score is an honest one


def test_ridge_does_not_penalise_the_bias():
    x, y, _, _ = planted(1000, 8, 3, noise=0.1)
    acc = RidgeAccumulator(8, 3)
    acc.add(x, y)
    fit = acc.fit(ridge=1e9)  # weights shrink to zero, the bias becomes the mean target
    assert fit.weight.abs().max() < 1e-6
    torch.testing.assert_close(fit.bias, y.double().mean(0), atol=1e-6, rtol=0)
    assert math.isnan(fit.r2)  # no held-out rows


def test_ridge_is_invariant_to_feature_scales():
    """Hidden states have a few dimensions far larger than the rest: rescaling one changes nothing."""
    x, y, _, _ = planted(500, 12, 3, noise=1.0)
    # Scaled in fp64, where x * 1000 is exact (24-bit fp32 mantissas): in fp32 the product rounds, and that rounding
    # alone moved the fit by up to 5x the fp64 tolerance below (a third of the seeds failed; 0.5x at this one on AVX2).
    s = torch.tensor([1000.0] + [1.0] * 11, dtype=torch.float64)
    scaled = x.double() * s
    fits = []
    for features in (x, scaled):
        acc = RidgeAccumulator(12, 3)
        acc.add(features, y, torch.arange(500) % 5 == 0)
        fits.append(acc.fit(ridge=0.3))
    torch.testing.assert_close(fits[1].weight * s, fits[0].weight)
    torch.testing.assert_close(fits[1].bias, fits[0].bias)
    assert fits[1].r2 == pytest.approx(fits[0].r2, abs=1e-9)


def test_ridge_is_invariant_to_feature_scales_when_one_dimension_dwarfs_the_rest():
    """Massive activations: one dimension 2^20 times larger must not change the penalty of the others."""
    x, y, _, _ = planted(2000, 16, 3, noise=0.1)
    s = torch.ones(16, dtype=torch.float64)
    s[0] = 2.0**20
    fits = []
    for features in (x.double(), x.double() * s):
        acc = RidgeAccumulator(16, 3)
        acc.add(features, y, torch.arange(2000) % 5 == 0)
        fits.append(acc.fit(ridge=1e-3))
    torch.testing.assert_close(fits[1].weight * s, fits[0].weight)
    torch.testing.assert_close(fits[1].bias, fits[0].bias)
    assert fits[1].r2 == pytest.approx(fits[0].r2, abs=1e-9)


def test_constant_features_get_weight_zero():
    x, y, _, _ = planted(500, 8, 2, noise=0.1)
    xc = torch.cat([x, torch.full((500, 1), 7.0), torch.zeros(500, 1)], dim=1)
    for ridge in (0.0, 1e-3):
        acc = RidgeAccumulator(10, 2)
        acc.add(xc, y)
        fit = acc.fit(ridge=ridge)
        assert bool(torch.isfinite(fit.weight).all()) and fit.weight[:, 8:].abs().max() == 0


def test_singular_system_is_a_clear_error():
    acc = RidgeAccumulator(16, 2)
    acc.add(torch.randn(5, 16), torch.randn(5, 2))
    with pytest.raises(ValueError, match="singular.*larger ridge"):
        acc.fit(ridge=0.0)
    acc.fit(ridge=1e-3)  # a ridge makes it solvable


def test_ridge_fit_needs_two_training_tokens():
    acc = RidgeAccumulator(4, 2)
    acc.add(torch.randn(1, 4), torch.randn(1, 2), torch.tensor([False]))
    with pytest.raises(ValueError, match="at least 2 training tokens, got 1"):
        acc.fit(ridge=1e-3)


def test_expert_r2_is_nan_where_the_held_out_target_is_constant():
    """R^2 is undefined for an expert whose held-out targets do not vary (SST = 0): NaN, not a huge negative."""
    x, y, _, _ = planted(400, 6, 3, noise=0.3)
    held = torch.arange(400) % 4 == 0
    y[held, 1] = 0.5  # exactly representable: the held-out sums give SST = 0 exactly
    acc = RidgeAccumulator(6, 3)
    acc.add(x, y, held)
    fit = acc.fit(ridge=1e-3)
    assert math.isnan(fit.expert_r2[1].item())
    assert bool(torch.isfinite(fit.expert_r2[[0, 2]]).all())


def test_expert_r2_is_nan_for_any_constant_held_out_target():
    """Constants that are not exactly representable: SST, a difference of two equal sums, may round to a tiny positive
    number instead of 0 (for ~1 in 10 of these), which must still give NaN (it gave R^2 = 1)."""
    g = torch.Generator().manual_seed(0)
    x, y, _, _ = planted(3000, 6, 3, noise=0.3)
    held = torch.arange(3000) % 4 == 0
    for constant in (-1.0 - torch.rand(60, generator=g, dtype=torch.float64)).tolist():
        y[held, 1] = constant
        acc = RidgeAccumulator(6, 3)
        acc.add(x, y, held)
        assert math.isnan(acc.fit(ridge=1e-3).expert_r2[1].item()), constant


def test_r2_of_an_exact_fit_is_at_most_one():
    """An exactly linear target: the held-out SSE from the sums is 0 up to rounding, which must not push R^2 above 1
    (of 16 experts, some get a slightly negative SSE from the sums' rounding)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(300, 8, generator=g, dtype=torch.float64)
    y = x @ torch.randn(16, 8, generator=g, dtype=torch.float64).T + 0.3
    acc = RidgeAccumulator(8, 16)
    acc.add(x, y, torch.arange(300) % 3 == 0)
    fit = acc.fit(ridge=0.0)
    assert fit.r2 <= 1.0 and bool((fit.expert_r2 <= 1.0).all())
    assert fit.r2 > 1 - 1e-9


def test_held_out_sequences_are_fixed_and_independent_of_batching():
    whole = held_out_sequences(0, 40, 0.1)
    assert whole.nonzero().flatten().tolist() == [9, 19, 29, 39]
    pieces = torch.cat([held_out_sequences(s, n, 0.1) for s, n in [(0, 7), (7, 13), (20, 20)]])
    assert torch.equal(whole, pieces)
    assert int(held_out_sequences(0, 1000, 0.25).sum()) == 250
    assert not held_out_sequences(0, 50, 0.0).any()


# ---------------------------------------------------------------------------------------------
# The driver on a planted model: expert u's output norm is exactly exp(a_u . z + b_u)
# ---------------------------------------------------------------------------------------------
class PlantedBlock(nn.Module):
    def __init__(self, hidden: int, experts: int):
        super().__init__()
        self.a = nn.Parameter(torch.randn(experts, hidden) / hidden)
        self.b = nn.Parameter(torch.randn(experts))
        self.v = nn.Parameter(F.normalize(torch.randn(experts, hidden), dim=-1))

    def expert_output(self, x: torch.Tensor, u: int) -> torch.Tensor:
        return torch.exp(x @ self.a[u] + self.b[u])[..., None] * self.v[u]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(self.expert_output(x, u) for u in range(self.a.shape[0])) / self.a.shape[0]


class PlantedModel(nn.Module):
    def __init__(self, hidden: int = 16, experts: int = 4, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(256, hidden)
        self.blocks = nn.ModuleList(PlantedBlock(hidden, experts) for _ in range(layers))
        self.head = nn.Linear(hidden, 256)
        self.head_calls = 0

    def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = torch.tanh(block(h))
        self.head_calls += 1
        return self.head(h)


class PlantedLayout:
    def __init__(self, index: int, block: PlantedBlock):
        self.name, self.layer_index, self.block = f"blocks.{index}", index, block
        self.routing = base_moe.Routing(top_k=2)
        self.num_experts, self.hidden_size = block.a.shape

    def expert_output(self, x: torch.Tensor, u: int) -> torch.Tensor:
        return self.block.expert_output(x, u)


def planted_setup():
    torch.manual_seed(0)
    model = PlantedModel()
    return model, [PlantedLayout(i, b) for i, b in enumerate(model.blocks)]


@pytest.mark.parametrize("holdout, needed", [(0.1, 10), (0.2, 5), (0.3, 4)])
def test_too_few_sequences_to_hold_one_out_warn(holdout, needed):
    model, layouts = planted_setup()
    with pytest.warns(UserWarning, match=f"needs at least {needed} sequences with holdout={holdout}, got {needed - 1}"):
        predictors = calibrate_layouts(model, layouts, torch.randint(0, 256, (needed - 1, 16)), holdout=holdout,
                                       progress=False)
    assert all(math.isnan(r) for r in predictors.r2.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one more sequence: one held out, no warning
        predictors = calibrate_layouts(model, layouts, torch.randint(0, 256, (needed, 16)), holdout=holdout,
                                       progress=False)
        calibrate_layouts(model, layouts, torch.randint(0, 256, (2, 16)), holdout=0.0, progress=False)  # none asked
    assert predictors.metadata["tokens_holdout"] == 16


def test_metadata_records_the_holdout_the_split_used():
    """holdout=7e-5 splits as 1/10000 (the split's fractions have denominators up to 10,000): the metadata says 1e-4,
    the fraction the held-out tokens come from (it said 7e-5)."""
    model, layouts = planted_setup()
    with pytest.warns(UserWarning, match="needs at least 10000 sequences"):
        predictors = calibrate_layouts(model, layouts, torch.randint(0, 256, (4, 16)), holdout=7e-5, progress=False)
    assert predictors.metadata["holdout"] == 1e-4
    predictors = calibrate_layouts(model, layouts, torch.randint(0, 256, (4, 16)), holdout=0.25, progress=False)
    assert predictors.metadata["holdout"] == 0.25
    predictors = calibrate_layouts(model, layouts, torch.randint(0, 256, (4, 16)), holdout=1 / 3, progress=False)
    assert predictors.metadata["holdout"] == 1 / 3  # the fraction itself, not a rounding of it


def test_one_held_out_token_warns():
    """One held-out token (sequences of one token) leaves R^2 undefined: NaN with a warning, as with none."""
    model, layouts = planted_setup()
    with pytest.warns(UserWarning, match="one token was held out: the held-out R\\^2 needs at least 2"):
        predictors = calibrate_layouts(model, layouts, torch.randint(0, 256, (10, 1)), holdout=0.1, progress=False)
    assert predictors.metadata["tokens_holdout"] == 1
    assert all(math.isnan(r) for r in predictors.r2.values())


def test_calibrate_recovers_planted_log_norms_through_the_hooks():
    model, layouts = planted_setup()
    ids = torch.randint(0, 256, (20, 16))
    predictors = calibrate_layouts(model, layouts, ids, batch_size=6, ridge=1e-9, holdout=0.2, progress=False)
    assert predictors.layers == [0, 1, 2]
    assert model.head_calls == 0  # the forward stops after the last MoE layer
    assert not model.blocks[0]._forward_pre_hooks  # hooks removed
    meta = predictors.metadata
    assert (meta["tokens"], meta["tokens_train"], meta["tokens_holdout"]) == (320, 256, 64)
    assert (meta["sequences"], meta["seq_len"], meta["hidden_size"], meta["num_experts"]) == (20, 16, 16, 4)
    for i, block in enumerate(model.blocks):
        assert predictors.r2[i] > 0.99999
        torch.testing.assert_close(predictors.weight[i], block.a.detach(), atol=1e-4, rtol=0)
        torch.testing.assert_close(predictors.bias[i], block.b.detach(), atol=1e-4, rtol=0)
        assert predictors.weight[i].dtype == torch.float32 and predictors.mean_log_norm[i].shape == (4,)


def test_calibrate_measures_expert_output_similarity():
    """similarity=True: per layer, the cosine of every two experts' outputs over all calibration tokens (held-out
    ones too), from the layer inputs the hooks saw, whatever the batching; the fit itself does not change."""
    model, layouts = planted_setup()
    ids = torch.randint(0, 256, (10, 8), generator=torch.Generator().manual_seed(3))
    with_sim = calibrate_layouts(model, layouts, ids, batch_size=3, holdout=0.2, progress=False, similarity=True)
    plain = calibrate_layouts(model, layouts, ids, batch_size=3, holdout=0.2, progress=False)
    assert plain.similarity == {} and "similarity" not in plain.metadata and "similarity" in with_sim.metadata
    with torch.no_grad():
        h = model.embed(ids)
        for i, block in enumerate(model.blocks):
            outputs = torch.stack([block.expert_output(h, u).reshape(-1) for u in range(4)]).double()
            expected = F.normalize(outputs, dim=1) @ F.normalize(outputs, dim=1).T
            torch.testing.assert_close(with_sim.similarity[i], expected.float(), atol=1e-5, rtol=0)
            assert torch.equal(with_sim.weight[i], plain.weight[i]) and torch.equal(with_sim.bias[i], plain.bias[i])
            h = torch.tanh(block(h))


def test_calibrate_accepts_an_iterable_of_batches_and_is_deterministic():
    model, layouts = planted_setup()
    ids = torch.randint(0, 256, (12, 8))
    a = calibrate_layouts(model, layouts, ids, batch_size=4, progress=False)
    b = calibrate_layouts(model, layouts, iter(ids.split(4)), batch_size=4, progress=False)
    for i in a.layers:
        assert torch.equal(a.weight[i], b.weight[i]) and torch.equal(a.bias[i], b.bias[i])
        assert torch.equal(a.mean_log_norm[i], b.mean_log_norm[i])
    assert a.r2 == b.r2


@pytest.mark.parametrize("bad_id", [256, 300, -1])
def test_calibrate_rejects_token_ids_outside_the_vocabulary(bad_id):
    """An id the embedding cannot look up is named before the forward pass (whose IndexError names none)."""
    ids = torch.randint(0, 256, (2, 16))
    ids[0, :2] = torch.tensor([0, 255])  # so that the ids span [min(bad_id, 0), max(bad_id, 255)]
    ids[1, 5] = bad_id
    message = rf"token ids in \[0, 256\), got ids from {min(bad_id, 0)} to {max(bad_id, 255)}"
    with pytest.raises(ValueError, match=message):
        base_moe.calibrate(tiny_qwen3_moe(layers=1), ids, progress=False)


def test_calibrate_rejects_bad_options():
    model, layouts = planted_setup()
    ids = torch.randint(0, 256, (4, 8))
    for holdout in (1.0, -0.1, 4e-5, 0.99996):  # the last two round to 0 and 1 as the split's fraction
        message = f"holdout must be 0 or strictly between 1/20000 and 1 - 1/20000, got {holdout}"
        with pytest.raises(ValueError, match=message):
            calibrate_layouts(model, layouts, ids, holdout=holdout, progress=False)
    with pytest.raises(ValueError, match="input_ids batches must be"):
        calibrate_layouts(model, layouts, ids[None], progress=False)
    with pytest.raises(ValueError, match="input_ids batches must hold tokens"):
        calibrate_layouts(model, layouts, ids[:0], progress=False)
    with pytest.raises(TypeError, match="integer token ids, got dtype torch.float32"):
        calibrate_layouts(model, layouts, ids.float(), progress=False)
    for ridge in (math.inf, math.nan, -1.0):
        with pytest.raises(ValueError, match="ridge must be finite and >= 0"):
            calibrate_layouts(model, layouts, ids, ridge=ridge, progress=False)
    with pytest.raises(ValueError, match="ridge must be finite"):
        calibrate_layouts(model, layouts, ids, ridge_sweep=[0.1, math.inf], progress=False)
    for batch_size in (2.5, 0, True):
        with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
            calibrate_layouts(model, layouts, ids, batch_size=batch_size, progress=False)
    for empty in ([], iter(())):
        with pytest.raises(ValueError, match="input_ids holds no sequences"):
            calibrate_layouts(model, layouts, empty, progress=False)
    for lists in ([[1, 2, 3], [4, 5, 6]], ([1, 2, 3],)):  # the progress bar's total must not fail first
        with pytest.raises(TypeError, match="an integer tensor \\[N, S\\] or an iterable of them, got list"):
            calibrate_layouts(model, layouts, lists, progress=False)


def test_one_ridge_sweep_value_is_a_sweep_of_one():
    model, layouts = planted_setup()
    ids = torch.randint(0, 256, (10, 8), generator=torch.Generator().manual_seed(3))
    one = calibrate_layouts(model, layouts, ids, ridge_sweep=0.5, progress=False)
    listed = calibrate_layouts(model, layouts, ids, ridge_sweep=[0.5], progress=False)
    assert list(one.stats["r2_by_ridge"]) == [0.5] and one.stats["r2_by_ridge"] == listed.stats["r2_by_ridge"]


def test_sequences_past_the_context_warn_once_per_length():
    """The tiny model's context is 256 tokens: sequences of 300 warn (once, however many batches), 256 do not."""
    model = tiny_qwen3_moe(layers=1)
    ids = torch.randint(0, 256, (4, 300), generator=torch.Generator().manual_seed(4))
    with pytest.warns(UserWarning, match="seq=300 is longer than the model's context") as caught:
        base_moe.calibrate(model, ids, batch_size=2, holdout=0, progress=False)
    assert sum("longer than the model's context" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        base_moe.calibrate(model, ids[:, :256], batch_size=2, holdout=0, progress=False)


def test_a_singular_ridge_sweep_value_does_not_abort_the_calibration():
    """Fewer training tokens than features: ridge 0 is singular, the used ridge is not; the sweep reports NaN."""
    model = tiny_qwen3_moe()
    ids = torch.randint(0, 256, (10, 2), generator=torch.Generator().manual_seed(0))
    pred = base_moe.calibrate(model, ids, ridge=1e-2, ridge_sweep=[0.0, 1.0], progress=False)
    assert all(math.isnan(v) for v in pred.stats["r2_by_ridge"][0.0].values())
    assert all(math.isfinite(v) for v in pred.stats["r2_by_ridge"][1.0].values())


def test_calibrate_takes_any_integer_dtype():
    """Token ids as uint8 (torch.frombuffer of a byte-level text) or int16 give the int64 ids' predictors."""
    model, layouts = planted_setup()
    ids = torch.randint(0, 256, (10, 8))
    want = calibrate_layouts(model, layouts, ids, batch_size=4, progress=False)
    for dtype in (torch.uint8, torch.int16, torch.int32):
        got = calibrate_layouts(model, layouts, ids.to(dtype), batch_size=4, progress=False)
        assert all(torch.equal(got.weight[i], want.weight[i]) for i in want.layers)


# ---------------------------------------------------------------------------------------------
# A real (tiny, random) Hugging Face MoE through base_moe.calibrate
# ---------------------------------------------------------------------------------------------
def test_calibrate_tiny_qwen3_moe_reports_r2_per_layer(tmp_path):
    model = tiny_qwen3_moe(layers=3)
    ids = torch.randint(0, 256, (20, 32))
    predictors = base_moe.calibrate(model, ids, batch_size=8, progress=False)
    assert predictors.layers == [0, 1, 2]
    assert set(predictors.r2) == {0, 1, 2} and all(math.isfinite(v) and v <= 1 for v in predictors.r2.values())
    for i in predictors.layers:
        assert predictors.weight[i].shape == (8, 32) and predictors.bias[i].shape == (8,)
        assert torch.isfinite(predictors.weight[i]).all() and torch.isfinite(predictors.mean_log_norm[i]).all()
    meta = predictors.metadata
    assert meta["model_type"] == "qwen3_moe" and meta["layers"] == [0, 1, 2] and meta["tokens_holdout"] == 64
    assert meta["routing"]["top_k"] == 2
    predictors.check_compatible(model)

    # the targets are the experts' real output norms: check one layer's mean against a direct computation
    captured = {}
    handle = model.model.layers[1].mlp.register_forward_pre_hook(lambda m, a: captured.setdefault("z", a[0]))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    handle.remove()
    z = captured["z"].reshape(-1, 32)
    experts = model.model.layers[1].mlp.experts
    gate, up = F.linear(z, experts.gate_up_proj[3]).chunk(2, dim=-1)
    direct = F.linear(F.silu(gate) * up, experts.down_proj[3]).norm(dim=-1).log().mean().detach()
    assert float(predictors.mean_log_norm[1][3]) == pytest.approx(float(direct), abs=1e-4)

    # same model, tokens and options: the same file, byte for byte
    again = base_moe.calibrate(model, ids, batch_size=8, progress=False)
    predictors.save(tmp_path / "a.safetensors")
    again.save(tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "gpt_oss"])
def test_calibrate_every_supported_family(family):
    """Shared experts, sigmoid routing with groups, dense first layers, router biases: predictors for exactly
    the MoE layers, and apply() accepts them."""
    from hf_models import VOCAB, tiny_model

    model = tiny_model(family)
    ids = torch.randint(0, VOCAB, (10, 16))
    predictors = base_moe.calibrate(model, ids, progress=False)
    layers = [layout.layer_index for layout in base_moe.layouts.find_moe_layouts(model)]
    assert predictors.layers == layers and all(math.isfinite(v) for v in predictors.r2.values())
    assert predictors.metadata["model_type"] == family
    base_moe.apply(model, predictors=predictors, budget=3)
    try:
        with torch.no_grad():
            model(input_ids=ids[:4])
        with pytest.raises(ValueError, match="calibration runs the dense model"):
            base_moe.calibrate(model, ids, progress=False)
        base_moe.configure(model, budget=None, policy="oea")  # prunes per token without a budget: still refused
        with pytest.raises(ValueError, match="configure\\(model, policy='dense'\\)"):
            base_moe.calibrate(model, ids, progress=False)
        base_moe.configure(model, policy="dense")
        again = base_moe.calibrate(model, ids, progress=False)  # dense again: the same predictors
        assert all(torch.equal(again.weight[i], predictors.weight[i]) for i in layers)
    finally:
        base_moe.restore(model)


# ---------------------------------------------------------------------------------------------
# Edge cases found by mutation testing
# ---------------------------------------------------------------------------------------------
def test_constant_features_off_the_binary_grid_get_weight_zero():
    """A constant like 0.1 is not exact in binary: its centred sum of squares is a rounding residue, not exactly 0.
    It must still count as constant (weight 0), and the fit must be the one without it."""
    x, y, _, _ = planted(500, 8, 2, noise=0.1)
    held = torch.arange(500) % 5 == 0
    plain = RidgeAccumulator(8, 2)
    plain.add(x, y, held)
    expected = plain.fit(ridge=1e-3)
    consts = torch.tensor([0.1, 3.7, 12.3]).expand(500, 3)
    acc = RidgeAccumulator(11, 2)
    acc.add(torch.cat([x, consts], dim=1), y, held)
    fit = acc.fit(ridge=1e-3)
    assert fit.weight[:, 8:].abs().max() == 0
    torch.testing.assert_close(fit.weight[:, :8], expected.weight)
    torch.testing.assert_close(fit.bias, expected.bias)
    assert fit.r2 == pytest.approx(expected.r2, abs=1e-9)


class _CurvedLayout(PlantedLayout):
    """Log-norms that are not linear in z: the fit (and its R^2) depends on which rows it was trained on."""

    def expert_output(self, x: torch.Tensor, u: int) -> torch.Tensor:
        return self.block.expert_output(x, u) * (1.0 + 4.0 * x[..., :1] ** 2)


def test_held_out_rows_are_the_tokens_of_the_held_out_sequences():
    """Sequence i's tokens are rows i*S .. i*S+S-1 of the block input: exactly those rows are held out."""
    torch.manual_seed(0)
    model = PlantedModel(layers=1)
    layout = _CurvedLayout(0, model.blocks[0])
    ids = torch.randint(0, 256, (10, 8), generator=torch.Generator().manual_seed(3))
    predictors = calibrate_layouts(model, [layout], ids, batch_size=10, ridge=1e-2, holdout=0.2, progress=False)
    captured = []
    handle = model.blocks[0].register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    with torch.no_grad():
        model(ids)
    handle.remove()
    x = captured[0].reshape(-1, layout.hidden_size)
    held = torch.tensor([4, 9]).repeat_interleave(8) * 8 + torch.arange(8).repeat(2)  # sequences 4 and 9
    mask = torch.zeros(80, dtype=torch.bool)
    mask[held] = True
    acc = RidgeAccumulator(layout.hidden_size, layout.num_experts)
    acc.add(x, base_moe.layouts.expert_log_norms(layout, x), mask)
    fit = acc.fit(ridge=1e-2)
    torch.testing.assert_close(predictors.weight[0], fit.weight.float())
    torch.testing.assert_close(predictors.bias[0], fit.bias.float())
    assert predictors.r2[0] == pytest.approx(fit.r2, abs=1e-6) and fit.r2 < 0.999
