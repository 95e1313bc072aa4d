"""EXPERIMENT check (notes/early_kept_v2.patch): the BASE layer (select_experts + experts) gives the same bits with
BASE_MOE_EARLY_KEPT=1 (gate_up streams the kept list's experts before its PDL wait) as without, over random inputs,
budgets and batches, eager and in a CUDA graph; and a stale mailbox (the expert op alone after a selection of other
experts) changes nothing either."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from bench_layer import MODELS, expert_weights, router_weights, select_experts  # noqa: E402

cfg = MODELS["qwen3-30b-a3b"]
gen = torch.Generator(device="cuda").manual_seed(1)
gu, dp = expert_weights(cfg, gen)
router, predictor, pbias = router_weights(cfg, gen)


def layer(x, M):
    ids, w = select_experts(x, cfg, router, predictor, pbias, M)
    return torch.ops.base_moe.experts(x, ids, w, gu, dp, M)


bad = 0
n = 0
for T in (1, 3, 4, 16, 33, 64):
    for M in (8, 16, 32, 64):
        for seed in range(3):
            g = torch.Generator(device="cuda").manual_seed(seed * 100 + T)
            x = torch.randn(T, cfg["H"], device="cuda", generator=g).to(torch.bfloat16)
            os.environ["BASE_MOE_EARLY_KEPT"] = "0"
            ref = layer(x, M)
            os.environ["BASE_MOE_EARLY_KEPT"] = "1"
            outs = [layer(x, M) for _ in range(3)]
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                gout = layer(x, M)
            graph.replay()
            torch.cuda.synchronize()
            for o in outs + [gout]:
                n += 1
                bad += not torch.equal(o, ref)
# stale mailbox: the last selection chose other experts than these ids use
x = torch.randn(16, cfg["H"], device="cuda", generator=gen).to(torch.bfloat16)
ids = torch.randint(0, cfg["E"], (16, cfg["k"]), device="cuda", generator=gen, dtype=torch.int32)
w = torch.rand(16, cfg["k"], device="cuda", generator=gen)
os.environ["BASE_MOE_EARLY_KEPT"] = "0"
ref = torch.ops.base_moe.experts(x, ids, w, gu, dp, 16)
os.environ["BASE_MOE_EARLY_KEPT"] = "1"
layer(torch.randn(16, cfg["H"], device="cuda", generator=gen).to(torch.bfloat16), 16)
stale = torch.ops.base_moe.experts(x, ids, w, gu, dp, 16)
torch.cuda.synchronize()
n += 1
bad += not torch.equal(stale, ref)
print(f"early_check: {n} outputs compared, {bad} differ")
