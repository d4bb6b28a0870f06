"""The one table from an FP8 opt level to the optimizer that trains it, shared by :func:`fp8.initialize` and
``pretrain_gpt.py``'s optimizer (``megatron/training/optimizer.py``).

- ``O1``: the given optimizer steps high-precision masters of the FP8 weights (:class:`MasterWeightOptimizer`
  refreshes the FP8 copies after each step);
- ``O2``: the given Adam/AdamW/SGD becomes its :mod:`fp8.optim` counterpart (FP8/FP16 moments, FP16-with-scale
  masters, or ``precision``), updating the FP8 weights in place (:func:`convert_optimizer`);
- ``O3``: O2 sharded over ``process_group`` by whole tensors (:func:`convert_to_sharded`).

Level ``none`` (the high-precision baseline) has no FP8 weight and is each caller's own (``fp8.initialize`` returns
the optimizer unchanged; ``pretrain_gpt.py`` adds Megatron's ``--bf16`` masters and ZeRO-1).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from .convert import convert_optimizer
from .master_weights import MasterWeightOptimizer
from .precision import OptimizerPrecision
from .sharded import convert_to_sharded

__all__ = ["FP8_LEVELS", "FP8Weight", "wrap_for_level"]

FP8_LEVELS = ("O1", "O2", "O3")
"""The levels :func:`wrap_for_level` builds an optimizer for."""


class FP8Weight(NamedTuple):
    """One FP8 weight as the optimizer of a level sees it: ``optimizer_param``, the tensor the given optimizer holds
    for it (O1 steps it: the high-precision master); ``weight``, the FP8 weight (:class:`fp8.Float8Tensor`) the model
    computes with; ``master``, its high-precision values (O2/O3 start their FP16 masters from them)."""

    optimizer_param: torch.Tensor
    weight: torch.Tensor
    master: torch.Tensor


def wrap_for_level(level: str, optimizer: torch.optim.Optimizer, weights: Sequence[FP8Weight], *,
                   scaling_module: nn.Module, precision: OptimizerPrecision | str | None = None,
                   process_group=None, comm_counter=None, **sharded: Any) -> torch.optim.Optimizer:
    """The optimizer of FP8 opt level ``level`` over ``optimizer``'s parameters, ``weights`` being the FP8 ones.
    ``precision``: O2/O3's storage precision (default the FP8-LM preset ``"O2"``); ``process_group`` and
    ``sharded`` (``expert_params``, ``expert_process_group``, ``counter``): O3's (:func:`convert_to_sharded`).
    ``comm_counter`` (O1/O2): counts the scale agreements the optimizer runs once FSDP2 shards the model."""
    if level not in FP8_LEVELS:
        raise ValueError(f"no FP8 optimizer for opt level {level!r}: the FP8 levels are {', '.join(FP8_LEVELS)}")
    if level != "O3" and (process_group is not None or sharded):
        raise ValueError(f"process_group= and the sharding options apply to opt level 'O3', not {level!r}")
    if level == "O1":
        if precision is not None:
            raise ValueError("precision= (the optimizer's storage precision) applies to opt levels 'O2' and 'O3', "
                             "not 'O1' (whose optimizer is the given one, over high-precision masters)")
        return MasterWeightOptimizer(optimizer, [(w.optimizer_param, w.weight) for w in weights], scaling_module,
                                     comm_counter=comm_counter)
    replace = {id(w.optimizer_param): w.weight for w in weights}
    initial = {w.weight: w.master for w in weights}
    if level == "O2":
        return convert_optimizer(optimizer, replace, precision or "O2", initial, scaling_module=scaling_module,
                                 comm_counter=comm_counter)
    return convert_to_sharded(optimizer, replace, precision or "O2", initial, process_group,
                              scaling_module=scaling_module, **sharded)
