# Session 74: measures what round_logits changes (ops.router_predict's round_logits, merged in session 75).
# Session 74 (README "round_logits"): run from the repo root, `PYTHONPATH=. python notes/s74_round_logits.py`.
# README's round_logits claims on a Qwen3-30B-A3B-sized bf16 router (H 2048, E 128, top-8), 4,096 random tokens, CPU:
# share of equal logits (ours rounded vs F.linear bf16), and tokens whose top-8 set differs from torch.topk's
import torch, torch.nn.functional as F
from base_moe import ops, reference
from base_moe.routing import Routing
torch.manual_seed(0)
H, E, k, T = 2048, 128, 8, 4096
x = torch.randn(T, H).bfloat16()
for scale in (H**-0.5, 0.02):
    w = (torch.randn(E, H) * scale).bfloat16()
    own = F.linear(x, w).float()
    for rounds in (True, False):
        ours, _ = ops.router_predict(x, w, round_logits=rounds)
        eq = float((ours == own).float().mean())
        hf_ids = torch.topk(torch.softmax(own, -1), k, dim=-1).indices.sort(-1).values
        ids, _ = reference.route(ours, Routing(k), None)
        ids = ids.long().sort(-1).values
        diff = (hf_ids != ids).any(-1)
        # a differing token whose k-th and (k+1)-th own logits tie
        s = own.sort(-1, descending=True).values
        tie = s[:, k - 1] == s[:, k]
        print(f"w scale {scale:.4f} round={rounds}: equal logits {eq:.4%}, other expert set {int(diff.sum())} of {T}"
              f" ({float(diff.float().mean()):.2%}), of them at an exact own tie {int((diff & tie).sum())}")
