"""Where WS wins (developer tooling, notes/STATUS.md): the expert op under forced configurations, bench_layer.py's
draws and timing, Qwen3 and OLMoE shapes. Two sweeps:
  default    T x M points of 85-186 tokens per expert, around WS's 160-token items (session 17)
  --columns  points of 32-128 tokens per expert, where 160-column items are mostly padding, against WS with 128, 80
             and 64 token columns per item ("WS-128" ...: bench_layer.py's variants, BASE_MOE_WS_N)

    python3 notes/ws_window.py [--columns] [qwen3-30b-a3b,olmoe-1b-7b]
"""
import sys

import torch

sys.path.insert(0, "benchmarks")
from bench_layer import COPIES, MODELS, draw_point, expert_op_us, expert_weights, variant  # noqa: E402

SWEEPS = {
    "window": (
        {
            "qwen3-30b-a3b": [(256, m) for m in (11, 13, 14, 16, 18, 20, 22, 24)] + [(128, 7), (128, 8), (128, 10),
                                                                                   (512, 28), (512, 32), (512, 40)],
            "olmoe-1b-7b": [(256, m) for m in (12, 14, 16, 18, 20, 24)] + [(512, 32)],
        },
        ("default", "WS", "W64", "W128"),
    ),
    "columns": (
        {
            "qwen3-30b-a3b": [(256, m) for m in (16, 20, 22, 24, 28, 32, 36, 40, 44, 48, 52, 56, 64)]
            + [(512, m) for m in (40, 48, 56, 64, 80, 96, 112, 128)]
            + [(128, m) for m in (12, 16, 20, 24, 32)] + [(64, 16)],
            "olmoe-1b-7b": [(256, m) for m in (16, 20, 24, 28, 32, 40, 48, 56, 64)] + [(512, m) for m in (48, 64, 96)],
        },
        ("default", "W64", "W128", "WS", "WS-128", "WS-80", "WS-64"),
    ),
}


args = [a for a in sys.argv[1:] if a != "--columns"]
points, variants = SWEEPS["columns" if "--columns" in sys.argv[1:] else "window"]
for name in (args[0] if args else ",".join(points)).split(","):
    cfg = MODELS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    copies = [expert_weights(cfg, gen) for _ in range(COPIES)]
    print(f"{name}\nT    M  tokens/expert active " + " ".join(f"{v:>8s}" for v in variants))
    for T, M in points[name]:
        x, ids, w, active = draw_point(name, cfg, T, M)
        us = []
        for var in variants:
            with variant(var):
                us.append(expert_op_us(x, ids, w, copies, M))
        print(f"{T:<4d} {M:<3d} {T * cfg['k'] // M:>13d} {active:>6d} " + " ".join(f"{u:8.1f}" for u in us))
    del copies
    torch.cuda.empty_cache()
