"""FP8 facts in one place: E4M3 and E5M2 as native ``torch.float8_*`` dtypes, their ranges, and their byte view."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FP8Format", "E4M3", "E5M2", "FP8_DTYPES", "get_format", "byte_view"]


@dataclass(frozen=True)
class FP8Format:
    """One 8-bit floating-point format: its torch dtype and numeric range.

    ``max`` is the largest finite magnitude, ``min_normal`` the smallest normal magnitude and
    ``mantissa_bits`` the explicit mantissa width (so the relative rounding error of a
    round-to-nearest cast of a normal value is at most ``2 ** -(mantissa_bits + 1)``).
    """

    name: str
    dtype: torch.dtype
    max: float
    min_normal: float
    mantissa_bits: int

    @property
    def max_relative_error(self) -> float:
        """Largest relative rounding error of a cast of a value inside the normal range."""
        return 2.0 ** -(self.mantissa_bits + 1)

    def __str__(self) -> str:
        return self.name


E4M3 = FP8Format("e4m3", torch.float8_e4m3fn, max=448.0, min_normal=2.0**-6, mantissa_bits=3)
"""Forward format (weights, activations): more precision, range +-448."""

E5M2 = FP8Format("e5m2", torch.float8_e5m2, max=57344.0, min_normal=2.0**-14, mantissa_bits=2)
"""Backward format (output gradients): more range, +-57344."""

FP8_DTYPES = (E4M3.dtype, E5M2.dtype)
"""The torch dtypes of FP8 storage."""

_BY_NAME = {"e4m3": E4M3, "e5m2": E5M2}
_BY_DTYPE = {E4M3.dtype: E4M3, E5M2.dtype: E5M2}


def get_format(fmt: str | torch.dtype | FP8Format) -> FP8Format:
    """Return the :class:`FP8Format` for a name (``"e4m3"``/``"e5m2"``), a torch float8 dtype or a format."""
    if isinstance(fmt, FP8Format):
        return fmt
    if isinstance(fmt, torch.dtype):
        if fmt not in _BY_DTYPE:
            raise ValueError(f"{fmt} is not a supported FP8 dtype; use torch.float8_e4m3fn or torch.float8_e5m2")
        return _BY_DTYPE[fmt]
    key = str(fmt).lower()
    if key not in _BY_NAME:
        raise ValueError(f"unknown FP8 format {fmt!r}; use 'e4m3' or 'e5m2'")
    return _BY_NAME[key]


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor (or packed FP4, ``torch.float4_e2m1fn_x2``: NVFP4's payloads) as ``uint8`` (the same bytes, no
    conversion: how FP8 crosses collectives and files); any other tensor unchanged."""
    return tensor.view(torch.uint8) if tensor.dtype in FP8_DTYPES or tensor.dtype == torch.float4_e2m1fn_x2 else tensor
