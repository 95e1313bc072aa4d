"""Where WS wins (developer tooling, notes/STATUS.md): the expert op under forced configurations at loads around its
160-token pass, T x M points of 85-186 tokens per expert (bench_layer.py's draws and timing), Qwen3 and OLMoE shapes.

    python3 notes/ws_window.py [qwen3-30b-a3b,olmoe-1b-7b]
"""
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_layer import COPIES, MODELS, draw_point, expert_op_us, expert_weights, set_variant  # noqa: E402

POINTS = {
    "qwen3-30b-a3b": [(256, m) for m in (11, 13, 14, 16, 18, 20, 22, 24)] + [(128, 7), (128, 8), (128, 10),
                                                                           (512, 28), (512, 32), (512, 40)],
    "olmoe-1b-7b": [(256, m) for m in (12, 14, 16, 18, 20, 24)] + [(512, 32)],
}
VARIANTS = ("default", "WS", "W64", "W128")

for name in (sys.argv[1] if len(sys.argv) > 1 else ",".join(POINTS)).split(","):
    cfg = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = [expert_weights(cfg, gen) for _ in range(COPIES)]
    print(f"{name}\nT    M  tokens/expert active " + " ".join(f"{v:>8s}" for v in VARIANTS))
    for T, M in POINTS[name]:
        x, ids, w, active = draw_point(name, cfg, T, M)
        us = []
        for var in VARIANTS:
            set_variant(var)
            us.append(expert_op_us(x, ids, w, copies, M))
        set_variant("default")
        print(f"{T:<4d} {M:<3d} {T * cfg['k'] // M:>13d} {active:>6d} " + " ".join(f"{u:8.1f}" for u in us))
    del copies
    torch.cuda.empty_cache()
