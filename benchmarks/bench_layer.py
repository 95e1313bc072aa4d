"""One MoE layer at decode: base_moe's expert op, the whole BASE layer and HF's grouped_mm experts.

Qwen3-30B-A3B (H=2048, E=128, k=8, I=768) and OLMoE-1B-7B (H=2048, E=64, k=8, I=1024) layers, bf16, batch in
{1, 4, 16, 64, 256}, dense random softmax routing and budgets M in {8, 16, 32, 64}. Budgets are applied to the
expert op and to HF by restricting the random routing to M random experts (every token's top-k among them),
and M is passed to our op as its bound on active experts (``max_active_experts``), as the BASE layer does; the
BASE layer runs its own selection (``select_experts`` with budget M, or M = E when dense) on random router and
predictor weights. Times: median of CUDA-graph replays, each graph holding several calls that rotate among copies of
the layer's expert, router and predictor weights so the L2 (50 MiB on the H100 and H200) never holds them (each call
streams more than 50 MiB of experts: at least 8 of 9.4 MB for Qwen3); a device-to-device copy measured
in the same run gives the bandwidth ceiling (2 x bytes / time).
The BASE layer is timed as consecutive layers (each selection follows the previous layer's slot sum, whose
end its programmatic dependent launch may overlap), and behind the decoder layer's RMSNorm as in decode
((norm + layer) - norm: a plain PyTorch kernel that lets nothing overlap it); "after our norm" puts
``base_moe.ops.rms_norm`` there instead, whose kernel lets the selection start while it runs, and still subtracts
torch's norm alone, so that a slower norm counts against it (and a faster one for it: the row also has both norms
alone, and ``base_layer_behind_our_norm_us``, (our norm + layer) - our norm, the layer's own cost behind our norm).

    python3 benchmarks/bench_layer.py [--out benchmarks/results/bench_layer.json]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import zlib

import torch
import torch.nn.functional as F
from common import copy_bandwidth, graph_time_us, median, names_from, require_cuda, run_metadata, write_json

import base_moe.ops  # noqa: F401

MODELS = {
    "qwen3-30b-a3b": dict(H=2048, E=128, k=8, I=768, renormalize=True),
    "olmoe-1b-7b": dict(H=2048, E=64, k=8, I=1024, renormalize=False),
}
BATCHES = [1, 4, 16, 64, 256]
BUDGETS = [None, 8, 16, 32, 64]
# DESIGN section 8: vLLM fused_moe on the same kind of H200 (Qwen3 layer), microseconds
VLLM_US = {(1, None): 36.6, (16, None): 194.0, (64, None): 292.0, (16, 16): 60.3, (64, 16): 81.2,
           (256, 16): 153.0, (64, 32): 123.0}
COPIES = 3  # expert weight copies (3 x 1.2 GB for Qwen3)
CALLS_PER_COPY = 4


def rounded(us):
    """A time for the progress lines: one decimal, or None where it was not measured."""
    return us if us is None else round(us, 1)


def time_graph(calls, reps=25):
    """Median microseconds per call: one graph runs CALLS_PER_COPY rounds over `calls` (one per weight copy)."""
    return median(graph_time_us(calls, reps, rounds=CALLS_PER_COPY))


def point_generator(name, T, M):
    """A generator seeded by the measurement point, so every section of a run (and every run) draws the same
    routing and hidden states for the same (model, T, M): how many experts need a second pass depends on the draw."""
    return torch.Generator(device="cuda").manual_seed(zlib.crc32(f"{name}/{T}/{M}".encode()))


def draw_point(name, cfg, T, M):
    """The inputs of a measurement point, drawn from its own generator: hidden [T, H] bf16, random routing (ids,
    weights) restricted to M experts, and the number of experts the routing uses."""
    point = point_generator(name, T, M)
    x = torch.randn(T, cfg["H"], device="cuda", generator=point).to(torch.bfloat16)
    ids, w = random_routing(T, cfg["E"], cfg["k"], M, cfg["renormalize"], point)
    return x, ids, w, int(torch.unique(ids[ids < cfg["E"]]).numel())


def expert_weights(cfg, gen):
    """gate_up_proj [E, 2I, H] and down_proj [E, H, I], bf16, scaled so every output has about unit variance."""
    E, H, I = cfg["E"], cfg["H"], cfg["I"]
    gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * H**-0.5).to(torch.bfloat16)
    down = (torch.randn(E, H, I, device="cuda", generator=gen) * I**-0.5).to(torch.bfloat16)
    return gate_up, down


def router_weights(cfg, gen):
    """Router and predictor weights [E, H] bf16 (random: speed only) and a zero predictor bias [E] fp32."""
    E, H = cfg["E"], cfg["H"]
    router = (torch.randn(E, H, device="cuda", generator=gen) * H**-0.5).to(torch.bfloat16)
    predictor = (torch.randn(E, H, device="cuda", generator=gen) * 0.1 * H**-0.5).to(torch.bfloat16)
    return router, predictor, torch.zeros(E, device="cuda")


def select_experts(x, cfg, router, predictor, predictor_bias, budget):
    """The BASE selection (softmax routing, BASE cost, backfill) with budget M -> ids, weights; the logits rounded to
    bf16, as both models' linear routers return them (what the HF integration passes)."""
    # (the schema's order: ... num_groups 1, top_k, scoring SOFTMAX, renormalize, n_group 1, topk_group 1, scaling 1,
    # cost BASE, budget, fill BACKFILL, voting None, round_logits True)
    return torch.ops.base_moe.select_experts(x, router, None, predictor, predictor_bias, None, 1, cfg["k"], 0,
                                             cfg["renormalize"], 1, 1, 1.0, 0, budget, 0, None, True)[2:4]


def expert_op_us(x, ids, w, copies, M):
    """Median microseconds of the expert op, M passed as its bound on active experts (as the BASE layer does)."""
    return time_graph([lambda gu=gu, dp=dp: torch.ops.base_moe.experts(x, ids, w, gu, dp, M) for gu, dp in copies])


def random_routing(T, E, k, budget, renormalize, gen):
    """ids [T, k] int32, weights [T, k] fp32: softmax routing, restricted to `budget` random experts."""
    logits = torch.randn(T, E, device="cuda", generator=gen)
    if budget is not None and budget < E:
        keep = torch.randperm(E, device="cuda", generator=gen)[:budget]
        mask = torch.full((E,), float("-inf"), device="cuda")
        mask[keep] = 0.0
        logits = logits + mask
    p = torch.softmax(logits, dim=-1)
    w, ids = torch.topk(p, k, dim=-1)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids.to(torch.int32).contiguous(), w.float().contiguous()


def hf_experts_modules(cfg, copies):
    """HF's Qwen3-MoE experts module with the grouped_mm implementation, one per weight copy."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    conf = Qwen3MoeConfig(hidden_size=cfg["H"], moe_intermediate_size=cfg["I"], num_experts=cfg["E"],
                          num_experts_per_tok=cfg["k"], hidden_act="silu")
    conf._experts_implementation = "grouped_mm"
    mods = []
    for gu, dp in copies:
        with torch.device("meta"):
            mod = Qwen3MoeExperts(conf)
        mod.gate_up_proj = torch.nn.Parameter(gu, requires_grad=False)
        mod.down_proj = torch.nn.Parameter(dp, requires_grad=False)
        mods.append(mod)
    return mods


VARIANT_KNOBS = ("BASE_MOE_EXPERTS_CONFIG", "BASE_MOE_EXPERTS_PDL", "BASE_MOE_EXPERTS_GATE_UP_TILES", "BASE_MOE_WS_N")
GATE_UP_TILES = ("full", "half")
CONFIGS = ("T16", "T32", "W64", "W128", "WS")
WS_COLUMNS = ("64", "80", "128", "160")


def variant_knobs(var):
    """The expert op's benchmark knobs for a variant: "default", or parts joined by "+": a configuration name
    (T16, T32, W64, W128, WS at pick_config's token columns per work item; WS-64, -80, -128, -160 at those),
    "nopdl", or a gate_up tile height (full, half; csrc/experts.cu launch_pair)."""
    knobs = {}
    for part in var.split("+"):
        if part == "nopdl":
            knobs["BASE_MOE_EXPERTS_PDL"] = "0"
        elif part in GATE_UP_TILES:
            knobs["BASE_MOE_EXPERTS_GATE_UP_TILES"] = part
        elif part in CONFIGS:
            knobs["BASE_MOE_EXPERTS_CONFIG"] = part
        elif part.startswith("WS-") and part[3:] in WS_COLUMNS:
            knobs.update(BASE_MOE_EXPERTS_CONFIG="WS", BASE_MOE_WS_N=part[3:])
        elif part != "default":
            raise ValueError(f"variant {var!r}: unknown part {part!r}")
    return knobs


@contextlib.contextmanager
def variant(var):
    """The environment with the variant's knobs (the others cleared), then the user's own settings again: the rows
    after the variants, and the JSON's record of the knobs, keep what the user set."""
    knobs = variant_knobs(var)  # a bad name raises before the environment changes
    saved = {knob: os.environ.get(knob) for knob in VARIANT_KNOBS}
    for knob in VARIANT_KNOBS:
        os.environ.pop(knob, None)
    os.environ.update(knobs)
    try:
        yield
    finally:
        for knob, value in saved.items():
            if value is None:
                os.environ.pop(knob, None)
            else:
                os.environ[knob] = value


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/bench_layer.json")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-variants", action="store_true")
    ap.add_argument("--variants-only", action="store_true", help="only the Qwen3 configuration variants")
    ap.add_argument("--variants", default="default,T16,T32,W64,W128,nopdl")
    ap.add_argument("--variant-points", choices=["acceptance", "all"], default="acceptance",
                    help="time the variants on the acceptance points of issue 8, or on every (batch, budget)")
    args = ap.parse_args()
    models = names_from(args.models, MODELS, "--models")
    if args.variants_only and (args.no_variants or "qwen3-30b-a3b" not in models):
        ap.error("--variants-only times the Qwen3 configuration variants alone: it needs qwen3-30b-a3b in --models "
                 "and no --no-variants (as given, nothing would be timed)")
    for var in args.variants.split(","):  # a bad variant fails here, not after every model's rows
        try:
            variant_knobs(var)
        except ValueError as err:
            ap.error(str(err))
    require_cuda("bench_layer.py")
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_bw = copy_bandwidth()
    selection = "base_moe CUDA select_experts (router_predict, then route_select)"
    print(f"device {torch.cuda.get_device_name()}; copy bandwidth {copy_bw / 1e12:.2f} TB/s (the % below; the final "
          "table divides by the faster of this and a copy at the end)")
    print("budget rows: expert op and HF use random routing restricted to M random experts; "
          "the BASE layer selects with its own kernels (budget M)")
    rows, variants = [], []
    for name in models:
        cfg = MODELS[name]
        E = cfg["E"]
        expert_bytes = 3 * cfg["H"] * cfg["I"] * 2
        copies = [expert_weights(cfg, gen) for _ in range(COPIES)]
        routers = [router_weights(cfg, gen) for _ in copies]  # each copy of the layer has its own (cold in L2)
        layers = list(zip(copies, routers))
        norm_weight = torch.ones(cfg["H"], device="cuda", dtype=torch.bfloat16)
        hf = None
        if not args.no_hf:
            try:
                hf = hf_experts_modules(cfg, copies)
            except Exception as exc:  # report, don't die
                print(f"HF grouped_mm experts unavailable: {exc!r}")
        for T in ([] if args.variants_only else BATCHES):
            for M in BUDGETS:
                x, ids, w, active = draw_point(name, cfg, T, M)
                ours = expert_op_us(x, ids, w, copies, M)
                budget = E if M is None else M

                def select(router, h=x):
                    return select_experts(h, cfg, *router, budget)

                def layer(gu, dp, router, h=x):
                    return torch.ops.base_moe.experts(h, *select(router, h), gu, dp, M)

                def norm():  # the decoder layer's norm just before the MoE block
                    return F.rms_norm(x, (cfg["H"],), norm_weight, 1e-6)

                def our_norm():  # base_moe's: the selection after it may start while it runs
                    return torch.ops.base_moe.rms_norm(x, norm_weight, 1e-6)

                base_us = base_norm_us = base_our_norm_us = base_active = norm_us = our_norm_us = None
                try:  # the selection ops are developed elsewhere: report a failure, keep the expert-op numbers
                    base_us = time_graph([lambda gu=gu, dp=dp, r=r: layer(gu, dp, r) for (gu, dp), r in layers])
                    sid = select(routers[0])[0]
                    base_active = int(torch.unique(sid[sid < E]).numel())
                    norm_us = time_graph([norm for _ in copies])
                    base_norm_us = time_graph([lambda gu=gu, dp=dp, r=r: layer(gu, dp, r, norm())
                                               for (gu, dp), r in layers]) - norm_us
                    our_norm_us = time_graph([our_norm for _ in copies])
                    base_our_norm_us = time_graph([lambda gu=gu, dp=dp, r=r: layer(gu, dp, r, our_norm())
                                                   for (gu, dp), r in layers]) - norm_us
                except Exception as exc:
                    print(f"BASE layer failed at T={T} M={M}: {exc!r}")
                hf_us = None
                if hf is not None:
                    ids64, w_bf16 = ids.long(), w.to(torch.bfloat16)  # HF's block gets them so: not timed
                    try:
                        with torch.no_grad():
                            hf_us = time_graph([lambda m=m: m(x, ids64, w_bf16) for m in hf])
                    except Exception as exc:
                        print(f"HF grouped_mm failed at T={T}: {exc!r}")
                        hf = None
                bw = active * expert_bytes / (ours * 1e-6)
                row = dict(model=name, batch=T, budget=M, active=active, ours_us=ours, ours_bw_TBps=bw / 1e12,
                           ours_frac_copy=bw / copy_bw, base_layer_us=base_us, base_layer_after_norm_us=base_norm_us,
                           base_layer_after_our_norm_us=base_our_norm_us,
                           base_layer_behind_our_norm_us=(None if base_our_norm_us is None else
                                                          base_our_norm_us + norm_us - our_norm_us),
                           norm_us=norm_us, our_norm_us=our_norm_us, base_layer_active=base_active,
                           hf_grouped_mm_us=hf_us, floor_us=active * expert_bytes / copy_bw * 1e6,
                           vllm_us=VLLM_US.get((T, M)) if name == "qwen3-30b-a3b" else None)
                rows.append(row)
                print(f"{name:14s} T={T:4d} M={str(M):4s} active={active:3d} ours={ours:7.1f}us "
                      f"({bw / 1e12:4.2f} TB/s, {100 * bw / copy_bw:3.0f}% copy) base_layer={rounded(base_us)}us "
                      f"(after a norm {rounded(base_norm_us)}us, after our norm {rounded(base_our_norm_us)}us, "
                      f"|A|={base_active}) hf={rounded(hf_us)} "
                      f"vllm={row['vllm_us']}", flush=True)
        if name == "qwen3-30b-a3b" and not args.no_variants:
            # tile configurations and PDL, on the acceptance points of issue 8 or on every (batch, budget)
            points = ([(1, None), (16, None), (16, 16), (64, 16), (64, 32), (64, None), (256, 16), (256, None)]
                      if args.variant_points == "acceptance" else [(T, M) for T in BATCHES for M in BUDGETS])
            for T, M in points:
                x, ids, w, active = draw_point(name, cfg, T, M)
                res = {}
                for var in args.variants.split(","):
                    with variant(var):
                        res[var] = expert_op_us(x, ids, w, copies, M)
                variants.append(dict(batch=T, budget=M, active=active, us=res))
                print(f"variants T={T:4d} M={str(M):4s} active={active:3d} " +
                      " ".join(f"{key}={val:6.1f}" for key, val in res.items()), flush=True)
        del copies, routers, layers, hf  # (layers holds the copies too)
        torch.cuda.empty_cache()

    # the copy again at the end, the faster of the two for every fraction (the conservative choice)
    copy_start, copy_end = copy_bw, copy_bandwidth()
    copy_bw = max(copy_start, copy_end)
    for r in rows:
        r["floor_us"] *= copy_start / copy_bw
        r["ours_frac_copy"] = r["ours_bw_TBps"] * 1e12 / copy_bw
    print(f"\ncopy bandwidth {copy_start / 1e12:.2f} TB/s at the start, {copy_end / 1e12:.2f} at the end: % of "
          f"{copy_bw / 1e12:.2f}")
    print("\nmodel           batch budget active  ours_us  %copy  base_layer_us  after_norm_us  hf_grouped_mm_us  "
          "vllm_us  after_our_norm_us")
    for r in rows:
        print(f"{r['model']:15s} {r['batch']:5d} {str(r['budget']):6s} {r['active']:6d} {r['ours_us']:8.1f} "
              f"{100 * r['ours_frac_copy']:5.0f}% {(r['base_layer_us'] or float('nan')):13.1f} "
              f"{(r['base_layer_after_norm_us'] or float('nan')):13.1f} "
              f"{(r['hf_grouped_mm_us'] or float('nan')):17.1f} {r['vllm_us'] or float('nan'):8.1f} "
              f"{(r['base_layer_after_our_norm_us'] or float('nan')):17.1f}")
    result = run_metadata(copy_bandwidth_TBps=copy_bw / 1e12, copy_bandwidth_start_end_TBps=[copy_start / 1e12,
                                                                                              copy_end / 1e12],
                          selection=selection,
                          rotated_weights="expert, router and predictor weights: one set per copy, "
                                          f"{COPIES} copies",
                          budget_method="expert op and HF: random softmax routing restricted to M random experts; "
                                        "BASE layer: its own selection with budget M on random router/predictor "
                                        "weights",
                          vllm_source="DESIGN.md section 8: vLLM fused_moe timed by the project's brief on an "
                                      "H200 on its own random routing, not in this run",
                          rows=rows, variants=variants)
    write_json(args.out, result)


if __name__ == "__main__":
    main()
