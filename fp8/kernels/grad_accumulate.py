"""FP8 gradient accumulation: ``acc += new`` for an FP8 gradient, summed in fp32 and re-quantized
with the power-of-two scale of the sum (so micro-batches of very different magnitude cannot overflow).

This is what an in-place add into a :class:`fp8.Float8Tensor` gradient computes; the torch reference is
the CPU path and the oracle of the Triton kernels (:mod:`fp8.kernels.triton_grad_accumulate`).
"""

from __future__ import annotations

import torch

from ..cast import quantize
from ..scaling import amax_of, compute_scale
from ..tensor import Float8Tensor
from .backend import resolve_backend

__all__ = ["accumulate_fp8_grad", "accumulate_fp8_grad_reference"]


def _value(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize(torch.float32) if isinstance(t, Float8Tensor) else t.to(torch.float32)


@torch.no_grad()
def accumulate_fp8_grad_reference(acc: Float8Tensor, new: torch.Tensor) -> Float8Tensor:
    """Torch reference of :func:`accumulate_fp8_grad` (same contract, same bits)."""
    total = acc.dequantize(torch.float32) + _value(new)
    scale = compute_scale(amax_of(total), acc.format, previous=acc.scale)
    acc.payload.copy_(quantize(total, scale, acc.format))
    acc.scale.copy_(scale)
    return acc


@torch.no_grad()
def accumulate_fp8_grad(acc: Float8Tensor, new: torch.Tensor, backend: str = "auto") -> Float8Tensor:
    """Add ``new`` (a high-precision tensor, e.g. a weight-gradient GEMM's fp32 output, or a
    :class:`Float8Tensor`) into the FP8 gradient ``acc`` in place and return ``acc``: the sum is formed
    in fp32, its amax gives the new power-of-two scale (the previous one is kept for an amax of 0, inf or
    NaN), values are clamped to the format. The Triton path reads both inputs twice (amax, then cast)
    and writes the payload once; no host sync."""
    if not isinstance(acc, Float8Tensor):
        raise TypeError("accumulate_fp8_grad: acc must be a Float8Tensor gradient; quantize it with fp8.to_float8")
    if acc.shape != new.shape:
        raise ValueError(f"accumulate_fp8_grad: shapes differ, {tuple(acc.shape)} vs {tuple(new.shape)}")
    if resolve_backend(backend, acc.payload, new) == "torch" or not acc.payload.is_contiguous():
        return accumulate_fp8_grad_reference(acc, new)
    from .triton_grad_accumulate import launch_accumulate

    launch_accumulate(acc, new)
    return acc
