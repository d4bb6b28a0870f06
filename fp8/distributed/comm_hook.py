"""A ``torch.nn.parallel.DistributedDataParallel`` comm hook that counts its bytes: baselines on stock DDP
measured the way the FP8 paths are.

:func:`counting_allreduce_hook` performs its bucket's all-reduce through :class:`fp8.comm.Collectives`
(optionally compressed to another dtype, e.g. BF16) and so records it in a :class:`fp8.comm.CommBytesCounter`.
"""

# No ``from __future__ import annotations`` here: torch DDP checks the comm hook's annotations as objects.
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm import Collectives, CommBytesCounter

__all__ = ["CountingHookState", "counting_allreduce_hook"]


@dataclass
class CountingHookState:
    """State of :func:`counting_allreduce_hook`: the counter, the process group (None: the default
    group) and the dtype the gradients travel in (None: the bucket's own dtype)."""

    counter: CommBytesCounter
    group: dist.ProcessGroup | None = None
    dtype: torch.dtype | None = None
    tag: str = "grads"

    def __post_init__(self) -> None:
        self.comm = Collectives(self.group, self.counter)  # one per hook state, built once


def counting_allreduce_hook(state: CountingHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch DDP comm hook: average the bucket over the group with one all-reduce in ``state.dtype``
    and count its bytes. Register with ``ddp.register_comm_hook(CountingHookState(counter), counting_allreduce_hook)``;
    ``dtype=torch.bfloat16`` reproduces ``bf16_compress_hook`` (which needs CUDA) on any backend."""
    comm = state.comm
    buffer = bucket.buffer()
    wire = buffer if state.dtype in (None, buffer.dtype) else buffer.to(state.dtype)
    wire.div_(comm.world_size)
    future = comm.all_reduce(wire, tag=state.tag).get_future()

    def unpack(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()[0]
        if reduced is not buffer:
            buffer.copy_(reduced)
        return buffer

    return future.then(unpack)
