"""Multi-tensor Triton kernels of the optimizer step, and their host-side launchers (imports Triton).

Every launcher here is **one** kernel launch over every tensor of its lists, whatever their number (the apex /
torchao ``multi_tensor_apply`` idea): the grid runs over a block table (``(tensor row, block within the tensor)``,
int32), and each program reads its tensor's addresses, element count and storage format from an int64 table
(addresses cast to typed pointers in the kernel). Formats are runtime codes
(:data:`fp8.kernels.triton_formats.FORMAT_CODES`), so tensors of different dtypes share one launch. Per-row kernels
(``prepare_states_kernel``, ``state_scales_kernel``) run over the rows of a table, a chunk of rows per program.

Reductions (non-finite flags, amaxes) accumulate with atomics into buffers the caller zeroed beforehand (a separate,
visible op: on the GPU the kernel sequence is the op sequence the CPU run dispatches, ``fp8.launches``). The tables
of a launch are built on the host and uploaded without blocking (:func:`device_table`); the optimizer caches the
ones that only change when a state tensor is re-allocated.

Numerics: power-of-two scales are :func:`pow2_scale`, ``2**(floor(log2(fmax / amax)) - margin)`` clamped to
``2**+-126`` (the previous scale where the amax is 0 or not finite), with ``floor(log2(y))`` read exactly from the
exponent bits of ``y = fmax * (1 / amax)`` (computed as torch computes ``fmax / amax``: a correctly rounded
reciprocal, then the product). torch's ``floor(log2(y))`` can round ``y`` within a few ulps below a power of two
``2**k`` up to ``k`` (probability ~1e-7 per scale); there the kernel's scale is the exact one, half of torch's (both
valid, nothing overflows). Bias corrections use ``beta**step`` by binary exponentiation in fp64 (within a few fp64
ulps of ``pow``: the fp32 value torch uses differs only where it lies that close to an fp32 rounding boundary).
Casts round to nearest even on the bits (:mod:`fp8.kernels.triton_formats`), as torch's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from .triton_formats import rounding_bits, stochastic_grid, decode_to_f32, encode_f32, format_code

__all__ = [
    "BLOCK", "ROWS", "ptr", "load_f32", "store_f32", "pow2_scale", "device_table", "block_table", "row_grid",
    "nonfinite_kernel", "amax_kernel", "quantize_kernel", "dequantize_kernel", "copy_kernel",
    "prepare_states_kernel", "state_scales_kernel", "sgd_stage1_kernel", "sgd_stage2_kernel", "sq_sum_kernel",
    "launch_mark_nonfinite", "launch_amax", "launch_quantize", "launch_dequantize", "launch_copy",
    "launch_sq_sums", "STATE_TABLE_COLUMNS", "state_table", "fmax_of", "launch_prepare_states", "launch_state_scales",
    "launch_state_stage", "block_quantize_kernel", "launch_block_quantize", "BLOCK_CHUNK",
]

BLOCK = 1024
"""Elements per program of the elementwise kernels."""
ROWS = 128
"""Tensor rows per program of the per-row kernels."""
FLT_MAX = tl.constexpr(3.4028234663852886e38)  # a constexpr: jit functions read it
STATE_TABLE_COLUMNS = 12
"""Columns of the state table (as :data:`fp8.kernels.triton_adam.TABLE_COLUMNS`): master/weight, first moment, second
moment and parameter payload addresses; master, first moment, second moment and parameter scale addresses; step
address; numel; packed format codes (w | m << 4 | v << 8 | p << 12); flags (1: m scaled, 2: v scaled, 4: master
scaled, 8: FP8 parameter, 16: has a master with a scale, 32: has a parameter to refresh)."""


# -- device helpers ----------------------------------------------------------------------------------------------------
@triton.jit
def ptr(addr, DTYPE: tl.constexpr):
    """``addr`` (int64, scalar or block) as a pointer to ``DTYPE``."""
    return addr.to(tl.pointer_type(DTYPE))


@triton.jit
def load_f32(addr, offs, mask, fmt):
    """fp32 values of the payload at ``addr`` (format code ``fmt``, a runtime value)."""
    if fmt == 0:
        x = tl.load(ptr(addr, tl.float32) + offs, mask=mask, other=0.0)
    elif fmt == 1:
        x = decode_to_f32(tl.load(ptr(addr, tl.int16) + offs, mask=mask, other=0), 1)
    elif fmt == 2:
        x = tl.load(ptr(addr, tl.float16) + offs, mask=mask, other=0.0).to(tl.float32)
    elif fmt == 3:
        x = decode_to_f32(tl.load(ptr(addr, tl.uint8) + offs, mask=mask, other=0), 3)
    else:
        x = decode_to_f32(tl.load(ptr(addr, tl.uint8) + offs, mask=mask, other=0), 4)
    return x


@triton.jit
def store_f32(addr, offs, mask, value, scale, fmax, fmt, scaled):
    """Store ``value`` (times ``scale``, clamped to +-``fmax`` when ``scaled``; NaN kept) in format ``fmt`` at
    ``addr``; returns the stored element's fp32 value (before unscaling)."""
    if scaled:
        y = value * scale
        value = tl.where(y != y, y, tl.minimum(tl.maximum(y, -fmax), fmax))
    if fmt == 0:
        tl.store(ptr(addr, tl.float32) + offs, value, mask=mask)
        stored = value
    elif fmt == 1:  # one name per branch: Triton types a name defined in several branches once
        bf16_bits = encode_f32(value, 1)
        tl.store(ptr(addr, tl.int16) + offs, bf16_bits, mask=mask)
        stored = decode_to_f32(bf16_bits, 1)
    elif fmt == 2:
        half = encode_f32(value, 2)
        tl.store(ptr(addr, tl.float16) + offs, half, mask=mask)
        stored = half.to(tl.float32)
    elif fmt == 3:
        e4m3_bits = encode_f32(value, 3)
        tl.store(ptr(addr, tl.uint8) + offs, e4m3_bits, mask=mask)
        stored = decode_to_f32(e4m3_bits, 3)
    else:
        e5m2_bits = encode_f32(value, 4)
        tl.store(ptr(addr, tl.uint8) + offs, e5m2_bits, mask=mask)
        stored = decode_to_f32(e5m2_bits, 4)
    return stored


@triton.jit
def pow2_scale(amax, fmax, margin, previous):
    """:func:`fp8.scaling.power_of_two_scale` elementwise (module docstring): ``previous`` where ``amax`` is 0, inf
    or NaN."""
    amax = amax.to(tl.float32)
    usable = (amax > 0.0) & (amax <= FLT_MAX)
    y = recip(tl.where(usable, amax, 1.0)) * fmax
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - margin
    e = tl.minimum(tl.maximum(e, -126), 126)
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(usable, scale, previous)


@triton.jit
def recip(x):
    """``1 / x`` correctly rounded (torch's ``reciprocal``)."""
    return tl.div_rn(tl.zeros_like(x) + 1.0, x)


@triton.jit
def _powi(base, n):
    """``base ** n`` in fp64 for integer ``n`` in [0, 2**31): binary exponentiation, low bits first."""
    result = tl.zeros_like(base) + 1.0
    for i in tl.static_range(31):
        result = tl.where(((n >> i) & 1) == 1, result * base, result)
        base = base * base
    return result


@triton.jit
def _block(blocks_ptr, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    row = tl.load(blocks_ptr + pid * 2)
    blk = tl.load(blocks_ptr + pid * 2 + 1)
    return row, blk, blk.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)


# -- generic multi-tensor kernels --------------------------------------------------------------------------------------
@triton.jit
def nonfinite_kernel(blocks_ptr, table_ptr, flag_ptr, BLOCK_SIZE: tl.constexpr):
    """Table rows ``(address, numel, format)``: ``flag_ptr`` (int32) max-ed with 1 where an element is inf or NaN."""
    row, blk, offs = _block(blocks_ptr, BLOCK_SIZE)
    base = table_ptr + row * 3
    mask = offs < tl.load(base + 1)
    x = load_f32(tl.load(base), offs, mask, tl.load(base + 2))
    bad = tl.max(tl.where(mask & ~(tl.abs(x) <= FLT_MAX), 1, 0), axis=0)
    if bad > 0:
        tl.atomic_max(flag_ptr, 1)


@triton.jit
def amax_kernel(blocks_ptr, table_ptr, out_ptr, BLOCK_SIZE: tl.constexpr):
    """Table rows ``(address, numel, format)``: ``out_ptr[row]`` (an fp32 amax seen as int32 bits) max-ed with the
    row's largest magnitude (NaN, whose bits are the largest, wins: as ``abs().amax()``)."""
    row, blk, offs = _block(blocks_ptr, BLOCK_SIZE)
    base = table_ptr + row * 3
    mask = offs < tl.load(base + 1)
    x = load_f32(tl.load(base), offs, mask, tl.load(base + 2))
    bits = tl.abs(x).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.atomic_max(out_ptr + row, tl.max(tl.where(mask, bits, 0), axis=0))


@triton.jit
def quantize_kernel(blocks_ptr, table_ptr, amax_ptr, fmax_ptr, BLOCK_SIZE: tl.constexpr):
    """Table rows ``(source, source format, numel, payload, payload format, scale address)``: the payload becomes
    ``cast(clamp(source * scale))`` with ``scale = pow2_scale(amax_ptr[row], fmax_ptr[row], 0, old scale)``, written
    into the scale tensor by the row's first block. (A block reading the scale after that write reads the new value
    only where it equals the old one: the scale depends on the old one only where the amax is not usable.)"""
    row, blk, offs = _block(blocks_ptr, BLOCK_SIZE)
    base = table_ptr + row * 6
    mask = offs < tl.load(base + 2)
    scale_ptr = ptr(tl.load(base + 5), tl.float32)
    fmax = tl.load(fmax_ptr + row)
    scale = pow2_scale(tl.load(amax_ptr + row), fmax, 0, tl.load(scale_ptr))
    x = load_f32(tl.load(base), offs, mask, tl.load(base + 1))
    store_f32(tl.load(base + 3), offs, mask, x, scale, fmax, tl.load(base + 4), True)
    if blk == 0:
        tl.store(scale_ptr, scale)


@triton.jit
def dequantize_kernel(blocks_ptr, table_ptr, BLOCK_SIZE: tl.constexpr):
    """Table rows ``(source, source format, scale address or 0, destination, destination format, numel)``: the
    destination becomes ``source * (1 / scale)`` (``source`` where there is no scale), rounded to its format."""
    row, blk, offs = _block(blocks_ptr, BLOCK_SIZE)
    base = table_ptr + row * 6
    mask = offs < tl.load(base + 5)
    x = load_f32(tl.load(base), offs, mask, tl.load(base + 1))
    scale_addr = tl.load(base + 2)
    if scale_addr != 0:
        scale = tl.load(ptr(scale_addr, tl.float32))
        x = x * recip(scale)
    store_f32(tl.load(base + 3), offs, mask, x, 1.0, 0.0, tl.load(base + 4), False)


@triton.jit
def copy_kernel(blocks_ptr, table_ptr, ok_ptr, UNLESS_OK: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Table rows ``(source, destination, bytes)``: copy the bytes (``UNLESS_OK``: only where the 0-d bool at
    ``ok_ptr`` is False)."""
    row, blk, offs = _block(blocks_ptr, BLOCK_SIZE)
    base = table_ptr + row * 3
    mask = offs < tl.load(base + 2)
    if UNLESS_OK:
        mask = mask & ((offs * 0 + tl.load(ok_ptr).to(tl.int32)) == 0)
    x = tl.load(ptr(tl.load(base), tl.uint8) + offs, mask=mask, other=0)
    tl.store(ptr(tl.load(base + 1), tl.uint8) + offs, x, mask=mask)


@triton.jit
def sq_sum_kernel(blocks_ptr, table_ptr, out_ptr, INF_NORM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Table rows ``(address, numel, format)``: ``out_ptr[row]`` accumulates the row's sum of squares (atomic add), or
    with ``INF_NORM`` its largest magnitude as int32 bits (atomic max; NaN wins)."""
    row, blk, offs = _block(blocks_ptr, BLOCK_SIZE)
    base = table_ptr + row * 3
    mask = offs < tl.load(base + 1)
    x = load_f32(tl.load(base), offs, mask, tl.load(base + 2))
    if INF_NORM:
        bits = tl.abs(x).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        tl.atomic_max(ptr(out_ptr, tl.int32) + row, tl.max(tl.where(mask, bits, 0), axis=0))
    else:
        tl.atomic_add(ptr(out_ptr, tl.float32) + row, tl.sum(tl.where(mask, x * x, 0.0), axis=0))



@triton.jit
def block_quantize_kernel(table_ptr, bad_ptr, ROWS_PER_TILE: tl.constexpr, CHUNK: tl.constexpr):
    """Block-scaled FP8 weights refreshed from their masters, program ``(block, row)``: table rows ``(source, source
    format, source scale address or 0, payload, payload format, scale grid address, rows, cols, block rows, block
    cols)`` (block sizes resolved: no 0). The block's largest magnitude of ``source * (1 / source
    scale)`` (NaN wins, as ``abs().amax()``) gives ``scale = pow2_scale(amax, fmax, 0, 1.0)``; the block's payload
    becomes ``cast(clamp(value * scale))`` and its grid entry that scale, unless ``bad_ptr`` (int32) is set (the
    launcher points it at a zero without a skip flag). Programs
    past a row's number of blocks return at once (the grid's first axis covers the largest grid)."""
    blk = tl.program_id(0)
    row = tl.program_id(1)
    base = table_ptr + row * 10
    n_rows = tl.load(base + 6)
    n_cols = tl.load(base + 7)
    br = tl.load(base + 8)
    bc = tl.load(base + 9)
    grid_cols = (n_cols + bc - 1) // bc
    grid_rows = (n_rows + br - 1) // br
    if blk < grid_rows * grid_cols:
        r0 = (blk // grid_cols) * br
        c0 = (blk % grid_cols) * bc
        r_end = tl.minimum(r0 + br, n_rows)
        c_end = tl.minimum(c0 + bc, n_cols)
        src = tl.load(base + 0)
        src_fmt = tl.load(base + 1)
        src_scale_addr = tl.load(base + 2)
        has_scale = src_scale_addr != 0
        inv = recip(tl.load(ptr(tl.where(has_scale, src_scale_addr, tl.load(base + 5)), tl.float32),
                            mask=has_scale, other=1.0))
        rows = tl.arange(0, ROWS_PER_TILE)[:, None]
        cols = tl.arange(0, CHUNK)[None, :]
        bits = tl.zeros([ROWS_PER_TILE, CHUNK], dtype=tl.int32)
        for r in range(r0, r_end, ROWS_PER_TILE):
            for c in range(c0, c_end, CHUNK):
                mask = ((r + rows) < r_end) & ((c + cols) < c_end)
                offs = (r + rows).to(tl.int64) * n_cols + c + cols
                x = load_f32(src, offs, mask, src_fmt) * inv
                bits = tl.maximum(bits, tl.where(mask, tl.abs(x).to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0))
        amax = tl.max(tl.max(bits, axis=1), axis=0).to(tl.float32, bitcast=True)
        fmt = tl.load(base + 4)
        fmax = tl.where(fmt == 3, 448.0, 57344.0)
        scale = pow2_scale(amax, fmax, 0, 1.0)
        if tl.load(bad_ptr) == 0:
            out = tl.load(base + 3)
            for r in range(r0, r_end, ROWS_PER_TILE):
                for c in range(c0, c_end, CHUNK):
                    mask = ((r + rows) < r_end) & ((c + cols) < c_end)
                    offs = (r + rows).to(tl.int64) * n_cols + c + cols
                    x = load_f32(src, offs, mask, src_fmt) * inv
                    store_f32(out, offs, mask, x, scale, fmax, fmt, True)
            tl.store(ptr(tl.load(base + 5), tl.float32) + blk, scale)


# -- optimizer states: the per-row kernels around the update passes ----------------------------------------------------
@triton.jit
def prepare_states_kernel(table_ptr, gscale_ptr, hyper_ptr, agreed_ptr, old_ptr, bc_ptr, amax_ptr, bad_ptr, n_rows,
                          HAS_AGREED: tl.constexpr, BIAS_CORRECTION: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr):
    """Before a step's update passes, per state-table row: the old scales (gradient, master, first and second
    moment, parameter; 1 where a tensor has none) into ``old_ptr[row, 0:5]``; with ``BIAS_CORRECTION`` (Adam)
    ``bc_ptr[row] = (lr / (1 - beta1**t), sqrt(1 - beta2**t))`` for the new step ``t`` (fp64, rounded to fp32, as
    torch; ``hyper_ptr[row] = (beta1, beta2, lr)`` in fp64), else the step count before this step (twice: SGD's
    first-step test, read by every block while the row's first block increments the count); the amaxes
    ``amax_ptr[row, 0:3]`` zeroed; program 0
    sets the skip flag ``bad_ptr`` (int32) to "not agreed" (0 without an agreement)."""
    pid = tl.program_id(0)
    rows = pid * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    live = rows < n_rows
    base = table_ptr + rows * 12
    flags = tl.load(base + 11, mask=live, other=0)
    gaddr = tl.load(gscale_ptr + rows, mask=live, other=0)
    has_g = live & (gaddr != 0)
    g_scale = tl.load(ptr(gaddr, tl.float32), mask=has_g, other=1.0)
    has_w = live & ((flags & 16) != 0)
    w_scale = tl.load(ptr(tl.load(base + 4, mask=live, other=0), tl.float32), mask=has_w, other=1.0)
    m_scale = tl.load(ptr(tl.load(base + 5, mask=live, other=0), tl.float32), mask=live, other=1.0)
    v_scale = tl.load(ptr(tl.load(base + 6, mask=live, other=0), tl.float32), mask=live, other=1.0)
    has_p = live & ((flags & 8) != 0)
    p_scale = tl.load(ptr(tl.load(base + 7, mask=live, other=0), tl.float32), mask=has_p, other=1.0)
    tl.store(old_ptr + rows * 5 + 0, g_scale, mask=live)
    tl.store(old_ptr + rows * 5 + 1, w_scale, mask=live)
    tl.store(old_ptr + rows * 5 + 2, m_scale, mask=live)
    tl.store(old_ptr + rows * 5 + 3, v_scale, mask=live)
    tl.store(old_ptr + rows * 5 + 4, p_scale, mask=live)
    step = tl.load(ptr(tl.load(base + 8, mask=live, other=0), tl.float32), mask=live, other=0.0)
    if BIAS_CORRECTION:
        n = (step + 1.0).to(tl.int32)
        beta1 = tl.load(hyper_ptr + rows * 3 + 0, mask=live, other=0.0)
        beta2 = tl.load(hyper_ptr + rows * 3 + 1, mask=live, other=0.0)
        lr = tl.load(hyper_ptr + rows * 3 + 2, mask=live, other=0.0).to(tl.float32)
        bc1 = (1.0 - _powi(beta1, n)).to(tl.float32)
        bc2 = tl.sqrt(1.0 - _powi(beta2, n)).to(tl.float32)  # fp64: IEEE sqrt (sqrt.rn.f64)
        tl.store(bc_ptr + rows * 2 + 0, recip(bc1) * lr, mask=live)
        tl.store(bc_ptr + rows * 2 + 1, bc2, mask=live)
    else:
        tl.store(bc_ptr + rows * 2 + 0, step, mask=live)
        tl.store(bc_ptr + rows * 2 + 1, step, mask=live)
    zero = tl.zeros([ROWS_PER_PROGRAM], dtype=tl.float32)
    tl.store(amax_ptr + rows * 3 + 0, zero, mask=live)
    tl.store(amax_ptr + rows * 3 + 1, zero, mask=live)
    tl.store(amax_ptr + rows * 3 + 2, zero, mask=live)
    if pid == 0:
        if HAS_AGREED:
            tl.store(bad_ptr, (tl.load(agreed_ptr) == 0).to(tl.int32))
        else:
            tl.store(bad_ptr, 0)


@triton.jit
def state_scales_kernel(table_ptr, fmax_ptr, amax_ptr, old_ptr, new_ptr, n_rows, W_FMT: tl.constexpr,
                        ROWS_PER_PROGRAM: tl.constexpr):
    """Per state-table row, the new scales ``new_ptr[row, 0:4]`` (first moment, second moment, master, FP8
    parameter) from the amaxes of the new values (``amax_ptr[row, 0:3]``): a power of two per scaled role (the old
    scale where the amax is not usable), 1 otherwise. The FP8 parameter's comes from the amax of the master as stored
    (format ``W_FMT``, the FP8 weights' master format): rounding is monotonic, so that is the stored amax."""
    pid = tl.program_id(0)
    rows = pid * ROWS_PER_PROGRAM + tl.arange(0, ROWS_PER_PROGRAM)
    live = rows < n_rows
    flags = tl.load(table_ptr + rows * 12 + 11, mask=live, other=0)
    amax_m = tl.load(amax_ptr + rows * 3 + 0, mask=live, other=0.0)
    amax_v = tl.load(amax_ptr + rows * 3 + 1, mask=live, other=0.0)
    amax_w = tl.load(amax_ptr + rows * 3 + 2, mask=live, other=0.0)
    old_w = tl.load(old_ptr + rows * 5 + 1, mask=live, other=1.0)
    old_m = tl.load(old_ptr + rows * 5 + 2, mask=live, other=1.0)
    old_v = tl.load(old_ptr + rows * 5 + 3, mask=live, other=1.0)
    old_p = tl.load(old_ptr + rows * 5 + 4, mask=live, other=1.0)
    fmax_m = tl.load(fmax_ptr + rows * 4 + 0, mask=live, other=1.0)
    fmax_v = tl.load(fmax_ptr + rows * 4 + 1, mask=live, other=1.0)
    fmax_w = tl.load(fmax_ptr + rows * 4 + 2, mask=live, other=1.0)
    fmax_p = tl.load(fmax_ptr + rows * 4 + 3, mask=live, other=1.0)
    one = tl.zeros([ROWS_PER_PROGRAM], dtype=tl.float32) + 1.0
    m = tl.where((flags & 1) != 0, pow2_scale(amax_m, fmax_m, 0, old_m), one)
    v = tl.where((flags & 2) != 0, pow2_scale(amax_v, fmax_v, 0, old_v), one)
    w = tl.where((flags & 4) != 0, pow2_scale(amax_w, fmax_w, 0, old_w), one)
    y = amax_w * w
    if W_FMT != 0:
        y = tl.where(y != y, y, tl.minimum(y, fmax_w))
    stored = decode_to_f32(encode_f32(y, W_FMT), W_FMT) * recip(w)
    p = tl.where((flags & 8) != 0, pow2_scale(stored, fmax_p, 0, old_p), one)
    tl.store(new_ptr + rows * 4 + 0, m, mask=live)
    tl.store(new_ptr + rows * 4 + 1, v, mask=live)
    tl.store(new_ptr + rows * 4 + 2, w, mask=live)
    tl.store(new_ptr + rows * 4 + 3, p, mask=live)


# -- SGD: the two passes (Adam's are fp8.kernels.triton_adam's) --------------------------------------------------------
@triton.jit
def _sgd_math(row, offs, mask, table_ptr, grads_ptr, old_ptr, bc_ptr, lr, momentum, omd, weight_decay,
              MAXIMIZE: tl.constexpr, HAS_DECAY: tl.constexpr, MOMENTUM: tl.constexpr, NESTEROV: tl.constexpr):
    base = table_ptr + row * 12
    codes = tl.load(base + 10)
    g = load_f32(tl.load(grads_ptr + row * 2), offs, mask, tl.load(grads_ptr + row * 2 + 1)) * \
        recip(tl.load(old_ptr + row * 5 + 0))
    if MAXIMIZE:
        g = -g
    w = load_f32(tl.load(base + 0), offs, mask, codes & 15) * recip(tl.load(old_ptr + row * 5 + 1))
    # torch's add(a, b, alpha) is one fused multiply-add (vec::fmadd on CPU, contracted on CUDA): so is each here.
    if HAS_DECAY:
        g = tl.fma(w, weight_decay, g)
    buf = g
    if MOMENTUM:
        first = tl.load(bc_ptr + row * 2) == 0.0  # the step count before this step (prepare_states_kernel)
        prev = load_f32(tl.load(base + 1), offs, mask, (codes >> 4) & 15) * recip(tl.load(old_ptr + row * 5 + 2))
        buf = tl.where(first, g, tl.fma(g, omd, prev * momentum))
        if NESTEROV:
            g = tl.fma(buf, momentum, g)
        else:
            g = buf
    w = tl.fma(g, -lr, w)
    return g, buf, w


@triton.jit
def sgd_stage1_kernel(blocks_ptr, table_ptr, grads_ptr, old_ptr, bc_ptr, amax_ptr, bad_ptr, lr, momentum, omd,
                      weight_decay, MAXIMIZE: tl.constexpr, HAS_DECAY: tl.constexpr, MOMENTUM: tl.constexpr,
                      NESTEROV: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """SGD's first pass: per row the amaxes of the new momentum buffer and master (``amax_ptr[row, 0]`` and ``[row,
    2]``); the gradients' non-finite flag (``bad_ptr``)."""
    row, blk, offs = _block(blocks_ptr, BLOCK_SIZE)
    mask = offs < tl.load(table_ptr + row * 12 + 9)
    g, buf, w = _sgd_math(row, offs, mask, table_ptr, grads_ptr, old_ptr, bc_ptr, lr, momentum, omd, weight_decay,
                          MAXIMIZE, HAS_DECAY, MOMENTUM, NESTEROV)
    finite = tl.abs(g) <= FLT_MAX
    bad = tl.max(tl.where(finite | (~mask), 0, 1), axis=0)
    if bad > 0:
        tl.atomic_max(bad_ptr, 1)
    ok = finite & mask
    if MOMENTUM:
        tl.atomic_max(amax_ptr + row * 3 + 0, tl.max(tl.where(ok, tl.abs(buf), 0.0), axis=0))
    tl.atomic_max(amax_ptr + row * 3 + 2, tl.max(tl.where(ok, tl.abs(w), 0.0), axis=0))


@triton.jit
def sgd_stage2_kernel(blocks_ptr, table_ptr, grads_ptr, old_ptr, bc_ptr, fmax_ptr, new_ptr, bad_ptr, lr, momentum, omd,
                      weight_decay, steps_ptr=None, row0=0, MAXIMIZE: tl.constexpr = False,
                      HAS_DECAY: tl.constexpr = False, MOMENTUM: tl.constexpr = False,
                      NESTEROV: tl.constexpr = False, BLOCK_SIZE: tl.constexpr = 1024,
                      STOCHASTIC: tl.constexpr = False):
    """SGD's second pass: momentum buffer, master and the refreshed parameter written with ``new_ptr[row, 0:4]``;
    the first block of a row writes its scales and step + 1. Nothing is written when ``bad_ptr`` is set.
    ``STOCHASTIC``: the momentum buffer (FP8/FP16) rounded stochastically as the optimizer's row ``row0 + row`` at
    step ``steps_ptr[row] + 1``."""
    row, blk, offs = _block(blocks_ptr, BLOCK_SIZE)
    skip = tl.load(bad_ptr)
    base = table_ptr + row * 12
    mask = (offs < tl.load(base + 9)) & ((offs * 0 + skip) == 0)
    g, buf, w = _sgd_math(row, offs, mask, table_ptr, grads_ptr, old_ptr, bc_ptr, lr, momentum, omd, weight_decay,
                          MAXIMIZE, HAS_DECAY, MOMENTUM, NESTEROV)
    codes = tl.load(base + 10)
    flags = tl.load(base + 11)
    m_scale = tl.load(new_ptr + row * 4 + 0)
    w_scale = tl.load(new_ptr + row * 4 + 2)
    p_scale = tl.load(new_ptr + row * 4 + 3)
    if MOMENTUM:
        m_fmt = (codes >> 4) & 15
        m_fmax = tl.load(fmax_ptr + row * 4 + 0)
        buf_scale = m_scale
        if STOCHASTIC:
            if (flags & 1) != 0 and m_fmt >= 2:
                y = buf * m_scale
                y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -m_fmax), m_fmax))
                step = tl.load(steps_ptr + row) + 1.0  # the step being taken
                buf = stochastic_grid(y, rounding_bits(row0 + row, step, offs), m_fmt)
                buf_scale = 1.0
        store_f32(tl.load(base + 1), offs, mask, buf, buf_scale, m_fmax, m_fmt, (flags & 1) != 0)
    stored = store_f32(tl.load(base + 0), offs, mask, w, w_scale, tl.load(fmax_ptr + row * 4 + 2), codes & 15,
                       (flags & 4) != 0) * recip(w_scale)
    if (flags & 32) != 0:
        store_f32(tl.load(base + 3), offs, mask, stored, p_scale, tl.load(fmax_ptr + row * 4 + 3),
                  (codes >> 12) & 15, (flags & 8) != 0)
    if blk == 0:
        if skip == 0:
            if MOMENTUM:
                tl.store(ptr(tl.load(base + 5), tl.float32), m_scale)
            if (flags & 16) != 0:
                tl.store(ptr(tl.load(base + 4), tl.float32), w_scale)
            if (flags & 8) != 0:
                tl.store(ptr(tl.load(base + 7), tl.float32), p_scale)
            step_ptr = ptr(tl.load(base + 8), tl.float32)
            tl.store(step_ptr, tl.load(step_ptr) + 1.0)


# -- host side ---------------------------------------------------------------------------------------------------------
def device_table(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host-built table on ``device`` without a host sync: on CUDA copied from pinned memory with
    ``non_blocking=True`` (the caching host allocator keeps the buffer until the copy ran)."""
    table = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


def block_table(numels: Sequence[int], device: torch.device, block: int = BLOCK) -> tuple[torch.Tensor, int]:
    """``(blocks, count)``: the ``(row, block)`` int32 table covering ``numels`` (``block`` elements per program;
    rows of 0 elements get no block)."""
    blocks = [(i, b) for i, n in enumerate(numels) for b in range(-(-int(n) // block))]
    return device_table(blocks, torch.int32, device).reshape(-1, 2), len(blocks)


def row_grid(n_rows: int) -> tuple[int]:
    """The grid of a per-row kernel over ``n_rows`` rows."""
    return (max(1, triton.cdiv(n_rows, ROWS)),)


def _flat_rows(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    return [[t.data_ptr(), t.numel(), format_code(t.dtype)] for t in tensors]


def _elementwise(kernel, rows: list, numels: Sequence[int], device: torch.device, *args, **kwargs) -> None:
    blocks, count = block_table(numels, device)
    if count == 0:
        return
    table = device_table(rows, torch.int64, device)
    kernel[(count,)](blocks, table, *args, BLOCK_SIZE=BLOCK, **kwargs)


def launch_mark_nonfinite(tensors: Sequence[torch.Tensor], flag: torch.Tensor) -> None:
    """One launch: ``flag`` (int32, one element) max-ed with 1 where any element of ``tensors`` is not finite."""
    _elementwise(nonfinite_kernel, _flat_rows(tensors), [t.numel() for t in tensors], flag.device, flag)


def launch_amax(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """One launch: ``out[i]`` (fp32) max-ed with ``tensors[i].abs().amax()`` (NaN wins)."""
    _elementwise(amax_kernel, _flat_rows(tensors), [t.numel() for t in tensors], out.device, out.view(torch.int32))


def fmax_of(dtype: torch.dtype) -> float:
    """The largest finite value of a scaled storage dtype (inf for unscaled ones)."""
    return {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.float16: 65504.0}.get(dtype, float("inf"))


def launch_quantize(values: Sequence[torch.Tensor], amax: torch.Tensor, payloads: Sequence[torch.Tensor],
                    scales: Sequence[torch.Tensor]) -> None:
    """One launch: each payload (FP8) becomes ``values[i]`` cast with the power-of-two scale of ``amax[i]`` (the old
    ``scales[i]`` kept where the amax is not usable), written into ``scales[i]``."""
    rows = [[v.data_ptr(), format_code(v.dtype), v.numel(), p.data_ptr(), format_code(p.dtype), s.data_ptr()]
            for v, p, s in zip(values, payloads, scales)]
    fmax = device_table([fmax_of(p.dtype) for p in payloads], torch.float32, amax.device)
    _elementwise(quantize_kernel, rows, [v.numel() for v in values], amax.device, amax, fmax)


BLOCK_CHUNK = 128
"""Columns per tile of :func:`block_quantize_kernel` (a 128-wide block is one tile wide; a whole row, several); its
tiles are 16 rows high (1 where every block is one row high: the row-wise recipe)."""


def launch_block_quantize(values: Sequence[torch.Tensor], value_scales: Sequence[torch.Tensor | None],
                          payloads: Sequence[torch.Tensor], scales: Sequence[torch.Tensor],
                          blocks: Sequence[tuple[int, int]], bad: torch.Tensor | None) -> None:
    """One launch of :func:`block_quantize_kernel`: each 2-D FP8 ``payloads[i]`` and its scale grid ``scales[i]``
    become ``values[i]`` (contiguous, as many elements; times ``1 / value_scales[i]`` where given) quantized per
    ``blocks[i]`` (rows, cols; resolved sizes), unless ``bad`` is set."""
    if not payloads:
        return
    rows, largest = [], 1
    for v, vs, p, s, (br, bc) in zip(values, value_scales, payloads, scales, blocks):
        m, n = p.shape
        rows.append([v.data_ptr(), format_code(v.dtype), 0 if vs is None else vs.data_ptr(), p.data_ptr(),
                     format_code(p.dtype), s.data_ptr(), m, n, br, bc])
        largest = max(largest, -(-m // br) * -(-n // bc))
    table = device_table(rows + [[0] * 10], torch.int64, payloads[0].device)  # a last row of zeros: "not bad"
    flag = bad if bad is not None else table[-1].view(torch.int32)[:1]
    tile_rows = 1 if all(br == 1 for br, _ in blocks) else 16  # row-wise scales: one row per block
    block_quantize_kernel[(largest, len(rows))](table, flag, ROWS_PER_TILE=tile_rows, CHUNK=BLOCK_CHUNK)


def launch_dequantize(payloads: Sequence[torch.Tensor], scales: Sequence[torch.Tensor | None],
                      outs: Sequence[torch.Tensor]) -> None:
    """One launch: ``outs[i] = payloads[i] * (1 / scales[i])`` in ``outs[i]``'s dtype (no scale: a cast)."""
    rows = [[p.data_ptr(), format_code(p.dtype), 0 if s is None else s.data_ptr(), o.data_ptr(), format_code(o.dtype),
             p.numel()] for p, s, o in zip(payloads, scales, outs)]
    device = outs[0].device if outs else torch.device("cpu")
    _elementwise(dequantize_kernel, rows, [p.numel() for p in payloads], device)


def launch_copy(sources: Sequence[torch.Tensor], destinations: Sequence[torch.Tensor],
                unless_ok: torch.Tensor | None = None) -> None:
    """One launch: the bytes of each source into its destination (contiguous, same size); with ``unless_ok`` (0-d
    bool) only where it is False."""
    rows = [[s.data_ptr(), d.data_ptr(), s.numel() * s.element_size()] for s, d in zip(sources, destinations)]
    nbytes = [r[2] for r in rows]
    device = destinations[0].device if destinations else torch.device("cpu")
    ok = unless_ok.view(torch.uint8) if unless_ok is not None else torch.empty(1, dtype=torch.uint8, device=device)
    _elementwise(copy_kernel, rows, nbytes, device, ok, UNLESS_OK=unless_ok is not None)


def launch_sq_sums(tensors: Sequence[torch.Tensor], out: torch.Tensor, inf_norm: bool) -> None:
    """One launch: ``out[i]`` (fp32, zeroed) accumulates the sum of squares of ``tensors[i]`` (``inf_norm``: its
    amax, as int32 bits)."""
    _elementwise(sq_sum_kernel, _flat_rows(tensors), [t.numel() for t in tensors], out.device, out.data_ptr(),
                 INF_NORM=inf_norm)


def state_table(weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales, exp_avg_sq_scales,
                param_scales, steps, kinds: Sequence[int], moments: Sequence[int], scratch: torch.Tensor):
    """``(rows, fmax rows)`` of the state table (:data:`STATE_TABLE_COLUMNS`) of a list of parameters: ``kinds[i]``
    is 0 for a parameter that is its own fp32 master (``weights[i]`` is the parameter), 1 for a 16-bit parameter
    with an fp32 master (``params[i]``, refreshed from it), 2 for an FP8 weight (payload ``params[i]``, scale
    ``param_scales[i]``), 3 for a block-scaled FP8 weight (its master updated here, the weight refreshed from it
    afterwards by :func:`block_quantize_kernel`); ``moments[i]`` (0, 1 or 2): how many of ``exp_avgs[i]``, ``exp_avg_sqs[i]`` hold states. Missing
    tensors take ``scratch``'s address (never written)."""
    rows, fmaxes = [], []
    sc = scratch.data_ptr()
    for i, kind in enumerate(kinds):
        w, m, v, p = weights[i], exp_avgs[i], exp_avg_sqs[i], params[i]
        has_m, has_v, has_master, has_p = moments[i] >= 1, moments[i] >= 2, kind != 0, kind in (1, 2)
        m_dtype = m.dtype if has_m else torch.float32
        v_dtype = v.dtype if has_v else torch.float32
        p_dtype = p.dtype if has_p else torch.float32
        addrs = (w.data_ptr(), m.data_ptr() if has_m else sc, v.data_ptr() if has_v else sc,
                 p.data_ptr() if has_p else sc, weight_scales[i].data_ptr() if has_master else sc,
                 exp_avg_scales[i].data_ptr() if has_m else sc, exp_avg_sq_scales[i].data_ptr() if has_v else sc,
                 param_scales[i].data_ptr() if kind == 2 else sc, steps[i].data_ptr())
        codes = (format_code(w.dtype) | format_code(m_dtype) << 4 | format_code(v_dtype) << 8
                 | format_code(p_dtype) << 12)
        flags = (int(has_m and _scaled(m_dtype)) | int(has_v and _scaled(v_dtype)) << 1
                 | int(kind in (2, 3) and _scaled(w.dtype)) << 2 | int(kind == 2) << 3 | int(has_master) << 4
                 | int(has_p) << 5)
        rows.append([*addrs, w.numel(), codes, flags])
        fmaxes.append([fmax_of(m_dtype), fmax_of(v_dtype), fmax_of(w.dtype), fmax_of(p_dtype)])
    return rows, fmaxes


def _scaled(dtype: torch.dtype) -> bool:
    return fmax_of(dtype) != float("inf")


def launch_prepare_states(table: torch.Tensor, grad_scales: Sequence[torch.Tensor | None], hyper: list,
                          agreed: torch.Tensor | None, old: torch.Tensor, bc: torch.Tensor, amax: torch.Tensor,
                          bad: torch.Tensor, bias_correction: bool) -> None:
    """One launch of :func:`prepare_states_kernel` over the rows of ``table`` (a state table on the device)."""
    device = old.device
    n = table.shape[0]
    gscale = device_table([0 if s is None else s.data_ptr() for s in grad_scales] or [0], torch.int64, device)
    hyper_t = device_table(hyper or [[0.0, 0.0, 0.0]], torch.float64, device)
    ok = agreed.view(torch.uint8) if agreed is not None else bad
    prepare_states_kernel[row_grid(n)](table, gscale, hyper_t, ok, old, bc, amax, bad, n,
                                       HAS_AGREED=agreed is not None, BIAS_CORRECTION=bias_correction,
                                       ROWS_PER_PROGRAM=ROWS)


def launch_state_scales(table: torch.Tensor, fmax: torch.Tensor, amax: torch.Tensor, old: torch.Tensor,
                        new: torch.Tensor, master_dtype: torch.dtype) -> None:
    """One launch of :func:`state_scales_kernel` over the rows of ``table``."""
    n = table.shape[0]
    state_scales_kernel[row_grid(n)](table, fmax, amax, old, new, n, W_FMT=format_code(master_dtype),
                                     ROWS_PER_PROGRAM=ROWS)


def launch_state_stage(kernel, blocks: torch.Tensor, n_blocks: int, table: torch.Tensor, grads: Sequence[torch.Tensor],
                       *args, **kwargs) -> None:
    """One launch of an update pass ``kernel`` (Adam's stage 1 or 2, SGD's) over a group's rows: the gradients'
    table (their addresses change every step) is built and uploaded here."""
    if n_blocks == 0:
        return
    grad_table = device_table([[g.data_ptr(), format_code(g.dtype)] for g in grads], torch.int64, table.device)
    kernel[(n_blocks,)](blocks, table, grad_table, *args, **kwargs)
