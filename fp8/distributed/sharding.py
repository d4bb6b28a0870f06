"""Parameters that FSDP2 (``torch.distributed.fsdp.fully_shard``) replaced by row shards, as fp8's optimizers see them.

``fully_shard`` swaps each parameter of a module for a new ``nn.Parameter`` holding a ``DTensor`` whose local tensor
is this rank's rows (``Shard(0)``, ``torch.chunk``'s split: ``ceil(rows / N)`` rows per rank, the last ranks shorter
or empty). An optimizer built before it (``fp8.initialize`` returns one) still holds the old, full parameters. This
module finds what moved (:class:`ParamSlots`: each parameter by the module attribute that holds it) and cuts the
optimizer's own full-size tensors (high-precision masters, moments) to the same rows (:func:`shard_like`,
:func:`local_rows`), so they are sharded exactly like the weights they belong to.

``torch.distributed.tensor`` is imported by whoever makes a DTensor (FSDP2); this module only looks for it in
``sys.modules``, so ``import fp8`` does not pay for it.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

__all__ = ["is_dtensor", "local", "ParamSlots", "local_rows", "rows_as_dtensor", "shard_like", "shard_state",
           "swap_params", "check_fsdp_placement"]


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (never imports it: none exists before it is)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local(t):
    """``t``'s local tensor if it is a DTensor (this rank's shard), else ``t`` itself (None stays None)."""
    return t._local_tensor if is_dtensor(t) else t


def check_fsdp_placement(param: torch.Tensor, name: str) -> None:
    """Refuse a sharded parameter fp8's optimizers cannot follow: anything but a 1-D mesh with ``Shard(0)``."""
    placements = tuple(param.placements)
    if len(placements) != 1 or type(placements[0]).__name__ != "Shard" or placements[0].dim != 0:
        raise NotImplementedError(
            f"{name}: fp8's optimizers follow parameters sharded by FSDP2 along dim 0 on a 1-D mesh; this one has "
            f"placements {placements} on mesh {param.device_mesh}; call fully_shard with a 1-D mesh (no HSDP, no "
            f"tensor parallel mesh) and the default shard_placement_fn")


def local_rows(full_rows: int, sharded: torch.Tensor) -> slice:
    """The rows of a ``full_rows``-row tensor that this rank holds in ``sharded`` (a ``Shard(0)`` DTensor, FSDP2's
    ``torch.chunk`` split)."""
    mesh = sharded.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    chunk = -(-full_rows // world)
    start = min(rank * chunk, full_rows)
    length = local(sharded).shape[0] if local(sharded).dim() else 0
    if start + length > full_rows or length != max(0, min(chunk, full_rows - start)):
        raise RuntimeError(f"a shard of {length} rows at row {start} does not match FSDP2's split of {full_rows} rows "
                           f"over {world} ranks")
    return slice(start, start + length)


def rows_as_dtensor(rows: torch.Tensor, sharded: torch.Tensor) -> torch.Tensor:
    """``rows`` (this rank's rows of a tensor with ``sharded``'s number of rows) as a DTensor of ``sharded``'s mesh and
    placement in its global shape, sharing ``rows``' storage (no copy, no collective)."""
    from torch.distributed.tensor import DTensor

    shape = torch.Size((sharded.shape[0], *rows.shape[1:]))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(rows, sharded.device_mesh, sharded.placements, run_check=False, shape=shape,
                              stride=stride)


def shard_like(full: torch.Tensor, sharded: torch.Tensor) -> torch.Tensor:
    """This rank's rows of ``full`` (a tensor of ``sharded``'s global shape) as a DTensor of ``sharded``'s mesh and
    placement: a copy of the rows, so the full tensor can be freed."""
    from torch.distributed.tensor import DTensor

    rows = local_rows(full.shape[0], sharded)
    piece = full.detach()[rows].clone()
    return DTensor.from_local(piece, sharded.device_mesh, sharded.placements, run_check=False, shape=full.shape,
                              stride=full.stride())


class ParamSlots:
    """Every parameter of ``model`` by the module attribute holding it, so an optimizer built before ``fully_shard``
    can tell which of its parameters FSDP2 replaced, and by what. :meth:`moved` is a host-side scan (no tensor op)."""

    def __init__(self, model: nn.Module | None) -> None:
        self.slots: list[tuple[nn.Module, str, str, torch.Tensor]] = []
        self._groups: list[list[torch.Tensor]] | None = None
        if model is None:
            return
        for fqn, module in model.named_modules():
            for name, param in module._parameters.items():
                if param is not None:
                    self.slots.append((module, name, f"{fqn}.{name}" if fqn else name, param))

    def moved(self, record: bool = True) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """``(name, old, new)`` for each parameter replaced by a DTensor since the last recording call (each reported
        once; ``record=False`` only looks, so a refusal raised from it is raised again at the next call).
        Other replacements are not reported and not recorded: FSDP2 puts its unsharded parameters in the modules
        between a unit's all-gather and its reshard (the root stays unsharded after a forward without backward),
        and swaps the sharded ones back after."""
        found = []
        for i, (module, name, fqn, old) in enumerate(self.slots):
            new = module._parameters.get(name)
            if new is not None and new is not old and is_dtensor(new):
                found.append((fqn, old, new))
                if record:
                    self.slots[i] = (module, name, fqn, new)
        return found

    def remember(self, param_groups: list[dict]) -> None:
        """Record the parameters of an optimizer's ``param_groups`` (in order), for :meth:`put_back`."""
        self._groups = [list(group["params"]) for group in param_groups]

    def put_back(self, param_groups: list[dict]) -> None:
        """Undo a remap of ``param_groups`` by FSDP2 shards done by someone else since :meth:`remember`: Accelerate's
        FSDP2 ``prepare`` swaps an optimizer's parameters for the model's sharded ones itself (at every ``prepare``),
        matched through ``data_ptr()``, which is 0 for every FP8 weight (a wrapper tensor without storage) and every
        empty shard, so all of those get the same one, while the optimizer's state stays keyed by its own parameters.
        A group whose changed entries are all DTensors gets its remembered list back, so the optimizer's own follow
        takes each parameter over with its state (and O3's owners hand theirs over) as after a plain ``fully_shard``.
        Other edits of the groups (parameters appended or removed in place, no DTensor among them) are the user's:
        kept, and remembered. A group changed both ways is refused. Host-side only (identity checks)."""
        if self._groups is None:
            return
        accepted = False
        for index, (group, before) in enumerate(zip(param_groups, self._groups)):
            now = group["params"]
            same_length = len(now) == len(before)
            if same_length:
                changed = [p for p, q in zip(now, before) if p is not q]
                if not changed:
                    continue
            else:
                kept = {id(q) for q in before}
                changed = [p for p in now if id(p) not in kept]
            shards = [p for p in changed if is_dtensor(p)]
            if not shards:
                accepted = True  # the user's own edit (no FSDP2 shard in it)
            elif len(shards) == len(changed) and same_length:
                group["params"] = list(before)
            else:
                raise RuntimeError(
                    f"param group {index} of fp8's optimizer was changed from outside both with FSDP2 shards and "
                    f"otherwise; add parameters with optimizer.add_param_group, and shard with fully_shard or "
                    f"Accelerate's FSDP2 plugin")
        if accepted:
            self.remember(param_groups)

    def take_sharded(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """:meth:`moved`, each entry checked by :meth:`sharded` before any is recorded: a refused sharding is refused
        again at the next call, never taken as followed."""
        found = self.sharded(self.moved(record=False))
        self.moved()
        return found

    @staticmethod
    def sharded(moved: list[tuple[str, torch.Tensor, torch.Tensor]]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """The entries of ``moved``, each checked to be FSDP2's shard of the old parameter (its global shape, a
        placement the optimizers can follow)."""
        out = []
        for fqn, old, new in moved:
            if tuple(new.shape) != tuple(old.shape):
                raise RuntimeError(
                    f"parameter {fqn!r} was replaced after fp8.initialize by a DTensor of global shape "
                    f"{tuple(new.shape)}, not its shape {tuple(old.shape)}; fp8's optimizer follows FSDP2's sharding "
                    f"(fully_shard) only")
            check_fsdp_placement(new, fqn)
            out.append((fqn, old, new))
        return out


def swap_params(param_groups: list[dict], state: dict, swap: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                as_dtensor: bool) -> None:
    """An optimizer's ``param_groups`` and ``state`` moved to FSDP2's shards: ``swap`` maps ``id(old)`` to ``(old, new,
    ref)``; ``old`` becomes ``new`` in the groups and its state, cut to the rows of ``ref`` (``shard_state``), is
    ``new``'s."""
    for group in param_groups:
        group["params"] = [swap[id(p)][1] if id(p) in swap else p for p in group["params"]]
    for old, new, ref in swap.values():
        moved = state.pop(old, None)
        if moved:
            state[new] = shard_state(moved, old, ref, as_dtensor)


def shard_state(state: dict, old: torch.Tensor, new: torch.Tensor, as_dtensor: bool) -> dict:
    """An optimizer state of full parameter ``old`` cut to ``new``'s local rows: tensors of ``old``'s shape are
    sliced (as DTensors like ``new`` where ``as_dtensor``, else as local tensors), others (steps, scales) kept."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() and tuple(value.shape) == tuple(old.shape):
            out[key] = shard_like(value, new) if as_dtensor else value.detach()[local_rows(old.shape[0], new)].clone()
        else:
            out[key] = value
    return out
