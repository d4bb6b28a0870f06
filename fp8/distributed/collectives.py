"""The collective calls of ``fp8.distributed``: asynchronous, byte-counted, FP8 carried as ``uint8``.

gloo and NCCL refuse float8 tensors in collectives but carry the same bytes viewed as ``uint8``, so
every FP8 tensor crosses the wire through a ``uint8`` view (1 byte per element, no conversion).
Every call returns the async work handle and records its ring-cost bytes in a
:class:`~fp8.distributed.bytes_counter.CommBytesCounter` when one is given.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .bytes_counter import CommBytesCounter

__all__ = ["Collectives", "FP8_DTYPES", "require_process_group"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# all_gather_single replaces the deprecated all_gather_into_tensor in recent torch releases.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def require_process_group(what: str) -> None:
    """Raise a clear error when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs an initialized process group: call torch.distributed.init_process_group('gloo' or 'nccl') "
            f"first (torchrun sets the rendezvous environment)"
        )


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as it travels: FP8 as a ``uint8`` view of the same bytes, anything else unchanged."""
    if tensor.dtype in FP8_DTYPES:
        if not tensor.is_contiguous():
            raise ValueError("FP8 tensors must be contiguous to travel as uint8; call .contiguous() first")
        return tensor.view(torch.uint8)
    return tensor


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Collectives:
    """Asynchronous collectives over one process group (``None``: the default group), counted.

    Methods return the ``torch.distributed`` work handle; ``tag`` names what travelled in the counter.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, counter: CommBytesCounter | None = None) -> None:
        require_process_group("fp8.distributed")
        self.group = group if group is not None else dist.group.WORLD
        self.counter = counter
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)

    def _count(self, kind: str, nbytes: int, tag: str) -> None:
        if self.counter is not None:
            self.counter.record(kind, nbytes, self.world_size, tag)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, tag: str = "grads") -> dist.Work:
        """In-place all-reduce of ``tensor`` (not FP8: sums need arithmetic) with ``op``."""
        if tensor.dtype in FP8_DTYPES:
            raise TypeError("FP8 tensors cannot be all-reduced by the backend; use fp8.distributed.scaled_all_reduce")
        self._count("all_reduce", _nbytes(tensor), tag)
        return dist.all_reduce(tensor, op=op, group=self.group, async_op=True)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, tag: str) -> dist.Work:
        """Equal-split all-to-all: chunk ``j`` of ``input`` goes to rank ``j``; chunk ``j`` of ``output``
        comes from rank ``j``. Counted on the full ``input``."""
        self._count("all_to_all", _nbytes(input), tag)
        return dist.all_to_all_single(_wire(output), _wire(input), group=self.group, async_op=True)

    def all_to_all_v(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int], tag: str
    ) -> dist.Work:
        """All-to-all with uneven splits (1-d tensors): ``input_splits[j]`` elements go to rank ``j``,
        ``output_splits[j]`` elements come from rank ``j``. Counted as the bytes sent to other ranks."""
        sent = (sum(input_splits) - input_splits[self.rank]) * input.element_size()
        self._count("all_to_all_v", sent, tag)
        return dist.all_to_all_single(
            _wire(output), _wire(input), output_split_sizes=list(output_splits),
            input_split_sizes=list(input_splits), group=self.group, async_op=True,
        )

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: str) -> dist.Work:
        """``output`` (``world_size`` times ``input``) gets every rank's ``input`` in rank order.
        Counted on the full ``output``."""
        self._count("all_gather", _nbytes(output), tag)
        return _all_gather(_wire(output), _wire(input), group=self.group, async_op=True)

    def broadcast(self, tensor: torch.Tensor, tag: str, src: int = 0) -> dist.Work:
        """In-place broadcast of ``tensor`` from group rank ``src``."""
        self._count("broadcast", _nbytes(tensor), tag)
        return dist.broadcast(_wire(tensor), src=dist.get_global_rank(self.group, src), group=self.group, async_op=True)
