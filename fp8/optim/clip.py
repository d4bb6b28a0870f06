"""``clip_grad_norm_`` over FP8 and high-precision gradients together."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..cast import payload_and_scale
from ..tensor import Float8Tensor

__all__ = ["clip_grad_norm_", "scale_grads_to_norm_", "tensor_norm"]


def tensor_norm(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    if isinstance(grad, Float8Tensor) and grad.block is not None:
        return torch.linalg.vector_norm(grad.dequantize(torch.float32), norm_type)
    parts = payload_and_scale(grad)  # a tensor-wise scaled gradient, FP8 or FP16
    if parts is not None:
        # The norm of payload / scale, without materialising the dequantized gradient twice.
        return torch.linalg.vector_norm(parts[0].to(torch.float32), norm_type) / parts[1]
    return torch.linalg.vector_norm(grad, norm_type).to(torch.float32)


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
    multiplied in place.
    No host synchronisation unless ``error_if_nonfinite``.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norms = torch.stack([tensor_norm(g, float(norm_type)) for g in grads])
    total = torch.linalg.vector_norm(norms, float(norm_type))
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot be clipped; "
            f"pass error_if_nonfinite=False to let the optimizer skip the step instead"
        )
    scale_grads_to_norm_(grads, total, max_norm)
    return total


def scale_grads_to_norm_(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float) -> None:
    """Multiply ``grads`` (whose global norm is ``total``) by ``min(1, max_norm / total)`` in place:
    scaled gradients (FP8 or FP16) exactly, through their scale; others with an in-place multiply."""
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for g in grads:
        parts = payload_and_scale(g)
        if parts is not None:
            parts[1].div_(coef)
        else:
            g.mul_(coef.to(g.dtype))
