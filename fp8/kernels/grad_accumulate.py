"""FP8 gradient accumulation: ``acc += new`` for an FP8 gradient, summed in fp32 and re-quantized
with the power-of-two scale of the sum (so micro-batches of very different magnitude cannot overflow).

This is what an in-place add into a :class:`fp8.Float8Tensor` gradient computes; the torch reference is
the CPU path and the oracle of the Triton kernels (:mod:`fp8.kernels.triton_grad_accumulate`).
"""

from __future__ import annotations

import torch

from ..cast import dequantize, payload_and_scale, quantize
from ..formats import get_format
from ..scaling import amax_of, compute_scale
from .backend import resolve_backend

__all__ = ["accumulate_fp8_grad", "accumulate_fp8_grad_reference", "accumulate_fp8_payload",
           "accumulate_fp8_payload_reference"]


def _value(new: torch.Tensor, new_scale: torch.Tensor | None) -> torch.Tensor:
    return new.to(torch.float32) if new_scale is None else dequantize(new, new_scale, torch.float32)


@torch.no_grad()
def accumulate_fp8_payload_reference(acc_payload: torch.Tensor, acc_scale: torch.Tensor, new: torch.Tensor,
                                     new_scale: torch.Tensor | None = None) -> None:
    """Torch reference of :func:`accumulate_fp8_payload` (same contract, same bits)."""
    fmt = get_format(acc_payload.dtype)
    total = dequantize(acc_payload, acc_scale, torch.float32) + _value(new, new_scale)
    scale = compute_scale(amax_of(total), fmt, previous=acc_scale)
    acc_payload.copy_(quantize(total, scale, fmt))
    acc_scale.copy_(scale)


@torch.no_grad()
def accumulate_fp8_payload(acc_payload: torch.Tensor, acc_scale: torch.Tensor, new: torch.Tensor,
                           new_scale: torch.Tensor | None = None, backend: str = "auto") -> None:
    """Add ``new`` into the FP8 gradient held as ``acc_payload`` (a float8 tensor) and its 0-d fp32
    ``acc_scale``, in place: ``new`` is a high-precision tensor (``new_scale`` None, e.g. a weight-gradient
    GEMM's fp32 output) or an FP8 payload with its scale. The sum is formed in fp32, its amax gives the new
    power-of-two scale (the previous one is kept for an amax of 0, inf or NaN), values are clamped to the
    format. The Triton path reads both inputs twice (amax, then cast) and writes the payload once; no host
    sync."""
    if acc_payload.shape != new.shape:
        raise ValueError(f"accumulate_fp8_grad: shapes differ, {tuple(acc_payload.shape)} vs {tuple(new.shape)}")
    if resolve_backend(backend, acc_payload, new) == "torch" or not acc_payload.is_contiguous():
        accumulate_fp8_payload_reference(acc_payload, acc_scale, new, new_scale)
        return
    from .triton_grad_accumulate import launch_accumulate

    launch_accumulate(acc_payload, acc_scale, new, new_scale)


def _parts(acc: torch.Tensor, new: torch.Tensor):
    acc_parts = payload_and_scale(acc)
    if acc_parts is None:
        raise TypeError("accumulate_fp8_grad: acc must be a Float8Tensor gradient; quantize it with fp8.to_float8")
    if acc.shape != new.shape:
        raise ValueError(f"accumulate_fp8_grad: shapes differ, {tuple(acc.shape)} vs {tuple(new.shape)}")
    return acc_parts, payload_and_scale(new) or (new, None)


def accumulate_fp8_grad_reference(acc: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`accumulate_fp8_grad` (same contract, same bits)."""
    (acc_payload, acc_scale), (new_data, new_scale) = _parts(acc, new)
    accumulate_fp8_payload_reference(acc_payload, acc_scale, new_data, new_scale)
    return acc


def accumulate_fp8_grad(acc: torch.Tensor, new: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """:func:`accumulate_fp8_payload` on FP8 values: add ``new`` (a high-precision tensor or a
    :class:`fp8.Float8Tensor`) into the FP8 gradient ``acc`` (a :class:`fp8.Float8Tensor`) in place and
    return ``acc``. FP8 values are taken by their payload and scale (:func:`fp8.cast.payload_and_scale`):
    this module does not import :mod:`fp8.tensor`, which imports it for ``acc += new``."""
    (acc_payload, acc_scale), (new_data, new_scale) = _parts(acc, new)
    accumulate_fp8_payload(acc_payload, acc_scale, new_data, new_scale, backend)
    return acc
