"""Convert a ``torch.optim`` Adam / AdamW / SGD into its FP8-aware counterpart."""

from __future__ import annotations

import torch
from torch import nn

from .adam import Adam, AdamW
from .base import FP8Optimizer
from .precision import OptimizerPrecision
from .sgd import SGD

__all__ = ["convert_optimizer", "check_convertible", "converted_arguments"]

_UNSUPPORTED_FLAGS = {"amsgrad": False, "differentiable": False}
_PERFORMANCE_FLAGS = ("foreach", "fused", "capturable")  # torch implementation choices, not semantics


def _target_class(optimizer: torch.optim.Optimizer) -> type[FP8Optimizer]:
    kind = type(optimizer)
    if kind is torch.optim.AdamW or (kind is torch.optim.Adam and optimizer.defaults.get("decoupled_weight_decay")):
        return AdamW
    if kind is torch.optim.Adam:
        return Adam
    if kind is torch.optim.SGD:
        return SGD
    raise TypeError(
        f"opt_level O2 converts torch.optim.Adam, AdamW and SGD; got {kind.__module__}.{kind.__name__}. "
        f"Use one of those, or opt_level='O1', which wraps any torch.optim optimizer"
    )


def check_convertible(optimizer: torch.optim.Optimizer) -> type[FP8Optimizer]:
    """The FP8 class ``optimizer`` converts to; raises a clear error if it cannot be converted."""
    target = _target_class(optimizer)
    if any(optimizer.state.values()):
        raise ValueError("fp8.initialize must run before the first optimizer step (the optimizer already has state)")
    for flag, allowed in _UNSUPPORTED_FLAGS.items():
        if any(group.get(flag, allowed) != allowed for group in optimizer.param_groups):
            raise ValueError(f"{type(optimizer).__name__}({flag}=True) has no FP8 counterpart; set {flag}=False")
    return target


def converted_arguments(
    optimizer: torch.optim.Optimizer, replace: dict[int, torch.Tensor]
) -> tuple[type[FP8Optimizer], list[dict], dict]:
    """``(fp8_class, param_groups, constructor_kwargs)`` equivalent to ``optimizer``, with each
    parameter whose ``id`` is in ``replace`` swapped for its FP8 version; raises if not convertible."""
    target = check_convertible(optimizer)
    dropped = set(_PERFORMANCE_FLAGS) | set(_UNSUPPORTED_FLAGS)
    groups = []
    for group in optimizer.param_groups:
        new = {k: v for k, v in group.items() if k not in dropped}
        new["params"] = [replace.get(id(p), p) for p in group["params"]]
        groups.append(new)
    defaults = {k: v for k, v in optimizer.defaults.items() if k not in dropped and k != "decoupled_weight_decay"}
    return target, groups, _constructor_args(target, defaults)


def convert_optimizer(
    optimizer: torch.optim.Optimizer,
    replace: dict[int, torch.Tensor],
    precision: OptimizerPrecision | str,
    initial_masters: dict[torch.Tensor, torch.Tensor] | None = None,
    *,
    scaling_module: nn.Module | None = None,
    comm_counter=None,
) -> FP8Optimizer:
    """The FP8-aware optimizer equivalent to ``optimizer``: same class of update, same param groups and
    hyper-parameters, with each parameter whose ``id`` is in ``replace`` swapped for its FP8 version
    (whose master starts from ``initial_masters[new_param]``); ``scaling_module`` as
    :class:`fp8.optim.base.FP8Optimizer` (``comm_counter``: its FSDP2 scale agreements). Refuses optimizers that
    already stepped."""
    target, groups, kwargs = converted_arguments(optimizer, replace)
    return target(groups, **kwargs, precision=precision, initial_masters=initial_masters, scaling_module=scaling_module,
                  comm_counter=comm_counter)


def _constructor_args(target: type[FP8Optimizer], defaults: dict) -> dict:
    names = {
        Adam: ("lr", "betas", "eps", "weight_decay", "maximize"),
        AdamW: ("lr", "betas", "eps", "weight_decay", "maximize"),
        SGD: ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"),
    }[target]
    args = {k: defaults[k] for k in names if k in defaults}
    if isinstance(args.get("lr"), torch.Tensor):
        args["lr"] = float(args["lr"])
    return args
