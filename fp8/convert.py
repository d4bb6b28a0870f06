"""Swap eligible ``nn.Linear`` modules of any model for :class:`Float8Linear`."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from .linear import Float8Linear, Float8LinearConfig, fp8_dims_problem

__all__ = ["ConvertedLinear", "convert_to_float8_linear"]

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]


@dataclass(frozen=True)
class ConvertedLinear:
    """One swap: the module's qualified name, the original high-precision weight, the new module."""

    fqn: str
    original_weight: nn.Parameter
    module: Float8Linear


def _skip_reason(fqn: str, linear: nn.Linear, filter_fn: ModuleFilter | None, use_count: Counter) -> str | None:
    if filter_fn is not None and not filter_fn(linear, fqn):
        return "excluded by module_filter_fn"
    if not linear.weight.is_floating_point():
        return f"weight dtype {linear.weight.dtype} is not floating point"
    if use_count[id(linear.weight)] > 1:
        return "weight is shared with another module (tied); FP8 would untie it"
    return fp8_dims_problem(linear.in_features, linear.out_features)


def convert_to_float8_linear(
    model: nn.Module,
    config: Float8LinearConfig | None = None,
    module_filter_fn: ModuleFilter | None = None,
) -> tuple[nn.Module, list[ConvertedLinear]]:
    """Replace every eligible ``nn.Linear`` in ``model`` (in place) by a :class:`Float8Linear`.

    ``module_filter_fn(module, fqn)`` returning False keeps a layer in high precision. Layers whose
    dimensions are not multiples of 16, or whose weight is tied to another module, are kept too;
    every skipped layer is logged with its reason. Returns the (possibly new, if ``model`` itself is
    a linear) model and the list of swaps.
    """
    config = config or Float8LinearConfig()
    use_count = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    converted: list[ConvertedLinear] = []
    for fqn, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        reason = _skip_reason(fqn, module, module_filter_fn, use_count)
        if reason:
            logger.info("fp8: kept %s in high precision: %s", fqn or "<root>", reason)
            continue
        new = Float8Linear.from_linear(module, config)
        converted.append(ConvertedLinear(fqn, module.weight, new))
        if not fqn:
            model = new
            continue
        parent_name, _, child_name = fqn.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, new)
    logger.info("fp8: converted %d linear layer(s) to FP8", len(converted))
    return model, converted
