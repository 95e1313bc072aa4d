"""base_moe.layouts: structure-based detection of HF MoE blocks and the plain-PyTorch view of each one."""

from __future__ import annotations

import functools
import math
import re
import types
import warnings

import pytest
import torch
from hf_models import FAMILIES, NUM_EXPERTS, selection_output, tiny_model
from torch import nn

from base_moe import reference
from base_moe.layouts import LOG_NORM_FLOOR, MoELayoutError, _candidate_routings, _random_like, find_moe_layouts
from base_moe.routing import Routing, Scoring

EXPECTED = {
    "qwen3_moe": dict(routing=Routing(2, Scoring.SOFTMAX, True), layers=[0, 1], fused=True, shared=()),
    "qwen2_moe": dict(routing=Routing(2, Scoring.SOFTMAX, False), layers=[0, 1], fused=True, shared=("shared_expert",)),
    "olmoe": dict(routing=Routing(2, Scoring.SOFTMAX, False), layers=[0, 1], fused=True, shared=()),
    "mixtral": dict(routing=Routing(2, Scoring.SOFTMAX, True), layers=[0, 1], fused=True, shared=()),
    "deepseek_v3": dict(
        routing=Routing(2, Scoring.SIGMOID, True, n_group=4, topk_group=2, scaling=2.5),
        layers=[1, 2], fused=True, shared=("shared_experts",),
    ),
    "gpt_oss": dict(routing=Routing(2, Scoring.SOFTMAX_AFTER_TOPK, False), layers=[0, 1], fused=False, shared=()),
}

_MODELS: dict[str, nn.Module] = {}


def model_of(family: str) -> nn.Module:
    """One tiny model per family for this module (the layout functions do not modify it)."""
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family)
    return _MODELS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_detects_every_family(family):
    model = model_of(family)
    layouts = find_moe_layouts(model)
    expected = EXPECTED[family]
    assert [lay.layer_index for lay in layouts] == expected["layers"]
    assert [lay.name for lay in layouts] == [f"model.layers.{i}.mlp" for i in expected["layers"]]
    for lay in layouts:
        assert lay.routing == expected["routing"]
        assert lay.num_experts == NUM_EXPERTS and lay.hidden_size == 32
        assert lay.fused == expected["fused"]
        assert lay.shared_names == expected["shared"]
        assert lay.block is model.get_submodule(lay.name)
        assert lay.returns_router_scores == (family == "gpt_oss")
        # (asked of a bf16 copy: DeepSeek-V3's router computes fp32 logits, the others' logits are their weight's dtype)
        assert lay.router_rounds_logits == (family != "deepseek_v3")
    assert (layouts[0].shared_gate_name is not None) == (family == "qwen2_moe")


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_layout_reproduces_the_block(family):
    """router_logits, routing, expert_output and shared_output together give the HF block's output."""
    lay = find_moe_layouts(model_of(family))[-1]
    x = torch.randn(7, lay.hidden_size)
    hf_logits = lay.router(x)[0]
    logits = lay.router_logits(x)
    assert logits.dtype == torch.float32 and torch.equal(logits, hf_logits.float())

    bias = lay.correction_bias()
    assert (bias is not None) == (family == "deepseek_v3")
    ids, weights = reference.route(logits, lay.routing, bias)
    assert (lay.shared_output(x) is not None) == bool(EXPECTED[family]["shared"])
    y = selection_output(lay, x, ids, weights)
    out = lay.block(x[None])
    out = out[0] if isinstance(out, tuple) else out
    torch.testing.assert_close(y, out[0], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_expert_log_norms_match_expert_outputs():
    lay = find_moe_layouts(model_of("gpt_oss"))[0]
    x = torch.randn(5, lay.hidden_size)
    norms = lay.expert_log_norms(x)
    assert norms.shape == (5, lay.num_experts) and norms.dtype == torch.float32
    torch.testing.assert_close(norms[:, 3], lay.expert_output(x, 3).norm(dim=-1).log())
    fresh = find_moe_layouts(tiny_model("gpt_oss"))[0]  # model_of's models are shared: this one is changed
    with torch.no_grad():
        fresh.experts.down_proj[5].zero_()  # a zero output: the floor, as calibration's targets have it
    zero = fresh.expert_log_norms(x)[:, 5]
    assert torch.equal(zero, torch.full((5,), math.log(LOG_NORM_FLOOR), dtype=torch.float32))


def test_norm_topk_prob_is_read_from_the_model():
    lay = find_moe_layouts(tiny_model("qwen3_moe", norm_topk_prob=False))[0]
    assert lay.routing == Routing(2, Scoring.SOFTMAX, False)


def test_dense_model_has_no_moe_blocks():
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4
    )
    assert find_moe_layouts(transformers.LlamaForCausalLM(cfg)) == []


def test_two_moe_stacks_sharing_layer_indices_are_refused():
    """Two decoder stacks (as a thinker and a talker) each count their layers from 0: the blocks would share the
    layer indices that key predictors and selections."""
    pair = nn.Module()
    pair.thinker, pair.talker = tiny_model("qwen3_moe").model, tiny_model("qwen3_moe").model
    with pytest.raises(MoELayoutError, match="'thinker.layers.0.mlp' and 'talker.layers.0.mlp' both have layer "
                       "index 0"):
        find_moe_layouts(pair)
    assert [layout.layer_index for layout in find_moe_layouts(pair.thinker)] == [0, 1]


def test_hybrid_models_convolutions_are_not_experts():
    """A hybrid model (Jamba's Mamba mixers, Qwen3-Next's linear attention) has 3-D convolution weights beside its
    MoE blocks: only the MoE blocks are found."""
    model = tiny_model("qwen3_moe")
    model.model.layers[0].mixer = nn.Module()
    model.model.layers[0].mixer.conv1d = nn.Conv1d(32, 32, kernel_size=4, groups=32)
    assert [layout.name for layout in find_moe_layouts(model)] == ["model.layers.0.mlp", "model.layers.1.mlp"]


# ---------------------------------------------------------------------------------------------------------------
# Blocks that look like MoE but are not understood: a clear error naming the module
# ---------------------------------------------------------------------------------------------------------------
class _Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)


class _ModuleListBlock(nn.Module):  # the transformers 4.x layout
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = nn.ModuleList(_Expert() for _ in range(4))


class _FusedExperts(nn.Module):
    def __init__(self, E=4, H=8, I=6):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.randn(E, H, I))
        self.act_fn = nn.SiLU()

    def forward(self, hidden, top_k_index, top_k_weights):  # HF's eager loop
        out = torch.zeros_like(hidden)
        for u in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(top_k_index == u)
            gate, up = nn.functional.linear(hidden[token], self.gate_up_proj[u]).chunk(2, dim=-1)
            y = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[u])
            out.index_add_(0, token, y * top_k_weights[token, slot, None])
        return out


class _Router(nn.Module):
    def __init__(self, E=4, H=8, mode="softmax"):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(E, H))
        self.top_k, self.mode = 2, mode

    def forward(self, x):
        logits = nn.functional.linear(x, self.weight)
        values, ids = torch.topk(logits, 2, dim=-1)
        if self.mode == "softmax":
            weights = torch.softmax(logits, -1).gather(1, ids)
        else:  # a rule base_moe does not know
            weights = values.abs().sqrt()
        return logits, weights, ids


class _Block(nn.Module):
    def __init__(self, mode="softmax", extra=False, router=True):
        super().__init__()
        if router:
            self.gate = _Router(mode=mode)
        self.experts = _FusedExperts()
        if extra:
            self.adapter = nn.Linear(8, 8)

    def forward(self, hidden):
        _, weights, ids = self.gate(hidden.reshape(-1, 8))
        return self.experts(hidden.reshape(-1, 8), ids, weights).view(hidden.shape)


class _LogitsRouter(nn.Linear):
    """A router that only computes logits; the block routes them (another transformers 5.x shape)."""


class _RoutingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = _LogitsRouter(8, 4, bias=False)
        self.experts = _FusedExperts()
        self.register_buffer("e_score_correction_bias", torch.randn(4) * 0.1)
        self.top_k, self.norm_topk_prob, self.routed_scaling_factor = 2, True, 1.5

    def route_tokens_to_experts(self, router_logits):
        scores = router_logits.sigmoid()
        ids = torch.topk(scores + self.e_score_correction_bias, 2, dim=-1).indices
        weights = scores.gather(1, ids)
        return ids, weights / weights.sum(-1, keepdim=True) * self.routed_scaling_factor

    def forward(self, hidden):
        x = hidden.reshape(-1, 8)
        ids, weights = self.route_tokens_to_experts(self.gate(x))
        return self.experts(x, ids, weights).view(hidden.shape)


class _SharedBlock(_Block):
    """Routed experts plus a shared expert, combined as ``(routed + shared) / 2`` (Cohere2-MoE's default
    ``shared_expert_combination_strategy="average"``) or summed (every other family)."""

    def __init__(self, average: bool):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8))
        self.average = average

    def forward(self, hidden):
        out = super().forward(hidden) + self.shared_experts(hidden)
        return out / 2 if self.average else out


class _BiasArgumentRouter(nn.Module):
    """A router whose forward takes the block's correction bias (MiniMax-M2, HY-V3)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8))
        self.top_k = 2

    def forward(self, x, e_score_correction_bias):
        logits = self._logits(x)
        scores = logits.sigmoid()
        ids = torch.topk(scores + e_score_correction_bias, 2, dim=-1).indices
        weights = scores.gather(1, ids)
        return logits, weights / weights.sum(-1, keepdim=True), ids

    def _logits(self, x):
        return nn.functional.linear(x, self.weight)


class _Fp32BiasArgumentRouter(_BiasArgumentRouter):
    """The same router computing its logits in fp32 whatever its weight's dtype (HY-V3's shape)."""

    def _logits(self, x):
        return nn.functional.linear(x.float(), self.weight.float())


class _KeywordBiasRouter(_BiasArgumentRouter):
    """The same router with its bias argument keyword-only."""

    def forward(self, x, *, e_score_correction_bias):
        return super().forward(x, e_score_correction_bias)


class _BiasArgumentBlock(nn.Module):
    def __init__(self, router=None):
        super().__init__()
        self.gate = router or _BiasArgumentRouter()
        self.experts = _FusedExperts()
        self.register_buffer("e_score_correction_bias", torch.randn(4) * 0.1)

    def forward(self, hidden):
        x = hidden.reshape(-1, 8)
        _, weights, ids = self.gate(x, e_score_correction_bias=self.e_score_correction_bias)
        return self.experts(x, ids, weights).view(hidden.shape)


class _Model(nn.Module):
    """``block`` in layer 1; ``first``, where given, in layer 0."""

    def __init__(self, block, first=None):
        super().__init__()
        self.layers = nn.ModuleList([nn.Module(), nn.Module()])
        self.layers[1].mlp = block
        if first is not None:
            self.layers[0].mlp = first


def test_hand_written_block_is_understood():
    (lay,) = find_moe_layouts(_Model(_Block()))
    assert lay.name == "layers.1.mlp" and lay.layer_index == 1
    assert lay.routing == Routing(2, Scoring.SOFTMAX, False) and lay.fused


def test_block_that_routes_the_logits_itself():
    (lay,) = find_moe_layouts(_Model(_RoutingBlock()))
    assert lay.routing == Routing(2, Scoring.SIGMOID, True, scaling=1.5)
    x = torch.randn(3, 8)
    torch.testing.assert_close(lay.router_logits(x), lay.router(x))
    assert torch.equal(lay.correction_bias(), lay.block.e_score_correction_bias)


@pytest.mark.parametrize(
    "block, message",
    [
        (_ModuleListBlock(), "per-expert ModuleList"),
        (_Block(mode="other"), "match none of base_moe's routing rules"),
        (_Block(extra=True), "unexpected submodule 'adapter'"),
        (_Block(router=False), "no router found"),
        (_SharedBlock(average=True), "not the weighted sum of its routed experts plus its shared experts"),
    ],
)
def test_unknown_layouts_raise_naming_the_module(block, message):
    with pytest.raises(MoELayoutError, match=message) as info:
        find_moe_layouts(_Model(block))
    assert "'layers.1.mlp'" in str(info.value)


def test_shared_experts_that_are_summed_are_understood():
    (lay,) = find_moe_layouts(_Model(_SharedBlock(average=False)))
    assert lay.shared_names == ("shared_experts",)


@pytest.mark.parametrize("router", [_BiasArgumentRouter, _KeywordBiasRouter, _Fp32BiasArgumentRouter])
def test_router_that_takes_the_correction_bias(router):
    (lay,) = find_moe_layouts(_Model(_BiasArgumentBlock(router())))
    assert lay.routing == Routing(2, Scoring.SIGMOID, True)
    # asked of a bf16 stand-in given a stand-in of the block's bias (a real one made the probe fail and say True)
    assert lay.router_rounds_logits == (router is not _Fp32BiasArgumentRouter)
    x = torch.randn(3, 8)
    torch.testing.assert_close(lay.router_logits(x), nn.functional.linear(x, lay.router.weight))


def test_cohere2_moe_averaging_its_shared_expert_is_refused():
    """Cohere2-MoE's default (routed + shared) / 2 used to be taken for routed + shared: a budget keeping every
    expert returned routed + shared where the block returns half of it."""
    import transformers

    def model(strategy):
        cfg = transformers.Cohere2MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
            shared_expert_combination_strategy=strategy, max_position_embeddings=64,
        )
        return transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").eval()

    assert [lay.shared_names for lay in find_moe_layouts(model("sum"))] == [("shared_experts",)]
    with pytest.raises(MoELayoutError, match="'model.layers.0.mlp'.*not the weighted sum"):
        find_moe_layouts(model("average"))


def test_probe_check_runs_in_eval_mode_and_restores_training_flags():
    """The probe check compares the block's output with a recomputation: it must run in eval mode (dropout, router
    jitter) and leave every module's training flag as it found it (here: mixed)."""
    block = _SharedBlock(average=False)
    block.shared_experts.insert(1, nn.Dropout(0.5))
    model = _Model(block).train()
    block.experts.eval()
    flags = [module.training for module in model.modules()]
    (lay,) = find_moe_layouts(model)
    assert lay.shared_names == ("shared_experts",)
    assert [module.training for module in model.modules()] == flags


def test_each_block_is_probed_once():
    """The probe runs a block's experts twice; apply() detects the layouts several times (its own pass and the
    predictors' checks), which must not run the probe again: on an offloaded model every run loads the experts."""
    from hf_models import StandInPredictors, tiny_model

    import base_moe

    model = tiny_model("qwen3_moe")
    calls = []
    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            module.register_forward_pre_hook(lambda *args: calls.append(1))
    layers = len(find_moe_layouts(model))
    assert len(calls) == 2 * layers  # the block's own forward and the recomputation it is checked against
    base_moe.apply(model, predictors=StandInPredictors(model), budget=2)
    assert len(calls) == 2 * layers


# ---------------------------------------------------------------------------------------------------------------
# Edge cases found by mutation testing
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_meta_device_model_takes_the_probed_routing(family):
    """A model on the meta device (no probe of its weights can run) gets the routing a CPU stand-in of its router
    with random weights shows: the probed one; and whether its router rounds its logits (asked of a bf16 stand-in):
    DeepSeek-V3's does not."""
    import transformers
    from hf_models import tiny_config

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(family), experts_implementation="eager")
    layouts = find_moe_layouts(model)
    assert [lay.routing for lay in layouts] == [EXPECTED[family]["routing"]] * 2
    assert [lay.router_rounds_logits for lay in layouts] == [family != "deepseek_v3"] * 2
    # from a CPU stand-in of the whole block (it was taken as False: GPT-OSS's decoder layer then unpacked a tensor)
    assert [lay.returns_router_scores for lay in layouts] == [family == "gpt_oss"] * 2


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_rounding_probe_copies_no_router_state(family):
    """Whether a router rounds its logits is asked of a shallow stand-in (no deep copy of the router's state): a
    router holding something that cannot be copied (a lock) is understood (DeepSeek-V3's False is no fallback
    answer)."""
    import threading

    model = tiny_model(family)
    for layout in find_moe_layouts(model):
        layout.router.lock = threading.Lock()
    assert [lay.router_rounds_logits for lay in find_moe_layouts(model)] == [family != "deepseek_v3"] * 2


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_all_zero_router_keeps_the_attributes_rule(norm_topk_prob):
    """An all-zero router (every score ties) cannot tell the rules apart: the attributes' rule is accepted."""
    model = tiny_model("qwen3_moe", norm_topk_prob=norm_topk_prob)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
    assert [lay.routing for lay in find_moe_layouts(model)] == [Routing(2, Scoring.SOFTMAX, norm_topk_prob)] * 2


class _ScaledOutputBlock(_Block):
    """Scales its routed output once more (a scaling factor applied after the experts): 1% off the weighted sum."""

    def forward(self, hidden):
        return super().forward(hidden) * 1.01


def test_block_whose_output_is_slightly_off_is_refused():
    with pytest.raises(MoELayoutError, match="not the weighted sum of its routed experts"):
        find_moe_layouts(_Model(_ScaledOutputBlock()))


def test_expert_output_gram_is_independent_of_its_chunks():
    """The Gram matrix of the experts' outputs, computed over token chunks of any size, is the one of all outputs
    at once; the cosine similarity made from it is 1 on the diagonal and 0 for an expert that never outputs."""
    from base_moe.layouts import cosine_similarity_from_gram, expert_output_gram

    class Linear:
        num_experts, hidden_size = 3, 8

        def __init__(self):
            self.w = small_integers(3, 8, 8, seed=0)
            self.w[2] = 0

        def expert_output(self, x, u):
            return x @ self.w[u].T

    # Small integers: every fp32 product and sum is exact (|sums| < 2^24), so any chunking gives the same bits, and
    # the comparison can be exact, whatever order the matrix products add in on this CPU.
    def small_integers(*shape, seed):
        return torch.randint(-3, 4, shape, generator=torch.Generator().manual_seed(seed)).float()

    layout, x = Linear(), small_integers(2, 5, 8, seed=1)
    outputs = torch.stack([layout.expert_output(x.reshape(-1, 8), u).reshape(-1) for u in range(3)]).double()
    for chunk_bytes in (1, 3 * 8 * 4 * 4, 1 << 28):  # one token, four tokens, all
        gram = expert_output_gram(layout, x, chunk_bytes)
        assert torch.equal(gram, outputs @ outputs.T)
    similarity = cosine_similarity_from_gram(outputs @ outputs.T)
    assert torch.equal(similarity.diagonal(), torch.ones(3)) and torch.all(similarity[2, :2] == 0)
    expected = torch.nn.functional.cosine_similarity(outputs[0], outputs[1], dim=0)
    torch.testing.assert_close(similarity[0, 1].double(), expected, rtol=1e-6, atol=1e-6)


def _experts_of(gate_up_shape, down_shape):
    experts = _FusedExperts()
    experts.gate_up_proj = nn.Parameter(torch.randn(gate_up_shape))
    experts.down_proj = nn.Parameter(torch.randn(down_shape))
    return experts


@pytest.mark.parametrize("three_d", ["gate_up_proj", "down_proj"])
def test_fused_experts_need_both_weights_three_d(three_d):
    """A child holding one 3-D weight named like the experts' and one 2-D one is not an experts module (a hybrid
    model's convolution, say); an 'experts' child like that is refused, not taken for the fused layout."""
    shapes = {"gate_up_proj": (4, 12, 8), "down_proj": (4, 8, 6)}
    shapes = {name: shape if name == three_d else shape[1:] for name, shape in shapes.items()}
    block = nn.Module()
    block.mixer = _experts_of(shapes["gate_up_proj"], shapes["down_proj"])
    assert find_moe_layouts(_Model(block)) == []
    block = _Block()
    block.experts = _experts_of(shapes["gate_up_proj"], shapes["down_proj"])
    with pytest.raises(MoELayoutError, match="'layers.1.mlp'.*has no fused 3-D 'gate_up_proj'/'down_proj' weights"):
        find_moe_layouts(_Model(block))


class _SharedGateFirstBlock(_Block):
    """Qwen2-MoE's block (routed experts plus a sigmoid-gated shared expert) with the shared expert's gate, a
    ``Linear(H, 1)``, registered before the router: the router is the child whose weight is ``[E, H]``."""

    def __init__(self):
        nn.Module.__init__(self)
        self.shared_expert_gate = nn.Linear(8, 1, bias=False)
        self.shared_expert = nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 8))
        self.gate = _Router()
        self.experts = _FusedExperts()

    def forward(self, hidden):
        x = hidden.reshape(-1, 8)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return (super().forward(hidden).reshape(-1, 8) + shared).view(hidden.shape)


def test_router_is_found_by_its_shape_beside_a_shared_expert_gate():
    (lay,) = find_moe_layouts(_Model(_SharedGateFirstBlock()))
    assert lay.router_name == "gate" and lay.shared_gate_name == "shared_expert_gate"
    assert lay.shared_names == ("shared_expert",) and lay.num_experts == 4


def test_odd_gate_up_rows_are_refused():
    """gate_up_proj stacks the gate and up rows, 2I of them: an odd count has no gate/up split."""
    block = _Block()
    block.experts = _experts_of((4, 13, 8), (4, 8, 6))  # 13 // 2 = 6: down_proj's shape alone would pass
    with pytest.raises(MoELayoutError, match=r"'layers.1.mlp'.*gate_up_proj \(4, 13, 8\) / down_proj \(4, 8, 6\)"):
        find_moe_layouts(_Model(block))


def test_non_silu_experts_run_through_the_models_own_module():
    """base_moe.ops.experts computes SiLU: a Qwen3-MoE model with GELU experts is not ``fused``, and under a budget
    that keeps every expert the patched model gives the model's own output (through its experts module)."""
    import base_moe
    from hf_models import VOCAB

    model = tiny_model("qwen3_moe", hidden_act="gelu")
    assert [lay.fused for lay in find_moe_layouts(model)] == [False, False]
    step = torch.randint(3, VOCAB, (6, 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        dense = model(step).logits
        base_moe.apply(model, budget=NUM_EXPERTS, policy="router_sum")
        budgeted = model(step).logits
    torch.testing.assert_close(budgeted, dense, rtol=1e-5, atol=1e-5)


class _GatherExperts(_FusedExperts):
    """Gathers each slot's weights by its id (as HF's batched_mm did before it knew the sentinel): id E is out of
    range."""

    def forward(self, hidden, top_k_index, top_k_weights):
        gate_up = torch.einsum("th,tkih->tki", hidden, self.gate_up_proj[top_k_index])
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch.einsum("tki,tkhi->tkh", self.act_fn(gate) * up, self.down_proj[top_k_index])
        return (y * top_k_weights[..., None]).sum(1)


@torch.no_grad()
def test_rows_whose_slots_are_all_sentinels_are_zero():
    """routed_experts points a sentinel slot (id E) at a valid expert with weight 0, whatever weight it came with:
    a token whose every slot was dropped gets 0, also where its fallback expert is the sentinel too."""
    block = _Block()
    block.experts = _GatherExperts()
    (lay,) = find_moe_layouts(_Model(block))
    E = lay.num_experts
    x = torch.randn(3, 8)
    ids = torch.tensor([[E, E], [1, E], [E, E]])
    weights = torch.ones(3, 2)
    for fallback in (None, torch.tensor([E, 2, 3])):
        y = lay.routed_experts(x, ids, weights, fallback)
        assert torch.equal(y[0], torch.zeros(8)) and torch.equal(y[2], torch.zeros(8))
        torch.testing.assert_close(y[1], lay.expert_output(x[1:2], 1)[0])


class _PairRouter(_Router):
    """Returns ``(top_k_weights, top_k_index)``: neither the transformers 5.x triple nor logits."""

    def forward(self, x):
        _, weights, ids = super().forward(x)
        return weights, ids


class _PairRouterBlock(_Block):
    def __init__(self):
        super().__init__()
        self.gate = _PairRouter()

    def forward(self, hidden):
        weights, ids = self.gate(hidden.reshape(-1, 8))
        return self.experts(hidden.reshape(-1, 8), ids, weights).view(hidden.shape)


def test_router_returning_weights_and_ids_is_refused():
    with pytest.raises(MoELayoutError, match="'layers.1.mlp'.*router 'gate' returns neither"):
        find_moe_layouts(_Model(_PairRouterBlock()))


class _WeightsFirstRoutingBlock(_RoutingBlock):
    """Its ``route_tokens_to_experts`` returns ``(weights, ids)``, the other order: told apart by dtype."""

    def route_tokens_to_experts(self, router_logits):
        ids, weights = super().route_tokens_to_experts(router_logits)
        return weights, ids

    def forward(self, hidden):
        x = hidden.reshape(-1, 8)
        weights, ids = self.route_tokens_to_experts(self.gate(x))
        return self.experts(x, ids, weights).view(hidden.shape)


def test_block_routing_its_logits_to_weights_then_ids():
    (lay,) = find_moe_layouts(_Model(_WeightsFirstRoutingBlock()))
    assert lay.routing == Routing(2, Scoring.SIGMOID, True, scaling=1.5)


class _TemperatureRouter(_Router):
    def forward(self, x, temperature):
        return super().forward(x * temperature)


class _BiasAndTemperatureRouter(_Router):
    def forward(self, x, e_score_correction_bias, temperature):
        return super().forward(x * temperature)


class _KeywordTemperatureRouter(_Router):
    def forward(self, x, *, temperature):
        return super().forward(x * temperature)


class _OptionalArgumentsRouter(_Router):
    def forward(self, x, temperature=1.0, *args, **kwargs):
        return super().forward(x * temperature)


class _ArgumentRouterBlock(_Block):
    def __init__(self, router, correction_bias=True):
        super().__init__()
        self.gate = router
        if correction_bias:
            self.register_buffer("e_score_correction_bias", torch.zeros(4))


@pytest.mark.parametrize(
    "router, correction_bias, arguments",
    [
        (_TemperatureRouter(), True, "temperature"),  # the block's correction bias is no temperature
        (_BiasAndTemperatureRouter(), True, "e_score_correction_bias, temperature"),
        (_BiasArgumentRouter(), False, "e_score_correction_bias"),  # a bias argument, but no bias to give it
        (_KeywordTemperatureRouter(), True, "temperature"),  # keyword-only arguments are required too
    ],
)
def test_router_with_unknown_arguments_is_refused(router, correction_bias, arguments):
    """A router's forward is called with the hidden states and, where it takes one argument more named like a bias,
    the correction bias; any other required argument is refused, naming it."""
    block = _ArgumentRouterBlock(router, correction_bias)
    with pytest.raises(MoELayoutError, match=rf"'layers.1.mlp'.*router 'gate' takes arguments base_moe does not know "
                                             rf"\({arguments}\)"):
        find_moe_layouts(_Model(block))


def test_router_with_optional_arguments_is_called_with_the_hidden_states():
    """Arguments with defaults, ``*args`` and ``**kwargs`` are not required: the router runs on the states alone."""
    (lay,) = find_moe_layouts(_Model(_ArgumentRouterBlock(_OptionalArgumentsRouter(), correction_bias=False)))
    assert lay.routing == Routing(2, Scoring.SOFTMAX, False)
    x = torch.randn(3, 8)
    torch.testing.assert_close(lay.router_logits(x), nn.functional.linear(x, lay.router.weight))


class _OptionalBiasRouter(_BiasArgumentRouter):
    """LFM2's router: the selection bias is an optional argument (``expert_bias=None``) that its block passes."""

    def forward(self, x, expert_bias=None):
        return super().forward(x, 0.0 if expert_bias is None else expert_bias)


class _OptionalBiasBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = _OptionalBiasRouter()
        self.experts = _FusedExperts()
        self.register_buffer("expert_bias", torch.randn(4) * 0.1)

    def forward(self, hidden):
        x = hidden.reshape(-1, 8)
        _, weights, ids = self.gate(x, self.expert_bias)
        return self.experts(x, ids, weights).view(hidden.shape)


def test_router_given_its_optional_selection_bias():
    """LFM2's shape: the block's ``expert_bias`` goes to the router's optional bias argument, and the ops apply it."""
    (lay,) = find_moe_layouts(_Model(_OptionalBiasBlock()))
    assert lay.routing == Routing(2, Scoring.SIGMOID, True)
    assert torch.equal(lay.correction_bias(), lay.block.expert_bias)
    x = torch.randn(64, 8)
    logits, weights, ids = lay.router_choices(x)
    ref_ids, ref_weights = reference.route(logits.float(), lay.routing, lay.correction_bias())
    order, ref_order = ids.argsort(dim=1), ref_ids.long().argsort(dim=1)
    assert torch.equal(ids.gather(1, order), ref_ids.long().gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order))


class _Statics(nn.Module):
    def __init__(self):
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(torch.zeros(1, 4), requires_grad=False)


class _StaticsRouter(_Router):
    """ERNIE-4.5's shape: softmax scores plus a selection bias held one module down, for the top-k only."""

    def __init__(self):
        super().__init__()
        self.moe_statics = _Statics()

    def forward(self, x):
        logits = nn.functional.linear(x, self.weight)
        scores = torch.softmax(logits, -1)
        ids = torch.topk(scores + self.moe_statics.e_score_correction_bias, 2, dim=-1).indices
        return logits, scores.gather(1, ids), ids


class _UnusedBiasBlock(_Block):
    """A softmax block holding two selection biases (zero, so the routing probe cannot tell), its router's, which
    base_moe reads, and its own."""

    def __init__(self):
        super().__init__()
        self.gate.register_buffer("e_score_correction_bias", torch.zeros(4))
        self.register_buffer("expert_bias", torch.zeros(4))


@pytest.mark.parametrize("block, name", [(_ArgumentRouterBlock(_StaticsRouter(), correction_bias=True),
                                          "gate.moe_statics.e_score_correction_bias"),
                                         (_UnusedBiasBlock(), "expert_bias")])
def test_selection_bias_base_moe_would_not_apply_is_refused(block, name):
    """A second selection bias beside the one base_moe reads (the router's own, then the block's) is refused even while
    zero: a small one passes the routing probe and would then be ignored."""
    with pytest.raises(MoELayoutError, match=rf"'layers.1.mlp'.*selection bias '{re.escape(name)}'"):
        find_moe_layouts(_Model(block))


def test_selection_bias_added_to_softmax_probabilities():
    """ERNIE-4.5's shape: the bias one module down (``[1, E]``) is read, and the ops' rule (softmax probabilities plus
    the bias, top-k, weights the probabilities) reproduces the router's choices."""
    router = _StaticsRouter()
    with torch.no_grad():
        router.moe_statics.e_score_correction_bias.copy_(torch.randn(1, 4) * 0.2)
    (lay,) = find_moe_layouts(_Model(_ArgumentRouterBlock(router, correction_bias=False)))
    assert lay.routing == Routing(2, Scoring.SOFTMAX, False)
    assert torch.equal(lay.correction_bias(), router.moe_statics.e_score_correction_bias.reshape(-1))
    logits, weights, ids = lay.router_choices(torch.randn(256, 8))
    ref_ids, ref_weights = reference.route(logits.float(), lay.routing, lay.correction_bias())
    assert not torch.equal(ref_ids, reference.route(logits.float(), lay.routing)[0])  # the bias changes choices
    order, ref_order = ids.argsort(dim=1), ref_ids.long().argsort(dim=1)
    assert torch.equal(ids.gather(1, order), ref_ids.long().gather(1, ref_order))
    torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order))


class _NestedRouter(nn.Module):
    """HunYuan-V1-MoE's shape: the router's weight is held by a Linear one module down."""

    def __init__(self):
        super().__init__()
        self.wg = nn.Linear(8, 4, bias=False)
        self.top_k = 2

    def forward(self, x):
        logits = self.wg(x)
        weights, ids = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
        return logits, weights / weights.sum(-1, keepdim=True), ids


def test_router_weight_one_module_down():
    (lay,) = find_moe_layouts(_Model(_ArgumentRouterBlock(_NestedRouter(), correction_bias=False)))
    assert (lay.router_name, lay.router_linear_name) == ("gate", "wg")
    assert lay.router_weight is lay.router.wg.weight and lay.router_bias is None
    assert lay.routing == Routing(2, Scoring.SOFTMAX, True) and lay.router_rounds_logits


class _Fp32NestedRouter(_NestedRouter):
    """The nested router computing fp32 logits whatever its weight's dtype (after calling its Linear once, so that
    the Linear's hooks run)."""

    def forward(self, x):
        self.wg(x)
        logits = nn.functional.linear(x.float(), self.wg.weight.float())
        weights, ids = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
        return logits, weights / weights.sum(-1, keepdim=True), ids


def _fail_on_bf16(module, args):
    if args[0].dtype == torch.bfloat16:  # (the fp32 model's own calls pass; the bf16 stand-in's would not)
        raise RuntimeError("a hook that cannot take the stand-in's tensors (an offload hook moving them)")


def test_rounding_probe_runs_no_hook_of_a_nested_router():
    """The bf16 stand-in drops the submodules' hooks too: a hook failing on it made the probe answer True (round)
    for a router that computes fp32 logits."""
    router = _Fp32NestedRouter()
    router.wg.register_forward_pre_hook(_fail_on_bf16)
    (lay,) = find_moe_layouts(_Model(_ArgumentRouterBlock(router, correction_bias=False)))
    assert lay.router_linear_name == "wg" and not lay.router_rounds_logits


class _SequenceRouter(_Router):
    """AFMoE's shape: the router's forward unpacks hidden states [B, S, H]."""

    def forward(self, x):
        _, _, hidden = x.shape
        return super().forward(x.view(-1, hidden))


class _SequenceRouterBlock(_Block):
    def __init__(self):
        super().__init__()
        self.gate = _SequenceRouter()

    def forward(self, hidden):
        _, weights, ids = self.gate(hidden.reshape(1, -1, 8))
        return self.experts(hidden.reshape(-1, 8), ids, weights).view(hidden.shape)


def test_router_that_takes_sequences():
    (lay,) = find_moe_layouts(_Model(_SequenceRouterBlock()))
    assert lay.router_takes_sequences and lay.routing == Routing(2, Scoring.SOFTMAX, False)
    x = torch.randn(5, 8)
    torch.testing.assert_close(lay.router_logits(x), nn.functional.linear(x, lay.router.weight))
    assert not find_moe_layouts(_Model(_Block()))[0].router_takes_sequences


class _IndexBufferRouter(_Router):
    """A router computing fp32 logits and holding an integer buffer (a permutation of its experts)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("order", torch.arange(4))

    def forward(self, x):
        logits = nn.functional.linear(x.float(), self.weight.float())[:, self.order]
        values, ids = torch.topk(logits, 2, dim=-1)
        return logits, torch.softmax(logits, -1).gather(1, ids), ids


def test_rounding_probe_on_the_meta_device_with_an_integer_buffer():
    """The stand-in of a model on the meta device gets zeros for an integer buffer (a CPU copy of a meta tensor
    failed, and the probe fell back to "rounds" for this fp32 router)."""
    with torch.device("meta"):
        block = _ArgumentRouterBlock(_IndexBufferRouter(), correction_bias=False)
    (lay,) = find_moe_layouts(_Model(block))
    assert not lay.router_rounds_logits and not lay.router_returns_model_dtype


class _ListRouter(_Router):
    def forward(self, x):
        return list(super().forward(x))


def test_router_returning_a_list_is_refused_saying_so():
    """A router output that is no tensor or tuple reaches the routing probe's message (the stand-in read of its
    logits' dtype raised an AttributeError before, which became an unclear "probe failed")."""
    with pytest.raises(MoELayoutError, match="returns neither"):
        find_moe_layouts(_Model(_ArgumentRouterBlock(_ListRouter(), correction_bias=False)))


class _FailingRouter(_Router):
    def forward(self, x):
        raise RuntimeError("needs a sequence dimension")


def test_router_that_fails_on_the_probe_is_refused_naming_the_block():
    with pytest.raises(MoELayoutError, match=r"'layers.1.mlp'.*router 'gate' or the block on a probe failed "
                                             r"\(RuntimeError: needs a sequence dimension\)"):
        find_moe_layouts(_Model(_ArgumentRouterBlock(_FailingRouter(), correction_bias=False)))


class _SigmoidRouter(_Router):
    """Top-k of the logits weighted by their sigmoids (Cohere2-MoE's ``expert_selection_fn="sigmoid"``): no attribute
    says so."""

    def forward(self, x):
        logits = nn.functional.linear(x, self.weight)
        values, ids = torch.topk(logits, 2, dim=-1)
        return logits, values.sigmoid(), ids


@pytest.mark.parametrize("make_block", [
    lambda: _ArgumentRouterBlock(_SigmoidRouter(), correction_bias=False),
    _RoutingBlock,  # the block routes the logits, with its own bias and scaling
    _BiasArgumentBlock,  # the router takes the block's bias
], ids=["sigmoid", "block_routes", "bias_argument"])
def test_meta_device_block_takes_the_probed_routing(make_block):
    """On the meta device a CPU stand-in of the router (and of the block, its own bias included) with random weights
    is probed: the routing is the one a real block gives."""
    (probed,) = find_moe_layouts(_Model(make_block()))
    with torch.device("meta"):
        model = _Model(make_block())
    (lay,) = find_moe_layouts(model)
    assert lay.routing == probed.routing


def test_meta_device_routing_is_not_the_attributes_guess_where_they_do_not_tell():
    """The sigmoid router's attributes (a top_k) describe softmax with renormalisation; the stand-in tells sigmoid."""
    with torch.device("meta"):
        model = _Model(_ArgumentRouterBlock(_SigmoidRouter(), correction_bias=False))
    (lay,) = find_moe_layouts(model)
    assert _candidate_routings(lay)[0] == Routing(2, Scoring.SOFTMAX, True)
    assert lay.routing == Routing(2, Scoring.SIGMOID, False)


def test_meta_device_router_the_stand_in_cannot_run_takes_the_attributes_guess():
    """Where the stand-in fails (here the router's forward raises), a model on the meta device keeps the routing
    its attributes describe, as before there was a stand-in."""
    with torch.device("meta"):
        model = _Model(_ArgumentRouterBlock(_FailingRouter(), correction_bias=False))
    with pytest.warns(UserWarning, match=r"'layers.1.mlp'.*could not run \(RuntimeError: needs a sequence dimension\); "
                                         r"its routing is taken from its attributes, unverified"):
        (lay,) = find_moe_layouts(model)
    assert lay.routing == _candidate_routings(lay)[0] == Routing(2, Scoring.SOFTMAX, True)


def test_meta_device_router_matching_no_rule_is_refused():
    """A stand-in that runs and matches no rule refuses the block, as the real router does (it was taken as the
    attributes' softmax)."""
    with torch.device("meta"):
        model = _Model(_Block(mode="other"))
    with pytest.raises(MoELayoutError, match=r"'layers.1.mlp' \(_Block\): on the meta device, the top-k weights of a "
                                             r"CPU copy of its router with random weights match none of base_moe's"):
        find_moe_layouts(model)


@pytest.mark.parametrize("make_block, refusal", [
    (lambda: _ArgumentRouterBlock(_TemperatureRouter()), r"takes arguments base_moe does not know \(temperature\)"),
    (_PairRouterBlock, "returns neither"),
], ids=["unknown_argument", "weights_and_ids"])
def test_meta_device_router_interface_base_moe_does_not_call_is_refused(make_block, refusal):
    """A router whose arguments or outputs base_moe does not know is refused on the meta device as on a real one (its
    stand-in's refusal was taken for a stand-in that cannot run: a warning and the attributes' guess)."""
    with torch.device("meta"):
        model = _Model(make_block())
    with pytest.raises(MoELayoutError, match=rf"'layers.1.mlp' \(_\w+\).*router 'gate' {refusal}"):
        find_moe_layouts(model)


def test_meta_device_block_combining_its_experts_otherwise_is_refused():
    """A block on the meta device is run as a CPU stand-in, so averaging its routed and shared experts is refused
    there too (it was accepted and computed as their sum); the summing block is understood."""
    with torch.device("meta"):
        averaging, summing = _Model(_SharedBlock(average=True)), _Model(_SharedBlock(average=False))
    refusal = (r"'layers.1.mlp' \(_SharedBlock\) \(on the meta device, checked on a CPU copy .*not the weighted sum "
               "of its routed experts plus its shared experts")
    with pytest.raises(MoELayoutError, match=refusal):
        find_moe_layouts(averaging)
    (lay,) = find_moe_layouts(summing)
    assert lay.shared_names == ("shared_experts",) and not lay.returns_router_scores


class _CountingBlock(_SharedBlock):
    runs = 0

    def forward(self, hidden):
        type(self).runs += 1
        return super().forward(hidden)


def test_meta_device_blocks_alike_are_run_once_and_blocks_that_differ_each():
    """The stand-in check runs once per block structure in a model (classes, attributes, shapes): a second block
    with another attribute value (here averaging, refused) is checked on its own."""
    with torch.device("meta"):
        alike = _Model(_CountingBlock(average=False), first=_CountingBlock(average=False))
        differing = _Model(_SharedBlock(average=True), first=_SharedBlock(average=False))
    for layer in alike.layers:  # an instance-level forward, as accelerate's offload hook sets, keeps them alike
        layer.mlp.forward = functools.partial(type(layer.mlp).forward, layer.mlp)
    _CountingBlock.runs = 0
    assert len(find_moe_layouts(alike)) == 2 and _CountingBlock.runs == 1
    with pytest.raises(MoELayoutError, match="'layers.1.mlp'.*not the weighted sum"):
        find_moe_layouts(differing)


def _other_intermediate_size(block):
    block.experts = _FusedExperts(I=10)


def _another_object(block):
    block.settings = types.SimpleNamespace()  # an object, keyed by identity


@pytest.mark.parametrize("differ", [_other_intermediate_size, _another_object])
def test_meta_device_blocks_that_differ_in_a_shape_or_an_object_are_each_run(differ):
    """Two blocks of one class whose experts' shapes differ, or which hold distinct objects, may run other code: each
    gets its own stand-in run."""
    with torch.device("meta"):
        first, second = _CountingBlock(average=False), _CountingBlock(average=False)
        differ(first)
        if differ is _another_object:
            differ(second)
        model = _Model(second, first=first)
    _CountingBlock.runs = 0
    assert len(find_moe_layouts(model)) == 2 and _CountingBlock.runs == 2


def test_meta_device_answer_is_not_kept_for_the_loaded_block():
    """A block checked on the meta device is checked again once its weights are loaded (the real check, not the
    stand-in's answer)."""
    with torch.device("meta"):
        model = _Model(_SharedBlock(average=False))
    find_moe_layouts(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    model.layers[1].mlp.average = True
    with pytest.raises(MoELayoutError, match="not the weighted sum"):
        find_moe_layouts(model)


class _DispatchingExperts(_FusedExperts):
    """Dispatches on its config's ``_experts_implementation`` as transformers' experts classes do; ``batched_mm``
    (a copy of an expert's matrices per token slot: gigabytes for a large model's stand-in) stands refused here."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(_experts_implementation="batched_mm")

    def forward(self, hidden, top_k_index, top_k_weights):
        if self.config._experts_implementation != "eager":
            raise RuntimeError("a copy per token slot")
        return super().forward(hidden, top_k_index, top_k_weights)


def test_meta_device_stand_in_runs_its_experts_eagerly_and_leaves_the_models_config():
    with torch.device("meta"):
        block = _SharedBlock(average=False)
        block.experts = _DispatchingExperts()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "could not run"
        (lay,) = find_moe_layouts(_Model(block))
    assert lay.routing == Routing(2, Scoring.SOFTMAX, False)
    assert block.experts.config._experts_implementation == "batched_mm"


class _NanBlock(_Block):
    def forward(self, hidden):
        return super().forward(hidden) * float("nan")


def test_block_whose_output_is_nan_is_refused():
    with pytest.raises(MoELayoutError, match="'layers.1.mlp'.*not the weighted sum"):
        find_moe_layouts(_Model(_NanBlock()))


class _CountingRouter(_Router):
    """Records the token counts its calls route (a router's own statistics) in a list, a dict or a set."""

    def __init__(self, container: type):
        super().__init__()
        self.tokens_seen = container()

    def forward(self, x):
        seen = self.tokens_seen
        if isinstance(seen, list):
            seen.append(x.shape[0])
        elif isinstance(seen, set):
            seen.add(x.shape[0])
        else:
            seen[len(seen)] = x.shape[0]
        return super().forward(x)


@pytest.mark.parametrize("container", [list, dict, set])
def test_meta_device_stand_ins_record_into_their_own_containers(container):
    """The stand-ins' probes are not recorded into the model's router (its container was shared with theirs)."""
    with torch.device("meta"):
        model = _Model(_ArgumentRouterBlock(_CountingRouter(container), correction_bias=False))
    (lay,) = find_moe_layouts(model)
    assert lay.routing == Routing(2, Scoring.SOFTMAX, False)
    assert model.layers[1].mlp.gate.tokens_seen == container()


class _CpuFailingBlock(_SharedBlock):
    """Its forward fails off its own device (an experts implementation without a CPU path); its router runs."""

    def forward(self, hidden):
        if hidden.device.type == "cpu":
            raise RuntimeError("no CPU kernel")
        return super().forward(hidden)


def test_meta_device_block_the_stand_in_cannot_run_is_taken_unverified_with_a_warning():
    with torch.device("meta"):
        model = _Model(_CpuFailingBlock(average=False))
    with pytest.warns(UserWarning, match=r"'layers.1.mlp'.*a CPU copy of the block with random weights could not run "
                                         r"\(RuntimeError: no CPU kernel\); base_moe takes it to return its output as "
                                         "one tensor"):
        (lay,) = find_moe_layouts(model)
    assert lay.routing == Routing(2, Scoring.SOFTMAX, False) and not lay.returns_router_scores


def test_large_stand_in_expert_banks_are_views_of_one_matrix():
    """A block stand-in's expert banks hold distinct matrices, each contiguous, in the memory of about one (matrix
    ``e`` starts ``e`` elements into it); smaller tensors and matrices are fully random."""
    generator = torch.Generator().manual_seed(0)
    bank = torch.empty(4, 6, 5, device="meta")
    view = _random_like(bank, generator, torch.float32, view_above=100)
    assert view.shape == bank.shape and view.untyped_storage().nbytes() == (30 + 3) * 4
    assert all(view[e].is_contiguous() for e in range(4))
    assert torch.equal(view[1].flatten()[:-1], view[0].flatten()[1:]) and not torch.equal(view[1], view[0])
    for small in (bank, torch.empty(40, 5, device="meta")):  # at the bound; a 2-D matrix
        full = _random_like(small, generator, torch.float32, view_above=120 if small.dim() == 3 else 100)
        assert full.is_contiguous() and full.unique().numel() == small.numel()


class _UnnormalisedRoutingBlock(_RoutingBlock):
    """Says ``norm_topk_prob=True`` and does not renormalise; ranks by the block's own bias."""

    def route_tokens_to_experts(self, router_logits):
        scores = router_logits.sigmoid()
        ids = torch.topk(scores + self.e_score_correction_bias, 2, dim=-1).indices
        return ids, scores.gather(1, ids) * self.routed_scaling_factor


def test_meta_device_stand_in_routes_with_the_blocks_own_bias():
    """The block's stand-in routes the stand-in router's logits with its own random bias, which the match is given:
    the rule its attributes contradict (no renormalisation) is found (a meta bias, or none, fails the probe)."""
    (probed,) = find_moe_layouts(_Model(_UnnormalisedRoutingBlock()))
    with torch.device("meta"):
        model = _Model(_UnnormalisedRoutingBlock())
    (lay,) = find_moe_layouts(model)
    assert lay.routing == probed.routing == Routing(2, Scoring.SIGMOID, False, scaling=1.5)
    assert _candidate_routings(lay)[0] == Routing(2, Scoring.SIGMOID, True, scaling=1.5)


def test_meta_device_detection_inside_a_meta_device_context():
    """Detection run under ``with torch.device("meta")`` builds its stand-ins on the CPU all the same (their random
    tensors and probes became meta tensors, and the probe failed)."""
    with torch.device("meta"):
        model = _Model(_ArgumentRouterBlock(_SigmoidRouter(), correction_bias=False))
        (lay,) = find_moe_layouts(model)
    assert lay.routing == Routing(2, Scoring.SIGMOID, False)


class _ScaleSharedExpert(nn.Module):
    """``x * weight``: a shared expert whose one weight is ``[1, H]``, the shape of Qwen2-MoE's shared-expert gate."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, 8))

    def forward(self, x):
        return x * self.weight


class _LinearLikeGate(nn.Module):
    """``x @ weight.T`` with ``weight [1, H]``: what a ``Linear(H, 1)`` computes, in a module that is not one."""

    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, x):
        return nn.functional.linear(x, self.weight)


def test_non_linear_shared_child_with_a_gate_shaped_weight_is_a_shared_expert():
    """Only a ``Linear(H, 1)`` is taken for the shared experts' gate (base_moe applies a sigmoid to what it returns):
    another module with a ``[1, H]`` weight is a shared expert, added as the block adds it, and where the block uses
    it as a gate the probe refuses the block rather than adding the gate's output."""
    block = _SharedBlock(average=False)
    block.shared_experts = _ScaleSharedExpert()
    (lay,) = find_moe_layouts(_Model(block))
    assert lay.shared_names == ("shared_experts",) and lay.shared_gate_name is None
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(lay.shared_output(x), block.shared_experts(x))
    gated = _SharedGateFirstBlock()
    gated.shared_expert_gate = _LinearLikeGate(gated.shared_expert_gate.weight)
    with pytest.raises(MoELayoutError, match="'layers.1.mlp'.*not the weighted sum of its routed experts plus its"):
        find_moe_layouts(_Model(gated))


class _UnappliedScalingBlock(_Block):
    """Carries a ``routed_scaling_factor`` that its softmax routing does not apply."""

    def __init__(self):
        super().__init__()
        self.routed_scaling_factor = 2.5


class _UnappliedScalingSigmoidBlock(_RoutingBlock):
    """DeepSeek-V3's sigmoid routing with a ``routed_scaling_factor`` that it does not apply."""

    def __init__(self, factor):
        super().__init__()
        self.routed_scaling_factor = factor

    def route_tokens_to_experts(self, router_logits):
        ids, weights = super().route_tokens_to_experts(router_logits)
        return ids, weights / self.routed_scaling_factor


@pytest.mark.parametrize("block", [_UnappliedScalingBlock(), _UnappliedScalingSigmoidBlock(2.5),
                                   _UnappliedScalingSigmoidBlock(1.015)], ids=["softmax", "sigmoid", "sigmoid-near-1"])
def test_routed_scaling_factor_the_block_does_not_apply_is_not_applied(block):
    """The probe, not the attribute, decides the factor: a block carrying a factor it does not apply routes with
    scaling 1, so a budget keeping every expert gives its own output. A factor within 2% of 1 passes the probe's
    element tolerance (bf16 rounding) and was taken: 1.5% too large an output, silently."""
    import base_moe

    model = _Model(block).eval()
    (lay,) = find_moe_layouts(model)
    assert lay.routing.scaling == 1.0
    x = torch.randn(6, 1, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        own = block(x)
        base_moe.apply(model, budget=lay.num_experts, policy="router_sum")
        torch.testing.assert_close(block(x), own, rtol=1e-5, atol=1e-5)


class _TemperatureLogitsRouter(_LogitsRouter):
    def forward(self, x):
        return super().forward(x) / 0.5


class _UnusedBiasLogitsRouter(_LogitsRouter):
    def forward(self, x):
        return nn.functional.linear(x, self.weight)


@pytest.mark.parametrize("router", [_TemperatureLogitsRouter(8, 4, bias=False), _UnusedBiasLogitsRouter(8, 4)])
def test_router_computing_other_logits_is_refused(router):
    """The budgeted path computes the logits from the router's weight and bias: a router whose forward computes others
    (a temperature, a bias it does not add) is refused, though its routing rule on its own logits is a known one."""
    block = _RoutingBlock()
    block.gate = router
    with pytest.raises(MoELayoutError, match=r"'layers.1.mlp'.*router 'gate' computes logits other than "
                                             r"hidden @ weight.T \+ bias"):
        find_moe_layouts(_Model(block))
