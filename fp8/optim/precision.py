"""Precision of each optimizer role (first moment, second moment, master weights), and how a state
tensor is stored: a payload in its storage dtype plus a per-tensor fp32 power-of-two scale.

FP8 and FP16 payloads are scaled so the tensor's amax lands in the top octave of the format (no
overflow, least underflow); BF16 and FP32 payloads are stored unscaled (scale 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..scaling import amax_of, power_of_two_scale

__all__ = [
    "StorageFormat", "STORAGE_FORMATS", "OptimizerPrecision", "PRECISION_PRESETS", "STATE_SCALINGS", "encode",
    "encode_delayed", "delayed_or_current_scale", "decode", "DELAYED_HEADROOM",
]


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

STATE_SCALINGS = ("current", "delayed")
"""Accepted values of :attr:`OptimizerPrecision.state_scaling`."""

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

    ``state_scaling`` (opt-in, default ``"current"``): how the scaled states of parameters that keep a
    master (FP8 weights, 16-bit parameters) are scaled. ``"current"``: each stored state's scale comes
    from its own new amax (the fused kernel reads the states twice). ``"delayed"``: from the previous
    step's amax of that state (``state["<key>_amax"]``), a power of two with one extra power of two of
    headroom, so the fused kernel can write the states in the pass that reads them and record the new
    amaxes in that same pass; a state whose new amax does not fit under its delayed scale (or that has
    no history yet: the first step) is written with its current scale instead (never clamped). FP32
    parameters (their own master) keep current scaling in either mode.
    """

    exp_avg: str = "e4m3"
    exp_avg_sq: str = "fp16"
    master: str = "fp16"
    state_scaling: str = "current"

    def __post_init__(self) -> None:
        if self.state_scaling not in STATE_SCALINGS:
            raise ValueError(
                f"OptimizerPrecision.state_scaling={self.state_scaling!r} is not supported; choose one of {STATE_SCALINGS}"
            )
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


DELAYED_HEADROOM = 1
"""Extra powers of two of headroom of a delayed state scale (``margin`` of :func:`power_of_two_scale`)."""


def delayed_or_current_scale(
    amax: torch.Tensor, history_amax: torch.Tensor, fmax: float, previous_scale: torch.Tensor | None
) -> torch.Tensor:
    """The scale a delayed-scaled state is stored with: the delayed scale from ``history_amax`` (the
    previous step's amax; one power of two of headroom) when the new ``amax`` fits under it, else the
    current scale from ``amax`` (as :func:`encode`). No history (amax 0, inf or NaN): current. Elementwise,
    no host sync."""
    delayed = power_of_two_scale(history_amax, fmax, margin=DELAYED_HEADROOM)
    has_history = torch.isfinite(history_amax) & (history_amax > 0)
    fits = has_history & (amax.to(torch.float32) * delayed <= fmax)
    current = power_of_two_scale(amax, fmax, previous=previous_scale)
    return torch.where(fits, delayed, current)


def encode_delayed(
    value: torch.Tensor, fmt: StorageFormat, previous_scale: torch.Tensor | None, history_amax: torch.Tensor
):
    """``(payload, scale, amax)`` storing fp32 ``value`` in ``fmt`` with delayed state scaling (see
    :func:`delayed_or_current_scale`); ``amax`` is ``value``'s amax, the next step's history. Never
    clamps a finite value: a state that outgrew its delayed scale is written with its current scale."""
    amax = amax_of(value)
    if fmt.scaled_max is None:
        return value.to(fmt.dtype), torch.ones((), dtype=torch.float32, device=value.device), amax
    scale = delayed_or_current_scale(amax, history_amax, fmt.scaled_max, previous_scale)
    payload = (value * scale).clamp_(-fmt.scaled_max, fmt.scaled_max).to(fmt.dtype)
    return payload, scale, amax


def decode(payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 value of a stored state: ``payload / scale`` (exact: the scale is a power of two)."""
    return payload.to(torch.float32) * scale.reciprocal()
