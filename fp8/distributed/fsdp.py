"""FP8 models under FSDP2 (``torch.distributed.fsdp.fully_shard``): what travels, in what format, counted.

``model, optimizer = fp8.initialize(model, optimizer, level)``, then ``fully_shard`` on each block and on the root, as
FSDP2 users write it. What happens then (docs/fsdp.md):

- **Weights at rest**: each rank keeps its rows of every FP8 weight, 1 byte per element (a ``DTensor`` whose local
  tensor is a :class:`fp8.Float8Tensor` sharing the weight's one scale), and the optimizer's masters and moments of
  those rows only (the optimizer cuts its full-size tensors to the rows FSDP2 gave each rank on its next call:
  :mod:`fp8.distributed.sharding`).
- **All-gather in FP8**: ``Float8Tensor.fsdp_pre_all_gather`` hands FSDP2 the payload's bytes, the scale rides as
  metadata. The optimizers agree every weight's scale over the shard group when they quantize (one MAX all-reduce of
  all amaxes per step), so every rank's rows were cast with the same scale and the gathered weight is one FP8 tensor,
  identical on every rank, equal to the single-process weight.
- **Reduce-scatter in FP8** (``FSDPConfig(reduce_scatter="fp8")``, the default): :class:`FP8ReduceScatter` puts
  the FP8 weights' gradients of FSDP2's flat buffer on the wire as E4M3 with one scale per weight shared by all ranks
  (one MAX all-reduce of the amaxes, plus a non-finite flag), moves them with one all-to-all (1 byte per element),
  and sums each rank's pieces in fp32; embedding tables' gradients (``FSDPConfig(embeddings="rowwise")``, the
  default) travel as E4M3 too, each sender's rows with their own power-of-two scale (sent beside them, 4 bytes a row),
  so a rarely used row keeps its precision; the unit's other high-precision parameters (norms, biases) take one
  reduce-scatter in the buffer's dtype. The sum never returns to FP8, so it cannot overflow: FP8-LM's automatic
  scaling factor mu (:mod:`fp8.distributed.auto_scale`), which guards the re-quantized sum of an all-reduce, has
  nothing to guard here; the shared scale from the global amax is the scaling. A non-finite FP8 weight gradient on any
  rank makes all the unit's reduced FP8 weight gradients NaN; the optimizers' finiteness check, agreed over the shard
  group, then skips the step on every rank (as for a non-finite high-precision gradient). ``"high"`` keeps FSDP2's own
  reduce-scatter in its ``reduce_dtype`` (``MixedPrecisionPolicy``; fp32 by default, bf16 for 2 bytes), counted.
- **Counted**: every FSDP2 all-gather and reduce-scatter of the model goes through :class:`fp8.comm.Collectives`
  (``FSDPConfig(counter=...)``), so bytes on the wire are counted at the calls, and traced when the counter has a
  trace.

Set up by :func:`follow_fsdp`, a forward pre-hook ``fp8.initialize`` registers on the model: at the first forward
after ``fully_shard`` it installs the comms on every ``FSDPModule`` and checks each FSDP2 unit (refusing, with the fix,
what cannot work), then does nothing more.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .. import ops
from ..comm import Collectives, CommBytesCounter
from ..formats import E4M3
from ..embedding import Float8Embedding
from ..linear import Float8Linear
from ..moe import Float8Experts
from ..tensor import Float8Tensor
from ..scaling import power_of_two_scale, set_amax_reduction_group
from .sharding import is_dtensor, local

__all__ = ["FSDPConfig", "REDUCE_SCATTER", "EMBEDDINGS", "FP8ReduceScatter", "ReduceScatterLayout", "CountedAllGather", "fp8_reduce_scatter", "follow_fsdp",
           "install_comms", "check_unit", "FSDPFollower"]

logger = logging.getLogger(__name__)

REDUCE_SCATTER = ("fp8", "high")
"""Values of ``FSDPConfig.reduce_scatter``: ``"fp8"`` (E4M3 on the wire, per-parameter shared scales, fp32 sums) or
``"high"`` (FSDP2's own reduce-scatter in its ``reduce_dtype``)."""

EMBEDDINGS = ("rowwise", "high")
"""Values of ``FSDPConfig.embeddings``: how ``nn.Embedding`` tables' gradients travel under ``reduce_scatter="fp8"``:
``"rowwise"`` (E4M3, each sender's power-of-two scale per table row sent beside its rows, fp32 sums) or ``"high"``
(with the norms and biases, in the buffer's dtype)."""


@dataclass(frozen=True)
class FSDPConfig:
    """How an ``fp8.initialize`` model communicates once FSDP2 shards it (``fp8.initialize(..., fsdp=...)``).

    ``reduce_scatter``: :data:`REDUCE_SCATTER`. ``agree_amaxes``: below. ``counter``: a :class:`fp8.comm.CommBytesCounter` that counts (and,
    with a trace, traces) every all-gather, reduce-scatter and scale agreement of the sharded model; None: uncounted.
    """

    reduce_scatter: str = "fp8"
    counter: CommBytesCounter | None = None
    agree_amaxes: bool = True
    """The activations' and gradients' scaling states agree their amaxes over the shard group (MAX; one all-reduce of
    all amaxes per step once their histories have started, :func:`fp8.set_amax_reduction_group`), so every rank casts
    with the scales the whole batch would give, as one process does."""

    embeddings: str = "rowwise"
    """:data:`EMBEDDINGS`: under ``reduce_scatter="fp8"``, ``nn.Embedding`` tables' gradients travel as E4M3 with each
    sender's scale per row (1 + 4 / embedding_dim bytes per element instead of the buffer's 4 or 2: a table is most of
    what a model's high-precision parameters send), or in the buffer's dtype (``"high"``). Ignored under
    ``reduce_scatter="high"``."""

    def __post_init__(self) -> None:
        if self.reduce_scatter not in REDUCE_SCATTER:
            raise ValueError(
                f"FSDPConfig.reduce_scatter must be one of {REDUCE_SCATTER}, got {self.reduce_scatter!r} ('fp8': E4M3 "
                f"on the wire with shared per-parameter scales; 'high': FSDP2's reduce-scatter in its reduce_dtype)")
        if self.embeddings not in EMBEDDINGS:
            raise ValueError(
                f"FSDPConfig.embeddings must be one of {EMBEDDINGS}, got {self.embeddings!r} ('rowwise': embedding "
                f"gradients as E4M3 with each sender's scale per row; 'high': in the reduce-scatter buffer's dtype)")
        if self.counter is not None and not isinstance(self.counter, CommBytesCounter):
            raise TypeError(f"FSDPConfig.counter must be an fp8.comm.CommBytesCounter or None, got "
                            f"{type(self.counter).__name__}")


class _Comms:
    """One :class:`Collectives` per process group, counting into ``counter``."""

    def __init__(self, counter: CommBytesCounter | None) -> None:
        self.counter = counter
        self._by_group: dict[str, Collectives] = {}

    def __call__(self, group: dist.ProcessGroup) -> Collectives:
        comm = self._by_group.get(group.group_name)
        if comm is None:
            comm = self._by_group[group.group_name] = Collectives(group, self.counter)
        return comm


class _Done:
    """A finished work handle (the FP8 reduce-scatter waits for its own collectives)."""

    def wait(self, *args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _finish(work, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


class CountedAllGather:
    """FSDP2's all-gather (its ``AllGather`` comm interface: ``allocate``, ``__call__``; installed with
    ``FSDPModule.set_custom_all_gather``) through :class:`fp8.comm.Collectives`, tag ``"fsdp all-gather"``: for a
    unit with FP8 weights, their payload bytes (FSDP2 packs a unit mixing FP8 and high-precision parameters as bytes)."""

    def __init__(self, comms: _Comms) -> None:
        self.comms = comms

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        return _finish(self.comms(group).all_gather(output_tensor, input_tensor, "fsdp all-gather"), async_op)


class ReduceScatterLayout:
    """One FSDP2 unit's reduce-scatter buffer as :func:`fp8_reduce_scatter` reads it: each parameter's elements per
    rank (``lengths``, FSDP2's order), whether it is an FP8 weight (``fp8``), and, for an embedding table whose
    gradient travels with a scale per row (``FSDPConfig(embeddings="rowwise")``), its row width (``rows``; 0 for every
    other parameter): each parameter is one run of columns of the buffer's rows. The FP8 weights' offsets are made
    once per device (:meth:`fp8_offsets`), so a reduce-scatter copies nothing from the host."""

    def __init__(self, lengths: list[int], fp8: list[bool], rows: list[int] | None = None) -> None:
        self.lengths = [int(n) for n in lengths]
        self.fp8 = list(fp8)
        self.rows = [int(r) for r in rows] if rows is not None else [0] * len(self.lengths)
        if len(self.fp8) != len(self.lengths) or len(self.rows) != len(self.lengths):
            raise ValueError(f"ReduceScatterLayout: {len(self.lengths)} lengths, {len(self.fp8)} fp8 flags and "
                             f"{len(self.rows)} row widths: give one of each per parameter")
        for n, f, r in zip(self.lengths, self.fp8, self.rows):
            if r and (f or r < 0 or n % r):
                raise ValueError(f"ReduceScatterLayout: a run of {n} elements with rows of {r} (fp8={f}): row-scaled "
                                 f"runs are whole rows of a high-precision table")
        starts = [sum(self.lengths[:i]) for i in range(len(self.lengths))]
        self.fp8_runs = [(st, n) for st, n, f in zip(starts, self.lengths, self.fp8) if f]
        self.row_runs = [(st, n, r) for st, n, r in zip(starts, self.lengths, self.rows) if r]
        self.high_runs = [(st, n) for st, n, f, r in zip(starts, self.lengths, self.fp8, self.rows) if not f and not r]
        self.width = sum(self.lengths)
        self._lengths_on: dict[str, torch.Tensor] = {}

    def fp8_offsets(self, device: torch.device) -> torch.Tensor:
        """Where each FP8 weight starts among the FP8 runs side by side, and their total (int64, one more than the
        weights), a device tensor made once per device (:func:`fp8.ops.segment_amax` and its siblings)."""
        t = self._lengths_on.get(str(device))
        if t is None:
            starts = [0]
            for _, n in self.fp8_runs:
                starts.append(starts[-1] + n)
            t = self._lengths_on[str(device)] = torch.tensor(starts, dtype=torch.int64, device=device)
        return t


def _runs(x: torch.Tensor, runs: list[tuple[int, int]], whole: bool) -> torch.Tensor:
    """The columns of ``runs`` of the ``(N, width)`` buffer ``x``, side by side (``x`` itself when they are all)."""
    if whole:
        return x
    return torch.cat([x.narrow(1, start, n) for start, n in runs], dim=1)


def _write_runs(out: torch.Tensor, runs: list[tuple[int, int]], values: torch.Tensor) -> None:
    """``out[run] = values[piece]`` for each run, in one multi-tensor copy."""
    if len(runs) == 1 and runs[0][1] == out.numel():
        out.copy_(values)
        return
    torch._foreach_copy_([out.narrow(0, start, n) for start, n in runs],
                         list(values.split([n for _, n in runs])))


class FP8ReduceScatter:
    """FSDP2's reduce-scatter (its ``ReduceScatter`` comm interface; ``FSDPModule.set_custom_reduce_scatter``) for one
    FSDP2 unit: with ``fp8``, :func:`fp8_reduce_scatter` on the unit's ``layout``; otherwise FSDP2's own (its op, its
    buffer's dtype) through :class:`fp8.comm.Collectives`, tag ``"fsdp reduce-scatter"``."""

    def __init__(self, comms: _Comms, layout: ReduceScatterLayout, fp8: bool) -> None:
        self.comms = comms
        self.layout = layout
        self.fp8 = fp8

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        comm = self.comms(group)
        if not self.fp8:
            return _finish(comm.reduce_scatter(output_tensor, input_tensor, "fsdp reduce-scatter", op=op), async_op)
        fp8_reduce_scatter(output_tensor, input_tensor, comm, op, self.layout)
        return _Done() if async_op else None


def _averages(op) -> bool:
    """Whether FSDP2's reduce ``op`` is AVG (True) or SUM (False); any other op is refused."""
    if op == dist.ReduceOp.AVG:
        return True
    if op == dist.ReduceOp.SUM:
        return False
    raise NotImplementedError(
        f"the FP8 reduce-scatter takes FSDP2's SUM or AVG, got {op}; leave set_gradient_divide_factor unset, or "
        f"use fp8.initialize(..., fsdp=FSDPConfig(reduce_scatter='high'))")


@torch.no_grad()
def fp8_reduce_scatter(output: torch.Tensor, input: torch.Tensor, comm: Collectives, op,
                       layout: ReduceScatterLayout) -> None:
    """``output`` = this rank's chunk of the sum (``op`` SUM) or mean (AVG) over ranks of ``input`` (FSDP2's flat
    reduce-scatter buffer: ``N`` rows, row ``j`` for rank ``j``, each row the unit's parameters' pieces as ``layout``
    says). The FP8 weights' pieces travel as E4M3:

    1. each FP8 weight's amax over its pieces (finite values) and a non-finite flag, agreed by one MAX all-reduce;
    2. ``payload = e4m3(clamp(x * s_p))``, ``s_p = power_of_two_scale(amax_p, 448)``, the same on every rank;
    3. one all-to-all of the bytes (row ``j`` to rank ``j``): ``(N-1)/N`` bytes per element;
    4. the ``N`` received rows summed in fp32 and divided by ``s_p`` (times ``N`` to average); all the FP8 weights'
       values NaN where any rank held a non-finite one (the optimizers' agreed finiteness check then skips the step on
       every rank, as it does for a non-finite high-precision gradient).

    Embedding tables' pieces (``layout.rows``) travel as E4M3 too, but each sender casts its rows with their own
    power-of-two scales (:func:`fp8.ops.quantize_rows`: one E4M3 scale per tensor could flush rarely used rows), sent
    beside them (a second all-to-all, 4 bytes a row); the receiver sums them in fp32 (:func:`fp8.ops.row_chunk_sum`).
    A non-finite value there stays NaN in its element, which the optimizers' agreed finiteness check sees.

    The other high-precision parameters' pieces (norms, biases: few elements) take one reduce-scatter in the buffer's
    dtype; so does the whole buffer when it is not laid out as ``layout`` (a parameter without a gradient this step)
    or holds nothing to cast.
    """
    world = comm.world_size
    divisor = float(world) if _averages(op) else 1.0
    x = input.view(world, -1)
    width = x.shape[1]
    out = output.view(-1)
    if width != layout.width or not (layout.fp8_runs or layout.row_runs):
        # a layout this unit did not announce (a parameter without a gradient this step) or nothing to cast: FSDP2's
        # own reduce-scatter in the buffer's dtype (never E4M3 under a scale another tensor set)
        comm.reduce_scatter(output, input, "fsdp reduce-scatter", op=op).wait()
        return
    if layout.high_runs:
        high = _runs(x, layout.high_runs, False)
        reduced = torch.empty(high.shape[1], dtype=high.dtype, device=high.device)
        comm.reduce_scatter(reduced, high.reshape(-1), "fsdp reduce-scatter", op=op).wait()
        _write_runs(out, layout.high_runs, reduced)
    if layout.row_runs:
        _rowwise_reduce_scatter(x, out, comm, layout.row_runs, divisor)
    if not layout.fp8_runs:
        return
    xf = _runs(x, layout.fp8_runs, not layout.high_runs and not layout.row_runs)
    offsets = layout.fp8_offsets(x.device)
    agreed = ops.segment_amax(xf, offsets)  # one read: every weight's amax, and the flag
    comm.all_reduce(agreed, op=dist.ReduceOp.MAX, tag="fsdp fp8 grad amax").wait()
    payload, scale_inv = ops.segment_cast(xf, offsets, agreed, "e4m3")  # one read, written where it is sent from
    received = torch.empty_like(payload)
    comm.all_to_all(received.view(-1), payload.view(-1), "fsdp fp8 reduce-scatter").wait()
    result = ops.segment_sum(received, offsets, scale_inv, agreed, divisor)
    _write_runs(out, layout.fp8_runs, result)


def _rowwise_reduce_scatter(x: torch.Tensor, out: torch.Tensor, comm: Collectives, runs: list[tuple[int, int, int]],
                            divisor: float) -> None:
    """The embedding tables' runs of the ``(N, width)`` buffer ``x`` reduce-scattered into ``out`` (this rank's flat
    chunk): each run's rows cast to E4M3 with this sender's scale per row, the payloads in one all-to-all, the scales
    in another, each run's ``N`` received pieces summed in fp32 with their senders' scales, over ``divisor``."""
    world = x.shape[0]
    payloads, inverses = [], []
    for start, n, width in runs:
        data, inv = ops.quantize_rows(x.narrow(1, start, n).reshape(-1, width), "e4m3")  # (world * n / width, width)
        payloads.append(data.view(world, n))
        inverses.append(inv.view(world, n // width))
    payload = payloads[0] if len(runs) == 1 else torch.cat(payloads, dim=1)
    scale_inv = inverses[0] if len(runs) == 1 else torch.cat(inverses, dim=1)
    received, received_inv = torch.empty_like(payload), torch.empty_like(scale_inv)
    comm.all_to_all(received.view(-1), payload.view(-1), "fsdp rowwise reduce-scatter").wait()
    comm.all_to_all(received_inv.view(-1), scale_inv.view(-1), "fsdp rowwise scales").wait()
    at = row = 0
    for start, n, width in runs:
        rows = n // width
        total = ops.row_chunk_sum(received.narrow(1, at, n), received_inv.narrow(1, row, rows), divisor)
        out.narrow(0, start, n).copy_(total)
        at, row = at + n, row + rows


def _unit_params(module: nn.Module) -> list:
    """The ``FSDPParam`` records of an ``FSDPModule``'s unit, in FSDP2's order (its reduce-scatter layout)."""
    state = module._get_fsdp_state()
    group = state._fsdp_param_group
    return [] if group is None else list(group.fsdp_params)


def check_unit(fqn: str, module: nn.Module) -> None:
    """Refuse an FSDP2 unit the FP8 model cannot run in, naming the fix: block-scaled FP8 weights (their scale blocks
    would split at shard boundaries), and a unit whose gradients would have several dtypes (FSDP2 reduces one dtype
    per unit: FP8 weights report fp32, a model's bf16 parameters bf16)."""
    name = fqn or "<root>"
    dtypes = {}
    for fsdp_param in _unit_params(module):
        shard = local(fsdp_param.sharded_param)
        pname = fsdp_param._param_fqn or "?"
        owner = fsdp_param._module_info.module
        if isinstance(owner, (Float8Experts, Float8Embedding)):
            raise NotImplementedError(
                f"FSDP2 unit {name!r}: {type(owner).__name__} weight {pname!r}: fp8's optimizers do not follow FP8 MoE "
                f"experts or FP8 embedding tables sharded by FSDP2 yet; keep them out of FP8 before fully_shard "
                f"(fp8.initialize(..., module_filter_fn=...) for experts, fp8_embeddings=False)")
        if isinstance(shard, Float8Tensor) and shard.block is not None:
            raise NotImplementedError(
                f"FSDP2 unit {name!r}: FP8 weight {pname!r} has block scales ({shard.block}); FSDP2 shards tensor-wise "
                f"FP8 weights only: fp8.initialize(..., recipe='tensorwise') before fully_shard")
        if fsdp_param.sharded_param.requires_grad:
            # the dtype its unsharded gradient will have: the policy's param_dtype, else the parameter's
            dtypes.setdefault(fsdp_param.mp_policy.param_dtype or fsdp_param.sharded_param.dtype, []).append(pname)
    if len(dtypes) > 1:
        found = "; ".join(f"{dtype}: {', '.join(names[:3])}" for dtype, names in dtypes.items())
        raise TypeError(
            f"FSDP2 unit {name!r} mixes FP8 weights with high-precision parameters of another dtype, so its gradients "
            f"would have several dtypes ({found}), which FSDP2 cannot reduce together; keep the model's parameters in "
            f"fp32 and give fully_shard mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) (FSDP2's mixed "
            f"precision: FP8 weights then report bf16 too), or fully_shard the high-precision modules as units of "
            f"their own")


def _row_width(fsdp_param, config: FSDPConfig) -> int:
    """The row width an ``nn.Embedding`` table's gradient is reduce-scattered with (one scale per row per sender:
    ``FSDPConfig(embeddings="rowwise")`` under ``reduce_scatter="fp8"``), 0 for every other parameter."""
    if config.reduce_scatter != "fp8" or config.embeddings != "rowwise":
        return 0
    owner = fsdp_param._module_info.module
    size = fsdp_param.padded_sharded_param_size
    if not isinstance(owner, nn.Embedding) or fsdp_param._module_info.param_name != "weight" or len(size) != 2:
        return 0
    return int(size[1])


def install_comms(model: nn.Module, config: FSDPConfig) -> int:
    """Check every FSDP2 unit of ``model`` (:func:`check_unit`) and give it the counted all-gather and the
    reduce-scatter of ``config``; returns the number of units."""
    from torch.distributed.fsdp import FSDPModule

    comms = _Comms(config.counter)
    units = 0
    for fqn, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        check_unit(fqn, module)
        params = _unit_params(module)
        if not params:
            continue
        grads = [p for p in params if p.sharded_param.requires_grad]
        layout = ReduceScatterLayout([int(p.padded_sharded_param_size.numel()) for p in grads],
                                     [isinstance(local(p.sharded_param), Float8Tensor) for p in grads],
                                     [_row_width(p, config) for p in grads])
        module.set_custom_all_gather(CountedAllGather(comms))
        module.set_custom_reduce_scatter(FP8ReduceScatter(comms, layout, config.reduce_scatter == "fp8"))
        units += 1
    return units


class FSDPFollower:
    """The forward pre-hook ``fp8.initialize`` registers on its model (:func:`follow_fsdp`): until the model is
    sharded it checks, on the host, whether an FP8 weight became a DTensor; at the first forward after
    ``fully_shard`` it installs the comms (:func:`install_comms`), logs the units, and stops looking."""

    def __init__(self, model: nn.Module, config: FSDPConfig) -> None:
        self.config = config
        self.modules = [m for m in model.modules() if isinstance(m, Float8Linear)]
        self.done = False

    def __call__(self, model: nn.Module, args) -> None:
        if self.done or not any(is_dtensor(m._parameters.get("weight")) for m in self.modules):
            return
        units = install_comms(model, self.config)
        if self.config.agree_amaxes:
            weight = next(m._parameters["weight"] for m in self.modules if is_dtensor(m._parameters.get("weight")))
            group = weight.device_mesh.get_group()
            set_amax_reduction_group(model, group, Collectives(group, self.config.counter))
        self.done = True
        logger.info("fp8: FSDP2 sharding found: %d unit(s), FP8 all-gather, %s reduce-scatter", units,
                    "FP8" if self.config.reduce_scatter == "fp8" else "high-precision")


def follow_fsdp(model: nn.Module, config: FSDPConfig) -> FSDPFollower:
    """Register :class:`FSDPFollower` on ``model`` (a forward pre-hook); returns it (``.done`` once set up)."""
    follower = FSDPFollower(model, config)
    model.register_forward_pre_hook(follower)
    return follower
