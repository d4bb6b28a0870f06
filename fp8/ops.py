"""The FP8 core's fused kernels, each one ``torch.library`` custom op (namespace ``fp8lm``).

Every op here is one kernel: its default implementation is the torch reference (the CPU path, and the test oracle of
the kernel), its CUDA implementation one Triton launch (:mod:`fp8.kernels.triton_quantize`; Triton is imported when
a CUDA op first runs, never at ``import fp8``). A custom op is one dispatched op, so the op sequence a CPU run
dispatches is the GPU's kernel sequence (:class:`fp8.launches.LaunchCounter` counts it), and ``torch.compile`` sees
one op (each has a fake implementation: no graph break).

Conventions (as everywhere in fp8): power-of-two scales, ``payload = cast(clamp(value * scale))`` and ``value =
payload * scale_inv``; the ops return ``scale_inv`` (what ``torch._scaled_mm`` takes), fp32. Inf and NaN inputs are
written as NaN (``0x7F``), never saturated, so a non-finite value reaches the gradients and the step is skipped.

- :func:`amax` ``(x, row, col) -> [finite amax, non-finite flag]``: one read of ``x`` (optionally scaled by per-row /
  per-column factors first: a row-wise GEMM's epilogue).
- :func:`cast_transpose` ``(x, scale, amax_slot, ...)``: delayed scaling in one pass: cast with the given scale,
  the transpose (padded), the amax recorded into the history slot in place.
- :func:`cast_transpose_from_amax`: current scaling's second pass: the scale computed from :func:`amax`'s result.
- :func:`quantize_rows`, :func:`quantize_cols_t`: per-row and per-column power-of-two scales (one pass each).
- :func:`quantize_tiles`: 1x128 tiles and, from the same 128x128 tile read, 128x1 tiles (the blockwise recipe); 1x32 and
  32x1 from one 32x32 read with ``tile=32`` (MXFP8).
- :func:`transpose_fp8`: an FP8 payload's padded transpose and ``1 / scale`` (a weight's input-gradient operand);
  :func:`transpose_fp8_into_` the same for many weights at once, in place (the optimizer step's refresh).
- :func:`scaled_fp16`: a weight gradient's fp32 GEMM output as a scaled FP16 buffer (scale from :func:`amax`).
- :func:`apply_scales`: a row-wise GEMM's fp32 output times its row and column ``scale_inv`` (the epilogue).
- :func:`update_scales_`: every delayed-scaling state of a model closes its step (multi-tensor: one launch).
- :func:`quantize_mx`: MXFP8's activation operands (1x32 and transposed 32x1 tiles) with their swizzled E8M0 scales,
  one pass;
- :func:`mx_scales`: an MXFP8 operand's scale grid as the swizzled E8M0 scales ``F.scaled_mm`` reads (one pass);
  :func:`mx_mm` the MXFP8 GEMM's reference on them (the CPU's ``gemm_backend="scaled_mm"``; CUDA runs ``F.scaled_mm``).
- :func:`block_mm`: the block-scaled FP8 GEMM (Triton on CUDA; its per-K-block fp32 reference elsewhere).
- :func:`segment_amax`, :func:`segment_cast`, :func:`segment_sum`: the FSDP2 FP8 reduce-scatter
  (:mod:`fp8.distributed.fsdp`): a buffer whose columns are runs of several FP8 weights' gradients, each weight its
  own scale: the amaxes per weight, the cast into the all-to-all buffer, and the received rows summed and unscaled;
  :func:`row_chunk_sum` the same reduce-scatter's epilogue for embedding tables sent with each sender's scale per row
  (cast by :func:`quantize_rows`).

Transposes are padded: ``data_t`` is ``(N, ceil(M / pad) * pad)`` with zeros past column ``M`` (``pad`` 1: none), so
a weight-gradient GEMM summing over ``M`` tokens gets a K that ``torch._scaled_mm`` takes whatever the token count.
With ``dst_cols`` (int32, one per row of ``x``) and ``out_t`` (a zeroed buffer the caller allocated) the transpose is
written into ``out_t`` instead, row ``r`` at column ``dst_cols[r]`` (groups of rows padded each on its own: the
experts' tokens), and the op returns an empty ``data_t``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import custom_op

from .formats import get_format

__all__ = [
    "power_of_two_scale", "amax", "cast_transpose", "cast_transpose_from_amax", "quantize_rows", "quantize_cols_t", "quantize_tiles",
    "transpose_fp8", "transpose_fp8_into_", "scaled_fp16", "apply_scales", "update_scales_", "block_mm", "padded", "TILE",
    "mx_scales", "mx_mm", "quantize_mx", "segment_amax", "segment_cast", "segment_sum",
    "row_chunk_sum", "FP16_MAX", "FP16_HEADROOM_BITS",
]

TILE = 128
"""Edge of the blockwise recipe's tiles (1x128, 128x1) and blocks (128x128)."""

FP16_MAX = 65504.0
FP16_HEADROOM_BITS = 11
_MAX_EXP = 126.0
_NAN_BITS = 0x7F


def padded(n: int, pad: int) -> int:
    """``n`` rounded up to a multiple of ``pad`` (``pad`` <= 1: ``n``)."""
    return -(-n // pad) * pad if pad > 1 else n


def power_of_two_scale(amax: Tensor, fmax: float, margin: int = 0, previous: Tensor | float | None = None) -> Tensor:
    """The scale formula of fp8 (every scale, every kernel): the power of two mapping ``amax`` into ``(fmax / 2,
    fmax]``, lowered by ``2**margin``: ``2**(floor(log2(fmax / amax)) - margin)``, within ``2**+-126`` (so it and its
    reciprocal stay normal fp32 numbers); ``previous`` (default 1.0) where ``amax`` is 0, inf or NaN. Elementwise,
    fp32, on ``amax``'s device, no host sync. The floor is exact: a ``log2`` rounded up to an integer from just below
    it is corrected, so the Triton kernels (which read the exponent bits of the same correctly rounded reciprocal times
``fmax``) give the same bits; a ratio past fp32's range (a tiny amax) counts as ``2**128`` before the margin."""
    amax = amax.to(torch.float32)
    ratio = amax.reciprocal() * fmax  # what ``fmax / amax`` computes in torch (Tensor.__rtruediv__), spelled out
    exponent = torch.floor(torch.log2(ratio))
    exponent = exponent - (torch.exp2(exponent) > ratio).to(torch.float32)
    exponent = exponent.clamp(max=_MAX_EXP + 2)  # an fp32 ratio that overflows (inf) has exponent 128, as in Triton
    scale = torch.exp2((exponent - margin).clamp(-_MAX_EXP, _MAX_EXP))
    if previous is None or not isinstance(previous, Tensor):
        previous = torch.full_like(amax, 1.0 if previous is None else previous)
    return torch.where(torch.isfinite(amax) & (amax > 0), scale, previous.to(torch.float32))


def _encode(value: Tensor, finite: Tensor, fmt) -> Tensor:
    """``value`` (fp32, already scaled) clamped and cast to ``fmt``; NaN bits where ``finite`` is False."""
    data = value.clamp(-fmt.max, fmt.max).to(fmt.dtype).view(torch.uint8)
    return torch.where(finite, data, torch.full_like(data, _NAN_BITS)).view(fmt.dtype)


def _transposed(data: Tensor, pad: int, dst_cols: Tensor | None, out_t: Tensor | None) -> Tensor:
    """``data.t()`` (row-major) with its columns padded (module docstring): into ``out_t`` at ``dst_cols`` when given
    (returning an empty tensor), else a new ``(N, M padded)`` tensor."""
    m, n = data.shape
    if out_t is not None:
        out_t.view(torch.uint8).index_copy_(1, dst_cols.to(torch.int64), data.view(torch.uint8).t())
        return data.new_empty((0, 0))
    out = torch.zeros((n, padded(m, pad)), dtype=torch.uint8, device=data.device)
    out[:, :m] = data.view(torch.uint8).t()
    return out.view(data.dtype)


def _finite_amax(values: Tensor) -> Tensor:
    return values.abs().nan_to_num(nan=0.0, posinf=0.0).amax() if values.numel() else values.new_zeros(())


def _record(amax_slot: Tensor, finite_amax: Tensor) -> None:
    amax_slot.copy_(torch.maximum(amax_slot, finite_amax.reshape(amax_slot.shape)))


def _empty_t(x: Tensor, fmt) -> Tensor:
    return torch.empty((0, 0), dtype=fmt.dtype, device=x.device)


# -- amax -----------------------------------------------------------------------------------------------------------
@custom_op("fp8lm::amax", mutates_args=())
def amax(x: Tensor, row: Tensor | None = None, col: Tensor | None = None) -> Tensor:
    """``[finite amax, non-finite flag]`` (fp32, 2 elements) of ``x * row * col`` (``row`` ``(M, 1)``, ``col``
    ``(1, N)``, each optional): the largest finite magnitude (0 when none), and 1.0 when any value is inf or NaN."""
    values = x.to(torch.float32)
    if row is not None:
        values = values * row
    if col is not None:
        values = values * col
    flag = (~torch.isfinite(values)).any().to(torch.float32) if values.numel() else values.new_zeros(())
    return torch.stack([_finite_amax(values), flag])


@amax.register_fake
def _(x, row=None, col=None):
    return x.new_empty((2,), dtype=torch.float32)


# -- tensor-wise casts ----------------------------------------------------------------------------------------------
@custom_op("fp8lm::cast_transpose", mutates_args=("amax_slot", "out_t"))
def cast_transpose(x: Tensor, scale: Tensor, amax_slot: Tensor, fmt: str, transpose: bool, pad: int, record: bool,
                   dst_cols: Tensor | None = None, out_t: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``(data, data_t, scale_inv)`` of 2-D ``x`` cast with the 0-d ``scale`` (delayed scaling: known before ``x`` is
    read), ``data_t`` its padded transpose (``(0, 0)`` without ``transpose``), ``scale_inv = 1 / scale``; with
    ``record`` the largest finite magnitude of ``x`` is max-ed into ``amax_slot`` (the history's slot 0) in place."""
    f = get_format(fmt)
    values = x.to(torch.float32)
    data = _encode(values * scale.to(torch.float32), torch.isfinite(values), f)
    if record:
        _record(amax_slot, _finite_amax(values))
    data_t = _transposed(data, pad, dst_cols, out_t) if transpose else _empty_t(x, f)
    return data, data_t, scale.to(torch.float32).reciprocal().reshape(())


def _fake_t(x, fmt, transpose, pad, out_t):
    m, n = x.shape
    dtype = get_format(fmt).dtype
    return x.new_empty((n, padded(m, pad)) if transpose and out_t is None else (0, 0), dtype=dtype)


@cast_transpose.register_fake
def _(x, scale, amax_slot, fmt, transpose, pad, record, dst_cols=None, out_t=None):
    return (x.new_empty(x.shape, dtype=get_format(fmt).dtype), _fake_t(x, fmt, transpose, pad, out_t),
            x.new_empty((), dtype=torch.float32))


@custom_op("fp8lm::cast_transpose_from_amax", mutates_args=("amax_slot", "out_t"))
def cast_transpose_from_amax(x: Tensor, amax2: Tensor, previous: Tensor, amax_slot: Tensor, fmt: str, margin: int,
                             transpose: bool, pad: int, record: bool, dst_cols: Tensor | None = None,
                             out_t: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Current scaling's cast: as :func:`cast_transpose` with the scale ``power_of_two_scale(amax2[0], fmt.max,
    margin, previous)`` computed in the kernel from :func:`amax`'s result ``amax2`` (agreed over a group beforehand
    where one shares it). When ``amax2`` flags a non-finite value, ``scale_inv`` and every element are NaN (the
    cast carries the failure on whole); ``record`` max-es a finite amax into ``amax_slot``."""
    f = get_format(fmt)
    bad = amax2[1] > 0
    scale = power_of_two_scale(amax2[0], f.max, margin, previous.reshape(()))
    values = x.to(torch.float32)
    data = _encode(values * scale, torch.isfinite(values) & ~bad, f)
    if record:
        _record(amax_slot, torch.where(bad, torch.zeros_like(amax2[0]), amax2[0]))
    scale_inv = torch.where(bad, torch.full_like(scale, float("nan")), scale.reciprocal())
    data_t = _transposed(data, pad, dst_cols, out_t) if transpose else _empty_t(x, f)
    return data, data_t, scale_inv


@cast_transpose_from_amax.register_fake
def _(x, amax2, previous, amax_slot, fmt, margin, transpose, pad, record, dst_cols=None, out_t=None):
    return (x.new_empty(x.shape, dtype=get_format(fmt).dtype), _fake_t(x, fmt, transpose, pad, out_t),
            x.new_empty((), dtype=torch.float32))


# -- block-scaled casts -----------------------------------------------------------------------------------------------
@custom_op("fp8lm::quantize_rows", mutates_args=())
def quantize_rows(x: Tensor, fmt: str, x_scale_inv: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(data, scale_inv (M, 1))``: one power-of-two scale per row of 2-D ``x`` from the row's finite amax (1.0 for a
    row without a non-zero finite value); ``x_scale_inv`` (optional, broadcastable) dequantizes an FP8 ``x`` first."""
    f = get_format(fmt)
    values = x.to(torch.float32) if x_scale_inv is None else x.to(torch.float32) * x_scale_inv
    row_amax = values.abs().nan_to_num(nan=0.0, posinf=0.0).amax(dim=1, keepdim=True) if values.shape[1] else \
        values.new_zeros((values.shape[0], 1))
    scale = power_of_two_scale(row_amax, f.max, 0, 1.0)
    return _encode(values * scale, torch.isfinite(values), f), scale.reciprocal()


@quantize_rows.register_fake
def _(x, fmt, x_scale_inv=None):
    return x.new_empty(x.shape, dtype=get_format(fmt).dtype), x.new_empty((x.shape[0], 1), dtype=torch.float32)


@custom_op("fp8lm::quantize_cols_t", mutates_args=())
def quantize_cols_t(x: Tensor, fmt: str, pad: int, x_scale_inv: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(data_t, scale_inv (1, N))``: one power-of-two scale per column of 2-D ``x`` (over all its rows), the payload
    written transposed, ``(N, M)`` with its columns padded to a multiple of ``pad`` (zeros); ``x_scale_inv`` as for
    :func:`quantize_rows`."""
    f = get_format(fmt)
    values = x.to(torch.float32) if x_scale_inv is None else x.to(torch.float32) * x_scale_inv
    col_amax = values.abs().nan_to_num(nan=0.0, posinf=0.0).amax(dim=0, keepdim=True) if values.shape[0] else \
        values.new_zeros((1, values.shape[1]))
    scale = power_of_two_scale(col_amax, f.max, 0, 1.0)
    data = _encode(values * scale, torch.isfinite(values), f)
    return _transposed(data, pad, None, None), scale.reciprocal()


@quantize_cols_t.register_fake
def _(x, fmt, pad, x_scale_inv=None):
    m, n = x.shape
    return x.new_empty((n, padded(m, pad)), dtype=get_format(fmt).dtype), x.new_empty((1, n), dtype=torch.float32)


def _tile_scales(values: Tensor, rows: int, cols: int, fmax: float) -> Tensor:
    m, n = values.shape
    gr, gc = -(-m // rows), -(-n // cols)
    full = torch.nn.functional.pad(values.abs().nan_to_num(nan=0.0, posinf=0.0), (0, gc * cols - n, 0, gr * rows - m))
    return power_of_two_scale(full.reshape(gr, rows, gc, cols).amax(dim=(1, 3)), fmax, 0, 1.0)


@custom_op("fp8lm::quantize_tiles", mutates_args=())
def quantize_tiles(x: Tensor, fmt: str, columnwise: bool, pad: int, x_scale_inv: Tensor | None = None,
                   tile: int = TILE, transpose_c: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(data, scale_inv, data_c, scale_inv_c)`` of 2-D ``x`` (N a multiple of ``tile``) in 1 x ``tile`` tiles
    (``scale_inv`` ``(M, N/tile)``) and, with ``columnwise``, ``tile`` x 1 tiles along the rows from the same read
    (``data_c`` ``(M padded to pad, N)`` with zero rows past ``M``, ``scale_inv_c`` ``(ceil(M/tile), N)``); else those
    two are empty. ``tile``: 128 for the blockwise recipe (DeepSeek-V3's tiles), 32 for MXFP8 (:mod:`fp8.mxfp8`).
    ``transpose_c``: the column-wise pair written transposed, ``data_c`` ``(N, M padded)`` and ``scale_inv_c``
    ``(N, ceil(M/tile))`` row-major (tokens contiguous: the layout the MXFP8 weight-gradient GEMM reads; the block GEMM
    reads any strides). ``x_scale_inv`` (a 1 x ``tile`` grid, optional) dequantizes an FP8 ``x`` first."""
    f = get_format(fmt)
    m, n = x.shape
    values = x.to(torch.float32)
    if x_scale_inv is not None:
        values = values * x_scale_inv.to(torch.float32).repeat_interleave(tile, dim=1)[:, :n]
    finite = torch.isfinite(values)
    s = _tile_scales(values, 1, tile, f.max)
    data = _encode(values * s.repeat_interleave(tile, dim=1)[:, :n], finite, f)
    if not columnwise:
        empty = torch.empty((0, 0), dtype=torch.float32, device=x.device)
        return data, s.reciprocal(), _empty_t(x, f), empty
    sc = _tile_scales(values, tile, 1, f.max)
    data_c = _encode(values * sc.repeat_interleave(tile, dim=0)[:m], finite, f)
    rows = padded(m, pad)
    if rows != m:
        data_c = torch.cat([data_c.view(torch.uint8), data_c.new_zeros((rows - m, n), dtype=torch.uint8)]).view(f.dtype)
    if transpose_c:
        return data, s.reciprocal(), data_c.t().contiguous(), sc.reciprocal().t().contiguous()
    return data, s.reciprocal(), data_c, sc.reciprocal()


@quantize_tiles.register_fake
def _(x, fmt, columnwise, pad, x_scale_inv=None, tile=TILE, transpose_c=False):
    m, n = x.shape
    dtype = get_format(fmt).dtype
    if not columnwise:
        return (x.new_empty(x.shape, dtype=dtype), x.new_empty((m, -(-n // tile)), dtype=torch.float32),
                x.new_empty((0, 0), dtype=dtype), x.new_empty((0, 0), dtype=torch.float32))
    if transpose_c:
        return (x.new_empty(x.shape, dtype=dtype), x.new_empty((m, -(-n // tile)), dtype=torch.float32),
                x.new_empty((n, padded(m, pad)), dtype=dtype), x.new_empty((n, -(-m // tile)), dtype=torch.float32))
    return (x.new_empty(x.shape, dtype=dtype), x.new_empty((m, -(-n // tile)), dtype=torch.float32),
            x.new_empty((padded(m, pad), n), dtype=dtype), x.new_empty((-(-m // tile), n), dtype=torch.float32))


@custom_op("fp8lm::quantize_mx", mutates_args=())
def quantize_mx(x: Tensor, fmt: str, columnwise: bool, pad: int, x_scale_inv: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """MXFP8's activation operands in one pass: :func:`quantize_tiles` with ``tile=32`` and ``transpose_c`` (``(data,
    scale_inv, data_c, scale_inv_c)``: 1x32 tiles, and 32x1 tiles along the tokens written transposed), plus the
    swizzled E8M0 scales ``F.scaled_mm`` reads for each (:func:`mx_scales` of ``scale_inv`` over ``M`` rows and of
    ``scale_inv_c`` over ``N`` rows; empty without ``columnwise``), returned as ``(data, scale_inv, hw, data_c,
    scale_inv_c, hw_c)``: no swizzle kernel per GEMM operand."""
    data, inv, data_c, inv_c = quantize_tiles(x, fmt, columnwise, pad, x_scale_inv, 32, True)
    hw = mx_scales(inv, x.shape[0], 1)
    hw_c = mx_scales(inv_c, x.shape[1], 1) if columnwise else hw.new_empty((0,))
    return data, inv, hw, data_c, inv_c, hw_c


@quantize_mx.register_fake
def _(x, fmt, columnwise, pad, x_scale_inv=None):
    m, n = x.shape
    dtype = get_format(fmt).dtype
    n_tiles = -(-n // 32)
    hw = x.new_empty((-(-m // 128) * 128 * (-(-n_tiles // 4) * 4),), dtype=torch.float8_e8m0fnu)
    if not columnwise:
        return (x.new_empty(x.shape, dtype=dtype), x.new_empty((m, -(-n // 32)), dtype=torch.float32), hw,
                x.new_empty((0, 0), dtype=dtype), x.new_empty((0, 0), dtype=torch.float32),
                x.new_empty((0,), dtype=torch.float8_e8m0fnu))
    kb_c = -(-m // 32)
    return (x.new_empty(x.shape, dtype=dtype), x.new_empty((m, -(-n // 32)), dtype=torch.float32), hw,
            x.new_empty((n, padded(m, pad)), dtype=dtype), x.new_empty((n, kb_c), dtype=torch.float32),
            x.new_empty((-(-n // 128) * 128 * (-(-kb_c // 4) * 4),), dtype=torch.float8_e8m0fnu))


# -- weights and weight gradients -----------------------------------------------------------------------------------
@custom_op("fp8lm::transpose_fp8", mutates_args=())
def transpose_fp8(payload: Tensor, scale: Tensor, pad: int) -> tuple[Tensor, Tensor]:
    """``(payload_t, 1 / scale)``: an FP8 payload's transpose (row-major, its columns padded to a multiple of ``pad``
    with zeros) and the reciprocal of its 0-d ``scale``: a tensor-wise weight's input-gradient operand and its
    ``scale_inv`` in one kernel (or a gathered activation's transpose)."""
    return _transposed(payload, pad, None, None), scale.to(torch.float32).reciprocal().reshape(())


@transpose_fp8.register_fake
def _(payload, scale, pad):
    return (payload.new_empty((payload.shape[1], padded(payload.shape[0], pad))),
            scale.new_empty((), dtype=torch.float32))


@custom_op("fp8lm::transpose_fp8_into_", mutates_args=("outs", "invs"))
def transpose_fp8_into_(payloads: list[Tensor], scales: list[Tensor], outs: list[Tensor], invs: list[Tensor]) -> None:
    """:func:`transpose_fp8` of many tensor-wise FP8 weights at once (multi-tensor: one launch), in place into the
    buffers ``outs`` (row-major ``(in, out)``) and ``invs`` (0-d) they held since the last step: an optimizer step
    refreshing the weights refreshes their input-gradient operands with them."""
    for payload, scale, out, inv in zip(payloads, scales, outs, invs):
        out.copy_(payload.t())
        inv.copy_(scale.to(torch.float32).reciprocal().reshape(inv.shape))


@transpose_fp8_into_.register_fake
def _(payloads, scales, outs, invs):
    return None


@custom_op("fp8lm::scaled_fp16", mutates_args=())
def scaled_fp16(x: Tensor, amax2: Tensor, row: Tensor | None = None, col: Tensor | None = None
                ) -> tuple[Tensor, Tensor]:
    """``(payload, scale)`` of the scaled FP16 gradient buffer of ``x * row * col`` (fp32; :func:`amax`'s ``amax2``
    of the same): scale ``power_of_two_scale(amax2[0], 65504, margin=11)`` (1.0 without a non-zero finite value),
    payload ``fp16(value * scale)`` (inf and NaN kept)."""
    values = x.to(torch.float32)
    if row is not None:
        values = values * row
    if col is not None:
        values = values * col
    scale = power_of_two_scale(amax2[0], FP16_MAX, FP16_HEADROOM_BITS, 1.0)
    return (values * scale).to(torch.float16), scale


@scaled_fp16.register_fake
def _(x, amax2, row=None, col=None):
    return x.new_empty(x.shape, dtype=torch.float16), x.new_empty((), dtype=torch.float32)


@custom_op("fp8lm::apply_scales", mutates_args=())
def apply_scales(x: Tensor, row: Tensor | None, col: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    """``(x * row * col)`` in ``out_dtype`` (fp32 arithmetic): a row-wise GEMM's scales applied to its fp32 output."""
    values = x.to(torch.float32)
    if row is not None:
        values = values * row
    if col is not None:
        values = values * col
    out = values.to(out_dtype)
    return out.clone() if out is x else out  # a custom op's output never aliases its input


@apply_scales.register_fake
def _(x, row, col, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype)


# -- collectives' epilogues ---------------------------------------------------------------------------------------------
@custom_op("fp8lm::sum_chunks", mutates_args=())
def sum_chunks(received: Tensor, chunks: int, scale_inv: Tensor, out_dtype: torch.dtype) -> Tensor:
    """``(sum_c received[c] * scale_inv)`` in ``out_dtype``: the FP8 reduce-scatter's epilogue (``received``: the
    ``chunks`` ranks' FP8 contributions to this rank's rows, stacked along dim 0, one shared 0-d ``scale_inv``),
    summed in fp32 in chunk order."""
    rows = received.shape[0] // chunks
    parts = received.view(chunks, rows, *received.shape[1:]).to(torch.float32)
    return (parts.sum(0) * scale_inv.to(torch.float32)).to(out_dtype)


@sum_chunks.register_fake
def _(received, chunks, scale_inv, out_dtype):
    return received.new_empty((received.shape[0] // chunks, *received.shape[1:]), dtype=out_dtype)


# -- per-segment scaling (the FSDP2 FP8 reduce-scatter: each FP8 weight a run of columns) ---------------------------
def _column_segments(offsets: Tensor, columns: int) -> Tensor:
    """The segment of each of ``columns`` columns from the segments' start ``offsets`` (int64, ``S + 1``, the last the
    column count): a per-column table made for the reference only (the kernels find it from ``offsets``)."""
    lengths = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=offsets.device), lengths, output_size=columns)


@custom_op("fp8lm::segment_amax", mutates_args=())
def segment_amax(x: Tensor, offsets: Tensor) -> Tensor:
    """``[amax of segment 0, ..., amax of segment S-1, non-finite flag]`` (fp32, ``S + 1``) of 2-D ``x`` whose columns
    ``offsets[s]`` to ``offsets[s + 1]`` form segment ``s`` (``offsets``: int64, ``S + 1``): each segment's largest
    finite magnitude over all rows (0 when none), and 1.0 when any value of ``x`` is inf or NaN. One read of ``x``."""
    n_segments = offsets.numel() - 1
    values = x.to(torch.float32).abs()
    column = values.nan_to_num(nan=0.0, posinf=0.0).amax(dim=0) if x.shape[0] else values.new_zeros(x.shape[1])
    out = torch.zeros(n_segments + 1, dtype=torch.float32, device=x.device)
    out[:n_segments] = out[:n_segments].scatter_reduce(0, _column_segments(offsets, x.shape[1]), column, "amax")
    out[n_segments] = (~torch.isfinite(values)).any().to(torch.float32) if x.numel() else 0.0
    return out


@segment_amax.register_fake
def _(x, offsets):
    return x.new_empty((offsets.shape[0],), dtype=torch.float32)


@custom_op("fp8lm::segment_cast", mutates_args=())
def segment_cast(x: Tensor, offsets: Tensor, amax: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """``(payload, scale_inv)``: 2-D ``x`` cast to ``fmt``, each column with its segment's power-of-two scale from
    ``amax`` (:func:`segment_amax`'s, agreed over ranks: ``S`` amaxes then the flag) and ``scale_inv`` (fp32, ``S``);
    non-finite values written as NaN. One read of ``x``."""
    f = get_format(fmt)
    scale = power_of_two_scale(amax[:-1], f.max)
    values = x.to(torch.float32)
    data = _encode(values * scale[_column_segments(offsets, x.shape[1])], torch.isfinite(values), f)
    return data, scale.reciprocal()


@segment_cast.register_fake
def _(x, offsets, amax, fmt):
    return x.new_empty(x.shape, dtype=get_format(fmt).dtype), amax.new_empty((amax.shape[0] - 1,))


@custom_op("fp8lm::segment_sum", mutates_args=())
def segment_sum(received: Tensor, offsets: Tensor, scale_inv: Tensor, amax: Tensor, divisor: float) -> Tensor:
    """fp32 ``(C,)``: the rows of ``received`` (FP8, ``(R, C)``: the ranks' contributions) decoded, summed in row
    order in fp32, times their segment's ``scale_inv``, over ``divisor`` (the number of ranks for a mean, else 1);
    all NaN when ``amax``'s flag (its last element) is set. One read of ``received``."""
    total = received.to(torch.float32).sum(dim=0) * scale_inv[_column_segments(offsets, received.shape[1])] / divisor
    return torch.where(amax[-1] > 0, torch.full_like(total, float("nan")), total)


@segment_sum.register_fake
def _(received, offsets, scale_inv, amax, divisor):
    return received.new_empty((received.shape[1],), dtype=torch.float32)


@custom_op("fp8lm::row_chunk_sum", mutates_args=())
def row_chunk_sum(received: Tensor, scale_inv: Tensor, divisor: float) -> Tensor:
    """fp32 ``(n,)``: the ``C`` rows of ``received`` (FP8, ``(C, n)``: the ranks' contributions to this rank's ``R``
    table rows of ``n // R`` elements each, laid end to end) decoded, each times its sender's power-of-two
    ``scale_inv`` of that table row (fp32, ``(C, R)``), summed in fp32 in sender order, over ``divisor`` (the number of
    ranks for a mean, else 1). A non-finite value stays NaN (its element only). One read of ``received``."""
    chunks, n = received.shape
    rows = scale_inv.shape[1]
    if n == 0:
        return received.new_empty((0,), dtype=torch.float32)
    per_element = scale_inv.to(torch.float32).repeat_interleave(n // rows, dim=1, output_size=n)
    return (received.to(torch.float32) * per_element).sum(dim=0) / divisor


@row_chunk_sum.register_fake
def _(received, scale_inv, divisor):
    return received.new_empty((received.shape[1],), dtype=torch.float32)


# -- delayed scaling: every state's step closed at once ---------------------------------------------------------------
@custom_op("fp8lm::update_scales_", mutates_args=("histories", "scales", "has_history"))
def update_scales_(histories: list[Tensor], scales: list[Tensor], has_history: list[Tensor], fmaxes: list[float],
                   margins: list[int], enabled: Tensor | None = None) -> None:
    """Close the step of every delayed-scaling state (in place, multi-tensor): each ``scale`` becomes
    ``power_of_two_scale(max of its history, fmax, margin, previous scale)``, ``has_history`` is set once a window
    holds an amax, the history rolls by one with a fresh slot 0. With a 0-d bool ``enabled`` that is False (a
    skipped step) only slot 0 is cleared: the step's amaxes are dropped, nothing else changes."""
    for history, scale, flag, fmax, margin in zip(histories, scales, has_history, fmaxes, margins):
        window = history.amax()
        new_scale = power_of_two_scale(window, fmax, margin, scale)
        new_flag = flag | (window > 0)
        rolled = torch.roll(history, 1)
        rolled[0] = 0.0
        if enabled is not None:
            dropped = history.clone()
            dropped[0] = 0.0
            new_scale = torch.where(enabled, new_scale, scale)
            new_flag = torch.where(enabled, new_flag, flag)
            rolled = torch.where(enabled, rolled, dropped)
        scale.copy_(new_scale)
        flag.copy_(new_flag)
        history.copy_(rolled)


@update_scales_.register_fake
def _(histories, scales, has_history, fmaxes, margins, enabled=None):
    return None


# -- MX scales in the hardware layout --------------------------------------------------------------------------------
@custom_op("fp8lm::mx_scales", mutates_args=())
def mx_scales(grid: Tensor, rows: int, repeat: int) -> Tensor:
    """The E8M0 scales an MXFP8 GEMM operand hands ``F.scaled_mm``, in one pass: ``grid`` (fp32 power-of-two
    ``scale_inv``, ``(ceil(rows / repeat), K / 32)``, any strides: one row per ``repeat`` operand rows, e.g. a 32x32
    weight block's row serves 32 rows) repeated to ``rows`` rows, each value's exponent byte (E8M0, exact), laid out in
    cuBLAS's swizzled 128 x 4 tiles with zero padding (:func:`fp8.microscaling.swizzle`). 1-D ``float8_e8m0fnu``."""
    full = grid.to(torch.float32).repeat_interleave(repeat, dim=0)[:rows] if repeat > 1 else grid.to(torch.float32)
    bits = ((full.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    kb = bits.shape[1]
    pr, pk = -(-rows // 128) * 128, -(-kb // 4) * 4
    padded_bits = bits.new_zeros((pr, pk))
    padded_bits[:rows, :kb] = bits
    tiles = padded_bits.reshape(pr // 128, 4, 32, pk // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(torch.float8_e8m0fnu)


@mx_scales.register_fake
def _(grid, rows, repeat):
    kb = grid.shape[1]
    return grid.new_empty((-(-rows // 128) * 128 * (-(-kb // 4) * 4),), dtype=torch.float8_e8m0fnu)


def _unswizzled_exp2(flat: Tensor, rows: int, kb: int) -> Tensor:
    """fp32 ``2 ** (e - 127)`` of the ``(rows, kb)`` E8M0 scales in a swizzled 1-D layout (:func:`mx_scales`)."""
    pr, pk = -(-rows // 128) * 128, -(-kb // 4) * 4
    tiles = flat.view(torch.uint8).reshape(pr // 128, pk // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    e = tiles.reshape(pr, pk)[:rows, :kb].to(torch.int32)
    return (e << 23).view(torch.float32)  # the exponent byte as an fp32 power of two (exact)


@custom_op("fp8lm::mx_mm", mutates_args=())
def mx_mm(a: Tensor, b: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype) -> Tensor:
    """The MXFP8 GEMM ``a @ b`` (E4M3 ``a`` M x K, ``b`` K x N) with the swizzled E8M0 scales ``F.scaled_mm`` takes
    (one per 32 along K): the hardware call's reference, where ``F.scaled_mm`` has no MX kernel (the CPU with
    ``gemm_backend="scaled_mm"``: the GPU's op sequence, counted). Each operand times its scales (exact), an fp32
    matmul: bit-identical to the emulated GEMM."""
    m, k = a.shape
    n = b.shape[1]
    sa = _unswizzled_exp2(scale_a, m, k // 32).repeat_interleave(32, dim=1)
    sb = _unswizzled_exp2(scale_b, n, k // 32).repeat_interleave(32, dim=1).t()
    return torch.mm(a.to(torch.float32) * sa, b.to(torch.float32) * sb).to(out_dtype)


@mx_mm.register_fake
def _(a, b, scale_a, scale_b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


# -- the block-scaled GEMM -------------------------------------------------------------------------------------------
@custom_op("fp8lm::block_mm", mutates_args=())
def block_mm(a: Tensor, a_scale_inv: Tensor, a_block: list[int], b: Tensor, b_scale_inv: Tensor, b_block: list[int],
             out_dtype: torch.dtype) -> Tensor:
    """``a @ b`` of FP8 payloads whose ``scale_inv`` grids vary along K in 128-element blocks (``a``: 1x128 tiles;
    ``b``: 128x128 blocks or 128x1 tiles), accumulated in fp32 one K block at a time (each block's FP8 dot product
    times its two ``scale_inv``), in ``out_dtype``; any strides."""
    m, k = a.shape
    n = b.shape[1]
    b_inv = b_scale_inv.to(torch.float32).repeat_interleave(b_block[1], dim=1)[:, :n]
    acc = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    for kb in range(k // TILE):
        ks = slice(kb * TILE, (kb + 1) * TILE)
        dot = a[:, ks].to(torch.float32) @ b[ks, :].to(torch.float32)
        acc = acc + dot * (a_scale_inv[:, kb, None].to(torch.float32) * b_inv[None, kb, :])
    return acc.to(out_dtype)


@block_mm.register_fake
def _(a, a_scale_inv, a_block, b, b_scale_inv, b_block, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


# -- CUDA: the Triton kernels (imported when a CUDA op first runs) ----------------------------------------------------
def _triton():
    from .kernels import triton_quantize

    return triton_quantize


@amax.register_kernel("cuda")
def _(x, row=None, col=None):
    return _triton().launch_amax(x, row, col)


@cast_transpose.register_kernel("cuda")
def _(x, scale, amax_slot, fmt, transpose, pad, record, dst_cols=None, out_t=None):
    return _triton().launch_cast_transpose(x, scale.reshape(()), None, None, amax_slot, get_format(fmt).dtype, 0,
                                           transpose, pad, record, dst_cols, out_t)


@cast_transpose_from_amax.register_kernel("cuda")
def _(x, amax2, previous, amax_slot, fmt, margin, transpose, pad, record, dst_cols=None, out_t=None):
    return _triton().launch_cast_transpose(x, None, amax2, previous.reshape(()), amax_slot, get_format(fmt).dtype,
                                           margin, transpose, pad, record, dst_cols, out_t)


@quantize_rows.register_kernel("cuda")
def _(x, fmt, x_scale_inv=None):
    return _triton().launch_quantize_rows(x, get_format(fmt).dtype, x_scale_inv)


@quantize_cols_t.register_kernel("cuda")
def _(x, fmt, pad, x_scale_inv=None):
    return _triton().launch_quantize_cols_t(x, get_format(fmt).dtype, pad, x_scale_inv)


@quantize_tiles.register_kernel("cuda")
def _(x, fmt, columnwise, pad, x_scale_inv=None, tile=TILE, transpose_c=False):
    return _triton().launch_quantize_tiles(x, get_format(fmt).dtype, columnwise, pad, x_scale_inv, tile, transpose_c)


@quantize_mx.register_kernel("cuda")
def _(x, fmt, columnwise, pad, x_scale_inv=None):
    return _triton().launch_quantize_mx(x, get_format(fmt).dtype, columnwise, pad, x_scale_inv)


@transpose_fp8.register_kernel("cuda")
def _(payload, scale, pad):
    return _triton().launch_transpose_fp8(payload, scale, pad)


@scaled_fp16.register_kernel("cuda")
def _(x, amax2, row=None, col=None):
    return _triton().launch_scaled_fp16(x, amax2, row, col)


@apply_scales.register_kernel("cuda")
def _(x, row, col, out_dtype):
    return _triton().launch_apply_scales(x, row, col, out_dtype)


@update_scales_.register_kernel("cuda")
def _(histories, scales, has_history, fmaxes, margins, enabled=None):
    if histories:
        _triton().launch_update_scales(histories, scales, has_history, fmaxes, margins, enabled)


@mx_scales.register_kernel("cuda")
def _(grid, rows, repeat):
    return _triton().launch_mx_scales(grid, rows, repeat)


@block_mm.register_kernel("cuda")
def _(a, a_scale_inv, a_block, b, b_scale_inv, b_block, out_dtype):
    from .kernels.triton_block_gemm import block_mm_inverse

    return block_mm_inverse(a, a_scale_inv, tuple(a_block), b, b_scale_inv, tuple(b_block), out_dtype)


@sum_chunks.register_kernel("cuda")
def _(received, chunks, scale_inv, out_dtype):
    return _triton().launch_sum_chunks(received, chunks, scale_inv, out_dtype)


@row_chunk_sum.register_kernel("cuda")
def _(received, scale_inv, divisor):
    return _triton().launch_row_chunk_sum(received, scale_inv, divisor)


@segment_amax.register_kernel("cuda")
def _(x, offsets):
    return _triton().launch_segment_amax(x, offsets)


@segment_cast.register_kernel("cuda")
def _(x, offsets, amax, fmt):
    return _triton().launch_segment_cast(x, offsets, amax, get_format(fmt).dtype)


@segment_sum.register_kernel("cuda")
def _(received, offsets, scale_inv, amax, divisor):
    return _triton().launch_segment_sum(received, offsets, scale_inv, amax, divisor)


@transpose_fp8_into_.register_kernel("cuda")
def _(payloads, scales, outs, invs):
    if payloads:
        _triton().launch_transpose_fp8_into(payloads, scales, outs, invs)
