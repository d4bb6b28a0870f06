"""Triton kernels of the FP8 Adam/AdamW update (imports Triton).

Stage 1 reads the gradient, the master value and both moments, forms the update in fp32 and
max-reduces the amaxes of the new moments and master (and a non-finite-gradient flag) across all
tensors; stage 2 reads them again, recomputes the same values, and writes the moments, the master and
the refreshed FP8 (or 16-bit) weight once, quantized with the scales the amaxes gave, every store
masked by the device-side finiteness flag (a skipped step writes nothing, and no host sync decides it).
The payloads of current-scaled states need their amax before they can be quantized, hence two passes.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_formats import decode_to_f32, encode_f32

__all__ = ["adam_stage1_kernel", "adam_stage2_kernel"]


@triton.jit
def _adam_math(offs, mask, g_ptr, g_scale_ptr, w_ptr, w_scale_ptr, m_ptr, m_scale_ptr, v_ptr, v_scale_ptr,
               bc1_ptr, bc2_ptr, lr, omb1, beta2, omb2, eps, weight_decay, decay_factor,
               G_FMT: tl.constexpr, W_FMT: tl.constexpr, M_FMT: tl.constexpr, V_FMT: tl.constexpr,
               MAXIMIZE: tl.constexpr, DECOUPLED: tl.constexpr, HAS_DECAY: tl.constexpr):
    g = decode_to_f32(tl.load(g_ptr + offs, mask=mask, other=0), G_FMT) * (1.0 / tl.load(g_scale_ptr))
    if MAXIMIZE:
        g = -g
    w = decode_to_f32(tl.load(w_ptr + offs, mask=mask, other=0), W_FMT) * (1.0 / tl.load(w_scale_ptr))
    if HAS_DECAY:
        if DECOUPLED:
            w = w * decay_factor
        else:
            g = g + weight_decay * w
    m = decode_to_f32(tl.load(m_ptr + offs, mask=mask, other=0), M_FMT) * (1.0 / tl.load(m_scale_ptr))
    v = decode_to_f32(tl.load(v_ptr + offs, mask=mask, other=0), V_FMT) * (1.0 / tl.load(v_scale_ptr))
    m = m + omb1 * (g - m)  # torch.lerp for weights < 0.5
    v = v * beta2 + omb2 * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), tl.load(bc2_ptr)) + eps  # IEEE-rounded, as torch
    w = w - tl.div_rn(m, denom) * tl.load(bc1_ptr)  # bc1_ptr holds lr / bias_correction1
    return g, m, v, w


@triton.jit
def adam_stage1_kernel(g_ptr, g_scale_ptr, w_ptr, w_scale_ptr, m_ptr, m_scale_ptr, v_ptr, v_scale_ptr,
                       bc1_ptr, bc2_ptr, amax_ptr, bad_ptr, numel, lr, omb1, beta2, omb2, eps, weight_decay,
                       decay_factor, G_FMT: tl.constexpr, W_FMT: tl.constexpr, M_FMT: tl.constexpr,
                       V_FMT: tl.constexpr, MAXIMIZE: tl.constexpr, DECOUPLED: tl.constexpr,
                       HAS_DECAY: tl.constexpr, BLOCK: tl.constexpr):
    """Amaxes of the new moments and master (``amax_ptr[0:3]``) and the gradient's non-finite flag."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g, m, v, w = _adam_math(offs, mask, g_ptr, g_scale_ptr, w_ptr, w_scale_ptr, m_ptr, m_scale_ptr, v_ptr,
                            v_scale_ptr, bc1_ptr, bc2_ptr, lr, omb1, beta2, omb2, eps, weight_decay, decay_factor,
                            G_FMT, W_FMT, M_FMT, V_FMT, MAXIMIZE, DECOUPLED, HAS_DECAY)
    finite = tl.abs(g) <= 3.4028234663852886e38
    tl.atomic_max(bad_ptr, tl.max(tl.where(finite | (~mask), 0, 1), axis=0))
    ok = finite & mask
    tl.atomic_max(amax_ptr + 0, tl.max(tl.where(ok, tl.abs(m), 0.0), axis=0))
    tl.atomic_max(amax_ptr + 1, tl.max(tl.where(ok, tl.abs(v), 0.0), axis=0))
    tl.atomic_max(amax_ptr + 2, tl.max(tl.where(ok, tl.abs(w), 0.0), axis=0))


@triton.jit
def _store_scaled(ptr, offs, mask, value, scale, FMAX: tl.constexpr, FMT: tl.constexpr, SCALED: tl.constexpr):
    if SCALED:
        value = tl.minimum(tl.maximum(value * scale, -FMAX), FMAX)
    encoded = encode_f32(value, FMT)
    tl.store(ptr + offs, encoded, mask=mask)
    return decode_to_f32(encoded, FMT)


@triton.jit
def adam_stage2_kernel(g_ptr, g_scale_ptr, w_ptr, w_scale_ptr, m_ptr, m_scale_ptr, v_ptr, v_scale_ptr,
                       bc1_ptr, bc2_ptr, new_scales_ptr, bad_ptr, p_ptr, numel, lr, omb1, beta2, omb2, eps,
                       weight_decay, decay_factor, G_FMT: tl.constexpr, W_FMT: tl.constexpr, M_FMT: tl.constexpr,
                       V_FMT: tl.constexpr, P_FMT: tl.constexpr, M_MAX: tl.constexpr, V_MAX: tl.constexpr,
                       W_MAX: tl.constexpr, P_MAX: tl.constexpr, M_SCALED: tl.constexpr, V_SCALED: tl.constexpr,
                       W_SCALED: tl.constexpr, P_SCALED: tl.constexpr, HAS_PARAM: tl.constexpr,
                       MAXIMIZE: tl.constexpr, DECOUPLED: tl.constexpr, HAS_DECAY: tl.constexpr, BLOCK: tl.constexpr):
    """Write moments, master and (``HAS_PARAM``) the refreshed weight with ``new_scales_ptr[0:4]``
    (moment 1, moment 2, master, weight); nothing is written when ``bad_ptr`` is set."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    skip = tl.load(bad_ptr)
    mask = (offs < numel) & ((offs * 0 + skip) == 0)
    g, m, v, w = _adam_math(offs, mask, g_ptr, g_scale_ptr, w_ptr, w_scale_ptr, m_ptr, m_scale_ptr, v_ptr,
                            v_scale_ptr, bc1_ptr, bc2_ptr, lr, omb1, beta2, omb2, eps, weight_decay, decay_factor,
                            G_FMT, W_FMT, M_FMT, V_FMT, MAXIMIZE, DECOUPLED, HAS_DECAY)
    _store_scaled(m_ptr, offs, mask, m, tl.load(new_scales_ptr + 0), M_MAX, M_FMT, M_SCALED)
    _store_scaled(v_ptr, offs, mask, v, tl.load(new_scales_ptr + 1), V_MAX, V_FMT, V_SCALED)
    master_scale = tl.load(new_scales_ptr + 2)
    stored = _store_scaled(w_ptr, offs, mask, w, master_scale, W_MAX, W_FMT, W_SCALED) * (1.0 / master_scale)
    if HAS_PARAM:
        _store_scaled(p_ptr, offs, mask, stored, tl.load(new_scales_ptr + 3), P_MAX, P_FMT, P_SCALED)
