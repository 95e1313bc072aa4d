"""First contact of the WS configuration with a GPU (developer tooling, notes/STATUS.md): one shape per process, so a
hang (a wrong mbarrier count) is caught by the caller's timeout and names its shape. Compares BASE_MOE_EXPERTS_CONFIG=WS
against the default configuration (bf16: the two add products in different orders, so they agree to rounding).

    python3 notes/ws_smoke.py SHAPE     # SHAPE: qwen3 (no partial tiles), h320 (partial down tile, I = 2 x 96),
                                        # i64 (gate_up tile with one live consumer of three), fp16
"""
import os
import sys

import torch

import base_moe.ops  # noqa: F401

SHAPES = {"qwen3": (256, dict(H=2048, I=768, E=128, k=8), 16, torch.bfloat16),
          "h320": (70, dict(H=320, I=192, E=10, k=3), 4, torch.bfloat16),
          "i64": (300, dict(H=128, I=64, E=4, k=2), 2, torch.bfloat16),
          "fp16": (100, dict(H=256, I=128, E=8, k=4), 4, torch.float16)}


def problem(T, H, I, E, k, used, dtype):
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, H, device="cuda", generator=g).to(dtype)
    gu = (torch.randn(E, 2 * I, H, device="cuda", generator=g) / H**0.5).to(dtype)
    dp = (torch.randn(E, H, I, device="cuda", generator=g) / I**0.5).to(dtype)
    pool = torch.randperm(E, device="cuda", generator=g)[:used]
    ids = pool[torch.rand(T, used, device="cuda", generator=g).argsort(dim=1)[:, :min(k, used)]].to(torch.int32)
    ids = torch.cat([ids, torch.full((T, k - ids.shape[1]), E, device="cuda", dtype=torch.int32)], dim=1)
    ids[torch.rand(T, k, device="cuda", generator=g) < 0.1] = E  # dropped slots
    w = torch.where(ids < E, torch.rand(T, k, device="cuda", generator=g), 0.0).float()
    return x, ids.contiguous(), w.contiguous(), gu, dp


T, shape, used, dtype = SHAPES[sys.argv[1]]
args = problem(T, **shape, used=used, dtype=dtype)
os.environ.pop("BASE_MOE_EXPERTS_CONFIG", None)
expected = torch.ops.base_moe.experts(*args)
os.environ["BASE_MOE_EXPERTS_CONFIG"] = "WS"
got = torch.ops.base_moe.experts(*args)
torch.cuda.synchronize()
err = (got.float() - expected.float()).abs().max().item()
scale = expected.float().abs().max().item()
ok = torch.isfinite(got).all().item() and err <= 2**-6 * scale
print(f"{sys.argv[1]}: max |WS - default| {err:.3g} of max |default| {scale:.3g}: {'ok' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
