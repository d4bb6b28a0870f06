"""Gradient accumulation into a scaled low-precision buffer: ``acc += new``, summed in fp32 and written back
with a power-of-two scale chosen on the device from the sum, so micro-batches of very different magnitude
cannot overflow.

- FP8 (:func:`accumulate_fp8_payload`): the sum re-quantized with its own current scale (what an in-place add
  into a :class:`fp8.Float8Tensor` gradient computes).
- FP16 (:func:`accumulate_fp16_payload`): the buffer keeps its scale (:func:`fp16_accumulation_scale`) unless
  the sum would overflow it, so each micro-batch adds one FP16 rounding of the sum (what an in-place add into
  an :class:`fp8.ScaledFloat16Tensor` gradient computes).

The torch references are the CPU path and the oracle of the Triton kernels
(:mod:`fp8.kernels.triton_grad_accumulate`).
"""

from __future__ import annotations

import torch

from ..cast import dequantize, payload_and_scale, quantize
from ..formats import get_format
from ..scaling import FP16_HEADROOM_BITS, FP16_MAX, amax_of, compute_scale, finite_amax, fp16_accumulation_scale
from .backend import resolve_backend

__all__ = ["accumulate_fp8_grad", "accumulate_fp8_grad_reference", "accumulate_fp8_payload",
           "accumulate_fp8_payload_reference", "accumulate_fp16_payload", "accumulate_fp16_payload_reference",
           "fp16_accumulation_scale", "finite_amax", "FP16_MAX", "FP16_HEADROOM_BITS"]

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
    _accumulate("accumulate_fp8_grad", accumulate_fp8_payload_reference, "launch_accumulate", acc_payload, acc_scale,
                new, new_scale, backend)


def _accumulate(name: str, reference, launcher: str, acc_payload: torch.Tensor, acc_scale: torch.Tensor,
                new: torch.Tensor, new_scale: torch.Tensor | None, backend: str) -> None:
    """``reference(...)`` on the torch backend or a non-contiguous buffer, else the Triton ``launcher`` of
    :mod:`fp8.kernels.triton_grad_accumulate` (imported here: Triton is optional)."""
    if acc_payload.shape != new.shape:
        raise ValueError(f"{name}: shapes differ, {tuple(acc_payload.shape)} vs {tuple(new.shape)}")
    if resolve_backend(backend, acc_payload, new) == "torch" or not acc_payload.is_contiguous():
        reference(acc_payload, acc_scale, new, new_scale)
        return
    from . import triton_grad_accumulate

    getattr(triton_grad_accumulate, launcher)(acc_payload, acc_scale, new, new_scale)


@torch.no_grad()
def accumulate_fp16_payload_reference(acc_payload: torch.Tensor, acc_scale: torch.Tensor, new: torch.Tensor,
                                      new_scale: torch.Tensor | None = None) -> None:
    """Torch reference of :func:`accumulate_fp16_payload` (same contract, same bits)."""
    acc = dequantize(acc_payload, acc_scale, torch.float32)
    total = acc + _value(new, new_scale)
    scale = fp16_accumulation_scale(finite_amax(total), finite_amax(acc_payload), acc_scale)
    acc_payload.copy_((total * scale).to(torch.float16))  # finite values fit by the choice of scale; inf/NaN kept
    acc_scale.copy_(scale)


@torch.no_grad()
def accumulate_fp16_payload(acc_payload: torch.Tensor, acc_scale: torch.Tensor, new: torch.Tensor,
                            new_scale: torch.Tensor | None = None, backend: str = "auto") -> None:
    """Add ``new`` into the FP16 gradient buffer ``acc_payload`` (float16) with its 0-d fp32 power-of-two
    ``acc_scale`` (value ``acc_payload / acc_scale``), in place: ``new`` is a high-precision tensor
    (``new_scale`` None) or a scaled payload (FP16 or FP8) with its scale. The sum is formed in fp32 and written
    with :func:`fp16_accumulation_scale` (computed on device before the write, so nothing overflows; a rescale
    is by a power of two, exact). Non-finite values of the sum are written as they are (the optimizer's finite
    check skips the step) and leave the scale alone. The Triton path reads both inputs twice (amaxes, then the
    write) and writes the payload once; no host sync."""
    if acc_payload.dtype != torch.float16:
        raise TypeError(f"accumulate_fp16_payload: the buffer must be float16, got {acc_payload.dtype}")
    _accumulate("accumulate_fp16_payload", accumulate_fp16_payload_reference, "launch_accumulate_fp16", acc_payload,
                acc_scale, new, new_scale, backend)


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
