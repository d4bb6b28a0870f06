"""FP8-aware optimizers with precision decoupling, the O1 wrapper, the O3 sharded optimizer, and gradient clipping."""

from .adam import Adam, AdamW
from .base import FP8Optimizer, grads_are_finite
from .clip import clip_grad_norm_
from .convert import convert_optimizer
from .master_weights import MasterWeightOptimizer
from .precision import PRECISION_PRESETS, OptimizerPrecision
from .sgd import SGD
from .partition import ParamPartition, partition_by_size
from .sharded import ShardedAdam, ShardedAdamW, ShardedFP8Optimizer, ShardedSGD
from .wrap import FP8_LEVELS, FP8Weight, wrap_for_level

__all__ = [
    "Adam", "AdamW", "SGD", "FP8Optimizer", "MasterWeightOptimizer", "OptimizerPrecision", "PRECISION_PRESETS",
    "clip_grad_norm_", "convert_optimizer", "grads_are_finite",
    "ParamPartition", "partition_by_size", "ShardedFP8Optimizer", "ShardedAdam", "ShardedAdamW", "ShardedSGD",
    "FP8_LEVELS", "FP8Weight", "wrap_for_level",
]
