"""Fused kernels (Triton, CUDA only; optional) with their torch references.

Nothing here imports Triton at ``import fp8`` time: the Triton modules (``triton_*.py``) are imported
on first use, only when :func:`fp8.kernels.backend.resolve_backend` picks Triton (CUDA tensors with
Triton installed, or ``backend="triton"`` under ``TRITON_INTERPRET=1`` in tests). The torch references
are the CPU path and the tests' oracle. Kernels work on plain tensors (FP8 payloads and their scales) and
never import :mod:`fp8.tensor`; it imports them.
"""

from .backend import KERNEL_BACKENDS, interpreter_enabled, resolve_backend, triton_available
from .cast_transpose_amax import amax_unless, cast_transpose_amax, cast_transpose_amax_reference
from .grad_accumulate import (
    accumulate_fp8_grad, accumulate_fp8_grad_reference, accumulate_fp8_payload, accumulate_fp8_payload_reference,
    accumulate_fp16_payload, accumulate_fp16_payload_reference,
)

__all__ = [
    "KERNEL_BACKENDS", "triton_available", "interpreter_enabled", "resolve_backend",
    "cast_transpose_amax", "cast_transpose_amax_reference", "amax_unless",
    "accumulate_fp8_grad", "accumulate_fp8_grad_reference", "accumulate_fp8_payload",
    "accumulate_fp8_payload_reference", "accumulate_fp16_payload", "accumulate_fp16_payload_reference",
]
