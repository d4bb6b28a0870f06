"""Triton kernels of gradient accumulation (imports Triton): stage 1 max-reduces the fp32 sum's amax, stage 2
recomputes the sum and writes it with the new scale: FP8 (the sum's current scale, clamped) or FP16 (the buffer's
scale rule, :func:`fp8.kernels.grad_accumulate.fp16_accumulation_scale`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import get_format
from ..scaling import compute_scale, fp16_accumulation_scale
from .triton_formats import decode_to_f32, encode_f32, format_code, payload_view

__all__ = ["launch_accumulate", "launch_accumulate_fp16"]

_BLOCK = 1024


@triton.jit
def _sum(acc_ptr, acc_scale_ptr, new_ptr, new_scale_ptr, offs, mask, ACC_FMT: tl.constexpr, NEW_FMT: tl.constexpr):
    a = decode_to_f32(tl.load(acc_ptr + offs, mask=mask, other=0), ACC_FMT) * (1.0 / tl.load(acc_scale_ptr))
    b = decode_to_f32(tl.load(new_ptr + offs, mask=mask, other=0), NEW_FMT) * (1.0 / tl.load(new_scale_ptr))
    return a + b


@triton.jit
def _amax_kernel(acc_ptr, acc_scale_ptr, new_ptr, new_scale_ptr, amax_ptr, nan_ptr, numel,
                 ACC_FMT: tl.constexpr, NEW_FMT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # 64-bit: numel may pass 2**31
    mask = offs < numel
    s = _sum(acc_ptr, acc_scale_ptr, new_ptr, new_scale_ptr, offs, mask, ACC_FMT, NEW_FMT)
    is_nan = s != s
    tl.atomic_max(amax_ptr, tl.max(tl.where(mask & (~is_nan), tl.abs(s), 0.0), axis=0))
    tl.atomic_max(nan_ptr, tl.max(tl.where(mask & is_nan, 1, 0), axis=0))


@triton.jit
def _cast_kernel(acc_ptr, acc_scale_ptr, new_ptr, new_scale_ptr, out_scale_ptr, numel, FMAX: tl.constexpr,
                 ACC_FMT: tl.constexpr, NEW_FMT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # 64-bit: numel may pass 2**31
    mask = offs < numel
    s = _sum(acc_ptr, acc_scale_ptr, new_ptr, new_scale_ptr, offs, mask, ACC_FMT, NEW_FMT)
    y = s * tl.load(out_scale_ptr)
    y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -FMAX), FMAX))  # clamp, NaN stays NaN (as torch.clamp)
    tl.store(acc_ptr + offs, encode_f32(y, ACC_FMT), mask=mask)


def launch_accumulate(acc_payload: torch.Tensor, acc_scale: torch.Tensor, new: torch.Tensor,
                      new_scale: torch.Tensor | None) -> None:
    """``acc += new`` in place with the two kernels (see :func:`fp8.kernels.accumulate_fp8_payload`):
    ``new`` is a high-precision tensor (``new_scale`` None) or an FP8 payload with its scale."""
    if new_scale is None:
        new_data, new_scale = new.detach().contiguous(), torch.ones((), dtype=torch.float32, device=new.device)
    else:
        new_data = new.contiguous()
    fmt = get_format(acc_payload.dtype)
    acc_data = payload_view(acc_payload)
    numel = acc_data.numel()
    amax = torch.zeros((), dtype=torch.float32, device=acc_data.device)
    has_nan = torch.zeros((), dtype=torch.int32, device=acc_data.device)
    grid = (max(1, triton.cdiv(numel, _BLOCK)),)
    flags = dict(ACC_FMT=format_code(acc_payload.dtype), NEW_FMT=format_code(new_data.dtype), BLOCK=_BLOCK)
    _amax_kernel[grid](acc_data, acc_scale, payload_view(new_data), new_scale, amax, has_nan, numel, **flags)
    amax = torch.where(has_nan > 0, torch.full_like(amax, float("nan")), amax)
    scale = compute_scale(amax, fmt, previous=acc_scale)
    # Stage 2 reads the old payload and scale: the new scale is written only after it.
    _cast_kernel[grid](acc_data, acc_scale, payload_view(new_data), new_scale, scale, numel,
                       FMAX=fmt.max, **flags)
    acc_scale.copy_(scale)


@triton.jit
def _fp16_amax_kernel(acc_ptr, acc_scale_ptr, new_ptr, new_scale_ptr, sum_amax_ptr, acc_amax_ptr, numel,
                      NEW_FMT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # 64-bit: numel may pass 2**31
    mask = offs < numel
    a = tl.load(acc_ptr + offs, mask=mask, other=0).to(tl.float32)
    s = _sum(acc_ptr, acc_scale_ptr, new_ptr, new_scale_ptr, offs, mask, 2, NEW_FMT)
    finite_s = mask & (tl.abs(s) < float("inf"))  # NaN compares false: finite values only
    finite_a = mask & (tl.abs(a) < float("inf"))
    tl.atomic_max(sum_amax_ptr, tl.max(tl.where(finite_s, tl.abs(s), 0.0), axis=0))
    tl.atomic_max(acc_amax_ptr, tl.max(tl.where(finite_a, tl.abs(a), 0.0), axis=0))


@triton.jit
def _fp16_write_kernel(acc_ptr, acc_scale_ptr, new_ptr, new_scale_ptr, out_scale_ptr, numel, NEW_FMT: tl.constexpr,
                       BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    s = _sum(acc_ptr, acc_scale_ptr, new_ptr, new_scale_ptr, offs, mask, 2, NEW_FMT)
    tl.store(acc_ptr + offs, (s * tl.load(out_scale_ptr)).to(tl.float16), mask=mask)  # fits by the scale's choice


def launch_accumulate_fp16(acc_payload: torch.Tensor, acc_scale: torch.Tensor, new: torch.Tensor,
                           new_scale: torch.Tensor | None) -> None:
    """``acc += new`` into an FP16 buffer in place with the two kernels (see
    :func:`fp8.kernels.accumulate_fp16_payload`): ``new`` is a high-precision tensor (``new_scale`` None) or a
    scaled payload with its scale."""
    if new_scale is None:
        new_data, new_scale = new.detach().contiguous(), torch.ones((), dtype=torch.float32, device=new.device)
    else:
        new_data = new.contiguous()
    numel = acc_payload.numel()
    sum_amax = torch.zeros((), dtype=torch.float32, device=acc_payload.device)
    acc_amax = torch.zeros((), dtype=torch.float32, device=acc_payload.device)
    grid = (max(1, triton.cdiv(numel, _BLOCK)),)
    flags = dict(NEW_FMT=format_code(new_data.dtype), BLOCK=_BLOCK)
    new_view = payload_view(new_data)
    _fp16_amax_kernel[grid](acc_payload, acc_scale, new_view, new_scale, sum_amax, acc_amax, numel, **flags)
    scale = fp16_accumulation_scale(sum_amax, acc_amax, acc_scale)
    # Stage 2 reads the old payload and scale: the new scale is written only after it.
    _fp16_write_kernel[grid](acc_payload, acc_scale, new_view, new_scale, scale, numel, **flags)
    acc_scale.copy_(scale)
