"""FP8 numerics statistics: per FP8 GEMM operand its amax, scale, and the fractions of values that flush to zero and
that saturate, plus the weight-gradient scales; accumulated on the device, read to the host on request only.

:class:`FP8Statistics` attaches a :class:`CastStatistics` to the scaling state of each FP8 linear's input and
output-gradient casts (``ScalingState.stats``: the cast calls :meth:`CastStatistics.observe` with the tensor and the
scale it casts with) and reads the weights (``Float8Tensor``: payload and scale) and their gradients' scales itself.
It observes only on the steps :meth:`FP8Statistics.begin_step` marks (every ``interval``-th), so the extra reductions
cost one pass over each operand every ``interval`` steps; :meth:`FP8Statistics.read` is the one host read.

For a value ``x`` cast with scale ``s`` to a format with largest magnitude ``max`` and smallest subnormal ``tiny``:
it *flushes to zero* when ``x != 0`` and ``|x| * s <= tiny / 2`` (round to nearest even takes it to 0), and it
*saturates* when ``|x| * s > max`` (clamped to ``max``). The flush-to-zero fraction is over the non-zero finite
values observed (zeros cannot flush), the saturated fraction over the finite ones (non-finite values are neither). The
tensor-wise, per-row and per-tile (``rowwise``, ``blockwise``) recipes' casts are observed (the last two choose each
row's or tile's scale from its own amax: no saturation by construction, but values far below their row's or tile's
amax flush to zero, and non-finite values show); the reported ``scale`` is then the largest of the cast's scales.
MXFP8 and NVFP4 casts are not observed.
"""

from __future__ import annotations

import torch
from torch import nn

from .formats import FP8Format
from .tensor import Float8Tensor

__all__ = ["CastStatistics", "FP8Statistics", "flush_and_saturation_counts", "merge_stats", "operand_alarms",
           "ALARM_STATS", "STAT_NAMES"]

STAT_NAMES = ("amax", "scale", "flush_to_zero", "saturated", "non_finite")
"""The statistics of one cast site, as :meth:`FP8Statistics.read` reports them."""


def flush_and_saturation_counts(x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """``[values that flush to zero, values that saturate, finite values, non-zero finite values]`` of ``x`` cast with
    ``scale`` to ``fmt`` (int64, on ``x``'s device; no host read)."""
    return _counts(x.detach().abs().float(), scale, fmt)


def _counts(ax: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """:func:`flush_and_saturation_counts` of the magnitudes ``ax`` (fp32)."""
    tiny = fmt.min_normal * 2.0 ** -fmt.mantissa_bits
    finite = torch.isfinite(ax)
    scaled = ax * scale.float()
    nonzero = finite & (ax > 0)
    flush = nonzero & (scaled <= tiny / 2)
    saturated = finite & (scaled > fmt.max)
    return torch.stack([flush.sum(), saturated.sum(), finite.sum(), nonzero.sum()])


class CastStatistics:
    """Device accumulators of one cast site (an FP8 linear's input, or its output gradient) over the observed
    steps since the last read: the largest amax, the last scale, and the flush / saturation / finite / non-zero
    counts."""

    def __init__(self) -> None:
        self.active = False
        self._amax: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._numel = 0  # values observed (known on the host: no device read)

    @torch.no_grad()
    def observe(self, x: torch.Tensor, scale: torch.Tensor, fmt: FP8Format) -> None:
        """Accumulate one cast of ``x`` with ``scale`` (a no-op unless :attr:`active`)."""
        if not self.active or x.numel() == 0:  # an expert or a rank with no token: nothing to count
            return
        ax = x.detach().abs().float()  # one pass for the counts and the amax
        counts = _counts(ax, scale, fmt)
        amax = ax.nan_to_num(0.0, 0.0, 0.0).amax() if x.numel() else torch.zeros((), device=x.device)
        if self._counts is None:
            self._amax, self._counts = amax, counts
        else:
            self._amax, self._counts = torch.maximum(self._amax, amax), self._counts + counts
        self._scale = scale.detach().float().amax().reshape(())  # per-row or per-block scales: the largest
        self._numel += x.numel()

    def take(self) -> tuple[list[torch.Tensor], int] | None:
        """``([amax, scale, flushed, saturated, finite, non-zero], values observed)``: device tensors and a host count
        (None if nothing observed); resets."""
        if self._counts is None:
            return None
        out = [self._amax, self._scale, *self._counts.to(torch.float64)], self._numel
        self._amax = self._scale = self._counts = None
        self._numel = 0
        return out


def _weight_stats(weight: Float8Tensor) -> list[torch.Tensor]:
    """A stored FP8 weight: amax of its value, its scale (the largest, for block scales), payload values at zero
    (flushed, or zero already: the master is not here to tell) and at the format's max (saturated), and its size
    (twice: the denominator of both fractions)."""
    payload = weight.payload
    mag = payload.float().abs()
    fmt_max = weight.format.max
    return [weight.dequantize(torch.float32).abs().amax(), weight.scale.float().amax(),
            (mag == 0).sum().to(torch.float64), (mag >= fmt_max).sum().to(torch.float64),
            *[torch.tensor(float(payload.numel()), dtype=torch.float64, device=payload.device)] * 2]


class FP8Statistics:
    """FP8 numerics statistics of ``model``'s FP8 linears (any module with ``input_scaling`` and
    ``grad_output_scaling`` scaling states and a :class:`Float8Tensor` weight: :class:`fp8.Float8Linear`, the
    parallel linears), named by their module paths (``prefix`` prepended). ``interval``: observe every
    ``interval``-th step (:meth:`begin_step`)."""

    def __init__(self, model: nn.Module, interval: int, prefix: str = "") -> None:
        if interval < 1:
            raise ValueError(f"interval must be >= 1, got {interval}")
        self.interval = interval
        self.layers: dict[str, dict[str, CastStatistics]] = {}
        self.weights: dict[str, nn.Parameter] = {}
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            states = (getattr(module, "input_scaling", None), getattr(module, "grad_output_scaling", None))
            if not isinstance(weight, Float8Tensor) or any(s is None for s in states):
                continue
            sites = {"input": CastStatistics(), "grad_output": CastStatistics()}
            states[0].stats, states[1].stats = sites["input"], sites["grad_output"]
            self.layers[prefix + name] = sites
            self.weights[prefix + name] = weight
        self._observed = False

    def begin_step(self, iteration: int) -> None:
        """Mark step ``iteration`` (1-based) observed or not: every ``interval``-th is. The same decision on every
        rank (the iteration number), so nothing about communication depends on it."""
        active = iteration % self.interval == 0
        self._observed |= active
        for sites in self.layers.values():
            for site in sites.values():
                site.active = active

    def _weight_snapshot(self) -> dict[str, list[torch.Tensor]]:
        out = {}
        for name, weight in self.weights.items():
            stats = _weight_stats(weight)
            grad = weight.grad
            grad_scale = getattr(grad, "scale", None) if grad is not None else None
            out[name] = stats + [grad_scale.float().amax() if isinstance(grad_scale, torch.Tensor)
                                 else torch.full((), float("nan"), device=stats[0].device)]
            out[name] = [t.to(torch.float64).reshape(()) for t in out[name]]
        return out

    @torch.no_grad()
    def read(self) -> dict[str, dict[str, dict[str, float]]]:
        """Per layer, per operand (``input``, ``grad_output``, ``weight``): ``amax``, ``scale``, ``flush_to_zero`` (a
        fraction of the non-zero finite values; the weight's: of all its payload values) and ``saturated`` (of the
        finite values), for the input and output gradient ``non_finite`` (NaN or infinite, of all values observed),
        and for the weight its gradient's scale (``grad_scale``: NaN
        when the gradient is not scaled); over the steps observed since the last read. One host read. Empty when no
        step was observed."""
        if not self._observed or not self.layers:
            return {}
        pending: list[tuple[str, str, list[torch.Tensor], int]] = []
        for name, sites in self.layers.items():
            for operand, site in sites.items():
                taken = site.take()
                if taken is not None:
                    pending.append((name, operand, *taken))
        for name, stats in self._weight_snapshot().items():
            pending.append((name, "weight", stats, 0))
        flat = torch.stack([t.to(torch.float64).reshape(()).to(pending[0][2][0].device)
                            for _, _, ts, _ in pending for t in ts]).tolist()  # the one host read
        out: dict[str, dict[str, dict[str, float]]] = {}
        i = 0
        for name, operand, ts, numel in pending:
            values = flat[i:i + len(ts)]
            i += len(ts)
            amax, scale, flushed, saturated, finite, nonzero = values[:6]
            entry = {"amax": amax, "scale": scale, "flush_to_zero": flushed / max(nonzero, 1.0),
                     "saturated": saturated / max(finite, 1.0)}
            if operand == "weight":
                entry["grad_scale"] = values[6]
            else:
                entry["non_finite"] = (numel - finite) / max(numel, 1)
            out.setdefault(name, {})[operand] = entry
        self._observed = False
        return out


def merge_stats(per_rank: list[dict]) -> dict:
    """One entry per layer from several ranks' :meth:`FP8Statistics.read` results (keyed by the same layer names):
    tensor-parallel and data-parallel copies of a layer merged by their largest value (amax, scale, fractions; a NaN,
    such as an unscaled gradient's ``grad_scale``, counts as absent). Every rank merging the same gathered list gets
    the same result."""
    merged: dict = {}
    for stats in per_rank:
        for name, operands in stats.items():
            layer = merged.setdefault(name, {})
            for operand, values in operands.items():
                slot = layer.setdefault(operand, {})
                for stat, value in values.items():
                    old = slot.get(stat)
                    if old is None or old != old:  # none yet, or NaN (no scaled gradient there)
                        slot[stat] = value
                    elif value == value:
                        slot[stat] = max(old, value)
    return merged


ALARM_STATS = ("non_finite", "saturated", "flush_to_zero")
"""The statistics that raise an alarm, worst first."""


def operand_alarms(values: dict[str, float], saturation: float, flush: float) -> list[tuple[str, float]]:
    """``(statistic, value)`` of each alarm one activation operand's statistics (:meth:`FP8Statistics.read`: an
    ``input`` or ``grad_output`` entry) raise, in :data:`ALARM_STATS` order: any non-finite value, more than
    ``saturation`` of its values saturated, more than ``flush`` of its non-zero values flushed to zero."""
    limits = {"non_finite": 0.0, "saturated": saturation, "flush_to_zero": flush}
    return [(stat, values[stat]) for stat in ALARM_STATS if values.get(stat, 0.0) > limits[stat]]
