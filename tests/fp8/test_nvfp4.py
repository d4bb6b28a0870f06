"""NVFP4 numerics (issue 33, :mod:`fp8.nvfp4`): E2M1 rounding and packing, the two-level scales against float64 within
the analysis bound, stochastic rounding unbiased over many seeds, the random Hadamard transform orthogonal and exact
on the weight-gradient product, and the NVFP4 ``F.scaled_mm`` call layout against torch's ``meta`` kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8.microscaling import swizzle, swizzled_numel
from fp8.fp4 import (E2M1_VALUES, dequantize_nvfp4, hadamard_transform, nvfp4_call_problem, pack_e2m1,
                       quantize_nvfp4, random_hadamard, round_e2m1, unpack_e2m1)

SEEDS = range(6)


def test_round_to_nearest_keeps_the_grid_and_breaks_ties_to_even():
    grid = torch.tensor(E2M1_VALUES)
    values = torch.cat([grid, -grid])  # -0.0 decodes as 0.0
    assert torch.equal(unpack_e2m1(pack_e2m1(round_e2m1(values[None]))), values[None])
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0])  # the neighbour with an even code (mantissa 0)
    assert torch.equal(unpack_e2m1(pack_e2m1(round_e2m1(midpoints[None])))[0], want)
    assert torch.equal(unpack_e2m1(pack_e2m1(round_e2m1(torch.tensor([[7.0, -100.0]]))))[0], torch.tensor([6.0, -6.0]))


def test_packing_puts_the_even_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 3, 15]], dtype=torch.uint8)
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.float4_e2m1fn_x2 and packed.shape == (1, 2)
    assert packed.view(torch.uint8).tolist() == [[0x21, 0xF3]]
    assert unpack_e2m1(packed).tolist() == [[0.5, 1.0, 1.5, -6.0]]


def _bound(x64: torch.Tensor, q) -> torch.Tensor:
    """Per-element error bound: E2M1 rounds a scaled value by at most a quarter of its magnitude (one mantissa bit)
    at or above 1, by at most 0.25 below it (the 0.5 step), in units of the block's decode factor; block scales are
    rounded up, so nothing saturates past 6."""
    br, bc = q.block
    inv = q.scale_inv().double().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    return torch.maximum(0.25 * x64.abs(), 0.25 * inv) * (1 + 1e-9)


@pytest.mark.parametrize("block", [(1, 16), (16, 16), (16, 1)], ids=["1x16", "16x16", "16x1"])
@pytest.mark.parametrize("seed", SEEDS)
def test_nvfp4_error_within_the_analysis_bound(seed, block):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 128, generator=gen) * torch.exp2(torch.randint(-10, 6, (1, 128), generator=gen).float())
    x[:, 3] *= 500.0  # an outlier channel
    q = quantize_nvfp4(x, block)
    assert (unpack_e2m1(q.data).abs() <= 6).all()
    decode = q.scale_inv().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    assert ((x.abs() / decode).nan_to_num(0.0) <= 6.0).all()  # block scales rounded up: no value saturates
    assert q.data.shape == (64, 64) and q.block_scales.dtype == torch.float8_e4m3fn
    assert q.block_scales.shape == (64 // block[0], 128 // block[1])
    g = q.global_scale_inv.reciprocal()
    assert torch.equal(torch.exp2(torch.log2(g).round()), g)  # the per-tensor factor is a power of two
    x64 = x.double()
    got = dequantize_nvfp4(q, torch.float64)
    assert ((got - x64).abs() <= _bound(x64, q)).all()


def test_a_non_finite_value_poisons_its_block_only():
    x = torch.randn(16, 32)
    x[0, 0] = float("inf")
    out = dequantize_nvfp4(quantize_nvfp4(x))
    assert out[0, :16].isnan().all() and torch.isfinite(out[0, 16:]).all() and torch.isfinite(out[1:]).all()


def test_stochastic_rounding_is_unbiased_over_many_seeds():
    """The mean of 4,000 stochastic roundings of values across the E2M1 range equals the value within 6 standard
    errors of the mean (a rounding's variance is at most step**2 / 4, the widest step is 2); round to nearest keeps
    its bias (the same value every time)."""
    x = torch.linspace(0.05, 5.95, 64)[None] * torch.tensor([1.0, -1.0]).repeat(32)[None]
    n = 4000
    total = torch.zeros(64, dtype=torch.float64)
    for seed in range(n):
        total += unpack_e2m1(pack_e2m1(round_e2m1(x, True, torch.Generator().manual_seed(seed))))[0].double()
    mean_error = (total / n - x[0].double()).abs()
    assert (mean_error <= 6 * (2.0 / 2) / n**0.5).all(), mean_error.max()
    nearest_error = (unpack_e2m1(pack_e2m1(round_e2m1(x)))[0] - x[0]).abs()
    assert nearest_error.max() > 10 * mean_error.max()


def test_random_hadamard_is_orthogonal_and_keeps_the_weight_gradient_product():
    gen = torch.Generator().manual_seed(0)
    signs = torch.randint(0, 2, (16,), generator=gen) * 2 - 1
    h = random_hadamard(signs, torch.float64)
    assert torch.allclose(h @ h.t(), torch.eye(16, dtype=torch.float64), atol=1e-15)
    dy, x = torch.randn(64, 24, generator=gen, dtype=torch.float64), torch.randn(64, 40, generator=gen,
                                                                                  dtype=torch.float64)
    got = hadamard_transform(dy, h, 0).t() @ hadamard_transform(x, h, 0)
    assert torch.allclose(got, dy.t() @ x, atol=1e-12)
    with pytest.raises(ValueError, match="groups of 16"):
        hadamard_transform(torch.zeros(20, 3), h, 0)


def test_nvfp4_call_layout_meets_the_meta_kernel():
    m, k, n = 96, 64, 48
    a = torch.empty(m, k // 2, dtype=torch.float4_e2m1fn_x2, device="meta")
    b = torch.empty(n, k // 2, dtype=torch.float4_e2m1fn_x2, device="meta").t()
    sa = torch.empty(swizzled_numel(m, k // 16), dtype=torch.float8_e4m3fn, device="meta")
    sb = torch.empty(swizzled_numel(n, k // 16), dtype=torch.float8_e4m3fn, device="meta")
    one = torch.ones((), device="meta")
    assert nvfp4_call_problem(a, b, sa, sb, "cuda", (10, 0)) is None
    assert "Blackwell" in nvfp4_call_problem(a, b, sa, sb, "cuda", (9, 0))
    recipes = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    swizzles = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
    out = F.scaled_mm(a, b, [sa, one], recipes, [sb, one], recipes, swizzles, swizzles, output_dtype=torch.bfloat16)
    assert out.shape == (m, n)
    short = sa[: m * k // 16]  # unswizzled count: refused by both
    assert "swizzled" in nvfp4_call_problem(a, b, short, sb, "cuda", (10, 0))
    with pytest.raises(RuntimeError):
        F.scaled_mm(a, b, [short, one], recipes, [sb, one], recipes, swizzles, swizzles, output_dtype=torch.bfloat16)


def test_the_swizzled_nvfp4_scales_come_from_the_block_grid():
    gen = torch.Generator().manual_seed(3)
    q = quantize_nvfp4(torch.randn(40, 64, generator=gen))
    flat = swizzle(q.block_scales.view(torch.uint8)).view(torch.float8_e4m3fn)
    assert flat.numel() == swizzled_numel(40, 4) and flat.dtype == torch.float8_e4m3fn
