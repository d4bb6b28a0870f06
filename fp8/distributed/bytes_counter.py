"""Bytes on the wire, counted at the collective calls with the standard ring costs.

Each rank's bytes sent for one collective over ``N`` ranks on a tensor of ``B`` bytes (``B`` is the
full tensor: the all-reduced buffer, the gathered output, the scattered input):

- all-reduce: ``2 (N-1)/N * B`` (ring reduce-scatter then ring all-gather)
- all-gather, reduce-scatter, all-to-all, broadcast: ``(N-1)/N * B``
- send: ``B``
- all-to-all with uneven splits (``all_to_all_v``, the O3 reduce-to-owner): ``B`` is given as the bytes
  this rank sends to the other ranks (its own chunk excluded), counted once

:class:`CommBytesCounter` accumulates these per tag and per collective; :func:`counting_allreduce_hook`
is a ``torch.nn.parallel.DistributedDataParallel`` comm hook that counts and performs its bucket's
all-reduce (optionally compressed to another dtype, e.g. BF16), for baselines counted the same way.
"""

# No ``from __future__ import annotations`` here: torch DDP checks the comm hook's annotations as objects.
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["RING_FACTORS", "ring_bytes", "CommBytesCounter", "CountingHookState", "counting_allreduce_hook"]

RING_FACTORS = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "all_to_all_v": lambda n: 1.0,
}
"""Bytes each rank sends per byte of the full tensor, as a function of the group size ``N``."""


def ring_bytes(kind: str, nbytes: int, world_size: int) -> float:
    """Bytes each rank sends for collective ``kind`` on a ``nbytes``-byte tensor over ``world_size`` ranks."""
    if kind not in RING_FACTORS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {sorted(RING_FACTORS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return RING_FACTORS[kind](world_size) * nbytes


class CommBytesCounter:
    """Accumulates ring-cost bytes sent by this rank, per tag (what travelled) and per collective.

    ``record`` is called at each collective call; ``total`` and ``by_tag`` read the sums (floats:
    the ring factors are fractional), ``calls`` the number of calls per tag; ``reset`` clears all.
    """

    def __init__(self) -> None:
        self.by_tag: dict[str, float] = defaultdict(float)
        self.by_kind: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def record(self, kind: str, nbytes: int, world_size: int, tag: str) -> float:
        """Count one ``kind`` collective on a ``nbytes``-byte tensor; returns the bytes this rank sends."""
        sent = ring_bytes(kind, nbytes, world_size)
        self.by_tag[tag] += sent
        self.by_kind[kind] += sent
        self.calls[tag] += 1
        return sent

    @property
    def total(self) -> float:
        """All bytes sent since the last reset."""
        return float(sum(self.by_tag.values()))

    def reset(self) -> None:
        """Forget every recorded call."""
        self.by_tag.clear()
        self.by_kind.clear()
        self.calls.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """Plain-dict copy: ``{"total": ..., "by_tag": {...}, "by_kind": {...}, "calls": {...}}``."""
        return {
            "total": self.total, "by_tag": dict(self.by_tag), "by_kind": dict(self.by_kind), "calls": dict(self.calls)
        }


@dataclass
class CountingHookState:
    """State of :func:`counting_allreduce_hook`: the counter, the process group (None: the default
    group) and the dtype the gradients travel in (None: the bucket's own dtype)."""

    counter: CommBytesCounter
    group: dist.ProcessGroup | None = None
    dtype: torch.dtype | None = None
    tag: str = "grads"


def counting_allreduce_hook(state: CountingHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch DDP comm hook: average the bucket over the group with one all-reduce in ``state.dtype``
    and count its bytes. Register with ``ddp.register_comm_hook(CountingHookState(counter), counting_allreduce_hook)``;
    ``dtype=torch.bfloat16`` reproduces ``bf16_compress_hook`` (which needs CUDA) on any backend."""
    from .collectives import Collectives

    comm = Collectives(state.group, state.counter)
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
