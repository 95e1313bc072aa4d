"""Session 68 (developer tooling): what finished_tokens costs one Qwen3-30B-A3B-shaped MoE block (H 2048, E 128, top-8,
I 768, bf16) under BASE M=16: the patched block's decode call in a CUDA graph, every row voting (no mask) against a
mask with no finished row and with half the rows finished. Median us per block call over graph replays of 20 calls.

    PYTHONPATH=. python3 notes/s68_voting_cost.py
"""
import statistics

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import base_moe
from base_moe.hf import moe_layouts

torch.manual_seed(0)
config = Qwen3MoeConfig(vocab_size=1024, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                        num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True)
with torch.device("cuda"):
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()


class Predictors:  # random predictor weights: the GEMV costs the same whatever they are
    weight = {0: torch.randn(128, 2048) * 0.02}
    bias = {0: torch.zeros(128)}


base_moe.apply(model, predictors=Predictors(), budget=16, policy="base", experts="base_moe")
layout = moe_layouts(model)[0]
state = layout.block._base_moe
CALLS = 20


def time_block(batch: int, voting) -> float:
    hidden = torch.randn(CALLS, batch, 1, 2048, device="cuda", dtype=torch.bfloat16)
    base_moe.configure(model, finished_tokens=None if voting is None else [0])
    state.inputs.voting = voting
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.no_grad():
        for _ in range(2):
            layout.block(hidden[0])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.no_grad():
        for i in range(CALLS):
            layout.block(hidden[i])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    state.inputs.voting = None
    return statistics.median(times)


print(torch.cuda.get_device_name(), torch.__version__)
print("batch | all vote (no mask) us | mask, none finished us | mask, half finished us")
for batch in (1, 16, 64):
    none = time_block(batch, None)
    all_live = time_block(batch, torch.ones(batch, 1, dtype=torch.bool, device="cuda"))
    half = torch.arange(batch, device="cuda")[:, None] % 2 == 0
    print(f"{batch} | {none:.1f} | {all_live:.1f} | {time_block(batch, half):.1f}")
