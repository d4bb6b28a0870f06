"""The skipped-steps counter shared by the FP8 optimizers: a device counter, read (and logged) on demand."""

from __future__ import annotations

import logging

import torch

__all__ = ["SkippedStepsCounter"]

logger = logging.getLogger("fp8.optim.base")


class SkippedStepsCounter:
    """Mixin: ``skipped_steps`` backed by a 0-d int64 device counter that the step increments without a host
    sync; call :meth:`_init_skipped_counter` in ``__init__``."""

    def _init_skipped_counter(self, device: torch.device | str) -> None:
        self._skipped_counter = torch.zeros((), dtype=torch.int64, device=device)
        self._skipped_reported = 0

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients. Reading it copies the device counter to the host (a
        sync, outside the step) and logs a warning for skips not reported yet; the step itself never
        syncs. :attr:`skipped_steps_counter` is the counter itself (no sync)."""
        count = int(self._skipped_counter)
        if count > self._skipped_reported:
            logger.warning("fp8: non-finite gradient, optimizer step skipped (%d skipped so far)", count)
        self._skipped_reported = count
        return count

    @skipped_steps.setter
    def skipped_steps(self, value: int | torch.Tensor) -> None:
        self._skipped_counter = torch.as_tensor(value, dtype=torch.int64).to(self._skipped_counter.device).clone()
        self._skipped_reported = int(value)

    @property
    def skipped_steps_counter(self) -> torch.Tensor:
        """The 0-d int64 device counter behind :attr:`skipped_steps` (reading it does not sync)."""
        return self._skipped_counter
