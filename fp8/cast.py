"""Cast kernels: quantize, dequantize and fused quantize+transpose (plain-torch reference).

This reference runs on every device and is the oracle for faster kernels. Values are always
clamped to the format's finite range before the cast: CPU and GPU casts treat overflow
differently (saturate vs. inf), so clamping makes both agree. NaN stays NaN.
"""

from __future__ import annotations

import torch

from .formats import FP8Format, get_format

__all__ = ["quantize", "dequantize", "quantize_transpose", "payload_and_scale"]


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format | str) -> torch.Tensor:
    """FP8 payload of ``x * scale`` (computed in fp32, clamped to +-fmt.max, rounded to nearest)."""
    fmt = get_format(fmt)
    scaled = x.to(torch.float32) * scale.to(torch.float32)
    return scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)


def dequantize(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """High-precision value ``data / scale`` of an FP8 payload, in ``dtype`` (exact in fp32)."""
    return (data.to(torch.float32) * scale.to(torch.float32).reciprocal()).to(dtype)


def quantize_transpose(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 payload of a 2-D ``x`` and its transpose, both row-major (contiguous).

    The transpose is taken of the FP8 payload, so both hold bit-identical values.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_transpose expects a 2-D tensor, got shape {tuple(x.shape)}")
    data = quantize(x, scale, fmt).contiguous()
    return data, data.t().contiguous()


def payload_and_scale(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(payload, scale)`` of an FP8 value (a :class:`fp8.Float8Tensor`), None for a plain tensor.

    Modules below :mod:`fp8.tensor` (the GEMM, the kernels) take FP8 values through this, by their
    ``payload`` and ``scale``, so they never import the tensor class (it imports them).
    """
    payload, scale = getattr(t, "payload", None), getattr(t, "scale", None)
    if isinstance(payload, torch.Tensor) and isinstance(scale, torch.Tensor):
        return payload, scale
    return None
