"""The automatic gradient scaling factor mu of the FP8 all-reduce (FP8-LM), kept on device.

Before quantization for communication, gradients are multiplied by mu. Summing ``N`` ranks' FP8
values with one shared scale can overflow the format (post-scaling, mu = 1) and dividing by ``N``
first loses the smallest values (pre-scaling, mu = 1/N); mu moves between the two on the fly:

- after each step, if the fraction of reduced values at the format's maximum exceeds ``threshold``
  (default 0.001%), mu halves for the next step;
- otherwise mu grows by ``2 ** (1 / growth_interval)``, doubling over ``growth_interval`` steps.

mu is stored exactly as the integer ``log2(mu) * growth_interval`` and enters the scales rounded down
to a power of two, so communication scales stay exact powers of two like every scale in the engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..formats import FP8Format, get_format

__all__ = ["AutoScaleConfig", "AutoScaleState"]


def _is_power_of_two(x: float) -> bool:
    return x > 0 and math.isfinite(x) and math.frexp(x)[0] == 0.5


@dataclass(frozen=True)
class AutoScaleConfig:
    """The rule for mu and the FP8 format gradients travel in.

    - ``threshold``: largest tolerated fraction of reduced values at the format maximum (1e-5 = 0.001%);
      above it mu halves for the next step.
    - ``growth_interval``: steps over which mu doubles while the fraction stays at or below the threshold.
    - ``init_mu``: starting mu, a power of two; ``None`` starts at the largest power of two <= 1/N
      for ``N`` ranks (pre-scaling: a sum of ``N`` values cannot overflow).
    - ``min_mu``, ``max_mu``: bounds, powers of two with ``max_mu <= 1``: above 1 each rank's own
      largest values would saturate before the sum, where the overflow statistic cannot see them.
    - ``fmt``: ``"e4m3"`` (default, 3 mantissa bits) or ``"e5m2"``.
    """

    threshold: float = 1e-5
    growth_interval: int = 1000
    init_mu: float | None = None
    min_mu: float = 2.0**-16
    max_mu: float = 1.0
    fmt: str = "e4m3"

    def __post_init__(self) -> None:
        get_format(self.fmt)
        if not (isinstance(self.threshold, (int, float)) and 0.0 <= self.threshold < 1.0):
            raise ValueError(f"threshold is a fraction in [0, 1) (1e-5 = 0.001%), got {self.threshold!r}")
        interval = self.growth_interval
        if not isinstance(interval, int) or isinstance(interval, bool) or interval < 1:
            raise ValueError(f"growth_interval must be a positive int (steps for mu to double), got {interval!r}")
        for name in ("min_mu", "max_mu") + (("init_mu",) if self.init_mu is not None else ()):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not _is_power_of_two(float(value)):
                raise ValueError(f"{name} must be a power of two (e.g. 1.0, 0.5, 2**-8), got {value!r}")
        if not 2.0**-100 <= self.min_mu <= self.max_mu <= 1.0:
            raise ValueError(
                f"need 2**-100 <= min_mu <= max_mu <= 1, got min_mu={self.min_mu}, max_mu={self.max_mu}; above 1 "
                f"each rank's largest values saturate before the sum, where the overflow statistic cannot see them"
            )
        if self.init_mu is not None and not self.min_mu <= self.init_mu <= self.max_mu:
            raise ValueError(f"init_mu={self.init_mu} must lie in [min_mu, max_mu] = [{self.min_mu}, {self.max_mu}]")

    @property
    def format(self) -> FP8Format:
        """The :class:`FP8Format` gradients travel in."""
        return get_format(self.fmt)

    def initial_mu(self, world_size: int) -> float:
        """The starting mu for ``world_size`` ranks (``init_mu``, or the largest power of two <= 1/N, clamped)."""
        if self.init_mu is not None:
            return float(self.init_mu)
        mu = 2.0 ** -math.ceil(math.log2(max(1, world_size)))
        return min(max(mu, self.min_mu), self.max_mu)


class AutoScaleState(nn.Module):
    """mu and the overflow statistic of the running step, as device buffers (saved in ``state_dict``).

    Buffers: ``log2_mu_steps`` (int64, ``log2(mu) * growth_interval``), ``growth_interval`` (int64, the
    interval ``log2_mu_steps`` is counted in, so a checkpoint loads under another interval),
    ``overflow_count`` and ``value_count`` (int64, this step's values at the format maximum and values
    reduced), ``last_overflow_fraction`` (fp32), ``halvings`` and ``steps`` (int64, closed steps).
    Nothing here synchronizes with the host.
    """

    def __init__(self, config: AutoScaleConfig | None = None, world_size: int = 1,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = config or AutoScaleConfig()
        k = round(math.log2(self.config.initial_mu(world_size)) * self.config.growth_interval)
        as_long = dict(dtype=torch.int64, device=device)
        self.register_buffer("log2_mu_steps", torch.tensor(k, **as_long))
        self.register_buffer("growth_interval", torch.tensor(self.config.growth_interval, **as_long))
        self.register_buffer("overflow_count", torch.zeros((), **as_long))
        self.register_buffer("value_count", torch.zeros((), **as_long))
        self.register_buffer("last_overflow_fraction", torch.zeros((), dtype=torch.float32, device=device))
        self.register_buffer("halvings", torch.zeros((), **as_long))
        self.register_buffer("steps", torch.zeros((), **as_long))

    @property
    def format(self) -> FP8Format:
        """The FP8 format gradients travel in."""
        return self.config.format

    @property
    def mu(self) -> torch.Tensor:
        """mu as a 0-d fp32 tensor on device: ``2 ** (log2_mu_steps / growth_interval)``."""
        return torch.exp2(self.log2_mu_steps.to(torch.float64) / self.config.growth_interval).to(torch.float32)

    def mu_scale(self) -> torch.Tensor:
        """The factor gradients are multiplied by: mu rounded down to a power of two (0-d fp32)."""
        exponent = torch.div(self.log2_mu_steps, self.config.growth_interval, rounding_mode="floor")
        return torch.exp2(exponent.to(torch.float32))

    @torch.no_grad()
    def record(self, at_max: torch.Tensor, values: int) -> None:
        """Add one reduction to the running step: ``at_max`` (0-d tensor) of its ``values`` reduced
        values sit at the format maximum."""
        self.overflow_count += at_max.to(torch.int64)
        self.value_count += int(values)

    @torch.no_grad()
    def update(self) -> None:
        """Close a step: halve mu if the step's overflow fraction exceeds the threshold, otherwise grow
        it by ``2 ** (1 / growth_interval)``; clamp to ``[min_mu, max_mu]``. A step that reduced
        nothing leaves mu unchanged. On device, no host sync."""
        cfg = self.config
        reduced = self.value_count > 0
        fraction = self.overflow_count.to(torch.float64) / self.value_count.clamp(min=1).to(torch.float64)
        overflow = reduced & (fraction > cfg.threshold)
        step = torch.where(overflow, -cfg.growth_interval, 1)
        k_min = round(math.log2(cfg.min_mu) * cfg.growth_interval)
        k_max = round(math.log2(cfg.max_mu) * cfg.growth_interval)
        updated = (self.log2_mu_steps + step).clamp(k_min, k_max)
        self.log2_mu_steps.copy_(torch.where(reduced, updated, self.log2_mu_steps))
        self.last_overflow_fraction.copy_(torch.where(reduced, fraction.to(torch.float32), self.last_overflow_fraction))
        self.halvings += overflow.to(torch.int64)
        self.steps += reduced.to(torch.int64)
        self.overflow_count.zero_()
        self.value_count.zero_()

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        saved, current = int(self.growth_interval), self.config.growth_interval
        if saved != current:  # re-express log2(mu) in this config's interval
            with torch.no_grad():
                k = round(int(self.log2_mu_steps) * current / saved)
                self.log2_mu_steps.fill_(k)
                self.growth_interval.fill_(current)

    def extra_repr(self) -> str:
        c = self.config
        return (f"fmt={c.fmt}, threshold={c.threshold:g}, growth_interval={c.growth_interval}, "
                f"mu in [{c.min_mu:g}, {c.max_mu:g}]")
