"""FP8 numerics statistics of a training run (``--fp8-stats-interval N``) and their alarms.

Every N-th step each rank's FP8 linears accumulate, on the device, their input's and output gradient's amax, scale
and fractions flushed to zero / saturated (:class:`fp8.stats.FP8Statistics`); at the log points (every
``--log-interval`` iterations, where the run reads its other values) they are read once, gathered from every rank
(one ``all_gather_object`` over the world, at the same iterations on every rank), merged per layer (tensor-parallel
shards: the largest amax and fractions; pipeline stages keep their own names, ``stage<P>.`` in front when PP > 1),
and attached to the log record (``fp8_stats``: the JSON log and TensorBoard). Each rank then checks the same merged
values, so all agree on an alarm:

- saturation: an operand with more than ``--fp8-stats-saturation-alarm`` of its values clamped to the format's max;
- flush to zero: more than ``--fp8-stats-flush-alarm`` of its non-zero values cast to zero (a scale collapsed, or
  a tensor far below the format's range);
- loss spike: a logged loss above ``--fp8-stats-loss-spike`` times the mean of the previous (up to 10) logged ones.

An alarm is a WARNING naming the layer, operand and iteration; with ``--fp8-stats-stop`` the run stops
(:class:`megatron.training.monitoring.health.RunHealthError`, exit status 1).
"""

from __future__ import annotations

from collections.abc import Callable
import logging

import torch

from fp8.comm import Collectives
from fp8.stats import FP8Statistics

from ..config import StatsConfig
from .health import RunHealthError

__all__ = ["NumericsMonitor", "merge_rank_stats", "alarms"]

_LOG = logging.getLogger("megatron.training")


def merge_rank_stats(per_rank: list[dict]) -> dict:
    """One entry per layer from every rank's statistics (``FP8Statistics.read()``, keyed by the single-process model's
    layer names: a pipeline stage's layers by their global number): tensor-parallel and data-parallel copies of a layer
    merged by their largest value (amax, scale, fractions)."""
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


def alarms(stats: dict, iteration: int, saturation: float, flush: float) -> list[str]:
    """The alarms of merged statistics (see the module docstring)."""
    out = []
    for name, operands in stats.items():
        for operand, values in operands.items():
            if operand == "weight":
                continue  # stored weights: a zero payload may be a zero weight; reported, not alarmed
            if values["saturated"] > saturation:
                out.append(f"iteration {iteration}: {name} {operand}: {values['saturated']:.2%} of its values saturate "
                           f"(> {saturation:.2%}; amax {values['amax']:.4g}, scale {values['scale']:.4g})")
            if values["flush_to_zero"] > flush:
                out.append(f"iteration {iteration}: {name} {operand}: {values['flush_to_zero']:.2%} of its non-zero "
                           f"values flush to zero (> {flush:.2%}; amax {values['amax']:.4g}, scale "
                           f"{values['scale']:.4g})")
    return out


class NumericsMonitor:
    """The run's FP8 statistics (``stats.fp8_stats_interval`` > 0) over ``chunks`` (this rank's model chunks) and
    their alarms."""

    def __init__(self, stats: StatsConfig, chunks: list[torch.nn.Module], world: Collectives,
                 global_names: list[Callable[[str], str]], log: bool) -> None:
        """``global_names[i]``: chunk ``i``'s module names -> the single-process model's (the layers' global numbers,
        as the start-up selection and ``--fp8-precision-config`` name them)."""
        self.config = stats
        self.world = world
        self.global_names = global_names
        self.log = log
        self.stats = [FP8Statistics(c, stats.fp8_stats_interval) for c in chunks]
        self.losses: list[float] = []

    def begin_step(self, iteration: int) -> None:
        for s in self.stats:
            s.begin_step(iteration)

    def read(self, records: list[dict]) -> None:
        """At a log point: read, gather and merge the statistics into ``records[-1]["fp8_stats"]``, then raise the
        alarms (every rank the same ones)."""
        local: dict = {}
        for s, global_name in zip(self.stats, self.global_names):
            local.update({global_name(name): values for name, values in s.read().items()})
        merged = merge_rank_stats(self.world.all_gather_object(local, "fp8 statistics"))
        cfg = self.config
        found = []
        if merged and records:
            records[-1]["fp8_stats"] = merged
            found += alarms(merged, records[-1]["iteration"], cfg.fp8_stats_saturation_alarm,
                            cfg.fp8_stats_flush_alarm)
        for record in records:
            loss = record.get("loss")
            if loss is None:
                continue
            previous = self.losses[-10:]
            if cfg.fp8_stats_loss_spike and len(previous) >= 3 and loss > cfg.fp8_stats_loss_spike * (
                    sum(previous) / len(previous)):
                found.append(f"iteration {record['iteration']}: loss {loss:.4f} spikes above "
                             f"{cfg.fp8_stats_loss_spike} x the mean of the previous {len(previous)} logged losses "
                             f"({sum(previous) / len(previous):.4f})")
            self.losses.append(loss)
        if found and self.log:
            for line in found:
                _LOG.warning("FP8 alarm, %s", line)
        if found and cfg.fp8_stats_stop:
            raise RunHealthError(f"--fp8-stats-stop: {found[0]}" + (f" (and {len(found) - 1} more alarms)"
                                                                     if len(found) > 1 else ""))
