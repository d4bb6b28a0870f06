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
import torch.distributed as dist
from torch import nn

from fp8.distributed.bytes_counter import CommBytesCounter
from fp8.optim.base import grad_value
from fp8.parallel.comm import TensorParallelComm
from fp8.tensor import Float8Tensor

__all__ = ["finalize_model_grads", "global_grad_norm"]


def finalize_model_grads(chunks: list[nn.Module], tp_group, embd_group, tied_embeddings: bool,
                         counter: CommBytesCounter | None = None) -> None:
    """Sum sequence-parallel parameter gradients over ``tp_group`` and tied embedding gradients over
    ``embd_group`` (when ``tied_embeddings`` and the pipeline has more than one stage)."""
    sp_grads = [p.grad for c in chunks for p in c.parameters()
                if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if sp_grads and dist.get_world_size(tp_group) > 1:
        flat = torch.cat([g.reshape(-1) for g in sp_grads])
        TensorParallelComm(tp_group, counter).all_reduce(flat, "sp param grads")
        offset = 0
        for g in sp_grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
    if tied_embeddings and embd_group is not None and dist.get_world_size(embd_group) > 1:
        for chunk in chunks:
            if not (getattr(chunk, "pre_process", False) or getattr(chunk, "post_process", False)):
                continue
            weight = chunk.shared_embedding_or_output_weight()
            if weight is None or weight.grad is None:
                continue
            if isinstance(weight.grad, Float8Tensor):
                raise RuntimeError("tied embeddings are expected in high precision")
            TensorParallelComm(embd_group, counter).all_reduce(weight.grad, "tied embedding grads")


@torch.no_grad()
def global_grad_norm(chunks: list[nn.Module], tp_rank: int, group, pp_first_stage: bool) -> torch.Tensor:
    """L2 norm (fp32) of all gradients of the model across ``group`` (the ranks holding distinct parts
    of the model: tensor x pipeline parallel, and data parallel when gradients are sharded, O3)."""
    total = torch.zeros((), dtype=torch.float32)
    seen: set[int] = set()
    for chunk in chunks:
        for p in chunk.parameters():
            if id(p) in seen or p.grad is None:
                continue
            seen.add(id(p))
            if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
                continue
            if getattr(p, "shared_embedding", False) and not pp_first_stage:
                continue  # the last stage's copy of a tied embedding: counted on the first stage
            total = total + grad_value(p.grad).square().sum().to(total.device)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return total.sqrt()
