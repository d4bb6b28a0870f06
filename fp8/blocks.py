"""Block scaling: one power-of-two scale per block of a 2-D tensor (torch reference, every device).

A block is ``(rows, cols)``; ``0`` stands for the whole dimension. The granularities the recipes use
(:mod:`fp8.recipes`):

- ``TENSORWISE = (0, 0)``: one scale for the tensor (its scale grid is the 0-d scale of
  :func:`fp8.scaling.compute_scale`).
- ``ROWWISE = (1, 0)``: one scale per row (a token of an activation, an output channel of a weight).
- ``COLWISE = (0, 1)``: one scale per column.
- ``TILE = (1, 128)`` and ``TILE_T = (128, 1)``: DeepSeek-V3's activation/gradient tiles, along a row
  and along a column.
- ``BLOCK = (128, 128)``: DeepSeek-V3's weight blocks.
- ``MX_TILE = (1, 32)``, ``MX_TILE_T = (32, 1)`` and ``MX_BLOCK = (32, 32)``: MXFP8's blocks (:mod:`fp8.mxfp8`): one
  scale per 32 elements along a GEMM's K; a weight's 32x32 blocks give both of its GEMMs (``W`` and ``W^T``) one scale
  per 32 along their K from one payload.

A tensor of shape ``(M, N)`` quantized with block ``(r, c)`` has a scale grid of shape
``(ceil(M / r), ceil(N / c))`` (fp32): ``payload = cast(value * scale of its block)``, so
``value = payload / scale``. Edge blocks may be partial. Every scale is
:func:`fp8.scaling.power_of_two_scale` of its block's amax (1.0 for an all-zero or non-finite block), so
re-quantizing an FP8 value to another grid is exact except where a value becomes subnormal in its new
block. ``quantize`` clamps to the format's range, like :func:`fp8.cast.quantize`.
"""

from __future__ import annotations

import math

import torch

from .cast import dequantize
from .formats import FP8Format, get_format
from .scaling import power_of_two_scale

__all__ = [
    "Block", "TENSORWISE", "ROWWISE", "COLWISE", "TILE", "TILE_T", "BLOCK", "MX_TILE", "MX_TILE_T", "MX_BLOCK",
    "block_size", "grid_shape",
    "is_tensorwise", "transpose_block", "block_amax", "block_scales", "expand_scales", "quantize_blocks",
    "dequantize_blocks", "quantize_to_blocks", "scales_constant_along",
]

Block = tuple[int, int]
TENSORWISE: Block = (0, 0)
ROWWISE: Block = (1, 0)
COLWISE: Block = (0, 1)
TILE: Block = (1, 128)
TILE_T: Block = (128, 1)
BLOCK: Block = (128, 128)
MX_TILE: Block = (1, 32)
MX_TILE_T: Block = (32, 1)
MX_BLOCK: Block = (32, 32)


def is_tensorwise(block: Block | None) -> bool:
    """Whether ``block`` covers the whole tensor (``None`` or ``(0, 0)``)."""
    return block is None or tuple(block) == TENSORWISE


def block_size(block: Block, shape: tuple[int, int]) -> tuple[int, int]:
    """The block's rows and columns in a tensor of ``shape`` (``0`` -> the whole dimension)."""
    rows, cols = block
    return (rows or max(shape[0], 1), cols or max(shape[1], 1))


def grid_shape(block: Block, shape: tuple[int, int]) -> tuple[int, int]:
    """Shape of the scale grid of a ``shape`` tensor quantized in ``block``s."""
    rows, cols = block_size(block, shape)
    return (math.ceil(shape[0] / rows), math.ceil(shape[1] / cols))


def transpose_block(block: Block | None) -> Block | None:
    """The block of the transposed tensor."""
    return None if block is None else (block[1], block[0])


def _check_2d(x: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"block scaling works on 2-D tensors, got shape {tuple(x.shape)}; reshape to (-1, last dim)")


def _padded_blocks(x: torch.Tensor, block: Block) -> tuple[torch.Tensor, tuple[int, int]]:
    """``x`` zero-padded to whole blocks and viewed as ``(grid rows, block rows, grid cols, block cols)``."""
    rows, cols = block_size(block, tuple(x.shape))
    gr, gc = grid_shape(block, tuple(x.shape))
    pad_r, pad_c = gr * rows - x.shape[0], gc * cols - x.shape[1]
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    return x.reshape(gr, rows, gc, cols), (gr, gc)


def block_amax(x: torch.Tensor, block: Block) -> torch.Tensor:
    """Largest magnitude per block, an fp32 ``grid_shape`` tensor (no host sync)."""
    _check_2d(x)
    if x.numel() == 0:
        return torch.zeros(grid_shape(block, tuple(x.shape)), dtype=torch.float32, device=x.device)
    blocks, _ = _padded_blocks(x.detach().abs().to(torch.float32), block)
    return blocks.amax(dim=(1, 3))


def block_scales(x: torch.Tensor, block: Block, fmt: FP8Format | str, margin: int = 0) -> torch.Tensor:
    """Current power-of-two scale per block of ``x`` for ``fmt`` (1.0 where a block is all zero or not finite)."""
    return power_of_two_scale(block_amax(x, block), get_format(fmt).max, margin)


def expand_scales(scales: torch.Tensor, block: Block, shape: tuple[int, int]) -> torch.Tensor:
    """The per-element scale of a ``shape`` tensor from its block ``scales`` grid (fp32)."""
    rows, cols = block_size(block, shape)
    full = scales.to(torch.float32).repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)
    return full[: shape[0], : shape[1]]


def quantize_blocks(x: torch.Tensor, scales: torch.Tensor, block: Block, fmt: FP8Format | str) -> torch.Tensor:
    """FP8 payload of ``x`` times its block's scale (fp32, clamped to +-fmt.max, rounded to nearest)."""
    _check_2d(x)
    fmt = get_format(fmt)
    scaled = x.to(torch.float32) * expand_scales(scales, block, tuple(x.shape))
    return scaled.clamp(-fmt.max, fmt.max).to(fmt.dtype)


def dequantize_blocks(data: torch.Tensor, scales: torch.Tensor, block: Block | None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Value ``payload / scale of its block`` in ``dtype`` (exact in fp32); a tensor-wise ``block`` (None or
    ``(0, 0)``, a 0-d scale, any number of dimensions) is :func:`fp8.cast.dequantize`."""
    if is_tensorwise(block):
        return dequantize(data, scales, dtype)
    _check_2d(data)
    return (data.to(torch.float32) * expand_scales(scales, block, tuple(data.shape)).reciprocal()).to(dtype)


def quantize_to_blocks(x: torch.Tensor, block: Block, fmt: FP8Format | str,
                       margin: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(payload, scales)`` of ``x`` in ``block``s with current power-of-two scales."""
    scales = block_scales(x, block, fmt, margin)
    return quantize_blocks(x, scales, block, fmt), scales


def scales_constant_along(block: Block | None, shape: tuple[int, int], dim: int) -> bool:
    """Whether one block spans the whole of dimension ``dim`` (so the scales do not vary along it)."""
    if is_tensorwise(block):
        return True
    return block_size(block, shape)[dim] >= shape[dim]
