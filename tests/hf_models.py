"""Tiny random Hugging Face MoE models of every family base_moe supports, built from configs (no downloads).

``tiny_model(family)`` returns a fresh fp32 model in eval mode with ``experts_implementation="eager"`` (the
bit-exact HF reference). Sizes are chosen for speed: hidden 32, 8 experts, top-2, two decoder layers.
``tiny_model(family, **KERNEL_SIZES)`` has hidden and expert intermediate sizes of 64, the smallest the CUDA expert
kernel takes (smaller blocks run the model's own experts on the GPU).
"""

from __future__ import annotations

import torch
import transformers

VOCAB = 64
FAMILIES = ["qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "deepseek_v3", "gpt_oss"]
NUM_EXPERTS = 8

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


# hidden and expert intermediate sizes the CUDA expert kernel takes (multiples of 64); a family's config has either
# moe_intermediate_size (its experts') or only intermediate_size
KERNEL_SIZES = dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=64)


def tiny_config(family: str, **overrides):
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **_COMMON, head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=NUM_EXPERTS,
            num_experts_per_tok=2, norm_topk_prob=True,
        )
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            **_COMMON, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_experts=NUM_EXPERTS, num_experts_per_tok=2, norm_topk_prob=False,
        )
    elif family == "olmoe":
        cfg = transformers.OlmoeConfig(
            **_COMMON, intermediate_size=16, num_experts=NUM_EXPERTS, num_experts_per_tok=2
        )
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(
            **_COMMON, intermediate_size=16, num_local_experts=NUM_EXPERTS, num_experts_per_tok=2
        )
    elif family == "deepseek_v3":
        cfg = transformers.DeepseekV3Config(
            **{**_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 4},
            intermediate_size=48, moe_intermediate_size=16, n_routed_experts=NUM_EXPERTS, num_experts_per_tok=2,
            n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, routed_scaling_factor=2.5, norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    elif family == "gpt_oss":
        cfg = transformers.GptOssConfig(
            **_COMMON, head_dim=8, intermediate_size=16, num_local_experts=NUM_EXPERTS, num_experts_per_tok=2,
            sliding_window=8,
        )
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def tiny_model(family: str, seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        tiny_config(family, **overrides), experts_implementation="eager", dtype=torch.float32
    )
    with torch.no_grad():
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):  # DeepSeek-V3 initialises it to zero: make it matter
                bias.normal_(0.0, 0.2)
            router_bias = getattr(module, "bias", None)
            if type(module).__name__.endswith("TopKRouter") and isinstance(router_bias, torch.Tensor):
                router_bias.normal_(0.0, 0.5)  # GPT-OSS router bias
    return model.eval()


def random_similarity(E: int, generator: torch.Generator, ties: bool = False) -> torch.Tensor:
    """A symmetric ``[E, E]`` expert similarity with 1 on the diagonal, for the substitute fill; ``ties``: few distinct
    values, so that the nearest kept expert is often a tie (which goes to the lower index)."""
    s = torch.rand(E, E, generator=generator)
    s = (s + s.T) / 2
    if ties:
        s = torch.round(s * 3) / 3
    return s.fill_diagonal_(1.0)


class StandInPredictors:
    """The attributes ``base_moe.apply`` reads from a ``base_moe.Predictors`` (without its file format)."""

    def __init__(self, model, seed: int = 0, scale: float = 0.1, with_mean: bool = True, with_similarity: bool = False):
        from base_moe.layouts import find_moe_layouts

        g = torch.Generator().manual_seed(seed)
        self.weight, self.bias, self.mean_log_norm, self.r2, self.similarity = {}, {}, {}, {}, {}
        for layout in find_moe_layouts(model):
            E, H = layout.num_experts, layout.hidden_size
            self.weight[layout.layer_index] = torch.randn(E, H, generator=g) * scale
            self.bias[layout.layer_index] = torch.randn(E, generator=g)
            self.mean_log_norm[layout.layer_index] = torch.randn(E, generator=g)
            self.r2[layout.layer_index] = 0.5
            if with_similarity:
                self.similarity[layout.layer_index] = random_similarity(E, g)
        if not with_mean:
            self.mean_log_norm = {}
        self.metadata = {"model_type": model.config.model_type}


def selection_output(layout, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """What a block must return for the selection ``ids, weights [N, k]`` of ``x [N, H]``, in fp32: each slot's weight
    times its expert's output (sentinel ids add nothing), plus the block's shared experts."""
    y = torch.zeros(x.shape[0], layout.hidden_size, device=x.device)
    for u in range(layout.num_experts):
        token, slot = torch.nonzero(ids == u, as_tuple=True)
        if len(token):
            y[token] += weights[token, slot, None] * layout.expert_output(x[token], u)
    shared = layout.shared_output(x)
    return y if shared is None else y + shared.float()
