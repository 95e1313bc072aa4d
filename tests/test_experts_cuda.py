"""CUDA decode expert kernel (csrc/experts.cu) against the fp32 reference.

Accuracy rule (flash-attention's): against the reference on fp32-upcast inputs, the kernel's error (max abs and
relative Frobenius) is at most twice the error of the same computation done in plain PyTorch in the input dtype.
"""

import functools
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import base_moe
import base_moe.ops  # noqa: F401  (registers the fakes)
from base_moe import reference

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks", "micro"))
from sass_k_loop import find_cuobjdump  # noqa: E402

pytestmark = pytest.mark.cuda

QWEN3 = dict(H=2048, I=768, E=128, k=8)
SMALL = [dict(H=64, I=64, E=3, k=2), dict(H=320, I=192, E=10, k=3), dict(H=256, I=128, E=33, k=4),
         dict(H=128, I=64, E=24, k=12)]  # k > 8: the slot sum's 16-slot instance


@functools.cache
def build_has_sm90a() -> bool:
    """Whether this build of the op library carries sm_90a code (WS and the wgmma configurations need it), read from
    its cubins with cuobjdump (benchmarks/micro/sass_k_loop.py finds it). A build for other targets, e.g.
    ``TORCH_CUDA_ARCH_LIST="8.0+PTX"`` run on Hopper through the driver's JIT, runs the cp.async fallbacks there.
    Without cuobjdump the default build (sm_90a) is assumed, so that the WS tests fail rather than skip where they
    cannot tell."""
    tool = find_cuobjdump()
    if tool is None:
        return True
    listing = subprocess.run([tool, "--list-elf", base_moe._C.__file__], capture_output=True, text=True, check=True)
    return "sm_90a" in listing.stdout


def ws_runs() -> bool:
    """Whether the expert op's WS configuration runs here: an sm_90 device and a build with its sm_90a code (else
    forcing WS runs a cp.async configuration, with a warning)."""
    return torch.cuda.get_device_capability() == (9, 0) and build_has_sm90a()


needs_ws = pytest.mark.skipif(base_moe.cuda_available() and not ws_runs(),
                              reason="WS needs an sm_90 device and a build with sm_90a code")


def make_problem(T, H, I, E, k, dtype, *, used=None, drop=0.15, seed=0):
    """Random routing over a subset of ``used`` experts (the others get no token), with dropped slots."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    hidden = torch.randn(T, H, device=dev, generator=g).to(dtype)
    gate_up = (torch.randn(E, 2 * I, H, device=dev, generator=g) / H**0.5).to(dtype)
    down = (torch.randn(E, H, I, device=dev, generator=g) / I**0.5).to(dtype)
    used = E if used is None else used
    pool = torch.randperm(E, device=dev, generator=g)[:used]
    kk = min(k, used)
    pick = torch.rand(T, used, device=dev, generator=g).argsort(dim=1)[:, :kk]
    ids = torch.full((T, k), E, dtype=torch.int32, device=dev)
    ids[:, :kk] = pool[pick].to(torch.int32)
    w = torch.softmax(torch.randn(T, k, device=dev, generator=g), dim=-1)
    dropped = torch.rand(T, k, device=dev, generator=g) < drop
    ids = torch.where(dropped, E, ids).to(torch.int32)
    w = torch.where(ids == E, 0.0, w).float().contiguous()
    return hidden, ids.contiguous(), w, gate_up, down


def in_dtype(hidden, ids, w, gate_up, down):
    """The same computation in plain PyTorch, every intermediate in the input dtype."""
    E = gate_up.shape[0]
    out = torch.zeros_like(hidden)
    for u in torch.unique(ids[ids < E]).tolist():
        token, slot = torch.nonzero(ids == u, as_tuple=True)
        gate, up = (hidden[token] @ gate_up[u].T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ down[u].T
        out.index_add_(0, token, y * w[token, slot, None].to(hidden.dtype))
    return out


def errors(out, ref):
    d = (out.float() - ref).abs()
    return d.max().item(), (d.norm() / ref.norm().clamp_min(1e-30)).item()


def poison_allocator(nbytes=256 << 20, small_blocks=64):
    """Fill cached device memory with NaN so unwritten outputs or scratch reads show up: one large block (for
    buffers over 1 MB) and many 512 KB ones (the caching allocator's small pool serves the buffers below 1 MB)."""
    torch.cuda.empty_cache()
    junk = [torch.full((nbytes // 4,), float("nan"), device="cuda")]
    junk += [torch.full((128 << 10,), float("nan"), device="cuda") for _ in range(small_blocks)]
    del junk


def check_accuracy(T, shape, dtype, bound=None, **kw):
    """The op (with ``bound`` as its max_active_experts, if given) on a random problem against the reference."""
    return check_problem(*make_problem(T, dtype=dtype, **shape, **kw), bound)


def check_problem(hidden, ids, w, gate_up, down, bound=None):
    """The op on this problem against the reference (check_accuracy's rule)."""
    dtype, E = hidden.dtype, gate_up.shape[0]
    ref = reference.experts(hidden.float(), ids, w, gate_up.float(), down.float())
    poison_allocator()
    out = torch.ops.base_moe.experts(hidden, ids, w, gate_up, down, *([] if bound is None else [bound]))
    torch.cuda.synchronize()
    assert out.dtype == dtype and out.shape == hidden.shape
    assert torch.isfinite(out).all(), "unwritten (poisoned) or non-finite output"
    base = in_dtype(hidden, ids, w, gate_up, down)
    k_max, k_rel = errors(out, ref)
    b_max, b_rel = errors(base, ref)
    assert k_max <= 2 * b_max + 1e-6, (k_max, b_max)
    assert k_rel <= 2 * b_rel + 1e-6, (k_rel, b_rel)
    # tokens whose slots were all dropped are exactly zero
    empty = (ids == E).all(dim=1)
    assert (out[empty] == 0).all()
    return out


@pytest.mark.parametrize("T", [1, 3, 16, 64, 256, 1000])
@pytest.mark.parametrize("shape", SMALL, ids=lambda s: "H{H}_I{I}_E{E}_k{k}".format(**s))
def test_small_shapes(T, shape):
    check_accuracy(T, shape, torch.bfloat16, used=max(1, shape["E"] - 1))


@pytest.mark.parametrize("T", [1, 3, 16, 64, 256, 1000])
@pytest.mark.parametrize("used", [8, 16, 128])
def test_qwen3_shape(T, used):
    check_accuracy(T, QWEN3, torch.bfloat16, used=used, seed=T + used)


@pytest.mark.parametrize("T", [1, 16, 200])
@pytest.mark.parametrize("shape", [dict(H=512, I=256, E=16, k=4), dict(H=320, I=192, E=10, k=3)],
                         ids=lambda s: "H{H}_I{I}_E{E}_k{k}".format(**s))
def test_fp16(T, shape):
    check_accuracy(T, shape, torch.float16, used=min(12, shape["E"] - 1))


def run_forced(config, monkeypatch, fn):
    """``fn()`` with ``config`` forced (BASE_MOE_EXPERTS_CONFIG). A forced WS that cannot run falls back to a cp.async
    configuration with a warning, and the case would not test WS: so WS's cases skip where it cannot run and check
    that its GEMMs ran."""
    monkeypatch.setenv("BASE_MOE_EXPERTS_CONFIG", config)
    if config != "WS":
        fn()
        return
    if not ws_runs():
        pytest.skip("WS needs an sm_90 device and a build with sm_90a code")
    assert {gated for gated, _ in ws_kernels_ran(launched_kernels(fn))} == {"true", "false"}


@pytest.mark.parametrize("config", ["W64", "W128", "WS"])
def test_fp16_wgmma(config, monkeypatch):
    """The fp16 instances of the wgmma configurations (test_configs runs bf16)."""
    run_forced(config, monkeypatch, lambda: check_accuracy(100, dict(H=256, I=128, E=8, k=4), torch.float16, used=4))


def test_all_dropped_and_one_expert():
    shape = dict(H=128, I=64, E=4, k=2)
    hidden, ids, w, gate_up, down = make_problem(5, dtype=torch.bfloat16, **shape)
    ids.fill_(4)
    w.zero_()
    poison_allocator()
    out = torch.ops.base_moe.experts(hidden, ids, w, gate_up, down)
    assert (out == 0).all()
    check_accuracy(300, shape, torch.bfloat16, used=1, drop=0.0)  # one expert, 300 tokens: several passes


@pytest.mark.parametrize("config", ["default", "T16", "T32", "W64", "W128", "WS"])
@pytest.mark.parametrize("H", [256, 320])  # 320: the down GEMM's 64-row tiles
def test_out_of_range_ids_are_empty_slots(config, H, monkeypatch):
    """Expert ids outside [0, E] (-1, E + 5), which the CUDA op cannot refuse without a host sync, are empty slots:
    the same bits as the sentinel E in their place, whatever their weights (README says so; the CPU op raises)."""
    E = 8
    hidden, ids, w, gate_up, down = make_problem(100, dtype=torch.bfloat16, H=H, I=128, E=E, k=4, used=6, drop=0.0,
                                                 seed=5)
    g = torch.Generator(device="cuda").manual_seed(6)
    bad = torch.rand(ids.shape, device="cuda", generator=g) < 0.25
    wrong = torch.where(torch.rand(ids.shape, device="cuda", generator=g) < 0.5, -1, E + 5).to(torch.int32)

    def check():
        expected = torch.ops.base_moe.experts(hidden, torch.where(bad, E, ids).to(torch.int32), w, gate_up, down)
        poison_allocator()
        out = torch.ops.base_moe.experts(hidden, torch.where(bad, wrong, ids).to(torch.int32), w, gate_up, down)
        assert torch.equal(out, expected)

    if config == "default":
        check()
    else:
        run_forced(config, monkeypatch, check)


@pytest.mark.parametrize("config", ["T16", "T32", "W64", "W128", "WS"])
@pytest.mark.parametrize("T,shape,used", [(1, dict(H=320, I=192, E=10, k=3), 9), (70, dict(H=320, I=192, E=10, k=3), 2),
                                          (300, dict(H=128, I=64, E=4, k=2), 1), (40, QWEN3, 16)])
def test_configs(config, T, shape, used, monkeypatch):
    """Every tile configuration (forced; the default picks one by tokens per expert), with experts that need several
    passes."""
    run_forced(config, monkeypatch, lambda: check_accuracy(T, shape, torch.bfloat16, used=used, drop=0.1, seed=T))


@needs_ws
@pytest.mark.parametrize("T,H", [(601, 2560), (131, 4160)])
def test_ws_plan_in_batches(T, H, monkeypatch):
    """WS's plan kernel counts the ids in batches of 512 x 8 and copies a CTA's hidden rows in batches of 512 x 8
    16-byte chunks: more pairs (T k = 4808) and longer rows (H > 2048) than one batch of either, and a last plan CTA
    with fewer than its 16 pairs (T odd)."""
    monkeypatch.setenv("BASE_MOE_EXPERTS_CONFIG", "WS")
    names = launched_kernels(
        lambda: check_accuracy(T, dict(H=H, I=128, E=8, k=8), torch.bfloat16, used=8, drop=0.1, seed=H))
    assert ws_kernels_ran(names), names


@pytest.mark.parametrize("config", ["T16", "W128"])
def test_pass_splits_same_bits(config, monkeypatch):
    """Passes split over several CTAs give the bits of one CTA taking them in a row (one expert, 300 tokens: several
    passes under every configuration)."""
    monkeypatch.setenv("BASE_MOE_EXPERTS_CONFIG", config)
    hidden, ids, w, gate_up, down = make_problem(300, dtype=torch.bfloat16, H=128, I=64, E=4, k=2)
    ids[:, 0] = 1  # expert 1 gets every token, expert 2 every other one, the rest of the slots are dropped (E)
    ids[:, 1] = 4
    ids[::2, 1] = 2
    outs = []
    for splits in ("1", "3"):
        monkeypatch.setenv("BASE_MOE_EXPERTS_SPLITS", splits)
        outs.append(torch.ops.base_moe.experts(hidden, ids, w, gate_up, down))
    assert torch.equal(outs[0], outs[1])


def kernel_events(fn) -> list:
    """The profiler's events of the CUDA kernels that ``fn`` launches (on any GPU), one per launch."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        for device in range(torch.cuda.device_count()):
            torch.cuda.synchronize(device)
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def launched_kernels(fn) -> list[str]:
    """The names of the CUDA kernels that ``fn`` launches, one per launch, as the profiler records them."""
    return [e.name for e in kernel_events(fn)]


TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")


def assert_same_on_a_non_current_gpu(call, *tensors):
    """``call(*tensors)`` with its tensors on cuda:1 while cuda:0 is current runs every kernel on cuda:1 (the profiler
    says where each ran: a launcher that took the current device's stream or properties would launch on cuda:0, where
    peer access could still give the same bits) and gives the bits it gives on cuda:0. Both GPUs are of one kind."""
    outputs = []
    with torch.cuda.device(0):
        for device in ("cuda:0", "cuda:1"):
            moved = [None if t is None else t.to(device) for t in tensors]
            for device_index in range(2):
                torch.cuda.synchronize(device_index)  # the copies are done before the profiled call
            events = kernel_events(lambda: outputs.append(call(*moved)))
            ran_on = {e.device_index for e in events}
            assert ran_on == {int(device[-1])}, [(e.name, e.device_index) for e in events]
    on_0, on_1 = ([out] if isinstance(out, torch.Tensor) else list(out) for out in outputs)
    for a, b in zip(on_0, on_1):
        assert b.device == torch.device("cuda:1")
        assert torch.equal(a, b.to("cuda:0"))


def gate_up_tile_rows(fn):
    """The tile heights (the ROWS template argument) of the gate_up kernels that ``fn`` launches."""
    names = [n for n in launched_kernels(fn) if "expert_gemm_kernel" in n]
    rows = {int(m.group(1)) for n in names if (m := re.search(r"expert_gemm_kernel<[^,]+, true, (\d+),", n))}
    assert rows, names
    return rows


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,shape", [(16, QWEN3), (40, dict(H=320, I=192, E=10, k=3)),
                                     (9, dict(H=256, I=128, E=33, k=4))])
def test_gate_up_tile_heights_same_bits(T, shape, dtype, monkeypatch):
    """T16's gate_up tile heights (full, half: forced; the profiler confirms which kernel ran) compute every output
    element in the same order: the same bits, also past one wave (QWEN3: 3072 CTAs of half tiles)."""
    monkeypatch.setenv("BASE_MOE_EXPERTS_CONFIG", "T16")
    hidden, ids, w, gate_up, down = make_problem(T, dtype=dtype, **shape, seed=T)
    outs = []
    for tiles, rows in (("full", 128), ("half", 64)):
        monkeypatch.setenv("BASE_MOE_EXPERTS_GATE_UP_TILES", tiles)
        poison_allocator()
        ran = gate_up_tile_rows(lambda: outs.append(torch.ops.base_moe.experts(hidden, ids, w, gate_up, down)))
        assert ran == {rows}, (tiles, ran)
    assert torch.equal(outs[0], outs[1])
    check_accuracy(T, shape, dtype, drop=0.15, seed=T)  # under the half tiles (the last knob set)


@needs_ws
def test_ws_runs_its_kernels(monkeypatch):
    """BASE_MOE_EXPERTS_CONFIG=WS runs the warp-specialised kernels (the profiler sees them), not a cp.async fallback:
    the WS cases of the other tests test what they name."""
    monkeypatch.setenv("BASE_MOE_EXPERTS_CONFIG", "WS")
    hidden, ids, w, gate_up, down = make_problem(64, dtype=torch.bfloat16, **QWEN3, used=16, seed=3)
    names = launched_kernels(lambda: torch.ops.base_moe.experts(hidden, ids, w, gate_up, down))
    assert any("ws_gemm_kernel" in n for n in names) and not any("expert_gemm_kernel" in n for n in names), names


def ws_kernels_ran(names):
    """The WS GEMM instances among launched kernel names: {(gated "true" / "false", token columns N)}."""
    return {m.groups() for x in names if (m := re.search(r"ws_gemm_kernel<[^,]+, (true|false), (\d+)>", x))}


def ws_columns_picked(T, bound, shape):
    """csrc/experts.cu ws_columns_for, restated: WS's token columns per work item where the default picks WS, else 0.
    Only where WS runs (ws_runs), in batches of more than 64 tokens whose work items (active experts x weight tiles
    of 96 intermediates for gate_up, 128 rows for down) fill the last of the rounds of one persistent CTA per SM to at
    least 65%: 160 columns at 97-150 tokens per active expert; in batches of 256 or more also 64 at 32-56, 80 at 57-80
    and 128 at 81-96."""
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count

    def fill(items):
        return items / (-(-items // sms) * sms)

    active = min(bound, shape["E"], T * shape["k"])
    per_expert = T * shape["k"] // active
    round_fill = min(fill(active * -(-shape["I"] // 96)), fill(active * -(-shape["H"] // 128)))
    if not ws_runs() or T <= 64 or round_fill < 0.65:
        return 0
    if 96 < per_expert <= 150:
        return 160
    if T < 256 or not 32 <= per_expert <= 96:
        return 0
    return 64 if per_expert <= 56 else 80 if per_expert <= 80 else 128


@pytest.mark.parametrize("T,bound,I", [(256, 16, 768), (256, 14, 768), (256, 13, 768), (256, 18, 768),
                                       (256, 22, 768), (64, 4, 768), (256, 16, 1024), (256, 14, 1024),
                                       (512, 40, 768), (512, 48, 768), (512, 96, 768), (256, 48, 768), (512, 64, 1024),
                                       (256, 28, 768), (256, 32, 1024), (128, 16, 768), (256, 35, 768), (256, 36, 768),
                                       (256, 25, 768), (512, 51, 768), (512, 50, 768)])
def test_default_picks_ws_by_load(T, bound, I, monkeypatch):
    """By default WS runs exactly where pick_config's rule says, with the columns it says (on an H200: b256 with 14 or
    16 active experts of the Qwen3 shape at 160 columns, 22 (93 per expert) at 128, 28 at 80, 48 (42) at 64, not 13 or
    18, not b64 or b128/M16; with OLMoE's I = 1024 at 16, at 80 with 32, not 14; b512 at 160 with 40 active experts,
    128 with 48, 64 with 96; I = 1024 b512 at 80 with 64; at the rule's edges: b256 with 35 (58 per expert) at 80, 36
    (56) at 64, 25 (81) at 128; b512 with 51 (80) at 80, 50 (81) at 128), and its output is accurate there."""
    monkeypatch.delenv("BASE_MOE_EXPERTS_CONFIG", raising=False)
    monkeypatch.delenv("BASE_MOE_WS_N", raising=False)
    shape = dict(QWEN3, E=max(24, bound), I=I)
    names = launched_kernels(lambda: check_accuracy(T, shape, torch.bfloat16, bound, used=bound, seed=bound))
    columns = ws_columns_picked(T, bound, shape)
    assert ws_kernels_ran(names) == ({("true", str(columns)), ("false", str(columns))} if columns else set()), names
    assert any("expert_gemm_kernel" in n for n in names) == (not columns), names  # one path ran, not none


@needs_ws
@pytest.mark.parametrize("n", [64, 80, 128])
@pytest.mark.parametrize("T,used", [(256, 32), (256, 16), (512, 16), (37, 5)])
def test_ws_token_columns(n, T, used, monkeypatch):
    """WS with 64, 80 or 128 token columns per work item (forced by BASE_MOE_WS_N, the knob of benchmarks):
    accurate like every configuration (experts with more slots than n take several items: ~218 per expert at 512 x 8 /
    16, ~110 at 256 / 16), and both GEMMs' kernels of that n are what ran."""
    monkeypatch.setenv("BASE_MOE_EXPERTS_CONFIG", "WS")
    monkeypatch.setenv("BASE_MOE_WS_N", str(n))
    names = launched_kernels(lambda: check_accuracy(T, QWEN3, torch.bfloat16, used, used=used, seed=T + used))
    assert ws_kernels_ran(names) == {("true", str(n)), ("false", str(n))}, names


@needs_ws
def test_ws_item_columns(monkeypatch):
    """WS's default 160-column items with every kind of fill: experts whose slot counts lie around 128, 144 and 160
    (the widths of notes/ws_narrow_wgmma.patch's narrower wgmmas), one slot, and past 160 (a full item and the rest)."""
    monkeypatch.setenv("BASE_MOE_EXPERTS_CONFIG", "WS")
    monkeypatch.delenv("BASE_MOE_WS_N", raising=False)
    counts = torch.tensor([1, 127, 128, 129, 144, 145, 160, 161, 290], device="cuda")
    E, T = len(counts) + 1, int(counts.sum())  # the last expert gets no token
    hidden, _, _, gate_up, down = make_problem(T, H=256, I=128, E=E, k=1, dtype=torch.bfloat16, drop=0.0, seed=5)
    g = torch.Generator(device="cuda").manual_seed(6)
    experts = torch.repeat_interleave(torch.arange(len(counts), device="cuda"), counts)
    ids = experts[torch.randperm(T, device="cuda", generator=g)].to(torch.int32).view(T, 1)
    w = torch.rand(T, 1, device="cuda", generator=g)
    names = launched_kernels(lambda: check_problem(hidden, ids, w, gate_up, down))
    assert ws_kernels_ran(names) == {("true", "160"), ("false", "160")}, names


SMALL_SMEM_KIB = 99  # shared memory per CTA on sm_86 / sm_89 / sm_120 GPUs
# a cp.async expert GEMM instance's name: ROWS, NTW, WARPS, STAGES, WR, WG (GATED skipped)
GEMM_INSTANCE = re.compile(r"expert_gemm_kernel<[^,]+, (?:true|false), "
                           r"(\d+), (\d+), (\d+), (\d+), (\d+), (true|false)>")


def expert_gemm_smem(names):
    """The dynamic shared memory (bytes) of each cp.async expert GEMM launch among kernel names: csrc/experts.cu's
    GemmKernel::smem restated (the stages of weight rows and token columns, 128 bytes each; counts, active experts and
    their offsets for 512 experts; the pass's token list and weights; 1 KiB to align wgmma's swizzle)."""
    sizes = []
    for name in names:
        if m := GEMM_INSTANCE.search(name):
            rows, ntw, warps, stages, wr = map(int, m.groups()[:5])
            columns = warps // wr * ntw * 8
            wgmma_align = 1024 if m.group(6) == "true" else 0
            sizes.append(stages * (rows + columns) * 128 + (3 * 512 + 2 * columns) * 4 + wgmma_align)
    assert sizes, names
    return sizes


@pytest.mark.parametrize("config", ["T16", "T32", "W64", "W128"])
def test_small_shared_memory_fallbacks(config, monkeypatch):
    """With shared memory capped at 99 KiB per CTA (BASE_MOE_EXPERTS_SMEM_KIB, as on sm_86 / sm_89 / sm_120 GPUs) every
    configuration runs kernels that fit (T32 and W64 at fewer stages, W128 as W64, the 64-row down GEMM of an H that
    128 does not divide at 6 stages) and matches the reference; fewer stages give the same bits; and what fits
    uncapped runs unchanged (T16's 5 stages, 96 KiB)."""
    monkeypatch.setenv("BASE_MOE_EXPERTS_CONFIG", config)
    limit = SMALL_SMEM_KIB * 1024 - 128  # less the kernels' static shared memory (128 bytes: the aligned extern array)
    exceeded = False
    # the bound on active experts (used) keeps the grids within one wave, where the deepest rings run uncapped
    for T, shape, used, tiles in [(16, QWEN3, 8, "full"), (40, QWEN3, 16, None),
                                  (300, dict(H=320, I=192, E=10, k=3), 4, None)]:
        if tiles is None:
            monkeypatch.delenv("BASE_MOE_EXPERTS_GATE_UP_TILES", raising=False)
        else:
            monkeypatch.setenv("BASE_MOE_EXPERTS_GATE_UP_TILES", tiles)
        problem = make_problem(T, dtype=torch.bfloat16, **shape, used=used, seed=T)
        monkeypatch.delenv("BASE_MOE_EXPERTS_SMEM_KIB", raising=False)
        outs = []
        uncapped = expert_gemm_smem(launched_kernels(lambda: outs.append(torch.ops.base_moe.experts(*problem, used))))
        monkeypatch.setenv("BASE_MOE_EXPERTS_SMEM_KIB", str(SMALL_SMEM_KIB))
        capped = expert_gemm_smem(launched_kernels(lambda: outs.append(check_problem(*problem, used))))
        assert max(capped) <= limit, capped
        if max(uncapped) > limit:
            exceeded = True
        else:
            assert capped == uncapped
        if config != "W128":
            assert torch.equal(outs[0], outs[1])
    assert exceeded, "no case needed a fallback"


@pytest.mark.parametrize("name,value,config", [("BASE_MOE_EXPERTS_SPLITS", "two", None),
                                               ("BASE_MOE_EXPERTS_CONFIG", "W256", None),
                                               ("BASE_MOE_EXPERTS_GATE_UP_TILES", "tall", None),
                                               ("BASE_MOE_WS_N", "64abc", "WS"),
                                               ("BASE_MOE_EXPERTS_SMEM_KIB", "64", None)])
def test_malformed_knob_warns_and_is_ignored(name, value, config, monkeypatch, capfd):
    """A benchmark knob with a value the op cannot use is reported (c10's warning on stderr, once per process: no
    other test sets a malformed value) and ignored: the output is the default's (for BASE_MOE_WS_N under forced WS:
    WS at its 160 columns)."""
    monkeypatch.delenv(name, raising=False)
    if config is not None:
        monkeypatch.setenv("BASE_MOE_EXPERTS_CONFIG", config)
    hidden, ids, w, gate_up, down = make_problem(40, dtype=torch.bfloat16, H=128, I=64, E=4, k=2)
    expected = torch.ops.base_moe.experts(hidden, ids, w, gate_up, down)
    monkeypatch.setenv(name, value)
    capfd.readouterr()
    out = torch.ops.base_moe.experts(hidden, ids, w, gate_up, down)
    torch.cuda.synchronize()
    assert f"{name}={value} is not" in capfd.readouterr().err
    assert torch.equal(out, expected)


@pytest.mark.parametrize("config", ["default", "T16", "T32", "W64", "W128", "WS"])
@pytest.mark.parametrize("T,used,bound", [(16, 16, 16), (16, 16, 3), (16, 16, 1), (64, 40, 7), (5, 5, 100)])
def test_max_active_experts(config, T, used, bound, monkeypatch):
    """Under a forced configuration the bound on active experts sizes the grid only: any value, even below the true
    count, gives the same bits. By default it also picks the configuration, and the mma.sync (T16, T32) and wgmma
    (W64, W128) configurations add the products in different orders: the outputs agree to bf16 rounding."""
    if config != "default":
        monkeypatch.setenv("BASE_MOE_EXPERTS_CONFIG", config)
    hidden, ids, w, gate_up, down = make_problem(T, dtype=torch.bfloat16, **QWEN3, used=used, seed=T + bound)
    expected = torch.ops.base_moe.experts(hidden, ids, w, gate_up, down)
    poison_allocator()
    out = torch.ops.base_moe.experts(hidden, ids, w, gate_up, down, bound)
    if config == "default":
        torch.testing.assert_close(out, expected, rtol=2**-7, atol=2**-7 * expected.abs().max().item())
    else:
        assert torch.equal(out, expected)


@TWO_GPUS
@pytest.mark.parametrize("T,used", [(16, 16), (256, 16)])  # T16; WS on sm_90
def test_on_a_non_current_gpu(T, used):
    assert_same_on_a_non_current_gpu(lambda *a: torch.ops.base_moe.experts(*a, used),
                                     *make_problem(T, dtype=torch.bfloat16, **QWEN3, used=used, seed=T))


def test_deterministic():
    hidden, ids, w, gate_up, down = make_problem(256, dtype=torch.bfloat16, **QWEN3, used=16)
    first = torch.ops.base_moe.experts(hidden, ids, w, gate_up, down)
    for _ in range(3):
        poison_allocator()
        assert torch.equal(torch.ops.base_moe.experts(hidden, ids, w, gate_up, down), first)


@pytest.mark.parametrize("config", ["default", "WS"])
@pytest.mark.parametrize("T", [1, 16, 100])
def test_cuda_graph_replay(T, config, monkeypatch):
    if config != "default":
        monkeypatch.setenv("BASE_MOE_EXPERTS_CONFIG", config)
    shape = dict(H=512, I=256, E=16, k=4)
    static = make_problem(T, dtype=torch.bfloat16, **shape, used=10, seed=1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.base_moe.experts(*static)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.base_moe.experts(*static)
    for seed in (2, 3):
        fresh = make_problem(T, dtype=torch.bfloat16, **shape, used=6, seed=seed)
        for dst, src in zip(static[:3], fresh[:3]):  # new hidden, ids, weights; same expert weights
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, torch.ops.base_moe.experts(*static))


def test_opcheck():
    args = make_problem(7, dtype=torch.bfloat16, H=128, I=64, E=5, k=2)
    torch.library.opcheck(torch.ops.base_moe.experts.default, args)


_SHAPE_ERRORS = """
import torch, base_moe.ops
from tests.test_experts_cuda import make_problem


def expect_rejected(args, message, what):
    try:
        torch.ops.base_moe.experts(*args)
    except RuntimeError as e:
        assert message in str(e), e
    else:
        raise AssertionError(what + " accepted")


expect_rejected(make_problem(2, dtype=torch.bfloat16, H=96, I=64, E=3, k=2), "multiple of 64", "H=96")
expect_rejected(make_problem(2, dtype=torch.bfloat16, H=64, I=0, E=3, k=2), "positive multiple of 64", "I=0")
fp32 = [a.float() if a.is_floating_point() else a for a in make_problem(2, dtype=torch.bfloat16, H=64, I=64, E=3, k=2)]
expect_rejected(fp32, "bfloat16 or float16", "float32")
print("ok")
"""


def run_in_fresh_process(script, **env):
    """Runs ``script`` in a new Python process (the repository importable, ``env`` added to the environment): its
    return code, stdout and stderr."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), **env)
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc.returncode, proc.stdout, proc.stderr


def test_shape_errors():
    """Clear errors for unsupported shapes and dtypes. Run in a subprocess: on the device (torch 2.11) a failing
    TORCH_CHECK in base_moe._C has crashed the process, which must not take the test session down."""
    rc, out, err = run_in_fresh_process(_SHAPE_ERRORS)
    assert rc == 0 and "ok" in out, (rc, out[-2000:], err[-2000:])


_CAPTURE_FIRST = """
import torch, base_moe.ops
from tests.test_experts_cuda import make_problem

problem = make_problem(100, dtype=torch.bfloat16, H=256, I=128, E=8, k=4, used=4)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):  # the process's first expert-op call
    out = torch.ops.base_moe.experts(*problem)
graph.replay()
assert torch.equal(out, torch.ops.base_moe.experts(*problem)), "the graph and the eager call differ"
print("ok")
"""


@needs_ws
def test_ws_in_a_graph_captured_first():
    """WS forced, in a process whose first expert-op call is captured in a CUDA graph: the capture runs WS as eager
    calls do (ws_available asks the device during capture too), so the graph and an eager call give the same bits and
    nothing falls back to a cp.async configuration."""
    rc, out, err = run_in_fresh_process(_CAPTURE_FIRST, BASE_MOE_EXPERTS_CONFIG="WS")
    assert rc == 0 and "ok" in out, (rc, out[-2000:], err[-2000:])
    assert "unavailable" not in err, err[-2000:]
