"""FP8-aware Adam and AdamW with precision-decoupled states (see :mod:`fp8.optim.base`)."""

from __future__ import annotations

import torch
from torch import nn

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

    _has_fused_step = True

    def _fused_step(self, params: list[torch.Tensor], agreed_ok: torch.Tensor | None = None) -> torch.Tensor:
        return fused_adam_step(self, params, agreed_ok)

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
                         kernel_backend=kernel_backend)

    def _update(self, w: torch.Tensor, g: torch.Tensor, state: dict, group: dict, delayed: bool = False) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        if weight_decay:
            if group["decoupled_weight_decay"]:
                w.mul_(1 - lr * weight_decay)
            else:
                g = g.add(w, alpha=weight_decay)
        exp_avg = self._load(state, "exp_avg").lerp_(g, 1 - beta1)
        exp_avg_sq = self._load(state, "exp_avg_sq").mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step = state["step"].to(torch.float64)  # 1 - beta**step cancels: float64 keeps it exact to fp32 rounding
        bias_correction1 = (1 - beta1**step).to(torch.float32)
        bias_correction2_sqrt = (1 - beta2**step).sqrt().to(torch.float32)
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        w.sub_(exp_avg / denom * (lr / bias_correction1))
        self._store(state, "exp_avg", "exp_avg", exp_avg, delayed=delayed)
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
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, maximize=maximize, decoupled_weight_decay=True,
            precision=precision, initial_masters=initial_masters, scaling_module=scaling_module,
            kernel_backend=kernel_backend,
        )
