"""CUDA rms_norm and add_rms_norm against base_moe.reference, and the selection kernel that starts while they run.

The kernel adds the fp32 squares in another order than torch, so its output may differ from torch's in the last places;
as in flash-attention's tests, its error against a float64 computation must stay within twice the error of torch's
same-dtype computation (the reference, run on the GPU), and in 16-bit dtypes few outputs may differ from torch's at
all, by at most two units in the last place. ``python tests/test_norm_cuda.py sanitize`` runs a few
calls (norm, then select_experts launched behind it) for compute-sanitizer.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from base_moe import Cost, Fill, Routing, Scoring, ops, reference
from test_experts_cuda import TWO_GPUS, assert_same_on_a_non_current_gpu

pytestmark = pytest.mark.cuda
DEVICE = os.environ.get("BASE_MOE_TEST_DEVICE", "cuda")

SHAPES = [(1, 1), (1, 7), (3, 64), (16, 2048), (64, 2880), (7, 7168), (300, 1000), (2, 4097)]


def random_inputs(T: int, H: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # rows of very different scales: the mean of squares spans many binades
    scale = torch.exp(torch.randn(T, 1, generator=gen) * 2.0)
    hidden = (torch.randn(T, H, generator=gen) * scale).to(DEVICE, dtype)
    weight = (torch.rand(H, generator=gen) * 1.5 + 0.25).to(DEVICE, dtype)
    return hidden, weight


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def exact_rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = hidden.double()
    return weight.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,H", SHAPES)
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm_error_within_twice_torchs(dtype, T, H, eps):
    hidden, weight = random_inputs(T, H, dtype, seed=T * 7919 + H)
    out = ops.rms_norm(hidden, weight, eps)
    assert out.dtype == dtype and out.shape == (T, H) and out.device == hidden.device
    exact = exact_rms_norm(hidden, weight, eps)
    torch_error = (reference.rms_norm(hidden, weight, eps).double() - exact).abs().max().item()
    our_error = (out.double() - exact).abs().max().item()
    assert our_error <= 2 * torch_error + 1e-6 * exact.abs().max().item(), (our_error, torch_error)
    if dtype != torch.float32:  # HF's two roundings to the dtype, as torch: only a rare flip of the last bit
        expected = reference.rms_norm(hidden, weight, eps).float()
        differs = out.float() != expected
        assert differs.float().mean().item() <= 0.01
        ulp = torch.finfo(dtype).eps * expected.abs().clamp_min(torch.finfo(dtype).tiny)
        assert ((out.float() - expected).abs() <= 2 * ulp).all()
    assert torch.equal(out, ops.rms_norm(hidden, weight, eps))  # deterministic


def test_rms_norm_zero_rows_and_empty_batch():
    hidden, weight = random_inputs(4, 256, torch.bfloat16, seed=1)
    hidden[2] = 0
    out = ops.rms_norm(hidden, weight, 1e-6)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert ops.rms_norm(hidden[:0], weight, 1e-6).shape == (0, 256)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("H", [2048, 1000])
def test_rms_norm_same_bits_whatever_the_alignment(dtype, H):
    """Rows that are not 16-byte aligned take the kernel's element-wise path, which adds the squares in the same order
    as its 16-byte path: the same bits for the same values."""
    T = 5
    hidden, weight = random_inputs(T, H, dtype, seed=H + 11)
    shifted_hidden = torch.empty(T * H + 1, device=hidden.device, dtype=dtype)[1:].view(T, H)
    shifted_weight = torch.empty(H + 1, device=hidden.device, dtype=dtype)[1:]
    shifted_hidden.copy_(hidden)
    shifted_weight.copy_(weight)
    assert shifted_hidden.data_ptr() % 16 != 0 and shifted_weight.data_ptr() % 16 != 0
    want = ops.rms_norm(hidden, weight, 1e-6)
    assert torch.equal(ops.rms_norm(shifted_hidden, weight, 1e-6), want)
    assert torch.equal(ops.rms_norm(hidden, shifted_weight, 1e-6), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,H", SHAPES)
def test_add_rms_norm_is_torchs_add_then_our_norm(dtype, T, H):
    """The sum is torch's residual + hidden bit for bit, and the norm of it rms_norm's bit for bit (same kernel, same
    order), whichever load path the alignment picks."""
    hidden, weight = random_inputs(T, H, dtype, seed=T * 31 + H)
    residual, _ = random_inputs(T, H, dtype, seed=T * 37 + H + 1)
    normed, total = ops.add_rms_norm(hidden, residual, weight, 1e-6)
    assert torch.equal(total, residual + hidden)
    assert torch.equal(normed, ops.rms_norm(total, weight, 1e-6))
    shifted = torch.empty(T * H + 1, device=hidden.device, dtype=dtype)[1:].view(T, H)
    shifted.copy_(residual)
    again, again_total = ops.add_rms_norm(hidden, shifted, weight, 1e-6)
    assert torch.equal(again, normed) and torch.equal(again_total, total)


@TWO_GPUS
def test_norms_on_a_non_current_gpu():
    hidden, weight = random_inputs(16, 2048, torch.bfloat16, seed=3)
    residual, _ = random_inputs(16, 2048, torch.bfloat16, seed=4)
    assert_same_on_a_non_current_gpu(lambda x, w: ops.rms_norm(x, w, 1e-6), hidden, weight)
    assert_same_on_a_non_current_gpu(lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-6), hidden, residual, weight)


def norm_then_select(hidden, weight, Wr, Wp, bp, residual=None):
    """The decode order: the norm (of residual + hidden, with a residual), then select_experts launched behind it
    (PDL), on the norm's output. A sleep kernel first holds the GPU until both are queued, so that they run back to
    back as in a decode step (launched from an idle GPU, the norm would finish before the host had launched the
    selection)."""
    routing = Routing(8, Scoring.SOFTMAX, renormalize=True)
    if DEVICE == "cuda":
        torch.cuda._sleep(2_000_000)  # ~1 ms
    if residual is None:
        normed = ops.rms_norm(hidden, weight, 1e-6)
    else:
        normed, _ = ops.add_rms_norm(hidden, residual, weight, 1e-6)
    out = ops.select_experts(normed, Wr, routing, budget=16, num_groups=1, cost=Cost.BASE, fill=Fill.BACKFILL,
                             predictor_weight=Wp, predictor_bias=bp)
    return normed, out


@pytest.mark.parametrize("with_residual", [False, True])
def test_select_experts_behind_the_norm_reads_its_finished_output(with_residual):
    """select_experts starts while the norm runs; what it computes must be what it computes on the norm's output
    once the norm has finished, for inputs that change every call. A smoke test: the guarantee is the kernels'
    structure (select_experts touches only its weights before its griddepcontrol.wait, which waits for the whole
    norm grid), and the window in which an early read could happen is the norm's last CTAs."""
    H, E = 2048, 128
    gen = torch.Generator().manual_seed(5)
    Wr = (torch.randn(E, H, generator=gen) / H**0.5).to(DEVICE, torch.bfloat16)
    Wp = (torch.randn(E, H, generator=gen) / H**0.5).to(DEVICE, torch.bfloat16)
    bp = torch.randn(E, generator=gen).to(DEVICE)
    for T in (1, 4, 16, 64):
        inputs = [random_inputs(T, H, torch.bfloat16, seed=100 * T + i) for i in range(20)]
        for hidden, weight in inputs:
            residual = torch.randn_like(hidden) if with_residual else None
            normed, fused = norm_then_select(hidden, weight, Wr, Wp, bp, residual)
            synchronize()
            again = ops.select_experts(normed.clone(), Wr, Routing(8, Scoring.SOFTMAX, renormalize=True), budget=16,
                                       num_groups=1, cost=Cost.BASE, fill=Fill.BACKFILL, predictor_weight=Wp,
                                       predictor_bias=bp)
            for got, want in zip(fused, again):
                assert torch.equal(got, want)


def sanitize() -> None:
    """A few calls of the norm, alone and with select_experts behind it, for compute-sanitizer."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for T, H in ((1, 7), (5, 2048), (3, 4097)):
            hidden, weight = random_inputs(T, H, dtype, seed=T + H)
            ops.rms_norm(hidden, weight, 1e-6)
            ops.add_rms_norm(hidden, torch.randn_like(hidden), weight, 1e-6)
    H, E = 2048, 128
    Wr = (torch.randn(E, H) / H**0.5).to(DEVICE, torch.bfloat16)
    Wp = (torch.randn(E, H) / H**0.5).to(DEVICE, torch.bfloat16)
    bp = torch.randn(E).to(DEVICE)
    for T in (1, 16):
        hidden, weight = random_inputs(T, H, torch.bfloat16, seed=T)
        norm_then_select(hidden, weight, Wr, Wp, bp)
        norm_then_select(hidden, weight, Wr, Wp, bp, residual=torch.randn_like(hidden))
    synchronize()
    print("sanitize: done")


if __name__ == "__main__":
    if sys.argv[1:] == ["sanitize"]:
        os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")  # each tensor its own allocation, for memcheck
        sanitize()
    else:
        sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
