"""Column- and row-parallel linears with megatron-core's constructor and forward contract, in FP8.

Constructors take megatron-core's arguments (``input_size, output_size, *, config, init_method, bias,
gather_output / input_is_parallel, skip_bias_add, stride, tp_group, ...``); ``config`` is read for
``sequence_parallel``, ``params_dtype`` and ``perform_initialization`` only, so any object with those
attributes works (megatron-core's ``TransformerConfig`` in practice). ``forward`` returns
``(output, bias)`` with ``bias`` None unless ``skip_bias_add``. Weights carry megatron's tensor-parallel
attributes (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``); biases added after a
sequence-parallel reduce-scatter carry ``sequence_parallel=True`` (their gradients must be summed over
the tensor-parallel group, as for sequence-parallel norms).

``fp8=Float8LinearConfig(...)`` (the default of the ``FP8*`` classes) runs :class:`fp8.Float8Linear`'s
autograd function (:class:`fp8.linear.Float8LinearFunction`), the collectives below passed in as
:class:`fp8.linear.LinearHooks`: E4M3 weight shard (a :class:`Float8Tensor` parameter), E4M3 input, E5M2 output
gradient (E4M3 under the ``rowwise``/``blockwise`` recipes, :mod:`fp8.recipes`), FP8 GEMMs with fp32 accumulation; the weight gradient is held per ``fp8.grad_accumulation``
(a scaled FP16 buffer by default, 2 bytes per element, accurate over micro-batches; see :mod:`fp8.linear`). Communication:

===========================  =========================================  ==========================================
layer / pass                 sequence parallel                          tensor parallel only
===========================  =========================================  ==========================================
column, forward              all-gather of the E4M3 input (1 B/value)   none (input replicated)
column, backward             FP8 reduce-scatter of dX (dY's format)     all-reduce of dX (high precision)
row, forward                 FP8 reduce-scatter of Y (E4M3, fp32 sum)   all-reduce of Y (high precision)
row, backward                all-gather of the FP8 dY (1 B/value)       none (dY replicated)
===========================  =========================================  ==========================================

An expert's linear (``is_expert=True``: megatron-core's mixture-of-experts ``SequentialMLP``) issues none of these:
megatron-core's token dispatcher brings each rank its tokens already gathered over the expert tensor-parallel group
(``tp_group``) and sums the experts' partial outputs itself; with expert parallelism its parameters carry
``allreduce=False`` (megatron-core's mark: reduced over the expert-data-parallel group, not the data-parallel one).

Tensor-wise scales of a tensor that crosses the group are agreed over the group (amax all-reduced with MAX), so
all ranks cast with the scale the single-process layer would use. Per-row and per-tile scales (the
``rowwise``/``blockwise`` recipes) are each rank's own: they travel with the rows they scale (``"sp all-gather
scales"``), and blocks never straddle two ranks where the shard dimensions are multiples of the block (a row
or a 128-wide tile), so the layers equal the single-process ones bit for bit there. Weight shards are quantized
on their own rank (tensor-wise: their own scale; equal to the single-process weight except for values below
E4M3's normal range).
``fp8=None`` is the high-precision baseline: the same layers, the same collectives in high precision,
counted the same way (its own two small autograd functions).

The initial high-precision weight shard of an FP8 layer is kept as ``initial_master`` until the
optimizer takes it (:func:`take_initial_masters`), so master weights start from the exact initial
values, not from their FP8 rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import CommBytesCounter
from ..linear import NO_HOOKS, Float8LinearConfig, Float8LinearFunction, LinearHooks, fp8_dims_problem
from ..scaling import ScalingConfig, ScalingState
from .comm import TensorParallelComm
from .init import initialize_sharded_weight

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "FP8ColumnParallelLinear", "FP8RowParallelLinear",
    "take_initial_masters", "ParallelLinearBase", "compute_dtype",
]


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by the tensor-parallel size ({denominator}); choose a "
            f"tensor-parallel size that divides it"
        )
    return numerator // denominator


class ParallelLinearBase(nn.Module):
    """Shared set-up of the column- and row-parallel linears."""

    partition_dim: int

    def __init__(
        self, input_size: int, output_size: int, *, config: Any, init_method: Callable | None, bias: bool,
        skip_bias_add: bool, stride: int, tp_group: dist.ProcessGroup | None, fp8: Float8LinearConfig | None,
        counter: CommBytesCounter | None, is_expert: bool = False,
    ) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        # An expert's linear (megatron-core's MoE, is_expert=True) runs on the tokens the MoE token dispatcher
        # brought to this rank, gathered over the expert tensor-parallel group (tp_group) already, and the
        # dispatcher sums its outputs: the linear itself issues no tensor-parallel collective (megatron-core's
        # "explicit expert communication").
        self.is_expert = bool(is_expert)
        self.sequence_parallel = bool(getattr(config, "sequence_parallel", False)) and not self.is_expert
        self.fp8 = fp8
        self.comm = TensorParallelComm(tp_group, counter)
        tp = self.comm.world_size
        self.tp_size = tp
        if self.sequence_parallel and tp == 1:
            self.sequence_parallel = False
        params_dtype = getattr(config, "params_dtype", torch.float32)
        full_shape = (output_size, input_size)
        local = _divide(full_shape[self.partition_dim], tp, "output_size" if self.partition_dim == 0 else "input_size")
        local_out, local_in = (local, input_size) if self.partition_dim == 0 else (output_size, local)
        problem = fp8_dims_problem(local_in, local_out) if fp8 is not None else None
        if problem:
            raise ValueError(
                f"{type(self).__name__}: the weight shard of a {output_size} x {input_size} weight over tensor-parallel "
                f"size {tp}: {problem}; pick hidden/FFN sizes that are multiples of 16 x the tensor-parallel size"
            )
        if fp8 is not None:
            fp8 = self.fp8 = fp8.for_dims(local_in, local_out, type(self).__name__)
        init = init_method if getattr(config, "perform_initialization", True) else None
        weight = initialize_sharded_weight(full_shape, self.partition_dim, self.comm.rank, tp, init, stride,
                                           torch.float32)
        if fp8 is None:
            self.weight = nn.Parameter(weight.to(params_dtype))
            self.initial_master = None
        else:
            self.weight = nn.Parameter(fp8.quantize_weight(weight, params_dtype))
            self.initial_master = weight
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = self.partition_dim
        self.weight.partition_stride = stride
        # megatron-core's mark of a parameter reduced over the data-parallel group; an expert's parameters with
        # expert parallelism are reduced over the expert-data-parallel group instead.
        expert_parallel = self.is_expert and int(getattr(config, "expert_model_parallel_size", 1) or 1) > 1
        self.weight.allreduce = not expert_parallel
        if bias:
            self.bias = nn.Parameter(torch.zeros(local_out, dtype=params_dtype))
            self.bias.allreduce = not expert_parallel
        else:
            self.register_parameter("bias", None)
        if fp8 is not None:
            agreed = self.comm.collectives if tp > 1 else None
            self.input_scaling = ScalingState(fp8.input)
            self.grad_output_scaling = ScalingState(fp8.grad_output)
            for state in (self.input_scaling, self.grad_output_scaling):
                state.amax_comm = agreed

    def _scatter_scaling(self, fmt: str) -> ScalingState:
        """Scaling state of an FP8 reduce-scatter: current scaling, agreed over the group."""
        state = ScalingState(ScalingConfig(fmt=fmt, kind="current"))
        state.amax_comm = self.comm.collectives
        return state

    def _gather(self, payload: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence-parallel all-gather of an FP8 payload with its scale: a 0-d scale is agreed over the group
        (the payload alone travels); a grid of per-row or per-tile scales travels with its rows."""
        if scale.dim() == 0:
            return self.comm.all_gather(payload, "sp all-gather"), scale
        return self.comm.all_gather(payload, "sp all-gather"), self.comm.all_gather(scale, "sp all-gather scales")

    def _all_reduce(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Tensor-parallel all-reduce of a GEMM's fp32 output, in ``dtype``."""
        return self.comm.all_reduce(tensor.to(dtype), "tp all-reduce")

    def extra_repr(self) -> str:
        precision = "high precision" if self.fp8 is None else f"fp8 weight={self.fp8.weight_fmt}"
        return (
            f"input_size={self.input_size}, output_size={self.output_size}, tp={self.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}, bias={self.bias is not None}, {precision}"
        )


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype activations are computed and saved in: autocast's (e.g. BF16) when it is on, else ``x``'s."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def _own_tensor(out: torch.Tensor, shape: tuple) -> torch.Tensor:
    """``out`` in ``shape`` as a tensor of its own to autograd (not a view of the function's intermediate):
    megatron-core adds into a linear's output in place (an expert's bias), which autograd refuses on a view."""
    return torch.ops.aten._unsafe_view(out.contiguous(), shape)


class _HighPrecisionColumnFunction(torch.autograd.Function):
    """The high-precision baseline: Y_shard = gather(X) @ W_shard^T (+ b_shard); backward reduces dX over
    the group."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        comm, sp = layer.comm, layer.sequence_parallel
        dtype = compute_dtype(x)
        x2d = x.reshape(-1, x.shape[-1]).to(dtype)
        full = comm.all_gather(x2d, "sp all-gather") if sp else x2d
        out = torch.mm(full, weight.t().to(dtype))
        ctx.save_for_backward(full, weight)
        if bias is not None:
            out = out + bias.to(out.dtype)
        ctx.layer, ctx.has_bias, ctx.x_shape, ctx.dtype = layer, bias is not None, x.shape, dtype
        lead = (x.shape[0] * comm.world_size, *x.shape[1:-1]) if sp else tuple(x.shape[:-1])
        return _own_tensor(out, (*lead, weight.shape[0]))

    @staticmethod
    def backward(ctx, grad_out):
        full, weight = ctx.saved_tensors
        layer = ctx.layer
        comm, sp = layer.comm, layer.sequence_parallel
        g2d = grad_out.reshape(-1, grad_out.shape[-1]).to(ctx.dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            dx = torch.mm(g2d, weight.to(ctx.dtype))
            if not layer.is_expert:
                dx = comm.reduce_scatter(dx, "sp reduce-scatter") if sp else comm.all_reduce(dx, "tp all-reduce")
            grad_x = dx.reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = torch.mm(g2d.t(), full).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g2d.sum(0)
        return grad_x, grad_w, grad_b, None


class _HighPrecisionRowFunction(torch.autograd.Function):
    """The high-precision baseline: Y = reduce(X_shard @ W_shard^T) over the group (scattered along the
    sequence with SP)."""

    @staticmethod
    def forward(ctx, x, weight, layer):
        comm, sp = layer.comm, layer.sequence_parallel
        dtype = compute_dtype(x)
        x2d = x.reshape(-1, x.shape[-1]).to(dtype)
        out = torch.mm(x2d, weight.t().to(dtype))
        if not layer.is_expert:
            out = comm.reduce_scatter(out, "sp reduce-scatter") if sp else comm.all_reduce(out, "tp all-reduce")
        ctx.save_for_backward(x2d, weight)
        ctx.layer, ctx.x_shape, ctx.dtype = layer, x.shape, dtype
        lead = (x.shape[0] // comm.world_size, *x.shape[1:-1]) if sp else tuple(x.shape[:-1])
        return _own_tensor(out, (*lead, weight.shape[0]))

    @staticmethod
    def backward(ctx, grad_out):
        saved_x, weight = ctx.saved_tensors
        layer = ctx.layer
        comm, sp = layer.comm, layer.sequence_parallel
        g2d = grad_out.reshape(-1, grad_out.shape[-1]).to(ctx.dtype)
        full_g = comm.all_gather(g2d.contiguous(), "sp all-gather") if sp else g2d
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(full_g, weight.to(ctx.dtype)).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_w = torch.mm(full_g.t(), saved_x).to(weight.dtype)
        return grad_x, grad_w, None


class ColumnParallelLinear(ParallelLinearBase):
    """``Y = X A^T + b`` with ``A`` split along its output dimension over the tensor-parallel group.

    megatron-core's ``ColumnParallelLinear`` contract; ``fp8`` selects FP8 (a
    :class:`fp8.Float8LinearConfig`) or high precision (``None``); ``counter`` counts the collectives.
    With sequence parallelism the input is this rank's sequence shard ``[s/tp, b, h]`` and is gathered
    (in FP8 when ``fp8`` is set); the output is this rank's output-feature shard ``[s, b, out/tp]``
    (all of them if ``gather_output``).
    """

    partition_dim = 0

    def __init__(
        self, input_size: int, output_size: int, *, config: Any, init_method: Callable | None = None,
        bias: bool = True, gather_output: bool = False, stride: int = 1, keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False, skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: list | None = None, grad_output_buffer: list | None = None,
        is_expert: bool = False, tp_comm_buffer_name: str | None = None, disable_grad_reduce: bool = False,
        tp_group: dist.ProcessGroup | None = None, fp8: Float8LinearConfig | None = None,
        counter: CommBytesCounter | None = None,
    ) -> None:
        if skip_weight_param_allocation:
            raise ValueError("skip_weight_param_allocation is not supported by fp8lm's parallel linears")
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         skip_bias_add=skip_bias_add, stride=stride, tp_group=tp_group, fp8=fp8, counter=counter,
                         is_expert=is_expert)
        if is_expert and gather_output:
            raise ValueError("an expert's ColumnParallelLinear cannot gather_output (the token dispatcher combines)")
        self.gather_output = gather_output
        if self.bias is not None:
            self.bias.tensor_model_parallel = True
            self.bias.partition_dim = 0
            self.bias.partition_stride = stride
        if fp8 is not None and self.sequence_parallel:
            self.grad_input_scatter_scaling = self._scatter_scaling(fp8.recipe_spec.grad_format(fp8.grad_output.fmt))

    def _fp8_hooks(self) -> LinearHooks:
        """The FP8 recipe's collectives: all-gather of the E4M3 input and FP8 reduce-scatter of dX with
        sequence parallelism; all-reduce of dX otherwise; none for an expert's linear."""
        if self.is_expert:
            return NO_HOOKS
        if self.sequence_parallel:
            return LinearHooks(gather_input=self._gather, reduce_grad_input=self._scatter_grad_input)
        return LinearHooks(reduce_grad_input=self._all_reduce)

    def _scatter_grad_input(self, dx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.comm.fp8_reduce_scatter(dx, self.grad_input_scatter_scaling, dtype, tag="sp reduce-scatter")

    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output, bias)``: ``bias`` is returned unapplied when ``skip_bias_add``, else None."""
        if weight is not None and weight is not self.weight:
            raise ValueError("passing a weight to forward is not supported by fp8lm's parallel linears")
        if input_.shape[-1] != self.input_size:
            raise ValueError(f"{type(self).__name__}: expected input last dim {self.input_size}, got {tuple(input_.shape)}")
        bias = None if self.skip_bias_add else self.bias
        if self.fp8 is None:
            out = _HighPrecisionColumnFunction.apply(input_, self.weight, bias, self)
        else:
            out = Float8LinearFunction.apply(
                input_, self.weight, bias, self.input_scaling, self.grad_output_scaling, self.fp8,
                torch.is_grad_enabled(), compute_dtype(input_), self._fp8_hooks(), None,
            )
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self.tp_size > 1:
            out = _GatherLastDim.apply(out, self.comm)
        return out, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(ParallelLinearBase):
    """``Y = X A^T + b`` with ``A`` split along its input dimension over the tensor-parallel group.

    megatron-core's ``RowParallelLinear`` contract (``input_is_parallel`` must be True: the input is
    this rank's feature shard ``[s, b, in/tp]``). The output is summed over the group: scattered along
    the sequence ``[s/tp, b, h]`` with sequence parallelism (FP8 reduce-scatter when ``fp8`` is set),
    all-reduced in high precision otherwise. The bias is added after the reduction.
    """

    partition_dim = 1

    def __init__(
        self, input_size: int, output_size: int, *, config: Any, init_method: Callable | None = None,
        bias: bool = True, input_is_parallel: bool = True, skip_bias_add: bool = False, stride: int = 1,
        keep_master_weight_for_test: bool = False, is_expert: bool = False, tp_comm_buffer_name: str | None = None,
        tp_group: dist.ProcessGroup | None = None, fp8: Float8LinearConfig | None = None,
        counter: CommBytesCounter | None = None,
    ) -> None:
        if not input_is_parallel:
            raise ValueError("fp8lm's RowParallelLinear needs input_is_parallel=True (as every GPT layer uses it)")
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         skip_bias_add=skip_bias_add, stride=stride, tp_group=tp_group, fp8=fp8, counter=counter,
                         is_expert=is_expert)
        if self.bias is not None:
            self.bias.sequence_parallel = self.sequence_parallel
        if fp8 is not None and self.sequence_parallel:
            self.output_scatter_scaling = self._scatter_scaling(fp8.input.fmt)

    def _fp8_hooks(self) -> LinearHooks:
        """The FP8 recipe's collectives: FP8 reduce-scatter of Y and all-gather of the E5M2 dY with
        sequence parallelism; all-reduce of Y otherwise; none for an expert's linear."""
        if self.is_expert:
            return NO_HOOKS
        if self.sequence_parallel:
            return LinearHooks(reduce_output=self._scatter_output, gather_grad_output=self._gather)
        return LinearHooks(reduce_output=lambda out, dtype, record: self._all_reduce(out, dtype))

    def _scatter_output(self, out: torch.Tensor, dtype: torch.dtype, record: bool) -> torch.Tensor:
        return self.comm.fp8_reduce_scatter(out, self.output_scatter_scaling, dtype, record=record,
                                            tag="sp reduce-scatter")

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output, bias)``: ``bias`` is returned unapplied when ``skip_bias_add``, else None."""
        expected = self.input_size // self.tp_size
        if input_.shape[-1] != expected:
            raise ValueError(f"{type(self).__name__}: expected input last dim {expected}, got {tuple(input_.shape)}")
        if self.fp8 is None:
            out = _HighPrecisionRowFunction.apply(input_, self.weight, self)
        else:
            out = Float8LinearFunction.apply(
                input_, self.weight, None, self.input_scaling, self.grad_output_scaling, self.fp8,
                torch.is_grad_enabled(), compute_dtype(input_), self._fp8_hooks(), None,
            )
        if self.skip_bias_add:
            return out, self.bias
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out, None


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dimension (high precision); backward keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        gathered = comm.all_gather(x.movedim(-1, 0).contiguous(), "tp gather-output")
        return gathered.movedim(0, -1).contiguous()

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        return grad.chunk(comm.world_size, dim=-1)[comm.rank].contiguous(), None


def _fp8_default() -> Float8LinearConfig:
    return Float8LinearConfig()


class FP8ColumnParallelLinear(ColumnParallelLinear):
    """:class:`ColumnParallelLinear` in FP8 (``fp8`` defaults to ``Float8LinearConfig()``)."""

    def __init__(self, *args: Any, fp8: Float8LinearConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, fp8=fp8 or _fp8_default(), **kwargs)


class FP8RowParallelLinear(RowParallelLinear):
    """:class:`RowParallelLinear` in FP8 (``fp8`` defaults to ``Float8LinearConfig()``)."""

    def __init__(self, *args: Any, fp8: Float8LinearConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, fp8=fp8 or _fp8_default(), **kwargs)


def take_initial_masters(module: nn.Module) -> dict[nn.Parameter, torch.Tensor]:
    """``{fp8_weight: initial high-precision shard}`` for every FP8 parallel linear in ``module``, and
    forget them there (the optimizer keeps them as its master weights from now on)."""
    masters = {}
    for layer in module.modules():
        if isinstance(layer, ParallelLinearBase) and layer.initial_master is not None:
            masters[layer.weight] = layer.initial_master
            layer.initial_master = None
    return masters
