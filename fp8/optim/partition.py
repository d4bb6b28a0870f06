"""Whole-tensor partition of parameters over data-parallel ranks (the O3 / ZeRO-1 ownership plan).

Every parameter is owned by exactly one rank, whole, so each tensor keeps one scale. Greedy longest-
processing-time: parameters by decreasing size, each to the least-loaded rank (ties: lowest rank).
The plan depends only on the sizes and the world size, so every rank computes the same one, and the
difference between the most and least loaded rank is at most the largest parameter's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["ParamPartition", "partition_by_size"]


@dataclass(frozen=True)
class ParamPartition:
    """Owner rank of each parameter, in the order the parameters were given.

    - ``owners``: ``owners[i]`` is the rank that owns parameter ``i``.
    - ``sizes``: ``sizes[i]`` is its element count.
    - ``world_size``: number of ranks.
    """

    owners: tuple[int, ...]
    sizes: tuple[int, ...]
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if len(self.owners) != len(self.sizes):
            raise ValueError(f"{len(self.owners)} owners for {len(self.sizes)} parameters")
        bad = [o for o in self.owners if not 0 <= o < self.world_size]
        if bad:
            raise ValueError(f"owner ranks {bad} outside [0, {self.world_size})")

    def owned(self, rank: int) -> list[int]:
        """Indices of the parameters ``rank`` owns, in parameter order."""
        return [i for i, owner in enumerate(self.owners) if owner == rank]

    def loads(self) -> list[int]:
        """Elements owned per rank."""
        load = [0] * self.world_size
        for owner, size in zip(self.owners, self.sizes):
            load[owner] += size
        return load


def partition_by_size(sizes: Sequence[int], world_size: int) -> ParamPartition:
    """Greedy whole-tensor partition of parameters with element counts ``sizes`` over ``world_size``
    ranks: largest first, each to the least-loaded rank (ties: lower rank, then parameter order)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    load = [0] * world_size
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[i] = rank
        load[rank] += int(sizes[i])
    return ParamPartition(tuple(owners), tuple(int(s) for s in sizes), world_size)
