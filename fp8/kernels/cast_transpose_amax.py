"""``cast_transpose_amax``: read a high-precision 2-D tensor once; write its FP8 cast, its FP8
transpose and its amax (the delayed-scaling step: the scale is known before the tensor is read).

The torch reference here is the CPU path and the test oracle; the Triton kernel
(:mod:`fp8.kernels.triton_cast`) runs for CUDA tensors when Triton is installed.
"""

from __future__ import annotations

import torch

from ..cast import quantize
from ..formats import FP8Format, get_format
from .backend import resolve_backend

__all__ = ["cast_transpose_amax", "cast_transpose_amax_reference", "amax_unless"]

_NAN_BITS = 0x7F  # the NaN written for an inf/NaN input (positive NaN, in E4M3 and E5M2)


def cast_transpose_amax_reference(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format | str, transpose: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Torch reference of :func:`cast_transpose_amax` (same contract, same bits)."""
    fmt = get_format(fmt)
    data = quantize(x, scale, fmt).view(torch.uint8)
    data = torch.where(torch.isfinite(x), data, torch.full_like(data, _NAN_BITS)).view(fmt.dtype)
    amax = x.detach().abs().amax().to(torch.float32) if x.numel() else torch.zeros((), device=x.device)
    return data, (data.t().contiguous() if transpose else None), amax


def cast_transpose_amax(
    x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format | str, transpose: bool = True, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(data, data_t, amax)`` of a 2-D ``x`` cast with ``scale`` to ``fmt``.

    ``data`` is ``quantize(x, scale, fmt)`` (row-major), ``data_t`` its transpose (row-major; None when
    ``transpose=False``), ``amax`` the 0-d fp32 ``x.abs().amax()``, non-finite when ``x`` holds inf or
    NaN. Elements that are inf or NaN are written as NaN (0x7F; never saturated), so they reach the gradients.
    ``backend``: see :func:`fp8.kernels.backend.resolve_backend`.
    """
    fmt = get_format(fmt)
    if x.dim() != 2:
        raise ValueError(f"cast_transpose_amax expects a 2-D tensor, got shape {tuple(x.shape)}")
    if resolve_backend(backend, x, scale) == "torch":
        return cast_transpose_amax_reference(x, scale, fmt, transpose)
    from .triton_cast import launch_cast_transpose_amax

    data, data_t, amax, nonfinite = launch_cast_transpose_amax(x, scale.reshape(()), fmt.dtype, transpose)
    return data, data_t, torch.where(nonfinite > 0, torch.full_like(amax, float("nan")), amax)


def amax_unless(x: torch.Tensor, skip: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """``x.abs().amax()`` (0-d fp32) or 0 when the 0-d bool ``skip`` is set; the Triton path reads
    nothing of ``x`` then (no host sync: the flag is read on device)."""
    if resolve_backend(backend, x, skip) == "torch":
        amax = x.detach().abs().amax().to(torch.float32) if x.numel() else torch.zeros((), device=x.device)
        return torch.where(skip, torch.zeros_like(amax), amax)
    from .triton_cast import launch_amax_unless

    return launch_amax_unless(x, skip)
