"""Triton kernels of the FP8 Adam/AdamW update, multi-tensor (imports Triton).

One launch per stage covers every tensor of a param group: the grid runs over a block table (tensor
row, block within the tensor), and each program reads its tensor's addresses, element count, storage
formats and flags from a per-group table (the apex/torchao ``multi_tensor_apply`` idea, with the
addresses held in an int64 table and cast to typed pointers in the kernel). Formats are runtime codes
(:data:`fp8.kernels.triton_formats.FORMAT_CODES`), so FP8 weights, FP32 and BF16 parameters share one
launch.

Stage 1 reads the gradient, the master value and both moments, forms the update in fp32 and
max-reduces, per tensor, the amaxes of the new moments and master (and one non-finite-gradient flag
for the whole step); stage 2 reads them again, recomputes the same values, and writes the moments, the
master and the refreshed FP8 (or 16-bit) weight once, quantized with the scales the amaxes gave; the
first program of each tensor also writes its new scales and its step count. Every store is masked by
the device-side flag (a skipped step writes nothing, and no host sync decides it). Both stages decode
with the old scales, passed as a table, so stage 2 may overwrite the scale tensors while it runs.
The payloads of current-scaled states need their amax before they can be quantized, hence two passes.
With delayed state scaling (opt-in) the scales are known before the pass: :func:`adam_delayed_kernel`
reads and writes once, :func:`adam_delayed_fixup_kernel` recomputes only the tensors that outgrew them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_formats import decode_to_f32, encode_f32, rounding_bits, stochastic_grid

__all__ = [
    "adam_stage1_kernel", "adam_stage2_kernel", "adam_delayed_kernel", "adam_delayed_fixup_kernel", "TABLE_COLUMNS",
    "DELAYED_TABLE_COLUMNS", "OLD_SCALE_COLUMNS",
]

TABLE_COLUMNS = 12
"""Columns of the int64 tensor table: w, m, v, p addresses; master, m, v, p scale and step addresses;
numel; packed format codes (w | m << 4 | v << 8 | p << 12); flags (m, v, master, p scaled; has a master; has a
param to refresh: :data:`fp8.kernels.triton_multi_tensor.STATE_TABLE_COLUMNS`)."""
DELAYED_TABLE_COLUMNS = 19
"""Columns of the delayed-state-scaling tensor table: the 12 of :data:`TABLE_COLUMNS` (w, m, v addresses
are the inputs), then the output w, m, v payload addresses (the other buffer of each state) and the
addresses of the m, v, master and FP8-weight amax histories."""
OLD_SCALE_COLUMNS = 5
"""Columns of the fp32 old-scale table: gradient, master, m, v, FP8 weight."""


@triton.jit
def _ptr(addr, DTYPE: tl.constexpr):
    return addr.to(tl.pointer_type(DTYPE))


@triton.jit
def _load_f32(addr, offs, mask, fmt):
    """fp32 values of the payload at ``addr`` (format code ``fmt``, a runtime value)."""
    if fmt == 0:
        x = tl.load(_ptr(addr, tl.float32) + offs, mask=mask, other=0.0)
    elif fmt == 1:
        x = decode_to_f32(tl.load(_ptr(addr, tl.int16) + offs, mask=mask, other=0), 1)
    elif fmt == 2:
        x = tl.load(_ptr(addr, tl.float16) + offs, mask=mask, other=0.0).to(tl.float32)
    elif fmt == 3:
        x = decode_to_f32(tl.load(_ptr(addr, tl.uint8) + offs, mask=mask, other=0), 3)
    else:
        x = decode_to_f32(tl.load(_ptr(addr, tl.uint8) + offs, mask=mask, other=0), 4)
    return x


@triton.jit
def _store_f32(addr, offs, mask, value, scale, fmax, fmt, scaled):
    """Store ``value`` (times ``scale``, clamped to +-``fmax`` when ``scaled``) in format ``fmt`` at
    ``addr``; returns the stored element's fp32 value (before unscaling)."""
    if scaled:
        value = tl.minimum(tl.maximum(value * scale, -fmax), fmax)
    if fmt == 0:
        tl.store(_ptr(addr, tl.float32) + offs, value, mask=mask)
        stored = value
    elif fmt == 1:  # one name per branch: Triton types a name defined in several branches once
        bf16_bits = encode_f32(value, 1)
        tl.store(_ptr(addr, tl.int16) + offs, bf16_bits, mask=mask)
        stored = decode_to_f32(bf16_bits, 1)
    elif fmt == 2:
        half = encode_f32(value, 2)
        tl.store(_ptr(addr, tl.float16) + offs, half, mask=mask)
        stored = half.to(tl.float32)
    elif fmt == 3:
        e4m3_bits = encode_f32(value, 3)
        tl.store(_ptr(addr, tl.uint8) + offs, e4m3_bits, mask=mask)
        stored = decode_to_f32(e4m3_bits, 3)
    else:
        e5m2_bits = encode_f32(value, 4)
        tl.store(_ptr(addr, tl.uint8) + offs, e5m2_bits, mask=mask)
        stored = decode_to_f32(e5m2_bits, 4)
    return stored


@triton.jit
def _adam_math(row, offs, mask, table_ptr, grads_ptr, old_ptr, bc_ptr, lr, omb1, beta2, omb2, eps, weight_decay,
               decay_factor, MAXIMIZE: tl.constexpr, DECOUPLED: tl.constexpr, HAS_DECAY: tl.constexpr,
               NCOL: tl.constexpr = 12):
    base = table_ptr + row * NCOL
    codes = tl.load(base + 10)
    g_fmt = tl.load(grads_ptr + row * 2 + 1)
    g = _load_f32(tl.load(grads_ptr + row * 2), offs, mask, g_fmt) * (1.0 / tl.load(old_ptr + row * 5 + 0))
    if MAXIMIZE:
        g = -g
    w = _load_f32(tl.load(base + 0), offs, mask, codes & 15) * (1.0 / tl.load(old_ptr + row * 5 + 1))
    if HAS_DECAY:
        if DECOUPLED:
            w = w * decay_factor
        else:
            g = g + weight_decay * w
    m = _load_f32(tl.load(base + 1), offs, mask, (codes >> 4) & 15) * (1.0 / tl.load(old_ptr + row * 5 + 2))
    v = _load_f32(tl.load(base + 2), offs, mask, (codes >> 8) & 15) * (1.0 / tl.load(old_ptr + row * 5 + 3))
    m = m + omb1 * (g - m)  # torch.lerp for weights < 0.5
    v = v * beta2 + omb2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), tl.load(bc_ptr + row * 2 + 1)) + eps  # IEEE-rounded, as torch
    w = w - tl.div_rn(m, denom) * tl.load(bc_ptr + row * 2)  # column 0 holds lr / bias_correction1
    return g, m, v, w


@triton.jit
def adam_stage1_kernel(blocks_ptr, table_ptr, grads_ptr, old_ptr, bc_ptr, amax_ptr, bad_ptr, lr, omb1, beta2, omb2,
                       eps, weight_decay, decay_factor, MAXIMIZE: tl.constexpr, DECOUPLED: tl.constexpr,
                       HAS_DECAY: tl.constexpr, BLOCK: tl.constexpr):
    """Per tensor row: amaxes of the new moments and master (``amax_ptr[row, 0:3]``); the gradients'
    non-finite flag (``bad_ptr``)."""
    pid = tl.program_id(0)
    row = tl.load(blocks_ptr + pid * 2)
    offs = tl.load(blocks_ptr + pid * 2 + 1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < tl.load(table_ptr + row * 12 + 9)
    g, m, v, w = _adam_math(row, offs, mask, table_ptr, grads_ptr, old_ptr, bc_ptr, lr, omb1, beta2, omb2, eps,
                            weight_decay, decay_factor, MAXIMIZE, DECOUPLED, HAS_DECAY)
    finite = tl.abs(g) <= 3.4028234663852886e38
    tl.atomic_max(bad_ptr, tl.max(tl.where(finite | (~mask), 0, 1), axis=0))
    ok = finite & mask
    tl.atomic_max(amax_ptr + row * 3 + 0, tl.max(tl.where(ok, tl.abs(m), 0.0), axis=0))
    tl.atomic_max(amax_ptr + row * 3 + 1, tl.max(tl.where(ok, tl.abs(v), 0.0), axis=0))
    tl.atomic_max(amax_ptr + row * 3 + 2, tl.max(tl.where(ok, tl.abs(w), 0.0), axis=0))


@triton.jit
def adam_stage2_kernel(blocks_ptr, table_ptr, grads_ptr, old_ptr, bc_ptr, fmax_ptr, new_ptr, bad_ptr, lr, omb1,
                       beta2, omb2, eps, weight_decay, decay_factor, steps_ptr=None, row0=0,
                       MAXIMIZE: tl.constexpr = False, DECOUPLED: tl.constexpr = False,
                       HAS_DECAY: tl.constexpr = False, BLOCK: tl.constexpr = 1024, STOCHASTIC: tl.constexpr = False):
    """Write moments, master and (has param) the refreshed weight with ``new_ptr[row, 0:4]`` (moment 1,
    moment 2, master, weight); the first block of a tensor also writes its new scales and step + 1.
    Nothing is written when ``bad_ptr`` is set. ``STOCHASTIC``: the first moment (FP8/FP16) rounded stochastically
    as the optimizer's row ``row0 + row`` at step ``steps_ptr[row] + 1`` (the counts before this pass: its first
    blocks increment them while the others run; :func:`fp8.kernels.triton_formats.stochastic_grid`)."""
    pid = tl.program_id(0)
    row = tl.load(blocks_ptr + pid * 2)
    blk = tl.load(blocks_ptr + pid * 2 + 1)
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    skip = tl.load(bad_ptr)
    base = table_ptr + row * 12
    mask = (offs < tl.load(base + 9)) & ((offs * 0 + skip) == 0)
    g, m, v, w = _adam_math(row, offs, mask, table_ptr, grads_ptr, old_ptr, bc_ptr, lr, omb1, beta2, omb2, eps,
                            weight_decay, decay_factor, MAXIMIZE, DECOUPLED, HAS_DECAY)
    codes = tl.load(base + 10)
    flags = tl.load(base + 11)
    m_scale = tl.load(new_ptr + row * 4 + 0)
    v_scale = tl.load(new_ptr + row * 4 + 1)
    w_scale = tl.load(new_ptr + row * 4 + 2)
    p_scale = tl.load(new_ptr + row * 4 + 3)
    m_fmt = (codes >> 4) & 15
    m_fmax = tl.load(fmax_ptr + row * 4 + 0)
    if STOCHASTIC:
        if (flags & 1) != 0 and m_fmt >= 2:
            y = tl.minimum(tl.maximum(m * m_scale, -m_fmax), m_fmax)
            step = tl.load(steps_ptr + row) + 1.0  # the step being taken
            m = stochastic_grid(y, rounding_bits(row0 + row, step, offs), m_fmt)
            m_scale = 1.0
    _store_f32(tl.load(base + 1), offs, mask, m, m_scale, m_fmax, m_fmt, (flags & 1) != 0)
    m_scale = tl.load(new_ptr + row * 4 + 0)
    _store_f32(tl.load(base + 2), offs, mask, v, v_scale, tl.load(fmax_ptr + row * 4 + 1), (codes >> 8) & 15,
               (flags & 2) != 0)
    stored = _store_f32(tl.load(base + 0), offs, mask, w, w_scale, tl.load(fmax_ptr + row * 4 + 2), codes & 15,
                        (flags & 4) != 0) * (1.0 / w_scale)
    if (flags & 32) != 0:
        _store_f32(tl.load(base + 3), offs, mask, stored, p_scale, tl.load(fmax_ptr + row * 4 + 3),
                   (codes >> 12) & 15, (flags & 8) != 0)
    if blk == 0:
        if skip == 0:
            tl.store(_ptr(tl.load(base + 5), tl.float32), m_scale)
            tl.store(_ptr(tl.load(base + 6), tl.float32), v_scale)
            if (flags & 16) != 0:
                tl.store(_ptr(tl.load(base + 4), tl.float32), w_scale)
            if (flags & 8) != 0:
                tl.store(_ptr(tl.load(base + 7), tl.float32), p_scale)
            step_ptr = _ptr(tl.load(base + 8), tl.float32)
            tl.store(step_ptr, tl.load(step_ptr) + 1.0)


@triton.jit
def _write_states(base, offs, mask, m, v, w, fmax_ptr, row, m_scale, v_scale, w_scale, p_scale):
    """Store m, v, master into the output buffers (columns 13, 14, 12) and the refreshed weight."""
    codes = tl.load(base + 10)
    flags = tl.load(base + 11)
    _store_f32(tl.load(base + 13), offs, mask, m, m_scale, tl.load(fmax_ptr + row * 4 + 0), (codes >> 4) & 15,
               (flags & 1) != 0)
    _store_f32(tl.load(base + 14), offs, mask, v, v_scale, tl.load(fmax_ptr + row * 4 + 1), (codes >> 8) & 15,
               (flags & 2) != 0)
    stored = _store_f32(tl.load(base + 12), offs, mask, w, w_scale, tl.load(fmax_ptr + row * 4 + 2), codes & 15,
                        (flags & 4) != 0) * (1.0 / w_scale)
    _store_f32(tl.load(base + 3), offs, mask, stored, p_scale, tl.load(fmax_ptr + row * 4 + 3), (codes >> 12) & 15,
               (flags & 8) != 0)


@triton.jit
def adam_delayed_kernel(blocks_ptr, table_ptr, grads_ptr, old_ptr, bc_ptr, fmax_ptr, delayed_ptr, amax_ptr, bad_ptr,
                        lr, omb1, beta2, omb2, eps, weight_decay, decay_factor, MAXIMIZE: tl.constexpr,
                        DECOUPLED: tl.constexpr, HAS_DECAY: tl.constexpr, BLOCK: tl.constexpr):
    """Delayed state scaling, the single pass: read gradient, master and moments once; write moments and
    master (into their other buffers) and the refreshed weight once, with the delayed scales
    ``delayed_ptr[row, 0:4]`` (moment 1, moment 2, master, weight); max-reduce the new amaxes of the
    moments and master (``amax_ptr[row, 0:3]``) for the next scales and the overflow check. Nothing is
    written when ``bad_ptr`` is set (decided before this pass). Rows for parameters with a master only."""
    pid = tl.program_id(0)
    row = tl.load(blocks_ptr + pid * 2)
    offs = tl.load(blocks_ptr + pid * 2 + 1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    skip = tl.load(bad_ptr)
    base = table_ptr + row * 19
    mask = (offs < tl.load(base + 9)) & ((offs * 0 + skip) == 0)
    g, m, v, w = _adam_math(row, offs, mask, table_ptr, grads_ptr, old_ptr, bc_ptr, lr, omb1, beta2, omb2, eps,
                            weight_decay, decay_factor, MAXIMIZE, DECOUPLED, HAS_DECAY, 19)
    if skip == 0:
        tl.atomic_max(amax_ptr + row * 3 + 0, tl.max(tl.where(mask, tl.abs(m), 0.0), axis=0))
        tl.atomic_max(amax_ptr + row * 3 + 1, tl.max(tl.where(mask, tl.abs(v), 0.0), axis=0))
        tl.atomic_max(amax_ptr + row * 3 + 2, tl.max(tl.where(mask, tl.abs(w), 0.0), axis=0))
    _write_states(base, offs, mask, m, v, w, fmax_ptr, row, tl.load(delayed_ptr + row * 4 + 0),
                  tl.load(delayed_ptr + row * 4 + 1), tl.load(delayed_ptr + row * 4 + 2),
                  tl.load(delayed_ptr + row * 4 + 3))


@triton.jit
def _copy_payload(src, dst, offs, mask, fmt):
    x = _load_f32(src, offs, mask, fmt)
    _store_f32(dst, offs, mask, x, 1.0, 0.0, fmt, False)  # decode/encode round trip: the same bits


@triton.jit
def adam_delayed_fixup_kernel(blocks_ptr, table_ptr, grads_ptr, old_ptr, bc_ptr, fmax_ptr, final_ptr, redo_ptr,
                              hist_ptr, bad_ptr, lr, omb1, beta2, omb2, eps, weight_decay, decay_factor,
                              MAXIMIZE: tl.constexpr, DECOUPLED: tl.constexpr, HAS_DECAY: tl.constexpr,
                              BLOCK: tl.constexpr):
    """After :func:`adam_delayed_kernel`. Rows whose ``redo_ptr[row]`` is set (a state outgrew its delayed
    scale, or had no history) are recomputed from the inputs, which the single pass left intact (it
    wrote the other buffers), and written with ``final_ptr[row, 0:4]`` (current scales where needed);
    other rows' programs read two flags and exit. A skipped step (``bad_ptr``) copies the inputs into the
    output buffers. The first block of each row of a step taken writes the scales, the new amax
    histories (``hist_ptr[row, 0:4]``) and step + 1."""
    pid = tl.program_id(0)
    row = tl.load(blocks_ptr + pid * 2)
    blk = tl.load(blocks_ptr + pid * 2 + 1)
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    skip = tl.load(bad_ptr)
    base = table_ptr + row * 19
    mask = offs < tl.load(base + 9)
    codes = tl.load(base + 10)
    if skip != 0:
        _copy_payload(tl.load(base + 0), tl.load(base + 12), offs, mask, codes & 15)
        _copy_payload(tl.load(base + 1), tl.load(base + 13), offs, mask, (codes >> 4) & 15)
        _copy_payload(tl.load(base + 2), tl.load(base + 14), offs, mask, (codes >> 8) & 15)
    else:
        if tl.load(redo_ptr + row) != 0:
            g, m, v, w = _adam_math(row, offs, mask, table_ptr, grads_ptr, old_ptr, bc_ptr, lr, omb1, beta2, omb2,
                                    eps, weight_decay, decay_factor, MAXIMIZE, DECOUPLED, HAS_DECAY, 19)
            _write_states(base, offs, mask, m, v, w, fmax_ptr, row, tl.load(final_ptr + row * 4 + 0),
                          tl.load(final_ptr + row * 4 + 1), tl.load(final_ptr + row * 4 + 2),
                          tl.load(final_ptr + row * 4 + 3))
        if blk == 0:
            flags = tl.load(base + 11)
            tl.store(_ptr(tl.load(base + 5), tl.float32), tl.load(final_ptr + row * 4 + 0))
            tl.store(_ptr(tl.load(base + 6), tl.float32), tl.load(final_ptr + row * 4 + 1))
            tl.store(_ptr(tl.load(base + 4), tl.float32), tl.load(final_ptr + row * 4 + 2))
            if (flags & 8) != 0:
                tl.store(_ptr(tl.load(base + 7), tl.float32), tl.load(final_ptr + row * 4 + 3))
            for k in tl.static_range(4):
                tl.store(_ptr(tl.load(base + 15 + k), tl.float32), tl.load(hist_ptr + row * 4 + k))
            step_ptr = _ptr(tl.load(base + 8), tl.float32)
            tl.store(step_ptr, tl.load(step_ptr) + 1.0)
