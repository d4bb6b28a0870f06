"""FP8 x FP8 GEMM: ``torch._scaled_mm`` where it can run, an exact emulation elsewhere.

``fp8_mm(a, b)`` multiplies ``a`` (M x K) by ``b`` (K x N), both :class:`fp8.Float8Tensor`, with fp32
accumulation (operands are taken by their payload and scale: :mod:`fp8.tensor` imports this module for
its ``mm``/``linear``/``@`` handlers, so this one does not import it). The hardware path follows ``torch._scaled_mm``'s rules as the GPU enforces them
(CPU is more lenient, so they are checked here on every device): ``a`` row-major, ``b``
column-major, K and N multiples of 16, not both operands E5M2, and a CPU or a CUDA GPU of compute
capability >= 8.9. The emulated path dequantizes to fp32 and runs an fp32 matmul; on CPU it
equals ``_scaled_mm`` bit for bit, and ``backend="auto"`` takes it there (:data:`GEMM_BACKENDS`: CPU
``_scaled_mm`` is orders of magnitude slower); ``backend="scaled_mm"`` runs ``torch._scaled_mm`` on the CPU too.

Finer scales (:mod:`fp8.blocks`): an operand's scale may be a grid of block scales, given with its block
(``a_block``/``b_block``; ``None`` for a 0-d tensor-wise scale). Scales constant along K (per-row scales
of ``a``, per-column scales of ``b``) run ``torch._scaled_mm``'s row-wise scaling (CPU; CUDA with a bf16
output); scales that vary along K in 128-element blocks (DeepSeek-style ``1x128`` x ``128x128``) run the
Triton block GEMM on CUDA (:mod:`fp8.kernels.triton_block_gemm`) when it is installed, and the exact
emulation elsewhere; any other layout is emulated. Each fallback is logged once per reason.
"""

from __future__ import annotations

import logging

import torch

from .blocks import Block, dequantize_blocks, expand_scales, is_tensorwise, scales_constant_along
from .cast import payload_and_scale
from .formats import E5M2

__all__ = ["fp8_mm", "fp8_mm_payload", "scaled_mm_supported", "scaled_mm_problem", "GEMM_BACKENDS"]

logger = logging.getLogger(__name__)

GEMM_BACKENDS = ("auto", "scaled_mm", "emulated")
"""``auto`` picks ``scaled_mm`` on a CUDA GPU where it can run and ``emulated`` elsewhere, the CPU included (there
the two are bit-identical and torch 2.13's CPU ``_scaled_mm`` is a reference loop: measured 300-1,300x slower
than the emulation on 2 cores, e.g. 7.7 s against 0.04 s for 1024 x 512 x 512); the others force one."""


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 on ``device`` (CPU, or CUDA compute capability >= 8.9)."""
    if device.type == "cpu":
        return hasattr(torch, "_scaled_mm")
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return False


def scaled_mm_problem(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why ``torch._scaled_mm`` cannot take ``a @ b`` (shape and format rules), or None if it can."""
    if a.dim() != 2 or b.dim() != 2:
        return f"operands must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}"
    k, n = b.shape
    if a.shape[1] % 16 or k % 16 or n % 16:
        return (
            f"shapes {tuple(a.shape)} @ {tuple(b.shape)}: K and N must be multiples of 16 (for a linear "
            f"layer: its in/out features, and for its weight-gradient GEMM the number of tokens, batch x "
            f"sequence; pad them to multiples of 16)"
        )
    if a.dtype == E5M2.dtype and b.dtype == E5M2.dtype:
        return "both operands are E5M2; one must be E4M3"
    return None


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) == t.shape[1]


def _col_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


def _emulated_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                 out_dtype: torch.dtype, a_block: Block | None = None, b_block: Block | None = None) -> torch.Tensor:
    return torch.mm(dequantize_blocks(a, a_scale, a_block), dequantize_blocks(b, b_scale, b_block)).to(out_dtype)


def _outer_scales(a, a_scale, a_block, b, b_scale, b_block) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise dequantization scales ``(M, 1)`` and ``(1, N)`` of operands whose scales are constant along K."""
    m, n = a.shape[0], b.shape[1]
    if is_tensorwise(a_block):
        sa = a_scale.reshape(1, 1).expand(m, 1)
    else:
        sa = expand_scales(a_scale, a_block, tuple(a.shape))[:, :1]
    if is_tensorwise(b_block):
        sb = b_scale.reshape(1, 1).expand(1, n)
    else:
        sb = expand_scales(b_scale, b_block, tuple(b.shape))[:1, :]
    return sa.reciprocal().contiguous(), sb.reciprocal().contiguous()


def _hardware_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    lhs = a if _row_major(a) else a.contiguous()
    rhs = b if _col_major(b) else b.t().contiguous().t()
    return torch._scaled_mm(lhs, rhs, scale_a=a_scale.reciprocal(), scale_b=b_scale.reciprocal(), out_dtype=out_dtype)


def fp8_mm_payload(
    a_payload: torch.Tensor,
    a_scale: torch.Tensor,
    b_payload: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    a_block: Block | None = None,
    b_block: Block | None = None,
) -> torch.Tensor:
    """:func:`fp8_mm` on plain FP8 payloads (``torch.float8_*`` tensors, ``a_payload`` M x K and
    ``b_payload`` K x N) and their 0-d fp32 scales (value = payload / scale): same rules, same
    fallback, same errors, same bits. Taking plain tensors (no :class:`Float8Tensor` built or
    unwrapped) keeps callers free of graph breaks under ``torch.compile``; the FP8 linear calls it
    inside its autograd function. ``a_block``/``b_block`` give the block of a scale grid (module docstring)."""
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"backend must be one of {GEMM_BACKENDS}, got {backend!r}")
    if a_payload.dim() != 2 or b_payload.dim() != 2 or a_payload.shape[1] != b_payload.shape[0]:
        raise ValueError(f"fp8_mm: cannot multiply {tuple(a_payload.shape)} by {tuple(b_payload.shape)}")
    if backend == "emulated" or (backend == "auto" and a_payload.device.type == "cpu"):
        return _emulated_mm(a_payload, a_scale, b_payload, b_scale, out_dtype, a_block, b_block)
    if not (is_tensorwise(a_block) and is_tensorwise(b_block)):
        return _block_scaled_mm(a_payload, a_scale, a_block, b_payload, b_scale, b_block, out_dtype, backend)
    problem = scaled_mm_problem(a_payload, b_payload)
    if problem is None and not scaled_mm_supported(a_payload.device):
        problem = (
            f"torch._scaled_mm has no FP8 support on {a_payload.device} (needs a CPU or a CUDA GPU of compute "
            f"capability >= 8.9, e.g. H100/H200/L40/RTX 4090); use gemm_backend='emulated'"
        )
    if problem is None:
        return _hardware_mm(a_payload, a_scale, b_payload, b_scale, out_dtype)
    if backend == "scaled_mm":
        raise ValueError(f"fp8_mm(backend='scaled_mm'): {problem}")
    _log_fallback(problem)
    return _emulated_mm(a_payload, a_scale, b_payload, b_scale, out_dtype)


def _block_scaled_mm(a, a_scale, a_block, b, b_scale, b_block, out_dtype, backend):
    """GEMM of operands with block scale grids (module docstring): row-wise ``_scaled_mm``, the Triton block
    GEMM on CUDA, or the exact emulation (``backend`` is ``"auto"`` or ``"scaled_mm"`` here)."""
    problem = None
    if scales_constant_along(a_block, tuple(a.shape), 1) and scales_constant_along(b_block, tuple(b.shape), 0):
        problem = scaled_mm_problem(a, b)
        if problem is None and not scaled_mm_supported(a.device):
            problem = f"torch._scaled_mm has no FP8 support on {a.device}"
        if problem is None and a.device.type == "cuda" and out_dtype != torch.bfloat16:
            problem = "row-wise torch._scaled_mm on CUDA writes bfloat16 only (the model's dtype is not bfloat16)"
        if problem is None:
            lhs = a if _row_major(a) else a.contiguous()
            rhs = b if _col_major(b) else b.t().contiguous().t()
            sa, sb = _outer_scales(a, a_scale, a_block, b, b_scale, b_block)
            return torch._scaled_mm(lhs, rhs, scale_a=sa, scale_b=sb, out_dtype=out_dtype)
    elif a.device.type == "cuda":
        from .kernels.triton_block_gemm import block_mm_problem, block_mm

        problem = block_mm_problem(a, a_block, b, b_block)
        if problem is None:
            return block_mm(a, a_scale, a_block, b, b_scale, b_block, out_dtype)
    else:
        problem = f"block scales that vary along K ({a_block} x {b_block}) have no torch._scaled_mm path on {a.device}"
    if backend == "scaled_mm":
        raise ValueError(f"fp8_mm(backend='scaled_mm'): {problem}; use backend='auto' or 'emulated'")
    _log_fallback(problem)
    return _emulated_mm(a, a_scale, b, b_scale, out_dtype, a_block, b_block)


def fp8_mm(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32, backend: str = "auto"
) -> torch.Tensor:
    """``a @ b`` for FP8 operands ``a`` (M x K) and ``b`` (K x N), accumulated in fp32, in ``out_dtype``.

    ``backend="scaled_mm"`` raises a ``ValueError`` naming the fix when the hardware path cannot
    run; ``"auto"`` falls back to the emulated path then (logged once per reason). The work is
    :func:`fp8_mm_payload`'s, on the operands' payloads and scales.
    """
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"backend must be one of {GEMM_BACKENDS}, got {backend!r}")
    a_parts, b_parts = payload_and_scale(a), payload_and_scale(b)
    if a_parts is None or b_parts is None:
        raise TypeError("fp8_mm takes two Float8Tensor operands; quantize with fp8.to_float8 first")
    return fp8_mm_payload(*a_parts, *b_parts, out_dtype, backend)


_LOGGED_FALLBACKS: set[str] = set()


def _log_fallback(problem: str) -> None:
    if problem not in _LOGGED_FALLBACKS:
        _LOGGED_FALLBACKS.add(problem)
        logger.info("fp8_mm: using the emulated GEMM: %s", problem)
