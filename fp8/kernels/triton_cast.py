"""Triton kernels for the FP8 cast: one pass writing the cast, its transpose and the amax (imports Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_formats import decode_to_f32, encode_f32, format_code, payload_view

__all__ = ["launch_cast_transpose_amax", "launch_amax_unless"]

_FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def _cast_transpose_amax_kernel(
    x_ptr, scale_ptr, data_ptr, data_t_ptr, amax_ptr, nonfinite_ptr, M, N, stride_m, stride_n,
    IN_FMT: tl.constexpr, OUT_FMT: tl.constexpr, FMAX: tl.constexpr, TRANSPOSE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # 64-bit rows/cols: rows * stride_m, rows * N and cols * M pass 2**31 for tensors over 2**31 elements.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    raw = tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_n, mask=mask, other=0)
    x = decode_to_f32(raw, IN_FMT)
    finite = tl.abs(x) <= 3.4028234663852886e38
    scale = tl.load(scale_ptr)
    y = tl.minimum(tl.maximum(x * scale, -FMAX), FMAX)
    y = tl.where(finite, y, float("nan"))  # inf/NaN inputs are carried as NaN (0x7F), never saturated
    bits = encode_f32(y, OUT_FMT)
    tl.store(data_ptr + rows[:, None] * N + cols[None, :], bits, mask=mask)
    if TRANSPOSE:
        tl.store(data_t_ptr + cols[None, :] * M + rows[:, None], bits, mask=mask)
    block_amax = tl.max(tl.max(tl.where(finite & mask, tl.abs(x), 0.0), axis=1), axis=0)
    tl.atomic_max(amax_ptr, block_amax)
    block_bad = tl.max(tl.max(tl.where(finite | (~mask), 0, 1), axis=1), axis=0)
    tl.atomic_max(nonfinite_ptr, block_bad)


@triton.jit
def _amax_unless_kernel(x_ptr, skip_ptr, amax_ptr, numel, IN_FMT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # 64-bit: numel may pass 2**31
    skip = tl.load(skip_ptr)
    mask = (offs < numel) & ((offs * 0 + skip) == 0)  # nothing is read when the flag is set
    x = decode_to_f32(tl.load(x_ptr + offs, mask=mask, other=0), IN_FMT)
    tl.atomic_max(amax_ptr, tl.max(tl.where(mask, tl.abs(x), 0.0), axis=0))


def launch_cast_transpose_amax(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, transpose: bool):
    """Run the fused kernel on 2-D ``x``: ``(data, data_t or None, finite amax, non-finite flag)``."""
    m, n = x.shape
    data = torch.empty((m, n), dtype=out_dtype, device=x.device)
    data_t = torch.empty((n, m), dtype=out_dtype, device=x.device) if transpose else data
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    nonfinite = torch.zeros((), dtype=torch.int32, device=x.device)
    block_m, block_n = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    src = payload_view(x)
    _cast_transpose_amax_kernel[grid](
        src, scale.to(torch.float32), payload_view(data), payload_view(data_t), amax, nonfinite, m, n,
        src.stride(0), src.stride(1), IN_FMT=format_code(x.dtype), OUT_FMT=format_code(out_dtype),
        FMAX=_FMAX[out_dtype], TRANSPOSE=transpose, BLOCK_M=block_m, BLOCK_N=block_n,
    )
    return data, (data_t if transpose else None), amax, nonfinite


def launch_amax_unless(x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """``x.abs().amax()`` (finite inputs) computed on device, or 0 without reading ``x`` when ``skip`` is set."""
    flat = payload_view(x.reshape(-1))
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    block = 1024
    _amax_unless_kernel[(max(1, triton.cdiv(flat.numel(), block)),)](
        flat, skip.to(torch.int32), amax, flat.numel(), IN_FMT=format_code(x.dtype), BLOCK=block
    )
    return amax
