"""The opt level an optimizer state dict was written at, and the refusal of a load across levels.

Each opt level keeps a different state: O1 (:class:`~fp8.optim.MasterWeightOptimizer`) the wrapped optimizer's
state plus FP32 master weights; O2 (:class:`~fp8.optim.FP8Optimizer`) torch's layout with low-precision moments and
masters; O3 (:class:`~fp8.optim.ShardedFP8Optimizer`) O2's layout holding only the tensors this rank owns among
``world_size`` data-parallel ranks. Their state dicts record ``"opt_level"`` (and O3 its ``"world_size"``); a load
into another level raises :class:`OptLevelMismatchError` naming both. State dicts written before the level was
recorded are still loaded at their own level (recognised by their keys: ``master_weights`` is O1's; O2 and O3
dicts without a record cannot be told apart and are loaded as before).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .precision import PRECISION_PRESETS, OptimizerPrecision

__all__ = ["OptLevelMismatchError", "level_name", "saved_opt_level", "check_opt_level"]


class OptLevelMismatchError(ValueError):
    """An optimizer state or checkpoint written at one opt level, loaded into an optimizer of another."""


def level_name(base: str, precision: OptimizerPrecision) -> str:
    """``base`` ("O2" or "O3") for the FP8-LM precision, else ``base`` with the storage precision spelled out (the
    ZeRO-1 baseline is O3's machinery at FP32 precision). The first moment's rounding mode is not part of the level: it
    changes no storage layout, and a run may switch it at a resume."""
    precision = dataclasses.replace(precision, exp_avg_rounding="nearest")
    if precision == PRECISION_PRESETS["O2"]:
        return base
    if precision == PRECISION_PRESETS["O1"]:
        return f"{base} machinery at FP32 precision (level none's sharded optimizer)"
    return f"{base} with precision exp_avg={precision.exp_avg}, exp_avg_sq={precision.exp_avg_sq}, " \
           f"master={precision.master}, state_scaling={precision.state_scaling}"


def saved_opt_level(state_dict: Any) -> str | None:
    """The level ``state_dict`` was written at: its record, or ``"O1"`` for a dict with master weights; None for an
    O2/O3/torch dict written before the level was recorded (not told apart); raises ``TypeError`` for anything
    that is not an optimizer state dict."""
    if not isinstance(state_dict, dict):
        raise TypeError(f"an optimizer state dict is a dict, got {type(state_dict).__name__}")
    level = state_dict.get("opt_level")
    if level is not None:
        return str(level)
    if "master_weights" in state_dict:
        return "O1"
    if "param_groups" in state_dict and "state" in state_dict:
        return None
    raise OptLevelMismatchError(
        f"not an optimizer state dict of any opt level (keys {sorted(map(str, state_dict))}); O1's holds "
        f"'optimizer' and 'master_weights', O2's and O3's 'state' and 'param_groups'")


def check_opt_level(state_dict: Any, mine: str, optimizer: object) -> None:
    """Refuse ``state_dict`` unless written at level ``mine`` (``optimizer``'s, named in the message)."""
    saved = saved_opt_level(state_dict)
    if saved is None:
        if mine == "O1":
            saved = "O2/O3 (or a torch optimizer's, level none)"
        else:
            return
    if saved != mine:
        raise OptLevelMismatchError(
            f"this optimizer state was saved at opt level {saved} and cannot be loaded into an opt level {mine} "
            f"optimizer ({type(optimizer).__name__}): each level keeps different states (O1: FP32 master weights, "
            f"O2: FP8/FP16 moments and masters, O3: O2's sharded over data parallel). Resume at opt level {saved} "
            f"(with the same optimizer_precision: FP8Trainer's fp8_optimizer_precision), or start this level's "
            f"optimizer from the model's weights without loading the optimizer state")
