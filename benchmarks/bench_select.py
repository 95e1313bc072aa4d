"""Selection path of one MoE layer: base_moe's CUDA kernels next to plain PyTorch, under CUDA-graph replay.

Paths, all timed in the same run on the same inputs:
  select_experts  base_moe.ops.select_experts: stages 1-3 (router_predict, then route_select; also each alone)
  pytorch  the same BASE selection in plain PyTorch (one GEMV over the concatenated router and predictor weights,
           routing, costs, batch sums, top-M, backfill, counts), graph-capturable, no Python loop over tokens
  hf       the model's own router alone (linear + scoring + top-k + renormalisation), as Hugging Face writes it
  after a norm  select_experts behind the decoder layer's RMSNorm, as in decode:
                (norm + selection) - norm, with torch's norm (F.rms_norm)
  after our norm  select_experts behind base_moe.ops.rms_norm instead, whose kernel lets the
                selection start while it runs: (our norm + selection) - torch's norm, so that a slower norm counts
                against it

Timing: each graph holds ROT consecutive calls on ROT different copies of the weights and hidden states (at least twice
the bytes of a 60 MiB L2, GH100's full L2: the H100 and H200 enable 50 MiB), is replayed many times, and the per-call
time is the median replay time / ROT. The kernels launch with programmatic dependent launch unless BASE_MOE_PDL=0, so a
select_experts call stages its weights while the previous call finishes. In decode the kernel before it is the layer's
norm: torch's does not let it (the "after a norm" column is the selection's cost in a decode step that keeps torch's
norm), base_moe's does ("after our norm": the step's extra cost over torch's norm alone when it runs base_moe's).
--hidden hot gives every call the same hidden states instead (L2-resident, as in decode, where the norm kernel just
before the MoE block wrote them). Behind a norm (the "after" columns and the norms alone) every call reads one
hidden-state buffer, whatever --hidden says: in decode the norm's input is the residual stream the attention just wrote
(L2-resident), and the norm alone must find its input where the chained norm does (with rotated copies the norm alone
read them from L2 at small T, where all ROT copies fit, while the chained norm, ~2 L2 of weights later, read them from
HBM). --weights hot gives every call the same router and predictor weights (L2-resident: what a selection would cost if
something had pulled its weights into L2 before the norm; in decode, between two layers' selections, ~40 MB of other
weights stream by).

    python benchmarks/bench_select.py [--out benchmarks/results/bench_select.json]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from common import (copy_bandwidth, graph_time_us, median, names_from, positive_ints, require_cuda, run_metadata,
                    write_json)

import base_moe
from base_moe import Cost, Fill, Routing, Scoring, ops
from base_moe.cli import positive_int

MODELS = {
    "qwen3-30b-a3b": dict(H=2048, E=128, routing=Routing(8, Scoring.SOFTMAX, renormalize=True), bias=False,
                          round_logits=True),
    "deepseek-v3-like": dict(
        H=7168, E=256, routing=Routing(8, Scoring.SIGMOID, renormalize=True, n_group=8, topk_group=4, scaling=2.5),
        bias=True, round_logits=False,
    ),
    # not in the table (--models): the softmax rules with a group limit or a selection bias
    "deepseek-v2-like": dict(
        H=5120, E=160, routing=Routing(6, Scoring.SOFTMAX, n_group=8, topk_group=3, scaling=16.0), bias=False,
        round_logits=False,
    ),
    "ernie-4.5-like": dict(H=2560, E=64, routing=Routing(6, Scoring.SOFTMAX, renormalize=True), bias=True,
                           round_logits=False),
}
"""round_logits: as the HF integration passes it (MoELayout.router_rounds_logits): Qwen3's linear router returns bf16
logits, DeepSeek-V3's, V2's and ERNIE-4.5's compute fp32 ones (their HF baselines get fp32 weights: no per-call cast)."""
DEFAULT_MODELS = ("qwen3-30b-a3b", "deepseek-v3-like")
"""the issue's table (#3)."""
TOKENS = (1, 4, 16, 64, 256)
BUDGET = 16
L2_BYTES = 60 * 2**20  # an upper bound of the Hopper L2s (H100 and H200: 50 MiB), so rotations never fit
# the paths timed behind a norm, and the norms alone subtracted from them: one hidden-state buffer for all calls
NORM_PATHS = ("norm", "norm_select", "norm_pytorch", "our_norm", "our_norm_select")


def path_inputs(path: str, xs: list) -> list:
    """The hidden states each of a graph's calls reads: behind a norm one buffer for every call (as in decode, and so
    that the norm alone and the norm inside a chain read their input from the same place); elsewhere ``xs``."""
    return [xs[0]] * len(xs) if path in NORM_PATHS else xs


# ---------------------------------------------------------------------------------------------
# Plain-PyTorch paths
# ---------------------------------------------------------------------------------------------
def routing_scores(logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None):
    """(probs, choice) [T, E]: what the weights are taken from, and what the experts are ranked by."""
    if routing.scoring == Scoring.SIGMOID:
        probs = torch.sigmoid(logits)
        return probs, probs + bias if bias is not None else probs
    probs = torch.softmax(logits, dim=-1)
    return probs, probs + bias if bias is not None else logits  # (ERNIE-4.5 ranks probabilities + its bias)


def torch_routing(logits: torch.Tensor, routing: Routing, bias: torch.Tensor | None, keep: torch.Tensor | None = None,
                  scores: tuple[torch.Tensor, torch.Tensor] | None = None):
    """ids, weights [T, k]; ``keep`` [T, E] bool restricts the choice (backfill); ``scores``: routing_scores' result
    when the caller has it already."""
    T, E = logits.shape
    probs, choice = scores if scores is not None else routing_scores(logits, routing, bias)
    if routing.n_group > 1:
        grouped = choice.view(T, routing.n_group, -1)  # groups scored as base_moe.reference.allowed_groups does
        if routing.scoring == Scoring.SIGMOID:
            group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:
            group_score = grouped.max(dim=-1).values
        top_groups = group_score.topk(routing.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, top_groups, True)
        allowed = group_mask.repeat_interleave(E // routing.n_group, dim=1)
        # backfill: group-allowed kept experts first, then other kept experts
        choice = torch.where(allowed, choice, choice - 1e4) if keep is not None else choice.masked_fill(~allowed, -1e9)
    if keep is not None:
        choice = choice.masked_fill(~keep, float("-inf"))
    top = choice.topk(routing.top_k, dim=-1)
    ids = top.indices
    w = probs.gather(1, ids)
    if keep is not None:
        valid = torch.isfinite(top.values)
        w = w * valid
        ids = torch.where(valid, ids, E)
    if routing.renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + (1e-20 if routing.scoring == Scoring.SIGMOID else 0.0))
    return ids, w * routing.scaling if routing.scaling != 1.0 else w


def torch_select(x, W_cat, b_cat, routing: Routing, bias, E: int, budget: int):
    """BASE selection in plain PyTorch (G = 1): returns ids, weights, kept, counts, D."""
    out = F.linear(x, W_cat).float() + b_cat
    logits, log_norms = out[:, :E], out[:, E:]
    scores = routing_scores(logits, routing, bias)  # once for the routing and the backfill
    ids, w = torch_routing(logits, routing, bias, scores=scores)
    w2 = w * w
    cost = torch.where(w2 == 0, 0.0, w2 * torch.exp(2.0 * log_norms.gather(1, ids)))  # as the ops: never 0 x inf
    D = torch.zeros(1, E, device=x.device).scatter_add_(1, ids.view(1, -1), cost.view(1, -1))
    union = torch.zeros(1, E, dtype=torch.bool, device=x.device).scatter_(1, ids.view(1, -1), True)
    top = torch.where(union, D, -1.0).topk(min(budget, E), dim=-1)
    kept = torch.where(top.values >= 0, top.indices, E)
    keep = torch.zeros(1, E + 1, dtype=torch.bool, device=x.device).scatter_(1, kept, True)[:, :E]
    final_ids, final_w = torch_routing(logits, routing, bias, keep.expand(x.shape[0], E), scores)
    counts = torch.zeros(1, E + 1, dtype=torch.int32, device=x.device)
    counts.scatter_add_(1, final_ids.view(1, -1), torch.ones_like(final_ids, dtype=torch.int32).view(1, -1))
    return final_ids, final_w, kept, counts[:, :E], D


def hf_keep_top_groups(choice: torch.Tensor, group_scores: torch.Tensor, routing: Routing) -> torch.Tensor:
    """HF's group limit (DeepSeek-V2 and -V3 alike): the choice scores outside the token's ``topk_group`` best groups
    by ``group_scores [T, n_group]`` set to 0."""
    T, E = choice.shape
    group_idx = torch.topk(group_scores, k=routing.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(T, routing.n_group, E // routing.n_group).reshape(T, -1)
    return choice.masked_fill(~score_mask.bool(), 0.0)


def hf_fp32_softmax_router(x, W_r, routing: Routing, bias):
    """DeepseekV2TopkRouter (greedy or group_limited_greedy) and Ernie4_5_MoeTopKRouter: fp32 linear, softmax, top-k of
    the probabilities (+ ERNIE's bias) within the best groups (a group's best probability), weights the probabilities
    (ERNIE renormalises, clamped at moe_norm_min), times the routed scaling."""
    scores = F.linear(x.float(), W_r.float()).softmax(dim=-1)
    choice = scores + bias if bias is not None else scores
    if routing.n_group > 1:
        group_scores = choice.view(choice.shape[0], routing.n_group, -1).max(dim=-1).values
        choice = hf_keep_top_groups(choice, group_scores, routing)
    ids = torch.topk(choice, k=routing.top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, ids)
    if routing.renormalize:
        w = w / w.sum(dim=-1, keepdim=True).clamp(min=1e-12)
    return ids, w * routing.scaling


def hf_router(x, W_r, routing: Routing, bias):
    """The model's router as Hugging Face writes it (Qwen3-MoE, DeepSeek-V3, and hf_fp32_softmax_router's)."""
    if routing.scoring == Scoring.SOFTMAX and (routing.n_group > 1 or bias is not None or routing.scaling != 1.0):
        return hf_fp32_softmax_router(x, W_r, routing, bias)
    if routing.scoring == Scoring.SIGMOID:  # DeepseekV3TopkRouter: fp32 linear, sigmoid, bias, groups
        logits = F.linear(x.float(), W_r.float())
        scores = logits.sigmoid()
        choice = scores + bias
        group_scores = choice.view(choice.shape[0], routing.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
        choice = hf_keep_top_groups(choice, group_scores, routing)
        ids = torch.topk(choice, k=routing.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, w * routing.scaling
    logits = F.linear(x, W_r)  # Qwen3MoeSparseMoeBlock
    probs = F.softmax(logits, dim=1, dtype=torch.float)
    w, ids = torch.topk(probs, routing.top_k, dim=-1)
    w = w / w.sum(dim=-1, keepdim=True)
    return ids, w.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------
def bench_model(name: str, cfg: dict, replays: int, hidden: str = "rotated", weights: str = "rotated",
                tokens: tuple[int, ...] = TOKENS, device: str = "cuda") -> list[dict]:
    H, E, routing = cfg["H"], cfg["E"], cfg["routing"]
    dtype = torch.bfloat16
    weight_bytes = 2 * E * H * 2  # router + predictor, bf16: what a selection path reads per call
    # enough copies that the least any timed path reads per call (HF's router alone, half of it) cycles through twice
    # the L2: no path's weights are served from L2 (rotating by weight_bytes left HF's router at about one L2)
    rot = max(2, min(256, (2 * L2_BYTES) // (E * H * 2) + 1))
    gen = torch.Generator(device=device).manual_seed(0)
    sets = []
    for _ in range(rot if weights == "rotated" else 1):
        Wr = (torch.randn(E, H, device=device, generator=gen) / H**0.5).to(dtype)
        Wp = (torch.randn(E, H, device=device, generator=gen) / H**0.5).to(dtype)
        sets.append(
            dict(
                Wr=Wr, Wp=Wp, W_cat=torch.cat([Wr, Wp]),  # concatenated at load time
                # HF keeps DeepSeek-V3's gate.weight in fp32 (_keep_in_fp32_modules_strict): its router reads fp32
                # weights and casts nothing per call
                Wr_hf=Wr if cfg["round_logits"] else Wr.float(),
                bp=torch.randn(E, device=device, generator=gen) * 0.1,
                bias=torch.randn(E, device=device, generator=gen) * 0.1 if cfg["bias"] else None,
            )
        )
    for s in sets:
        s["b_cat"] = torch.cat([torch.zeros(E, device=device), s["bp"]])
    sets = sets * (rot // len(sets))  # "hot": one weight set for every call
    rows = []
    for T in tokens:
        copies = rot if hidden == "rotated" else 1
        xs = [torch.randn(T, H, device=device, generator=gen).to(dtype) for _ in range(copies)]
        xs = xs * (rot // len(xs))  # "hot": one buffer for every call

        def select_experts(x, s):
            return ops.select_experts(x, s["Wr"], routing, budget=BUDGET, cost=Cost.BASE, fill=Fill.BACKFILL,
                                      predictor_weight=s["Wp"], predictor_bias=s["bp"], correction_bias=s["bias"],
                                      round_logits=cfg["round_logits"])

        def pytorch(x, s):
            return torch_select(x, s["W_cat"], s["b_cat"], routing, s["bias"], E, BUDGET)

        def hf(x, s):
            return hf_router(x, s["Wr_hf"], routing, s["bias"])

        norm_weight = torch.ones(H, device=device, dtype=dtype)

        def norm(x, s):  # the decoder layer's norm just before the MoE block (a plain PyTorch kernel, no PDL)
            return F.rms_norm(x, (H,), norm_weight, 1e-6)

        def norm_select(x, s):
            return select_experts(norm(x, s), s)

        def norm_pytorch(x, s):  # the baseline behind the same norm, so that the speed-up compares like with like
            return pytorch(norm(x, s), s)

        def our_norm(x, s):  # base_moe's: programmatic dependent launch lets the selection after it start early
            return ops.rms_norm(x, norm_weight, 1e-6)

        def our_norm_select(x, s):
            return select_experts(our_norm(x, s), s)

        def gemv_only(x, s):
            return ops.router_predict(x, s["Wr"], None, s["Wp"], s["bp"], round_logits=cfg["round_logits"])

        # select_experts' two launches alone (route_select on precomputed logits)
        stage1 = [gemv_only(x, s) for x, s in zip(xs, sets)]

        def select_only(x, s, i=None):
            logits, log_norms = stage1[i]
            return ops.route_select(logits, routing, budget=BUDGET, cost=Cost.BASE, fill=Fill.BACKFILL,
                                    log_norms=log_norms, correction_bias=s["bias"])

        row = dict(model=name, H=H, E=E, k=routing.top_k, T=T, budget=BUDGET, rotation=rot,
                   weight_bytes=weight_bytes)
        for path, fn in (("router_predict", gemv_only), ("route_select", None)):
            if fn is None:
                calls = [lambda x=x, s=s, i=i: select_only(x, s, i) for i, (x, s) in enumerate(zip(xs, sets))]
            else:
                calls = [lambda x=x, s=s, fn=fn: fn(x, s) for x, s in zip(xs, sets)]
            row[f"{path}_us"] = median(graph_time_us(calls, replays))
        for path, fn in (("select_experts", select_experts), ("pytorch", pytorch), ("hf_router", hf), ("norm", norm),
                         ("norm_select", norm_select), ("norm_pytorch", norm_pytorch), ("our_norm", our_norm),
                         ("our_norm_select", our_norm_select)):
            calls = [lambda x=x, s=s, fn=fn: fn(x, s) for x, s in zip(path_inputs(path, xs), sets)]
            times = graph_time_us(calls, replays)
            row[f"{path}_us"] = median(times)
            row[f"{path}_us_min"] = min(times)
        # In decode the kernel before the selection is the layer's norm. torch's does not trigger programmatic
        # dependent launch: the selection cannot stage its weights while it runs, as it can behind the previous
        # selection. base_moe's does; its step is compared against torch's norm alone, so its own time counts.
        row["select_experts_after_norm_us"] = row["norm_select_us"] - row["norm_us"]
        row["select_experts_after_our_norm_us"] = row["our_norm_select_us"] - row["norm_us"]
        row["pytorch_after_norm_us"] = row["norm_pytorch_us"] - row["norm_us"]
        row["speedup_vs_pytorch"] = row["pytorch_us"] / row["select_experts_us"]
        # both behind torch's norm: select_experts_us overlaps the previous selection (PDL), which decode never offers
        row["speedup_vs_pytorch_after_norm"] = row["pytorch_after_norm_us"] / row["select_experts_after_norm_us"]
        row["speedup_vs_hf_router"] = row["hf_router_us"] / row["select_experts_us"]
        rows.append(row)
        print(
            f"{name:17s} T={T:4d}  select_experts {row['select_experts_us']:7.2f} us (after a norm "
            f"{row['select_experts_after_norm_us']:6.2f}, after our norm "
            f"{row['select_experts_after_our_norm_us']:6.2f}; "
            f"norms {row['norm_us']:5.2f} / {row['our_norm_us']:5.2f}; router_predict {row['router_predict_us']:6.2f}, "
            f"route_select {row['route_select_us']:6.2f})  pytorch {row['pytorch_us']:7.2f} us  "
            f"hf router {row['hf_router_us']:7.2f} us  speed-up {row['speedup_vs_pytorch']:5.1f}x",
            flush=True,
        )
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None,
                        help="JSON path (default: benchmarks/results/bench_select.json, or bench_select_hot.json when "
                             "--hidden or --weights is hot)")
    parser.add_argument("--replays", type=positive_int, default=50)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"of {', '.join(MODELS)}")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                        help="tokens per call, comma-separated (the issue's table: %(default)s)")
    parser.add_argument("--hidden", choices=("rotated", "hot"), default="rotated",
                        help="hidden states: one copy per call (from HBM) or one buffer for all calls (from L2)")
    parser.add_argument("--weights", choices=("rotated", "hot"), default="rotated",
                        help="router and predictor weights: one copy per call (from HBM) or one set for all (from L2)")
    args = parser.parse_args()
    tokens = tuple(positive_ints(args.tokens, "--tokens"))
    models = names_from(args.models, MODELS, "--models")
    require_cuda("bench_select.py")
    torch.backends.cuda.matmul.allow_tf32 = False
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    rows = []
    for name in models:
        rows += bench_model(name, MODELS[name], args.replays, args.hidden, args.weights, tokens)
    hbm = args.weights == "rotated"  # HBM bytes per second: meaningless when the weights come from L2
    for row in rows:
        row["weight_bandwidth_TBps"] = row["weight_bytes"] / (row["select_experts_us"] * 1e-6) / 1e12 if hbm else None

    print()
    print("| model | T | select_experts (us) | after a norm (us) | after our norm (us) | router_predict alone | route_select alone | PyTorch BASE path (us) | HF router only (us) | "
          "speed-up vs PyTorch | weights read | norm alone, torch / ours (us) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['T']} | {r['select_experts_us']:.2f} | {r['select_experts_after_norm_us']:.2f} | "
              f"{r['select_experts_after_our_norm_us']:.2f} | "
              f"{r['router_predict_us']:.2f} | {r['route_select_us']:.2f} | {r['pytorch_us']:.2f} | "
              f"{r['hf_router_us']:.2f} | {r['speedup_vs_pytorch']:.1f}x | {r['weight_bytes'] / 1e6:.2f} MB | "
              f"{r['norm_us']:.2f} / {r['our_norm_us']:.2f} |")
    result = run_metadata(
        benchmark="bench_select",
        copy_bandwidth_TBps=bandwidth / 1e12,  # bytes read + written per second by a 1 GiB device copy
        timing=f"CUDA-graph replay of ROT consecutive calls, weights {args.weights}, hidden states {args.hidden} "
               "(behind a norm and for the norms alone: one buffer); median over replays / ROT",
        hidden_states=args.hidden,
        weights=args.weights,
        programmatic_dependent_launch=os.environ.get("BASE_MOE_PDL", "1") != "0",
        budget=BUDGET,
        cost="base",
        fill="backfill",
        rows=rows,
    )
    hot = "hot" in (args.hidden, args.weights)
    default = os.path.join(os.path.dirname(__file__), "results", "bench_select_hot.json" if hot else "bench_select.json")
    write_json(args.out or default, result)


if __name__ == "__main__":
    main()
