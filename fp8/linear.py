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

from .blocks import dequantize_blocks, quantize_to_blocks, transpose_block
from .cast import quantize
from .formats import get_format
from .gemm import GEMM_BACKENDS, GemmTarget, fp8_mm_payload, gemm_path
from .kernels.backend import KERNEL_BACKENDS
from .recipes import BLOCKWISE_TILE, RECIPES, Recipe, get_recipe
from .scaled_fp16 import to_scaled_fp16
from .scaling import ScalingConfig, ScalingState
from .tensor import Float8Tensor, cached_operand, to_float8

logger = logging.getLogger(__name__)

__all__ = [
    "Float8LinearConfig", "Float8Linear", "Float8LinearFunction", "LinearHooks", "NO_HOOKS", "fp8_dims_problem",
    "GRAD_ACCUMULATION", "weight_grad",
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

    @property
    def recipe_spec(self) -> Recipe:
        """The :class:`fp8.recipes.Recipe` named by ``recipe``."""
        return get_recipe(self.recipe)

    def quantize_weight(self, weight: torch.Tensor, dtype: torch.dtype | None = None) -> Float8Tensor:
        """The FP8 weight of a high-precision ``weight`` for a model in ``dtype`` (default: ``weight``'s):
        ``weight_fmt`` with a current scale (per block of the recipe's weight block), reporting
        :meth:`weight_dtype`, accumulating with ``accumulate_backend``."""
        return to_float8(weight.detach(), self.weight_fmt, dtype=self.weight_dtype(dtype or weight.dtype),
                         accumulate_backend=self.accumulate_backend, block=self.recipe_spec.weight)

    def for_dims(self, in_features: int, out_features: int, name: str = "") -> "Float8LinearConfig":
        """This config for a linear of these dimensions: ``blockwise`` on dimensions that are not multiples of
        :data:`fp8.recipes.BLOCKWISE_TILE` falls back to ``tensorwise`` for that layer (logged)."""
        if self.recipe == "blockwise" and (in_features % BLOCKWISE_TILE or out_features % BLOCKWISE_TILE):
            logger.info("fp8: %s (in_features=%d, out_features=%d) cannot tile in %dx%d blocks; it runs the "
                        "tensorwise recipe", name or "a linear", in_features, out_features, BLOCKWISE_TILE,
                        BLOCKWISE_TILE)
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
                f"per token and per output channel; 'blockwise': 1x128 activation tiles, 128x128 weight blocks)"
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


def fp8_dims_problem(in_features: int, out_features: int) -> str | None:
    """Why a linear of these dimensions cannot run its GEMMs in FP8, or None if it can."""
    if in_features % 16 or out_features % 16:
        return (
            f"in_features={in_features} and out_features={out_features} must both be multiples of 16 "
            f"for FP8 GEMMs (pad the layer)"
        )
    return None


def weight_grad(grad_w32: torch.Tensor, config: Float8LinearConfig, weight_dtype: torch.dtype) -> torch.Tensor:
    """The gradient an FP8 weight receives from one backward, given the weight-gradient GEMM's fp32 output:
    a fresh scaled FP16 buffer under ``grad_accumulation="fp16"`` (:func:`fp8.scaled_fp16.to_scaled_fp16`; autograd
    adds the next micro-batches into it in place), that output itself under ``"fp32"`` (autograd sums
    micro-batches in fp32), an E4M3 :class:`Float8Tensor` with a current scale under ``"fp8"``."""
    if config.grad_accumulation == "fp32":
        return grad_w32
    if config.grad_accumulation == "fp16":
        return to_scaled_fp16(grad_w32, dtype=weight_dtype, accumulate_backend=config.accumulate_backend)
    return to_float8(grad_w32, config.weight_grad_fmt, dtype=weight_dtype, accumulate_backend=config.accumulate_backend,
                     block=config.recipe_spec.weight)


@dataclass(frozen=True)
class LinearHooks:
    """Communication around :class:`Float8LinearFunction`'s GEMMs (the tensor/sequence-parallel linears';
    :class:`Float8Linear` uses none). Each hook is optional; without one the step is skipped.

    - ``gather_input(payload, scale)``: the E4M3 input payload (rows) and its scale (0-d, agreed over the group,
      or a grid of per-row / per-tile scales) -> the gathered ``(payload, scale)`` the forward GEMM reads
      (sequence-parallel all-gather).
    - ``reduce_output(out32, dtype, record)``: the forward GEMM's fp32 output -> the reduced output in
      ``dtype`` (all-reduce, or FP8 reduce-scatter). With it the GEMM writes fp32, without it ``dtype``.
    - ``gather_grad_output(payload, scale)``: the output-gradient payload and scale -> the gathered
      ``(payload, scale)`` (the backward counterpart of a reduce-scatter of the output).
    - ``reduce_grad_input(dx32, dtype)``: the input-gradient GEMM's fp32 output -> the reduced input
      gradient in ``dtype`` (all-reduce, or FP8 reduce-scatter). With it the GEMM writes fp32.
    """

    gather_input: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    reduce_output: Callable[[torch.Tensor, torch.dtype, bool], torch.Tensor] | None = None
    gather_grad_output: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    reduce_grad_input: Callable[[torch.Tensor, torch.dtype], torch.Tensor] | None = None


NO_HOOKS = LinearHooks()
"""The hooks of a single-process linear: no communication."""


class Float8LinearFunction(torch.autograd.Function):
    """The FP8 linear recipe, once: ``y = x @ W^T (+ b)`` with the input cast to ``input_state``'s format
    (E4M3), ``W`` an FP8 :class:`Float8Tensor`, FP8 GEMMs with fp32 accumulation in all three passes, the
    output gradient cast once with its transpose (``grad_output_state``, E5M2), and the weight gradient
    held per ``config.grad_accumulation`` (:func:`weight_grad`). ``dtype`` is the compute dtype (the
    output's and the saved activations'); ``hooks`` (:class:`LinearHooks`) add the parallel linears'
    collectives around the GEMMs.

    ``apply(x, weight, bias, input_state, grad_output_state, config, record, dtype, hooks)``: ``record``
    says whether the input's amax enters its scaling history (training passes only).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, input_state, grad_output_state, config, record, dtype, hooks):
        if not isinstance(weight, Float8Tensor):
            raise TypeError("Float8Linear.weight must be a Float8Tensor; assign through fp8.to_float8")
        x2d = x.reshape(-1, x.shape[-1]).to(dtype)
        recipe = config.recipe_spec
        if recipe.tensorwise:
            x_scale = input_state.scale_for(x2d, record=record)  # records this linear's amax either way
            if hooks.gather_input is None:
                x_data, x_scale = _shared_cast(x, ("tensorwise", input_state.config, x2d.dtype),
                                               lambda: (quantize(x2d, x_scale, input_state.format), x_scale))
            else:
                x_data = quantize(x2d, x_scale, input_state.format)
        elif hooks.gather_input is None:
            x_data, x_scale = _shared_cast(x, ("blocks", recipe.input, x2d.dtype),
                                           lambda: quantize_to_blocks(x2d, recipe.input, "e4m3"))
        else:
            x_data, x_scale = quantize_to_blocks(x2d, recipe.input, "e4m3")
        if hooks.gather_input is not None:
            x_data, x_scale = hooks.gather_input(x_data, x_scale)
        w_data, w_scale, w_block = weight.payload, weight.scale, weight.block
        gemm_dtype = torch.float32 if hooks.reduce_output is not None else dtype
        out = fp8_mm_payload(x_data, x_scale, w_data.t(), _t(w_scale), gemm_dtype, config.gemm_backend,
                             a_block=None if recipe.tensorwise else recipe.input, b_block=transpose_block(w_block))
        if hooks.reduce_output is not None:
            out = hooks.reduce_output(out, dtype, record)
        if bias is not None:
            out = out + bias.to(out.dtype)
        ctx.save_for_backward(x_data, x_scale, w_data, w_scale)
        ctx.grad_output_state, ctx.config, ctx.hooks, ctx.w_block = grad_output_state, config, hooks, w_block
        # The weight itself, for the input-gradient operand cached with it (_dgrad_weight); none in traced graphs.
        ctx.fp8_weight = None if torch.compiler.is_compiling() else weight
        ctx.has_bias, ctx.x_shape, ctx.weight_dtype = bias is not None, x.shape, weight.dtype
        if out.shape[0] == x2d.shape[0]:
            lead = tuple(x.shape[:-1])
        else:  # gathered or scattered along the first (sequence) dimension
            inner = math.prod(x.shape[1:-1])
            lead = (out.shape[0] // inner, *x.shape[1:-1])
        # A new tensor to autograd, not a view of this function's intermediate: callers may add into it in place
        # (Falcon's parallel attention does ``mlp_output += attention_output``), which autograd refuses on a view.
        return torch.ops.aten._unsafe_view(out.contiguous(), (*lead, weight.shape[0]))

    @staticmethod
    def backward(ctx, grad_out):
        x_data, x_scale, w_data, w_scale = ctx.saved_tensors
        if not ctx.config.recipe_spec.tensorwise:
            return _block_backward(ctx, grad_out, x_data, x_scale, w_data, w_scale)
        config, state, hooks = ctx.config, ctx.grad_output_state, ctx.hooks
        g2d = grad_out.reshape(-1, grad_out.shape[-1])
        if hooks.gather_grad_output is not None:
            g_scale = state.scale_for(g2d)
            g_data, g_scale = hooks.gather_grad_output(quantize(g2d, g_scale, state.format), g_scale)
            g_data_t = g_data.t().contiguous()
        else:
            # Cast, transpose and amax in one read of dY (fused kernel on CUDA, the torch reference elsewhere).
            g_data, g_data_t, g_scale = state.quantize_transpose(g2d)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            reduce = hooks.reduce_grad_input
            dx_dtype = torch.float32 if reduce is not None else grad_out.dtype
            w_op = _dgrad_weight(ctx, g_data, w_data, w_scale, dx_dtype)
            dx = fp8_mm_payload(g_data, g_scale, w_op, w_scale, dx_dtype, config.gemm_backend)
            grad_x = (reduce(dx, grad_out.dtype) if reduce is not None else dx).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w32 = fp8_mm_payload(g_data_t, g_scale, x_data, x_scale, torch.float32, config.gemm_backend)
            grad_w = weight_grad(grad_w32, config, ctx.weight_dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2d.sum(0)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def _shared_cast(x: torch.Tensor, key: tuple, cast) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 cast of input ``x`` (payload, scale), ``cast()``, shared by every FP8 linear that reads the same tensor
    unchanged with the same ``key`` (the q/k/v or gate/up projections of one hidden state), so it is computed and
    saved for backward once. Memoized on ``x`` itself (its version counter guards in-place changes); freed with it.

    Per-block current scales (``key`` ``("blocks", block, dtype)``) are a function of the values, so the memo is the
    cast every reader would make. Tensor-wise (``("tensorwise", scaling config, dtype)``): each linear still records
    ``x``'s amax in its own history; the readers use the first one's delayed scale, which equals theirs (histories
    fed the same tensors since construction hold the same amaxes) and is a valid scale for ``x`` in any case."""
    if torch.compiler.is_compiling() or x.is_inference():  # traced graphs take no attributes; inference tensors
        return cast()                                          # have no version counter to guard a memo: cast
    key = (*key, x._version)
    memo = getattr(x, "_fp8_input_cast", None)
    if memo is not None and memo[0] == key:
        return memo[1], memo[2]
    x_data, x_scale = cast()
    try:
        x._fp8_input_cast = (key, x_data, x_scale)
    except (AttributeError, RuntimeError):  # a tensor that takes no attributes
        pass
    return x_data, x_scale


def _column_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


def _runs_scaled_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, backend: str, a_block=None,
                    b_block=None) -> bool:
    """Whether :func:`fp8.gemm.fp8_mm_payload` multiplies these operands on one of its ``scaled_mm_*`` paths
    (:func:`fp8.gemm.gemm_path`, the decision it runs), which take ``b`` column-major and copy a row-major one."""
    return gemm_path(a, b, out_dtype, GemmTarget.of(a.device), backend, a_block, b_block).scaled_mm


def _dgrad_weight(ctx, g_data: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """The weight payload as the second operand of ``dX = dY @ W`` (tensor-wise recipe). Where that GEMM runs
    ``torch._scaled_mm`` it takes ``W`` (out x in, row-major) column-major: the transposed copy is made once per
    optimizer step and kept with the weight (:func:`fp8.tensor.cached_operand`, :attr:`Float8Tensor.transpose_cache`),
    the same bits ``_scaled_mm`` would otherwise copy on every backward. Elsewhere (the emulated GEMM) ``W`` as is."""
    if _column_major(w_data) or not _runs_scaled_mm(g_data, w_data, out_dtype, ctx.config.gemm_backend):
        return w_data
    return cached_operand(ctx.fp8_weight, w_data, w_scale, ("transpose",), lambda: (w_data.t().contiguous().t(),))[0]


def _t(scale: torch.Tensor) -> torch.Tensor:
    """The scale of a transposed operand: a grid is transposed, a 0-d scale is itself."""
    return scale.t() if scale.dim() == 2 else scale


def _block_backward(ctx, grad_out, x_data, x_scale, w_data, w_scale):
    """Backward of the rowwise/blockwise recipes (:mod:`fp8.recipes`): dY cast in the recipe's blocks along the
    output features for ``dY @ W`` and along the tokens for ``dY^T @ x``; operands held in another layout are
    re-quantized from their exact dequantized values."""
    config, hooks, recipe = ctx.config, ctx.hooks, ctx.config.recipe_spec
    backend = config.gemm_backend
    g2d = grad_out.reshape(-1, grad_out.shape[-1])
    g_data, g_scale = quantize_to_blocks(g2d, recipe.grad_output, recipe.grad_fmt)
    if hooks.gather_grad_output is not None:
        g_data, g_scale = hooks.gather_grad_output(g_data, g_scale)
    grad_x = grad_w = grad_b = None
    if ctx.needs_input_grad[0]:
        reduce = hooks.reduce_grad_input
        dx_dtype = torch.float32 if reduce else grad_out.dtype

        def dgrad_weight():
            if recipe.dgrad_weight == ctx.w_block:
                return w_data, w_scale
            return quantize_to_blocks(dequantize_blocks(w_data, w_scale, ctx.w_block), recipe.dgrad_weight,
                                      config.weight_fmt)

        if _runs_scaled_mm(g_data, w_data, dx_dtype, backend, recipe.grad_output, recipe.dgrad_weight):
            # Row-wise _scaled_mm: the weight in its dgrad blocks, column-major, made once per optimizer step and
            # kept with the weight (as _dgrad_weight's transpose).
            def build():
                wd, ws = dgrad_weight()
                return (wd if _column_major(wd) else wd.t().contiguous().t()), ws

            wd, ws = cached_operand(ctx.fp8_weight, w_data, w_scale, ("blocks", recipe.dgrad_weight, config.weight_fmt),
                                    build)
        else:
            wd, ws = dgrad_weight()
        dx = fp8_mm_payload(g_data, g_scale, wd, ws, dx_dtype, backend,
                            a_block=recipe.grad_output, b_block=recipe.dgrad_weight)
        grad_x = (reduce(dx, grad_out.dtype) if reduce else dx).reshape(ctx.x_shape)
    if ctx.needs_input_grad[1]:
        g_full = dequantize_blocks(g_data, g_scale, recipe.grad_output)
        gt_data, gt_scale = quantize_to_blocks(g_full, recipe.wgrad_grad_output, recipe.grad_fmt)
        xw_data, xw_scale = quantize_to_blocks(dequantize_blocks(x_data, x_scale, recipe.input), recipe.wgrad_input,
                                               "e4m3")
        grad_w32 = fp8_mm_payload(gt_data.t(), gt_scale.t(), xw_data, xw_scale, torch.float32, backend,
                                  a_block=transpose_block(recipe.wgrad_grad_output), b_block=recipe.wgrad_input)
        grad_w = weight_grad(grad_w32, config, ctx.weight_dtype)
    if ctx.has_bias and ctx.needs_input_grad[2]:
        grad_b = g2d.sum(0)
    return grad_x, grad_w, grad_b, None, None, None, None, None, None


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
    ) -> None:
        super().__init__()
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

    @classmethod
    def from_linear(cls, linear: nn.Linear, config: Float8LinearConfig | None = None) -> "Float8Linear":
        """An FP8 linear with ``linear``'s weight quantized (current scale) and ``linear``'s own bias
        ``Parameter`` (so an optimizer holding it keeps stepping it)."""
        problem = fp8_dims_problem(linear.in_features, linear.out_features)
        if problem:
            raise ValueError(f"Float8Linear.from_linear: {problem}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.config = (config or Float8LinearConfig()).for_dims(linear.in_features, linear.out_features)
        weight = linear.weight
        new.weight = nn.Parameter(new.config.quantize_weight(weight), requires_grad=weight.requires_grad)
        new.bias = linear.bias
        new.input_scaling = ScalingState(new.config.input, device=weight.device)
        new.grad_output_scaling = ScalingState(new.config.grad_output, device=weight.device)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"Float8Linear: expected input with last dim {self.in_features}, got {tuple(x.shape)}")
        # Only passes that can train record activation amaxes: evaluation leaves the scaling history alone.
        record = torch.is_grad_enabled()
        return Float8LinearFunction.apply(
            x, self.weight, self.bias, self.input_scaling, self.grad_output_scaling, self.config, record, x.dtype,
            NO_HOOKS,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"weight={self.config.weight_fmt}, input={self.config.input.fmt}/{self.config.input.kind}, "
            f"grad_output={self.config.grad_output.fmt}/{self.config.grad_output.kind}, "
            f"grad_accumulation={self.config.grad_accumulation}, recipe={self.config.recipe}"
        )
