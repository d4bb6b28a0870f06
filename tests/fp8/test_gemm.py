"""FP8 GEMM: torch._scaled_mm vs the emulated path (bit-exact on CPU), float64 reference, GPU rules."""

from __future__ import annotations


import pytest
import torch

import fp8
from tests.fp8_bounds import product_error_bound, quantization_error_bound


def _operands(gen, m, k, n, fa="e4m3", fb="e4m3"):
    a = torch.randn(m, k, generator=gen) * 2.5
    b = torch.randn(n, k, generator=gen) * 0.3  # weight-like, stored (N, K) row-major
    return a, b, fp8.to_float8(a, fa), fp8.to_float8(b, fb).t()  # b operand: (K, N) column-major


@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")])
@pytest.mark.parametrize("shape", [(64, 32, 48), (16, 128, 16), (35, 64, 32)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_and_emulation_agree_bit_for_bit(gen, fmts, shape, out_dtype):
    m, k, n = shape
    _, _, a8, b8 = _operands(gen, m, k, n, *fmts)
    hw = fp8.fp8_mm(a8, b8, out_dtype=out_dtype, backend="scaled_mm")
    emu = fp8.fp8_mm(a8, b8, out_dtype=out_dtype, backend="emulated")
    assert hw.dtype == emu.dtype == out_dtype and hw.shape == (m, n)
    assert torch.equal(hw, emu)


@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e5m2", "e4m3")])
def test_against_float64_reference(gen, fmts):
    a, b, a8, b8 = _operands(gen, 64, 96, 32, *fmts)
    out = fp8.fp8_mm(a8, b8).to(torch.float64)
    a64, b64 = a.to(torch.float64), b.t().to(torch.float64)
    exact = a64 @ b64
    bound = product_error_bound(
        a64, quantization_error_bound(a, a8.scale, fmts[0]), b64, quantization_error_bound(b, b8.scale, fmts[1]).t()
    )
    accumulation = 96 * 2**-23 * (a64.abs() @ b64.abs())
    assert torch.all((out - exact).abs() <= bound + accumulation)
    assert (out - exact).norm() / exact.norm() < 0.08


def test_gpu_rules_enforced_on_every_device(gen):
    _, _, a8, b8 = _operands(gen, 32, 24, 32)  # K = 24: not a multiple of 16
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.fp8_mm(a8, b8, backend="scaled_mm")
    assert torch.equal(fp8.fp8_mm(a8, b8, backend="auto"), fp8.fp8_mm(a8, b8, backend="emulated"))
    _, _, a8, b8 = _operands(gen, 32, 32, 32, "e5m2", "e5m2")
    with pytest.raises(ValueError, match="E5M2"):
        fp8.fp8_mm(a8, b8, backend="scaled_mm")


def test_auto_takes_the_bit_identical_emulation_on_cpu(gen, monkeypatch):
    """torch 2.13's CPU _scaled_mm is a reference loop (measured 300-1,300x slower): "auto" emulates on the CPU,
    "scaled_mm" still runs it."""
    _, _, a8, b8 = _operands(gen, 32, 32, 48)
    expected = fp8.fp8_mm(a8, b8, backend="scaled_mm")
    calls = []
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert torch.equal(fp8.fp8_mm(a8, b8, backend="auto"), expected) and not calls
    fp8.fp8_mm(a8, b8, backend="scaled_mm")
    assert calls == [1]


def test_layout_is_fixed_for_the_hardware_path(gen):
    _, _, a8, b8 = _operands(gen, 32, 32, 48)
    b_row_major = fp8.Float8Tensor(b8.payload.contiguous(), b8.scale)  # same values, wrong layout
    assert torch.equal(fp8.fp8_mm(a8, b_row_major, backend="scaled_mm"), fp8.fp8_mm(a8, b8, backend="scaled_mm"))


def test_bad_arguments(gen):
    _, _, a8, b8 = _operands(gen, 32, 32, 32)
    with pytest.raises(TypeError, match="Float8Tensor"):
        fp8.fp8_mm(a8, b8.dequantize())
    with pytest.raises(ValueError, match="cannot multiply"):
        fp8.fp8_mm(a8, a8[:16])
    with pytest.raises(ValueError, match="backend"):
        fp8.fp8_mm(a8, b8, backend="cublas")
