"""All-gather of whole tensors from their owners (opt level O3): after the optimizer step each rank
sends the tensors it owns and every rank writes every owner's values into its own copies.

Tensors of one dtype travel in one flat buffer per rank, padded to the largest rank's share (the
whole-tensor partition keeps that padding below the largest tensor's size); FP8 payloads travel as
``uint8`` and their fp32 scales in a second, small all-gather.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..comm import Collectives

__all__ = ["start_owner_gather"]


def start_owner_gather(
    tensors: Sequence[torch.Tensor], owners: Sequence[int], comm: Collectives, tag: str
) -> Callable[[], None]:
    """Issue the all-gather that copies each tensor (plain, one dtype, contiguous) from its owner
    ``owners[i]`` into every rank's ``tensors[i]``; returns the function that waits and writes them."""
    if not tensors:
        return lambda: None
    world, rank = comm.world_size, comm.rank
    loads = [0] * world
    for t, owner in zip(tensors, owners):
        loads[owner] += t.numel()
    shard = max(loads)
    send = torch.zeros(shard, dtype=tensors[0].dtype, device=tensors[0].device)
    position = 0
    for t, owner in zip(tensors, owners):
        if owner == rank:
            send[position : position + t.numel()] = t.detach().reshape(-1)
            position += t.numel()
    output = torch.empty(shard * world, dtype=send.dtype, device=send.device)
    work = comm.all_gather(output, send, tag=tag)

    @torch.no_grad()
    def finish() -> None:
        work.wait()
        cursor = [r * shard for r in range(world)]
        for t, owner in zip(tensors, owners):
            start = cursor[owner]
            cursor[owner] += t.numel()
            if owner != rank:
                t.detach().view(-1).copy_(output[start : start + t.numel()])

    return finish
