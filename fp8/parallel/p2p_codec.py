"""Wire format of activations and gradients between pipeline stages: FP8 payload plus its scale.

One ``uint8`` buffer per message: ``numel`` bytes of FP8 payload followed by the 4 bytes of its fp32
scale (current power-of-two scaling from the tensor's own amax, so no agreement between stages is
needed). Activations travel as E4M3, their gradients as E5M2. With ``fmt=None`` the tensor travels
unchanged (the high-precision baseline). With a ``block`` (:mod:`fp8.blocks`: ``(1, 0)`` per token, ``(1, 128)``
per tile, the rowwise and blockwise recipes) the tensor is viewed as ``(-1, last dim)`` and the payload is
followed by its grid of fp32 block scales.
"""

from __future__ import annotations

import math

import torch

from ..blocks import Block, block_amax, dequantize_blocks, grid_shape, is_tensorwise, quantize_blocks
from ..cast import dequantize, quantize
from ..formats import get_format
from ..scaling import amax_of, compute_scale, power_of_two_scale

__all__ = ["PipelineCodec"]

_SCALE_BYTES = 4


class PipelineCodec:
    """Encodes a tensor into the bytes that cross a pipeline-stage boundary and decodes them back.

    ``fmt``: ``"e4m3"``, ``"e5m2"`` or ``None`` (no compression); ``dtype``: the high-precision dtype of
    decoded tensors; ``block``: one scale per block of the ``(-1, last dim)`` view (None: one per tensor).
    """

    def __init__(self, fmt: str | None, dtype: torch.dtype, block: Block | None = None) -> None:
        self.format = get_format(fmt) if fmt is not None else None
        self.dtype = dtype
        self.block = None if is_tensorwise(block) else tuple(block)

    @staticmethod
    def _rows(shape) -> tuple[int, int]:
        return (math.prod(shape[:-1]), shape[-1])

    def wire_numel(self, shape) -> int:
        """Elements of the wire buffer for a tensor of ``shape``."""
        numel = math.prod(shape)
        if self.format is None:
            return numel
        if self.block is None:
            return numel + _SCALE_BYTES
        return numel + _SCALE_BYTES * math.prod(grid_shape(self.block, self._rows(shape)))

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
        if self.block is not None:
            x = tensor.detach().reshape(self._rows(tensor.shape))
            amax = block_amax(x, self.block)
            scales = power_of_two_scale(amax, self.format.max)
            scales = torch.where(torch.isfinite(amax), scales, torch.full_like(scales, float("nan")))
            payload = quantize_blocks(x, scales, self.block, self.format).reshape(-1).view(torch.uint8)
            return torch.cat([payload, scales.reshape(-1).view(torch.uint8)])
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
        if self.block is not None:
            rows = self._rows(shape)
            payload = wire[:numel].view(self.format.dtype).reshape(rows)
            scales = wire[numel:].view(torch.float32).reshape(grid_shape(self.block, rows))
            return dequantize_blocks(payload, scales, self.block, self.dtype).reshape(tuple(shape))
        payload = wire[:numel].view(self.format.dtype).reshape(tuple(shape))
        scale = wire[numel:numel + _SCALE_BYTES].view(torch.float32).reshape(())
        return dequantize(payload, scale, self.dtype)
