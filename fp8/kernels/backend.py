"""Which implementation a kernel call runs: Triton (CUDA tensors, or the interpreter when asked) or torch.

Triton is an optional dependency: it is imported here only when a caller asks whether it can be used,
never when :mod:`fp8` is imported. ``backend="auto"`` picks Triton for CUDA tensors when Triton is
installed and the torch reference everywhere else (and while ``torch.compile`` traces: Inductor fuses
the reference into its own kernels); ``backend="triton"`` forces Triton (on CPU tensors
only under ``TRITON_INTERPRET=1``, which is how the tests run the kernels); ``backend="torch"``
forces the reference.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = ["KERNEL_BACKENDS", "triton_available", "interpreter_enabled", "resolve_backend"]

KERNEL_BACKENDS = ("auto", "torch", "triton")
"""``auto``: Triton for CUDA tensors when installed, else torch; ``torch``/``triton`` force one."""

_AVAILABLE: dict[str, bool] = {}


def triton_available() -> bool:
    """Whether Triton can be imported (checked once, without importing it into ``fp8`` at import time)."""
    if "triton" not in _AVAILABLE:
        _AVAILABLE["triton"] = importlib.util.find_spec("triton") is not None
    return _AVAILABLE["triton"]


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET=1`` is set, so Triton kernels run on CPU tensors (tests only: slow)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"`` for a call on ``tensors`` given the requested ``backend``.

    Raises a ``ValueError`` naming the fix when ``"triton"`` is requested but cannot run.
    """
    if backend not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    on_cuda = bool(tensors) and all(t.is_cuda for t in tensors)
    if backend == "auto":
        if torch.compiler.is_compiling():
            return "torch"
        return "triton" if on_cuda and triton_available() and not interpreter_enabled() else "torch"
    if not triton_available():
        raise ValueError("backend='triton' needs Triton: pip install triton (or use backend='auto'/'torch')")
    if not on_cuda and not interpreter_enabled():
        raise ValueError(
            "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before "
            "importing triton (tests), or use backend='auto'/'torch'"
        )
    return "triton"
