"""Precision of each optimizer role (first moment, second moment, master weights), and how a state
tensor is stored: a payload in its storage dtype plus a per-tensor fp32 power-of-two scale.

FP8 and FP16 payloads are scaled so the tensor's amax lands in the top octave of the format (no
overflow, least underflow); BF16 and FP32 payloads are stored unscaled (scale 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scaling import amax_of, power_of_two_scale

__all__ = ["StorageFormat", "STORAGE_FORMATS", "OptimizerPrecision", "PRECISION_PRESETS", "encode", "decode"]


@dataclass(frozen=True)
class StorageFormat:
    """A state storage format: torch dtype and, for scaled formats, the largest finite value."""

    name: str
    dtype: torch.dtype
    scaled_max: float | None  # None: stored unscaled

    @property
    def bytes_per_element(self) -> int:
        """Bytes one element of the payload takes."""
        return torch.empty((), dtype=self.dtype).element_size()


STORAGE_FORMATS = {
    "e4m3": StorageFormat("e4m3", torch.float8_e4m3fn, 448.0),
    "e5m2": StorageFormat("e5m2", torch.float8_e5m2, 57344.0),
    "fp16": StorageFormat("fp16", torch.float16, 65504.0),
    "bf16": StorageFormat("bf16", torch.bfloat16, None),
    "fp32": StorageFormat("fp32", torch.float32, None),
}
"""Every storage format by name."""

_ALLOWED = {
    "exp_avg": ("e4m3", "e5m2", "fp16", "bf16", "fp32"),
    # E4M3 is accepted for the second moment only as the FP8-LM ablation: it underflows and diverges.
    "exp_avg_sq": ("fp16", "bf16", "fp32", "e4m3"),
    "master": ("fp16", "bf16", "fp32"),
}


@dataclass(frozen=True)
class OptimizerPrecision:
    """Storage format per optimizer role: ``exp_avg`` (first moment / momentum), ``exp_avg_sq``
    (second moment) and ``master`` (master copy of each FP8 weight; 16-bit high-precision
    parameters always keep an fp32 master).

    ``PRECISION_PRESETS["O1"]`` is fp32/fp32/fp32; ``PRECISION_PRESETS["O2"]`` is the FP8-LM recipe
    e4m3/fp16/fp16 (each with a per-tensor scale).
    """

    exp_avg: str = "e4m3"
    exp_avg_sq: str = "fp16"
    master: str = "fp16"

    def __post_init__(self) -> None:
        for role, allowed in _ALLOWED.items():
            value = getattr(self, role)
            if value not in allowed:
                raise ValueError(f"OptimizerPrecision.{role}={value!r} is not supported; choose one of {allowed}")

    def format(self, role: str) -> StorageFormat:
        """The :class:`StorageFormat` of ``role`` (``"exp_avg"``, ``"exp_avg_sq"`` or ``"master"``)."""
        return STORAGE_FORMATS[getattr(self, role)]

    @classmethod
    def preset(cls, name: str) -> "OptimizerPrecision":
        """The named preset (``"O1"`` or ``"O2"``)."""
        if name not in PRECISION_PRESETS:
            raise ValueError(f"unknown precision preset {name!r}; choose one of {tuple(PRECISION_PRESETS)}")
        return PRECISION_PRESETS[name]


PRECISION_PRESETS = {
    "O1": OptimizerPrecision(exp_avg="fp32", exp_avg_sq="fp32", master="fp32"),
    "O2": OptimizerPrecision(exp_avg="e4m3", exp_avg_sq="fp16", master="fp16"),
}
"""Named precision presets."""


def encode(value: torch.Tensor, fmt: StorageFormat, previous_scale: torch.Tensor | None = None):
    """``(payload, scale)`` storing fp32 ``value`` in ``fmt``: scaled formats get a power-of-two scale
    from ``value``'s amax (computed on device, no host sync); unscaled ones get scale 1."""
    if fmt.scaled_max is None:
        scale = torch.ones((), dtype=torch.float32, device=value.device)
        return value.to(fmt.dtype), scale
    scale = power_of_two_scale(amax_of(value), fmt.scaled_max, previous=previous_scale)
    payload = (value * scale).clamp_(-fmt.scaled_max, fmt.scaled_max).to(fmt.dtype)
    return payload, scale


def decode(payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 value of a stored state: ``payload / scale`` (exact: the scale is a power of two)."""
    return payload.to(torch.float32) * scale.reciprocal()
