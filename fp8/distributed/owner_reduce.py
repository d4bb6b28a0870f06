"""Reduce-to-owner of gradient buckets (opt level O3): each gradient is summed on the one rank that
owns it, in the FP8 recipe of the scaled all-reduce, without the all-gather.

For one FP8 bucket on ``N`` ranks: one MAX all-reduce of the tensors' fp32 amaxes gives every rank the
same scale ``s = 2**floor(log2(fmax / A)) * mu`` per tensor; each rank quantizes its gradients with it
into one flat 1-byte buffer ordered by owner, and an all-to-all with uneven splits (``uint8`` on the
wire) sends to each rank the tensors it owns; the owner sums the ``N`` received payloads in fp32 and
re-quantizes the sum with the same scale. FP8 bytes are never summed as integers. Other gradients take
the same all-to-all in their own dtype and are summed in fp32 on the owner.

A reduction returns one entry per input: the reduced gradient for tensors this rank owns, ``None`` for
the others. The overflow statistic of mu is recorded on the owner's values only; the caller sums it
over the ranks before closing mu's step (:func:`agree_overflow_statistic`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm import Collectives
from ..tensor import Float8Tensor
from .auto_scale import AutoScaleState
from .pipeline import Reduction
from ..blocks import Block
from .scaled_allreduce import block_amaxes, count_at_max, scale_slices, shared_scales, quantize_shared

__all__ = ["fp8_owner_reduction", "plain_owner_reduction", "agree_overflow_statistic"]


def _layout(tensors: Sequence[torch.Tensor], owners: Sequence[int], world: int):
    """Send order (grouped by owner, stable), per-rank split sizes and each tensor's send offset."""
    order = sorted(range(len(tensors)), key=lambda i: owners[i])
    splits = [0] * world
    offsets = [0] * len(tensors)
    position = 0
    for i in order:
        offsets[i] = position
        position += tensors[i].numel()
        splits[owners[i]] += tensors[i].numel()
    return order, splits, offsets, position


def _owned_offsets(tensors: Sequence[torch.Tensor], owners: Sequence[int], rank: int) -> dict[int, int]:
    """Offset of each tensor ``rank`` owns inside that rank's received chunk."""
    out, position = {}, 0
    for i in sorted(range(len(tensors)), key=lambda i: owners[i]):
        if owners[i] == rank:
            out[i] = position
            position += tensors[i].numel()
    return out


def fp8_owner_reduction(
    tensors: Sequence[torch.Tensor], owners: Sequence[int], state: AutoScaleState, comm: Collectives,
    average: bool = True, blocks: Sequence[Block | None] | None = None,
) -> Reduction:
    """Staged reduce-to-owner of one FP8 bucket (module docstring): yields after its amax all-reduce
    and its all-to-all; returns a :class:`~fp8.Float8Tensor` per tensor this rank owns, else ``None``.
    ``blocks[i]``: shared scales per block of tensor ``i`` (as :func:`fp8.distributed.scaled_all_reduce`)."""
    fmt, world, rank = state.format, comm.world_size, comm.rank
    blocks = list(blocks) if blocks is not None else [None] * len(tensors)
    device = tensors[0].device
    order, splits, offsets, total = _layout(tensors, owners, world)

    amax = block_amaxes(tensors, blocks)
    yield comm.all_reduce(amax, op=dist.ReduceOp.MAX, tag="fp8 amax")

    scales = shared_scales(amax, fmt, state.mu_scale().to(device), world if average else 1)
    slices = scale_slices(tensors, blocks)
    send = torch.empty(total, dtype=fmt.dtype, device=device)
    for i in order:
        start, end, shape = slices[i]
        send[offsets[i] : offsets[i] + tensors[i].numel()] = quantize_shared(
            tensors[i], scales[start:end].reshape(shape), blocks[i], fmt)
    mine = splits[rank]
    received = torch.empty(mine * world, dtype=fmt.dtype, device=device)
    yield comm.all_to_all_v(received, send, [mine] * world, splits, tag="fp8 grads")
    del send

    reduced = received.view(world, mine).to(torch.float32).sum(0).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    del received
    state.record(count_at_max(reduced, fmt), mine)
    result_scales = scales * world if average else scales
    results: list[torch.Tensor | None] = [None] * len(tensors)
    for i, offset in _owned_offsets(tensors, owners, rank).items():
        t = tensors[i]
        start, end, shape = slices[i]
        results[i] = Float8Tensor(reduced[offset : offset + t.numel()].view(t.shape),
                                  result_scales[start:end].reshape(shape).clone(), t.dtype, block=blocks[i])
    return results


def plain_owner_reduction(
    tensors: Sequence[torch.Tensor], owners: Sequence[int], comm: Collectives, average: bool = True
) -> Reduction:
    """Reduce-to-owner of same-dtype tensors in their own dtype (sum in fp32 on the owner); returns the
    averaged (or summed) tensor for each tensor this rank owns, else ``None``."""
    world, rank = comm.world_size, comm.rank
    dtype, device = tensors[0].dtype, tensors[0].device
    order, splits, offsets, total = _layout(tensors, owners, world)
    send = torch.empty(total, dtype=dtype, device=device)
    for i in order:
        send[offsets[i] : offsets[i] + tensors[i].numel()] = tensors[i].detach().reshape(-1)
    mine = splits[rank]
    received = torch.empty(mine * world, dtype=dtype, device=device)
    yield comm.all_to_all_v(received, send, [mine] * world, splits, tag="grads")
    summed = received.view(world, mine).to(torch.float32).sum(0)
    if average:
        summed.div_(world)
    summed = summed.to(dtype)
    results: list[torch.Tensor | None] = [None] * len(tensors)
    for i, offset in _owned_offsets(tensors, owners, rank).items():
        results[i] = summed[offset : offset + tensors[i].numel()].view(tensors[i].shape)
    return results


@torch.no_grad()
def agree_overflow_statistic(state: AutoScaleState, comm: Collectives) -> None:
    """Sum this step's overflow and value counts over the ranks (each owner counted its own values),
    so every rank closes mu's step identically. One 16-byte all-reduce."""
    counts = torch.stack([state.overflow_count, state.value_count])
    comm.all_reduce(counts, tag="fp8 overflow").wait()
    state.overflow_count.copy_(counts[0])
    state.value_count.copy_(counts[1])
