"""Session 68 (developer tooling): what finished sequences' votes cost the live ones, on the bundled testbed (CPU).

A batch of 16 held-out sequences of 256 bytes, the first 32 positions dense, then every position one decode batch of
16 tokens under BASE (group_by="position", the evaluation protocol). From position 64 on, 8 of the 16 sequences are
"finished": their bytes are 0 (the pad byte; the testbed's configs name no pad or EOS id, so the ids are passed). The
live 8 sequences' bits per byte over positions 64-255, under: dense; BASE where every row votes (the default);
BASE with finished_tokens=[0]; BASE on a batch of the 8 live sequences alone.

    PYTHONPATH=. python3 notes/s68_finished_quality.py
"""
import math
import os

import torch
from transformers import AutoModelForCausalLM

import base_moe

torch.manual_seed(0)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTBED = os.path.join(ROOT, "testbed")


def read_bytes(path, limit=None):
    with open(path, "rb") as f:
        return torch.frombuffer(bytearray(f.read(limit)), dtype=torch.uint8).long()


model = AutoModelForCausalLM.from_pretrained(TESTBED, dtype=torch.float32).eval()
predictors = base_moe.calibrate(model, read_bytes(os.path.join(TESTBED, "calib.txt"), 65536).view(-1, 256),
                                progress=False)
held = read_bytes(os.path.join(TESTBED, "heldout.txt"))
seqs = held[: 16 * 256].view(16, 256)
live_rows = torch.arange(0, 16, 2)
batch = seqs.clone()
batch[1::2, 64:] = 0  # the odd rows finished at position 64
START = 64


def live_bits(model, ids, rows):
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)
    target = ids[:, 1:]
    nll = -logp[:, :-1].gather(2, target[..., None])[..., 0]
    return float(nll[rows, START - 1:].mean()) / math.log(2)


print("budget | dense | every row votes | finished_tokens=[0] | live rows alone   (bits per byte, live rows, 64-255)")
dense = live_bits(model, batch, live_rows)
base_moe.apply(model, predictors=predictors, policy="base", group_by="position", dense_positions=32)
for budget in (4, 6, 8, 12):
    base_moe.configure(model, budget=budget, finished_tokens=None)
    voting = live_bits(model, batch, live_rows)
    base_moe.configure(model, finished_tokens=[0])
    skipped = live_bits(model, batch, live_rows)
    base_moe.configure(model, finished_tokens=None)
    alone = live_bits(model, seqs[live_rows], torch.arange(8))
    print(f"{budget} | {dense:.4f} | {voting:.4f} | {skipped:.4f} | {alone:.4f}")
