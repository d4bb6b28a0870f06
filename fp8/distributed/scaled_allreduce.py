"""Scaled FP8 all-reduce: gradients cross the wire as 1-byte values with a scale shared by all ranks.

For one bucket of tensors on ``N`` ranks (FP8-LM recipe, sums formed in fp32):

1. **Shared scale.** Each rank takes every tensor's amax (of its finite values); one MAX all-reduce of
   these fp32 amaxes (4 bytes per tensor) gives every rank the same amax ``A``, and the same scale
   ``s = 2**floor(log2(fmax / A)) * mu`` (mu: :class:`~fp8.distributed.AutoScaleState`, a power of two).
2. **Quantize and exchange.** Each rank writes ``cast(clamp(g * s))`` for all tensors into one flat FP8
   buffer, padded to a multiple of ``N``, and an all-to-all (as ``uint8``) hands shard ``j`` of
   every rank's buffer to rank ``j`` (the reduce-scatter's traffic, 1 byte per element).
3. **Sum and re-quantize.** Rank ``j`` sums its ``N`` shards in fp32. All ranks used the same scale, so
   the sum is taken on the payloads directly and re-quantized with that scale (``clamp`` to the
   format's range, round to nearest).
4. **All-gather** (as ``uint8``) of the summed shards: every rank ends with identical bytes.

The result is a :class:`~fp8.Float8Tensor` per input: payload ``sum`` with scale ``s * N`` (average) or
``s`` (sum). A tensor given a block (``blocks[i]``, the gradient of a weight of the ``rowwise``/``blockwise``
recipes: :mod:`fp8.blocks`) gets one shared scale per block instead: its grid of block amaxes joins the same
MAX all-reduce (4 bytes per block), every block is quantized with its own shared scale, and the result carries
the grid (``block=``); the sums of step 3 need no scales (each element's scale is the same on every rank). The fraction of result values at the format maximum (saturated sums) feeds mu's rule;
it is counted on the gathered payload, which every rank holds, so mu stays identical without a
collective. Non-finite inputs: ``inf`` saturates at the format maximum (and counts as overflow), the
scale comes from the finite values; ``NaN`` stays ``NaN``.
"""

from __future__ import annotations

import functools

import math
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from ..blocks import Block, block_amax, grid_shape, quantize_blocks
from ..cast import payload_and_scale, quantize
from ..comm import Collectives, CommBytesCounter
from ..formats import FP8Format
from ..scaling import compute_scale
from ..tensor import Float8Tensor
from .auto_scale import AutoScaleState
from .pipeline import Reduction, ReductionPipeline

__all__ = ["DEFAULT_BUCKET_BYTES", "scaled_all_reduce", "fp8_bucket_reduction", "coalesce", "quantize_shared", "block_amaxes",
           "count_at_max", "scale_slices", "shared_scales"]

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Bucket capacity in bytes on the wire (torch DDP's default 25 MiB): 25 Mi elements of FP8."""


def _check_input(t: torch.Tensor) -> None:
    if payload_and_scale(t) is None and not t.is_floating_point():
        raise TypeError(f"scaled_all_reduce takes floating-point tensors, fp8.Float8Tensor or fp8.ScaledFloat16Tensor, "
                        f"got {t.dtype}")


def _values(t: torch.Tensor) -> torch.Tensor:
    """fp32 value of a scaled tensor (Float8Tensor, ScaledFloat16Tensor) or a plain floating tensor."""
    if payload_and_scale(t) is not None:
        return t.dequantize(torch.float32)
    return t.detach().to(torch.float32)


def _finite_amax(t: torch.Tensor) -> torch.Tensor:
    """Largest finite magnitude of ``t`` (0-d fp32, 0 for an empty or all non-finite tensor), no host sync."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    parts = payload_and_scale(t)
    if parts is not None:  # a tensor-wise scaled gradient (FP8 or FP16): a power-of-two scale divides exactly
        payload_amax = parts[0].to(torch.float32).abs().nan_to_num(nan=0.0, posinf=0.0).amax()
        return payload_amax * parts[1].reciprocal()
    return t.detach().to(torch.float32).abs().nan_to_num(nan=0.0, posinf=0.0).amax()


def block_amaxes(tensors: Sequence[torch.Tensor], blocks: Sequence[Block | None]) -> torch.Tensor:
    """The finite amaxes of a bucket as one flat fp32 vector: one per tensor-wise tensor, a grid per block-scaled one
    (in tensor order)."""
    parts = []
    for t, block in zip(tensors, blocks):
        if block is None:
            parts.append(_finite_amax(t).reshape(1))
        else:
            values = _values(t).reshape(t.shape[0], -1).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
            parts.append(block_amax(values, block).reshape(-1))
    return torch.cat(parts)


def scale_slices(tensors: Sequence[torch.Tensor], blocks: Sequence[Block | None]) -> list[tuple[int, int, tuple]]:
    """``(start, end, shape)`` of each tensor's scale(s) in the flat vector of :func:`block_amaxes` (shape ``()`` or the grid)."""
    out, position = [], 0
    for t, block in zip(tensors, blocks):
        shape = () if block is None else grid_shape(block, (t.shape[0], t.numel() // max(t.shape[0], 1)))
        n = 1 if block is None else shape[0] * shape[1]
        out.append((position, position + n, shape))
        position += n
    return out


def quantize_shared(t: torch.Tensor, scale: torch.Tensor, block: Block | None, fmt: FP8Format) -> torch.Tensor:
    """The flat FP8 payload of ``t`` with its shared scale (0-d) or shared block scales (a grid)."""
    if block is None:
        return quantize(_values(t).reshape(-1), scale, fmt)
    return quantize_blocks(_values(t).reshape(t.shape[0], -1), scale, block, fmt).reshape(-1)


def shared_scales(amax: torch.Tensor, fmt: FP8Format, mu_scale: torch.Tensor, world_size: int) -> torch.Tensor:
    """Per-tensor communication scales from the agreed amaxes: ``2**floor(log2(fmax/amax)) * mu``,
    kept inside the normal fp32 range even after the averaging factor ``world_size``."""
    scale = compute_scale(amax, fmt) * mu_scale
    top = 2.0 ** (126 - math.ceil(math.log2(world_size)))
    return scale.clamp(2.0**-126, top)


@functools.lru_cache(maxsize=None)
def _max_magnitude_bits(fmt: FP8Format) -> int:
    """The byte of +fmt.max without its sign bit (a host constant, computed once per format)."""
    return int(torch.tensor(fmt.max, dtype=fmt.dtype).view(torch.uint8)) & 0x7F


def count_at_max(payload: torch.Tensor, fmt: FP8Format) -> torch.Tensor:
    """Number of payload values equal to +-fmt.max (0-d int64), compared bit-wise on the bytes."""
    return ((payload.view(torch.uint8) & 0x7F) == _max_magnitude_bits(fmt)).sum()


def fp8_bucket_reduction(
    tensors: Sequence[torch.Tensor], state: AutoScaleState, comm: Collectives, average: bool = True,
    blocks: Sequence[Block | None] | None = None,
) -> Reduction:
    """Staged scaled FP8 all-reduce of one bucket (see the module docstring); yields after issuing each
    of its three collectives, returns one :class:`~fp8.Float8Tensor` per input (payloads are views of
    one gathered buffer). ``blocks[i]``: the block of tensor ``i``'s shared scales (None: one scale). Records
    the overflow statistic in ``state``; does not update mu."""
    for t in tensors:
        _check_input(t)
    blocks = list(blocks) if blocks is not None else [None] * len(tensors)
    fmt = state.format
    world = comm.world_size
    device = tensors[0].device
    numels = [t.numel() for t in tensors]
    offsets = [0]
    for numel in numels:
        offsets.append(offsets[-1] + numel)
    total = offsets[-1]
    shard = -(-total // world)
    padded = shard * world

    # 1. One amax per tensor (per block of a block-scaled one), agreed across ranks (MAX).
    amax = block_amaxes(tensors, blocks)
    yield comm.all_reduce(amax, op=dist.ReduceOp.MAX, tag="fp8 amax")

    # 2. Quantize every tensor with the shared scale(s), exchange shards (1 byte per element).
    scales = shared_scales(amax, fmt, state.mu_scale().to(device), world if average else 1)
    slices = scale_slices(tensors, blocks)
    send = torch.zeros(padded, dtype=fmt.dtype, device=device)
    for i, t in enumerate(tensors):
        start, end, shape = slices[i]
        send[offsets[i] : offsets[i + 1]] = quantize_shared(t, scales[start:end].reshape(shape), blocks[i], fmt)
    received = torch.empty_like(send)
    yield comm.all_to_all(received, send, tag="fp8 grads")
    del send

    # 3. Sum this rank's shard over the ranks in fp32, re-quantize with the same scale, gather.
    shard_sum = received.view(world, shard).to(torch.float32).sum(0)
    del received
    reduced = shard_sum.clamp(-fmt.max, fmt.max).to(fmt.dtype)
    gathered = torch.empty(padded, dtype=fmt.dtype, device=device)
    yield comm.all_gather(gathered, reduced, tag="fp8 grads")

    # 4. Overflow statistic on the gathered bytes (identical on every rank), results.
    state.record(count_at_max(gathered[:total], fmt), total)
    result_scales = scales * world if average else scales
    return [
        Float8Tensor(gathered[offsets[i] : offsets[i + 1]].view(t.shape),
                     result_scales[slices[i][0]:slices[i][1]].reshape(slices[i][2]).clone(), t.dtype, block=blocks[i])
        for i, t in enumerate(tensors)
    ]


def coalesce(tensors: Sequence[torch.Tensor], bucket_bytes: int, bytes_per_element: int = 1) -> Iterator[list[int]]:
    """Indices of consecutive ``tensors`` grouped into buckets of at most ``bucket_bytes`` on the wire
    (a tensor larger than that gets a bucket of its own)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[int] = []
    size = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * bytes_per_element
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append(i)
        size += nbytes
    if bucket:
        yield bucket


def scaled_all_reduce(
    tensors: Sequence[torch.Tensor],
    state: AutoScaleState,
    group: dist.ProcessGroup | None = None,
    *,
    average: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    counter: CommBytesCounter | None = None,
    update_mu: bool = True,
    blocks: Sequence[Block | None] | None = None,
) -> list[Float8Tensor]:
    """Average (or sum, ``average=False``) ``tensors`` over ``group`` with the scaled FP8 all-reduce.

    ``tensors`` are this rank's gradients, :class:`~fp8.Float8Tensor` or plain floating tensors, in
    the same order and shapes on every rank. Small tensors are coalesced into buckets of
    ``bucket_bytes`` (1 byte per element) whose collectives are pipelined. Returns one
    :class:`~fp8.Float8Tensor` per input (format ``state.format``, reporting the input's dtype),
    byte-identical on every rank; with ``update_mu`` the call closes a step of mu's rule. Bytes sent
    are recorded in ``counter`` if given. ``blocks[i]`` (2-D tensors): one shared scale per block of tensor ``i``
    (module docstring); the result carries the grid.
    """
    if not tensors:
        return []
    comm = Collectives(group, counter)
    pipeline = ReductionPipeline()
    for indices in coalesce(tensors, bucket_bytes):
        pipeline.launch(fp8_bucket_reduction([tensors[i] for i in indices], state, comm, average,
                                             None if blocks is None else [blocks[i] for i in indices]), eager=True)
    results = [result for bucket in pipeline.drain() for result in bucket]
    if update_mu:
        state.update()
    return results
