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

- non-finite values: any NaN or infinite value in an operand.

An alarm is a WARNING naming the layer, operand and iteration; with ``--fp8-stats-stop`` the run stops
(:class:`megatron.training.monitoring.health.RunHealthError`, exit status 1).

``--fp8-auto-fallback`` acts on them (:mod:`fp8.fallback`): the merged statistics of each check (a log point with
observed steps) go to one :class:`fp8.fallback.AutoFallback`, the same on every rank, which moves a linear alarmed at
``--fp8-fallback-patience`` consecutive checks one rung down ``--fp8-fallback-ladder`` (a loss spike is blamed on the
linear whose operand amax grew the most since the previous check). Each rank applies the decisions to the linears it
holds before the next step; each is a WARNING and goes into the log record (``fp8_fallback``, with every linear's
setting as ``layer_precisions``); the controller's state is saved in checkpoints (``meta``) and applied on load.
"""

from __future__ import annotations

from collections.abc import Callable
import logging

import torch

from fp8.comm import Collectives
from fp8.fallback import (AutoFallback, FallbackConfig, allowed_settings, apply_settings, fallback_linears,
                          linear_setting)
from fp8.convert import layer_precisions
from fp8.stats import FP8Statistics, merge_stats, operand_alarms

from ..config import StatsConfig
from .health import RunHealthError

__all__ = ["NumericsMonitor", "merge_rank_stats", "alarms", "fallback_config"]

_LOG = logging.getLogger("megatron.training")


merge_rank_stats = merge_stats
"""One entry per layer from every rank's statistics (``FP8Statistics.read()``, keyed by the single-process model's
layer names: a pipeline stage's layers by their global number)."""


def alarms(stats: dict, iteration: int, saturation: float, flush: float) -> list[str]:
    """The alarms of merged statistics (see the module docstring; :func:`fp8.stats.operand_alarms`)."""
    out = []
    for name, operands in stats.items():
        for operand, values in operands.items():
            if operand == "weight":
                continue  # stored weights: a zero payload may be a zero weight; reported, not alarmed
            for stat, value in operand_alarms(values, saturation, flush):
                head = f"iteration {iteration}: {name} {operand}: {value:.2%} of its "
                if stat == "non_finite":
                    out.append(head + "values are not finite")
                elif stat == "saturated":
                    out.append(head + f"values saturate (> {saturation:.2%}; amax {values['amax']:.4g}, scale "
                                      f"{values['scale']:.4g})")
                else:
                    out.append(head + f"non-zero values flush to zero (> {flush:.2%}; amax {values['amax']:.4g}, "
                                      f"scale {values['scale']:.4g})")
    return out


def fallback_config(stats) -> FallbackConfig:
    """The :class:`fp8.fallback.FallbackConfig` of ``--fp8-auto-fallback``'s flags (the stats section or an argparse
    namespace): its thresholds are the alarms' (``--fp8-stats-saturation-alarm``, ``--fp8-stats-flush-alarm``)."""
    return FallbackConfig(interval=max(stats.fp8_stats_interval, 1), patience=stats.fp8_fallback_patience,
                          ladder=FallbackConfig.parse_ladder(stats.fp8_fallback_ladder),
                          saturation=stats.fp8_stats_saturation_alarm, flush=stats.fp8_stats_flush_alarm,
                          restore_after=stats.fp8_fallback_restore_after)


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
        self.chunks = chunks
        self.fallback: AutoFallback | None = None
        self.linears: dict = {}  # this rank's FP8 linears the fallback moves, by global name
        self._logged_precisions = False
        if stats.fp8_auto_fallback:
            config = fallback_config(stats)
            for chunk, global_name in zip(chunks, global_names):
                self.linears.update({global_name(n): m for n, m in fallback_linears(chunk).items()})
            initial: dict = {}
            allowed: dict = {}
            local = {n: (linear_setting(m), allowed_settings(m, config.ladder)) for n, m in self.linears.items()}
            for part in world.all_gather_object(local, "fp8 fallback"):  # every stage's linears, once at start-up
                initial.update({n: v[0] for n, v in part.items()})
                allowed.update({n: tuple(v[1]) for n, v in part.items()})
            self.fallback = AutoFallback(config, initial, allowed)

    def layer_precisions(self) -> dict[str, str]:
        """Every linear's setting (:func:`fp8.layer_precisions`) by global name, over every rank (one
        ``all_gather_object``: call it on every rank at the same point)."""
        local: dict = {}
        for chunk, global_name in zip(self.chunks, self.global_names):
            local.update({global_name(n): v for n, v in layer_precisions(chunk).items()})
        merged: dict = {}
        for part in self.world.all_gather_object(local, "fp8 fallback"):
            merged.update(part)
        return dict(sorted(merged.items()))

    def state(self) -> dict:
        """What a checkpoint keeps of the monitor (the same on every rank): the loss window of the spike alarm and the
        fallback's controller (None without it)."""
        return {"losses": list(self.losses[-10:]),
                "fallback": None if self.fallback is None else self.fallback.state_dict()}

    def load_state(self, state: dict | None) -> None:
        """A checkpoint's :meth:`state`: the loss window, and the controller with every linear this rank holds at the
        saved setting (before the checkpoint's weights are read: their layouts follow the settings)."""
        if not state:
            return
        self.losses = list(state.get("losses", []))
        saved = state.get("fallback")
        if self.fallback is not None and saved:
            self.fallback.load_state_dict(saved)
            apply_settings(self.linears, self.fallback.settings, self.fallback.recipes, self.fallback.initial)

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
        spike = False
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
                spike = True
            self.losses.append(loss)
        if found and self.log:
            for line in found:
                _LOG.warning("FP8 alarm, %s", line)
        if self.fallback is not None and records:
            self._fall_back(merged, records, spike)
        if found and cfg.fp8_stats_stop:
            raise RunHealthError(f"--fp8-stats-stop: {found[0]}" + (f" (and {len(found) - 1} more alarms)"
                                                                     if len(found) > 1 else ""))

    def _fall_back(self, merged: dict, records: list[dict], spike: bool) -> None:
        """One check of the fallback on the merged statistics (every rank the same decisions), applied to this rank's
        linears; the decisions and every linear's setting into the last record (and at the first check)."""
        decisions = self.fallback.observe(merged, records[-1]["iteration"], spike=spike) if merged else []
        if decisions:
            apply_settings(self.linears, self.fallback.settings, self.fallback.recipes)
            records[-1]["fp8_fallback"] = [d.message() for d in decisions]
            if self.log:
                for d in decisions:
                    _LOG.warning("FP8 auto fallback, %s", d.message())
        if decisions or not self._logged_precisions:
            records[-1]["layer_precisions"] = self.layer_precisions()
            self._logged_precisions = True
