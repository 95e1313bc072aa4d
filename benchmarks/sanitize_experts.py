"""Small driver for compute-sanitizer (memcheck, racecheck) on the CUDA expert op, every tile configuration:
``compute-sanitizer --tool memcheck python benchmarks/sanitize_experts.py`` (the configurations from
``--configs`` or the SANITIZE_CONFIGS environment variable). It runs without PyTorch's caching allocator (each tensor
its own allocation, so that memcheck sees an access past a tensor's end), unless PYTORCH_NO_CUDA_MEMORY_CACHING is set;
give compute-sanitizer ``--error-exitcode`` to have its findings in the exit status."""
import argparse
import os

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")  # before torch's first CUDA allocation
import torch  # noqa: E402
from common import require_cuda  # noqa: E402

import base_moe.ops  # noqa: F401, E402

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--configs", default=os.environ.get("SANITIZE_CONFIGS", "default,T16,T32,W64,W128,WS"),
                    help="expert-op tile configurations, comma-separated (default: %(default)s)")
args = parser.parse_args()
require_cuda("sanitize_experts.py")
torch.manual_seed(0)
for config in args.configs.split(","):
    if config == "default":
        os.environ.pop("BASE_MOE_EXPERTS_CONFIG", None)
    else:
        os.environ["BASE_MOE_EXPERTS_CONFIG"] = config
    # H = 320: the down GEMM's 64-row fallback of the 128-row configurations; k = 12: the slot sum's 16-slot instance;
    # E = 160: grids of 320 CTAs, past one wave of T16 at 5 stages (T16 then runs at 3); E = 80: twice gate_up's 160
    # CTAs fit one wave of the 64-row kernel, so T16 runs it in those tiles (as every smaller shape)
    for T, H, I, E, k, used in [(1, 128, 64, 4, 2, 4), (37, 256, 128, 8, 3, 5), (150, 128, 64, 3, 2, 2),
                                (20, 320, 192, 10, 3, 6), (9, 128, 64, 24, 12, 20), (64, 256, 128, 160, 8, 160),
                                (16, 256, 128, 80, 8, 80)]:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        gu = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.05
        dp = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.05
        ids = torch.stack([torch.randperm(used, device="cuda")[:k] for _ in range(T)]).to(torch.int32)
        ids[torch.rand(T, k, device="cuda") < 0.2] = E
        w = torch.where(ids < E, torch.rand(T, k, device="cuda"), 0.0).float()
        for _ in range(2):
            y = torch.ops.base_moe.experts(x, ids, w, gu, dp)
        torch.cuda.synchronize()
        print(config, T, H, I, E, k, float(y.float().abs().sum()))
print("sanitize driver done")
