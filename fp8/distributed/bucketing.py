"""Which gradients travel together: buckets by kind, in backward order, and the own-dtype all-reduce.

FP8 parameters (``fp8.Float8Tensor``) go into FP8 buckets reduced by the scaled FP8 all-reduce; every
other parameter goes into a bucket of its own dtype, all-reduced in that dtype. Parameters are
visited in reverse registration order (gradients become ready roughly in that order during backward)
and buckets are ordered by the position of their last member, i.e. by when they can fill up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..comm import Collectives
from ..tensor import Float8Tensor
from .pipeline import Reduction

__all__ = ["GradBucket", "plan_buckets", "plain_bucket_reduction"]


@dataclass
class GradBucket:
    """Parameters whose gradients are reduced together: ``fp8`` (scaled FP8 all-reduce, 1 byte per
    element on the wire) or plain (all-reduce in ``dtype``)."""

    params: list[nn.Parameter] = field(default_factory=list)
    fp8: bool = False
    dtype: torch.dtype | None = None
    nbytes: int = 0
    last_position: int = -1


def plan_buckets(params: Sequence[nn.Parameter], bucket_bytes: int) -> list[GradBucket]:
    """Group ``params`` (in registration order) into buckets of at most ``bucket_bytes`` on the wire
    (a larger parameter gets a bucket of its own); returns them in launch order."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    open_buckets: dict[tuple, GradBucket] = {}
    closed: list[GradBucket] = []
    for position, param in enumerate(reversed(list(params))):
        fp8 = isinstance(param, Float8Tensor)
        key = ("fp8", param.device) if fp8 else ("plain", param.dtype, param.device)
        nbytes = param.numel() * (1 if fp8 else param.element_size())
        bucket = open_buckets.get(key)
        if bucket is not None and bucket.nbytes + nbytes > bucket_bytes:
            closed.append(bucket)
            bucket = None
        if bucket is None:
            bucket = open_buckets[key] = GradBucket(fp8=fp8, dtype=None if fp8 else param.dtype)
        bucket.params.append(param)
        bucket.nbytes += nbytes
        bucket.last_position = position
    closed.extend(open_buckets.values())
    return sorted(closed, key=lambda b: b.last_position)


def plain_bucket_reduction(tensors: Sequence[torch.Tensor], comm: Collectives, average: bool = True) -> Reduction:
    """Staged all-reduce of same-dtype tensors through one flat buffer in their own dtype; returns the
    averaged (or summed) tensors as views of that buffer, shaped like the inputs."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors])
    yield comm.all_reduce(flat, tag="grads")
    if average:
        flat.div_(comm.world_size)
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
