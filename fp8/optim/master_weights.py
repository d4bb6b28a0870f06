"""O1 optimizer: a ``torch.optim`` optimizer stepping high-precision master copies of FP8 weights.

The wrapped optimizer keeps the original high-precision weight ``Parameter`` objects (the masters)
in its param groups; the model holds their FP8 copies. ``step()`` dequantizes each FP8 weight
gradient into its master's ``.grad``, runs the wrapped optimizer, re-quantizes the FP8 weights from
the updated masters (current power-of-two scale), frees the transient master gradients and closes
the step for the model's delayed scaling states.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..scaling import update_scales
from ..tensor import Float8Tensor
from .base import grads_are_finite, skip_step

__all__ = ["MasterWeightOptimizer"]


class MasterWeightOptimizer(torch.optim.Optimizer):
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
        self.skipped_steps = 0
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
            elif isinstance(grad, Float8Tensor):
                master.grad = grad.dequantize(master.dtype)
            else:
                master.grad = grad.to(master.dtype)

    @torch.no_grad()
    def refresh_fp8_weights(self) -> None:
        """Re-quantize every FP8 weight from its master (current power-of-two scale)."""
        for master, fp8_weight in self.pairs:
            fp8_weight.copy_(master)

    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        """One optimizer step on the masters, then refreshed FP8 weights and closed scaling step.
        Skipped (counted in ``skipped_steps``, logged) if any gradient is not finite."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [w for _, w in self.pairs] + [p for g in self.optimizer.param_groups for p in g["params"]]
        if not grads_are_finite(params):
            skip_step(self, self.model)
            return loss
        self._load_master_grads()
        self.optimizer.step()
        self.refresh_fp8_weights()
        for master, _ in self.pairs:
            master.grad = None  # transient: the FP8 gradient is the one kept
        update_scales(self.model)
        return loss

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of high-precision parameters to the wrapped optimizer."""
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Wrapped optimizer state, the master weights (in model order) and ``skipped_steps``."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "master_weights": [m.detach() for m in self.master_weights],
            "skipped_steps": self.skipped_steps,
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore the wrapped optimizer and the masters, and re-quantize the FP8 weights from them."""
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
