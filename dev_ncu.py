# temporary device driver for ncu: one experts call on the Qwen3 shape at (T, M)
import sys, torch, base_moe.ops  # noqa
sys.path.insert(0, "benchmarks")
from bench_layer import random_routing, point_generator
T, M = int(sys.argv[1]), (None if sys.argv[2] == "None" else int(sys.argv[2]))
H, E, k, I = 2048, 128, 8, 768
g = torch.Generator(device="cuda").manual_seed(0)
gu = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H**-0.5).bfloat16()
dp = (torch.randn(E, H, I, device="cuda", generator=g) * I**-0.5).bfloat16()
pt = point_generator("qwen3-30b-a3b", T, M)
x = torch.randn(T, H, device="cuda", generator=pt).bfloat16()
ids, w = random_routing(T, E, k, M, True, pt)
for _ in range(2):
    torch.ops.base_moe.experts(x, ids, w, gu, dp, M)
torch.cuda.synchronize()
