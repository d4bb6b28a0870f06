"""Tensor-parallel collectives of the parallel linears, counted at the call, FP8 carried as ``uint8``.

- ``all_gather`` (sequence parallel, before column-parallel GEMMs and, in backward, after row-parallel
  ones): gathers along the first (sequence) dimension; FP8 payloads travel as 1-byte values, cast with a
  scale every rank of the group agreed on, so the gathered payload has that one scale.
- ``fp8_reduce_scatter`` (sequence parallel, after row-parallel GEMMs and, in backward, after
  column-parallel ones): each rank casts its partial sums to FP8 with an agreed scale, an all-to-all
  moves the 1-byte chunks to their owners, and each owner sums the chunks in fp32 (so the sum cannot
  overflow and rounds once per addend, not per partial sum).
- ``reduce_scatter`` / ``all_reduce``: the high-precision versions (baseline, and plain tensor
  parallelism without sequence parallelism).

Bytes are counted with the ring costs of :mod:`fp8.distributed.bytes_counter` (an all-to-all of ``B``
bytes costs what a ring reduce-scatter of ``B`` bytes does: ``(N-1)/N * B`` per rank).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..cast import quantize
from ..distributed.bytes_counter import CommBytesCounter
from ..distributed.collectives import FP8_DTYPES
from ..scaling import ScalingState

__all__ = ["TensorParallelComm"]

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _wire(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


class TensorParallelComm:
    """Collectives over one tensor-parallel group; ``group=None`` with no process group means size 1.

    ``counter`` (optional, may be set later) records every byte this object sends, by tag.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, counter: CommBytesCounter | None = None) -> None:
        self.group = group
        self.counter = counter
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self.world_size, self.rank = 1, 0
        else:
            self.world_size = dist.get_world_size(group)
            self.rank = dist.get_rank(group)

    def _count(self, kind: str, tensor: torch.Tensor, tag: str) -> None:
        if self.counter is not None:
            self.counter.record(kind, tensor.numel() * tensor.element_size(), self.world_size, tag)

    def all_gather(self, tensor: torch.Tensor, tag: str = "sp all-gather") -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order (FP8 stays FP8, 1 byte/value)."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        out = torch.empty((self.world_size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
        self._count("all_gather", out, tag)
        _all_gather(_wire(out), _wire(tensor), group=self.group)
        return out

    def all_reduce(self, tensor: torch.Tensor, tag: str = "tp all-reduce") -> torch.Tensor:
        """Sum of ``tensor`` over the group (high precision), in place."""
        if self.world_size == 1:
            return tensor
        self._count("all_reduce", tensor, tag)
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def _check_divisible(self, tensor: torch.Tensor) -> None:
        if tensor.shape[0] % self.world_size:
            raise ValueError(
                f"cannot scatter {tensor.shape[0]} rows (sequence x batch) over tensor-parallel size "
                f"{self.world_size}: make the sequence length divisible by the tensor-parallel size"
            )

    def reduce_scatter(self, tensor: torch.Tensor, tag: str = "sp reduce-scatter") -> torch.Tensor:
        """Chunk ``rank`` (along dim 0) of the sum of ``tensor`` over the group, high precision."""
        if self.world_size == 1:
            return tensor
        self._check_divisible(tensor)
        tensor = tensor.contiguous()
        out = torch.empty((tensor.shape[0] // self.world_size, *tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
        self._count("reduce_scatter", tensor, tag)
        dist.reduce_scatter_tensor(out, tensor, group=self.group)
        return out

    def fp8_reduce_scatter(
        self, tensor: torch.Tensor, state: ScalingState, out_dtype: torch.dtype, record: bool = True,
        tag: str = "sp reduce-scatter",
    ) -> torch.Tensor:
        """Chunk ``rank`` (along dim 0) of the sum of ``tensor`` over the group, moved as FP8.

        ``state`` gives the cast's scale (it must agree across the group: give it the group as its amax
        reduction group); the chunks are summed in fp32 and returned in ``out_dtype``.
        """
        if self.world_size == 1:
            return tensor.to(out_dtype)
        self._check_divisible(tensor)
        scale = state.scale_for(tensor, record=record)
        payload = quantize(tensor, scale, state.format).contiguous()
        received = torch.empty_like(payload)
        self._count("reduce_scatter", payload, tag)
        dist.all_to_all_single(_wire(received), _wire(payload), group=self.group)
        chunks = received.view(self.world_size, -1, *tensor.shape[1:]).to(torch.float32)
        return (chunks.sum(0) / scale).to(out_dtype)
