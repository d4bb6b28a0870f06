"""``--moe-grouped-gemm``: a rank's local experts as one grouped GEMM per projection (:class:`FP8GroupedMLP`).

megatron-core's ``MoELayer`` builds :class:`FP8GroupedMLP` in place of ``SequentialMLP`` (the layer spec's
``moe_grouped_gemm``, :func:`megatron.training.gpt_layer_specs.get_gpt_layer_fp8_spec`). It is
:class:`megatron.training.moe.SeededSequentialMLP` for everything but the forward:

- construction: the same experts, built the same way (megatron-core's ``MLP`` with fp8lm's parallel linears, each
  seeded from its global expert index), so the weights, their names (``local_experts.{i}.linear_fc1.weight``), the
  generator state after the experts, the initial master weights (:func:`fp8.parallel.take_initial_masters`), each
  linear's precision (``--fp8-min-dim``, ``--first-last-layers-bf16``, ``--fp8-precision-config``), the FP8
  start-up summary (each expert projection counted as the FP8 linear it is) and megatron-core's ``allreduce = False``
  under expert parallelism are those of the sequential experts: a grouped and a sequential run start identical (a
  sequential run's checkpoint lacks the grouped projections' scaling states, so a grouped run refuses to load it,
  naming them). Each expert's weight is its own FP8 :class:`fp8.Float8Tensor` (own scale, own
  gradient per ``grad_accumulation``), so every opt level, fp8lm's ``DistributedDataParallel`` and O3's ownership
  handle them as any FP8 weight.
- forward: each projection (``linear_fc1``, ``linear_fc2``) of all local experts runs as one grouped linear over
  the tokens sorted by expert (megatron-core's ``tokens_per_expert``): FP8 tensorwise,
  :class:`fp8.grouped_gemm.GroupedLinearFunction` (the input cast once with one delayed-scaling state per
  projection, ``torch._scaled_grouped_mm`` for the forward GEMM on a GPU that has it); FP8 rowwise/blockwise,
  :class:`fp8.grouped_gemm.GroupedBlockLinearFunction` (per-token scales, the expert linear's GEMMs per group);
  high precision (``--fp8-opt-level none`` and layers kept out of FP8), :class:`_HighPrecisionGroupedFunction`, the
  high-precision expert linear's GEMMs per group, bit for bit. Bias, activation (gated linear units included) and
  the router's probabilities are applied as megatron-core's ``MLP`` applies them in ``SequentialMLP``.
- padding: in FP8 each expert's token count is padded with zero rows to the GEMMs' multiple
  (:data:`PAD_MULTIPLE`: the weight-gradient GEMM sums over an expert's tokens, and ``torch._scaled_mm`` takes K in
  multiples of 16, the block GEMM in multiples of 128). Padding rows get probability 0, so they are zero through
  both projections (an fc1 bias included), add nothing to an amax or a weight gradient, and are dropped from the
  output; an expert without tokens gets no rows.

Expert tensor parallelism is not supported (the arguments check refuses ``--moe-grouped-gemm`` with
``--tensor-model-parallel-size`` > 1; the constructor refuses an expert tensor-parallel group of more than one rank).
FP8 statistics (``--fp8-stats-interval``, :mod:`fp8.stats`) report each expert's weight, but not the grouped casts
of the experts' inputs and output gradients: the expert linears' own scaling states, which the statistics watch, are
not used by the grouped GEMMs (the grouped states are this module's ``fc1_input_scaling`` etc.).
"""

from __future__ import annotations

import itertools

import torch

from fp8.grouped_gemm import GroupedBlockLinearFunction, GroupedLinearFunction, group_bounds
from fp8.linear import Float8LinearConfig
from fp8.parallel.linear import compute_dtype
from fp8.recipes import RECIPES, get_recipe
from fp8.scaling import ScalingState

from .moe import SeededSequentialMLP

__all__ = ["FP8GroupedMLP", "PAD_MULTIPLE", "padded_sizes", "ExpertPadding"]

PAD_MULTIPLE = {name: get_recipe(name).token_multiple for name in RECIPES}  # the GEMMs' K multiple per recipe
"""Rows each expert's token count is padded to a multiple of, per FP8 recipe: the K of its weight-gradient GEMM
(``torch._scaled_mm``: multiples of 16; the block GEMM: of 128)."""


def padded_sizes(sizes: list[int], multiple: int) -> list[int]:
    """Each group's rows padded up to a multiple of ``multiple`` (an empty group stays empty)."""
    return [-(-n // multiple) * multiple for n in sizes]


class ExpertPadding:
    """The padded layout of tokens sorted by expert: ``rows`` (on ``device``) are the padded rows holding the
    tokens, in order; :meth:`pad` scatters into zeros, :meth:`unpad` gathers back (both differentiable);
    :meth:`offsets` are the padded groups' cumulative ends (int32, on ``device``).

    Both index tensors are built on the device from host integers passed as kernel arguments (an ``arange`` or a
    ``full`` per group), never copied from host memory: a copy from pageable host memory synchronises the host
    with the device."""

    def __init__(self, sizes: list[int], multiple: int, device: torch.device) -> None:
        self.sizes = padded_sizes(sizes, multiple)
        self.total = sum(self.sizes)
        self.device = device
        self.rows = None
        if self.sizes != sizes:
            starts = list(itertools.accumulate(self.sizes, initial=0))
            self.rows = torch.cat([torch.arange(start, start + n, device=device) for start, n in zip(starts, sizes)])

    def offsets(self) -> torch.Tensor:
        """The padded groups' cumulative ends, int32 on the device (``torch._scaled_grouped_mm``'s ``offs``)."""
        ends = itertools.accumulate(self.sizes)
        return torch.cat([torch.full((1,), end, dtype=torch.int32, device=self.device) for end in ends]
                         or [torch.zeros(0, dtype=torch.int32, device=self.device)])

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows is None:
            return x
        return x.new_zeros((self.total, *x.shape[1:])).index_copy(0, self.rows, x)

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.rows is None else y.index_select(0, self.rows)


class _HighPrecisionGroupedFunction(torch.autograd.Function):
    """``y[rows of g] = x[rows of g] @ W_g^T`` in the compute dtype ``dtype``, group by group: the GEMMs of the
    high-precision expert linears (``fp8.parallel``'s ``_HighPrecisionColumnFunction``/``_HighPrecisionRowFunction``
    of an expert: no collective), operand for operand, so equal to them bit for bit.
    ``apply(x, sizes, dtype, *weights)``."""

    @staticmethod
    def forward(ctx, x, sizes, dtype, *weights):
        x2d = x.to(dtype)
        outs = [torch.mm(x2d[start:end], w.t().to(dtype)) for (start, end), w in zip(group_bounds(sizes), weights)]
        ctx.save_for_backward(x2d, *weights)
        ctx.sizes, ctx.dtype = list(sizes), dtype
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, *weights = ctx.saved_tensors
        g2d = grad_out.to(ctx.dtype)
        bounds = group_bounds(ctx.sizes)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.cat([torch.mm(g2d[start:end], w.to(ctx.dtype)) for (start, end), w in zip(bounds, weights)])
        grad_ws = [torch.mm(g2d[start:end].t(), x2d[start:end]).to(w.dtype) if ctx.needs_input_grad[3 + g] else None
                   for g, ((start, end), w) in enumerate(zip(bounds, weights))]
        return (grad_x, None, None, *grad_ws)


def _projection_fp8(linears: list, name: str) -> Float8LinearConfig | None:
    """The one precision of a projection's expert linears (their FP8 config, or None: high precision)."""
    configs = {linear.fp8 for linear in linears}
    if len(configs) != 1:
        raise ValueError(f"FP8GroupedMLP: the experts' {name} linears differ in precision ({configs}); a grouped GEMM "
                         f"runs one recipe for all of them (give every expert of a layer the same precision rule)")
    return configs.pop()


class FP8GroupedMLP(SeededSequentialMLP):
    """A rank's local experts with each projection as one grouped linear (module docstring): megatron-core's
    ``SequentialMLP`` contract (``(num_local_experts, config, submodules, pg_collection)``; ``forward(tokens sorted by
    expert, tokens_per_expert, probs) -> (output, None)``), the experts built as :class:`SeededSequentialMLP` builds
    them (``submodules``: megatron-core's ``MLPSubmodules`` of fp8lm's parallel linears)."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None) -> None:
        super().__init__(num_local_experts, config, submodules, pg_collection)
        if self.tp_group is not None and self.tp_group.size() > 1:
            raise ValueError(f"FP8GroupedMLP runs unsplit experts (expert tensor-parallel size 1), not "
                             f"{self.tp_group.size()}: use --tensor-model-parallel-size 1, or drop --moe-grouped-gemm")
        experts = list(self.local_experts)
        self.fc1_fp8 = _projection_fp8([e.linear_fc1 for e in experts], "linear_fc1") if experts else None
        self.fc2_fp8 = _projection_fp8([e.linear_fc2 for e in experts], "linear_fc2") if experts else None
        # One scaling state per tensor-wise projection for all its experts (one cast of the grouped tokens), on the
        # default device as the linears' own.
        for prefix, fp8 in (("fc1", self.fc1_fp8), ("fc2", self.fc2_fp8)):
            tensorwise = fp8 is not None and fp8.recipe_spec.tensorwise
            setattr(self, f"{prefix}_input_scaling", ScalingState(fp8.input) if tensorwise else None)
            setattr(self, f"{prefix}_grad_output_scaling", ScalingState(fp8.grad_output) if tensorwise else None)
        self.pad_multiple = max([PAD_MULTIPLE[fp8.recipe] for fp8 in (self.fc1_fp8, self.fc2_fp8) if fp8 is not None],
                                default=1)

    def _project(self, name: str, x: torch.Tensor, padding: ExpertPadding, dtype: torch.dtype,
                 offsets: dict) -> torch.Tensor:
        """Projection ``name`` (``"fc1"``/``"fc2"``) of every local expert on its rows of ``x`` (laid out as
        ``padding``): one grouped linear. ``offsets`` caches the padded groups' device offsets for the layer."""
        weights = [getattr(e, f"linear_{name}").weight for e in self.local_experts]
        fp8 = getattr(self, f"{name}_fp8")
        sizes = padding.sizes
        if fp8 is None:
            return _HighPrecisionGroupedFunction.apply(x, sizes, dtype, *weights)
        if not fp8.recipe_spec.tensorwise:
            return GroupedBlockLinearFunction.apply(x, sizes, fp8, dtype, *weights)
        if "offsets" not in offsets:
            offsets["offsets"] = padding.offsets()
        return GroupedLinearFunction.apply(x, offsets["offsets"], sizes, getattr(self, f"{name}_input_scaling"),
                                           getattr(self, f"{name}_grad_output_scaling"), fp8, torch.is_grad_enabled(),
                                           dtype, *weights)

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        """megatron-core's ``MLP`` activation (its unfused path: fp8lm turns the fusions off)."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(h)
        x_glu, x_linear = torch.chunk(h, 2, dim=-1)
        if (val := config.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        return config.activation_func(x_glu) * (x_linear + config.glu_linear_offset)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        """``(output, None)``: each token through its expert's MLP, scaled by its routing probability (after the
        activation, and the fc2 bias with it, as ``SequentialMLP``'s experts do), in the input's token order."""
        hidden, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:
            if self.config.moe_router_topk != 1:
                raise ValueError("moe_apply_probs_on_input only works with moe_router_topk=1 (megatron-core's rule)")
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)  # applied already
        # The counts megatron-core's dispatcher hands over on the host (its all-to-all dispatcher copies them there
        # and waits for the copy once per layer): every grouped GEMM slices by them, and the device offsets and rows
        # are built from them on the device (ExpertPadding), so the layer adds no host sync of its own.
        sizes = [int(n) for n in torch.as_tensor(tokens_per_expert).tolist()]
        if len(sizes) != self.num_local_experts or sum(sizes) != hidden.shape[0]:
            raise ValueError(f"FP8GroupedMLP: tokens_per_expert {sizes} for {self.num_local_experts} local experts and "
                             f"{hidden.shape[0]} tokens; pass one count per local expert, summing to the tokens")
        padding = ExpertPadding(sizes, self.pad_multiple, hidden.device)
        x, p = padding.pad(hidden), padding.pad(probs)  # padding rows: zero tokens of probability 0
        dtype = compute_dtype(x)
        experts = list(self.local_experts)
        offsets = {}  # the tensorwise projections' device offsets, built once for both
        h = self._project("fc1", x, padding, dtype, offsets)
        if experts and experts[0].linear_fc1.bias is not None:
            h = torch.cat([h_g + e.linear_fc1.bias for h_g, e in zip(h.split(padding.sizes), experts)])
        h = self._activation(h)
        h = (h * p.unsqueeze(-1)).to(h.dtype)
        y = self._project("fc2", h, padding, dtype, offsets)
        if experts and experts[0].linear_fc2.bias is not None:
            y = torch.cat([(y_g + e.linear_fc2.bias.unsqueeze(0) * p_g.unsqueeze(-1)).to(y.dtype)
                           for y_g, p_g, e in zip(y.split(padding.sizes), p.split(padding.sizes), experts)])
        return padding.unpad(y), None

    def extra_repr(self) -> str:
        names = [("high precision" if fp8 is None else f"fp8 {fp8.recipe}") for fp8 in (self.fc1_fp8, self.fc2_fp8)]
        return (f"num_local_experts={self.num_local_experts}, grouped GEMMs: linear_fc1 {names[0]}, linear_fc2 "
                f"{names[1]}, tokens padded to multiples of {self.pad_multiple}")
