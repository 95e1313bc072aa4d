"""Tiny random models of the Hugging Face MoE families beyond tests/hf_models.FAMILIES (session 75's survey of
transformers 5.25): the ones base_moe supports and the ones it must refuse, built from configs (no downloads).

Every model: hidden 64, two decoder layers that are both MoE layers, 8 routed experts, top-2, fp32, eager experts.
Routers get weights of order 1 / sqrt(H) and every selection bias (``e_score_correction_bias``, ``expert_bias``) and
router bias draws N(0, ``bias_scale``): Hugging Face initialises them to zero, which would hide a routing rule read
wrongly.
"""

from __future__ import annotations

import torch
import transformers

E, K, V, H, LAYERS = 8, 2, 64, 64, 2
_COMMON = dict(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, intermediate_size=64, moe_intermediate_size=32, max_position_embeddings=64,
               pad_token_id=0, bos_token_id=1, eos_token_id=2, num_experts_per_tok=K)
_MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, qk_head_dim=16,
            num_key_value_heads=4)
_FULL, _SLIDE = "full_attention", "sliding_attention"
_LINEAR_ATTENTION = dict(layer_types=["linear_attention", _FULL], linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4)
_COHERE2 = dict(num_experts=E, num_shared_experts=1, layer_types=[_SLIDE, _FULL], mlp_layer_types=["sparse"] * LAYERS,
                sliding_window=8)
_DEEPSEEK_V2 = dict(_MLA, n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0, routed_scaling_factor=1.0,
                    topk_method="greedy")
_DOTS1 = dict(n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0, layer_types=[_FULL] * LAYERS,
              max_window_layers=LAYERS, routed_scaling_factor=2.0, norm_topk_prob=True)
_ERNIE = dict(moe_num_experts=E, moe_k=K, moe_num_shared_experts=1, moe_layer_start_index=0,
              moe_layer_end_index=LAYERS - 1, moe_layer_interval=1)
_EXAONE = dict(num_experts=E, num_shared_experts=1, mlp_layer_types=["sparse"] * LAYERS, first_k_dense_replace=0,
               layer_types=[_SLIDE, _FULL], sliding_window=8)
_GLM4 = dict(n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0, routed_scaling_factor=2.0)
_GROUPS = dict(n_group=4, topk_group=2)
_JAMBA = dict(num_experts=E, expert_layer_period=1, expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1,
              use_mamba_kernels=False, mamba_dt_rank=8, mamba_d_state=8)
_LFM2 = dict(num_experts=E, num_dense_layers=0, layer_types=["conv", _FULL], use_expert_bias=True, norm_eps=1e-5)
_LLAMA4 = dict(num_local_experts=E, moe_layers=list(range(LAYERS)), interleave_moe_layer_step=1, intermediate_size=32,
               intermediate_size_mlp=64, layer_types=["chunked_attention", _FULL], no_rope_layers=[1, 0],
               attention_chunk_size=8)
_MINICPM5 = dict(n_routed_experts=E, n_shared_experts=1, routed_scaling_factor=3.66,
                 mlp_layer_types=["sparse"] * LAYERS)
_MINIMAX = dict(num_local_experts=E, intermediate_size=32, layer_types=[_FULL, "linear_attention"], block_size=4)
_QWEN3_NEXT = dict(_LINEAR_ATTENTION, num_experts=E, shared_expert_intermediate_size=32, decoder_sparse_step=1)
_SARVAM = dict(n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0, routed_scaling_factor=2.5)
_AFMOE = dict(num_experts=E, num_shared_experts=1, num_dense_layers=0, layer_types=[_SLIDE, _FULL], sliding_window=8,
              global_attn_every_n_layers=2)

SUPPORTED = {
    # name: (model_type, config keys beyond the common ones)
    # its router (weight at router.gate) takes [B, S, H] and the block's expert_bias; route_scale is its scaling
    "afmoe": ("afmoe", dict(_AFMOE, route_scale=1.0)),
    "afmoe_scaled": ("afmoe", dict(_AFMOE, route_scale=2.5)),
    "cohere2_moe_sum": ("cohere2_moe", dict(_COHERE2, shared_expert_combination_strategy="sum")),
    "cohere2_moe_sigmoid": ("cohere2_moe", dict(_COHERE2, shared_expert_combination_strategy="sum",
                                                expert_selection_fn="sigmoid")),
    "deepseek_v2": ("deepseek_v2", _DEEPSEEK_V2),
    "deepseek_v2_renorm": ("deepseek_v2", dict(_DEEPSEEK_V2, norm_topk_prob=True)),
    # DeepSeek-V2 itself: softmax, a group limit by the groups' best scores, a routed scaling of 16 (one group of two
    # experts for top-2: the limit binds)
    "deepseek_v2_group_limited": ("deepseek_v2", dict(_DEEPSEEK_V2, routed_scaling_factor=16.0, n_group=4,
                                                      topk_group=1, topk_method="group_limited_greedy")),
    # the same groups declared, not applied (topk_method="greedy"), and a scaling
    "deepseek_v2_groups_unused": ("deepseek_v2", dict(_DEEPSEEK_V2, routed_scaling_factor=2.0, n_group=4,
                                                      topk_group=1)),
    "dots1": ("dots1", _DOTS1),
    # softmax probabilities + a selection bias held one module down (gate.moe_statics), renormalised
    "ernie4_5_moe": ("ernie4_5_moe", _ERNIE),
    "dots1_groups": ("dots1", dict(_DOTS1, **_GROUPS)),
    "exaone_moe": ("exaone_moe", _EXAONE),
    "exaone_moe_groups": ("exaone_moe", dict(_EXAONE, **_GROUPS)),
    "flex_olmo": ("flex_olmo", dict(num_experts=E)),
    "flex_olmo_renorm": ("flex_olmo", dict(num_experts=E, norm_topk_prob=True)),
    "glm4_moe": ("glm4_moe", _GLM4),
    "glm4_moe_groups": ("glm4_moe", dict(_GLM4, **_GROUPS)),
    "glm4_moe_norenorm": ("glm4_moe", dict(_GLM4, norm_topk_prob=False)),
    "glm4_moe_lite": ("glm4_moe_lite", dict(_MLA, n_routed_experts=E, n_shared_experts=1, routed_scaling_factor=1.8,
                                            mlp_layer_types=["sparse"] * LAYERS)),
    "glm_moe_dsa": ("glm_moe_dsa", dict(_MLA, n_routed_experts=E, n_shared_experts=1, routed_scaling_factor=2.5,
                                        mlp_layer_types=["sparse"] * LAYERS, first_k_dense_replace=0, index_topk=4,
                                        index_head_dim=16, index_n_heads=2, layer_types=["indexed_attention"] * LAYERS,
                                        indexer_types=["full"] * LAYERS)),
    "granitemoe": ("granitemoe", dict(num_local_experts=E, intermediate_size=32)),
    "granitemoeshared": ("granitemoeshared", dict(num_local_experts=E, intermediate_size=32,
                                                  shared_intermediate_size=32)),
    "granitemoehybrid": ("granitemoehybrid", dict(num_local_experts=E, intermediate_size=32,
                                                  shared_intermediate_size=32, layer_types=["linear_attention", _FULL],
                                                  mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16,
                                                  mamba_chunk_size=8)),
    # its router's weight is one module down (gate.wg)
    "hunyuan_v1_moe": ("hunyuan_v1_moe", dict(num_experts=E, moe_topk=K)),
    "jamba": ("jamba", _JAMBA),
    "jamba_renorm": ("jamba", dict(_JAMBA, norm_topk_prob=True)),
    "lfm2_moe": ("lfm2_moe", _LFM2),
    "lfm2_moe_nobias_scale2": ("lfm2_moe", dict(_LFM2, use_expert_bias=False, routed_scaling_factor=2.0)),
    "minicpm5_moe": ("minicpm5_moe", _MINICPM5),
    "minicpm5_moe_groups": ("minicpm5_moe", dict(_MINICPM5, **_GROUPS)),
    "minimax": ("minimax", _MINIMAX),
    "minimax_top1": ("minimax", dict(_MINIMAX, num_experts_per_tok=1)),
    "param2moe": ("param2moe", _SARVAM),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", dict(_LINEAR_ATTENTION, num_experts=E,
                                                  shared_expert_intermediate_size=32)),
    "qwen3_next": ("qwen3_next", _QWEN3_NEXT),
    "qwen3_next_norenorm": ("qwen3_next", dict(_QWEN3_NEXT, norm_topk_prob=False)),
    "sarvam_moe": ("sarvam_moe", _SARVAM),
    "sarvam_moe_groups": ("sarvam_moe", dict(_SARVAM, **_GROUPS)),
}

SINCE_TRANSFORMERS = {name: "5.25" for name in ("glm_moe_dsa", "granitemoe", "granitemoeshared", "granitemoehybrid",
                                                 "jamba", "jamba_renorm")}
"""families whose tiny model here needs a newer transformers than 5.17 (the GPU machine's): there Granite-MoE's router
returns other shapes and Jamba's block routes with another signature (base_moe refuses both, naming the probe's
error), and GLM-MoE-DSA's config knows no "indexed_attention" layer; the survey ran on 5.25."""

FP32_ONLY = {"lfm2_moe", "lfm2_moe_nobias_scale2"}
"""supported in fp32 only: LFM2's router ranks sigmoid + bias in the model's dtype, so in bf16 it ranks sums rounded to
bf16, which base_moe's fp32 scores do not reproduce; detection refuses it there."""

REFUSED = {
    # name: (model_type, config keys, a regex searched in the MoELayoutError, selection-bias scale)
    "cohere2_moe_average": ("cohere2_moe", _COHERE2, "not the weighted sum of its routed experts", 0.2),
    "dbrx": ("dbrx", dict(d_model=H, n_heads=4, n_layers=LAYERS, max_seq_len=64,
                          attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
                          ffn_config={"ffn_hidden_size": 32, "moe_num_experts": E, "moe_top_k": K, "hidden_size": H}),
             "no fused 3-D", 0.2),
    "jetmoe": ("jetmoe", dict(num_local_experts=E, kv_channels=16, num_key_value_heads=4, intermediate_size=32),
               "no fused 3-D", 0.2),
    "llama4_text": ("llama4_text", _LLAMA4, "do not match hidden size", 0.2),
    "longcat_flash": ("longcat_flash", dict(_MLA, head_dim=8, num_layers=LAYERS, n_routed_experts=E,
                                            zero_expert_num=2, moe_topk=K, expert_ffn_hidden_size=32,
                                            ffn_hidden_size=64, routed_scaling_factor=2.0),
                      # 5.17's experts module holds the zero experts' gate_up rows: refused for its weights' shapes
                      "no router found|do not match hidden size", 0.2),
    "phimoe": ("phimoe", dict(num_local_experts=E, intermediate_size=32), "match none of base_moe's routing rules",
               0.2),
}


def has_model_type(model_type: str) -> bool:
    """Whether the installed transformers knows ``model_type`` (older 5.x releases lack some families)."""
    return model_type in transformers.CONFIG_MAPPING


def build(model_type: str, keys: dict, bias_scale: float = 0.2) -> transformers.PreTrainedModel:
    """The tiny fp32 causal LM of ``model_type`` with ``keys``, its routers and selection biases drawn (module doc)."""
    config = transformers.AutoConfig.for_model(model_type, **{**_COMMON, **keys})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager", dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            owner = name.rsplit(".", 1)[0]
            if p.dim() == 2 and p.shape[0] in (E, E + 2) and ("gate" in owner or "router" in owner) \
                    and "proj" not in owner:  # E + 2: LongCat's zero experts
                p.copy_(torch.randn(p.shape, generator=generator) / p.shape[1] ** 0.5)
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and t.numel() in (E, E + 2) and "bias" in name.rsplit(".", 1)[-1] \
                    and "proj" not in name:
                t.copy_(torch.randn(t.shape, generator=generator) * bias_scale)
    return model.eval()
