"""``clip_grad_norm_`` over FP8 and high-precision gradients together, in a fixed number of ops whatever the number of
gradients: the per-tensor norms by one ``torch._foreach_norm`` per payload dtype (FP8 payloads cast to FP16 first, in
one multi-tensor op: exact), the clip by one ``torch._foreach_div_`` of the scaled gradients' scales and one
``torch._foreach_mul_`` per dtype of the others (multi-tensor launches on CUDA)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..cast import payload_and_scale
from ..comm import Collectives
from ..distributed.sharding import check_fsdp_placement, is_dtensor, local
from ..formats import FP8_DTYPES
from ..tensor import Float8Tensor
from . import ops

__all__ = ["clip_grad_norm_", "scale_grads_to_norm_", "tensor_norm", "grad_norms"]


def tensor_norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    if isinstance(grad, Float8Tensor) and grad.block is not None:
        return torch.linalg.vector_norm(grad.dequantize(torch.float32), norm_type)
    parts = payload_and_scale(grad)  # a tensor-wise scaled gradient, FP8 or FP16
    if parts is not None:
        # The norm of payload / scale, without materialising the dequantized gradient twice.
        return torch.linalg.vector_norm(parts[0].to(torch.float32), norm_type) / parts[1]
    return torch.linalg.vector_norm(grad, norm_type).to(torch.float32)


@torch.no_grad()
def grad_norms(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """``torch.stack([tensor_norm(g, norm_type) for g in grads])`` (fp32, the same values bit for bit), in a fixed
    number of ops: one ``torch._foreach_norm`` per payload dtype (the norm of ``payload / scale`` is the payload's
    norm divided by the scale), block-scaled FP8 gradients one by one (dequantized)."""
    norms: list[torch.Tensor | None] = [None] * len(grads)
    divisors: list[torch.Tensor | None] = [None] * len(grads)
    by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
    fp8_payloads: list[tuple[int, torch.Tensor]] = []
    for i, g in enumerate(grads):
        if isinstance(g, Float8Tensor) and g.block is not None:
            norms[i] = tensor_norm(g, norm_type)
            continue
        parts = payload_and_scale(g)  # a tensor-wise scaled gradient, FP8 or FP16
        payload = parts[0] if parts is not None else g
        divisors[i] = parts[1] if parts is not None else None
        if payload.dtype in FP8_DTYPES:
            fp8_payloads.append((i, payload))
        else:
            by_dtype.setdefault(payload.dtype, []).append((i, payload))
    if fp8_payloads:  # FP8 has no norm kernel: FP16 holds every FP8 value exactly
        empty = fp8_payloads[0][1].new_empty(0, dtype=torch.float32)
        halves = ops.dequantize_grads([t for _, t in fp8_payloads], [empty] * len(fp8_payloads), torch.float16,
                                backend=_backend([t for _, t in fp8_payloads]))
        by_dtype.setdefault(torch.float16, []).extend((i, h) for (i, _), h in zip(fp8_payloads, halves))
    for dtype, rows in by_dtype.items():
        scaled = [(i, t) for i, t in rows if divisors[i] is not None]
        plain = [(i, t) for i, t in rows if divisors[i] is None]
        if scaled:  # the payloads' norms in fp32 (as vector_norm(payload.to(torch.float32)))
            for (i, _), n in zip(scaled, torch._foreach_norm([t for _, t in scaled], norm_type, dtype=torch.float32)):
                norms[i] = n
        if plain:  # in the gradient's dtype, then fp32 (as vector_norm(grad).to(torch.float32))
            for (i, _), n in zip(plain, torch._foreach_norm([t for _, t in plain], norm_type)):
                norms[i] = n
    if not any(d is not None for d in divisors):
        return torch.stack(norms).to(torch.float32)
    one = torch.ones((), dtype=torch.float32, device=norms[0].device)
    return torch.stack(norms).to(torch.float32) / torch.stack([one if d is None else d.to(torch.float32)
                                                              for d in divisors])


def _backend(tensors: list[torch.Tensor]) -> str:
    from .base import op_backend

    return op_backend("auto", tensors)


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Scale all gradients so their global ``norm_type`` norm is at most ``max_norm``; return the norm
    before clipping (fp32), as ``torch.nn.utils.clip_grad_norm_`` does.

    FP8 gradients are scaled by dividing their scale by the clip coefficient (no re-quantization:
    only the fp32 scale is rounded, and it is no longer a power of two); high-precision gradients are
    multiplied in place. Gradients of parameters sharded by FSDP2 (DTensors, ``Shard(0)`` on a 1-D mesh) are clipped
    by the norm of the whole gradients: one all-reduce over their mesh's group, on every rank of it (call it on every
    rank).
    No host synchronisation unless ``error_if_nonfinite``.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    if any(is_dtensor(g) for g in grads):  # FSDP2: each rank holds its rows of these gradients
        total = _sharded_total(grads, float(norm_type))
        grads = [local(g) for g in grads]
    else:
        total = torch.linalg.vector_norm(grad_norms(grads, float(norm_type)), float(norm_type))
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be clipped; "
            f"pass error_if_nonfinite=False to let the optimizer skip the step instead"
        )
    scale_grads_to_norm_(grads, total, max_norm)
    return total


def _sharded_total(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The global norm when some gradients are FSDP2 shards (DTensors sharded along dim 0: each rank holds its rows,
    maybe none): the shards' part (sum of p-th powers, or the max for the inf norm) all-reduced over their mesh's
    group (one collective, tag ``"grad norm"``, on the group's device), the unsharded gradients' part added once:
    they must be the same on every rank (replicated parameters, reduced), or each rank would clip by its own norm.
    No host read."""
    if not (norm_type > 0):
        raise ValueError(f"clip_grad_norm_ of FSDP2-sharded gradients takes a positive norm_type (or inf), got "
                         f"{norm_type}")
    shards, plain, groups = [], [], {}
    for g in grads:
        if not is_dtensor(g):
            plain.append(g)
            continue
        check_fsdp_placement(g, "a gradient passed to clip_grad_norm_")  # a replicated one would be counted N times
        group = g.device_mesh.get_group()
        groups[id(group)] = group
        shards.append(local(g))
    if len(groups) != 1:
        raise ValueError(f"clip_grad_norm_: the gradients are sharded over {len(groups)} different process groups; "
                         f"clip each FSDP2 mesh's parameters in its own call")
    comm = Collectives(next(iter(groups.values())))
    device = comm.device if comm.device is not None else shards[0].device  # a multi-backend group names none
    inf = norm_type == float("inf")

    def part(tensors: list[torch.Tensor]) -> torch.Tensor:  # empty shards (fewer rows than ranks) count nothing
        tensors = [t for t in tensors if t.numel()]
        if not tensors:
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = grad_norms(tensors, norm_type).to(device)
        return norms.amax() if inf else norms.pow(norm_type).sum()

    total = part(shards)
    if inf:  # a MAX reduction may drop a NaN: carried as inf, still non-finite on every rank
        total = torch.nan_to_num(total, nan=float("inf"))
    comm.all_reduce(total, op=torch.distributed.ReduceOp.MAX if inf else torch.distributed.ReduceOp.SUM,
                    tag="grad norm").wait()
    if plain:
        total = torch.maximum(total, part(plain)) if inf else total + part(plain)
    return total if inf else total.pow(1.0 / norm_type)


def scale_grads_to_norm_(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Multiply ``grads`` (whose global norm is ``total``) by ``min(1, max_norm / total)`` in place:
    scaled gradients (FP8 or FP16) exactly, through their scale (one ``torch._foreach_div_`` for all); others with an
    in-place multiply (one ``torch._foreach_mul_`` per dtype)."""
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    scales, plain = [], {}
    for g in grads:
        parts = payload_and_scale(g)
        if parts is not None:
            scales.append(parts[1])
        else:
            plain.setdefault(g.dtype, []).append(g)
    if scales:
        torch._foreach_div_(scales, coef)
    for dtype, tensors in plain.items():
        torch._foreach_mul_(tensors, coef.to(dtype))
