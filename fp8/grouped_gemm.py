"""FP8 grouped linear: one GEMM per group of consecutive rows, each group with its own FP8 weight (MoE experts).

``x`` holds the tokens sorted by group (expert): rows ``offsets[g-1]:offsets[g]`` belong to group ``g``, and
``y[rows of g] = x[rows of g] @ W_g^T``. :class:`GroupedLinearFunction` runs the one FP8 linear core of
:mod:`fp8.linear` (:func:`fp8.linear.linear_forward` / :func:`~fp8.linear.linear_backward`) with a
:class:`fp8.linear.Groups`: the recipe's quantizers (:mod:`fp8.quantizers`) cast the input once for all groups (one
scaling state per projection under ``tensorwise``, as one linear reads one tensor; per-token scales under
``rowwise``/``blockwise``, whatever group a token is in), each weight an FP8 :class:`fp8.Float8Tensor` with its own
scales, the output gradient cast once, fp32 accumulation in all three passes; each group's weight-gradient operands
are its own (made from its rows, the tokens padded to the GEMM's multiple, so no expert GEMM is emulated whatever its
token count), the weight gradients held per ``Float8LinearConfig.grad_accumulation``.

Forward GEMM (:func:`grouped_forward`): ``torch._scaled_grouped_mm`` (E4M3 x E4M3 tensor-wise, bfloat16 output) on a
CUDA GPU of compute capability >= 9.0, with the experts' weights stacked once per optimizer step (kept with the first
expert's weight, :func:`fp8.tensor.cached_operand`, never restacked per forward); elsewhere one FP8 GEMM per group.
The input-gradient and weight-gradient GEMMs run one per group (:func:`fp8.gemm.mm`); each expert's transposed weight
is kept once per optimizer step as a dense linear's is.

:func:`grouped_mm_reference` is the float64 oracle of tests.
"""

from __future__ import annotations

import torch

from .gemm import Operand, fp8_mm_payload, mm
from .linear import NO_HOOKS, Float8LinearConfig, Groups, group_bounds, linear_backward, linear_forward
from .scaling import ScalingState
from .tensor import Float8Tensor, cached_operand

__all__ = ["grouped_fp8_mm", "grouped_mm_problem", "grouped_mm_reference", "GroupedLinearFunction", "group_bounds",
           "scaled_grouped_mm", "GroupedBlockLinearFunction", "grouped_forward"]


def grouped_mm_problem(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, backend: str) -> str | None:
    """Why ``torch._scaled_grouped_mm`` cannot run a grouped GEMM of ``a`` (FP8 rows) and ``b`` (one group's FP8 weight)
    writing ``out_dtype``, or None."""
    if backend == "emulated":
        return "gemm_backend='emulated'"
    if a.dtype is not torch.float8_e4m3fn or b.dtype is not torch.float8_e4m3fn:
        return f"torch._scaled_grouped_mm multiplies E4M3 operands only, not {a.dtype} x {b.dtype}"
    if a.device.type != "cuda":
        return f"{a.device} is not a CUDA GPU"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    if torch.cuda.get_device_capability(a.device) < (9, 0):
        return "torch._scaled_grouped_mm needs compute capability >= 9.0 (H100/H200)"
    if out_dtype is not torch.bfloat16:
        return f"torch._scaled_grouped_mm writes bfloat16, not {out_dtype}"
    return None


def grouped_fp8_mm(a: torch.Tensor, a_scale: torch.Tensor, b: list[torch.Tensor], b_scales: torch.Tensor,
                   offsets: torch.Tensor, sizes: list[int], out_dtype: torch.dtype, backend: str = "auto") -> torch.Tensor:
    """``cat_g(a[rows of g] @ b[g])``: ``a`` an FP8 payload (rows sorted by group) with its 0-d scale, ``b`` one FP8
    payload per group (K x N) with ``b_scales[g]`` its 0-d scale (value = payload / scale, as everywhere in fp8),
    ``offsets`` the groups' cumulative ends (int32, on ``a``'s device), ``sizes`` the same on the host.
    Rows past ``offsets[-1]`` are not part of any group and get no output row."""
    if len(b) != len(sizes) or b_scales.shape != (len(sizes),):
        raise ValueError(f"grouped_fp8_mm: {len(sizes)} groups but {len(b)} weights and scales of shape "
                         f"{tuple(b_scales.shape)}; pass one weight and one 0-d scale per group")
    n_rows = sum(sizes)
    if n_rows and grouped_mm_problem(a, b[0], out_dtype, backend) is None:
        return scaled_grouped_mm(a[:n_rows], a_scale, b, b_scales, offsets, out_dtype)
    outs = [fp8_mm_payload(a[start:end], a_scale, w, w_scale, out_dtype, backend)
            for (start, end), w, w_scale in zip(group_bounds(sizes), b, b_scales.unbind(0))]
    if not outs:
        return a.new_empty((0, 0), dtype=out_dtype)
    return torch.cat(outs)


def scaled_grouped_mm(a: torch.Tensor, a_scale: torch.Tensor, b: list[torch.Tensor], b_scales: torch.Tensor,
                      offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The ``torch._scaled_grouped_mm`` call of :func:`grouped_fp8_mm` (all rows of ``a`` in groups): ``a`` row-major,
    the weights stacked (G, K, N) column-major per group, the tensor-wise scales broadcast to its row-wise
    dequantization scales (the reciprocals: ``a`` per row, each group's weight per column)."""
    mat_b, scale_b = _stack(b, b_scales.reciprocal())
    scale_a = a_scale.reciprocal().reshape(1).expand(a.shape[0]).contiguous()
    return torch._scaled_grouped_mm(a.contiguous(), mat_b, scale_a, scale_b, offs=offsets, out_dtype=out_dtype)


def _stack(b: list[torch.Tensor], inverses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The grouped GEMM's second operand: the (K x N) payloads stacked (G, K, N), each column-major, and their
    per-column ``scale_inv`` (G, N)."""
    n = b[0].shape[1]
    mat_b = torch.stack([w.t() for w in b]).transpose(-2, -1)
    return mat_b, inverses.reshape(-1, 1).expand(len(b), n).contiguous()


def grouped_mm_reference(a: torch.Tensor, b: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """The float64 grouped product ``cat_g(a[rows of g] @ b[g])`` of high-precision operands (a test oracle)."""
    return torch.cat([a[start:end].double() @ w.double() for (start, end), w in zip(group_bounds(sizes), b)])


def grouped_forward(rows: Operand, weights: list[Float8Tensor], sizes: list[int], offsets: torch.Tensor | None,
                    weight_quantizer, out_dtype: torch.dtype, backend: str, held) -> torch.Tensor:
    """The forward GEMM of all groups (:class:`fp8.linear.Groups`): ``torch._scaled_grouped_mm`` where it runs (the
    weights' stack kept once per optimizer step with the first weight), else one FP8 GEMM per group."""
    if (rows.block is None and offsets is not None and sum(sizes)
            and grouped_mm_problem(rows.data, weights[0].payload, out_dtype, backend) is None):
        first = held[0] if held else None
        others = tuple((w._version, w.payload._version, w.scale._version) for w in weights[1:]) if held else ()
        stacked = cached_operand(first, weights[0].payload, weights[0].scale, ("grouped stack", len(weights), others),
                                 lambda: _stack([w.payload.t() for w in weights],
                                                torch.stack([w.scale for w in weights]).reciprocal()))
        scale_a = rows.scale_inv.reshape(1).expand(rows.data.shape[0]).contiguous()
        return torch._scaled_grouped_mm(rows.data, stacked[0], scale_a, stacked[1], offs=offsets, out_dtype=out_dtype)
    outs = [mm(Operand(rows.data[start:end], rows.scale_inv if rows.scale_inv.dim() == 0 else rows.scale_inv[start:end],
                       rows.block, global_scale_inv=rows.global_scale_inv),
               weight_quantizer.forward_b(w.payload, w.scale, w, backend), out_dtype, backend)
            if end > start else rows.data.new_empty((0, w.shape[0]), dtype=out_dtype)  # no token: no GEMM
            for (start, end), w in zip(group_bounds(sizes), weights)]
    if not outs:
        return rows.data.new_empty((0, weights[0].shape[0] if weights else 0), dtype=out_dtype)
    return torch.cat(outs)


def _check_groups(x: torch.Tensor, sizes: list[int], weights, name: str) -> None:
    if len(weights) != len(sizes) or x.dim() != 2 or x.shape[0] != sum(sizes):
        raise ValueError(f"{name}: x of shape {tuple(x.shape)}, {len(weights)} weights and groups of {list(sizes)} "
                         f"rows; pass the 2-D tokens sorted by group and one weight per group")
    if not all(isinstance(w, Float8Tensor) for w in weights):
        raise TypeError(f"{name}: every weight must be a Float8Tensor; assign through fp8.to_float8")


class GroupedLinearFunction(torch.autograd.Function):
    """``y[rows of g] = x[rows of g] @ W_g^T`` for every group g: the FP8 linear core (module docstring), any recipe.

    ``apply(x, offsets, sizes, input_state, grad_output_state, config, record, dtype, *weights)``: ``x`` (T x K) sorted
    by group, ``offsets`` the groups' cumulative ends (int32, on the device) and ``sizes`` their row counts on the
    host, ``weights`` one FP8 :class:`fp8.Float8Tensor` (N x K) per group, ``record`` whether the input's amax enters
    its history (tensor-wise), ``dtype`` the compute dtype."""

    @staticmethod
    def forward(ctx, x, offsets, sizes, input_state: ScalingState, grad_output_state: ScalingState,
                config: Float8LinearConfig, record, dtype, *weights):
        _check_groups(x, sizes, weights, "GroupedLinearFunction")
        ctx.weight_inputs = tuple(range(8, 8 + len(weights)))
        return linear_forward(ctx, x, list(weights), None, input_state, grad_output_state, config, record, dtype,
                              NO_HOOKS, Groups(list(sizes), offsets, grouped_forward))

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_ws, _ = linear_backward(ctx, grad_out)
        return (grad_x, None, None, None, None, None, None, None, *grad_ws)


class GroupedBlockLinearFunction(torch.autograd.Function):
    """:class:`GroupedLinearFunction` for the ``rowwise``/``blockwise`` recipes (current per-block scales: no scaling
    state). ``apply(x, sizes, config, dtype, *weights)``."""

    @staticmethod
    def forward(ctx, x, sizes, config: Float8LinearConfig, dtype, *weights):
        if config.recipe_spec.tensorwise:
            raise ValueError("GroupedBlockLinearFunction runs the rowwise/blockwise recipes; the tensorwise recipe is "
                             "GroupedLinearFunction's")
        _check_groups(x, sizes, weights, "GroupedBlockLinearFunction")
        ctx.weight_inputs = tuple(range(4, 4 + len(weights)))
        return linear_forward(ctx, x, list(weights), None, None, None, config, True, dtype, NO_HOOKS,
                              Groups(list(sizes), None, grouped_forward))

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_ws, _ = linear_backward(ctx, grad_out)
        return (grad_x, None, None, None, *grad_ws)

