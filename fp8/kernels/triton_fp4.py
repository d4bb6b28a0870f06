"""Triton kernels of the NVFP4 recipe's custom ops (:func:`fp8.fp4.nvfp4_quantize`, :func:`fp8.fp4.nvfp4_amax`):
one launch each (imports Triton). Their torch references in :mod:`fp8.fp4` are the oracles: tests run both under
``TRITON_INTERPRET=1`` and compare bits (round to nearest; stochastic rounding draws from ``tl.rand`` here and from a
``torch.Generator`` there, so it is compared in law: unbiased, on the same grid).

Both kernels read the matrix ``L`` (``x`` or ``x^T``, by strides: the transpose is never written) in programs of
128 rows by one 16-element K block; the Hadamard transform of a block is 16 multiply-adds in a fixed order, products
exact (entries +-1/4), the order :func:`fp8.fp4.hadamard_transform` sums in. Columns past ``x``'s K read as zeros
(the padding of the weight-gradient operands' tokens).

:func:`launch_nvfp4_quantize` writes, from that one read: the packed E2M1 payload (even element in the low nibble),
the fp32 ``scale_inv`` grid, the E4M3 block scales per row in cuBLAS's swizzled 32_4_4 layout (zeros in its padding:
the launch grid covers the padded tile, so no fill kernel) and the 0-d ``global_scale_inv``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_formats import decode_to_f32, encode_f32, format_code, payload_view
from .triton_quantize import pow2_scale, amax_scratch

__all__ = ["launch_nvfp4_quantize", "launch_nvfp4_amax", "is_empty_launch"]

_BLOCK_R = 128
_FLT_MAX = 3.4028234663852886e38
_GLOBAL_FMAX = 6.0 * 448.0  # fp8.fp4: E2M1's largest magnitude times E4M3's


@triton.jit
def _h_entries(j, i, SIGNS: tl.constexpr):
    """Row ``j`` of the random Hadamard matrix ``H_16 diag(s) / 4`` at columns ``i``: ``(-1)**popcount(i & j)`` times
    ``s_i`` (bit ``i`` of the mask ``SIGNS`` set: -1), over 4 (exact)."""
    b = i & j
    parity = (b ^ (b >> 1) ^ (b >> 2) ^ (b >> 3)) & 1
    flip = parity ^ ((SIGNS >> i) & 1)
    return tl.where(flip == 1, -0.25, 0.25)


@triton.jit
def _load_block(x_ptr, s_ptr, rows, kb, R, K, stride_r, stride_k, ss_r, ss_k, IN_FMT: tl.constexpr,
                SIGNS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr):
    """The even and odd columns (``(BLOCK_R, 8)`` each, fp32) of K block ``kb`` of rows ``rows``, zeros past ``R``
    and ``K``; an FP8 payload dequantized by its 16x16 block scales (``HAS_SCALE``: ``s_ptr`` with strides ``ss_r``,
    ``ss_k`` along the rows and the K blocks, ``value = payload * (1 / scale)``, exact); Hadamard-transformed along the
    block when ``SIGNS`` (a sign mask) is not -1."""
    i8 = tl.arange(0, 8)
    rmask = rows < R
    if HAS_SCALE:
        sc = tl.load(s_ptr + (rows // 16) * ss_r + kb * ss_k, mask=rmask & ((tl.zeros_like(rows) + kb * 16) < K),
                     other=1.0)
        inv = tl.math.div_rn(tl.zeros_like(sc) + 1.0, sc)
    else:
        inv = tl.zeros((BLOCK_R,), dtype=tl.float32) + 1.0
    if SIGNS >= 0:
        acc_e = tl.zeros((BLOCK_R, 8), dtype=tl.float32)
        acc_o = tl.zeros((BLOCK_R, 8), dtype=tl.float32)
        for j in tl.static_range(16):
            kj = kb * 16 + j
            xj = decode_to_f32(tl.load(x_ptr + rows * stride_r + kj * stride_k, mask=rmask & ((tl.zeros_like(rows) + kj) < K),
                                       other=0),
                               IN_FMT)
            if HAS_SCALE:
                xj = xj * inv
            he = _h_entries(j, 2 * i8, SIGNS)
            ho = _h_entries(j, 2 * i8 + 1, SIGNS)
            acc_e = acc_e + xj[:, None] * he[None, :]
            acc_o = acc_o + xj[:, None] * ho[None, :]
        return acc_e, acc_o
    ke = kb * 16 + 2 * i8
    me = rmask[:, None] & (ke[None, :] < K)
    mo = rmask[:, None] & (ke[None, :] + 1 < K)
    base = x_ptr + rows[:, None] * stride_r
    ve = decode_to_f32(tl.load(base + ke[None, :] * stride_k, mask=me, other=0), IN_FMT)
    vo = decode_to_f32(tl.load(base + (ke[None, :] + 1) * stride_k, mask=mo, other=0), IN_FMT)
    if HAS_SCALE:
        ve = ve * inv[:, None]
        vo = vo * inv[:, None]
    return ve, vo


@triton.jit
def _amax_kernel(x_ptr, s_ptr, scratch_ptr, out_ptr, R, K, stride_r, stride_k, ss_r, ss_k, n_programs,
                 IN_FMT: tl.constexpr, SIGNS: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1).to(tl.int64)
    ve, vo = _load_block(x_ptr, s_ptr, rows, kb, R, K, stride_r, stride_k, ss_r, ss_k, IN_FMT, SIGNS, HAS_SCALE,
                         BLOCK_R)
    fe = tl.abs(ve) <= 3.4028234663852886e38
    fo = tl.abs(vo) <= 3.4028234663852886e38
    amax = tl.maximum(tl.max(tl.max(tl.where(fe, tl.abs(ve), 0.0), axis=1), axis=0),
                      tl.max(tl.max(tl.where(fo, tl.abs(vo), 0.0), axis=1), axis=0))
    bad = tl.maximum(tl.max(tl.max(tl.where(fe, 0.0, 1.0), axis=1), axis=0),
                     tl.max(tl.max(tl.where(fo, 0.0, 1.0), axis=1), axis=0))
    tl.atomic_max(scratch_ptr, amax.to(tl.int32, bitcast=True))  # non-negative fp32 order as their int32 bits
    tl.atomic_max(scratch_ptr + 1, bad.to(tl.int32, bitcast=True))
    arrived = tl.atomic_add(scratch_ptr + 2, 1)
    if arrived == n_programs - 1:
        tl.store(out_ptr, tl.atomic_xchg(scratch_ptr, 0).to(tl.float32, bitcast=True))
        tl.store(out_ptr + 1, tl.atomic_xchg(scratch_ptr + 1, 0).to(tl.float32, bitcast=True))
        tl.atomic_xchg(scratch_ptr + 2, 0)


def _layout(x: torch.Tensor, transpose: bool, x_scale: torch.Tensor | None):
    """``L``'s rows, K and strides over ``x`` (and over its scale grid), by ``transpose``."""
    rows, k = (x.shape[1], x.shape[0]) if transpose else (x.shape[0], x.shape[1])
    stride_r, stride_k = (x.stride(1), x.stride(0)) if transpose else (x.stride(0), x.stride(1))
    s = x_scale if x_scale is None or x_scale.dtype == torch.float32 else x_scale.to(torch.float32)
    ss_r, ss_k = (0, 0) if s is None else ((s.stride(1), s.stride(0)) if transpose else (s.stride(0), s.stride(1)))
    return rows, k, stride_r, stride_k, s, ss_r, ss_k


def launch_nvfp4_amax(x: torch.Tensor, signs: int, transpose: bool, x_scale: torch.Tensor | None) -> torch.Tensor:
    rows, k, stride_r, stride_k, s, ss_r, ss_k = _layout(x, transpose, x_scale)
    out = torch.empty((2,), dtype=torch.float32, device=x.device)
    grid = (max(1, triton.cdiv(rows, _BLOCK_R)), max(1, triton.cdiv(k, 16)))
    _amax_kernel[grid](payload_view(x), out if s is None else s, amax_scratch(x.device), out, rows, k, stride_r, stride_k,
                       ss_r, ss_k, grid[0] * grid[1], IN_FMT=format_code(x.dtype), SIGNS=signs,
                       HAS_SCALE=s is not None, BLOCK_R=_BLOCK_R)
    return out


@triton.jit
def _e2m1_grid(code):
    """The E2M1 magnitude of 3-bit ``code`` (0, 0.5, 1, 1.5, 2, 3, 4, 6)."""
    return tl.where(code < 4, code.to(tl.float32) * 0.5,
                    tl.where(code == 4, 2.0, tl.where(code == 5, 3.0, tl.where(code == 6, 4.0, 6.0))))


@triton.jit
def _e2m1_code(v, u, STOCHASTIC: tl.constexpr):
    """4-bit E2M1 codes (int32, sign in bit 3) of fp32 ``v`` in ``[-6, 6]``: round to nearest with ties to the even
    code (:func:`fp8.fp4.round_e2m1`), or stochastic with the uniform draws ``u``."""
    mag = tl.abs(v)
    if STOCHASTIC:
        lower = ((mag >= 0.5).to(tl.int32) + (mag >= 1.0).to(tl.int32) + (mag >= 1.5).to(tl.int32)
                 + (mag >= 2.0).to(tl.int32) + (mag >= 3.0).to(tl.int32) + (mag >= 4.0).to(tl.int32)
                 + (mag >= 6.0).to(tl.int32))
        lower = tl.minimum(lower, 6)
        lo = _e2m1_grid(lower)
        hi = _e2m1_grid(lower + 1)
        frac = tl.math.div_rn(mag - lo, hi - lo)
        code = lower + (u < frac).to(tl.int32)
    else:
        code = ((mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
                + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
                + (mag > 5.0).to(tl.int32))
    sign = ((v < 0) & (code > 0)).to(tl.int32)
    return code | (sign << 3)


@triton.jit
def _nvfp4_kernel(x_ptr, s_ptr, amax_ptr, data_ptr, inv_ptr, hw_ptr, ginv_ptr, R, K, KB, stride_r, stride_k, ss_r,
                  ss_k, k_tiles, seed, IN_FMT: tl.constexpr, BLOCK_ROWS: tl.constexpr, SIGNS: tl.constexpr,
                  HAS_SCALE: tl.constexpr,
                  STOCHASTIC: tl.constexpr, BLOCK_R: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    kb = tl.program_id(1).to(tl.int64)
    i8 = tl.arange(0, 8)
    rmask = (rows < R) & (tl.zeros_like(rows) + kb < KB)
    ve, vo = _load_block(x_ptr, s_ptr, rows, kb, R, K, stride_r, stride_k, ss_r, ss_k, IN_FMT, SIGNS, HAS_SCALE,
                         BLOCK_R)
    ve = tl.where(rmask[:, None], ve, 0.0)
    vo = tl.where(rmask[:, None], vo, 0.0)

    amax = tl.load(amax_ptr)
    g = pow2_scale(amax, 2688.0, 0, 1.0)  # power_of_two_scale(amax, 6 * 448): the tensor's encode factor
    fe = tl.abs(ve) <= 3.4028234663852886e38
    fo = tl.abs(vo) <= 3.4028234663852886e38
    bmax = tl.maximum(tl.max(tl.where(fe, tl.abs(ve), 0.0), axis=1), tl.max(tl.where(fo, tl.abs(vo), 0.0), axis=1))
    bad = tl.maximum(tl.max(tl.where(fe, 0, 1), axis=1), tl.max(tl.where(fo, 0, 1), axis=1))
    if BLOCK_ROWS > 1:  # 2-D blocks: the amax over BLOCK_ROWS rows, given back to each
        bmax = tl.reshape(tl.broadcast_to(tl.max(tl.reshape(bmax, (BLOCK_R // BLOCK_ROWS, BLOCK_ROWS)), axis=1)[:, None],
                                          (BLOCK_R // BLOCK_ROWS, BLOCK_ROWS)), (BLOCK_R,))
        bad = tl.reshape(tl.broadcast_to(tl.max(tl.reshape(bad, (BLOCK_R // BLOCK_ROWS, BLOCK_ROWS)), axis=1)[:, None],
                                         (BLOCK_R // BLOCK_ROWS, BLOCK_ROWS)), (BLOCK_R,))
    wanted = tl.minimum(tl.math.div_rn(bmax * g, tl.zeros_like(bmax) + 6.0), 448.0)
    sbits = encode_f32(wanted, 3).to(tl.int32)
    sbits = tl.where(decode_to_f32(sbits, 3) < wanted, sbits + 1, sbits)  # rounded down: the next code up
    sbits = tl.where(bad > 0, 0x7F, sbits)
    s32 = decode_to_f32(sbits, 3)
    ok = s32 > 0  # False for an all-zero block and for NaN (a block with a non-finite value): codes 0
    den = tl.broadcast_to(tl.where(ok, s32, 1.0)[:, None], (BLOCK_R, 8))  # libdevice's division: equal shapes
    scaled_e = tl.where(ok[:, None], tl.math.div_rn(ve * g, den), 0.0)
    scaled_o = tl.where(ok[:, None], tl.math.div_rn(vo * g, den), 0.0)
    scaled_e = tl.minimum(tl.maximum(scaled_e, -6.0), 6.0)
    scaled_o = tl.minimum(tl.maximum(scaled_o, -6.0), 6.0)
    if STOCHASTIC:
        offs = (rows[:, None] * (KB * 16) + kb * 16 + 2 * i8[None, :]).to(tl.int32)
        ue = tl.rand(seed, offs)
        uo = tl.rand(seed, offs + 1)
    else:
        ue = scaled_e
        uo = scaled_o
    byte = _e2m1_code(scaled_e, ue, STOCHASTIC) | (_e2m1_code(scaled_o, uo, STOCHASTIC) << 4)
    tl.store(data_ptr + rows[:, None] * (KB * 8) + kb * 8 + i8[None, :], byte.to(tl.uint8),
             mask=rmask[:, None] & (i8[None, :] < 8))

    ginv = tl.math.div_rn(tl.zeros_like(g) + 1.0, g)
    if BLOCK_ROWS > 1:
        tl.store(inv_ptr + (rows // BLOCK_ROWS) * KB + kb, s32 * ginv, mask=rmask & (rows % BLOCK_ROWS == 0))
    else:
        tl.store(inv_ptr + rows * KB + kb, s32 * ginv, mask=rmask)
    # the swizzled E4M3 scales: every byte of the padded layout, zeros outside the operand
    within = (rows % 32) * 16 + ((rows % 128) // 32) * 4 + kb % 4
    tile = (rows // 128) * k_tiles + kb // 4
    tl.store(hw_ptr + tile * 512 + within, tl.where(rmask, sbits, 0).to(tl.uint8))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(ginv_ptr, ginv)


def is_empty_launch(x: torch.Tensor, transpose: bool, pad: int) -> bool:
    """Whether :func:`launch_nvfp4_quantize`'s grid would be empty (no row or no K block): no program would run, so
    the caller makes that operand with the torch reference (its global scale included)."""
    rows, k = (x.shape[1], x.shape[0]) if transpose else (x.shape[0], x.shape[1])
    return rows == 0 or -(-k // max(pad, 16)) == 0


def launch_nvfp4_quantize(x: torch.Tensor, amax2: torch.Tensor, block_rows: int, transpose: bool, pad: int,
                          signs: int, stochastic: bool, seed: int, x_scale: torch.Tensor | None = None):
    rows, k, stride_r, stride_k, s, ss_r, ss_k = _layout(x, transpose, x_scale)
    if rows % block_rows:
        raise ValueError(f"nvfp4_quantize: {rows} rows do not tile in blocks of {block_rows} rows")
    step = max(pad, 16)
    kp = -(-k // step) * step
    kb = kp // 16
    k_tiles = -(-kb // 4)
    rows_hw = -(-rows // 128) * 128
    dev = x.device
    data = torch.empty((rows, kp // 2), dtype=torch.uint8, device=dev)
    inv = torch.empty((rows // block_rows, kb), dtype=torch.float32, device=dev)
    hw = torch.empty((rows_hw * k_tiles * 4,), dtype=torch.uint8, device=dev)
    ginv = torch.empty((), dtype=torch.float32, device=dev)
    grid = (rows_hw // _BLOCK_R, k_tiles * 4)
    _nvfp4_kernel[grid](payload_view(x), amax2 if s is None else s, amax2, data, inv, hw, ginv, rows, k, kb, stride_r,
                        stride_k, ss_r, ss_k, k_tiles, seed, IN_FMT=format_code(x.dtype), BLOCK_ROWS=block_rows,
                        SIGNS=signs, HAS_SCALE=s is not None,
                        STOCHASTIC=stochastic, BLOCK_R=_BLOCK_R)
    return data, inv, hw.view(torch.float8_e4m3fn), ginv
