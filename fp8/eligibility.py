"""Whether a linear runs in FP8: the one rule, for ``fp8.initialize``'s conversion (:mod:`fp8.convert`), the frozen
and MoE paths, the parallel linears and Megatron's layer specs (``megatron/training/gpt_layer_specs.py``). The memory
planner, which imports no torch, mirrors it (``megatron/training/planning/memory_plan.py``: ``fp8_linear_planned``)
and ``tests/training/test_eligibility.py`` holds the two equal. Plain Python: importing this module alone needs nothing.

Two reasons keep a linear out of FP8, told apart because callers act differently on them:

- *too small* (``min(in, out) < min_fp8_dim``): FP8 would not pay for its casts at this size (the measured crossover,
  :data:`fp8.convert.CUDA_MIN_FP8_DIM`); every caller keeps the layer in high precision and says so;
- *shape*: a dimension that is not a multiple of 16 (what ``torch._scaled_mm`` takes); ``fp8.initialize`` keeps the
  layer in high precision, a Megatron parallel linear asked to run in FP8 refuses at construction naming the sizes.
"""

from __future__ import annotations

from dataclasses import dataclass

GEMM_MULTIPLE = 16
"""FP8 GEMM dimensions are multiples of this (``torch._scaled_mm``'s rule)."""

__all__ = ["GEMM_MULTIPLE", "Ineligible", "fp8_dims_problem", "fp8_linear_problem"]


@dataclass(frozen=True)
class Ineligible:
    """Why a linear does not run in FP8: ``reason`` (a sentence naming the fix) and whether it is only too small."""

    reason: str
    too_small: bool


def fp8_dims_problem(in_features: int, out_features: int) -> str | None:
    """Why a linear of these dimensions cannot run its GEMMs in FP8, or None if it can."""
    if in_features % GEMM_MULTIPLE or out_features % GEMM_MULTIPLE:
        return (f"in_features={in_features} and out_features={out_features} must both be multiples of "
                f"{GEMM_MULTIPLE} for FP8 GEMMs (pad the layer)")
    return None


def fp8_linear_problem(in_features: int, out_features: int, min_fp8_dim: int = 0, where: str = "",
                       fix: str = "pass min_fp8_dim=0 to convert it") -> Ineligible | None:
    """None when a linear of these dimensions (``where``: what they are, e.g. " (per tensor-parallel rank)") runs in
    FP8 under ``min_fp8_dim``, else why not (module docstring); ``fix``: how a user converts a too-small layer."""
    if min(in_features, out_features) < min_fp8_dim:
        return Ineligible(f"in_features={in_features}, out_features={out_features}{where} below "
                          f"min_fp8_dim={min_fp8_dim} (too small to gain from FP8 at the measured crossover; {fix})",
                          too_small=True)
    problem = fp8_dims_problem(in_features, out_features)
    return Ineligible(problem, too_small=False) if problem else None
