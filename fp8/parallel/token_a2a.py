"""Mixture-of-experts token all-to-all, FP8 on the wire: each token a row of FP8 values with its own scale.

The expert-parallel dispatch sends each routed token (a row of ``hidden`` values) to the rank holding its expert, and
the combine sends the expert outputs back; both are all-to-alls with uneven splits (the router decides how many rows
go where). :func:`all_to_all_rows` runs one through :class:`fp8.comm.Collectives` (counted) and differentiates it
(the backward is the all-to-all in the other direction). With a format, every row travels as ``hidden`` FP8 bytes
followed by the 4 bytes of its fp32 power-of-two scale (:func:`fp8.scaling.power_of_two_scale` of the row's amax, so a
token keeps its own range whatever the other tokens hold): ``(hidden + 4) / (2 * hidden)`` of the BF16 bytes. A row
holding inf/NaN travels with a NaN scale, so the receiver sees a non-finite row (the step is then skipped), never a
clamped one. Without a format rows travel in their own dtype (the high-precision path).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..blocks import block_amax, dequantize_blocks, quantize_blocks
from ..comm import Collectives
from ..formats import get_format
from ..scaling import power_of_two_scale

__all__ = ["encode_rows", "decode_rows", "all_to_all_rows"]

_ROW = (1, 0)  # one scale per row (fp8.blocks: a whole row is one block)
_SCALE_BYTES = 4


@torch.no_grad()
def encode_rows(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``(rows, hidden + 4)`` uint8: each row of the 2-d ``x`` in ``fmt`` times its own scale, then the scale's
    bytes."""
    fmt = get_format(fmt)
    x = x.detach()
    amax = block_amax(x, _ROW)  # (rows, 1)
    scales = power_of_two_scale(amax, fmt.max)
    scales = torch.where(torch.isfinite(amax), scales, torch.full_like(scales, float("nan")))
    payload = quantize_blocks(x, scales, _ROW, fmt).view(torch.uint8)
    return torch.cat([payload, scales.contiguous().view(torch.uint8)], dim=1)


@torch.no_grad()
def decode_rows(wire: torch.Tensor, fmt: str, dtype: torch.dtype) -> torch.Tensor:
    """The ``(rows, hidden)`` tensor in ``dtype`` that :func:`encode_rows` wrote into ``wire``."""
    fmt = get_format(fmt)
    hidden = wire.shape[1] - _SCALE_BYTES
    payload = wire[:, :hidden].contiguous().view(fmt.dtype)
    scales = wire[:, hidden:].contiguous().view(torch.float32)  # (rows, 1)
    return dequantize_blocks(payload, scales, _ROW, dtype)


def _exchange(x: torch.Tensor, comm: Collectives, output_splits: Sequence[int], input_splits: Sequence[int],
              fmt: str | None, tag: str) -> torch.Tensor:
    """Rows ``x`` (2-d) split by ``input_splits`` to the ranks; the received rows (``sum(output_splits)``)."""
    rows_out = int(sum(output_splits))
    if fmt is None:
        send = x.contiguous()
        width = x.shape[1]
        recv = torch.empty((rows_out, width), dtype=x.dtype, device=x.device)
    else:
        send = encode_rows(x, fmt)
        width = send.shape[1]
        recv = torch.empty((rows_out, width), dtype=torch.uint8, device=x.device)
    comm.all_to_all_v(recv.view(-1), send.view(-1), [int(s) * width for s in output_splits],
                      [int(s) * width for s in input_splits], tag).wait()
    return recv if fmt is None else decode_rows(recv, fmt, x.dtype)


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, comm, output_splits, input_splits, fmt, grad_fmt, tag):
        ctx.comm, ctx.splits, ctx.grad_fmt, ctx.tag = comm, (list(output_splits), list(input_splits)), grad_fmt, tag
        return _exchange(x, comm, output_splits, input_splits, fmt, tag)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        # the gradient of a received row goes back to the rank that sent the row
        dx = _exchange(grad.contiguous(), ctx.comm, input_splits, output_splits, ctx.grad_fmt, ctx.tag + " grad")
        return dx, None, None, None, None, None, None


def all_to_all_rows(x: torch.Tensor, comm: Collectives, output_splits: Sequence[int], input_splits: Sequence[int],
                    *, fmt: str | None = None, grad_fmt: str | None = None, tag: str = "moe tokens") -> torch.Tensor:
    """All-to-all of the rows of ``x`` over ``comm``'s group, differentiable: ``input_splits[j]`` rows go to rank
    ``j``, ``output_splits[j]`` rows come from it (host integers, every rank's matching the others'). The forward
    sends rows in ``fmt`` (``"e4m3"``/``"e5m2"`` with a scale per row; None: in ``x``'s dtype), the backward sends
    the gradient rows back in ``grad_fmt``. ``x`` of any shape ``(rows, ...)`` (viewed as 2-d). Counted under
    ``tag`` (the backward under ``tag + " grad"``) as the bytes sent to other ranks."""
    shape = x.shape
    flat = x.reshape(shape[0], -1) if x.dim() != 2 else x
    out = _AllToAllRows.apply(flat, comm, output_splits, input_splits, fmt, grad_fmt, tag)
    return out.reshape((out.shape[0],) + tuple(shape[1:])) if x.dim() != 2 else out
