"""Wire format of activations and gradients between pipeline stages: FP8 payload plus its scale.

One ``uint8`` buffer per message: ``numel`` bytes of FP8 payload followed by the 4 bytes of its fp32
scale (current power-of-two scaling from the tensor's own amax, so no agreement between stages is
needed). Activations travel as E4M3, their gradients as E5M2. With ``fmt=None`` the tensor travels
unchanged (the high-precision baseline).
"""

from __future__ import annotations

import math

import torch

from ..cast import dequantize, quantize
from ..formats import get_format
from ..scaling import amax_of, compute_scale

__all__ = ["PipelineCodec"]

_SCALE_BYTES = 4


class PipelineCodec:
    """Encodes a tensor into the bytes that cross a pipeline-stage boundary and decodes them back.

    ``fmt``: ``"e4m3"``, ``"e5m2"`` or ``None`` (no compression); ``dtype``: the high-precision dtype of
    decoded tensors.
    """

    def __init__(self, fmt: str | None, dtype: torch.dtype) -> None:
        self.format = get_format(fmt) if fmt is not None else None
        self.dtype = dtype

    def wire_numel(self, shape) -> int:
        """Elements of the wire buffer for a tensor of ``shape``."""
        numel = math.prod(shape)
        return numel + _SCALE_BYTES if self.format is not None else numel

    def empty_wire(self, shape, device: torch.device | str) -> torch.Tensor:
        """A receive buffer for a tensor of ``shape``."""
        if self.format is None:
            return torch.empty(tuple(shape), dtype=self.dtype, device=device)
        return torch.empty(self.wire_numel(shape), dtype=torch.uint8, device=device)

    def empty_output(self, shape, device: torch.device | str) -> torch.Tensor:
        """An uninitialised tensor of ``shape`` in the decoded dtype (what :meth:`decode` returns)."""
        return torch.empty(tuple(shape), dtype=self.dtype, device=device)

    @torch.no_grad()
    def encode(self, tensor: torch.Tensor) -> torch.Tensor:
        """The wire buffer for ``tensor`` (FP8 payload + fp32 scale, or ``tensor`` in ``dtype``).

        A tensor holding inf/NaN is sent with a NaN scale, so the receiver sees non-finite values too.
        """
        if self.format is None:
            return tensor.detach().to(self.dtype).contiguous()
        amax = amax_of(tensor)
        scale = compute_scale(amax, self.format)
        scale = torch.where(torch.isfinite(amax), scale, torch.full_like(scale, float("nan")))
        payload = quantize(tensor.detach(), scale, self.format).reshape(-1).view(torch.uint8)
        return torch.cat([payload, scale.reshape(1).view(torch.uint8)])

    @torch.no_grad()
    def decode(self, wire: torch.Tensor, shape) -> torch.Tensor:
        """The high-precision tensor of ``shape`` a wire buffer carries."""
        if self.format is None:
            return wire.reshape(tuple(shape))
        numel = math.prod(shape)
        payload = wire[:numel].view(self.format.dtype).reshape(tuple(shape))
        scale = wire[numel:numel + _SCALE_BYTES].view(torch.float32).reshape(())
        return dequantize(payload, scale, self.dtype)
