"""``DistributedDataParallel``: torch DDP's contract, with FP8 weight gradients sent as 1-byte values.

Gradients come out averaged over the process group, as with ``torch.nn.parallel.DistributedDataParallel``.
Gradients of FP8 weights (``Float8Tensor`` parameters) are reduced with the scaled FP8 all-reduce: a gradient
summed over ``no_sync()`` micro-batches (a scaled FP16 buffer under ``grad_accumulation="fp16"``, an fp32 tensor under
``"fp32"``) is quantized once to E4M3 for the wire, an E4M3 ``Float8Tensor`` gradient (``"fp8"``) is sent as it is, and either becomes a ``Float8Tensor``
(payload + scale, 1 byte per element; a weight of the ``rowwise``/``blockwise`` recipes gets one shared scale per
block of its own block, so its gradient carries the same grid); every other gradient is all-reduced in its own dtype. Communication overlaps backward: a post-accumulate-grad hook on each
parameter marks it ready, full buckets are launched in a fixed order with asynchronous collectives,
and a callback queued on the autograd engine finishes them all at the end of backward, then closes
the step of the scaling factor mu.

Owner mode (opt level O3): given the sharded optimizer that ``fp8.initialize(..., opt_level="O3")``
returns (``o3_optimizer=optimizer``), each bucket is reduced to the owners of its gradients only (:mod:`fp8.distributed.owner_reduce`, same FP8 recipe and mu, no
all-gather): after backward a rank holds the averaged gradients of the parameters it owns and ``None``
for the others; the optimizer step all-gathers the updated weights.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import Collectives, CommBytesCounter, require_process_group
from ..scaling import ScalingState
from ..tensor import Float8Tensor
from .auto_scale import AutoScaleConfig, AutoScaleState
from .bucketing import GradBucket, plain_bucket_reduction, plan_buckets
from .owner_reduce import agree_overflow_statistic, fp8_owner_reduction, plain_owner_reduction
from .pipeline import ReductionPipeline
from .scaled_allreduce import DEFAULT_BUCKET_BYTES, fp8_bucket_reduction

__all__ = ["DistributedDataParallel"]


@dataclass
class _Backward:
    """Progress of the reduction during one backward pass."""

    task: int
    pending: list[int]
    pipeline: ReductionPipeline
    next_bucket: int = 0
    launched_in_backward: int = 0


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper of an FP8 model (``fp8.initialize`` first, then this).

    - ``module``: the model; every rank must hold the same parameters (same seed or checkpoint).
    - ``process_group``: the data-parallel group (``None``: the default group). gloo or NCCL.
    - ``bucket_bytes``: bucket capacity in bytes on the wire (FP8: 1 byte per element; others: their
      element size); default 25 MiB like torch DDP.
    - ``scaling``: :class:`AutoScaleConfig`, the rule of the scaling factor mu (``grad_scaling``
      holds its state, saved in ``state_dict()``).
    - ``broadcast_buffers``: broadcast the module's buffers from rank 0 before each forward, as torch
      DDP does, except the FP8 scaling states (amax histories are each rank's own statistics; call
      ``fp8.set_amax_reduction_group(model, group)`` to make ranks agree on those scales).
    - ``counter``: a :class:`CommBytesCounter` recording every byte this wrapper sends.
    - ``o3_optimizer``: opt level O3's sharded optimizer over this module's parameters (what
      ``fp8.initialize(..., opt_level="O3")`` returns; any object with ``owner(param) -> rank`` and the
      ``process_group`` it is sharded over): each gradient is then reduced to its owner only. ``None``
      (default): every gradient is all-reduced to every rank.
    - ``exclude``: parameters kept out of the buckets and out of the start-up broadcast (no hook, no reduction:
      their gradients accumulate locally and the caller reduces them, e.g. the two copies of tied embeddings under
      pipeline parallelism, summed over the embedding group before the data-parallel reduction, or the experts of
      expert parallelism, which differ between the ranks of the data-parallel group and are reduced over the
      expert-data-parallel group by a second wrapper excluding everything else).

    Every rank must produce gradients for the same parameters in each backward (as torch DDP with
    ``find_unused_parameters=False``); parameters without a gradient at the end of backward are
    reduced as zeros, so all ranks stay identical. ``no_sync()`` accumulates micro-batches locally.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: dist.ProcessGroup | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        *,
        scaling: AutoScaleConfig | None = None,
        broadcast_buffers: bool = True,
        counter: CommBytesCounter | None = None,
        o3_optimizer: Any = None,
        exclude: Any = (),
    ) -> None:
        super().__init__()
        require_process_group("fp8.distributed.DistributedDataParallel")
        if isinstance(module, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
            raise ValueError("module is already wrapped for data parallelism; wrap the bare model once")
        self.module = module
        self.process_group = process_group
        self._comm = Collectives(process_group, counter)
        self.broadcast_buffers = broadcast_buffers
        params = list(module.parameters())
        device = params[0].device if params else torch.device("cpu")
        self.grad_scaling = AutoScaleState(scaling, self._comm.world_size, device)
        self._param_ids = tuple(id(p) for p in params)
        excluded = {id(p) for p in exclude}
        trained = [p for p in params if p.requires_grad and id(p) not in excluded]
        self._excluded = tuple(p for p in params if id(p) in excluded)
        self._buckets: list[GradBucket] = plan_buckets(trained, bucket_bytes)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self._buckets) for p in bucket.params}
        self._sync_buffers = [
            b for m in module.modules() if not isinstance(m, ScalingState) for b in m.buffers(recurse=False)
        ]
        self._require_sync = True
        self._backward: _Backward | None = None
        self.last_backward_stats: dict[str, int] = {}
        self._owners = self._owner_plan(trained, o3_optimizer)
        self._check_same_structure(params)
        self._sync_module_states([p for p in params if id(p) not in excluded])
        self._hook_handles = self._register_hooks(trained)

    # -- set-up ------------------------------------------------------------------------------
    def _owner_plan(self, trained: list[nn.Parameter], optimizer: Any) -> dict[int, int] | None:
        """Owner rank per trained parameter id when an O3 optimizer is given (else None: all-reduce)."""
        if optimizer is None:
            return None
        if not callable(getattr(optimizer, "owner", None)) or not hasattr(optimizer, "process_group"):
            raise TypeError(
                f"o3_optimizer must be the sharded optimizer fp8.initialize(..., opt_level='O3') returns, got "
                f"{type(optimizer).__name__}; pass o3_optimizer=None at the other opt levels"
            )
        mine = dist.get_process_group_ranks(self._comm.group)
        theirs = dist.get_process_group_ranks(optimizer.process_group or dist.group.WORLD)
        if mine != theirs:
            raise ValueError(
                f"the O3 optimizer is sharded over ranks {theirs} but this wrapper's process group is {mine}; pass the "
                f"same group as fp8.initialize(..., opt_level='O3', process_group=...)"
            )
        owners = {}
        for p in trained:
            try:
                owners[id(p)] = optimizer.owner(p)
            except KeyError:
                raise ValueError(
                    "a trainable parameter of the module is not in the O3 optimizer; give the optimizer every "
                    "parameter with requires_grad=True (or freeze it) before fp8.initialize"
                ) from None
        return owners

    def _check_same_structure(self, params: list[nn.Parameter]) -> None:
        local = torch.tensor(
            [len(params), sum(p.numel() for p in params), sum(isinstance(p, Float8Tensor) for p in params)],
            dtype=torch.int64, device=self.grad_scaling.log2_mu_steps.device,
        )
        high, low = local.clone(), local.clone()
        self._comm.all_reduce(high, op=dist.ReduceOp.MAX, tag="init").wait()
        self._comm.all_reduce(low, op=dist.ReduceOp.MIN, tag="init").wait()
        if not torch.equal(high, low):
            raise ValueError(
                "ranks hold different models (parameter count, elements or FP8 parameters differ); build the same "
                "model and call fp8.initialize with the same opt_level and module filter on every rank"
            )

    @torch.no_grad()
    def _sync_module_states(self, params: list[nn.Parameter]) -> None:
        """Broadcast plain parameters and buffers from rank 0; check FP8 weights already agree."""
        plain = [p for p in params if not isinstance(p, Float8Tensor)] + self._sync_buffers
        self._broadcast(plain, tag="init")
        fp8_params = [p for p in params if isinstance(p, Float8Tensor)]
        if not fp8_params:
            return
        mine = [p.payload.reshape(-1).view(torch.uint8) for p in fp8_params] + [
            torch.cat([p.scale.reshape(-1) for p in fp8_params]).view(torch.uint8)  # 0-d scales or block grids
        ]
        local = torch.cat(mine)
        reference = local.clone()
        self._comm.broadcast(reference, tag="init").wait()
        differs = torch.tensor([int(not torch.equal(local, reference))], device=local.device)
        self._comm.all_reduce(differs, op=dist.ReduceOp.MAX, tag="init").wait()
        if int(differs) != 0:
            raise ValueError(
                "FP8 weights differ across ranks; their high-precision masters live in the optimizer, which DDP "
                "cannot broadcast. Seed every rank identically before building the model (torch.manual_seed), "
                "or load the same checkpoint on every rank, before fp8.initialize"
            )

    def _broadcast(self, tensors: list[torch.Tensor], tag: str) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            self._comm.broadcast(flat, tag=tag).wait()
            for t, part in zip(group, flat.split([t.numel() for t in group])):
                t.detach().copy_(part.view(t.shape))

    def _register_hooks(self, params: list[nn.Parameter]) -> list[Any]:
        this = weakref.ref(self)

        def grad_ready(param: nn.Parameter) -> None:
            ddp = this()
            if ddp is not None:
                ddp._grad_ready(param)

        return [p.register_post_accumulate_grad_hook(grad_ready) for p in params]

    # -- forward -----------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (after broadcasting its buffers from rank 0, if enabled)."""
        if tuple(id(p) for p in self.module.parameters()) != self._param_ids:
            raise RuntimeError(
                "the module's parameters changed after it was wrapped; call fp8.initialize(model, optimizer) before "
                "fp8.distributed.DistributedDataParallel(model), and rebuild the wrapper after changing parameters"
            )
        if self.broadcast_buffers and self._sync_buffers and self._require_sync:
            with torch.no_grad():
                self._broadcast(self._sync_buffers, tag="buffers")
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Within this context gradients accumulate locally (no communication); the first backward
        after it reduces the accumulated gradients."""
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    # -- backward: hooks, buckets, end-of-backward callback ------------------------------------
    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self._require_sync:
            return
        task = torch._C._current_graph_task_id()
        state = self._backward
        if state is None or state.task != task:
            state = self._backward = _Backward(
                task, [len(b.params) for b in self._buckets], ReductionPipeline()
            )
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        index = self._bucket_of[id(param)]
        state.pending[index] -= 1
        while state.next_bucket < len(self._buckets) and state.pending[state.next_bucket] <= 0:
            self._launch(state, state.next_bucket)
            state.next_bucket += 1
            state.launched_in_backward += 1

    def _launch(self, state: _Backward, index: int) -> None:
        bucket = self._buckets[index]
        if self._owners is not None:
            owners = [self._owners[id(p)] for p in bucket.params]
            if bucket.fp8:
                grads = [p.grad if p.grad is not None else torch.zeros(p.shape, device=p.device) for p in bucket.params]
                reduction = fp8_owner_reduction(grads, owners, self.grad_scaling, self._comm, average=True,
                                                blocks=[p.block for p in bucket.params])
            else:
                grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
                reduction = plain_owner_reduction(grads, owners, self._comm, average=True)
        elif bucket.fp8:
            grads = [p.grad if p.grad is not None else torch.zeros(p.shape, device=p.device) for p in bucket.params]
            reduction = fp8_bucket_reduction(grads, self.grad_scaling, self._comm, average=True,
                                             blocks=[p.block for p in bucket.params])
        else:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
            reduction = plain_bucket_reduction(grads, self._comm, average=True)
        state.pipeline.launch(reduction, eager=bucket.fp8, on_done=partial(self._write_back, bucket))

    @torch.no_grad()
    def _write_back(self, bucket: GradBucket, reduced: list[torch.Tensor]) -> None:
        for param, grad in zip(bucket.params, reduced):
            if grad is None:  # owner mode, not this rank's parameter: free its gradient
                param.grad = None
            elif param.grad is None or type(param.grad) is not type(grad):
                # No gradient yet, or an FP16/fp32 sum (grad_accumulation "fp16"/"fp32") replaced by its reduced FP8
                # value (E4M3, 1 byte per element, after the reduction).
                param.grad = grad.clone()
            else:
                param.grad.copy_(grad)  # Float8Tensor.copy_ of a Float8Tensor: payload and scale

    def _finish_backward(self) -> None:
        state, self._backward = self._backward, None
        if state is None:
            return
        while state.next_bucket < len(self._buckets):
            self._launch(state, state.next_bucket)
            state.next_bucket += 1
        state.pipeline.drain()
        if any(b.fp8 for b in self._buckets):
            if self._owners is not None:
                agree_overflow_statistic(self.grad_scaling, self._comm)
            self.grad_scaling.update()
        self.last_backward_stats = {"buckets": len(self._buckets), "launched_in_backward": state.launched_in_backward}

    # -- introspection ------------------------------------------------------------------------
    @property
    def buckets(self) -> list[GradBucket]:
        """The gradient buckets, in launch order."""
        return list(self._buckets)

    @property
    def owner_mode(self) -> bool:
        """Whether gradients are reduced to their owners only (an O3 optimizer is registered)."""
        return self._owners is not None

    @property
    def world_size(self) -> int:
        """Number of ranks in the data-parallel group."""
        return self._comm.world_size

    def extra_repr(self) -> str:
        n_fp8 = sum(b.fp8 for b in self._buckets)
        return f"world_size={self.world_size}, buckets={len(self._buckets)} ({n_fp8} FP8)"
