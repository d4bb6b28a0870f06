"""Quantize / dequantize / quantize+transpose against a float64 reference."""

from __future__ import annotations

import pytest
import torch

import fp8
from fp8.scaling import amax_of, compute_scale
from tests.fp8_bounds import quantization_error_bound


def _fresh(gen, shape=(128, 96), spread=4.0):
    """Random values spanning several orders of magnitude, no zeros."""
    mag = torch.exp(torch.empty(shape, dtype=torch.float64).uniform_(-spread, spread, generator=gen))
    sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.float64) * 2 - 1
    return (mag * sign).to(torch.float32)


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
def test_round_trip_error_bound(fmt, gen):
    x = _fresh(gen)
    scale = compute_scale(amax_of(x), fmt)
    back = fp8.dequantize(fp8.quantize(x, scale, fmt), scale).to(torch.float64)
    err = (back - x.to(torch.float64)).abs()
    bound = quantization_error_bound(x, scale, fmt)
    assert torch.all(err <= bound), f"max excess {(err - bound).max().item()}"
    # Values in the normal range have relative error <= 2**-(m+1), and that bound is reached in practice.
    normal = x.abs().to(torch.float64) * scale >= fmt.min_normal
    rel = err[normal] / x.abs().to(torch.float64)[normal]
    assert rel.max() <= fmt.max_relative_error
    assert rel.max() > fmt.max_relative_error / 2


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
def test_payload_dtype_and_exact_dequantize(fmt, gen):
    x = _fresh(gen, (32, 32))
    scale = compute_scale(amax_of(x), fmt)
    q = fp8.quantize(x, scale, fmt)
    assert q.dtype == fmt.dtype and q.element_size() == 1
    # Power-of-two scale: dequantization is exact in fp32 (equal to the float64 value).
    exact = q.to(torch.float64) / scale.to(torch.float64)
    assert torch.equal(fp8.dequantize(q, scale).to(torch.float64), exact)


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
def test_overflow_saturates_and_nan_propagates(fmt):
    x = torch.tensor([fmt.max * 4, -fmt.max * 4, float("inf"), -float("inf"), float("nan"), 1.0])
    q = fp8.quantize(x, torch.tensor(1.0), fmt).to(torch.float32)
    assert q[:4].tolist() == [fmt.max, -fmt.max, fmt.max, -fmt.max]
    assert torch.isnan(q[4]) and q[5] == 1.0


def test_quantize_transpose_is_bitwise_transpose(gen):
    x = _fresh(gen, (48, 80))
    scale = compute_scale(amax_of(x), "e5m2")
    data, data_t = fp8.quantize_transpose(x, scale, "e5m2")
    assert data.is_contiguous() and data_t.is_contiguous() and data_t.shape == (80, 48)
    assert torch.equal(data_t.view(torch.uint8), data.t().contiguous().view(torch.uint8))
    assert torch.equal(data.view(torch.uint8), fp8.quantize(x, scale, "e5m2").view(torch.uint8))
    with pytest.raises(ValueError, match="2-D"):
        fp8.quantize_transpose(x.reshape(-1), scale, "e5m2")
