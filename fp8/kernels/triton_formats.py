"""Triton device functions: exact encode/decode between fp32 and the storage formats (imports Triton).

FP8 and BF16 conversions are done on the bits (round to nearest even, like torch's casts) instead of
with Triton's ``.to()``: the bits are the same on every GPU and under the Triton interpreter, whose
FP8/BF16 casts do not round like the hardware. Format codes (``constexpr``): see :data:`FORMAT_CODES`.
Payload pointers: fp32 and fp16 as themselves, bf16 viewed as int16, FP8 viewed as uint8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..formats import byte_view

__all__ = ["FORMAT_CODES", "format_code", "payload_view", "encode_f32", "decode_to_f32", "rounding_bits",
           "stochastic_grid"]

FORMAT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
"""Format code of each payload dtype, as the kernels take it."""


def format_code(dtype: torch.dtype) -> int:
    """The kernels' code for payload ``dtype``; a ``ValueError`` for dtypes they do not handle."""
    if dtype not in FORMAT_CODES:
        raise ValueError(f"Triton kernels take payloads in {list(FORMAT_CODES)}, got {dtype}")
    return FORMAT_CODES[dtype]


def payload_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels address it: bf16 as int16, FP8 as uint8, others unchanged."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    return byte_view(t)


@triton.jit
def _fp8_bits(y, MANT: tl.constexpr, BIAS: tl.constexpr, SUB_SCALE: tl.constexpr):
    """Bits (int32 in [0, 255]) of fp32 ``y`` rounded to nearest even in an FP8 format; ``y`` must be
    within the format's range (clamped) or NaN (-> 0x7F with the sign, as torch)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    drop: tl.constexpr = 23 - MANT
    r = a + ((1 << (drop - 1)) - 1) + ((a >> drop) & 1)
    normal = (((r >> 23) - 127 + BIAS) << MANT) | ((r >> drop) & ((1 << MANT) - 1))
    # Below the smallest normal: a multiple of the subnormal step, rounded to nearest even by the
    # fp32 addition of 2**23 (exact: the multiple is < 2**23).
    is_sub = a < ((128 - BIAS) << 23)
    t = tl.where(is_sub, tl.abs(y), 0.0) * SUB_SCALE
    sub = ((t + 8388608.0) - 8388608.0).to(tl.int32)
    out = tl.where(is_sub, sub, normal)
    out = tl.where(a > 0x7F800000, 0x7F, out)
    return out | (sign << 7)


@triton.jit
def _fp8_value(b, MANT: tl.constexpr, BIAS: tl.constexpr, SUB_STEP: tl.constexpr, FN: tl.constexpr):
    """fp32 value of FP8 bits ``b`` (int32); ``FN``: E4M3FN's NaN encoding (no infinities)."""
    sign = (b >> 7) & 1
    e = (b >> MANT) & ((1 << (7 - MANT)) - 1)
    m = b & ((1 << MANT) - 1)
    normal = ((sign << 31) | ((e - BIAS + 127) << 23) | (m << (23 - MANT))).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * SUB_STEP
    sub = tl.where(sign == 1, -sub, sub)
    value = tl.where(e == 0, sub, normal)
    if FN:
        value = tl.where((b & 0x7F) == 0x7F, float("nan"), value)
    else:
        special = e == ((1 << (7 - MANT)) - 1)
        inf = tl.where(sign == 1, float("-inf"), float("inf"))
        value = tl.where(special, tl.where(m == 0, inf, float("nan")), value)
    return value


@triton.jit
def encode_f32(y, FMT: tl.constexpr):
    """``y`` (fp32) as the payload element of format ``FMT``, rounded to nearest even (values already
    clamped to the format's range)."""
    if FMT == 0:
        return y
    elif FMT == 1:
        bits = y.to(tl.int32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        return r.to(tl.int16)
    elif FMT == 2:
        return y.to(tl.float16)
    elif FMT == 3:
        return _fp8_bits(y, 3, 7, 512.0).to(tl.uint8)
    else:
        return _fp8_bits(y, 2, 15, 65536.0).to(tl.uint8)


@triton.jit
def decode_to_f32(x, FMT: tl.constexpr):
    """The fp32 value of payload elements ``x`` of format ``FMT`` (exact)."""
    if FMT == 0:
        return x.to(tl.float32)
    elif FMT == 1:
        return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif FMT == 2:
        return x.to(tl.float32)
    elif FMT == 3:
        return _fp8_value(x.to(tl.int32) & 0xFF, 3, 7, 0.001953125, True)
    else:
        return _fp8_value(x.to(tl.int32) & 0xFF, 2, 15, 0.0000152587890625, False)


# -- stochastic rounding (fp8.optim.precision.rounding_bits / stochastic_grid, bit for bit) --------------------------
@triton.jit
def _mul32(x, c: tl.constexpr):
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32), as the torch reference computes it (no int64 overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


@triton.jit
def rounding_bits(row, step, offs):
    """20 random bits (int64) per element ``offs`` of the optimizer's row ``row`` at ``step`` (the step being taken,
    1-based): :func:`fp8.optim.precision.rounding_bits`, the same hash."""
    key = _mix32((row.to(tl.int64) & 0xFFFFFFFF) ^ 0x5BD1E995)
    seed = _mix32((step.to(tl.int64) + key) & 0xFFFFFFFF)
    index = offs.to(tl.int64)
    return _mix32((index & 0xFFFFFFFF) ^ seed ^ ((index >> 32) & 0xFFFFFFFF)) >> 12


@triton.jit
def stochastic_grid(y, bits, fmt):
    """fp32 ``y`` (scaled, clamped) on the grid of format code ``fmt`` (2 fp16, 3 E4M3, 4 E5M2), up in magnitude
    when ``bits < frac * 2**20``: :func:`fp8.optim.precision.stochastic_grid`, bit for bit. NaN stays NaN."""
    mantissa = tl.where(fmt == 2, 10, tl.where(fmt == 3, 3, 2))
    emin = tl.where(fmt == 3, -6, -14)
    magnitude = tl.abs(y)
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    spacing = tl.maximum(exponent, emin) - mantissa
    t = magnitude * ((127 - spacing) << 23).to(tl.float32, bitcast=True)  # 2 ** -spacing, exact
    low = tl.floor(t)
    up = bits.to(tl.float32) < (t - low) * 1048576.0
    rounded = (low + up.to(tl.float32)) * ((127 + spacing) << 23).to(tl.float32, bitcast=True)
    signed = tl.where(y.to(tl.int32, bitcast=True) < 0, -rounded, rounded)  # the sign bit: -0.0 stays -0.0
    return tl.where(y != y, y, signed)
