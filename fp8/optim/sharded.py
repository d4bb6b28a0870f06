"""The FP8 distributed optimizer of opt level O3: ZeRO-1-style sharding of the O2 optimizer over the
data-parallel group, by whole tensors.

Every rank keeps all parameters (FP8 weights with their scales, the few high-precision ones) for the
forward and backward, but the optimizer state, i.e. FP16 master + scale, E4M3 first moment + scale,
FP16 second moment + scale, step, only for the parameters it owns (:mod:`fp8.optim.partition`).
:class:`fp8.distributed.DistributedDataParallel`, given this optimizer (``o3_optimizer=optimizer``),
reduces each gradient to its owner only, freeing the others; the step
updates the owned parameters, then all-gathers the updated FP8 payloads (``uint8``) with their scales,
and the other parameters in their own dtype, from their owners to every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..comm import Collectives, CommBytesCounter, require_process_group
from ..formats import byte_view
from ..recipes import refresh_weight_operands
from ..tensor import Float8Tensor
from .adam import Adam, AdamW
from .base import FP8Optimizer, grads_finite_flag
from .clip import clip_grad_norm_, grad_norms, scale_grads_to_norm_
from .convert import converted_arguments
from .partition import ParamPartition, partition_by_size
from .precision import OptimizerPrecision
from .sgd import SGD

__all__ = [
    "ExpertOwners", "start_owner_gather",
    "ShardedFP8Optimizer", "ShardedAdam", "ShardedAdamW", "ShardedSGD", "convert_to_sharded",
]


def _normalize_groups(params) -> list[dict[str, Any]]:
    groups = list(params)
    if not groups:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for group in groups:
        group = dict(group)
        ps = group["params"]
        group["params"] = [ps] if isinstance(ps, torch.Tensor) else list(ps)
        out.append(group)
    return out


def start_owner_gather(tensors: list[torch.Tensor], owners: list[int], comm: Collectives, tag: str) -> Callable[[], None]:
    """Issue the all-gather that copies each tensor (plain, one dtype, contiguous) from its owner ``owners[i]`` into
    every rank's ``tensors[i]``; returns the function that waits and writes them. The semantics (and bytes on the wire)
    of :func:`fp8.distributed.gather.start_owner_gather`, in a fixed number of ops whatever the number of tensors: the
    rank's own tensors packed by one multi-tensor copy into the zeroed send buffer (one flat buffer per rank, padded
    to the largest rank's share), the others' unpacked by one after the wait (``torch._foreach_copy_``, FP8 as bytes)."""
    if not tensors:
        return lambda: None
    world, rank = comm.world_size, comm.rank
    loads = [0] * world
    for t, owner in zip(tensors, owners):
        loads[owner] += t.numel()
    shard = max(loads)
    send = torch.zeros(shard, dtype=tensors[0].dtype, device=tensors[0].device)
    flat = [byte_view(t.detach()).view(-1) for t in tensors]
    mine = [f for f, owner in zip(flat, owners) if owner == rank]
    if mine:
        sizes = [f.numel() for f in mine]
        torch._foreach_copy_(list(byte_view(send).split([*sizes, shard - sum(sizes)]))[:len(mine)], mine)
    output = torch.empty(shard * world, dtype=send.dtype, device=send.device)
    work = comm.all_gather(output, send, tag=tag)

    @torch.no_grad()
    def finish() -> None:
        work.wait()
        received = byte_view(output)
        cursor = [r * shard for r in range(world)]
        destinations, sources = [], []
        for f, owner in zip(flat, owners):
            start = cursor[owner]
            cursor[owner] += f.numel()
            if owner != rank:
                destinations.append(f)
                sources.append(received[start: start + f.numel()])
        if destinations:
            torch._foreach_copy_(destinations, sources)

    return finish


class ShardedFP8Optimizer(FP8Optimizer):
    """Mixin over an :class:`FP8Optimizer` (Adam, AdamW, SGD): states for owned parameters only.

    ``process_group`` is the data-parallel group (None: the default group); ``counter`` (a
    :class:`fp8.distributed.CommBytesCounter`) records the weight all-gather's bytes; ``gather_weights=False``
    leaves the all-gather of updated parameters to the caller (Megatron's BF16 ZeRO-1 baseline gathers its BF16
    parameters, not the FP32 masters this optimizer steps). ``partition``
    (:class:`ParamPartition`) and ``owned_params`` describe the ownership; ``param_groups`` hold all
    parameters (hyper-parameters and LR schedulers work as usual). The step needs each parameter's
    gradient on its owner only: at world size > 1 a gradient on a non-owner means the model was not
    wrapped in ``fp8.distributed.DistributedDataParallel``, and raises.
    """

    LEVEL = "O3"

    def __init__(self, params, *args: Any, process_group: dist.ProcessGroup | None = None,
                 counter: CommBytesCounter | None = None, gather_weights: bool = True, expert_params: Any = (),
                 expert_process_group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        require_process_group("opt_level 'O3' (the FP8 distributed optimizer)")
        groups = _normalize_groups(params)
        self.process_group = process_group
        self.gather_weights = gather_weights
        self._comm = Collectives(process_group, counter)
        experts = {id(p) for p in expert_params}
        if experts and expert_process_group is None:
            raise ValueError("expert_params need the expert_process_group they are sharded over (the "
                             "expert-data-parallel group)")
        self.expert_process_group = expert_process_group
        self._expert_comm = Collectives(expert_process_group, counter) if experts else None
        seen: dict[int, torch.Tensor] = {}
        for group in groups:
            for p in group["params"]:
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        self._sharded_params = list(seen.values())
        dense = [p for p in self._sharded_params if id(p) not in experts]
        self._experts = [p for p in self._sharded_params if id(p) in experts]
        self._expert_ids = frozenset(id(p) for p in self._experts)
        self.partition: ParamPartition = partition_by_size([p.numel() for p in dense], self._comm.world_size)
        self._owner = {id(p): o for p, o in zip(dense, self.partition.owners)}
        if self._experts:
            self.expert_partition = partition_by_size([p.numel() for p in self._experts],
                                                      self._expert_comm.world_size)
            self._owner.update({id(p): o for p, o in zip(self._experts, self.expert_partition.owners)})
        super().__init__(groups, *args, **kwargs)
        self.gather_params()

    # -- ownership -----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank in the data-parallel group."""
        return self._comm.rank

    @property
    def world_size(self) -> int:
        """Size of the data-parallel group."""
        return self._comm.world_size

    @property
    def comm(self) -> Collectives:
        """The data-parallel group's :class:`fp8.comm.Collectives` (the weight all-gather and the agreement
        collectives go through it; a wrapper gathering other tensors to the same owners may use it too)."""
        return self._comm

    @property
    def counter(self) -> CommBytesCounter | None:
        """The byte counter of the weight all-gather (settable)."""
        return self._comm.counter

    @counter.setter
    def counter(self, counter: CommBytesCounter | None) -> None:
        self._comm.counter = counter
        if self._expert_comm is not None:
            self._expert_comm.counter = counter

    def owner(self, p: torch.Tensor) -> int:
        """Rank owning parameter ``p`` (in the data-parallel group; an expert parameter's in the
        expert-data-parallel group)."""
        return self._owner[id(p)]

    def is_expert(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is one of the ``expert_params`` (sharded over the expert-data-parallel group)."""
        return id(p) in self._expert_ids

    def owns(self, p: torch.Tensor) -> bool:
        """Whether this rank owns ``p`` (holds its optimizer state and receives its gradient); under FSDP2 every rank
        holds its rows of every parameter."""
        if self._fsdp:
            return True
        comm = self._expert_comm if id(p) in self._expert_ids else self._comm
        return self._owner.get(id(p), -1) == comm.rank

    def expert_owners(self) -> "ExpertOwners":
        """The expert parameters' owners as ``fp8.distributed.DistributedDataParallel(..., o3_optimizer=...)``
        takes them (``owner(p)``, ``process_group``: the expert-data-parallel group)."""
        return ExpertOwners(self)

    @property
    def owned_params(self) -> list[torch.Tensor]:
        """The parameters this rank owns, in parameter order."""
        return [p for p in self._sharded_params if self.owns(p)]

    @property
    def sharded_params(self) -> list[torch.Tensor]:
        """Every trained parameter, in the partition's order."""
        return list(self._sharded_params)

    @torch.no_grad()
    def _init_state(self, p: torch.Tensor, group: dict, initial_master: torch.Tensor | None = None) -> None:
        if self.owns(p):
            super()._init_state(p, group, initial_master)

    # -- the step --------------------------------------------------------------------------------
    def _check_grads_reduced(self) -> None:
        if self.world_size == 1:
            return
        stray = [p for p in self._sharded_params if p.grad is not None and not self.owns(p)]
        if stray:
            raise RuntimeError(
                f"{len(stray)} parameter(s) this rank does not own have gradients: with opt_level 'O3', wrap the "
                f"model in fp8.distributed.DistributedDataParallel(model, o3_optimizer=optimizer) after fp8.initialize, "
                f"which reduces each "
                f"gradient to its owner (and call the optimizer step after a synced backward, not inside no_sync)"
            )

    def _agreed_finite(self) -> torch.Tensor:
        """0-d bool device flag: every rank's owned gradients are finite (MIN all-reduce of the local
        flags, on device: no host sync)."""
        device = self._skipped_counter.device
        flag = grads_finite_flag(self.owned_params).to(device=device, dtype=torch.int32).reshape(1)
        self._comm.all_reduce(flag, op=dist.ReduceOp.MIN, tag="finite").wait()
        return flag.reshape(()) > 0

    # -- under FSDP2 ------------------------------------------------------------------------------
    _fsdp = False
    """Whether FSDP2 sharded the model (:meth:`follow_sharding`): the states are then cut by rows as FSDP2 cuts the
    parameters, every rank holds its rows of every parameter, and the step is O2's on those rows."""

    @torch.no_grad()
    def follow_sharding(self) -> None:
        """FSDP2 sharded the model since the last call (``fully_shard`` after ``fp8.initialize(..., "O3")``): each
        parameter's owner hands its states (FP16 master, moments, scales, step) to every rank (one broadcast per state
        tensor, in parameter order, tag ``"o3 fsdp handover"``), then every rank keeps the rows FSDP2 gave it (as O2
        does under FSDP2) and the optimizer steps as O2 on its rows from then on: FSDP2 reduce-scatters the gradients
        and all-gathers the weights, so the owners' reduction and gather are not used any more."""
        if self._fsdp:
            FP8Optimizer.follow_sharding(self)
            return
        self._slots.put_back(self.param_groups)  # a remap from outside (Accelerate's prepare)
        moved = self._slots.moved(record=False)
        if not moved:
            return
        if self._experts:
            raise NotImplementedError(
                "opt_level 'O3' with expert_params under FSDP2: fp8's FSDP2 support does not follow expert parameters "
                "yet; shard without expert parallelism")
        sharded_world = moved[0][2].device_mesh.size()
        if sharded_world != self.world_size:
            raise ValueError(
                f"FSDP2 shards over {sharded_world} ranks, the O3 optimizer over {self.world_size} (its process_group); "
                f"give fp8.initialize the process group FSDP2 shards over")
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in self._owner:
                    continue
                if not self.owns(p):  # the layout of the owner's states, to receive them into
                    FP8Optimizer._init_state(self, p, group)
                state = self.state[p]
                for key in sorted(k for k, v in state.items() if isinstance(v, torch.Tensor)):
                    self._comm.broadcast(state[key], "o3 fsdp handover", src=self.owner(p)).wait()
        self._fsdp = True
        self._comm_counter = self._comm.counter
        FP8Optimizer.follow_sharding(self)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        """Update the owned parameters (skipped on every rank if any rank's gradients are not finite,
        decided on device from the ranks' agreed flag: no host sync), then all-gather every parameter
        from its owner (FP8 weights: payload + scale; unchanged values after a skipped step)."""
        self.follow_sharding()
        if self._fsdp:
            return FP8Optimizer.step(self, closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_grads_reduced()
        self._step_masked(self._agreed_finite())
        self.gather_params()
        refresh_weight_operands(p for group in self.param_groups for p in group["params"])  # after the gather
        return loss

    @torch.no_grad()
    def gather_params(self) -> None:
        """Copy every parameter from its owner to all ranks: FP8 weights as ``uint8`` payload plus fp32
        scale (tags ``"fp8 weights"``, ``"fp8 weight scales"``), others in their own dtype (``"weights"``). Nothing
        with ``gather_weights=False`` (the caller gathers what it needs from the same owners)."""
        if not self.gather_weights or self._fsdp:  # under FSDP2, FSDP2 gathers the weights
            return
        finishers = []
        for params, comm, prefix in (([p for p in self._sharded_params if id(p) not in self._expert_ids], self._comm,
                                      ""),
                                     (self._experts, self._expert_comm, "expert ")):
            if not params or comm.world_size == 1:
                continue
            plain: dict[torch.dtype, list[torch.Tensor]] = {}
            by_payload: dict[torch.dtype, list[torch.Tensor]] = {}
            for p in params:
                if isinstance(p, Float8Tensor):
                    by_payload.setdefault(p.payload.dtype, []).append(p)
                else:
                    plain.setdefault(p.dtype, []).append(p)
            for ps in by_payload.values():
                owners = [self.owner(p) for p in ps]
                finishers.append(start_owner_gather([p.payload for p in ps], owners, comm, prefix + "fp8 weights"))
                finishers.append(start_owner_gather([p.scale for p in ps], owners, comm,
                                                    prefix + "fp8 weight scales"))
            for ps in plain.values():
                finishers.append(start_owner_gather(ps, [self.owner(p) for p in ps], comm, prefix + "weights"))
        for finish in finishers:
            finish()

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients (held by their owners) to a global ``norm_type`` norm (2 or inf) of at
        most ``max_norm``; returns the global norm before clipping, identical on every rank."""
        if norm_type not in (2.0, float("inf")):
            raise ValueError(f"O3 clips with norm_type 2 or inf, got {norm_type}")
        self.follow_sharding()  # FSDP2 may have sharded the model since the last step (before the first one)
        if self._fsdp:  # FSDP2's gradients are DTensors of each rank's rows: the norm of the whole ones, FP8 exactly
            params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            return clip_grad_norm_(params, max_norm, norm_type)
        grads = [p.grad for p in self.owned_params if p.grad is not None]
        # Partial norms live on the parameters' device (the process group's: CUDA for NCCL), also on a rank
        # that owns no gradient this step; the all-reduce then needs no host copy. A fixed number of ops (grad_norms).
        device = self._skipped_counter.device
        norms = grad_norms(grads, float(norm_type)).to(device) if grads else None
        if norm_type == 2.0:
            local = norms.square().sum() if norms is not None else torch.zeros((), device=device)
            self._comm.all_reduce(local, tag="grad norm").wait()
            total = local.sqrt()
        else:
            local = norms.max() if norms is not None else torch.zeros((), device=device)
            self._comm.all_reduce(local, op=dist.ReduceOp.MAX, tag="grad norm").wait()
            total = local
        scale_grads_to_norm_(grads, total, max_norm)
        return total

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """This rank's own state (the tensors it owns), with ``opt_level`` and the data-parallel ``world_size``."""
        state = super().state_dict()
        state["world_size"] = self.world_size
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """This rank's own state dict (same world size); re-gathers the parameters afterwards. For
        checkpoints that reshard across world sizes use :mod:`fp8.checkpoint`. A state dict of another
        opt level or data-parallel size is refused (:class:`fp8.optim.levels.OptLevelMismatchError`)."""
        from .levels import OptLevelMismatchError

        saved_world = state_dict.get("world_size") if isinstance(state_dict, dict) else None
        if saved_world is not None and int(saved_world) != self.world_size:
            raise OptLevelMismatchError(
                f"this {self.opt_level} optimizer state was saved by one rank of {saved_world} data-parallel ranks "
                f"(the tensors that rank owned) and cannot be loaded into an {self.opt_level} optimizer sharded "
                f"over {self.world_size}: save and load with fp8.checkpoint, which reshards across data-parallel "
                f"sizes")
        super().load_state_dict(state_dict)
        self.gather_params()


class ExpertOwners:
    """The expert parameters' ownership of a :class:`ShardedFP8Optimizer` as
    ``fp8.distributed.DistributedDataParallel(..., o3_optimizer=...)`` takes it: ``owner(p)`` (a rank of the
    expert-data-parallel group) and that ``process_group``."""

    def __init__(self, optimizer: ShardedFP8Optimizer) -> None:
        self._optimizer = optimizer
        self.process_group = optimizer.expert_process_group

    def owner(self, p: torch.Tensor) -> int:
        if not self._optimizer.is_expert(p):
            raise KeyError("not an expert parameter")
        return self._optimizer.owner(p)


class ShardedAdam(ShardedFP8Optimizer, Adam):
    """:class:`fp8.optim.Adam` with its states sharded over the data-parallel group (O3)."""


class ShardedAdamW(ShardedFP8Optimizer, AdamW):
    """:class:`fp8.optim.AdamW` with its states sharded over the data-parallel group (O3)."""


class ShardedSGD(ShardedFP8Optimizer, SGD):
    """:class:`fp8.optim.SGD` with its states sharded over the data-parallel group (O3)."""


_SHARDED = {Adam: ShardedAdam, AdamW: ShardedAdamW, SGD: ShardedSGD}


def convert_to_sharded(
    optimizer: torch.optim.Optimizer,
    replace: dict[int, torch.Tensor],
    precision: OptimizerPrecision | str,
    initial_masters: dict[torch.Tensor, torch.Tensor] | None = None,
    process_group: dist.ProcessGroup | None = None,
    *,
    scaling_module: torch.nn.Module | None = None,
    gather_weights: bool = True,
    expert_params: Any = (),
    expert_process_group: dist.ProcessGroup | None = None,
    counter: CommBytesCounter | None = None,
) -> ShardedFP8Optimizer:
    """The O3 optimizer equivalent to ``optimizer`` (``torch.optim`` Adam, AdamW or SGD), as
    :func:`fp8.optim.convert_optimizer` builds the O2 one, sharded over ``process_group`` (``expert_params``, the
    parameters of this rank's experts under expert parallelism, over ``expert_process_group``); ``gather_weights``
    as :class:`ShardedFP8Optimizer`'s; ``counter`` counts its collectives' bytes."""
    target, groups, kwargs = converted_arguments(optimizer, replace)
    return _SHARDED[target](groups, **kwargs, precision=precision, initial_masters=initial_masters,
                            process_group=process_group, scaling_module=scaling_module, gather_weights=gather_weights,
                            expert_params=expert_params, expert_process_group=expert_process_group, counter=counter)
