"""Triton kernels of the FP8 core's custom ops (:mod:`fp8.ops`): one launch each (imports Triton).

Each ``launch_*`` function runs one kernel and returns what its op returns; the op's torch reference in
:mod:`fp8.ops` is its oracle (tests run both under ``TRITON_INTERPRET=1`` and compare bits).

Scales are computed in the kernels with the exact power-of-two formula of :func:`fp8.ops.power_of_two_scale`:
``floor(log2(fmax / amax))`` read from the exponent bits of ``fmax`` times the correctly rounded reciprocal of the
amax (as torch computes ``fmax / amax``), so kernel and reference agree bit for bit.

:func:`launch_amax` reduces over the whole tensor in one launch: every program max-es its block into a small scratch
buffer kept per device (zeros between calls), and the last program to finish (an atomic counter) copies the result
out and zeroes the scratch. Launches on one device must therefore not run concurrently on two streams (the core
issues them on the current stream, in order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_formats import decode_to_f32, encode_f32, format_code, payload_view

__all__ = [
    "launch_amax", "launch_cast_transpose", "launch_quantize_rows", "launch_quantize_cols_t", "launch_quantize_tiles",
    "launch_transpose_fp8", "launch_scaled_fp16", "launch_apply_scales", "launch_update_scales", "launch_transpose_fp8_into",
    "launch_sum_chunks", "launch_row_chunk_sum", "launch_mx_scales", "launch_quantize_mx", "pow2_scale", "amax_scratch",
]

_FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_FLT_MAX = 3.4028234663852886e38
_SCRATCH: dict[torch.device, torch.Tensor] = {}  # per device: the amax reduction's scratch (module docstring)
_TABLES: dict[tuple, torch.Tensor] = {}  # update_scales_'s address tables, by the addresses (a few models at once)
_MAX_TABLES = 16


@triton.jit
def pow2_scale(amax, FMAX: tl.constexpr, MARGIN: tl.constexpr, previous):
    """:func:`fp8.ops.power_of_two_scale` on fp32 ``amax``: exact ``2**(floor(log2(FMAX / amax)) - MARGIN)`` within
    ``2**+-126``, ``previous`` where ``amax`` is 0 or not finite."""
    x = tl.math.div_rn(tl.zeros_like(amax) + 1.0, amax) * FMAX  # torch's fmax / amax: the reciprocal, then the product
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - MARGIN  # floor(log2(x)) of a normal x; inf: 128
    e = tl.minimum(tl.maximum(e, -126), 126)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    ok = (amax > 0) & (amax <= 3.4028234663852886e38)
    return tl.where(ok, scale, previous)


def amax_scratch(device: torch.device) -> torch.Tensor:
    """The amax reductions' scratch on ``device`` (3 int32: amax bits, flag bits, arrivals; zeros between launches)."""
    buf = _SCRATCH.get(device)
    if buf is None:
        buf = _SCRATCH[device] = torch.zeros(3, dtype=torch.int32, device=device)
    return buf


@triton.jit
def _amax_kernel(x_ptr, row_ptr, col_ptr, scratch_ptr, out_ptr, M, N, stride_m, stride_n, n_programs,
                 IN_FMT: tl.constexpr, HAS_ROW: tl.constexpr, HAS_COL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = decode_to_f32(tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_n, mask=mask, other=0),
                      IN_FMT)
    if HAS_ROW:
        x = x * tl.load(row_ptr + rows, mask=rows < M, other=1.0)[:, None]
    if HAS_COL:
        x = x * tl.load(col_ptr + cols, mask=cols < N, other=1.0)[None, :]
    finite = tl.abs(x) <= 3.4028234663852886e38
    block_amax = tl.max(tl.max(tl.where(finite & mask, tl.abs(x), 0.0), axis=1), axis=0)
    block_bad = tl.max(tl.max(tl.where(finite | (~mask), 0.0, 1.0), axis=1), axis=0)
    # Non-negative fp32 values order as their int32 bits: the scratch holds bits (int32 atomics everywhere).
    tl.atomic_max(scratch_ptr, block_amax.to(tl.int32, bitcast=True))
    tl.atomic_max(scratch_ptr + 1, block_bad.to(tl.int32, bitcast=True))
    arrived = tl.atomic_add(scratch_ptr + 2, 1)
    if arrived == n_programs - 1:  # the last program: every block is in
        tl.store(out_ptr, tl.atomic_xchg(scratch_ptr, 0).to(tl.float32, bitcast=True))
        tl.store(out_ptr + 1, tl.atomic_xchg(scratch_ptr + 1, 0).to(tl.float32, bitcast=True))
        tl.atomic_xchg(scratch_ptr + 2, 0)


def launch_amax(x: torch.Tensor, row: torch.Tensor | None, col: torch.Tensor | None) -> torch.Tensor:
    m, n = x.shape
    out = torch.empty(2, dtype=torch.float32, device=x.device)
    block_m, block_n = 64, 128
    grid = (max(1, triton.cdiv(m, block_m)), max(1, triton.cdiv(n, block_n)))
    src = payload_view(x)
    _amax_kernel[grid](
        src, row if row is not None else out, col if col is not None else out, amax_scratch(x.device), out, m, n,
        src.stride(0), src.stride(1), grid[0] * grid[1], IN_FMT=format_code(x.dtype), HAS_ROW=row is not None,
        HAS_COL=col is not None, BLOCK_M=block_m, BLOCK_N=block_n,
    )
    return out


@triton.jit
def _cast_t_kernel(x_ptr, scale_ptr, amax2_ptr, prev_ptr, slot_ptr, data_ptr, t_ptr, dst_ptr, inv_ptr, M, N,
                   stride_m, stride_n, t_width, IN_FMT: tl.constexpr, OUT_FMT: tl.constexpr, FMAX: tl.constexpr,
                   MARGIN: tl.constexpr, FROM_AMAX: tl.constexpr, TRANSPOSE: tl.constexpr, RECORD: tl.constexpr,
                   HAS_DST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows < M
    mask = in_rows[:, None] & (cols[None, :] < N)
    x = decode_to_f32(tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_n, mask=mask, other=0),
                      IN_FMT)
    if FROM_AMAX:
        a = tl.load(amax2_ptr)
        badf = tl.load(amax2_ptr + 1)
        bad = badf > 0
        scale = pow2_scale(a, FMAX, MARGIN, tl.load(prev_ptr))
        finite = (tl.abs(x) <= 3.4028234663852886e38) & ((tl.zeros_like(x) + badf) == 0.0)
        inv = tl.where(bad, float("nan"), 1.0 / scale)
    else:
        scale = tl.load(scale_ptr)
        finite = tl.abs(x) <= 3.4028234663852886e38
        inv = 1.0 / scale
    y = tl.minimum(tl.maximum(x * scale, -FMAX), FMAX)
    y = tl.where(finite, y, float("nan"))
    bits = encode_f32(y, OUT_FMT)
    bits = tl.where(mask, bits, 0)
    tl.store(data_ptr + rows[:, None] * N + cols[None, :], bits, mask=mask)
    if TRANSPOSE:
        if HAS_DST:
            dst = tl.load(dst_ptr + rows, mask=in_rows, other=0).to(tl.int64)
            tl.store(t_ptr + cols[None, :] * t_width + dst[:, None], bits, mask=mask)
        else:  # rows past M up to the padded width are written as zeros
            t_mask = (rows[:, None] < t_width) & (cols[None, :] < N)
            tl.store(t_ptr + cols[None, :] * t_width + rows[:, None], bits, mask=t_mask)
    if RECORD:
        if FROM_AMAX:
            if (pid_m == 0) & (pid_n == 0):
                tl.store(slot_ptr, tl.maximum(tl.load(slot_ptr), tl.where(bad, 0.0, tl.load(amax2_ptr))))
        else:
            block_amax = tl.max(tl.max(tl.where(finite & mask, tl.abs(x), 0.0), axis=1), axis=0)
            tl.atomic_max(slot_ptr, block_amax)
    if (pid_m == 0) & (pid_n == 0):
        tl.store(inv_ptr, inv)


def launch_cast_transpose(x, scale, amax2, previous, amax_slot, fmt_dtype, margin, transpose, pad, record,
                          dst_cols, out_t):
    """Both tensor-wise casts (``scale`` given: delayed; ``amax2`` given: current). Returns ``(data, data_t,
    scale_inv)``; ``data_t`` is written into ``out_t`` (and returned empty) when the caller allocated it."""
    m, n = x.shape
    data = torch.empty((m, n), dtype=fmt_dtype, device=x.device)
    width = -(-m // pad) * pad if pad > 1 else m
    if not transpose:
        data_t = torch.empty((0, 0), dtype=fmt_dtype, device=x.device)
    elif out_t is not None:
        data_t, width = out_t, out_t.shape[1]
    else:
        data_t = torch.empty((n, width), dtype=fmt_dtype, device=x.device)
    inv = torch.empty((), dtype=torch.float32, device=x.device)
    block_m, block_n = 64, 64
    rows = m if (dst_cols is not None or not transpose) else width
    grid = (max(1, triton.cdiv(rows, block_m)), max(1, triton.cdiv(n, block_n)))
    src = payload_view(x)
    dummy = inv
    _cast_t_kernel[grid](
        src, scale if scale is not None else dummy, amax2 if amax2 is not None else dummy,
        previous if previous is not None else dummy, amax_slot, payload_view(data), payload_view(data_t),
        dst_cols if dst_cols is not None else dummy, inv, m, n, src.stride(0), src.stride(1), width,
        IN_FMT=format_code(x.dtype), OUT_FMT=format_code(fmt_dtype), FMAX=_FMAX[fmt_dtype], MARGIN=margin,
        FROM_AMAX=amax2 is not None, TRANSPOSE=transpose, RECORD=record, HAS_DST=dst_cols is not None,
        BLOCK_M=block_m, BLOCK_N=block_n,
    )
    return data, (data_t if out_t is None else torch.empty((0, 0), dtype=fmt_dtype, device=x.device)), inv


@triton.jit
def _rows_kernel(x_ptr, xs_ptr, data_ptr, inv_ptr, M, N, stride_m, stride_n, IN_FMT: tl.constexpr,
                 OUT_FMT: tl.constexpr, FMAX: tl.constexpr, HAS_XS: tl.constexpr, XS_PER_ROW: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    in_rows = rows < M
    xs = 1.0
    if HAS_XS:
        if XS_PER_ROW:
            xs = tl.load(xs_ptr + rows, mask=in_rows, other=1.0)[:, None]
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N).to(tl.int64)
        mask = in_rows[:, None] & (cols[None, :] < N)
        x = decode_to_f32(tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_n, mask=mask, other=0),
                          IN_FMT)
        if HAS_XS:
            if XS_PER_ROW:
                x = x * xs
            else:
                x = x * tl.load(xs_ptr + cols, mask=cols < N, other=1.0)[None, :]
        ok = mask & (tl.abs(x) <= 3.4028234663852886e38)
        amax = tl.maximum(amax, tl.max(tl.where(ok, tl.abs(x), 0.0), axis=1))
    scale = pow2_scale(amax, FMAX, 0, tl.full((BLOCK_M,), 1.0, tl.float32))
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N).to(tl.int64)
        mask = in_rows[:, None] & (cols[None, :] < N)
        x = decode_to_f32(tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_n, mask=mask, other=0),
                          IN_FMT)
        if HAS_XS:
            if XS_PER_ROW:
                x = x * xs
            else:
                x = x * tl.load(xs_ptr + cols, mask=cols < N, other=1.0)[None, :]
        y = tl.minimum(tl.maximum(x * scale[:, None], -FMAX), FMAX)
        y = tl.where(tl.abs(x) <= 3.4028234663852886e38, y, float("nan"))
        tl.store(data_ptr + rows[:, None] * N + cols[None, :], encode_f32(y, OUT_FMT), mask=mask)
    tl.store(inv_ptr + rows, 1.0 / scale, mask=in_rows)


def _xs_layout(x_scale_inv: torch.Tensor | None, m: int) -> tuple[torch.Tensor | None, bool]:
    """A dequantization factor as a flat fp32 vector and whether it is per row (else per column)."""
    if x_scale_inv is None:
        return None, True
    per_row = x_scale_inv.dim() == 2 and x_scale_inv.shape[1] == 1 and x_scale_inv.shape[0] == m
    return x_scale_inv.to(torch.float32).reshape(-1).contiguous(), per_row


def launch_quantize_rows(x, fmt_dtype, x_scale_inv):
    m, n = x.shape
    data = torch.empty((m, n), dtype=fmt_dtype, device=x.device)
    inv = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    xs, per_row = _xs_layout(x_scale_inv, m)
    block_m, block_n = 16, 128
    src = payload_view(x)
    _rows_kernel[(max(1, triton.cdiv(m, block_m)),)](
        src, xs if xs is not None else inv, payload_view(data), inv, m, n, src.stride(0), src.stride(1),
        IN_FMT=format_code(x.dtype), OUT_FMT=format_code(fmt_dtype), FMAX=_FMAX[fmt_dtype], HAS_XS=xs is not None,
        XS_PER_ROW=per_row, BLOCK_M=block_m, BLOCK_N=block_n,
    )
    return data, inv


@triton.jit
def _cols_t_kernel(x_ptr, xs_ptr, t_ptr, inv_ptr, M, N, stride_m, stride_n, width, IN_FMT: tl.constexpr,
                   OUT_FMT: tl.constexpr, FMAX: tl.constexpr, HAS_XS: tl.constexpr, XS_PER_ROW: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_cols = cols < N
    xs_col = 1.0
    if HAS_XS:
        if not XS_PER_ROW:
            xs_col = tl.load(xs_ptr + cols, mask=in_cols, other=1.0)[None, :]
    amax = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, M, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
        mask = (rows[:, None] < M) & in_cols[None, :]
        x = decode_to_f32(tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_n, mask=mask, other=0),
                          IN_FMT)
        if HAS_XS:
            if XS_PER_ROW:
                x = x * tl.load(xs_ptr + rows, mask=rows < M, other=1.0)[:, None]
            else:
                x = x * xs_col
        ok = mask & (tl.abs(x) <= 3.4028234663852886e38)
        amax = tl.maximum(amax, tl.max(tl.where(ok, tl.abs(x), 0.0), axis=0))
    scale = pow2_scale(amax, FMAX, 0, tl.full((BLOCK_N,), 1.0, tl.float32))
    for start in range(0, width, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M).to(tl.int64)
        mask = (rows[:, None] < M) & in_cols[None, :]
        x = decode_to_f32(tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_n, mask=mask, other=0),
                          IN_FMT)
        if HAS_XS:
            if XS_PER_ROW:
                x = x * tl.load(xs_ptr + rows, mask=rows < M, other=1.0)[:, None]
            else:
                x = x * xs_col
        y = tl.minimum(tl.maximum(x * scale[None, :], -FMAX), FMAX)
        y = tl.where(tl.abs(x) <= 3.4028234663852886e38, y, float("nan"))
        bits = tl.where(mask, encode_f32(y, OUT_FMT), 0)  # padding rows: zeros
        t_mask = (rows[:, None] < width) & in_cols[None, :]
        tl.store(t_ptr + cols[None, :] * width + rows[:, None], bits, mask=t_mask)
    tl.store(inv_ptr + cols, 1.0 / scale, mask=in_cols)


def launch_quantize_cols_t(x, fmt_dtype, pad, x_scale_inv):
    m, n = x.shape
    width = -(-m // pad) * pad if pad > 1 else m
    data_t = torch.empty((n, width), dtype=fmt_dtype, device=x.device)
    inv = torch.empty((1, n), dtype=torch.float32, device=x.device)
    xs, per_row = _xs_layout(x_scale_inv, m)
    block_m, block_n = 128, 16
    src = payload_view(x)
    _cols_t_kernel[(max(1, triton.cdiv(n, block_n)),)](
        src, xs if xs is not None else inv, payload_view(data_t), inv, m, n, src.stride(0), src.stride(1), width,
        IN_FMT=format_code(x.dtype), OUT_FMT=format_code(fmt_dtype), FMAX=_FMAX[fmt_dtype], HAS_XS=xs is not None,
        XS_PER_ROW=per_row, BLOCK_M=block_m, BLOCK_N=block_n,
    )
    return data_t, inv


@triton.jit
def _tiles_kernel(x_ptr, xs_ptr, data_ptr, inv_ptr, data_c_ptr, inv_c_ptr, hw_ptr, hw_c_ptr, M, N, stride_m, stride_n,
                  rows_c, n_tiles, m_tiles, IN_FMT: tl.constexpr, OUT_FMT: tl.constexpr, FMAX: tl.constexpr,
                  COLUMNWISE: tl.constexpr, HAS_XS: tl.constexpr, TILE: tl.constexpr, TRANSPOSE_C: tl.constexpr,
                  SWIZZLE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * TILE + tl.arange(0, TILE)
    cols = pid_n.to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = decode_to_f32(tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_n, mask=mask, other=0),
                      IN_FMT)
    if HAS_XS:  # an FP8 x dequantized by its 1x128 tile grid
        x = x * tl.load(xs_ptr + rows * n_tiles + pid_n, mask=(rows < M) & (rows * 0 + pid_n < n_tiles),
                        other=1.0)[:, None]
    finite = tl.abs(x) <= 3.4028234663852886e38
    mag = tl.where(finite & mask, tl.abs(x), 0.0)
    s = pow2_scale(tl.max(mag, axis=1), FMAX, 0, tl.full((TILE,), 1.0, tl.float32))
    y = tl.where(finite, tl.minimum(tl.maximum(x * s[:, None], -FMAX), FMAX), float("nan"))
    tl.store(data_ptr + rows[:, None] * N + cols[None, :], encode_f32(y, OUT_FMT), mask=mask)
    tl.store(inv_ptr + rows * n_tiles + pid_n, 1.0 / s, mask=(rows < M) & (rows * 0 + pid_n < n_tiles))
    if COLUMNWISE:
        sc = pow2_scale(tl.max(mag, axis=0), FMAX, 0, tl.full((TILE,), 1.0, tl.float32))
        yc = tl.where(finite, tl.minimum(tl.maximum(x * sc[None, :], -FMAX), FMAX), float("nan"))
        bits = tl.where(mask, encode_f32(yc, OUT_FMT), 0)  # rows past M (padding): zeros
        c_mask = (rows[:, None] < rows_c) & (cols[None, :] < N)
        if TRANSPOSE_C:  # (N, rows_c) row-major: the tokens contiguous
            tl.store(data_c_ptr + cols[None, :] * rows_c + rows[:, None], bits, mask=c_mask)
            tl.store(inv_c_ptr + cols * m_tiles + pid_m, 1.0 / sc, mask=(cols < N) & (cols * 0 + pid_m < m_tiles))
        else:
            tl.store(data_c_ptr + rows[:, None] * N + cols[None, :], bits, mask=c_mask)
            tl.store(inv_c_ptr + pid_m * N + cols, 1.0 / sc, mask=(cols < N) & (cols * 0 + pid_m < m_tiles))
    if SWIZZLE:  # MXFP8 (TILE 32): the E8M0 scales in cuBLAS's swizzled layout, every byte of its padded tiles
        k_tiles = (n_tiles + 3) // 4
        inside = (rows < M) & (rows * 0 + pid_n < n_tiles)
        e = tl.where(inside, ((1.0 / s).to(tl.int32, bitcast=True) >> 23) & 0xFF, 0)
        off = ((rows // 128) * k_tiles + pid_n // 4) * 512 + (rows % 32) * 16 + ((rows % 128) // 32) * 4 + pid_n % 4
        tl.store(hw_ptr + off, e.to(tl.uint8))
        if COLUMNWISE:
            k_tiles_c = (m_tiles + 3) // 4
            inside_c = (cols < N) & (cols * 0 + pid_m < m_tiles)
            e_c = tl.where(inside_c, ((1.0 / sc).to(tl.int32, bitcast=True) >> 23) & 0xFF, 0)
            off_c = (((cols // 128) * k_tiles_c + pid_m // 4) * 512 + (cols % 32) * 16 + ((cols % 128) // 32) * 4
                     + pid_m % 4)
            tl.store(hw_c_ptr + off_c, e_c.to(tl.uint8))


def launch_quantize_tiles(x, fmt_dtype, columnwise, pad, x_scale_inv=None, tile=128, transpose_c=False,
                          swizzle=False):
    m, n = x.shape
    n_tiles = -(-n // tile)
    m_tiles = -(-m // tile)
    data = torch.empty((m, n), dtype=fmt_dtype, device=x.device)
    inv = torch.empty((m, n_tiles), dtype=torch.float32, device=x.device)
    rows_c = (-(-m // pad) * pad if pad > 1 else m) if columnwise else 0
    if columnwise:
        shape_c, shape_inv_c = ((n, rows_c), (n, m_tiles)) if transpose_c else ((rows_c, n), (m_tiles, n))
        data_c = torch.empty(shape_c, dtype=fmt_dtype, device=x.device)
        inv_c = torch.empty(shape_inv_c, dtype=torch.float32, device=x.device)
    else:
        data_c = torch.empty((0, 0), dtype=fmt_dtype, device=x.device)
        inv_c = torch.empty((0, 0), dtype=torch.float32, device=x.device)
    grid = (max(1, triton.cdiv(max(m, rows_c), tile)), max(1, n_tiles))
    hw = hw_c = None
    if swizzle:  # the grid covers the swizzled layouts' padded tiles: rows (and features) to 128, K blocks to 4
        grid = (-(-grid[0] // 4) * 4, -(-grid[1] // 4) * 4)
        hw = torch.empty((-(-m // 128) * 128 * (-(-n_tiles // 4) * 4),), dtype=torch.uint8, device=x.device)
        hw_c = torch.empty((-(-n // 128) * 128 * (-(-m_tiles // 4) * 4),) if columnwise else (0,), dtype=torch.uint8,
                           device=x.device)
    src = payload_view(x)
    xs = x_scale_inv.to(torch.float32).contiguous() if x_scale_inv is not None else inv
    _tiles_kernel[grid](
        src, xs, payload_view(data), inv, payload_view(data_c) if columnwise else payload_view(data),
        inv_c if columnwise else inv, hw if swizzle else inv, hw_c if swizzle and columnwise else inv, m, n,
        src.stride(0), src.stride(1), rows_c, n_tiles, m_tiles,
        IN_FMT=format_code(x.dtype), OUT_FMT=format_code(fmt_dtype), FMAX=_FMAX[fmt_dtype], COLUMNWISE=columnwise,
        HAS_XS=x_scale_inv is not None, TILE=tile, TRANSPOSE_C=transpose_c, SWIZZLE=swizzle,
        num_warps=8 if tile >= 128 else 4,
    )
    if swizzle:
        return data, inv, hw.view(torch.float8_e8m0fnu), data_c, inv_c, hw_c.view(torch.float8_e8m0fnu)
    return data, inv, data_c, inv_c


def launch_quantize_mx(x, fmt_dtype, columnwise, pad, x_scale_inv=None):
    """:func:`fp8.ops.quantize_mx`: the 32-tile kernel writing the swizzled E8M0 scales too."""
    return launch_quantize_tiles(x, fmt_dtype, columnwise, pad, x_scale_inv, 32, True, swizzle=True)


@triton.jit
def _transpose_kernel(src_ptr, scale_ptr, dst_ptr, inv_ptr, M, N, stride_m, stride_n, width, BLOCK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    cols = pid_n.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    bits = tl.load(src_ptr + rows[:, None] * stride_m + cols[None, :] * stride_n, mask=mask, other=0)
    t_mask = (rows[:, None] < width) & (cols[None, :] < N)  # rows past M up to the padded width: zeros
    tl.store(dst_ptr + cols[None, :] * width + rows[:, None], bits, mask=t_mask)
    if (pid_m == 0) & (pid_n == 0):
        tl.store(inv_ptr, 1.0 / tl.load(scale_ptr))


def launch_transpose_fp8(payload, scale, pad):
    m, n = payload.shape
    width = -(-m // pad) * pad if pad > 1 else m
    out = torch.empty((n, width), dtype=payload.dtype, device=payload.device)
    inv = torch.empty((), dtype=torch.float32, device=payload.device)
    block = 64
    src = payload_view(payload)
    _transpose_kernel[(max(1, triton.cdiv(width, block)), max(1, triton.cdiv(n, block)))](
        src, scale.to(torch.float32), payload_view(out), inv, m, n, src.stride(0), src.stride(1), width, BLOCK=block)
    return out, inv


@triton.jit
def _scale_elementwise_kernel(x_ptr, row_ptr, col_ptr, amax2_ptr, out_ptr, scale_out_ptr, M, N, stride_m, stride_n,
                              IN_FMT: tl.constexpr, OUT_FMT: tl.constexpr, HAS_ROW: tl.constexpr,
                              HAS_COL: tl.constexpr, TO_FP16: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = decode_to_f32(tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_n, mask=mask, other=0),
                      IN_FMT)
    if HAS_ROW:
        x = x * tl.load(row_ptr + rows, mask=rows < M, other=1.0)[:, None]
    if HAS_COL:
        x = x * tl.load(col_ptr + cols, mask=cols < N, other=1.0)[None, :]
    if TO_FP16:
        scale = pow2_scale(tl.load(amax2_ptr), 65504.0, 11, 1.0)
        x = x * scale
        if (pid_m == 0) & (pid_n == 0):
            tl.store(scale_out_ptr, scale)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], encode_f32(x, OUT_FMT), mask=mask)


def _elementwise(x, row, col, amax2, out_dtype):
    m, n = x.shape
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    block_m, block_n = 64, 64
    src = payload_view(x)
    _scale_elementwise_kernel[(max(1, triton.cdiv(m, block_m)), max(1, triton.cdiv(n, block_n)))](
        src, row.reshape(-1) if row is not None else scale, col.reshape(-1) if col is not None else scale,
        amax2 if amax2 is not None else scale, payload_view(out), scale, m, n, src.stride(0), src.stride(1),
        IN_FMT=format_code(x.dtype), OUT_FMT=format_code(out_dtype), HAS_ROW=row is not None, HAS_COL=col is not None,
        TO_FP16=amax2 is not None, BLOCK_M=block_m, BLOCK_N=block_n,
    )
    return out, scale


def launch_scaled_fp16(x, amax2, row, col):
    return _elementwise(x, row, col, amax2, torch.float16)


def launch_apply_scales(x, row, col, out_dtype):
    return _elementwise(x, row, col, None, out_dtype)[0]


@triton.jit
def _update_scales_kernel(table_ptr, fmax_ptr, enabled_ptr, HAS_ENABLED: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    hist = tl.load(table_ptr + i * 5 + 0).to(tl.pointer_type(tl.float32))
    scale_ptr = tl.load(table_ptr + i * 5 + 1).to(tl.pointer_type(tl.float32))
    flag_ptr = tl.load(table_ptr + i * 5 + 2).to(tl.pointer_type(tl.int8))
    length = tl.load(table_ptr + i * 5 + 3)
    margin = tl.load(table_ptr + i * 5 + 4).to(tl.int32)
    fmax = tl.load(fmax_ptr + i)
    offs = tl.arange(0, BLOCK)
    in_hist = offs < length
    h = tl.load(hist + offs, mask=in_hist, other=0.0)
    shifted = tl.load(hist + offs - 1, mask=in_hist & (offs >= 1), other=0.0)
    window = tl.max(h, axis=0)
    previous = tl.load(scale_ptr)
    x = tl.math.div_rn(tl.zeros_like(window) + 1.0, window) * fmax
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - margin
    e = tl.minimum(tl.maximum(e, -126), 126)
    new_scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    new_scale = tl.where((window > 0) & (window <= 3.4028234663852886e38), new_scale, previous)
    flag = tl.load(flag_ptr)
    new_flag = tl.where(window > 0, 1, flag).to(tl.int8)
    enabled = True
    if HAS_ENABLED:
        enabled = tl.load(enabled_ptr) != 0
    if enabled:
        tl.store(scale_ptr, new_scale)
        tl.store(flag_ptr, new_flag)
        tl.store(hist + offs, shifted, mask=in_hist)
    else:
        tl.store(hist + offs, tl.where(offs == 0, 0.0, h), mask=in_hist)


def launch_update_scales(histories, scales, has_history, fmaxes, margins, enabled):
    device = histories[0].device
    key = (device, *(t.data_ptr() for t in histories), *(t.numel() for t in histories),
           *(t.data_ptr() for t in scales), *(t.data_ptr() for t in has_history), *fmaxes, *margins)
    tables = _TABLES.get(key)
    if tables is None:
        rows = [[h.data_ptr(), s.data_ptr(), f.data_ptr(), h.numel(), m]
                for h, s, f, m in zip(histories, scales, has_history, margins)]
        table, fmax = torch.tensor(rows, dtype=torch.int64), torch.tensor(list(fmaxes), dtype=torch.float32)
        if device.type == "cuda":  # uploaded without a host sync (the caching allocator keeps the pinned buffer)
            table = table.pin_memory().to(device, non_blocking=True)
            fmax = fmax.pin_memory().to(device, non_blocking=True)
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.pop(next(iter(_TABLES)))
        tables = _TABLES[key] = (table, fmax)
    table, fmax = tables
    block = max(16, triton.next_power_of_2(max(h.numel() for h in histories)))
    _update_scales_kernel[(len(histories),)](
        table, fmax, enabled.view(torch.int8) if enabled is not None else fmax, HAS_ENABLED=enabled is not None,
        BLOCK=block)


@triton.jit
def _transpose_multi_kernel(table_ptr, BLOCK: tl.constexpr):
    """One tensor per row of the table (payload, scale, out, inv addresses; rows, columns); one 64x64 tile per
    program along axis 1 (programs past a tensor's tiles return)."""
    i = tl.program_id(0)
    tile = tl.program_id(1)
    m = tl.load(table_ptr + i * 6 + 4)
    n = tl.load(table_ptr + i * 6 + 5)
    tiles_n = (n + BLOCK - 1) // BLOCK
    if tile < ((m + BLOCK - 1) // BLOCK) * tiles_n:
        src = tl.load(table_ptr + i * 6 + 0).to(tl.pointer_type(tl.uint8))
        dst = tl.load(table_ptr + i * 6 + 2).to(tl.pointer_type(tl.uint8))
        rows = (tile // tiles_n).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        cols = (tile % tiles_n).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = (rows[:, None] < m) & (cols[None, :] < n)
        bits = tl.load(src + rows[:, None] * n + cols[None, :], mask=mask, other=0)
        tl.store(dst + cols[None, :] * m + rows[:, None], bits, mask=mask)
        if tile == 0:
            scale = tl.load(tl.load(table_ptr + i * 6 + 1).to(tl.pointer_type(tl.float32)))
            tl.store(tl.load(table_ptr + i * 6 + 3).to(tl.pointer_type(tl.float32)), 1.0 / scale)


def launch_transpose_fp8_into(payloads, scales, outs, invs):
    device = payloads[0].device
    for p, o in zip(payloads, outs):
        if not (p.is_contiguous() and o.is_contiguous() and o.shape == p.shape[::-1]):
            raise ValueError(f"transpose_fp8_into_ writes a contiguous (in, out) transpose of a contiguous payload: "
                             f"got payload {tuple(p.shape)} strides {p.stride()}, out {tuple(o.shape)} strides "
                             f"{o.stride()}; pass contiguous buffers of the transposed shape")
    key = ("transpose", device, *(t.data_ptr() for group in (payloads, scales, outs, invs) for t in group),
           *(d for p in payloads for d in p.shape))
    table = _TABLES.get(key)
    if table is None:
        rows = [[p.data_ptr(), s.data_ptr(), o.data_ptr(), i.data_ptr(), p.shape[0], p.shape[1]]
                for p, s, o, i in zip(payloads, scales, outs, invs)]
        table = torch.tensor(rows, dtype=torch.int64)
        if device.type == "cuda":
            table = table.pin_memory().to(device, non_blocking=True)
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.pop(next(iter(_TABLES)))
        _TABLES[key] = table
    block = 64
    tiles = max(triton.cdiv(p.shape[0], block) * triton.cdiv(p.shape[1], block) for p in payloads)
    _transpose_multi_kernel[(len(payloads), tiles)](table, BLOCK=block)


@triton.jit
def _sum_chunks_kernel(src_ptr, inv_ptr, out_ptr, n, CHUNKS: tl.constexpr, IN_FMT: tl.constexpr,
                       OUT_FMT: tl.constexpr, BLOCK: tl.constexpr):
    """Element i of the output: the CHUNKS values at i, n + i, 2n + i, ... decoded and summed in order, times scale_inv."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        acc += decode_to_f32(tl.load(src_ptr + c * n.to(tl.int64) + offs, mask=mask, other=0), IN_FMT)
    acc = acc * tl.load(inv_ptr)
    tl.store(out_ptr + offs, encode_f32(acc, OUT_FMT), mask=mask)


def launch_sum_chunks(received, chunks, scale_inv, out_dtype):
    received = received.contiguous()
    out = torch.empty((received.shape[0] // chunks, *received.shape[1:]), dtype=out_dtype, device=received.device)
    n = out.numel()
    block = 1024
    _sum_chunks_kernel[(max(1, triton.cdiv(n, block)),)](
        payload_view(received), scale_inv.to(torch.float32).reshape(()), payload_view(out), n, CHUNKS=chunks,
        IN_FMT=format_code(received.dtype), OUT_FMT=format_code(out_dtype), BLOCK=block)
    return out


@triton.jit
def _mx_scales_kernel(grid_ptr, out_ptr, rows, kb, stride_r, stride_k, repeat, k_tiles, total, BLOCK: tl.constexpr):
    """Each output byte of the swizzled layout: tile ``o // 512`` (row tile outer, K tile inner), inside it row
    ``(o % 512) // 16 + 32 * ((o % 16) // 4)`` and K-block ``o % 4``; the grid value's exponent byte, 0 past the
    operand."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tile = o // 512
    within = o % 512
    r = (tile // k_tiles) * 128 + ((within % 16) // 4) * 32 + within // 16
    c = (tile % k_tiles) * 4 + within % 4
    inside = (r < rows) & (c < kb) & (o < total)
    value = tl.load(grid_ptr + (r // repeat) * stride_r + c * stride_k, mask=inside, other=0.0)
    bits = ((value.to(tl.int32, bitcast=True) >> 23) & 0xFF).to(tl.uint8)
    tl.store(out_ptr + o, tl.where(inside, bits, 0), mask=o < total)


def launch_mx_scales(grid, rows, repeat):
    kb = grid.shape[1]
    k_tiles = -(-kb // 4)
    total = -(-rows // 128) * 128 * k_tiles * 4
    out = torch.empty((total,), dtype=torch.uint8, device=grid.device)
    g = grid if grid.dtype == torch.float32 else grid.to(torch.float32)
    block = 1024
    _mx_scales_kernel[(max(1, triton.cdiv(total, block)),)](g, out, rows, kb, g.stride(0), g.stride(1), repeat,
                                                           k_tiles, total, BLOCK=block)
    return out.view(torch.float8_e8m0fnu)


# -- per-segment scaling: the FSDP2 FP8 reduce-scatter (fp8.ops.segment_amax / segment_cast / segment_sum) ------------
@triton.jit
def _segment_of(cols, off_ptr, N_SEG):
    """The segment of each column: how many segment starts after the first lie at or before it (a loop over the
    unit's few FP8 weights instead of a per-column table)."""
    seg = tl.zeros(cols.shape, dtype=tl.int32)
    for j in range(1, N_SEG):
        seg += (cols >= tl.load(off_ptr + j)).to(tl.int32)
    return seg


@triton.jit
def _segment_amax_kernel(x_ptr, off_ptr, out_ptr, R, C, stride_r, N_SEG, IN_FMT: tl.constexpr, BLOCK: tl.constexpr):
    """Columns [pid * BLOCK, +BLOCK): their finite amax over the R rows, max-ed into their segment's slot (atomic on
    non-negative fp32), and the non-finite flag into slot N_SEG."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < C
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.float32)
    row_ptr = x_ptr
    for r in range(R):
        v = tl.abs(decode_to_f32(tl.load(row_ptr + cols, mask=mask, other=0), IN_FMT))
        finite = v <= 3.4028234663852886e38
        amax = tl.maximum(amax, tl.where(finite, v, 0.0))
        bad = tl.maximum(bad, tl.where(finite, 0.0, 1.0))
        row_ptr += stride_r  # a pointer per row: no int32 product of row and stride
    seg = _segment_of(cols, off_ptr, N_SEG)
    tl.atomic_max(out_ptr + seg, amax, mask=mask)
    tl.atomic_max(out_ptr + N_SEG + tl.zeros([BLOCK], dtype=tl.int32), bad, mask=mask)


def launch_segment_amax(x, offsets):
    x = x.contiguous()
    n_segments = offsets.numel() - 1
    out = torch.zeros(n_segments + 1, dtype=torch.float32, device=x.device)
    rows, cols = x.shape
    block = 512
    if cols:
        _segment_amax_kernel[(triton.cdiv(cols, block),)](
            payload_view(x), offsets, out, rows, cols, x.stride(0), n_segments, IN_FMT=format_code(x.dtype),
            BLOCK=block)
    return out


@triton.jit
def _segment_cast_kernel(x_ptr, off_ptr, amax_ptr, data_ptr, inv_ptr, R, C, stride_r, N_SEG, IN_FMT: tl.constexpr,
                         OUT_FMT: tl.constexpr, FMAX: tl.constexpr, BLOCK: tl.constexpr):
    """Columns [pid(0) * BLOCK, +BLOCK) of row pid(1) (columns on the grid's first axis: no 65535 limit) cast with
    their segment's scale; program (0, 0) writes every segment's scale_inv."""
    row = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = (cols < C) & ((tl.zeros_like(cols) + row) < R)  # no rows: the program still writes the scale_invs
    seg = _segment_of(cols, off_ptr, N_SEG)
    scale = pow2_scale(tl.load(amax_ptr + seg, mask=mask, other=0.0), FMAX, 0, 1.0)
    v = decode_to_f32(tl.load(x_ptr + row * stride_r + cols, mask=mask, other=0), IN_FMT)
    y = tl.minimum(tl.maximum(v * scale, -FMAX), FMAX)
    y = tl.where(tl.abs(v) <= 3.4028234663852886e38, y, float("nan"))  # inf and NaN written as NaN
    tl.store(data_ptr + row * C + cols, encode_f32(y, OUT_FMT), mask=mask)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        for start in range(0, N_SEG, BLOCK):
            segs = start + tl.arange(0, BLOCK)
            in_range = segs < N_SEG
            s = pow2_scale(tl.load(amax_ptr + segs, mask=in_range, other=0.0), FMAX, 0, 1.0)
            tl.store(inv_ptr + segs, 1.0 / s, mask=in_range)


def launch_segment_cast(x, offsets, amax, fmt_dtype):
    x = x.contiguous()
    rows, cols = x.shape
    data = torch.empty((rows, cols), dtype=fmt_dtype, device=x.device)
    n_segments = amax.shape[0] - 1
    inv = torch.empty(n_segments, dtype=torch.float32, device=x.device)
    block = 1024
    _segment_cast_kernel[(max(1, triton.cdiv(cols, block)), max(1, rows))](
        payload_view(x), offsets, amax.to(torch.float32), payload_view(data), inv, rows, cols, max(x.stride(0), 1),
        n_segments, IN_FMT=format_code(x.dtype), OUT_FMT=format_code(fmt_dtype), FMAX=_FMAX[fmt_dtype],
        BLOCK=block)
    return data, inv


@triton.jit
def _segment_sum_kernel(src_ptr, off_ptr, inv_ptr, amax_ptr, out_ptr, R, C, N_SEG, divisor, IN_FMT: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Columns [pid * BLOCK, +BLOCK): the R rows decoded and summed in row order, times the segment's scale_inv, over
    ``divisor``; NaN when the flag is set."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < C
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    row_ptr = src_ptr
    for r in range(R):
        acc += decode_to_f32(tl.load(row_ptr + cols, mask=mask, other=0), IN_FMT)
        row_ptr += C  # a pointer per row: no int32 product of row and width
    seg = _segment_of(cols, off_ptr, N_SEG)
    acc = acc * tl.load(inv_ptr + seg, mask=mask, other=1.0)
    acc = tl.math.div_rn(acc, tl.zeros_like(acc) + divisor)
    flag = tl.load(amax_ptr + N_SEG)
    acc = tl.where(flag > 0, float("nan"), acc)
    tl.store(out_ptr + cols, acc, mask=mask)


def launch_segment_sum(received, offsets, scale_inv, amax, divisor):
    received = received.contiguous()
    rows, cols = received.shape
    out = torch.empty(cols, dtype=torch.float32, device=received.device)
    block = 1024
    if cols:
        _segment_sum_kernel[(triton.cdiv(cols, block),)](
            payload_view(received), offsets, scale_inv.to(torch.float32), amax.to(torch.float32), out, rows, cols,
            amax.shape[0] - 1, float(divisor), IN_FMT=format_code(received.dtype), BLOCK=block)
    return out


@triton.jit
def _row_chunk_sum_kernel(src_ptr, inv_ptr, out_ptr, C, N, R, width, src_stride, divisor, IN_FMT: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Elements [pid * BLOCK, +BLOCK) of the ``(N,)`` output: the C senders' values decoded, each times its sender's
    scale_inv of the element's table row (``column // width``), summed in sender order, over ``divisor``."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    row = cols // width
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    row_ptr = src_ptr
    inv_row = inv_ptr
    for c in range(C):
        x = decode_to_f32(tl.load(row_ptr + cols, mask=mask, other=0), IN_FMT)
        acc += x * tl.load(inv_row + row, mask=mask, other=1.0)
        row_ptr += src_stride  # a pointer per sender: no int32 product of sender and stride
        inv_row += R
    acc = tl.math.div_rn(acc, tl.zeros_like(acc) + divisor)
    tl.store(out_ptr + cols, acc, mask=mask)


def launch_row_chunk_sum(received, scale_inv, divisor):
    if received.stride(-1) != 1:
        received = received.contiguous()
    chunks, n = received.shape
    rows = scale_inv.shape[1]
    out = torch.empty(n, dtype=torch.float32, device=received.device)
    block = 1024
    if n:
        _row_chunk_sum_kernel[(triton.cdiv(n, block),)](
            payload_view(received), scale_inv.to(torch.float32).contiguous(), out, chunks, n, rows, n // rows,
            received.stride(0), float(divisor), IN_FMT=format_code(received.dtype), BLOCK=block)
    return out
