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

Every call goes through :class:`fp8.comm.Collectives` (counted with its ring costs: an all-to-all of ``B``
bytes costs what a ring reduce-scatter of ``B`` bytes does, ``(N-1)/N * B`` per rank; FP8 as ``uint8``;
tensors on the group's device).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import ops
from ..comm import Collectives, CommBytesCounter
from ..scaling import ScalingState

__all__ = ["TensorParallelComm"]


class TensorParallelComm:
    """Collectives over one tensor-parallel group; ``group=None`` with no process group means size 1.

    ``counter`` (optional, may be set later) records every byte this object sends, by tag.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, counter: CommBytesCounter | None = None) -> None:
        self.group = group
        if group is None and not (dist.is_available() and dist.is_initialized()):
            self._comm = None
            self.world_size, self.rank = 1, 0
            self._counter = counter
        else:
            self._comm = Collectives(group, counter)
            self.world_size, self.rank = self._comm.world_size, self._comm.rank

    @property
    def collectives(self) -> Collectives | None:
        """The group's :class:`fp8.comm.Collectives` (None for size 1 without a process group): scaling states
        that agree over this group share it, and so its counter."""
        return self._comm

    @property
    def counter(self) -> CommBytesCounter | None:
        """The byte counter of this group's collectives (settable)."""
        return self._comm.counter if self._comm is not None else self._counter

    @counter.setter
    def counter(self, counter: CommBytesCounter | None) -> None:
        if self._comm is not None:
            self._comm.counter = counter
        else:
            self._counter = counter

    def all_gather(self, tensor: torch.Tensor, tag: str = "sp all-gather") -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along dim 0 in rank order (FP8 stays FP8, 1 byte/value)."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        out = torch.empty((self.world_size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype,
                          device=tensor.device)
        self._comm.all_gather(out, tensor, tag).wait()
        return out

    def all_reduce(self, tensor: torch.Tensor, tag: str = "tp all-reduce") -> torch.Tensor:
        """Sum of ``tensor`` over the group (high precision), in place."""
        if self.world_size == 1:
            return tensor
        self._comm.all_reduce(tensor, tag=tag).wait()
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
        self._comm.reduce_scatter(out, tensor, tag).wait()
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
        # the cast in fused kernels (the amax agreed over the group, then one cast), the epilogue in one
        payload, _, scale_inv = state.quantize(tensor.reshape(-1, tensor.shape[-1]), record=record)
        received = torch.empty_like(payload)
        self._comm.all_to_all(received, payload, tag).wait()
        out = ops.sum_chunks(received, self.world_size, scale_inv, out_dtype)
        return out.view(tensor.shape[0] // self.world_size, *tensor.shape[1:])
