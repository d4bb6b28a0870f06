"""Device launches counted on any device: every dispatched op that is not a view or a pure allocation.

On a GPU each such op is one kernel launch (a 0-d scale op included) or one copy; a fused kernel registered as a
``torch.library`` custom op (:mod:`fp8.ops`) is one op here and one launch there, so the op sequence a CPU run
dispatches is the GPU's launch sequence, countable without a GPU. :class:`LaunchCounter` is the context manager
that counts them (``benchmarks/kernels.py``, the launch tests):

- ``launches``: ops dispatched, minus views (``OpOverload.is_view``) and the ops of :data:`NO_LAUNCH` (metadata
  and allocation only);
- ``full_size_passes``: those of them reading or writing a tensor of at least ``full_size`` elements (a pass
  over a full-size tensor: what bounds an elementwise kernel's time);
- ``by_op``: launches per op name, to see what a path runs.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LaunchCounter", "NO_LAUNCH"]

aten = torch.ops.aten

NO_LAUNCH = frozenset({
    aten._unsafe_view.default, aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.empty_like.default, aten.lift_fresh.default, aten.detach.default,
    aten.alias.default, aten.set_.source_Storage_storage_offset, aten.resize_.default, aten.sym_size.int,
    aten.sym_stride.int, aten.sym_numel.default, aten.is_same_size.default,
})
"""Ops that change metadata or allocate without touching device memory: no launch on a GPU."""


class LaunchCounter(TorchDispatchMode):
    """Counts the device launches of what runs inside it (module docstring). ``full_size``: the element count from
    which a tensor is full-size (None: passes are not counted)."""

    def __init__(self, full_size: int | None = None) -> None:
        super().__init__()
        self.full_size = full_size
        self.launches = 0
        self.full_size_passes = 0
        self.by_op: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func in NO_LAUNCH:
            return out
        self.launches += 1
        self.by_op[str(func.overloadpacket) if func.namespace == "aten" else str(func)] += 1
        if self.full_size is not None:
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            if any(t.numel() >= self.full_size for t in tensors):
                self.full_size_passes += 1
        return out
