"""Layout-independent initialisation of tensor-parallel weight shards.

The full weight is initialised on the CPU with the caller's ``init_method`` (drawing from the default
generator exactly as a single-process model would) and this rank keeps its shard, so a model built
with any tensor-parallel size starts from the same weights as the single-process model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["initialize_sharded_weight"]


def initialize_sharded_weight(
    full_shape: tuple[int, int],
    partition_dim: int,
    rank: int,
    world_size: int,
    init_method: Callable[[torch.Tensor], object] | None,
    stride: int = 1,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """This rank's shard (fp32 unless ``dtype``) of a ``full_shape`` weight initialised by ``init_method``.

    The full weight is split along ``partition_dim`` into ``world_size * stride`` equal blocks and rank
    ``r`` keeps blocks ``r, r + world_size, ...`` (megatron-core's strided partitioning, used by fused
    gated projections). ``init_method=None`` leaves the weight zero.
    """
    size = full_shape[partition_dim]
    if size % (world_size * stride):
        raise ValueError(
            f"dimension {partition_dim} of a {tuple(full_shape)} weight is not divisible by tensor-parallel size "
            f"{world_size} x stride {stride}; choose sizes divisible by the tensor-parallel size"
        )
    full = torch.zeros(full_shape, dtype=torch.float32)
    if init_method is not None:
        init_method(full)
    blocks = torch.split(full, size // (world_size * stride), dim=partition_dim)
    mine = torch.cat(blocks[rank::world_size], dim=partition_dim)
    return mine.to(dtype).contiguous()
