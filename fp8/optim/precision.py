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
    "StorageFormat", "STORAGE_FORMATS", "OptimizerPrecision", "PRECISION_PRESETS", "STATE_SCALINGS", "ROUNDINGS",
    "encode", "encode_delayed", "delayed_or_current_scale", "decode", "DELAYED_HEADROOM", "STOCHASTIC_BITS",
    "STOCHASTIC_GRIDS", "rounding_bits", "stochastic_grid", "round_stochastically", "ROUNDING_CHUNK",
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

ROUNDINGS = ("nearest", "stochastic")
"""Accepted values of :attr:`OptimizerPrecision.exp_avg_rounding`."""

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
    exp_avg_rounding: str = "nearest"
    """How the first moment (SGD: the momentum buffer) is rounded into ``exp_avg``'s format: ``"nearest"`` (round to
    nearest even) or ``"stochastic"`` (up or down with probabilities that make the stored value's expectation the
    exact one, from counter-based random bits of the parameter's row, the step and the element: :func:`rounding_bits`,
    :func:`stochastic_grid`). With 3 mantissa bits (E4M3) round to nearest leaves an element of Adam's running mean
    unchanged while ``(1 - beta1) * |g - m|`` is below half its spacing (``|m| / 32`` to ``|m| / 16``), so near a minimum
    it goes stale; stochastic rounding moves it by the right amount on average. For FP8 and FP16 first moments, with
    current state scaling. The bits are a pure function of (row, step, element): nothing to checkpoint, a resumed run
    continues bit for bit."""

    def __post_init__(self) -> None:
        if self.state_scaling not in STATE_SCALINGS:
            raise ValueError(
                f"OptimizerPrecision.state_scaling={self.state_scaling!r} is not supported; choose one of {STATE_SCALINGS}"
            )
        if self.exp_avg_rounding not in ROUNDINGS:
            raise ValueError(f"OptimizerPrecision.exp_avg_rounding={self.exp_avg_rounding!r} is not supported; choose "
                             f"one of {ROUNDINGS}")
        for role, allowed in _ALLOWED.items():
            value = getattr(self, role)
            if value not in allowed:
                raise ValueError(f"OptimizerPrecision.{role}={value!r} is not supported; choose one of {allowed}")
        if self.exp_avg_rounding == "stochastic":
            if STORAGE_FORMATS[self.exp_avg].dtype not in STOCHASTIC_GRIDS:
                raise ValueError(
                    f"OptimizerPrecision(exp_avg_rounding='stochastic') rounds FP8 and FP16 first moments, not "
                    f"exp_avg={self.exp_avg!r}: use exp_avg='e4m3', 'e5m2' or 'fp16', or exp_avg_rounding='nearest'")
            if self.state_scaling != "current":
                raise ValueError(
                    "OptimizerPrecision(exp_avg_rounding='stochastic') runs with current state scaling only: set "
                    "state_scaling='current' (the default)")

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


def encode(value: torch.Tensor, fmt: StorageFormat, previous_scale: torch.Tensor | None = None,
           stochastic: tuple[int, torch.Tensor] | None = None):
    """``(payload, scale)`` storing fp32 ``value`` in ``fmt``: scaled formats get a power-of-two scale
    from ``value``'s amax (computed on device, no host sync); unscaled ones get scale 1. With ``stochastic``
    (``(row, step)``: :func:`rounding_bits`'s) the payload is rounded stochastically (:func:`round_stochastically`)."""
    if stochastic is not None and fmt.dtype not in STOCHASTIC_GRIDS:
        raise ValueError(f"stochastic rounding stores into {tuple(STOCHASTIC_GRIDS)}, not {fmt.dtype}: pass "
                         f"stochastic=None")
    if fmt.scaled_max is None:
        scale = torch.ones((), dtype=torch.float32, device=value.device)
        return value.to(fmt.dtype), scale
    scale = power_of_two_scale(amax_of(value), fmt.scaled_max, previous=previous_scale)
    payload = (value * scale).clamp_(-fmt.scaled_max, fmt.scaled_max)
    if stochastic is not None:
        payload = round_stochastically(payload, *stochastic, fmt.dtype)
    return payload.to(fmt.dtype), scale


# -- stochastic rounding (OptimizerPrecision.exp_avg_rounding="stochastic") -----------------------------------------
STOCHASTIC_BITS = 20
"""Random bits per element of :func:`rounding_bits`: a value rounds up with probability ``ceil(f * 2**20) / 2**20``
for its fraction ``f`` of the spacing, unbiased to ``2**-20`` of a spacing."""

STOCHASTIC_GRIDS = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14), torch.float16: (10, -14)}
"""``{dtype: (mantissa bits, smallest normal exponent)}`` of the formats :func:`stochastic_grid` rounds into: the
spacing of the values near ``y`` is ``2 ** (max(floor(log2 |y|), emin) - mantissa)``."""

_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """``x * c mod 2**32`` for ``x`` in [0, 2**32) (an int or an int64 tensor) without an int64 overflow."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x):
    """A 32-bit integer hash (lowbias32) of ``x`` in [0, 2**32): an int or an int64 tensor, elementwise."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def rounding_bits(row: int, step: torch.Tensor, numel: int, start: int = 0) -> torch.Tensor:
    """int64 ``(numel,)``: :data:`STOCHASTIC_BITS` uniform random bits for elements ``start`` to ``start + numel`` of
    the optimizer's row ``row`` (its position among the parameters the optimizer steps) at ``step`` (a 0-d device
    tensor: the step being taken, 1-based), a counter-based hash of (row, step, element) that the Triton kernels
    compute the same way (``fp8.kernels.triton_formats.rounding_bits``). No state, no host read."""
    key = _mix32((row & _M32) ^ 0x5BD1E995)
    seed = _mix32((step.to(torch.int64) + key) & _M32)
    index = torch.arange(start, start + numel, dtype=torch.int64, device=step.device)
    return _mix32((index & _M32) ^ seed ^ ((index >> 32) & _M32)) >> (32 - STOCHASTIC_BITS)


def stochastic_grid(y: torch.Tensor, bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``y`` (already scaled and clamped to ``dtype``'s range) rounded to a neighbouring value of ``dtype``'s grid
    (:data:`STOCHASTIC_GRIDS`): up in magnitude when ``bits < frac * 2**20`` (``frac``: ``|y|``'s fraction of the
    spacing above the lower neighbour), so the expectation is ``y``; exact in fp32 (power-of-two steps), so the cast
    to ``dtype`` that follows is exact. NaN stays NaN."""
    mantissa, emin = STOCHASTIC_GRIDS[dtype]
    magnitude = y.abs()
    _, exponent = torch.frexp(magnitude)  # magnitude = m * 2**exponent, m in [0.5, 1): floor(log2) = exponent - 1
    spacing = (exponent - 1).clamp(min=emin) - mantissa
    t = magnitude * torch.exp2(-spacing.to(torch.float32))  # exact: a power of two
    low = torch.floor(t)
    up = bits.view(y.shape).to(torch.float32) < (t - low) * float(2 ** STOCHASTIC_BITS)
    rounded = (low + up.to(torch.float32)) * torch.exp2(spacing.to(torch.float32))
    return torch.where(torch.isnan(y), y, torch.copysign(rounded, y))


ROUNDING_CHUNK = 1 << 20
"""Elements :func:`round_stochastically` rounds at a time (its temporaries stay tens of MB whatever the tensor)."""


def round_stochastically(y: torch.Tensor, row: int, step: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """:func:`stochastic_grid` of fp32 ``y`` (scaled, clamped) with the bits of the optimizer's row ``row`` at ``step``
    (:func:`rounding_bits`, element ``i`` of ``y`` flattened), :data:`ROUNDING_CHUNK` elements at a time."""
    flat = y.reshape(-1)
    if flat.numel() <= ROUNDING_CHUNK:
        return stochastic_grid(flat, rounding_bits(row, step, flat.numel()), dtype).view(y.shape)
    out = torch.empty_like(flat)
    for start in range(0, flat.numel(), ROUNDING_CHUNK):
        piece = flat[start:start + ROUNDING_CHUNK]
        out[start:start + piece.numel()] = stochastic_grid(piece, rounding_bits(row, step, piece.numel(), start),
                                                           dtype)
    return out.view(y.shape)


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
