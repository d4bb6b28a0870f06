"""Scheduled precision: FP8 linears that run in high precision from a given step on, as NVIDIA's NVFP4 recipe does for
the last part of training (its loss gap to BF16 from 1.5% to 0.5%).

Two modes: ``"forward"``, the forward GEMM in high precision on the weight's values with the backward GEMMs in the
recipe's formats (:attr:`fp8.Float8LinearConfig.high_precision_forward`), or ``"linear"``, all three GEMMs in high
precision (:attr:`fp8.Float8LinearConfig.high_precision`: the input saved for backward in the model's dtype, 2 bytes
per element in bf16 where FP8 saves 1). Weights stay FP8 at rest and the optimizer is unchanged in both. The switch
follows the step number (1-based: ``from_step=N`` runs step N and every later one in high precision), so it needs no
state of its own beyond the step count, which :func:`attach` keeps in the optimizer's state dict.
"""

from __future__ import annotations

from collections.abc import Callable
import logging

import torch
from torch import nn

from .convert import set_high_precision, set_high_precision_forward

__all__ = ["MODES", "switch", "attach", "PrecisionSchedule"]

MODES = ("forward", "linear")
_LOG = logging.getLogger("fp8.schedule")


def switch(model: nn.Module, mode: str, enabled: bool = True) -> int:
    """Put every FP8 linear of ``model`` in high precision per ``mode`` (:data:`MODES`), or back (``enabled``
    False); returns how many configs changed (0 once switched: idempotent)."""
    if mode not in MODES:
        raise ValueError(f"high-precision mode must be one of {MODES} ('forward': the forward GEMM only; 'linear': "
                         f"all three GEMMs), got {mode!r}")
    return set_high_precision_forward(model, enabled) if mode == "forward" else set_high_precision(model, enabled)


class PrecisionSchedule:
    """:func:`attach`'s hooks: the optimizer's steps counted; after step ``from_step - 1`` the model switches."""

    KEY = "fp8_precision_schedule"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, from_step: int, mode: str,
                 log: Callable[[str], None]) -> None:
        if from_step < 1:
            raise ValueError(f"high_precision_from_step={from_step}: steps count from 1")
        if mode not in MODES:
            raise ValueError(f"high_precision_mode must be one of {MODES}, got {mode!r}")
        self.model, self.from_step, self.mode, self.log = model, from_step, mode, log
        self.step = 0
        self.switched = False
        self._apply()
        optimizer.register_step_post_hook(self._after_step)
        optimizer.register_state_dict_post_hook(self.save_state)
        # first among the load hooks: switching back (a state from before the switch) must not undo what automatic
        # fallback restores after it (its high-precision linears)
        optimizer.register_load_state_dict_pre_hook(self.load_state, prepend=True)
        # and once more after every load hook: the fallback puts linears it had not moved back at their initial
        # setting, which in "linear" mode would clear this switch's flag
        optimizer.register_load_state_dict_post_hook(self.after_load)

    def _apply(self) -> None:
        if self.step + 1 >= self.from_step:
            changed = switch(self.model, self.mode)
            self.switched = True
            if changed:
                what = "forward GEMMs" if self.mode == "forward" else "GEMMs"
                self.log(f"step {self.step + 1}: the {what} of {changed} FP8 linear(s) run in high precision from "
                         f"now on (high_precision_from_step={self.from_step}, mode {self.mode!r})")

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.step += 1
        self._apply()

    def after_load(self, optimizer) -> None:
        self._apply()

    def save_state(self, optimizer, state_dict: dict) -> dict:
        state_dict[self.KEY] = {"step": self.step, "from_step": self.from_step, "mode": self.mode}
        return state_dict

    def load_state(self, optimizer, state_dict: dict) -> dict:
        state_dict = dict(state_dict)
        saved = state_dict.pop(self.KEY, None)
        if saved is not None:
            self.step = int(saved["step"])
            if self.switched and self.step + 1 < self.from_step:  # a state from before the switch: switch back
                switch(self.model, self.mode, False)
                self.switched = False
            self._apply()
        return state_dict


def attach(model: nn.Module, optimizer: torch.optim.Optimizer, from_step: int, mode: str = "forward",
           log: Callable[[str], None] | None = None) -> PrecisionSchedule:
    """Scheduled precision on an FP8 ``model`` trained with ``optimizer`` (``fp8.initialize(...,
    high_precision_from_step=N, high_precision_mode=...)``): the optimizer's steps are counted (a step post hook) and
    step ``from_step`` and every later one run in high precision per ``mode``; the count travels in
    ``optimizer.state_dict()`` (``"fp8_precision_schedule"``), so a resumed run switches at the same step. The switch is
    logged (``log``, default INFO on the ``fp8.schedule`` logger)."""
    return PrecisionSchedule(model, optimizer, from_step, mode, log or _LOG.info)
