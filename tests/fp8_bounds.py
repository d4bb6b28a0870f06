"""Element-wise error bounds of FP8 quantization, used by the numerics tests."""

from __future__ import annotations

import torch

import fp8


def quantization_error_bound(x: torch.Tensor, scale: torch.Tensor, fmt) -> torch.Tensor:
    """Float64 bound on |dequantize(quantize(x)) - x| for values inside the clamp range.

    Normal values: relative error <= 2**-(m+1). Values in the subnormal range: absolute error
    <= half the subnormal spacing, min_normal * 2**-m / 2, divided by the scale.
    """
    fmt = fp8.get_format(fmt)
    x = x.detach().to(torch.float64)
    s = scale.to(torch.float64)
    return x.abs() * fmt.max_relative_error + fmt.min_normal * 2.0 ** -(fmt.mantissa_bits + 1) / s


def product_error_bound(a, ea, b, eb) -> torch.Tensor:
    """Bound on |a_hat @ b_hat - a @ b| given |a_hat - a| <= ea, |b_hat - b| <= eb (all float64)."""
    return ea @ (b.abs() + eb) + a.abs() @ eb
