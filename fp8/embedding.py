"""``Float8Embedding``: an embedding table held as E4M3 with one power-of-two scale per row.

A lookup gathers the rows' payloads and scales and returns ``payload / scale`` in the model's dtype: exactly the
values held, no GEMM. Trained (``fp8.initialize(..., fp8_embeddings=True)``), the table is an FP8 weight like a
:class:`~fp8.linear.Float8Linear`'s: the optimizer keeps its master and refreshes the E4M3 rows (with their
scales) after each step, and its gradient is the rows' summed output gradients (an fp32 dense table, scattered
with ``index_add``) held per ``config.grad_accumulation``: a scaled FP16 buffer (one scale for the table), fp32,
or E4M3 with one scale per row (:func:`fp8.linear.weight_grad`). Frozen (``fp8.freeze``), it is 1 byte per value plus a 4-byte scale per row.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .blocks import ROWWISE, dequantize_blocks
from .linear import Float8LinearConfig, weight_grad
from .tensor import Float8Tensor, to_float8

__all__ = ["Float8Embedding", "embedding_problem"]


def embedding_problem(emb: nn.Embedding) -> str | None:
    """Why ``emb`` cannot hold an FP8 table, or None if it can."""
    if emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
        return (f"max_norm={emb.max_norm}, sparse={emb.sparse}, scale_grad_by_freq={emb.scale_grad_by_freq}: these "
                f"renormalise rows at lookup or change the gradient; an FP8 table supports none of them")
    if not emb.weight.is_floating_point():
        return f"weight dtype {emb.weight.dtype} is not floating point"
    return None


class _Float8EmbeddingFunction(torch.autograd.Function):
    """``apply(ids, weight, padding_idx, config, dtype)``: the rows of the FP8 ``weight`` at ``ids`` in ``dtype``."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, config, dtype):
        flat = ids.reshape(-1)
        rows = weight.payload.index_select(0, flat)
        scales = weight.scale.index_select(0, flat)
        out = dequantize_blocks(rows, scales, ROWWISE, dtype).reshape(*ids.shape, weight.shape[1])
        if ctx.needs_input_grad[1]:
            ctx.save_for_backward(flat)
        ctx.shape, ctx.padding_idx, ctx.config, ctx.weight_dtype = tuple(weight.shape), padding_idx, config, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None
        (flat,) = ctx.saved_tensors
        grad_w32 = torch.zeros(ctx.shape, dtype=torch.float32, device=grad_out.device)
        grad_w32.index_add_(0, flat, grad_out.reshape(-1, ctx.shape[1]).to(torch.float32))
        if ctx.padding_idx is not None:
            grad_w32[ctx.padding_idx] = 0
        return None, weight_grad(grad_w32, ctx.config, ctx.weight_dtype), None, None, None


class Float8Embedding(nn.Module):
    """Drop-in for ``nn.Embedding`` (no ``max_norm``, ``sparse``, ``scale_grad_by_freq``) with an E4M3 table, one
    scale per row (``ROWWISE``); ``weight`` is an ``nn.Parameter`` holding the :class:`Float8Tensor`. ``config``'s
    ``weight_fmt``, ``grad_accumulation``, ``weight_grad_fmt`` and ``accumulate_backend`` apply (its recipe is
    ``rowwise``: the table's and its gradient's blocks are rows); ``dtype`` is the output's."""

    def __init__(self, weight: nn.Parameter, padding_idx: int | None, dtype: torch.dtype,
                 config: Float8LinearConfig | None = None) -> None:
        super().__init__()
        if not isinstance(weight, Float8Tensor) or weight.block != ROWWISE:
            raise TypeError("Float8Embedding.weight must be a row-wise scaled Float8Tensor "
                            "(fp8.to_float8(w, block=fp8.blocks.ROWWISE))")
        self.weight = weight
        self.padding_idx = padding_idx
        self.dtype = dtype
        self.config = dataclasses.replace(config or Float8LinearConfig(), recipe="rowwise")
        self.num_embeddings, self.embedding_dim = weight.shape

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, config: Float8LinearConfig | None = None) -> "Float8Embedding":
        """The FP8 form of ``emb``: its table quantized with current per-row scales, requiring grad as ``emb``'s
        weight does (its master is ``emb.weight``, for the optimizer)."""
        problem = embedding_problem(emb)
        if problem:
            raise ValueError(f"Float8Embedding.from_embedding: {problem}")
        config = dataclasses.replace(config or Float8LinearConfig(), recipe="rowwise")
        w = emb.weight.detach()
        table = to_float8(w, config.weight_fmt, dtype=config.weight_dtype(w.dtype),
                          accumulate_backend=config.accumulate_backend, block=ROWWISE)
        return cls(nn.Parameter(table, requires_grad=emb.weight.requires_grad), emb.padding_idx, w.dtype, config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _Float8EmbeddingFunction.apply(ids, self.weight, self.padding_idx, self.config, self.dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, {self.config.weight_fmt} per row, dtype={self.dtype}, "
                f"grad_accumulation={self.config.grad_accumulation}")
