"""The optimizer of each opt level for a megatron-core model built with fp8lm's layers.

- ``none``: ``torch.optim.AdamW`` (or SGD) on the high-precision parameters (the baseline); with
  ``--use-distributed-optimizer``, its FP32 states sharded over data parallel by whole tensors (ZeRO-1).
- ``O1``: the same optimizer stepping FP32 master weights of the FP8 weights
  (:class:`fp8.optim.MasterWeightOptimizer`), which refreshes the FP8 copies after each step.
- ``O2``: :mod:`fp8.optim`'s AdamW/SGD: FP8 first moment, FP16 second moment, FP16 master weights
  (each with a scale).
- ``O3``: O2 sharded over the data-parallel group (whole tensors, FP8 weight all-gather).

Masters start from the exact initial weights (:func:`fp8.parallel.take_initial_masters`). Weight decay
applies to matrices, not to biases and norm gains (Megatron's rule).

Megatron's ``--bf16`` (the high-precision parameters in BF16) is here too. BF16 parameters and activations, FP32 main gradients and FP32
master weights in the optimizer.

- Every high-precision parameter (all of them at level ``none``; embeddings, norms, biases and the output
  layer at the FP8 levels) is stored in BF16, so activations are BF16 without autocast. FP8 weights keep
  their own recipe (E4M3 payload; the FP8 optimizers' masters).
- Level ``none`` (the baseline, as Megatron-LM's ``--bf16``): a post-accumulate-grad hook adds each
  micro-batch's BF16 gradient into an FP32 ``param.main_grad`` and frees the BF16 one (Megatron's
  ``accumulate_allreduce_grads_in_fp32``); :meth:`MainGrads.finish` averages the main gradients over
  data parallel in FP32 after the backward passes (one flat all-reduce per step, not overlapped with
  backward, as Megatron without ``--overlap-grad-reduce``); :class:`BF16MasterOptimizer` steps FP32
  masters on them (fused AdamW, skipping on device) and copies the masters back into the BF16
  parameters. With ``--use-distributed-optimizer`` the masters and their Adam states are sharded over
  data parallel by whole tensors (the ZeRO-1 optimizer of :mod:`fp8.optim.sharded` at FP32 precision):
  each rank keeps the masters, states and main gradients of the tensors it owns (the main gradients are
  all-reduced, then the others freed), and the step all-gathers the updated BF16 parameters.
- Levels O1/O2/O3: the BF16 parameters' gradients accumulate in BF16 and are reduced by fp8lm's DDP
  wrapper; O1 steps FP32 masters of them (:class:`fp8.optim.MasterWeightOptimizer`), O2/O3's
  :mod:`fp8.optim` keeps FP32 masters of 16-bit parameters by design.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fp8.cast import payload_and_scale
from fp8.comm import Collectives, CommBytesCounter
from fp8.distributed.gather import start_owner_gather
from fp8.optim.base import FP8Optimizer
from fp8.optim.master_weights import MasterWeightOptimizer
from fp8.optim.sharded import ShardedFP8Optimizer, convert_to_sharded
from fp8.optim.wrap import FP8Weight, wrap_for_level
from fp8.parallel import take_initial_masters
from fp8.tensor import Float8Tensor

from .config import OptimizerConfig, RunConfig

__all__ = ["build_optimizer", "TrainingOptimizer", "cast_to_bf16_", "MainGrads", "BF16MasterOptimizer", "bf16_params"]



@torch.no_grad()
def cast_to_bf16_(chunks: list[nn.Module]) -> int:
    """Store every floating-point parameter that is not an FP8 weight in BF16, in place (the parameter
    objects and their megatron attributes stay). Returns how many were cast."""
    n = 0
    for chunk in chunks:
        for p in chunk.parameters():
            if isinstance(p, Float8Tensor) or not p.is_floating_point() or p.dtype == torch.bfloat16:
                continue
            p.data = p.data.to(torch.bfloat16)
            n += 1
    return n


def bf16_params(chunks: list[nn.Module]) -> list[nn.Parameter]:
    """The trainable BF16 parameters of ``chunks``, each once."""
    seen: set[int] = set()
    out = []
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) in seen or not p.requires_grad or isinstance(p, Float8Tensor) or p.dtype != torch.bfloat16:
                continue
            seen.add(id(p))
            out.append(p)
    return out


class MainGrads:
    """FP32 main gradients of BF16 parameters, accumulated across micro-batches and averaged over data
    parallel in FP32.

    ``params``: the BF16 parameters; ``dp_group``: the data-parallel group; ``owns(p)`` (with a sharded
    optimizer): whether this rank keeps ``p``'s main gradient after the reduction. ``expert_params`` (a subset of
    ``params``: this rank's experts under expert parallelism) are summed over ``expert_group`` (the
    expert-data-parallel group) instead, and divided by the data-parallel size like the others (each expert saw
    the tokens of every data-parallel rank routed to it).
    """

    def __init__(self, params: list[nn.Parameter], dp_group: dist.ProcessGroup | None,
                 owns: Callable[[nn.Parameter], bool] | None = None, expert_params=(),
                 expert_group: dist.ProcessGroup | None = None, counter: CommBytesCounter | None = None) -> None:
        self.params = list(params)
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
        self.owns = owns
        experts = {id(p) for p in expert_params}
        self.comm = Collectives(dp_group, counter) if self.dp_size > 1 else None  # built once
        self._groups = [([p for p in self.params if id(p) not in experts], self.comm)]
        if experts:
            if expert_group is None:
                raise ValueError("expert_params need their expert_group (the expert-data-parallel group)")
            self.expert_comm = Collectives(expert_group, counter)
            self._groups.append(([p for p in self.params if id(p) in experts], self.expert_comm))
        else:
            self.expert_comm = None
        for p in self.params:
            p.main_grad = None
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulate) for p in self.params]

    @staticmethod
    @torch.no_grad()
    def _accumulate(p: nn.Parameter) -> None:
        if p.main_grad is None:
            p.main_grad = p.grad.to(torch.float32)
        else:
            p.main_grad.add_(p.grad)
        p.grad = None

    def zero(self) -> None:
        """Free the main gradients (start of a step)."""
        for p in self.params:
            p.main_grad = None

    @property
    def counter(self) -> CommBytesCounter | None:
        """The byte counter of the data-parallel reduction (given at construction)."""
        return None if self.comm is None else self.comm.counter

    @torch.no_grad()
    def finish(self) -> None:
        """After the step's backward passes: average the main gradients over data parallel (one flat FP32
        all-reduce; a parameter without a gradient on some rank counts as zeros), then keep only the
        owned ones under a sharded optimizer."""
        for params, comm in self._groups if self.dp_size > 1 else ():
            if not params:
                continue
            grads = [p.main_grad if p.main_grad is not None else torch.zeros(p.shape, dtype=torch.float32,
                                                                               device=p.device)
                     for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if comm.world_size > 1:
                comm.all_reduce(flat, tag="bf16 main grads").wait()
            flat.div_(self.dp_size)
            offset = 0
            for p, g in zip(params, grads):
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                p.main_grad = g
                offset += g.numel()
        if self.owns is not None and self.dp_size > 1:
            for p in self.params:
                if not self.owns(p):
                    p.main_grad = None

    def nbytes(self) -> int:
        """Bytes the main gradients hold now."""
        return sum(p.main_grad.numel() * 4 for p in self.params if p.main_grad is not None)


class BF16MasterOptimizer(MasterWeightOptimizer):
    """Steps FP32 masters of BF16 parameters on their FP32 main gradients, then copies the masters back.

    ``optimizer``: over the masters (a fused ``torch.optim.AdamW``, which skips a non-finite step on device
    through ``found_inf``; or fp8lm's sharded optimizer at FP32 precision for ``--use-distributed-optimizer``,
    which skips on device and all-gathers the updated masters itself). ``pairs``: ``(master, param)``;
    parameters without a ``main_grad`` attribute (FP8 weights at O1) use their own gradient, dequantized.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, pairs: list[tuple[nn.Parameter, nn.Parameter]],
                 model: nn.Module, main_grads: MainGrads | None = None) -> None:
        super().__init__(optimizer, pairs, model)
        self.main_grads = main_grads

    opt_level = "none (--bf16: FP32 masters of BF16 parameters)"

    @torch.no_grad()
    def load_master_grads(self) -> None:
        sharded = isinstance(self.optimizer, ShardedFP8Optimizer)
        for master, param in self.pairs:
            if sharded and not self.optimizer.owns(master):
                master.grad = None
                continue
            if hasattr(param, "main_grad"):
                master.grad = param.main_grad
            elif param.grad is None:
                master.grad = None
            elif payload_and_scale(param.grad) is not None:  # a scaled gradient: E4M3 or the FP16 sum
                master.grad = param.grad.dequantize(master.dtype)
            else:
                master.grad = param.grad.to(master.dtype)

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        super().zero_grad(set_to_none=set_to_none)
        if self.main_grads is not None:
            self.main_grads.zero()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        self.load_master_grads()  # before the finiteness check, which reads the masters' gradients
        if isinstance(self.optimizer, FP8Optimizer):
            # The sharded FP32 optimizer: steps the owned masters, skipping on device (agreed over its ranks);
            # the owners copy them into their BF16 parameters, which are then all-gathered (BF16 on the wire).
            optimizer = self.optimizer
            loss = optimizer.step(closure)
            owners = []
            for master, param in self.pairs:
                if optimizer.owns(master):
                    param.copy_(master)
                owners.append(optimizer.owner(master))
                master.grad = None
            start_owner_gather([p for _, p in self.pairs], owners, optimizer.comm, "weights")()
            return loss
        return super().step(closure)


# -- the optimizer of each level ----------------------------------------------------------------------
def _torch_optimizer(opt: OptimizerConfig, groups: list[dict]) -> torch.optim.Optimizer:
    if opt.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=opt.lr, momentum=0.9)
    # The fused kernel (CUDA and CPU): one launch, `step` kept on device, and a skip decided on device through
    # its `found_inf` input (the training loop's, or O1's wrapper's): no host synchronisation per step.
    return torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps, fused=True)


def build_optimizer(
    cfg: RunConfig, chunks: list[nn.Module], dp_group: dist.ProcessGroup | None,
    expert_params: list[nn.Parameter] = (), expert_group: dist.ProcessGroup | None = None,
    counter: CommBytesCounter | None = None,
) -> TrainingOptimizer:
    """The optimizer of ``cfg.precision.fp8_opt_level`` over every parameter of ``chunks`` (call before wrapping
    the chunks for data parallelism, and give the wrapper its :attr:`TrainingOptimizer.owner`). ``expert_params``: this
    rank's experts under expert parallelism, whose gradients are reduced (and, sharded, owned) over ``expert_group``
    (the expert-data-parallel group). ``counter`` counts the bytes of the optimizer's own collectives (a sharded
    optimizer's weight all-gather and agreement, the BF16 baseline's main-gradient reduction)."""
    level = cfg.precision.fp8_opt_level
    masters: dict[nn.Parameter, nn.Parameter] = {}
    for chunk in chunks:
        for weight, initial in take_initial_masters(chunk).items():
            masters[weight] = nn.Parameter(initial.to(weight.device), requires_grad=weight.requires_grad)
    if cfg.precision.bf16 and level in ("none", "O1"):
        # --bf16: FP32 masters of the BF16 parameters (O2/O3's fp8.optim keeps FP32 masters of 16-bit
        # parameters itself).
        for p in bf16_params(chunks):
            masters[p] = nn.Parameter(p.detach().to(torch.float32), requires_grad=True)
    decay, no_decay = [], []
    seen: set[int] = set()
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if isinstance(p, Float8Tensor) and p not in masters:
                raise RuntimeError("an FP8 weight has no initial master; build the optimizer once, right after the model")
            target = masters.get(p, p)
            (decay if p.dim() >= 2 else no_decay).append(target)
    groups = [{"params": decay, "weight_decay": cfg.optimizer.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    base = _torch_optimizer(cfg.optimizer, groups)
    scaling_module = nn.ModuleList(chunks)
    experts = {"expert_params": list(expert_params), "expert_process_group": expert_group, "counter": counter}
    if level == "none" and cfg.precision.bf16:
        bf16 = _bf16_baseline(cfg, base, masters, scaling_module, dp_group, list(expert_params), expert_group,
                              counter)
        return TrainingOptimizer(bf16, bf16.main_grads)
    if level == "none":
        if cfg.optimizer.use_distributed_optimizer and dp_group is not None and dist.get_world_size(dp_group) > 1:
            # ZeRO-1 baseline: FP32 Adam states sharded by whole tensors (the O3 machinery at FP32 precision).
            return TrainingOptimizer(convert_to_sharded(base, {}, "O1", {}, dp_group, **experts))
        return TrainingOptimizer(base)
    # the FP8 levels: fp8's one level table (fp8.initialize builds the same optimizers)
    weights = [FP8Weight(master, weight, master.detach()) for weight, master in masters.items()]
    return TrainingOptimizer(wrap_for_level(level, base, weights, scaling_module=scaling_module,
                                            **({"process_group": dp_group, **experts} if level == "O3" else {})))


def _bf16_baseline(cfg: RunConfig, base: torch.optim.Optimizer, masters: dict, scaling_module: nn.Module,
                   dp_group, expert_params: list[nn.Parameter], expert_group,
                   counter: CommBytesCounter | None) -> BF16MasterOptimizer:
    """Megatron's ``--bf16`` baseline: FP32 masters (sharded over data parallel with
    ``--use-distributed-optimizer``) stepped on FP32 main gradients, copied back into the BF16 parameters."""
    inner = base
    owns = None
    if cfg.optimizer.use_distributed_optimizer and dp_group is not None and dist.get_world_size(dp_group) > 1:
        # ZeRO-1 as Megatron's distributed optimizer: each rank keeps the FP32 masters and Adam states of the
        # tensors it owns (whole tensors); the updated BF16 parameters, not the masters, are all-gathered.
        # BF16MasterOptimizer gathers the BF16 parameters from the owners, not the FP32 masters.
        inner = convert_to_sharded(base, {}, "O1", {}, dp_group, gather_weights=False, counter=counter)
        with torch.no_grad():
            for master in masters.values():
                if not inner.owns(master):
                    master.data = torch.empty(0, dtype=master.dtype, device=master.device)
        master_of = dict(masters)

        def owns(p, _inner=inner, _master_of=master_of):
            return _inner.owns(_master_of[p])
    main_grads = MainGrads(list(masters), dp_group, owns, [p for p in expert_params if p in masters], expert_group,
                           counter)
    return BF16MasterOptimizer(inner, [(master, p) for p, master in masters.items()], scaling_module, main_grads)


class TrainingOptimizer:
    """The one interface the training loop and the checkpoints use for the optimizer of every level: ``none``
    (torch's AdamW/SGD; ZeRO-1 with ``--use-distributed-optimizer``; Megatron's ``--bf16`` masters), O1
    (:class:`~fp8.optim.MasterWeightOptimizer`), O2 (:class:`~fp8.optim.FP8Optimizer`) and O3
    (:class:`~fp8.optim.ShardedFP8Optimizer`), experts included. ``inner`` is the level's optimizer (what
    :func:`fp8.memory_report` reads); ``main_grads`` the ``--bf16`` baseline's FP32 main gradients (else None)."""

    def __init__(self, inner: torch.optim.Optimizer, main_grads: MainGrads | None = None) -> None:
        self.inner = inner
        self.main_grads = main_grads

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        """The states by the tensor the optimizer steps (O1 and ``--bf16``: the masters)."""
        return self.inner.state

    @property
    def owner(self) -> ShardedFP8Optimizer | None:
        """The sharded optimizer (O3, or the ZeRO-1 baseline) whose owners receive the gradients through
        ``fp8.distributed.DistributedDataParallel(..., o3_optimizer=...)``, else None (all-reduce)."""
        return self.inner if isinstance(self.inner, ShardedFP8Optimizer) else None

    def owns(self, p: torch.Tensor) -> bool:
        """Whether this rank holds ``p``'s optimizer state (always, unsharded)."""
        return True if self.owner is None else self.owner.owns(p)

    @property
    def masters(self) -> dict[int, nn.Parameter]:
        """``id(weight) -> master`` of the parameters stepped through a high-precision master (O1; ``--bf16``)."""
        if isinstance(self.inner, MasterWeightOptimizer):
            return {id(weight): master for master, weight in self.inner.pairs}
        return {}

    @property
    def skipped_steps(self) -> torch.Tensor | int | None:
        """The steps the optimizer skipped for non-finite gradients, as it counts them (None: torch's)."""
        return self.inner.skipped_steps if isinstance(self.inner, (MasterWeightOptimizer, FP8Optimizer)) else None

    def set_lr(self, lr: float) -> None:
        for group in self.inner.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)

    def main_grad_bytes(self) -> int:
        """Bytes of FP32 main gradients held across the step (``--bf16`` at level none; else 0)."""
        return self.main_grads.nbytes() if self.main_grads is not None else 0

    @torch.no_grad()
    def step(self, finite: torch.Tensor) -> None:
        """One optimizer step, skipped on device when the 0-d bool ``finite`` is not set.

        The FP8 optimizers (O1's master-weight wrapper, O2, O3, the ZeRO-1 baseline) skip a step whose
        gradients are not finite by themselves, on device (the training loop turns every gradient into NaN
        when the global norm is not finite, :func:`megatron.training.distributed.grads.clip_and_poison_`); a fused
        ``torch.optim`` optimizer (the baseline's AdamW) gets ``found_inf``, as torch's GradScaler passes it.
        Only a non-fused optimizer (``--optimizer sgd`` at level ``none``: torch's fused SGD mis-initialises
        its momentum when its first step is skipped) decides on the host.
        """
        optimizer = self.inner
        if isinstance(optimizer, (MasterWeightOptimizer, FP8Optimizer)):
            optimizer.step()
            return
        if optimizer.defaults.get("fused"):
            optimizer.found_inf = (~finite).to(torch.float32)
            try:
                optimizer.step()
            finally:
                del optimizer.found_inf
            return
        if bool(finite):  # host read (non-fused baseline optimizer only)
            optimizer.step()
