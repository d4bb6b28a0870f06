"""FP8-aware Adam and AdamW with precision-decoupled states (see :mod:`fp8.optim.base`)."""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from .base import FP8Optimizer
from .fused_adam import fused_adam_step  # Triton itself is imported only when a fused step runs
from .precision import OptimizerPrecision

__all__ = ["Adam", "AdamW"]


class Adam(FP8Optimizer):
    """Adam (``torch.optim.Adam`` semantics, L2 weight decay unless ``decoupled_weight_decay``) whose
    first moment, second moment and master weights are stored per ``precision`` (default: the O2
    recipe, E4M3 / FP16 / FP16, each with a per-tensor scale). The update math is fp32."""

    def _moment_roles(self, group: dict) -> dict[str, str]:
        return {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}

    _has_fused_step = True  # delayed state scaling's Triton path (fused_adam_step)
    _bias_correction = True

    def _fused_step(self, params: list[torch.Tensor], agreed_ok: torch.Tensor | None = None) -> torch.Tensor:
        return fused_adam_step(self, params, agreed_ok)

    def _stage(self, stage, group, lists, ws, rows, backend, tables) -> None:
        beta1, beta2 = group["betas"]
        args = self._state_args(lists, rows, ws)
        hyper = dict(lr=float(group["lr"]), beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"], decoupled=bool(group["decoupled_weight_decay"]),
                     maximize=bool(group.get("maximize", False)), tables=tables or [], backend=backend)
        if stage == 1:
            ops.adam_stage1_(lists["grads"][rows], *args, ws.amax[rows], ws.bad, **hyper)
        else:
            ops.adam_stage2_(lists["grads"][rows], *args, ws.new[rows], ws.bad, **hyper,
                             **self._rounding_args(rows, ws))

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool = False,
        precision: OptimizerPrecision | str = "O2",
        initial_masters: dict[torch.Tensor, torch.Tensor] | None = None,
        scaling_module: nn.Module | None = None,
        kernel_backend: str = "auto",
        comm_counter=None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"invalid learning rate {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"invalid eps {eps} or weight_decay {weight_decay}: must be >= 0")
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults, precision, initial_masters, scaling_module=scaling_module,
                         kernel_backend=kernel_backend, comm_counter=comm_counter)

    def _update(self, w: torch.Tensor, g: torch.Tensor, state: dict, group: dict, delayed: bool = False,
                row: int | None = None) -> None:
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        exp_avg = self._load(state, "exp_avg")
        exp_avg_sq = self._load(state, "exp_avg_sq")
        step = state["step"].to(torch.float64)  # 1 - beta**step cancels: float64 keeps it exact to fp32 rounding
        bias_correction1 = (1 - beta1**step).to(torch.float32)
        bias_correction2_sqrt = (1 - beta2**step).sqrt().to(torch.float32)
        ops.adam_update_(w, g, exp_avg, exp_avg_sq, lr / bias_correction1, bias_correction2_sqrt, lr=lr, beta1=beta1,
                         beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                         decoupled=group["decoupled_weight_decay"])
        self._store(state, "exp_avg", "exp_avg", exp_avg, delayed=delayed, row=row)
        self._store(state, "exp_avg_sq", "exp_avg_sq", exp_avg_sq, delayed=delayed)


class AdamW(Adam):
    """AdamW (``torch.optim.AdamW`` semantics: decoupled weight decay, default 0.01) with
    precision-decoupled states, as :class:`Adam`."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        precision: OptimizerPrecision | str = "O2",
        initial_masters: dict[torch.Tensor, torch.Tensor] | None = None,
        scaling_module: nn.Module | None = None,
        kernel_backend: str = "auto",
        comm_counter=None,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, maximize=maximize, decoupled_weight_decay=True,
            precision=precision, initial_masters=initial_masters, scaling_module=scaling_module,
            kernel_backend=kernel_backend, comm_counter=comm_counter,
        )
