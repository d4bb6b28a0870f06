"""FP8 linear layer: FP8 weights, FP8 activations, FP8 GEMMs in all three passes, FP8 weight gradients.

The recipe below is :class:`Float8LinearFunction`, the one autograd function that :class:`Float8Linear`
and the FP8 tensor/sequence-parallel linears (:mod:`fp8.parallel.linear`) run; the parallel layers pass
their collectives in as :class:`LinearHooks`.

Forward: input cast to E4M3 (its own scaling state), weight held as an E4M3 :class:`Float8Tensor`,
``y = x @ W^T`` in FP8 with fp32 accumulation, bias added in high precision.
Backward: output gradient cast to E5M2 (its own scaling state, quantized once with its transpose),
``dX = dY @ W`` and ``dW = dY^T @ X`` in FP8 with fp32 accumulation.

Weight gradients over micro-batches (``Float8LinearConfig.grad_accumulation``):

- ``"fp16"`` (default): the weight's ``.grad`` is a :class:`fp8.ScaledFloat16Tensor`, an FP16 buffer (2 bytes per
  element) with a power-of-two scale chosen on the device: the first micro-batch's amax sits ``2**11`` below the
  FP16 maximum, and the scale is lowered by a power of two (exact) only when a sum would overflow. Each further
  micro-batch is added in fp32 and the sum rounded once to FP16 (11 significant bits), so the accumulated
  gradient stays within the one-micro-batch FP8 error at 1,536 micro-batches (``benchmarks/grad_accumulation.py``).
  The FP8 weight reports dtype float32 (it stands for its fp32 master), whatever the model's dtype. The FP8
  data-parallel reductions (:class:`fp8.distributed.DistributedDataParallel`, O3) quantize the sum once to E4M3
  for the wire and leave an E4M3 :class:`Float8Tensor` gradient.
- ``"fp32"``: ``dW`` leaves the GEMM in fp32 and is the weight's ``.grad`` as a plain fp32 tensor; autograd sums
  the micro-batches in fp32 (4 bytes per weight element while gradients are held). Reductions as for ``"fp16"``.
- ``"fp8"``: ``dW`` is stored as an E4M3 :class:`Float8Tensor` (1 byte per element) with its own current
  power-of-two scale; each further micro-batch is added in fp32 and the sum re-rounded to E4M3, so
  contributions smaller than half an E4M3 step of the running sum are lost (measured: relative error
  0.10 at 32 micro-batches, 0.51 at 128; ``benchmarks/grad_accumulation.py``). For one or a few micro-batches.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from . import ops
from .blocks import dequantize_blocks
from .formats import get_format
from .eligibility import fp8_dims_problem
from .gemm import GEMM_BACKENDS, Operand, mm
from .kernels.backend import KERNEL_BACKENDS
from .quantizers import observe_cast
from .recipes import RECIPES, Recipe, get_recipe
from .scaled_fp16 import ScaledFloat16Tensor
from .scaling import ScalingConfig, ScalingState
from .tensor import Float8Tensor, to_float8

logger = logging.getLogger(__name__)

__all__ = [
    "Float8LinearConfig", "Float8Linear", "Float8LinearFunction", "LinearHooks", "NO_HOOKS", "InputCasts", "fp8_dims_problem",
    "GRAD_ACCUMULATION", "weight_grad", "group_bounds", "Groups", "linear_forward", "linear_backward",
]

GRAD_ACCUMULATION = ("fp16", "fp32", "fp8")
"""Values of ``Float8LinearConfig.grad_accumulation``: how FP8 weight gradients are held and summed."""


def _default_input() -> ScalingConfig:
    return ScalingConfig(fmt="e4m3", kind="delayed")


def _default_grad_output() -> ScalingConfig:
    return ScalingConfig(fmt="e5m2", kind="delayed")


@dataclass(frozen=True)
class Float8LinearConfig:
    """Formats and scaling of an FP8 linear's tensor roles, and its GEMM backend.

    ``input`` and ``grad_output`` are scaled per :class:`ScalingConfig` (delayed by default, history
    16); the weight (``weight_fmt``) is re-quantized from its master copy with a current scale after
    every optimizer step; the weight gradient (``weight_grad_fmt``) gets a current scale from its
    amax. ``gemm_backend`` is one of ``"auto"``, ``"scaled_mm"``, ``"emulated"``.
    ``grad_accumulation`` (``"fp16"``, ``"fp32"`` or ``"fp8"``) says how weight gradients are held and summed over
    micro-batches (module docstring): ``"fp16"``, the default, holds 2 bytes per weight element (a scaled FP16
    buffer) and stays within the one-micro-batch FP8 error at 1,536 micro-batches; ``"fp32"`` is exact to fp32
    rounding for 4 bytes; ``"fp8"`` holds 1 byte but loses accuracy past a few micro-batches.
    ``accumulate_backend`` (``"auto"``, ``"torch"``, ``"triton"``) is the kernel backend of adds into the
    FP8 weight and its FP8 gradient (:attr:`Float8Tensor.accumulate_backend`, carried by those tensors):
    ``"auto"`` runs Triton for CUDA tensors and the torch reference elsewhere.
    ``recipe`` (:data:`fp8.recipes.RECIPES`) is the granularity of the scales: ``"tensorwise"`` (the
    default: ``input``/``grad_output`` scaling as configured), ``"rowwise"`` or ``"blockwise"`` (current
    per-row / per-block scales, E4M3 everywhere; :mod:`fp8.recipes`).
    """

    input: ScalingConfig = field(default_factory=_default_input)
    grad_output: ScalingConfig = field(default_factory=_default_grad_output)
    weight_fmt: str = "e4m3"
    weight_grad_fmt: str = "e4m3"
    gemm_backend: str = "auto"
    grad_accumulation: str = "fp16"
    accumulate_backend: str = "auto"
    recipe: str = "tensorwise"
    fp4_hadamard: bool = True
    fp4_stochastic_rounding: bool = True
    high_precision_forward: bool = False
    """The forward GEMM in the model's dtype on the weight's values (``x @ W^T``, W dequantized from its FP8/NVFP4
    form at rest), the backward GEMMs in the recipe's formats as before: NVIDIA's NVFP4 recipe for the last part of
    training (:func:`fp8.convert.set_high_precision_forward` switches a model; ``--fp4-bf16-forward-from-iteration``).
    The input is still quantized for the weight-gradient GEMM (its column-wise operand only)."""
    high_precision: bool = False
    """All three GEMMs in high precision on the weight's values (W dequantized from its FP8 form at rest: exact in
    bf16): the forward ``x @ W^T`` and the input gradient in the model's dtype, the weight gradient ``dY^T @ X`` in
    fp32, held per ``grad_accumulation`` as before; nothing about the activations or output gradients is quantized
    (the input is saved for backward in the model's dtype: 2 bytes per element in bf16, where the FP8 recipe saves 1).
    The weight stays FP8 at rest and its optimizer unchanged. The last rung of automatic fallback
    (:mod:`fp8.fallback`) and the whole-linear mode of scheduled precision (:func:`fp8.convert.set_high_precision`)."""

    @property
    def recipe_spec(self) -> Recipe:
        """The :class:`fp8.recipes.Recipe` named by ``recipe`` (``nvfp4``: with ``fp4_hadamard`` and
        ``fp4_stochastic_rounding``, the random Hadamard transform of the weight-gradient operands and the stochastic
        rounding of the output gradient, :mod:`fp8.nvfp4`)."""
        spec = get_recipe(self.recipe)
        if self.recipe == "nvfp4":
            spec = dataclasses.replace(spec, options=(("hadamard", self.fp4_hadamard),
                                                      ("stochastic_rounding", self.fp4_stochastic_rounding)))
        return spec

    def quantize_weight(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> Float8Tensor:
        """The FP8 weight of a high-precision ``weight`` for a model in ``dtype`` (default: ``weight``'s):
        ``weight_fmt`` with a current scale (per block of the recipe's weight block), reporting
        :meth:`weight_dtype`, accumulating with ``accumulate_backend``."""
        return to_float8(weight.detach(), self.weight_fmt, dtype=self.weight_dtype(dtype or weight.dtype),
                         accumulate_backend=self.accumulate_backend, block=self.recipe_spec.weight)

    def for_dims(self, in_features: int, out_features: int, name: str = "") -> "Float8LinearConfig":
        """This config for a linear of these dimensions: ``blockwise`` / ``mxfp8`` on dimensions that are not multiples
        of their blocks (:data:`fp8.recipes.BLOCKWISE_TILE`, 32) falls back to ``tensorwise`` for that layer
        (logged)."""
        problem = self.recipe_spec.dims_problem(in_features, out_features)
        if problem is not None:
            logger.info("fp8: %s: %s; it runs the tensorwise recipe", name or "a linear", problem)
            return dataclasses.replace(self, recipe="tensorwise")
        return self

    def weight_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype an FP8 weight of a model in ``dtype`` reports (and its gradient has): float32 under
        ``grad_accumulation="fp16"``/``"fp32"``, so gradients are never rounded to the model's 16-bit dtype;
        ``dtype`` under ``"fp8"``."""
        return dtype if self.grad_accumulation == "fp8" else torch.float32

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(
                f"recipe must be one of {RECIPES}, got {self.recipe!r} ('tensorwise': one scale per tensor; 'rowwise': "
                f"per token and per output channel; 'blockwise': 1x128 activation tiles, 128x128 weight blocks; 'mxfp8': "
                f"1x32 tiles and 32x32 weight blocks with E8M0 scales, NVIDIA Blackwell; 'nvfp4': E2M1 with E4M3 "
                f"scales per 16 and per tensor, NVIDIA Blackwell)"
            )
        if self.grad_accumulation not in GRAD_ACCUMULATION:
            raise ValueError(
                f"grad_accumulation must be one of {GRAD_ACCUMULATION}, got {self.grad_accumulation!r} ('fp16': a "
                f"scaled FP16 buffer, 2 bytes per weight element, accurate at any number of micro-batches (the "
                f"default); 'fp32': exact fp32 sums, 4 bytes; 'fp8': 1 byte, for one or a few micro-batches)"
            )
        get_format(self.weight_fmt)
        get_format(self.weight_grad_fmt)
        if self.gemm_backend not in GEMM_BACKENDS:
            raise ValueError(f"gemm_backend must be one of {GEMM_BACKENDS}, got {self.gemm_backend!r}")
        if self.accumulate_backend not in KERNEL_BACKENDS:
            raise ValueError(
                f"accumulate_backend must be one of {KERNEL_BACKENDS}, got {self.accumulate_backend!r} ('auto': "
                f"Triton for CUDA tensors, torch elsewhere)"
            )
        if self.input.fmt == "e5m2" and self.weight_fmt == "e5m2":
            raise ValueError("input and weight cannot both be E5M2: FP8 GEMMs need one E4M3 operand")
        if self.grad_output.fmt == "e5m2" and self.weight_fmt == "e5m2":
            raise ValueError("grad_output and weight cannot both be E5M2: FP8 GEMMs need one E4M3 operand")
        if self.grad_output.fmt == "e5m2" and self.input.fmt == "e5m2":
            raise ValueError(
                "grad_output and input cannot both be E5M2: the weight-gradient GEMM needs one E4M3 operand"
            )


def weight_grad(grad_w32: torch.Tensor, config: Float8LinearConfig, weight_dtype: torch.dtype,
                row: torch.Tensor | None = None, col: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient an FP8 weight receives from one backward, given the weight-gradient GEMM's fp32 output (times
    ``row`` ``(M, 1)`` and ``col`` ``(1, N)`` where the GEMM left its row-wise scales to apply, :func:`fp8.gemm.mm`):
    a fresh scaled FP16 buffer under ``grad_accumulation="fp16"`` (:func:`fp8.ops.amax` then
    :func:`fp8.ops.scaled_fp16`, the scales applied inside: two kernels; autograd adds the next micro-batches into it
    in place), that output itself under ``"fp32"`` (autograd sums micro-batches in fp32), an E4M3
    :class:`Float8Tensor` with a current scale under ``"fp8"``."""
    if config.grad_accumulation == "fp16":
        amax2 = ops.amax(grad_w32, row, col)
        payload, scale = ops.scaled_fp16(grad_w32, amax2, row, col)
        return ScaledFloat16Tensor(payload, scale, weight_dtype, config.accumulate_backend)
    if row is not None or col is not None:
        grad_w32 = ops.apply_scales(grad_w32, row, col, torch.float32)
    if config.grad_accumulation == "fp32":
        return grad_w32
    return to_float8(grad_w32, config.weight_grad_fmt, dtype=weight_dtype, accumulate_backend=config.accumulate_backend,
                     block=config.recipe_spec.weight)


@dataclass(frozen=True)
class LinearHooks:
    """Communication around the FP8 linear core's GEMMs (the tensor/sequence-parallel linears'; :class:`Float8Linear`
    uses none). Each hook is optional; without one the step is skipped. Scales travel as ``scale_inv`` (``value =
    payload * scale_inv``, what the GEMMs take).

    - ``gather_input(payload, scale_inv)``: the E4M3 input payload (rows) and its ``scale_inv`` (0-d, agreed over the
      group, or a grid of per-row / per-tile values) -> the gathered ``(payload, scale_inv)`` the forward GEMM reads
      (sequence-parallel all-gather).
    - ``reduce_output(out32, dtype, record)``: the forward GEMM's fp32 output -> the reduced output in
      ``dtype`` (all-reduce, or FP8 reduce-scatter). With it the GEMM writes fp32, without it ``dtype``.
    - ``gather_grad_output(payload, scale_inv)``: the output-gradient payload and ``scale_inv`` -> the gathered
      ``(payload, scale_inv)`` (the backward counterpart of a reduce-scatter of the output).
    - ``reduce_grad_input(dx32, dtype)``: the input-gradient GEMM's fp32 output -> the reduced input
      gradient in ``dtype`` (all-reduce, or FP8 reduce-scatter). With it the GEMM writes fp32.
    """

    gather_input: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    reduce_output: Callable[[torch.Tensor, torch.dtype, bool], torch.Tensor] | None = None
    gather_grad_output: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    reduce_grad_input: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None


NO_HOOKS = LinearHooks()
"""The hooks of a single-process linear: no communication."""


# -- the one autograd core: dense, tensor-parallel (hooks) and grouped (experts) linears --------------------------------
def _rows(op: Operand, start: int, end: int) -> Operand:
    """Rows ``start:end`` of a row-wise operand (its per-row / per-tile scales with them)."""
    scale = op.scale_inv if op.scale_inv.dim() == 0 else op.scale_inv[start:end]
    return Operand(op.data[start:end], scale, op.block, global_scale_inv=op.global_scale_inv)


def linear_forward(ctx, x, weights, bias, input_state, grad_output_state, config, record, dtype, hooks, groups,
                   input_casts: InputCasts | None = None):
    """The FP8 linear's forward for one weight (``groups`` None) or one weight per group of rows (:class:`Groups`):
    the input quantized once (its column-wise operand too, from the same read, where the weight gradient will need it
    and the rows are not gathered), one FP8 GEMM per weight; ``input_casts``: the cast shared with the other readers
    of ``x`` (:class:`InputCasts`)."""
    for w in weights:
        if not isinstance(w, Float8Tensor):
            raise TypeError("an FP8 linear's weight must be a Float8Tensor; assign through fp8.to_float8")
    recipe = config.recipe_spec
    quantizers = recipe.make_quantizers(input_state, grad_output_state, config.weight_fmt)
    backend = config.gemm_backend
    x2d = x.reshape(-1, x.shape[-1]).to(dtype)
    grouped = groups is not None
    sizes = groups.sizes if grouped else None
    gathered = hooks.gather_input is not None
    wgrad = any(ctx.needs_input_grad[i] for i in ctx.weight_inputs)
    columnwise = wgrad and not gathered and not grouped
    if config.high_precision:
        if grouped or gathered or hooks.gather_grad_output is not None:
            raise ValueError("a linear in high precision (Float8LinearConfig.high_precision: automatic fallback's last "
                             "rung, --fp8-high-precision-mode linear) runs on linears whose input is neither "
                             "all-gathered (sequence parallelism) nor grouped (MoE experts)")
        return _high_precision_linear(ctx, x, x2d, weights[0], bias, hooks, dtype, config, record)
    if config.high_precision_forward:
        if grouped or gathered:
            raise ValueError("high_precision_forward (--fp4-bf16-forward-from-iteration) runs on linears whose input is "
                             "neither all-gathered (sequence parallelism) nor grouped (MoE experts); run it without "
                             "--sequence-parallel and MoE, or without the switch")
        return _high_precision_forward(ctx, x, x2d, weights[0], bias, quantizers, config, hooks, dtype, wgrad,
                                       record)
    key = (recipe.name, recipe.options, input_state.config if recipe.tensorwise else None, x2d.dtype, columnwise)
    if gathered:
        rows, cols = quantizers.input.quantize(x2d, record, columnwise=False)
        data, scale_inv = hooks.gather_input(rows.data, rows.scale_inv)
        rows = Operand(data, scale_inv, rows.block, global_scale_inv=rows.global_scale_inv)  # NVFP4's: agreed
    elif grouped:
        rows, cols = quantizers.input.quantize(x2d, record, columnwise=False)
    else:
        made = []

        def cast():
            made.append(True)
            return quantizers.input.quantize(x2d, record, columnwise)

        step_guard = input_state.amax_history if recipe.tensorwise else None
        rows, cols = cast() if input_casts is None else input_casts.cast(x, key, cast, step_guard)
        if not made and record and (recipe.tensorwise or recipe.name in ("rowwise", "blockwise")):
            # another reader's cast, shared: this reader's statistics still see the input and the scales it used
            observe_cast(input_state.stats, x2d, rows, "e4m3" if not recipe.tensorwise else input_state.config.fmt)
    gemm_dtype = torch.float32 if hooks.reduce_output is not None else dtype
    ctx.fp8_weights = None if torch.compiler.is_compiling() else list(weights)
    if not grouped:
        w = weights[0]
        out = mm(rows, quantizers.weight.forward_b(w.payload, w.scale, w, backend), gemm_dtype, backend)
    else:
        out = groups.forward_gemm(rows, weights, sizes, groups.offsets, quantizers.weight, gemm_dtype, backend,
                                  ctx.fp8_weights)
    if hooks.reduce_output is not None:
        out = hooks.reduce_output(out, dtype, record)
    if bias is not None:
        out = out + bias.to(out.dtype)
    group_cols = []
    if grouped and wgrad and quantizers.input.per_token:
        # per-token scales: each group's column-wise operand from its high-precision rows, as a linear of its own
        # would make it (no second rounding of the FP8 rows)
        group_cols = [quantizers.input.columnwise(x2d[start:end]) if end > start else None
                      for start, end in group_bounds(sizes)]
    saved = cols if cols is not None else rows  # the weight gradient's operand, or the rows it is made from
    kept = [c for c in group_cols if c is not None]
    if kept:
        saved = Operand(saved.data.new_empty((0, 0)), saved.scale_inv.new_empty((0,)), saved.block)
    _save_for_backward(ctx, saved, cols is not None, weights, group_cols, quantizers, config, hooks, sizes, bias,
                       x.shape)
    return out


def _save_for_backward(ctx, saved, columnwise, weights, group_cols, quantizers, config, hooks, sizes, bias, x_shape):
    """What :func:`linear_backward` reads: ``saved`` (the weight gradient's operand, or the rows it is made from; its
    scales in the GEMM's layout where a kernel wrote them, and NVFP4's 0-d per-tensor factor), the weights' payloads
    and scales, the groups' own column-wise operands (``group_cols``: None where a group has no token)."""
    kept = [c for c in group_cols if c is not None]
    hw = saved.hw_scale if not kept else None
    ctx.save_for_backward(saved.data, saved.scale_inv, *(w.payload for w in weights), *(w.scale for w in weights),
                          *(c.data for c in kept), *(c.scale_inv for c in kept), *(() if hw is None else (hw,)))
    ctx.saved_hw = hw is not None
    ctx.saved_columnwise, ctx.saved_block, ctx.n_weights = columnwise, saved.block, len(weights)
    ctx.saved_global = saved.global_scale_inv
    ctx.group_cols = [c is not None for c in group_cols]
    ctx.group_cols_block = kept[0].block if kept else None
    ctx.quantizers, ctx.config, ctx.hooks, ctx.sizes = quantizers, config, hooks, sizes
    ctx.has_bias, ctx.x_shape = bias is not None, x_shape
    ctx.weight_dtypes = [w.dtype for w in weights]


def _high_precision_forward(ctx, x, x2d, w, bias, quantizers, config, hooks, dtype, wgrad, record):
    """:attr:`Float8LinearConfig.high_precision_forward`: ``x @ W^T`` in ``dtype`` with W dequantized from its form at
    rest (exact in bf16: E4M3 values times power-of-two scales), the input's column-wise operand made for the weight
    gradient; :func:`linear_backward` runs as for the FP8 forward (it reads only that operand and the weight). A
    row-parallel linear's partial sums stay fp32 until its reduction, as the FP8 GEMM's do."""
    if hooks.reduce_output is not None:
        weight = dequantize_blocks(w.payload, w.scale, w.block, torch.float32)
        out = hooks.reduce_output(torch.mm(x2d.to(torch.float32), weight.t()), dtype, record)
    else:
        weight = dequantize_blocks(w.payload, w.scale, w.block, dtype)
        out = torch.mm(x2d, weight.t())
    if bias is not None:
        out = out + bias.to(out.dtype)
    cols = quantizers.input.weight_grad_operand(x2d, record) if wgrad else None
    saved = cols if cols is not None else Operand(x2d.new_empty((0, 0)), x2d.new_empty((0,)), None)
    ctx.fp8_weights = None if torch.compiler.is_compiling() else [w]
    _save_for_backward(ctx, saved, cols is not None, [w], [], quantizers, config, hooks, None, bias, x.shape)
    return out


def _high_precision_linear(ctx, x, x2d, w, bias, hooks, dtype, config, record):
    """:attr:`Float8LinearConfig.high_precision`: ``x @ W^T`` in ``dtype`` (fp32 partial sums before a row-parallel
    reduction) on W's values; the input saved as it is for :func:`_high_precision_backward`."""
    if hooks.reduce_output is not None:
        weight = dequantize_blocks(w.payload, w.scale, w.block, torch.float32)
        out = hooks.reduce_output(torch.mm(x2d.to(torch.float32), weight.t()), dtype, record)
    else:
        out = torch.mm(x2d, dequantize_blocks(w.payload, w.scale, w.block, dtype).t())
    if bias is not None:
        out = out + bias.to(out.dtype)
    ctx.save_for_backward(x2d, w.payload, w.scale)
    ctx.high_precision, ctx.weight_block, ctx.hooks, ctx.config = True, w.block, hooks, config
    ctx.has_bias, ctx.x_shape, ctx.weight_dtypes = bias is not None, x.shape, [w.dtype]
    return out


def _high_precision_backward(ctx, grad_out):
    """The backward of :func:`_high_precision_linear`: ``dX = dY @ W`` in the output gradient's dtype (fp32 before a
    reduction), ``dW = dY^T @ X`` in fp32 held per ``grad_accumulation`` (:func:`weight_grad`)."""
    x2d, payload, scale = ctx.saved_tensors
    hooks, config = ctx.hooks, ctx.config
    g2d = grad_out.reshape(-1, grad_out.shape[-1])
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        reduce = hooks.reduce_grad_input
        dx_dtype = torch.float32 if reduce is not None else grad_out.dtype
        dx = torch.mm(g2d.to(dx_dtype), dequantize_blocks(payload, scale, ctx.weight_block, dx_dtype))
        grad_x = (reduce(dx, grad_out.dtype) if reduce is not None else dx).reshape(ctx.x_shape)
    if ctx.needs_input_grad[ctx.weight_inputs[0]]:
        grad_w = weight_grad(torch.mm(g2d.t().to(torch.float32), x2d.to(torch.float32)), config, ctx.weight_dtypes[0])
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = g2d.sum(0)
    return grad_x, [grad_w], grad_b


@dataclass(frozen=True)
class Groups:
    """Rows of a grouped linear (MoE experts, rows sorted by group): ``sizes`` the groups' row counts on the host,
    ``offsets`` their cumulative ends on the device (int32), ``forward_gemm`` the forward GEMM of all groups
    ``(rows, weights, sizes, offsets, weight_quantizer, out_dtype, backend, held) -> out`` (:mod:`fp8.grouped_gemm`
    passes its own: ``torch._scaled_grouped_mm`` where it runs, one GEMM per group elsewhere)."""

    sizes: list[int]
    offsets: torch.Tensor | None
    forward_gemm: Callable


def group_bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """``[(start, end)]`` row ranges of groups of these sizes, in order."""
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def linear_backward(ctx, grad_out):
    """The FP8 linear's backward: the output gradient quantized once (its column-wise operand from the same read
    where the rows are not gathered), ``dX = dY @ W`` and ``dW = dY^T @ X`` in FP8 per weight; the weight gradients
    held per ``grad_accumulation`` (:func:`weight_grad`)."""
    if getattr(ctx, "high_precision", False):
        return _high_precision_backward(ctx, grad_out)
    saved_data, saved_scale, *wt = ctx.saved_tensors
    saved_hw = wt.pop() if ctx.saved_hw else None
    n = ctx.n_weights
    payloads, scales, kept = wt[:n], wt[n:2 * n], wt[2 * n:]
    group_cols, it = [], iter(zip(kept[:len(kept) // 2], kept[len(kept) // 2:]))
    for has in ctx.group_cols:
        group_cols.append(Operand(*next(it), ctx.group_cols_block) if has else None)
    quantizers, config, hooks, sizes = ctx.quantizers, ctx.config, ctx.hooks, ctx.sizes
    backend = config.gemm_backend
    weights = ctx.fp8_weights or [None] * n
    grouped = sizes is not None
    g2d = grad_out.reshape(-1, grad_out.shape[-1])
    needs_dx = ctx.needs_input_grad[0]
    needs_dw = [ctx.needs_input_grad[i] for i in ctx.weight_inputs]
    gathered = hooks.gather_grad_output is not None
    g_rows, g_cols = quantizers.grad_output.quantize(g2d.contiguous() if grouped else g2d, True,
                                                     columnwise=any(needs_dw) and not gathered and not grouped)
    if gathered:
        data, scale_inv = hooks.gather_grad_output(g_rows.data, g_rows.scale_inv)
        g_rows = Operand(data, scale_inv, g_rows.block, global_scale_inv=g_rows.global_scale_inv)
    saved = Operand(saved_data, saved_scale, ctx.saved_block, hw_scale=saved_hw, global_scale_inv=ctx.saved_global)
    grad_x = grad_b = None
    grad_ws = [None] * n
    bounds = group_bounds(sizes) if grouped else [(0, g_rows.data.shape[0])]
    if needs_dx:
        reduce = hooks.reduce_grad_input
        dx_dtype = torch.float32 if reduce is not None else grad_out.dtype
        dxs = []
        for (start, end), payload, scale, w in zip(bounds, payloads, scales, weights):
            if grouped and start == end:  # no token: no GEMM
                dxs.append(g2d.new_empty((0, payload.shape[1]), dtype=dx_dtype))
                continue
            a = _rows(g_rows, start, end) if grouped else g_rows
            dxs.append(mm(a, quantizers.weight.dgrad_b(payload, scale, w, a, dx_dtype, backend), dx_dtype, backend))
        dx = dxs[0] if not grouped else (torch.cat(dxs) if dxs else g2d.new_zeros((0, payloads[0].shape[1])))
        grad_x = (reduce(dx, grad_out.dtype) if reduce is not None else dx).reshape(ctx.x_shape)
    if any(needs_dw):
        for g, ((start, end), payload) in enumerate(zip(bounds, payloads)):
            if not needs_dw[g]:
                continue
            if grouped and start == end:  # no token: a zero gradient, no empty GEMM
                zero = saved_data.new_zeros((payload.shape[0], payload.shape[1]), dtype=torch.float32)
                grad_ws[g] = weight_grad(zero, config, ctx.weight_dtypes[g])
                continue
            if grouped and quantizers.grad_output.per_token:  # from the high-precision rows (see the forward)
                a = quantizers.grad_output.columnwise(g2d[start:end])
                b = group_cols[g] if group_cols else quantizers.input.columnwise_from(_rows(saved, start, end))
            elif grouped:
                a = quantizers.grad_output.columnwise_from(_rows(g_rows, start, end))
                b = group_cols[g] if group_cols else quantizers.input.columnwise_from(_rows(saved, start, end))
            else:
                a = g_cols if g_cols is not None else quantizers.grad_output.columnwise_from(g_rows)
                b = saved if ctx.saved_columnwise else quantizers.input.columnwise_from(saved)
            out, row, col = mm(a, b.t, torch.float32, backend, defer_scales=True)
            grad_ws[g] = weight_grad(out, config, ctx.weight_dtypes[g], row, col)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = g2d.sum(0)
    return grad_x, grad_ws, grad_b


class Float8LinearFunction(torch.autograd.Function):
    """The FP8 linear recipe, once: ``y = x @ W^T (+ b)`` with the input quantized by the recipe's input quantizer
    (E4M3; :mod:`fp8.quantizers`), ``W`` an FP8 :class:`Float8Tensor`, FP8 GEMMs with fp32 accumulation in all three
    passes, the output gradient quantized once with the operand its weight gradient needs, and the weight gradient
    held per ``config.grad_accumulation`` (:func:`weight_grad`). ``dtype`` is the compute dtype (the output's);
    ``hooks`` (:class:`LinearHooks`) add the parallel linears' collectives around the GEMMs. The grouped linear of
    MoE experts (:class:`fp8.grouped_gemm.GroupedLinearFunction`) runs the same core.

    ``apply(x, weight, bias, input_state, grad_output_state, config, record, dtype, hooks, input_casts)``: ``record``
    says whether the input's amax enters its scaling history (training passes only); ``input_casts`` (or None) the
    :class:`InputCasts` the linear shares with the other readers of its input.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, input_state, grad_output_state, config, record, dtype, hooks, input_casts=None):
        ctx.weight_inputs = (1,)
        out = linear_forward(ctx, x, [weight], bias, input_state, grad_output_state, config, record, dtype, hooks,
                             None, input_casts)
        if out.shape[0] == math.prod(x.shape[:-1]):
            lead = tuple(x.shape[:-1])
        else:  # gathered or scattered along the first (sequence) dimension
            inner = math.prod(x.shape[1:-1])
            lead = (out.shape[0] // inner, *x.shape[1:-1])
        # A new tensor to autograd, not a view of this function's intermediate: callers may add into it in place
        # (Falcon's parallel attention does ``mlp_output += attention_output``), which autograd refuses on a view.
        return torch.ops.aten._unsafe_view(out.contiguous(), (*lead, weight.shape[0]))

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_ws, grad_b = linear_backward(ctx, grad_out)
        return grad_x, grad_ws[0], grad_b, None, None, None, None, None, None, None


class InputCasts:
    """The FP8 casts of layer inputs, shared by the FP8 linears that read the same tensor unchanged with the same
    recipe (the q/k/v or gate/up projections of one hidden state), so each is computed and saved for backward once.
    Owned by the linears given it at construction (:func:`fp8.convert.convert_to_float8_linear` gives one to every
    linear of a model; a linear built alone has its own): nothing is stored on the input. Entries are weak in the
    input (freed with it) and guarded by its version counter (an in-place change casts again).

    Per-block current scales are a function of the values, so a memo is the cast every reader would make.
    Tensor-wise (``key`` holding the scaling config): the first reader's delayed scale is used by all, and only its
    history records the input's amax (the cast records it in the same kernel); the readers' histories, fed the same
    tensors since construction, would hold the same amaxes, and its scale is a valid scale for the input in any case.
    A memo lasts one scaling step: ``step_guard`` (the first reader's amax history) changes when the step closes
    (:func:`fp8.scaling.update_scales`), so the same tensor read again in a later step is cast again, with the new
    scale, its amax recorded."""

    def __init__(self) -> None:
        from torch.utils.weak import WeakTensorKeyDictionary

        self._memo = WeakTensorKeyDictionary()

    def __len__(self) -> int:
        return len(self._memo)

    def __contains__(self, x: torch.Tensor) -> bool:
        return x in self._memo

    def get(self, x: torch.Tensor) -> tuple[Operand, Operand | None] | None:
        """The cast memoized for ``x`` (whatever its key), or None."""
        memo = self._memo.get(x)
        return None if memo is None else memo[3]

    def cast(self, x: torch.Tensor, key: tuple, cast, step_guard: torch.Tensor | None = None
             ) -> tuple[Operand, Operand | None]:
        """The cast of ``x`` for ``key``: the memo's when it is still valid, else ``cast()`` (then memoized)."""
        if torch.compiler.is_compiling() or x.is_inference():  # traced graphs keep no memo; inference tensors
            return cast()                                          # have no version counter to guard one: cast
        key = (*key, x._version)
        memo = self._memo.get(x)
        if memo is not None and memo[0] == key and (memo[1] is None or memo[1]._version == memo[2]):
            return memo[3]
        value = cast()
        self._memo[x] = (key, step_guard, step_guard._version if step_guard is not None else None, value)
        return value

    def __deepcopy__(self, memo: dict) -> InputCasts:
        return InputCasts()  # a copied model shares casts among its own linears, none with the original's inputs

    def __getstate__(self) -> dict:
        return {}  # transient: a saved model holds no casts

    def __setstate__(self, state: dict) -> None:
        self.__init__()


class Float8Linear(nn.Module):
    """Drop-in for ``nn.Linear`` computing in FP8 (see the module docstring for the formats).

    ``weight`` is an ``nn.Parameter`` holding an E4M3 :class:`Float8Tensor` (1 byte per element
    plus its scale); ``bias`` stays in high precision. ``input_scaling`` and ``grad_output_scaling``
    hold the scaling state of the activations and output gradients; call ``fp8.update_scales(model)``
    once per optimizer step (the optimizer returned by ``fp8.initialize`` does it for you).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        config: Float8LinearConfig | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        input_casts: InputCasts | None = None,
    ) -> None:
        super().__init__()
        self.input_casts = input_casts if input_casts is not None else InputCasts()
        problem = fp8_dims_problem(in_features, out_features)
        if problem:
            raise ValueError(f"Float8Linear: {problem}")
        self.in_features = in_features
        self.out_features = out_features
        self.config = (config or Float8LinearConfig()).for_dims(in_features, out_features)
        weight = torch.empty(out_features, in_features, device=device, dtype=dtype or torch.float32)
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        self.weight = nn.Parameter(self.config.quantize_weight(weight))
        if bias:
            bound = 1 / math.sqrt(in_features)
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=weight.dtype).uniform_(-bound, bound))
        else:
            self.register_parameter("bias", None)
        self.input_scaling = ScalingState(self.config.input, device=weight.device)
        self.grad_output_scaling = ScalingState(self.config.grad_output, device=weight.device)
        self.stored_transposed = False

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Float8LinearConfig | None = None,
                    input_casts: InputCasts | None = None) -> "Float8Linear":
        """An FP8 linear with ``linear``'s weight quantized (current scale) and ``linear``'s own bias
        ``Parameter`` (so an optimizer holding it keeps stepping it). ``input_casts``: the :class:`InputCasts` it
        shares with other linears (default: its own)."""
        problem = fp8_dims_problem(linear.in_features, linear.out_features)
        if problem:
            raise ValueError(f"Float8Linear.from_linear: {problem}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.input_casts = input_casts if input_casts is not None else InputCasts()
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.config = (config or Float8LinearConfig()).for_dims(linear.in_features, linear.out_features)
        weight = linear.weight
        new.weight = nn.Parameter(new.config.quantize_weight(weight), requires_grad=weight.requires_grad)
        new.bias = linear.bias
        new.input_scaling = ScalingState(new.config.input, device=weight.device)
        new.grad_output_scaling = ScalingState(new.config.grad_output, device=weight.device)
        new.stored_transposed = False  # True when converted from a transformers Conv1D ((in, out) in its model)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Float8Linear: expected input with last dim {self.in_features}, got {tuple(x.shape)}")
        # Only passes that can train record activation amaxes: evaluation leaves the scaling history alone.
        record = torch.is_grad_enabled()
        return Float8LinearFunction.apply(
            x, self.weight, self.bias, self.input_scaling, self.grad_output_scaling, self.config, record, x.dtype,
            NO_HOOKS, self.input_casts,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"weight={self.config.weight_fmt}, input={self.config.input.fmt}/{self.config.input.kind}, "
            f"grad_output={self.config.grad_output.fmt}/{self.config.grad_output.kind}, "
            f"grad_accumulation={self.config.grad_accumulation}, recipe={self.config.recipe}"
        )
