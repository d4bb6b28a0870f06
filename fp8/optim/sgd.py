"""FP8-aware SGD with momentum, the momentum buffer stored per the ``exp_avg`` precision."""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from .base import FP8Optimizer
from .precision import OptimizerPrecision

__all__ = ["SGD"]


class SGD(FP8Optimizer):
    """SGD (``torch.optim.SGD`` semantics: momentum, dampening, Nesterov, L2 weight decay) whose
    momentum buffer is stored per ``precision.exp_avg`` and master weights per ``precision.master``."""

    def _moment_roles(self, group: dict) -> dict[str, str]:
        return {"momentum_buffer": "exp_avg"} if group["momentum"] else {}

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        precision: OptimizerPrecision | str = "O2",
        initial_masters: dict[torch.Tensor, torch.Tensor] | None = None,
        scaling_module: nn.Module | None = None,
        kernel_backend: str = "auto",
        comm_counter=None,
    ) -> None:
        if not lr >= 0.0 or not momentum >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"invalid lr {lr}, momentum {momentum} or weight_decay {weight_decay}: must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum > 0 and zero dampening")
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
            maximize=maximize,
        )
        super().__init__(params, defaults, precision, initial_masters, scaling_module=scaling_module,
                         kernel_backend=kernel_backend, comm_counter=comm_counter)

    def _update(self, w: torch.Tensor, g: torch.Tensor, state: dict, group: dict, delayed: bool = False,
                row: int | None = None) -> None:
        momentum = group["momentum"]
        previous = self._load(state, "momentum_buffer") if momentum else None
        # First step: the buffer starts as the gradient itself (torch semantics).
        buf = ops.sgd_update(w, g, previous, state["step"] == 1, lr=group["lr"], momentum=momentum,
                             dampening=group["dampening"], weight_decay=group["weight_decay"],
                             nesterov=group["nesterov"])
        if momentum:
            self._store(state, "momentum_buffer", "exp_avg", buf, delayed=delayed, row=row)

    def _stage(self, stage, group, lists, ws, rows, backend, tables) -> None:
        args = self._state_args(lists, rows, ws)
        hyper = dict(lr=float(group["lr"]), momentum=group["momentum"], dampening=group["dampening"],
                     weight_decay=group["weight_decay"], nesterov=bool(group["nesterov"]),
                     maximize=bool(group.get("maximize", False)), tables=tables or [], backend=backend)
        if stage == 1:
            ops.sgd_stage1_(lists["grads"][rows], *args, ws.amax[rows], ws.bad, **hyper)
        else:
            ops.sgd_stage2_(lists["grads"][rows], *args, ws.new[rows], ws.bad, **hyper,
                            **self._rounding_args(rows, ws))
