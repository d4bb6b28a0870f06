"""Tensor-wise scaling: power-of-two scales from an amax, current and delayed scaling state.

Convention used throughout the engine: ``fp8 = cast(clamp(x * scale))`` and ``x ~= fp8 / scale``.
Scales are fp32 powers of two, so multiplying by a scale or by its reciprocal is exact and
rescaling never adds rounding error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from . import ops
from .comm import Collectives
from .formats import FP8Format, get_format
from .host_read import HostCopy
from .ops import power_of_two_scale

__all__ = ["ScalingConfig", "ScalingState", "HistoryProbe", "compute_scale", "amax_of", "power_of_two_scale", "update_scales",
           "set_amax_reduction_group", "discard_step_amaxes", "finite_amax", "fp16_accumulation_scale", "FP16_MAX",
           "FP16_HEADROOM_BITS"]

# Exponent range of a scale: 2**126 and 2**-126 and their reciprocals stay normal fp32 numbers.
_MAX_SCALE_EXPONENT = 126.0


def amax_of(x: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of ``x`` as a 0-d fp32 tensor on ``x``'s device (no host sync)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().to(torch.float32)


def compute_scale(
    amax: torch.Tensor, fmt: FP8Format | str, margin: int = 0, previous: torch.Tensor | None = None
) -> torch.Tensor:
    """Power-of-two scale ``2**floor(log2(fmt.max / amax)) * 2**-margin`` as a 0-d fp32 tensor.

    An amax of 0, inf or NaN cannot define a scale: the ``previous`` scale is kept (1.0 when there
    is none). Computed on device, without a host synchronisation.
    """
    return power_of_two_scale(amax, get_format(fmt).max, margin, previous)


FP16_MAX = ops.FP16_MAX
"""Largest finite FP16 magnitude."""

FP16_HEADROOM_BITS = ops.FP16_HEADROOM_BITS
"""Headroom of a fresh FP16 gradient buffer: its scale puts the first micro-batch's amax ``2**11`` (2,048 times)
below the FP16 maximum, so 2,048 micro-batches of that size summed with one sign fit without a rescale. FP16
keeps full (11-bit) precision over the 19 binades below that amax."""


def finite_amax(x: torch.Tensor) -> torch.Tensor:
    """Largest finite magnitude of ``x`` (0-d fp32; 0 when there is none), no host sync."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().to(torch.float32).abs().nan_to_num(nan=0.0, posinf=0.0).amax()


def fp16_accumulation_scale(sum_amax: torch.Tensor, acc_amax: torch.Tensor, acc_scale: torch.Tensor) -> torch.Tensor:
    """The FP16 buffer's scale after adding a micro-batch, from the finite amax of the fp32 sum and of the buffer
    before the add (0-d fp32, on device): an empty buffer (amax 0) takes the fresh scale of the sum with
    :data:`FP16_HEADROOM_BITS` of headroom; otherwise it keeps ``acc_scale`` unless the sum would overflow it,
    then the largest power of two at which the sum fits (an exact rescale). An amax of 0 (or no finite value)
    keeps ``acc_scale``. One formula: :func:`fp8.scaling.power_of_two_scale`."""
    fits = power_of_two_scale(sum_amax, FP16_MAX, previous=acc_scale)
    fresh = power_of_two_scale(sum_amax, FP16_MAX, FP16_HEADROOM_BITS, previous=acc_scale)
    return torch.where(acc_amax > 0, torch.minimum(acc_scale, fits), fresh)


@dataclass(frozen=True)
class ScalingConfig:
    """How one tensor role (input, weight, output gradient) is scaled.

    ``kind="current"`` takes the scale from the amax of the tensor being cast; ``kind="delayed"``
    takes it from the largest amax seen over the last ``history_len`` steps (the current step's
    amax is recorded and used from the next step on). ``margin`` lowers the scale by ``2**margin``.
    """

    fmt: str = "e4m3"
    kind: str = "delayed"
    history_len: int = 16
    margin: int = 0

    def __post_init__(self) -> None:
        get_format(self.fmt)
        if self.kind not in ("current", "delayed"):
            raise ValueError(f"scaling kind must be 'current' or 'delayed', got {self.kind!r}")
        if self.history_len < 1:
            raise ValueError(f"history_len must be >= 1, got {self.history_len}")
        if not 0 <= self.margin <= 32:
            raise ValueError(f"margin must be in [0, 32], got {self.margin}")

    @property
    def format(self) -> FP8Format:
        """The :class:`FP8Format` this role is cast to."""
        return get_format(self.fmt)


class ScalingState(nn.Module):
    """Scaling state of one tensor role, kept on device as buffers (saved in ``state_dict``).

    Buffers: ``amax_history`` (``history_len`` fp32 values, slot 0 is the step in progress) and
    ``scale`` (fp32, the delayed scale for the step in progress), ``has_history`` (bool, whether a
    step with a recorded amax has been closed). ``scale_for(x)`` returns the
    scale to cast ``x`` with and records its amax; ``update()`` closes a step.

    Agreement: with ``amax_comm`` (a :class:`fp8.comm.Collectives` over a process group; or set
    ``amax_reduce_group``) every rank uses the same scale. Current scaling agrees on each cast's amax
    (MAX all-reduce). Delayed scaling agrees once per step, in :func:`update_scales` (one batched
    all-reduce per group); its casts agree per cast only until the history has started on every rank
    (``history_confirmed``, learnt one update late at a fixed point, the same on every rank), since before
    that a cast falls back to its own amax.
    """

    def __init__(self, config: ScalingConfig, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config
        self.amax_comm: Collectives | None = None
        self.history_confirmed = False
        self._history_probe: HistoryProbe | None = None  # posted by update_scales, read at the next one
        # FP8 numerics statistics of this role's casts (fp8.stats.FP8Statistics sets one; None: not collected):
        # anything with ``observe(x, scale, fmt)``, called with each training cast's input and scale.
        self.stats = None
        self._seed_base: int | None = None  # rounding_seed's base, drawn at its first call
        self._seed_calls = 0
        self.register_buffer("amax_history", torch.zeros(config.history_len, dtype=torch.float32, device=device))
        self.register_buffer("scale", torch.ones((), dtype=torch.float32, device=device))
        self.register_buffer("has_history", torch.zeros((), dtype=torch.bool, device=device))

    def rounding_seed(self) -> int:
        """A fresh seed for a stochastic-rounding cast of this role (NVFP4's gradients): a base drawn from torch's
        CPU generator at the first call (seeded runs repeat; every linear's role draws its own) plus the number of
        calls since; host integers only after the first call, so a cast costs no device op for its seed. Not saved:
        a resumed run draws a new base."""
        if self._seed_base is None:
            self._seed_base = int(torch.randint(0, 2**30, (), device="cpu").item())
        self._seed_calls += 1
        return self._seed_base + self._seed_calls

    @property
    def format(self) -> FP8Format:
        """The FP8 format this role is cast to."""
        return self.config.format

    @property
    def amax_reduce_group(self) -> dist.ProcessGroup | None:
        """The process group whose ranks agree on this role's scale (None: no agreement)."""
        return None if self.amax_comm is None else self.amax_comm.group

    @amax_reduce_group.setter
    def amax_reduce_group(self, group: dist.ProcessGroup | None) -> None:
        self.amax_comm = None if group is None else Collectives(group)

    def _agrees_per_cast(self) -> bool:
        return self.amax_comm is not None and (self.config.kind == "current" or not self.history_confirmed)

    def _reduce_amax(self, amax: torch.Tensor) -> torch.Tensor:
        if self.amax_comm is not None:
            amax = amax.clone()
            self.amax_comm.all_reduce(amax, op=dist.ReduceOp.MAX, tag="fp8 amax").wait()
        return amax

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self.history_confirmed = False  # the loaded history is confirmed again at the next updates
        self._history_probe = None

    def scale_for(self, x: torch.Tensor, record: bool = True) -> torch.Tensor:
        """Scale (0-d fp32) to cast ``x`` with; records ``x``'s amax in the history if ``record``
        (training passes; evaluation passes leave the history alone).

        Current scaling computes it from ``x`` (amax agreed across the group, if one is set).
        Delayed scaling returns the stored scale, except before any amax was recorded, where it
        falls back to current scaling so the first step cannot overflow (agreed across the group
        until the history is confirmed started on every rank). If ``x`` holds inf or NaN the
        scale is NaN, so the cast carries the non-finite values on (clamping would hide them as
        finite maxima and the step would not be skipped); non-finite amaxes are never recorded.
        """
        amax = amax_of(x)
        finite = torch.isfinite(amax)
        if record:
            with torch.no_grad():
                recorded = torch.where(finite, amax, torch.zeros_like(amax))
                self.amax_history[0] = torch.maximum(self.amax_history[0], recorded)
        cfg = self.config
        if cfg.kind == "current":
            scale = compute_scale(self._reduce_amax(amax), cfg.fmt, cfg.margin, self.scale)
        else:
            if self._agrees_per_cast():
                # The first-step fallback must agree across ranks too.
                amax = self._reduce_amax(amax)
            scale = torch.where(self.has_history, self.scale, compute_scale(amax, cfg.fmt, cfg.margin, self.scale))
        scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
        if self.stats is not None and record:  # training casts only
            self.stats.observe(x, scale, self.format)
        return scale

    def quantize(self, x: torch.Tensor, record: bool = True, transpose: bool = False, pad: int = 1,
                 dst_cols: torch.Tensor | None = None, out_t: torch.Tensor | None = None):
        """``(data, data_t, scale_inv)``: 2-D ``x`` cast to this role's format with :meth:`scale_for`'s scale, and its
        transpose (padded, :mod:`fp8.ops`; empty without ``transpose``), in the fewest kernels: a delayed-scaling role
        whose history has started (known on the host since the last :func:`update_scales`) and that agrees nothing per
        cast is one :func:`fp8.ops.cast_transpose` (the scale read on the device, the amax max-ed into the history in
        the same pass); current scaling is :func:`fp8.ops.amax` (all-reduced over the group where one agrees) and
        :func:`fp8.ops.cast_transpose_from_amax`; a delayed role before its history has started falls back to its
        own (agreed) amax for this cast. Non-finite values are written as NaN; a current or fallback scale of a
        tensor holding any is NaN (the whole cast is NaN). ``record``: as :meth:`scale_for`."""
        cfg, fmt = self.config, self.config.fmt
        slot = self.amax_history[:1]
        if cfg.kind == "delayed" and self.history_confirmed and not self._agrees_per_cast():
            data, data_t, scale_inv = ops.cast_transpose(x, self.scale, slot, fmt, transpose, pad, record, dst_cols,
                                                         out_t)
            scale = self.scale
        else:
            amax2 = ops.amax(x)
            if self._agrees_per_cast():
                self.amax_comm.all_reduce(amax2, op=dist.ReduceOp.MAX, tag="fp8 amax").wait()
            if cfg.kind == "current":
                data, data_t, scale_inv = ops.cast_transpose_from_amax(x, amax2, self.scale, slot, fmt, cfg.margin,
                                                                       transpose, pad, record, dst_cols, out_t)
                scale = scale_inv.reciprocal() if self.stats is not None and record else None
            else:
                fallback = power_of_two_scale(amax2[0], self.format.max, cfg.margin, self.scale)
                scale = torch.where(self.has_history, self.scale, fallback)
                scale = torch.where(amax2[1] > 0, torch.full_like(scale, float("nan")), scale)
                data, data_t, scale_inv = ops.cast_transpose(x, scale, slot, fmt, transpose, pad, record, dst_cols,
                                                             out_t)
        if self.stats is not None and record:  # training casts only
            self.stats.observe(x, scale, self.format)
        return data, data_t, scale_inv

    def quantize_transpose(self, x: torch.Tensor, record: bool = True, backend: str = "auto"):
        """``(data, data_t, scale)``: ``x`` (2-D) cast with :meth:`scale_for`'s scale, and its transpose.

        Bit for bit what ``scale_for`` + :func:`fp8.quantize_transpose` give. On CUDA with Triton
        (``backend="auto"``) a delayed-scaled role reads ``x`` once: one kernel writes the cast, the
        transpose and the amax (a first step without history reads it once more for its current scale).
        """
        from .kernels.backend import resolve_backend  # kernels import nothing heavy at fp8 import time

        if self.config.kind != "delayed" or self._agrees_per_cast() or resolve_backend(backend, x) == "torch":
            from .cast import quantize_transpose

            scale = self.scale_for(x, record=record)
            data, data_t = quantize_transpose(x, scale, self.format)
            return data, data_t, scale
        from .kernels.cast_transpose_amax import amax_unless, cast_transpose_amax

        fallback = compute_scale(amax_unless(x, self.has_history, backend), self.config.fmt, self.config.margin, self.scale)
        scale = torch.where(self.has_history, self.scale, fallback)
        data, data_t, amax = cast_transpose_amax(x, scale, self.format, transpose=True, backend=backend)
        if self.stats is not None and record:
            self.stats.observe(x, scale, self.format)
        finite = torch.isfinite(amax)
        if record:
            with torch.no_grad():
                recorded = torch.where(finite, amax, torch.zeros_like(amax))
                self.amax_history[0] = torch.maximum(self.amax_history[0], recorded)
        return data, data_t, torch.where(finite, scale, torch.full_like(scale, float("nan")))

    @torch.no_grad()
    def update(self, reduce: bool = True, enabled: torch.Tensor | None = None) -> None:
        """Close a step: agree on the step's amax across the group, recompute the scale from the
        window's max, and start a new history slot (:func:`fp8.ops.update_scales_`). Runs on device without a host
        sync. With a 0-d bool ``enabled`` tensor the step is closed only where it is set (decided on device; where
        it is not, the step's amax is dropped)."""
        if reduce and self.amax_comm is not None:
            self.amax_history[0] = self._reduce_amax(self.amax_history[0])
        ops.update_scales_([self.amax_history], [self.scale], [self.has_history], [self.format.max],
                           [self.config.margin], enabled)

    def extra_repr(self) -> str:
        c = self.config
        return f"fmt={c.fmt}, kind={c.kind}, history_len={c.history_len}, margin={c.margin}"


class HistoryProbe:
    """Which delayed histories of a group of states have started: the agreed device flags, copied to the host
    without a sync at one :func:`update_scales` and read at the next (:class:`fp8.host_read.HostCopy`)."""

    def __init__(self, states: list[ScalingState]) -> None:
        self.states = states
        self.copy = HostCopy(torch.stack([s.has_history for s in states]))

    def started(self) -> list[bool]:
        """The flags posted one update ago (waits for their copy, which has landed)."""
        return [bool(flag) for flag in self.copy.result()]


@torch.no_grad()
def update_scales(module: nn.Module, enabled: torch.Tensor | None = None) -> None:
    """Close the step for every :class:`ScalingState` in ``module``: agree on the step's amaxes across
    each state's process group (one MAX all-reduce per group, the only amax collective of a step once
    the delayed histories have started), then compute the next delayed scales and roll the histories of all states
    in one multi-tensor kernel (:func:`fp8.ops.update_scales_`): a fixed number of launches whatever the number of
    layers. No host sync. A 0-d bool ``enabled`` closes it only where set (on device; elsewhere the step's amaxes
    are dropped)."""
    states = [m for m in module.modules() if isinstance(m, ScalingState)]
    if not states:
        return
    by_group: dict[int, list[ScalingState]] = {}
    for state in states:
        if state.amax_comm is not None:
            by_group.setdefault(id(state.amax_comm.group), []).append(state)
    for members in by_group.values():
        amaxes = torch.stack([state.amax_history[0] for state in members])
        members[0].amax_comm.all_reduce(amaxes, op=dist.ReduceOp.MAX, tag="fp8 amax").wait()
        torch._foreach_copy_([state.amax_history[:1] for state in members], list(amaxes.split(1)))
    ops.update_scales_([s.amax_history for s in states], [s.scale for s in states], [s.has_history for s in states],
                       [s.format.max for s in states], [s.config.margin for s in states], enabled)
    for members in by_group.values():
        _confirm_histories(members)
    # States agreeing on nothing learn the same way when their history has started, for their casts' fast path
    # (ScalingState.quantize); a traced step (torch.compile) takes no host read, so they keep the general path.
    local = [s for s in states if s.amax_comm is None]
    if local and not torch.compiler.is_compiling():
        _confirm_histories(local)


def _confirm_histories(members: list[ScalingState]) -> None:
    """Mark the delayed states of one group whose history had started at the previous update as confirmed (the
    probe posted then; its flags derive from agreed amaxes, and it is read at this update on every rank, never
    when a rank sees its copy land), and post a probe for the others. Every rank therefore stops the per-cast
    amax all-reduces of a state at the same step."""
    pending = [s for s in members if s.config.kind == "delayed" and not s.history_confirmed]
    if not pending:
        return
    probe = pending[0]._history_probe
    if probe is not None:
        pending[0]._history_probe = None
        for state, started in zip(probe.states, probe.started()):
            state.history_confirmed = state.history_confirmed or started
        pending = [s for s in pending if not s.history_confirmed]
    if pending:
        pending[0]._history_probe = HistoryProbe(pending)


def set_amax_reduction_group(module: nn.Module, group: dist.ProcessGroup | None,
                             comm: Collectives | None = None) -> None:
    """Make every :class:`ScalingState` in ``module`` agree on its amax across ``group`` (MAX), so all
    ranks cast with the same scales; ``None`` turns agreement off. ``comm`` (a :class:`fp8.comm.Collectives`
    over ``group``, e.g. with a byte counter) is used when given. Call on every rank of the group."""
    shared = None if group is None else (comm if comm is not None else Collectives(group))
    for state in module.modules():
        if isinstance(state, ScalingState):
            state.amax_comm = shared


@torch.no_grad()
def discard_step_amaxes(module: nn.Module, keep: torch.Tensor | None = None) -> None:
    """Forget the amaxes recorded in the step in progress (e.g. a step skipped for non-finite
    gradients), so they never enter a scaling history. With a 0-d bool ``keep`` tensor they are
    forgotten only where it is not set (decided on device, no host sync). One multi-tensor op for all states."""
    slots = [state.amax_history[:1] for state in module.modules() if isinstance(state, ScalingState)]
    if not slots:
        return
    if keep is None:
        torch._foreach_zero_(slots)
    else:
        torch._foreach_mul_(slots, keep.to(torch.float32))
