"""O1 optimizer: a ``torch.optim`` optimizer stepping high-precision master copies of FP8 weights.

The wrapped optimizer keeps the original high-precision weight ``Parameter`` objects (the masters)
in its param groups; the model holds their FP8 copies. ``step()`` dequantizes each FP8 weight
gradient into its master's ``.grad``, runs the wrapped optimizer, re-quantizes the FP8 weights from
the updated masters (current power-of-two scale), frees the transient master gradients and closes
the step for the model's delayed scaling states.

A step whose gradients hold inf or NaN is skipped, decided on device where the wrapped optimizer allows
it (no host synchronisation): a fused ``torch.optim`` optimizer (``fused=True``: Adam, AdamW, SGD,
Adagrad) takes the flag as its ``found_inf`` input and skips on device; any other optimizer whose states
live on the parameters' device is stepped and then masked back (``torch.where`` over a copy of its
parameters and states taken before the step, one transient copy). A step whose optimizer state is not
created yet (torch creates it lazily on the first step), or whose states live on another device (torch's
non-capturable Adam keeps ``step`` on the host), is decided on the host (one sync), as before.
``skipped_steps`` is a device counter, read (and new skips logged) when the host asks for it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import logging

import torch
from torch import nn

from ..cast import payload_and_scale
from ..scaling import discard_step_amaxes, update_scales
from ..tensor import Float8Tensor
from .skipped import SkippedStepsCounter
from .base import grads_finite_flag

logger = logging.getLogger(__name__)

__all__ = ["MasterWeightOptimizer"]


class MasterWeightOptimizer(SkippedStepsCounter, torch.optim.Optimizer):
    """Wraps ``optimizer`` so it steps on FP8 weights through their high-precision masters.

    ``pairs`` lists ``(master, fp8_weight)``: the master is a parameter of ``optimizer``, the FP8
    weight a :class:`Float8Tensor` parameter of ``model``. ``param_groups`` and ``state`` are the
    wrapped optimizer's, so learning-rate schedulers work unchanged. ``state_dict()`` holds the
    wrapped optimizer's state and the master weights.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pairs: list[tuple[nn.Parameter, nn.Parameter]],
        model: nn.Module,
    ) -> None:
        # Not calling Optimizer.__init__: param groups and state are the wrapped optimizer's own.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.pairs = pairs
        self.model = model
        first = next((m for m, _ in pairs), None)
        if first is None:
            first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        self._init_skipped_counter(first.device if first is not None else "cpu")
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self):
        return self.optimizer.state

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.pairs)} FP8 weights, {self.optimizer!r})"

    @property
    def master_weights(self) -> list[nn.Parameter]:
        """The high-precision master copies of the FP8 weights, in model order."""
        return [master for master, _ in self.pairs]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the wrapped optimizer's gradients and those of the FP8 weights."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for _, fp8_weight in self.pairs:
            if set_to_none:
                fp8_weight.grad = None
            elif fp8_weight.grad is not None:
                fp8_weight.grad.zero_()

    @torch.no_grad()
    def _load_master_grads(self) -> None:
        for master, fp8_weight in self.pairs:
            grad = fp8_weight.grad
            if grad is None:
                master.grad = None
            elif payload_and_scale(grad) is not None:  # a scaled gradient, FP8 or FP16
                master.grad = grad.dequantize(master.dtype)
            else:
                master.grad = grad.to(master.dtype)

    @torch.no_grad()
    def refresh_fp8_weights(self) -> None:
        """Re-quantize every FP8 weight from its master (current power-of-two scale)."""
        for master, fp8_weight in self.pairs:
            fp8_weight.copy_(master)

    # -- the step ---------------------------------------------------------------------------------
    def _fused_found_inf(self) -> bool:
        """Whether the wrapped optimizer skips on device through a ``found_inf`` input (fused torch.optim)."""
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False)) and bool(
            self.optimizer.defaults.get("fused"))

    def _stepped(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def _maskable(self, stepped: list[torch.Tensor], device: torch.device) -> bool:
        """Whether the step can be undone on device: every stepped parameter has its state already
        (torch creates it lazily on the first step) and every state tensor lives on ``device``."""
        for p in stepped:
            state = self.optimizer.state.get(p)
            if not state or p.device != device:
                return False
            if any(isinstance(v, torch.Tensor) and v.device != device for v in state.values()):
                return False
        return True

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        """One optimizer step on the masters, then refreshed FP8 weights and closed scaling step.
        Skipped (counted in ``skipped_steps``, logged when it is read) if any gradient is not finite;
        decided on device where the wrapped optimizer allows it (module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        device = self._skipped_counter.device
        params = [w for _, w in self.pairs] + [p for g in self.optimizer.param_groups for p in g["params"]]
        ok = grads_finite_flag(params).to(device)
        self._load_master_grads()
        stepped = self._stepped()
        if self._fused_found_inf():
            self._found_inf_step(ok)
        elif self._maskable(stepped, device):
            self._masked_step(stepped, ok)
        elif not bool(ok):  # host decision: lazily created state, or states off the parameters' device
            for master, _ in self.pairs:
                master.grad = None
            self._skipped_counter += 1
            discard_step_amaxes(self.model)
            return loss
        else:
            self.optimizer.step()
        self.refresh_fp8_weights()  # a skipped step re-quantizes the unchanged masters: same bits
        for master, _ in self.pairs:
            master.grad = None  # transient: the FP8 gradient is the one kept
        self._skipped_counter += (~ok).to(torch.int64)
        discard_step_amaxes(self.model, keep=ok)
        update_scales(self.model, enabled=ok)
        return loss

    def _found_inf_step(self, ok: torch.Tensor) -> None:
        """A fused torch.optim step told to skip on device (``found_inf``, as torch's GradScaler does)."""
        opt = self.optimizer
        found_inf = (~ok).to(torch.float32)
        previous = getattr(opt, "found_inf", None)
        if previous is not None:  # a GradScaler's flag too: skip if either says so
            found_inf = torch.maximum(found_inf, previous.to(found_inf.device, torch.float32).reshape(()))
        opt.found_inf = found_inf
        try:
            opt.step()
        finally:
            if previous is None:
                del opt.found_inf
            else:
                opt.found_inf = previous

    def _masked_step(self, stepped: list[torch.Tensor], ok: torch.Tensor) -> None:
        """Step, then keep the old parameters and states where ``ok`` is not set (on device)."""
        before = [(p, p.detach().clone(), dict(self.optimizer.state[p])) for p in stepped]
        saved = {id(v): v.clone() for _, _, state in before for v in state.values() if isinstance(v, torch.Tensor)}
        self.optimizer.step()
        for p, old_value, old_state in before:
            p.detach().copy_(torch.where(ok, p.detach(), old_value))
            state = self.optimizer.state[p]
            for key, old in old_state.items():
                if not isinstance(old, torch.Tensor):
                    continue
                new = state.get(key)
                if new is None:
                    continue
                kept = torch.where(ok, new, saved[id(old)])
                if new is old:  # updated in place: keep the object, restore its values
                    new.copy_(kept)
                else:
                    state[key] = kept

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of high-precision parameters to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Wrapped optimizer state, the master weights (in model order) and ``skipped_steps``."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "master_weights": [m.detach() for m in self.master_weights],
            "skipped_steps": self.skipped_steps,
            "opt_level": self.opt_level,
        }

    opt_level = "O1"
    """The opt level this optimizer's state belongs to (recorded in :meth:`state_dict`, checked on load)."""

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore the wrapped optimizer and the masters, and re-quantize the FP8 weights from them. A state
        dict of another opt level is refused (:class:`fp8.optim.levels.OptLevelMismatchError`)."""
        from .levels import check_opt_level

        check_opt_level(state_dict, self.opt_level, self)
        masters = state_dict["master_weights"]
        if len(masters) != len(self.pairs):
            raise ValueError(
                f"checkpoint holds {len(masters)} master weights, this model has {len(self.pairs)} FP8 weights; "
                f"load it into a model converted with the same opt_level and module filter"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.skipped_steps = state_dict.get("skipped_steps", 0)
        for (master, _), saved in zip(self.pairs, masters):
            master.copy_(saved)
        self.refresh_fp8_weights()
