"""WS with fewer token columns per work item (developer tooling, notes/STATUS.md; branch wip/ws-n): the expert op
under forced configurations at 32-128 tokens per expert, where WS's 160-column items are mostly padding and the
cp.async configurations (W64, W128) run today, against WS at BASE_MOE_WS_N = 160, 128 and 64. bench_layer.py's
draws and timing.

    python3 notes/ws_n_sweep.py [qwen3-30b-a3b,olmoe-1b-7b]
"""
import os
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_layer import COPIES, MODELS, draw_point, expert_op_us, expert_weights, set_variant  # noqa: E402

POINTS = {
    "qwen3-30b-a3b": [(256, 16), (256, 24), (256, 32), (256, 48), (256, 64), (128, 16), (128, 32), (64, 16)],
    "olmoe-1b-7b": [(256, 16), (256, 32), (256, 64)],
}
VARIANTS = (("default", None), ("W64", None), ("W128", None), ("WS", "160"), ("WS", "128"), ("WS", "64"))

for name in (sys.argv[1] if len(sys.argv) > 1 else ",".join(POINTS)).split(","):
    cfg = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = [expert_weights(cfg, gen) for _ in range(COPIES)]
    heads = [var if n is None else f"{var}-{n}" for var, n in VARIANTS]
    print(f"{name}\nT    M  tokens/expert active " + " ".join(f"{h:>8s}" for h in heads))
    for T, M in POINTS[name]:
        x, ids, w, active = draw_point(name, cfg, T, M)
        us = []
        for var, n in VARIANTS:
            set_variant(var)
            if n is not None:
                os.environ["BASE_MOE_WS_N"] = n
            us.append(expert_op_us(x, ids, w, copies, M))
            os.environ.pop("BASE_MOE_WS_N", None)
        set_variant("default")
        print(f"{T:<4d} {M:<3d} {T * cfg['k'] // M:>13d} {active:>6d} " + " ".join(f"{u:8.1f}" for u in us))
    del copies
    torch.cuda.empty_cache()
