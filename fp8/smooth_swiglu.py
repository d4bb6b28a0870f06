"""Smooth-SwiGLU (Fishman et al. 2024, "Scaling FP8 training to trillion-token LLMs"): the input of a gated MLP's
down projection scaled per channel before its FP8 cast, the inverse scales folded into the weight operand, so the
layer computes the same function in exact arithmetic and outlier channels never saturate.

A gated MLP computes ``h = act(x W1^T) * (x W2^T)`` and ``y = h W3^T``; channels of ``h`` whose two branches' weights
align grow outliers late in training (Fishman et al.), which a tensor-wise delayed scale, set from past amaxes, clamps
to the format's maximum. Here the down projection computes, for ``s`` one power of two per input channel ``c`` from
that channel's amax over the tokens (:func:`fp8.ops.power_of_two_scale`: the amax mapped into ``(fmax / 2, fmax]``)::

    y = Q(h * s) @ Q(W3 * diag(1 / s))^T        ( = h @ W3^T in exact arithmetic)

Every channel of ``h * s`` has its amax in ``(fmax / 2, fmax]``: nothing saturates, whatever the outliers. Powers of
two make the scaling exact: ``Q(h * s) / s`` is ``h`` rounded per channel (the same rounding as a tensor-wise cast
wherever neither saturates nor underflows), and ``W3 / s`` is the FP8 weight's own values shifted by whole binades,
exact but where a value falls below the format's normal range in its row (:func:`weight_operand_exact`: the smallest
weights of quiet channels, 1-2% of them with 256x outliers; their products are the smallest of the sum).

Where the scales are applied (the trade-off). ``s`` is *current*, computed from the tensor being cast, and ``1 / s``
goes into the forward GEMM's weight operand, re-quantized from the FP8 weight at each forward (one pass over the
1-byte weight). The weight at rest, its master in the optimizer, checkpoints and exports stay ``W3`` itself: the
smoothing lives in the forward GEMM's operands only, and nothing else changes (optimizer dynamics, weight decay,
resumption, serving, tensor parallelism: a row-parallel shard's channels are its own, over all tokens). The
alternative, ``s`` held between optimizer steps and folded into the stored FP8 weight (or its master), saves that
weight pass but (1) is a delayed per-channel scale, which saturates again when a channel's amax jumps between updates
(the failure this targets); (2) the input gradient needs ``W3`` itself (``dh = dY @ W3``): a second weight copy, or a
per-channel rescale of ``dh`` (a pass over the activation gradient per backward); (3) masters, checkpoints, exports
and weight decay would see ``W3 / s`` unless unscaled, and Adam is not invariant to a per-column reparameterization.

The GEMMs (:mod:`fp8.linear`'s core, unchanged: the smoothing is a quantizer pair, :func:`make_smoothed_quantizers`,
as a recipe's are):

- forward: ``a = Q(h * s)`` (row-wise operand, unit scales), ``b = Q(W3 / s)^T`` with one scale per output channel
  (a row-wise-scaled GEMM: scales constant along K);
- input gradient: ``dh = Q(dY) @ W3``: the stored FP8 weight and its kept transpose, as the tensor-wise recipe (the
  gradient of ``h`` involves no ``s``);
- weight gradient: ``dW3 = Q(dY)^T @ h_q`` with ``h_q = Q(h * s) / s`` the same cast's column-wise operand (one scale
  per channel: its ``1 / s``): the gradient of ``W3`` itself.

Launches per smoothed linear, forward + backward on the hardware GEMM path (:class:`fp8.launches.LaunchCounter`, each
op a launch; ``benchmarks/smooth_swiglu.py``): 12 against the tensor-wise delayed recipe's 7. Forward 6 against 2:
:func:`fp8.ops.quantize_cols_t` (the channel amaxes and the transposed cast in one kernel, replacing the
cast-transpose; it reads ``h`` twice), :func:`fp8.ops.transpose_fp8` (the row-major copy the forward GEMM reads, 1
byte per element), :func:`fp8.ops.quantize_rows` over the 1-byte weight (``W3 / s`` per output channel), the GEMM,
and two small ones: the unit row scales of ``a`` (one value per token) and ``1 / s`` times the weight's ``1 / scale``
(one per input channel). Backward 6 against 5: the tensor-wise recipe's, its weight-gradient GEMM's tensor-wise
``dY`` scale expanded to a column (one value per output channel) beside ``h_q``'s per-channel scales. Full-size passes:
2 more (the FP8 transpose and the weight pass, where the weight is as large as the activation).

Where: :func:`smooth_swiglu` for transformers gated MLPs (``gate_proj``/``up_proj``/``down_proj``/``act_fn``:
Llama, Mistral, Qwen2, Qwen3, ...) after ``fp8.initialize``; :func:`smooth_config` for megatron-core's ``linear_fc2``
(:func:`megatron.training.gpt_layer_specs.get_gpt_layer_fp8_spec`'s ``swiglu_smooth``). The scale granularity is the
``tensorwise`` recipe's (the ``rowwise``/``blockwise``/MX recipes scale every token or tile from its own current amax
and never saturate; they are refused, naming the fix).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch
from torch import nn

from . import ops
from .blocks import COLWISE, ROWWISE, TENSORWISE
from .formats import get_format
from .gemm import Operand
from .linear import Float8Linear, Float8LinearConfig
from .quantizers import ActivationQuantizer, LinearQuantizers, TensorwiseQuantizer, TensorwiseWeightQuantizer
from .recipes import Recipe
from .scaling import ScalingState, power_of_two_scale

__all__ = [
    "SMOOTH_OPTION", "SMOOTHED_RECIPE", "SmoothSwiGLUConfig", "smooth_config", "smooth_problem", "make_smoothed_quantizers",
    "SmoothedInputQuantizer", "SmoothedWeightQuantizer", "SmoothSwiGLULinear", "smooth_swiglu", "is_gated_mlp",
    "smoothing_scales", "weight_operand_exact",
]

logger = logging.getLogger(__name__)

SMOOTH_OPTION = ("smooth_swiglu", True)
"""The recipe option that marks a smoothed linear's recipe (:attr:`fp8.recipes.Recipe.options`): it keys the shared
input casts apart from the plain tensor-wise recipe's (:class:`fp8.linear.InputCasts`)."""


def smoothing_scales(h: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """``s`` ``(1, channels)``: per channel (last dimension) of ``h``, the power of two mapping the channel's finite
    amax over all tokens into ``(fmax / 2, fmax]`` (1.0 for a channel without a non-zero finite value): the scales
    :class:`SmoothedInputQuantizer`'s kernel (:func:`fp8.ops.quantize_cols_t`) computes. A reference for tests and
    benchmarks (the training path never calls it)."""
    values = h.detach().reshape(-1, h.shape[-1]).to(torch.float32)
    amax = values.abs().nan_to_num(nan=0.0, posinf=0.0).amax(dim=0, keepdim=True)
    return power_of_two_scale(amax, get_format(fmt).max, 0, 1.0)


class _Smoothing:
    """What one forward's input cast hands its weight quantizer: ``1 / s`` ``(1, in)``."""

    __slots__ = ("col_inv",)

    def __init__(self) -> None:
        self.col_inv: torch.Tensor | None = None


class SmoothedInputQuantizer(ActivationQuantizer):
    """The down projection's input ``h`` (2-D ``(tokens, channels)``): one kernel (:func:`fp8.ops.quantize_cols_t`)
    finds each channel's amax and writes ``Q(h * s)`` transposed with ``1 / s`` per channel (the weight gradient's
    column-wise operand), then :func:`fp8.ops.transpose_fp8` its row-major copy, the forward GEMM's ``a`` with unit
    scales (its ``s`` is folded into the weight operand by :class:`SmoothedWeightQuantizer`). ``state``: the linear's
    input scaling state, read only for its statistics (``ScalingState.stats``: the smoothed tensor ``h * s`` observed
    with scale 1 on observed steps); the cast records no amax (its scales are current)."""

    def __init__(self, state: ScalingState, smoothing: _Smoothing) -> None:
        self.state = state
        self.fmt = state.config.fmt
        self.smoothing = smoothing

    def _cast(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        data_t, col_inv = ops.quantize_cols_t(x, self.fmt, self.pad)
        self.smoothing.col_inv = col_inv
        return data_t, col_inv

    def quantize(self, x, record, columnwise, dst_cols=None, t_width=0):
        if dst_cols is not None:
            raise ValueError("Smooth-SwiGLU smooths a dense down projection: grouped experts' tokens (MoE grouped GEMM) "
                             "have no smoothed cast; build the experts without swiglu_smooth")
        data_t, col_inv = self._cast(x)
        m = x.shape[0]
        # the row-major copy; transpose_fp8 also returns 1 / its 0-d scale argument, unused here
        rows_data, _ = ops.transpose_fp8(data_t, self.state.scale, 1)
        rows = Operand(rows_data[:m], torch.ones((m, 1), dtype=torch.float32, device=x.device), ROWWISE)
        stats = self.state.stats
        if stats is not None and record and getattr(stats, "active", True):  # observed steps only: one extra pass
            stats.observe(x.to(torch.float32) * col_inv.reciprocal(), torch.ones((), device=x.device),
                          self.state.format)
        return rows, (Operand(data_t, col_inv.reshape(-1, 1), ROWWISE) if columnwise else None)

    def columnwise(self, x):
        data_t, col_inv = self._cast(x)
        return Operand(data_t, col_inv.reshape(-1, 1), ROWWISE)

    def columnwise_from(self, rows, dst_cols=None, t_width=0):
        raise ValueError("Smooth-SwiGLU's down projection makes its weight-gradient operand with its forward cast; its "
                         "input is never gathered (a row-parallel linear) nor grouped: build it as a plain or "
                         "row-parallel linear (fp8.smooth_swiglu.SmoothSwiGLULinear, fp8.parallel.RowParallelLinear)")


class SmoothedWeightQuantizer(TensorwiseWeightQuantizer):
    """A tensor-wise FP8 weight ``W`` of a smoothed linear: the forward GEMM's ``b`` is ``W / s`` (``s`` from this
    forward's input cast) re-quantized with one scale per output channel by one kernel (:func:`fp8.ops.quantize_rows`
    on the 1-byte payload, ``1 / s`` and the weight's ``1 / scale`` applied on the way in; exact where no value falls
    below the normal range of its row); the input-gradient GEMM's ``W`` is the tensor-wise recipe's (the stored
    weight, its transpose kept between optimizer steps)."""

    def __init__(self, fmt: str, smoothing: _Smoothing) -> None:
        self.fmt = fmt
        self.smoothing = smoothing

    def forward_b(self, payload, scale, weight, backend, target=None):
        col_inv = self.smoothing.col_inv
        if col_inv is None:
            raise RuntimeError("a smoothed linear's weight operand needs its input's per-channel scales from the same "
                               "forward; the input cast came from a shared memo: build the linear with input_casts=None "
                               "(fp8.smooth_swiglu.SmoothSwiGLULinear, the parallel linears do)")
        data, row_inv = ops.quantize_rows(payload, self.fmt, col_inv / scale.to(torch.float32))
        return Operand(data.t(), row_inv.t(), COLWISE)


def make_smoothed_quantizers(input_state: ScalingState, grad_output_state: ScalingState, weight_fmt: str,
                             smooth_swiglu: bool = True) -> LinearQuantizers:
    """The quantizers of one smoothed linear's forward (the :class:`fp8.recipes.Recipe` factory of
    :attr:`SmoothSwiGLUConfig.recipe_spec`): :class:`SmoothedInputQuantizer` and :class:`SmoothedWeightQuantizer`
    sharing this forward's scales, the output gradient the tensor-wise recipe's (delayed, its own state)."""
    smoothing = _Smoothing()
    return LinearQuantizers(SmoothedInputQuantizer(input_state, smoothing), TensorwiseQuantizer(grad_output_state),
                            SmoothedWeightQuantizer(weight_fmt, smoothing))


@dataclass(frozen=True)
class SmoothSwiGLUConfig(Float8LinearConfig):
    """A :class:`fp8.Float8LinearConfig` of the ``tensorwise`` recipe whose linear smooths its input per channel
    (module docstring): its :attr:`recipe_spec` makes :func:`make_smoothed_quantizers`. Every field means what it
    does for the plain config (``input.fmt``: the smoothed cast's format; its delayed-scaling settings are unused:
    the per-channel scales are current). Make one with :func:`smooth_config`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        problem = smooth_problem(self)
        if problem is not None:
            raise ValueError(problem)

    @property
    def recipe_spec(self) -> Recipe:
        """:data:`SMOOTHED_RECIPE`."""
        return SMOOTHED_RECIPE


SMOOTHED_RECIPE = Recipe("tensorwise", ROWWISE, TENSORWISE, TENSORWISE, TENSORWISE, TENSORWISE, COLWISE, "e5m2",
                         factory=make_smoothed_quantizers, options=(SMOOTH_OPTION,))
"""The recipe of a smoothed linear: the tensor-wise recipe (its name: delayed E5M2 output gradients, a tensor-wise
weight at rest and in the input-gradient GEMM) with the smoothed operands' blocks (the forward GEMM row-wise scaled:
unit rows of ``Q(h * s)``, one scale per output channel of ``W / s``; the input's column-wise operand one scale per
channel) and :func:`make_smoothed_quantizers` as its factory (:data:`SMOOTH_OPTION` passed to it). A constant, so a
traced forward (``torch.compile``) reads it without building one."""


def smooth_problem(config: Float8LinearConfig) -> str | None:
    """Why ``config``'s linear cannot be smoothed, naming the fix, or None."""
    if config.recipe != "tensorwise":
        return (f"Smooth-SwiGLU smooths the tensorwise recipe's down projection, not the {config.recipe!r} recipe's "
                f"(its per-token or per-tile current scales never saturate): use recipe 'tensorwise' (--fp8-recipe "
                f"tensorwise), or leave the MLPs unsmoothed (drop --swiglu-smooth / the smooth_swiglu call)")
    return None


def smooth_config(config: Float8LinearConfig) -> SmoothSwiGLUConfig:
    """``config`` as a :class:`SmoothSwiGLUConfig` (the same fields); a ``ValueError`` naming the fix for a recipe
    other than ``tensorwise`` (:func:`smooth_problem`)."""
    if isinstance(config, SmoothSwiGLUConfig):
        return config
    problem = smooth_problem(config)
    if problem is not None:
        raise ValueError(problem)
    return SmoothSwiGLUConfig(**{f.name: getattr(config, f.name) for f in dataclasses.fields(Float8LinearConfig)})


class SmoothSwiGLULinear(Float8Linear):
    """A :class:`fp8.Float8Linear` whose input is smoothed per channel (module docstring): the same parameters,
    scaling states and state-dict keys, a :class:`SmoothSwiGLUConfig`, and no shared input casts (its input is read
    by no other linear, and its weight operand needs the scales of its own cast). Made from a converted down
    projection by :meth:`from_float8_linear` (:func:`smooth_swiglu` does it)."""

    @classmethod
    def from_float8_linear(cls, linear: Float8Linear) -> "SmoothSwiGLULinear":
        """A smoothed linear holding ``linear``'s own weight and bias ``Parameter`` s (the optimizer's master weights
        keep mapping to them) and its scaling states."""
        if not isinstance(linear, Float8Linear):
            raise TypeError(f"SmoothSwiGLULinear.from_float8_linear takes an fp8.Float8Linear, got "
                            f"{type(linear).__name__}: convert the model first (fp8.initialize)")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.input_casts = None
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.config = smooth_config(linear.config)
        new.weight = linear.weight
        new.bias = linear.bias
        new.input_scaling = linear.input_scaling
        new.grad_output_scaling = linear.grad_output_scaling
        new.stored_transposed = linear.stored_transposed
        return new

    def extra_repr(self) -> str:
        return super().extra_repr() + ", smooth_swiglu=True"


_GATED_MLP_PARTS = ("gate_proj", "up_proj", "down_proj")


def is_gated_mlp(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers gated MLP (``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: Llama,
    Mistral, Qwen2, Qwen3 and their relatives), by its children ``gate_proj``, ``up_proj``, ``down_proj`` and its
    ``act_fn`` (duck typing: transformers is not imported)."""
    return all(isinstance(getattr(module, name, None), nn.Module) for name in _GATED_MLP_PARTS) and \
        callable(getattr(module, "act_fn", None))


def smooth_swiglu(model: nn.Module) -> int:
    """Smooth the down projection of every transformers gated MLP of ``model`` (:func:`is_gated_mlp`) in place: its
    :class:`fp8.Float8Linear` becomes a :class:`SmoothSwiGLULinear` holding the same parameters (the optimizer
    returned by ``fp8.initialize`` keeps stepping them; checkpoints keep their keys). Call after ``fp8.initialize``
    and before wrapping the model (DDP, FSDP2's ``fully_shard``, ``torch.compile``). Returns the number of MLPs
    changed (0 when all were smoothed already).

    A ``ValueError`` names the fix when the model has no gated MLP, when no down projection of one is an FP8 linear
    (call ``fp8.initialize`` first; one kept in high precision, e.g. by ``min_fp8_dim``, needs no smoothing and is
    left alone, logged at INFO), or when a down projection runs a recipe other than ``tensorwise``."""
    mlps = [(name, module) for name, module in model.named_modules() if is_gated_mlp(module)]
    if not mlps:
        raise ValueError("smooth_swiglu: the model has no gated MLP (a module with gate_proj, up_proj, down_proj and "
                         "act_fn, as Llama/Mistral/Qwen2/Qwen3 have); Megatron GPT models smooth theirs with "
                         "get_gpt_layer_fp8_spec(swiglu_smooth=True) (--swiglu --swiglu-smooth)")
    fp8_mlps = [(name, m) for name, m in mlps if isinstance(m.down_proj, Float8Linear)]
    if not fp8_mlps:
        raise ValueError(f"smooth_swiglu: none of the model's {len(mlps)} gated MLPs has an FP8 down_proj "
                         f"(fp8.Float8Linear): call fp8.initialize(model, optimizer, opt_level='O1' or higher) first, "
                         f"then smooth_swiglu(model)")
    for name, module in mlps:
        if not isinstance(module.down_proj, Float8Linear):
            logger.info("fp8: %s.down_proj stays in high precision (%s): nothing to smooth", name or "<root>",
                        type(module.down_proj).__name__)
    for name, module in fp8_mlps:  # every problem before anything changes
        problem = smooth_problem(module.down_proj.config)
        if problem is not None:
            raise ValueError(f"smooth_swiglu: {name or '<root>'}.down_proj: {problem}")
    changed = 0
    for name, module in fp8_mlps:
        if isinstance(module.down_proj, SmoothSwiGLULinear):
            continue
        module.down_proj = SmoothSwiGLULinear.from_float8_linear(module.down_proj)
        changed += 1
    logger.info("fp8: Smooth-SwiGLU on the down projections of %d gated MLP(s) (%d already smoothed)", changed,
                len(fp8_mlps) - changed)
    return changed


def weight_operand_exact(weight_values: torch.Tensor, s: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """Which elements of ``W / s`` (``weight_values`` ``(out, in)`` the FP8 weight's values, ``s`` ``(1, in)``) the
    per-output-channel re-quantization of :class:`SmoothedWeightQuantizer` keeps exactly (bool, ``(out, in)``): those
    whose value in their row's scale is a value of the format (an FP8 value shifted by a power of two is one unless
    it falls below the normal range, where it loses mantissa bits or flushes). For tests and benchmarks."""
    f = get_format(fmt)
    shifted = weight_values.to(torch.float64) / s.to(torch.float64)
    row_scale = power_of_two_scale(shifted.abs().amax(dim=1, keepdim=True).to(torch.float32), f.max, 0, 1.0)
    scaled = (shifted * row_scale.to(torch.float64)).to(torch.float32)  # exact: an FP8 value times powers of two
    return scaled.to(f.dtype).to(torch.float64) == scaled.to(torch.float64)
