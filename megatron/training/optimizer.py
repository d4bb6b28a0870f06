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
"""

from __future__ import annotations


import torch
import torch.distributed as dist
from torch import nn

from fp8.comm import CommBytesCounter
from fp8.optim.base import FP8Optimizer
from fp8.optim.convert import convert_optimizer
from fp8.optim.master_weights import MasterWeightOptimizer
from fp8.optim.sharded import ShardedFP8Optimizer, convert_to_sharded
from fp8.parallel import take_initial_masters
from fp8.tensor import Float8Tensor

from .config import OptimizerConfig, RunConfig
from .mixed_precision import BF16MasterOptimizer, MainGrads, bf16_params

__all__ = ["build_optimizer", "owner_optimizer", "step_optimizer"]


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
) -> torch.optim.Optimizer:
    """The optimizer of ``cfg.precision.fp8_opt_level`` over every parameter of ``chunks`` (call before wrapping
    the chunks for data parallelism, and give the wrapper :func:`owner_optimizer` of it). ``expert_params``: this
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
        return _bf16_baseline(cfg, base, masters, scaling_module, dp_group, list(expert_params), expert_group,
                              counter)
    if level == "none":
        if cfg.optimizer.use_distributed_optimizer and dp_group is not None and dist.get_world_size(dp_group) > 1:
            # ZeRO-1 baseline: FP32 Adam states sharded by whole tensors (the O3 machinery at FP32 precision).
            return convert_to_sharded(base, {}, "O1", {}, dp_group, **experts)
        return base
    if level == "O1":
        return MasterWeightOptimizer(base, [(master, weight) for weight, master in masters.items()], scaling_module)
    replace = {id(master): weight for weight, master in masters.items()}
    initial = {weight: master.detach() for weight, master in masters.items()}
    if level == "O2":
        return convert_optimizer(base, replace, "O2", initial, scaling_module=scaling_module)
    return convert_to_sharded(base, replace, "O2", initial, dp_group, scaling_module=scaling_module, **experts)


def owner_optimizer(optimizer: torch.optim.Optimizer) -> ShardedFP8Optimizer | None:
    """The sharded optimizer (O3, or the ZeRO-1 baseline) whose owners receive the gradients through
    ``fp8.distributed.DistributedDataParallel(..., o3_optimizer=...)``, else None (all-reduce)."""
    return optimizer if isinstance(optimizer, ShardedFP8Optimizer) else None


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


@torch.no_grad()
def step_optimizer(optimizer: torch.optim.Optimizer, finite: torch.Tensor) -> None:
    """One optimizer step, skipped on device when the 0-d bool ``finite`` is not set.

    The FP8 optimizers (O1's master-weight wrapper, O2, O3, the ZeRO-1 baseline) skip a step whose
    gradients are not finite by themselves, on device (the training loop turns every gradient into NaN
    when the global norm is not finite, :func:`megatron.training.distributed.grads.clip_and_poison_`); a fused
    ``torch.optim`` optimizer (the baseline's AdamW) gets ``found_inf``, as torch's GradScaler passes it.
    Only a non-fused optimizer (``--optimizer sgd`` at level ``none``: torch's fused SGD mis-initialises
    its momentum when its first step is skipped) decides on the host.
    """
    if isinstance(optimizer, (MasterWeightOptimizer, FP8Optimizer)) or getattr(optimizer, "skips_on_device", False):
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
