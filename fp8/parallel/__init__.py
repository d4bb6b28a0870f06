"""Tensor-, sequence- and pipeline-parallel FP8 building blocks (pure PyTorch, no Megatron import).

- :mod:`.linear`: column- and row-parallel linears honouring megatron-core's constructor and forward
  contract, in FP8 (or in high precision, the baseline, with the same collectives counted the same way).
- :mod:`.comm`: the tensor-parallel collectives they use, FP8 payloads as 1-byte values.
- :mod:`.p2p_codec`: the wire format of FP8 activations and gradients between pipeline stages.
- :mod:`.init`: layout-independent initialisation of sharded weights.
"""

from .comm import TensorParallelComm
from .init import initialize_sharded_weight
from .linear import (
    ColumnParallelLinear, FP8ColumnParallelLinear, FP8RowParallelLinear, RowParallelLinear, take_initial_masters,
)
from .p2p_codec import PipelineCodec

__all__ = [
    "TensorParallelComm", "initialize_sharded_weight", "ColumnParallelLinear", "RowParallelLinear",
    "FP8ColumnParallelLinear", "FP8RowParallelLinear", "take_initial_masters", "PipelineCodec",
]
