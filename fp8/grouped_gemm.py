"""FP8 grouped GEMM: one GEMM per group of consecutive rows, each group with its own FP8 weight (MoE experts).

``x`` holds the tokens sorted by group (expert): rows ``offsets[g-1]:offsets[g]`` belong to group ``g``, and
``y[rows of g] = x[rows of g] @ W_g^T``. The recipe is :class:`fp8.linear.Float8LinearFunction`'s tensor-wise one,
per group: the input cast once to E4M3 with its delayed scale (one :class:`fp8.scaling.ScalingState` for all groups,
as one linear reads one tensor), each weight an E4M3 :class:`fp8.Float8Tensor` with its own (per-expert) current
power-of-two scale, the output gradient cast once to E5M2 with its transpose, fp32 accumulation in all three passes,
weight gradients held per ``Float8LinearConfig.grad_accumulation`` (:func:`fp8.linear.weight_grad`).

Paths (:func:`grouped_fp8_mm`):

- ``torch._scaled_grouped_mm`` for the forward GEMM (E4M3 x E4M3; it takes no E5M2 operand) on a CUDA GPU of compute
  capability >= 9.0 with bfloat16 output (:func:`grouped_mm_problem` says why not elsewhere); its per-row /
  per-column dequantization scales are the tensor-wise ones broadcast, so it computes what the per-group path
  computes (its call is checked against torch's meta kernel on CPU; not yet run on a GPU).
- elsewhere, for the E5M2 input-gradient GEMM and for the weight gradients (fp32 output), the repo's FP8 GEMM (:func:`fp8.gemm.fp8_mm_payload`) on
  each group's slice: on the CPU the exact emulation. Slicing needs the group sizes on the host: the caller reads
  them once per layer and passes them in (``sizes``), so no GEMM reads the device.

:class:`GroupedBlockLinearFunction` is the same grouped linear under the ``rowwise``/``blockwise`` recipes
(:mod:`fp8.recipes`): the input and the output gradient cast once for all groups in their per-token blocks (a row,
or 1x128 tiles: each token's scales are its own, whatever group it is in), each group's GEMMs those of
:class:`fp8.linear.Float8LinearFunction` on the group's rows (:func:`fp8.gemm.fp8_mm_payload`, one call per group and
pass), the operands whose blocks span tokens (the weight gradient's) quantized per group.

:func:`grouped_mm_reference` is the float64 oracle of tests.
"""

from __future__ import annotations

import torch

from .blocks import dequantize_blocks, quantize_to_blocks, transpose_block
from .cast import quantize
from .gemm import fp8_mm_payload
from .linear import Float8LinearConfig, weight_grad
from .scaling import ScalingState
from .tensor import Float8Tensor

__all__ = ["grouped_fp8_mm", "grouped_mm_problem", "grouped_mm_reference", "GroupedLinearFunction", "group_bounds",
           "scaled_grouped_mm", "GroupedBlockLinearFunction"]


def group_bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """``[(start, end)]`` row ranges of groups of these sizes, in order."""
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


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
    n = b[0].shape[1]
    mat_b = torch.stack([w.t() for w in b]).transpose(-2, -1)
    scale_a = a_scale.reciprocal().reshape(1).expand(a.shape[0]).contiguous()
    scale_b = b_scales.reciprocal().reshape(-1, 1).expand(len(b), n).contiguous()
    return torch._scaled_grouped_mm(a.contiguous(), mat_b, scale_a, scale_b, offs=offsets, out_dtype=out_dtype)


def grouped_mm_reference(a: torch.Tensor, b: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """The float64 grouped product ``cat_g(a[rows of g] @ b[g])`` of high-precision operands (a test oracle)."""
    return torch.cat([a[start:end].double() @ w.double() for (start, end), w in zip(group_bounds(sizes), b)])


class GroupedLinearFunction(torch.autograd.Function):
    """``y[rows of g] = x[rows of g] @ W_g^T`` for every group g, the FP8 recipe of the module docstring.

    ``apply(x, offsets, sizes, input_state, grad_output_state, config, record, dtype, *weights)``: ``x`` (T x K) sorted
    by group, ``offsets``/``sizes`` as in :func:`grouped_fp8_mm`, ``weights`` one E4M3 :class:`fp8.Float8Tensor`
    (N x K) per group, ``record`` whether the input's amax enters its history, ``dtype`` the compute dtype."""

    @staticmethod
    def forward(ctx, x, offsets, sizes, input_state: ScalingState, grad_output_state: ScalingState,
                config: Float8LinearConfig, record, dtype, *weights):
        if not config.recipe_spec.tensorwise:
            raise ValueError(f"the FP8 grouped GEMM runs the tensorwise recipe, not {config.recipe!r}")
        if not all(isinstance(w, Float8Tensor) for w in weights):
            raise TypeError("GroupedLinearFunction: every weight must be a Float8Tensor; assign through fp8.to_float8")
        if x.dim() != 2 or x.shape[0] != sum(sizes):
            raise ValueError(f"GroupedLinearFunction: x of shape {tuple(x.shape)} for groups of {sum(sizes)} rows in all; "
                             f"pass the 2-D tokens sorted by group, exactly the groups' rows")
        x2d = x.to(dtype)
        x_scale = input_state.scale_for(x2d, record=record)
        x_data = quantize(x2d, x_scale, input_state.format)
        w_data = [w.payload for w in weights]
        w_scales = torch.stack([w.scale for w in weights])
        out = grouped_fp8_mm(x_data, x_scale, [w.t() for w in w_data], w_scales, offsets, sizes, dtype,
                             config.gemm_backend)
        ctx.save_for_backward(x_data, x_scale, offsets, w_scales, *w_data)
        ctx.sizes, ctx.grad_output_state, ctx.config = sizes, grad_output_state, config
        ctx.weight_dtypes = [w.dtype for w in weights]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_data, x_scale, offsets, w_scales, *w_data = ctx.saved_tensors
        config, sizes = ctx.config, ctx.sizes
        g_data, g_data_t, g_scale = ctx.grad_output_state.quantize_transpose(grad_out.contiguous())
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_fp8_mm(g_data, g_scale, w_data, w_scales, offsets, sizes, grad_out.dtype,
                                    config.gemm_backend)
        grad_ws = [None] * len(w_data)
        for g, ((start, end), w_scale) in enumerate(zip(group_bounds(sizes), w_scales.unbind(0))):
            if ctx.needs_input_grad[8 + g]:
                grad_w32 = fp8_mm_payload(g_data_t[:, start:end], g_scale, x_data[start:end], x_scale, torch.float32,
                                          config.gemm_backend)
                grad_ws[g] = weight_grad(grad_w32, config, ctx.weight_dtypes[g])
        return (grad_x, None, None, None, None, None, None, None, *grad_ws)


def _grid_t(scale: torch.Tensor) -> torch.Tensor:
    """The scale grid of a transposed operand (a 0-d scale is itself)."""
    return scale.t() if scale.dim() == 2 else scale


class GroupedBlockLinearFunction(torch.autograd.Function):
    """``y[rows of g] = x[rows of g] @ W_g^T`` for every group g under the ``rowwise``/``blockwise`` recipes (module
    docstring): per group, the three GEMMs of :class:`fp8.linear.Float8LinearFunction` with no hooks, bit for bit.

    ``apply(x, sizes, config, dtype, *weights)``: ``x`` (T x K) sorted by group, ``sizes`` the groups' rows on the
    host (summing to T), ``config`` a :class:`fp8.linear.Float8LinearConfig` of a block recipe, ``dtype`` the compute
    dtype, ``weights`` one FP8 :class:`fp8.Float8Tensor` (N x K) per group, in the recipe's weight blocks. Current
    scales only (no scaling state); weight gradients held per ``config.grad_accumulation``."""

    @staticmethod
    def forward(ctx, x, sizes, config: Float8LinearConfig, dtype, *weights):
        recipe = config.recipe_spec
        if recipe.tensorwise:
            raise ValueError("GroupedBlockLinearFunction runs the rowwise/blockwise recipes; the tensorwise recipe is "
                             "GroupedLinearFunction's")
        if not all(isinstance(w, Float8Tensor) for w in weights):
            raise TypeError("GroupedBlockLinearFunction: every weight must be a Float8Tensor; assign through "
                            "fp8.to_float8")
        if len(weights) != len(sizes) or x.dim() != 2 or x.shape[0] != sum(sizes):
            raise ValueError(f"GroupedBlockLinearFunction: x of shape {tuple(x.shape)}, {len(weights)} weights and "
                             f"groups of {list(sizes)} rows; pass the 2-D tokens sorted by group and one weight per group")
        x_data, x_scale = quantize_to_blocks(x.to(dtype), recipe.input, "e4m3")  # per token: any group split holds
        outs = [fp8_mm_payload(x_data[start:end], x_scale[start:end], w.payload.t(), _grid_t(w.scale), dtype,
                               config.gemm_backend, a_block=recipe.input, b_block=transpose_block(w.block))
                for (start, end), w in zip(group_bounds(sizes), weights)]
        out = torch.cat(outs) if outs else x.new_empty((0, 0), dtype=dtype)
        ctx.save_for_backward(x_data, x_scale, *(w.payload for w in weights), *(w.scale for w in weights))
        ctx.sizes, ctx.config = list(sizes), config
        ctx.w_blocks = [w.block for w in weights]
        ctx.weight_dtypes = [w.dtype for w in weights]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_data, x_scale, *saved = ctx.saved_tensors
        n = len(ctx.sizes)
        w_data, w_scales = saved[:n], saved[n:]
        config, recipe = ctx.config, ctx.config.recipe_spec
        backend = config.gemm_backend
        g_data, g_scale = quantize_to_blocks(grad_out.contiguous(), recipe.grad_output, recipe.grad_fmt)  # per token
        dxs, grad_ws = [], [None] * n
        for g, (start, end) in enumerate(group_bounds(ctx.sizes)):
            gd, gs = g_data[start:end], g_scale[start:end]
            if ctx.needs_input_grad[0]:
                wd, ws = w_data[g], w_scales[g]
                if recipe.dgrad_weight != ctx.w_blocks[g]:  # re-quantized from its exact values (fp8.recipes)
                    wd, ws = quantize_to_blocks(dequantize_blocks(wd, ws, ctx.w_blocks[g]), recipe.dgrad_weight,
                                                config.weight_fmt)
                dxs.append(fp8_mm_payload(gd, gs, wd, ws, grad_out.dtype, backend, a_block=recipe.grad_output,
                                          b_block=recipe.dgrad_weight))
            if ctx.needs_input_grad[4 + g] and start == end:  # no token: a zero gradient, no empty GEMM
                grad_ws[g] = weight_grad(x_data.new_zeros((w_data[g].shape[0], x_data.shape[1]), dtype=torch.float32),
                                         config, ctx.weight_dtypes[g])
            elif ctx.needs_input_grad[4 + g]:
                # blocks along the tokens: this group's own (as the expert's linear would cast them)
                gt_data, gt_scale = quantize_to_blocks(dequantize_blocks(gd, gs, recipe.grad_output),
                                                       recipe.wgrad_grad_output, recipe.grad_fmt)
                xw_data, xw_scale = quantize_to_blocks(
                    dequantize_blocks(x_data[start:end], x_scale[start:end], recipe.input), recipe.wgrad_input, "e4m3")
                grad_w32 = fp8_mm_payload(gt_data.t(), gt_scale.t(), xw_data, xw_scale, torch.float32, backend,
                                          a_block=transpose_block(recipe.wgrad_grad_output), b_block=recipe.wgrad_input)
                grad_ws[g] = weight_grad(grad_w32, config, ctx.weight_dtypes[g])
        grad_x = torch.cat(dxs) if ctx.needs_input_grad[0] and dxs else None
        return (grad_x, None, None, None, *grad_ws)
