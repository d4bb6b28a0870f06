"""FP8-aware optimizers."""

from .master_weights import MasterWeightOptimizer

__all__ = ["MasterWeightOptimizer"]
