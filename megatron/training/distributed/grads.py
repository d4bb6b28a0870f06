"""Gradient finalisation across model-parallel ranks: sequence-parallel and tied-embedding sums, global norm.

Runs after the backward passes of a step (data-parallel averaging is done by the DDP wrapper during
backward): gradients of parameters marked ``sequence_parallel`` (norms, row-parallel biases) are summed
over the tensor-parallel group (each rank saw a slice of the sequence); the two copies of tied
input/output embeddings on the first and last pipeline stages get the sum of their gradients; then
the global gradient norm counts every parameter once (tensor-parallel shards on every rank,
replicated parameters on tensor-parallel rank 0, the tied copy once).
"""

from __future__ import annotations

import torch
from torch import nn

from collections.abc import Callable

from fp8.cast import payload_and_scale
from fp8.comm import Collectives
from fp8.distributed.owner_reduce import plain_owner_reduction
from fp8.distributed.pipeline import StagedReduction
from fp8.optim.clip import tensor_norm
from fp8.tensor import Float8Tensor

__all__ = ["finalize_model_grads", "tied_embedding_weights", "reduce_tied_embedding_grads", "global_grad_norm", "clip_and_poison_", "main_grad", "model_grads", "scale_grads_", "unique_parameters"]


def finalize_model_grads(chunks: list[nn.Module], tp_comm: Collectives, embd_comm: Collectives | None,
                         tied_embeddings: bool) -> None:
    """Sum sequence-parallel parameter gradients over ``tp_comm``'s group and tied embedding gradients over
    ``embd_comm``'s (when ``tied_embeddings`` and the pipeline has more than one stage)."""
    sp_grads = [main_grad(p) for c in chunks for p in c.parameters()
                if getattr(p, "sequence_parallel", False) and main_grad(p) is not None]
    if sp_grads and tp_comm.world_size > 1:
        flat = torch.cat([g.reshape(-1) for g in sp_grads])
        tp_comm.all_reduce(flat, tag="sp param grads").wait()
        offset = 0
        for g in sp_grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    if tied_embeddings and embd_comm is not None and embd_comm.world_size > 1:
        for chunk in chunks:
            if not (getattr(chunk, "pre_process", False) or getattr(chunk, "post_process", False)):
                continue
            weight = chunk.shared_embedding_or_output_weight()
            grad = None if weight is None else main_grad(weight)
            if grad is None:
                continue
            if isinstance(grad, Float8Tensor):
                raise RuntimeError("tied embeddings are expected in high precision")
            embd_comm.all_reduce(grad, tag="tied embedding grads").wait()


def tied_embedding_weights(chunks: list[nn.Module]) -> list[nn.Parameter]:
    """The copies of tied input/output embeddings ``chunks`` hold (the first stage's word embedding, the last
    stage's output weight; both on a one-stage pipeline's single chunk, once), in chunk order."""
    out: list[nn.Parameter] = []
    for chunk in chunks:
        chunk = getattr(chunk, "module", chunk)
        if not (getattr(chunk, "pre_process", False) or getattr(chunk, "post_process", False)):
            continue
        weight = chunk.shared_embedding_or_output_weight()
        if weight is not None and weight.requires_grad and all(weight is not w for w in out):
            out.append(weight)
    return out


@torch.no_grad()
def reduce_tied_embedding_grads(weights: list[nn.Parameter], embd_comm: Collectives, dp_comm: Collectives | None,
                                owner: Callable[[nn.Parameter], int] | None = None) -> None:
    """The tied embeddings' gradients under a sharded optimizer, which :class:`fp8.distributed.DistributedDataParallel`
    kept out of its buckets (``exclude=``): each copy's local gradient (every micro-batch of this rank) is first
    summed over ``embd_comm``'s group (the first and last stages' copies at the same tensor/data-parallel
    coordinate), then averaged over ``dp_comm``'s group: reduced to its owner ``owner(weight)`` (the others' gradients
    freed, as the buckets' owner reduction does) or, without ``owner``, all-reduced. Both copies then hold the same
    gradient on their owners (the same sums in the same order on both stages), so the sharded optimizer steps them
    identically although their owners differ. Every rank of both groups issues the same collectives in the same
    order: one all-reduce per weight over the embedding group, then one collective per weight over data parallel,
    whatever the values (a missing gradient counts as zeros)."""
    for weight in weights:
        grad = weight.grad
        if grad is None:
            grad = weight.grad = torch.zeros_like(weight)
        if isinstance(grad, Float8Tensor):
            raise RuntimeError("tied embeddings are expected in high precision")
        embd_comm.all_reduce(grad, tag="tied embedding grads").wait()
    if dp_comm is None or dp_comm.world_size <= 1:
        return
    for weight in weights:
        if owner is None:
            dp_comm.all_reduce(weight.grad, tag="tied embedding grads").wait()
            weight.grad.div_(dp_comm.world_size)
            continue
        (reduced,) = StagedReduction(plain_owner_reduction([weight.grad], [owner(weight)], dp_comm,
                                                           average=True), eager=True).finish()
        weight.grad = None if reduced is None else reduced.clone()


def main_grad(p: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer steps on for parameter ``p``: its FP32 main gradient under ``--bf16``
    (:mod:`megatron.training.optimizer`), otherwise ``p.grad``."""
    grad = getattr(p, "main_grad", None)
    return grad if grad is not None else p.grad


def unique_parameters(chunks: list[nn.Module]):
    """Every parameter of ``chunks`` once, in order (a parameter shared between chunks is yielded at its first)."""
    seen: set[int] = set()
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                yield p


def model_grads(chunks: list[nn.Module]) -> list[torch.Tensor]:
    """Every gradient of ``chunks`` once (main gradients where they exist)."""
    return [g for g in map(main_grad, unique_parameters(chunks)) if g is not None]


def _squared_norms(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Sum of squared L2 norms of ``grads`` as a 0-d fp32 tensor on ``device``: one ``_foreach_norm``
    per (device, dtype) group of plain gradients, FP8 gradients through payload and scale; no host
    synchronisation (nothing is read back, nothing is copied per parameter)."""
    parts = [torch.zeros((), dtype=torch.float32, device=device)]
    plain: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        if payload_and_scale(g) is not None:  # a scaled gradient: E4M3, or the FP16 sum of grad_accumulation="fp16"
            parts.append(tensor_norm(g, 2.0).square().reshape(()))
        else:
            plain.setdefault((g.device, g.dtype), []).append(g)
    for (_, dtype), group in plain.items():
        norms = torch._foreach_norm(group, 2.0, dtype=torch.float32)
        parts.append(torch.stack(norms).square().sum())
    return torch.stack([p.to(device) for p in parts]).sum()


@torch.no_grad()
def global_grad_norm(chunks: list[nn.Module], tp_rank: int, comm: Collectives, pp_first_stage: bool,
                     device: torch.device | None = None, expert_comm: Collectives | None = None) -> torch.Tensor:
    """L2 norm (0-d fp32 tensor on ``device``) of all gradients of the model across ``comm``'s group (the ranks
    holding distinct parts of the model: tensor x pipeline parallel, and data parallel when gradients
    are sharded, O3). ``device`` (default: the first parameter's) is where the partial sums live and
    what is all-reduced: the process group's device (CUDA for NCCL). No host synchronisation. ``expert_comm``: the
    expert-parallel group, over which the routed experts' squared norms (megatron-core's ``allreduce = False``
    parameters) are summed first, when ``comm``'s group does not hold every expert-parallel rank."""
    counted, experts = [], []
    for p in unique_parameters(chunks):
        if device is None:
            device = p.device
        grad = main_grad(p)
        if grad is None:
            continue
        if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
            continue
        if getattr(p, "shared_embedding", False) and not pp_first_stage:
            continue  # the last stage's copy of a tied embedding: counted on the first stage
        (experts if expert_comm is not None and getattr(p, "allreduce", True) is False else counted).append(grad)
    device = device if device is not None else torch.device("cpu")
    total = _squared_norms(counted, device)
    if expert_comm is not None:
        expert_total = _squared_norms(experts, device)
        if expert_comm.world_size > 1:
            expert_comm.all_reduce(expert_total, tag="grad norm").wait()
        total = total + expert_total
    if comm.world_size > 1:
        comm.all_reduce(total, tag="grad norm").wait()
    return total.sqrt()


@torch.no_grad()
def scale_grads_(grads: list[torch.Tensor], factor: float | torch.Tensor) -> None:
    """Multiply ``grads`` by ``factor`` (a number, or a 0-d tensor on their device): scaled gradients (E4M3, FP16
    sums) exactly, through their scale, others in place."""
    for g in grads:
        if payload_and_scale(g) is not None:
            g.scale.div_(factor)
        else:
            g.mul_(factor.to(g.dtype) if isinstance(factor, torch.Tensor) else factor)


@torch.no_grad()
def clip_and_poison_(grads: list[torch.Tensor], norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Scale ``grads`` (global norm ``norm``) by ``min(1, max_norm / norm)`` (no clipping when ``max_norm``
    is 0), or by NaN when ``norm`` is not finite: every rank then sees non-finite gradients, and each
    optimizer skips the step on device (every opt level decides its skip from its own gradients), so
    the skip needs no host read and all model-parallel ranks agree. Returns the 0-d bool ``finite``.

    FP8 gradients are scaled through their scale (exact), others multiplied in place."""
    finite = torch.isfinite(norm)
    if max_norm > 0:
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    else:
        coef = torch.ones_like(norm)
    coef = torch.where(finite, coef, torch.full_like(coef, float("nan")))
    scale_grads_(grads, coef)
    return finite
