"""``FP8Optimizer``: the base of the precision-decoupled optimizers (Adam, AdamW, SGD).

Each parameter's state is stored compressed per :class:`OptimizerPrecision`: a payload in the role's
storage dtype plus an fp32 power-of-two scale (keys ``<role>`` and ``<role>_scale``). Parameters that
cannot carry their own master value get a master copy in ``state["master"]``: FP8 weights
(:class:`Float8Tensor`) in the ``master`` precision, 16-bit parameters in fp32; FP32 parameters are
their own master. The update runs in fp32;
new scales come from the updated values (opt-in ``precision.state_scaling="delayed"``: from the previous
step's amax of each state, current where the new amax does not fit; amax histories in ``<key>_amax``); after the step each FP8 weight is re-quantized from its
master. A step whose gradients hold inf or NaN is skipped without touching any state: the decision is
taken on device (every write is masked by one finiteness flag), so a step needs no host synchronisation;
``skipped_steps`` is a device counter, read (and any new skip logged) when the host asks for it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
from torch import nn

from ..kernels.backend import KERNEL_BACKENDS, interpreter_enabled, resolve_backend, triton_available
from ..blocks import quantize_to_blocks
from ..cast import payload_and_scale, quantize
from ..comm import Collectives, CommBytesCounter
from ..distributed.sharding import ParamSlots, local, swap_params
from ..scaling import amax_of, discard_step_amaxes, update_scales
from ..recipes import refresh_weight_operands
from ..tensor import Float8Tensor
from . import ops
from .levels import level_name
from .skipped import SkippedStepsCounter
from .precision import (
    STOCHASTIC_GRIDS, STORAGE_FORMATS, OptimizerPrecision, StorageFormat, decode, delayed_or_current_scale, encode,
    encode_delayed,
)

__all__ = ["FP8Optimizer", "grads_are_finite", "grads_finite_flag", "grad_value", "skip_step", "select_where",
           "op_backend"]

logger = logging.getLogger(__name__)


def grad_value(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as an fp32 tensor (scaled gradients, FP8 or FP16, dequantized)."""
    if payload_and_scale(grad) is not None:
        return grad.dequantize(torch.float32)
    return grad.to(torch.float32)


def skip_step(optimizer: torch.optim.Optimizer, scaling_module: nn.Module | None) -> None:
    """Record a step skipped for non-finite gradients: count it in ``optimizer.skipped_steps``, log it,
    and drop the step's amaxes from ``scaling_module``'s scaling histories."""
    optimizer.skipped_steps += 1
    logger.warning("fp8: non-finite gradient, optimizer step skipped (%d skipped so far)", optimizer.skipped_steps)
    if scaling_module is not None:
        discard_step_amaxes(scaling_module)


def grads_are_finite(params: Iterable[torch.Tensor]) -> bool:
    """Whether every gradient of ``params`` is finite (scaled gradients' payloads and scales included).

    One host synchronisation for all tensors together (:func:`grads_finite_flag` has none).
    """
    return bool(grads_finite_flag(params))


def op_backend(kernel_backend: str, tensors) -> str:
    """The ``backend`` of the multi-tensor ops (:mod:`fp8.optim.ops`) for ``kernel_backend`` (``"auto"``,
    ``"torch"``, ``"triton"``) on ``tensors``: ``"auto"`` is Triton where every tensor is on CUDA and Triton is
    installed (also while ``torch.compile`` traces: the ops are opaque to it), the torch reference elsewhere;
    ``"triton"`` raises (naming the fix) where it cannot run."""
    tensors = list(tensors)
    if kernel_backend == "auto":
        on_cuda = bool(tensors) and all(t.is_cuda for t in tensors)
        return "triton" if on_cuda and triton_available() and not interpreter_enabled() else "torch"
    return resolve_backend(kernel_backend, *tensors)


def _grad_tensors(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Every tensor of ``params``' gradients whose values must be finite: payloads and scales of scaled gradients,
    plain gradients."""
    out = []
    for p in params:
        if p.grad is None:
            continue
        grad = local(p.grad)  # under FSDP2: this rank's rows
        parts = payload_and_scale(grad)  # FP8 or FP16 payload with its scale(s)
        out.extend(parts if parts is not None else (grad,))
    return out


def grads_finite_flag(params: Iterable[torch.Tensor], kernel_backend: str = "auto") -> torch.Tensor:
    """0-d bool tensor on device: whether every gradient of ``params`` is finite (scaled gradients' payloads and
    scales included). No host sync; a fixed number of ops (a zeroed flag, one multi-tensor check
    :func:`fp8.optim.ops.mark_nonfinite_`, the comparison), whatever the number of gradients."""
    tensors = _grad_tensors(params)
    if not tensors:
        return torch.ones((), dtype=torch.bool)
    flag = torch.zeros(1, dtype=torch.int32, device=tensors[0].device)
    ops.mark_nonfinite_(tensors, flag, backend=op_backend(kernel_backend, tensors))
    return (flag == 0).reshape(())


select_where = ops.select_where


class _Workspace:
    """A step's per-row scratch tensors: ``old`` scales ``(rows, 5)``, bias corrections ``bc`` ``(rows, 2)``,
    ``amax`` ``(rows, 3)``, ``new`` scales ``(rows, 4)`` (fp32, one buffer) and the skip flag ``bad`` (int32)."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows = rows
        buffer = torch.empty(rows * 14, dtype=torch.float32, device=device)
        self.old = buffer[: rows * 5].view(rows, 5)
        self.bc = buffer[rows * 5: rows * 7].view(rows, 2)
        self.amax = buffer[rows * 7: rows * 10].view(rows, 3)
        self.new = buffer[rows * 10:].view(rows, 4)
        self.bad = torch.empty(1, dtype=torch.int32, device=device)
        self.steps: torch.Tensor | None = None  # stochastic rounding: the step counts before the step, one per row


class FP8Optimizer(SkippedStepsCounter, torch.optim.Optimizer):
    """Base class: compressed states, master weights, skip on non-finite gradients, exact checkpoints.

    Subclasses define ``_moment_roles(group)`` (state keys and their precision role) and ``_update(w, g,
    state, group)`` which updates the fp32 master value ``w`` in place given the fp32 gradient ``g``.
    ``skipped_steps`` counts steps skipped for non-finite gradients. Constructor keywords (every
    subclass takes them):

    - ``scaling_module``: the model whose delayed-scaling step each optimizer step closes (amaxes of a
      skipped step dropped, scales updated); ``fp8.initialize`` passes the model. None: no scaling state.
    - ``kernel_backend`` (``"auto"``, ``"torch"``, ``"triton"``; see :mod:`fp8.kernels.backend`): the
      update's implementation where a subclass has a fused kernel (Adam/AdamW on CUDA with Triton).
    """

    def __init__(
        self,
        params,
        defaults: dict[str, Any],
        precision: OptimizerPrecision | str = "O2",
        initial_masters: dict[torch.Tensor, torch.Tensor] | None = None,
        *,
        scaling_module: nn.Module | None = None,
        kernel_backend: str = "auto",
        comm_counter: CommBytesCounter | None = None,
    ) -> None:
        if kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {kernel_backend!r}")
        if scaling_module is not None and not isinstance(scaling_module, nn.Module):
            raise TypeError(f"scaling_module must be an nn.Module (the model) or None, got {type(scaling_module).__name__}")
        self.precision = OptimizerPrecision.preset(precision) if isinstance(precision, str) else precision
        self.kernel_backend = kernel_backend
        self.scaling_module = scaling_module
        self._slots = ParamSlots(scaling_module)
        self._comm_counter = comm_counter
        self._shard_comm: Collectives | None = None
        super().__init__(params, defaults)
        self._slots.remember(self.param_groups)
        first = next((p for group in self.param_groups for p in group["params"]), None)
        device = first.device if first is not None else torch.device("cpu")
        self._init_skipped_counter(device)
        initial_masters = initial_masters or {}
        for group in self.param_groups:
            for p in group["params"]:
                # Parameters given a master start from it even if frozen now (unfrozen later, the
                # master must be the high-precision original, not the FP8-rounded weight).
                if p.requires_grad or p in initial_masters:
                    self._init_state(p, group, initial_masters.get(p))

    # -- state layout ---------------------------------------------------------------------------
    @staticmethod
    def needs_master(p: torch.Tensor) -> bool:
        """Whether ``p`` keeps a separate master copy (FP8 weights and 16-bit parameters)."""
        return isinstance(p, Float8Tensor) or p.dtype in (torch.float16, torch.bfloat16)

    def _store(self, state: dict, key: str, role: str, value: torch.Tensor, fmt: StorageFormat | None = None,
               delayed: bool = False, row: int | None = None) -> None:
        """Store ``value`` as ``state[key]`` in ``role``'s format (or ``fmt``): with ``delayed`` (a step of a
        parameter whose states use delayed scaling) from its amax history, else with a current scale; the first
        moment rounded stochastically as the step's row ``row`` under ``precision.exp_avg_rounding="stochastic"``
        (the multi-tensor step's bits: :func:`fp8.optim.precision.rounding_bits`)."""
        previous = state.get(f"{key}_scale")
        fmt = fmt or self.precision.format(role)
        if delayed and f"{key}_amax" in state:
            state[key], state[f"{key}_scale"], state[f"{key}_amax"] = encode_delayed(
                value, fmt, previous, state[f"{key}_amax"])
            return
        stochastic = None
        if (role == "exp_avg" and row is not None and self.precision.exp_avg_rounding == "stochastic"
                and fmt.dtype in STOCHASTIC_GRIDS):
            stochastic = (row, state["step"])  # the step being taken (already counted)
        state[key], state[f"{key}_scale"] = encode(value, fmt, previous, stochastic)

    @staticmethod
    def _rounding_args(rows: slice, ws: "_Workspace") -> dict:
        """The stochastic-rounding keywords of a group's second pass over ``rows`` (:func:`fp8.optim.ops.adam_stage2_`,
        ``sgd_stage2_``): its first row and the step counts taken before the step (``ws.steps``, set only under
        ``precision.exp_avg_rounding="stochastic"``); none when the first moments round to nearest."""
        if ws.steps is None:
            return {}
        return dict(stochastic_row0=rows.start, rounding_steps=ws.steps[rows])

    def _uses_delayed_state_scaling(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s states are stored with delayed scaling (``precision.state_scaling="delayed"``
        and ``p`` keeps a master; FP32 parameters, their own master, keep current scaling)."""
        return self.precision.state_scaling == "delayed" and self.needs_master(p)

    def _store_master(self, p: torch.Tensor, state: dict, value: torch.Tensor, delayed: bool = False) -> None:
        # FP8 weights keep their master in the configured precision; the few 16-bit high-precision
        # parameters (norms, embeddings, biases) keep an fp32 master, since their values near 1 would
        # lose small updates in 16 bits.
        fmt = None if isinstance(p, Float8Tensor) else STORAGE_FORMATS["fp32"]
        self._store(state, "master", "master", value, fmt, delayed=delayed)

    @staticmethod
    def _load(state: dict, key: str) -> torch.Tensor:
        return decode(state[key], state[f"{key}_scale"])

    def _moment_roles(self, group: dict) -> dict[str, str]:
        """State keys holding moments in ``group`` and the precision role each is stored in."""
        raise NotImplementedError

    @torch.no_grad()
    def _init_state(self, p: torch.Tensor, group: dict, initial_master: torch.Tensor | None = None) -> None:
        state = self.state[p]
        p = local(p)  # under FSDP2 the state holds this rank's rows, as local tensors
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        for key, role in self._moment_roles(group).items():
            # Each state its own storage: the step updates them in place (an unscaled format stores the value given).
            self._store(state, key, role, torch.zeros(p.shape, dtype=torch.float32, device=p.device))
        if self._uses_delayed_state_scaling(p):
            # Amax histories of the delayed state scales: 0 = none yet, so the first step scales currently.
            keys = [*self._moment_roles(group), "master"] + (["param"] if isinstance(p, Float8Tensor) else [])
            for key in keys:
                state[f"{key}_amax"] = torch.zeros((), dtype=torch.float32, device=p.device)
        if self.needs_master(p):
            if initial_master is None:
                initial_master = p.dequantize(torch.float32) if isinstance(p, Float8Tensor) else p
            # A copy: the master is updated in place, never the tensor it started from.
            self._store_master(p, state, initial_master.detach().to(torch.float32, copy=True))
            self._refresh_param(p, state)

    def _refresh_param(self, p: torch.Tensor, state: dict) -> None:
        """Write the stored master into the model parameter (FP8: re-quantized, current scale)."""
        local(p).copy_(self._load(state, "master"))

    @torch.no_grad()
    def set_master(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``value`` as parameter ``p``'s master, in its storage format (current scale), without writing ``p``
        (:func:`fp8.export.import_fp8`: the masters of imported FP8 weights, exactly: E4M3 values fit FP16 with a
        power-of-two scale). ``p`` must hold a master here (O3: on its owner rank)."""
        state = self.state[p]
        if "master" not in state:
            raise ValueError("this parameter holds no master here (an FP32 parameter is its own; under O3 another rank "
                             "owns it)")
        self._store_master(p, state, value.detach().to(torch.float32))

    def master_value(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master value of parameter ``p`` (its own value for FP32 parameters)."""
        state = self.state[p]
        return self._load(state, "master") if "master" in state else p.detach().to(torch.float32)

    # -- the step ---------------------------------------------------------------------------------
    def _update(self, w: torch.Tensor, g: torch.Tensor, state: dict, group: dict, delayed: bool = False,
                row: int | None = None) -> None:
        """Update master value ``w`` in place from gradient ``g`` and store the new moments (``delayed``: as
        :meth:`_store`'s)."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        """One update of every parameter with a gradient; skipped (and counted) if any gradient is
        not finite. No host synchronisation: the skip is decided on device (masked writes)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.follow_sharding()
        self._step_masked()
        # the weights' input-gradient operands (transposes) for the next step: one multi-tensor kernel for all
        refresh_weight_operands(local(p) for group in self.param_groups for p in group["params"])
        return loss

    def add_param_group(self, param_group: dict) -> None:
        self._slots.put_back(self.param_groups)  # a pending outside remap first, so the snapshot is the optimizer's own
        super().add_param_group(param_group)
        self._slots.remember(self.param_groups)

    # -- FSDP2 ------------------------------------------------------------------------------------
    @torch.no_grad()
    def follow_sharding(self) -> None:
        """Take over the parameters FSDP2 put in place since the last call (``fully_shard`` after ``fp8.initialize``):
        in the param groups each old parameter becomes its sharded one, and its state (FP16 master, moments) is cut to
        the rows this rank holds; the steps then agree every amax and the skip flag over the shard group, so the
        scales (the FP8 weights' included) are the whole tensors' and every rank steps or skips together. Called by
        :meth:`step`, :meth:`zero_grad`, :meth:`state_dict` and :meth:`load_state_dict`; a host-side scan when
        nothing moved."""
        self._slots.put_back(self.param_groups)  # a remap from outside (Accelerate's prepare), at any call
        if not self._slots.moved(record=False):
            return
        if self.precision.state_scaling == "delayed":  # refused at every call, not only the first
            raise NotImplementedError(
                "precision.state_scaling='delayed' is not supported under FSDP2 (its per-parameter path would scale "
                "each rank's rows alone); use the default current state scaling with fully_shard")
        moved = self._slots.take_sharded()
        swap_params(self.param_groups, self.state, {id(old): (old, new, new) for _, old, new in moved},
                    as_dtensor=False)
        self._slots.remember(self.param_groups)
        self.__dict__.pop("_step_workspace", None)
        self.__dict__.pop("_fused_adam_tables", None)
        self._shard_comm = Collectives(moved[0][2].device_mesh.get_group(), self._comm_counter)

    @torch.no_grad()
    def _step_masked(self, agreed_ok: torch.Tensor | None = None) -> torch.Tensor:
        """The step's work (no closure): every write masked by the device flag "all gradients finite",
        and by ``agreed_ok`` too when given (e.g. O3's cross-rank agreement); returns the flag used.

        A fixed number of ops whatever the number of parameters (:meth:`_multi_tensor_step`; block-scaled weights of
        the ``rowwise``/``blockwise`` recipes included), except for block-scaled gradients (``grad_accumulation="fp8"``
        with those recipes) and delayed state scaling, which take the per-parameter paths."""
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state[p]:
                    self._init_state(p, group)
        device = self._skipped_counter.device
        block_grads = any(getattr(local(p.grad), "block", None) is not None for p in params)
        block_weights = any(getattr(local(p), "block", None) is not None for p in params)
        delayed = any("master_amax" in self.state[p] for p in params)
        if params and not block_grads and not delayed:
            ok = self._multi_tensor_step(params, agreed_ok)
        elif (params and self._has_fused_step and not block_grads and not block_weights
              and resolve_backend(self.kernel_backend, *params) == "triton"):
            ok = self._fused_step(params, agreed_ok)
        else:
            ok = grads_finite_flag(params, self.kernel_backend).to(device)
            if agreed_ok is not None:
                ok = ok & agreed_ok.to(device)
            row = 0  # each parameter's row as the multi-tensor step numbers them (stochastic rounding's bits)
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._masked_param_update(p, group, ok, row)
                        row += 1
        self._skipped_counter += (~ok).to(torch.int64)
        if self.scaling_module is not None:
            discard_step_amaxes(self.scaling_module, keep=ok)
            update_scales(self.scaling_module, enabled=ok)
        return ok

    # -- the multi-tensor step -------------------------------------------------------------------------------------
    _bias_correction = False
    """Whether :func:`fp8.optim.ops.prepare_states_` computes Adam's bias corrections for this optimizer."""

    def _moment_count(self, group: dict) -> int:
        """How many moments (``exp_avg``, ``exp_avg_sq`` slots of the ops) ``group``'s parameters keep."""
        return len(self._moment_roles(group))

    def _moment_keys(self, group: dict) -> tuple[str | None, str | None]:
        """The state keys in the ops' ``exp_avg`` and ``exp_avg_sq`` slots (None: no such moment)."""
        keys = list(self._moment_roles(group))
        return (keys + [None, None])[0], (keys + [None, None])[1]

    def _stage(self, stage: int, group: dict, lists: dict, ws: "_Workspace", rows: slice, backend: str,
               tables: list[torch.Tensor] | None) -> None:
        """Run update pass ``stage`` (1: amaxes and non-finite gradients; 2: writes) over one param group's
        ``rows`` of ``lists`` (the per-row lists of :mod:`fp8.optim.ops`); subclasses run their op."""
        raise NotImplementedError

    @staticmethod
    def _state_args(lists: dict, rows: slice, ws: "_Workspace") -> tuple:
        """The arguments a group's pass op takes after its gradients: the state lists, kinds, old scales and bias
        corrections of ``rows``."""
        return (*(lists[key][rows] for key in ops.STATE_LISTS), lists["kinds"][rows], ws.old[rows], ws.bc[rows])

    def _multi_tensor_step(self, params: list[torch.Tensor], agreed_ok: torch.Tensor | None) -> torch.Tensor:
        """The step as a fixed number of multi-tensor ops (:mod:`fp8.optim.ops`), whatever the number of parameters:
        :func:`~fp8.optim.ops.prepare_states_` (old scales, bias corrections, zeroed amaxes, the skip flag from
        ``agreed_ok``), one first pass per param group (amaxes of the new states; non-finite gradients raise the
        skip flag), :func:`~fp8.optim.ops.state_scales_` (every new scale), one second pass per group (states,
        masters and parameters written unless the step is skipped), block-scaled FP8 weights quantized from their new
        masters (:func:`~fp8.optim.ops.quantize_weight_blocks_`, one op for all), and the "step taken" flag it
        returns. No host
        sync; the moments, masters and parameters are updated in place."""
        backend = op_backend(self.kernel_backend, params)
        device = params[0].device
        lists: dict[str, list] = {key: [] for key in (*ops.STATE_LISTS, "grads", "grad_scales", "kinds", "moments",
                                                      "beta1", "beta2", "lr")}
        groups = []
        for group in self.param_groups:
            start = len(lists["kinds"])
            for p in group["params"]:
                if p.grad is not None:
                    self._append_row(lists, p, group, device)
            if len(lists["kinds"]) > start:
                groups.append((group, slice(start, len(lists["kinds"]))))
        ws = self._workspace(len(lists["kinds"]), device)
        # stochastic rounding's step counts, taken before the passes increment them (one stack: one launch)
        ws.steps = (torch.stack([s.reshape(()).to(torch.float32) for s in lists["steps"]])
                    if self.precision.exp_avg_rounding == "stochastic" and lists["steps"] else None)
        tables = self._device_tables(lists, groups, device) if backend == "triton" else None
        state = [lists[key] for key in ops.STATE_LISTS]
        ops.prepare_states_(lists["grad_scales"], *state, lists["kinds"], lists["moments"], lists["beta1"],
                            lists["beta2"], lists["lr"], self._bias_correction,
                            None if agreed_ok is None else agreed_ok.to(device=device, dtype=torch.bool).reshape(()),
                            ws.old, ws.bc, ws.amax, ws.bad, backend=backend,
                            tables=[] if tables is None else tables["all"])
        for group, rows in groups:
            self._stage(1, group, lists, ws, rows, backend, None if tables is None else tables[rows.start])
        if self._shard_comm is not None and self._shard_comm.world_size > 1:
            self._agree_amaxes(ws)
        ops.state_scales_(*state, lists["kinds"], lists["moments"], ws.amax, ws.old, ws.new, backend=backend,
                          tables=[] if tables is None else tables["all"])
        for group, rows in groups:
            self._stage(2, group, lists, ws, rows, backend, None if tables is None else tables[rows.start])
        blocked = [(local(p), self.state[p]) for p in params
                   if isinstance(local(p), Float8Tensor) and local(p).block is not None]
        if blocked:  # kind 3: the block-scaled weights from their new masters, one launch for all
            ops.quantize_weight_blocks_([s["master"] for _, s in blocked], [s["master_scale"] for _, s in blocked],
                                        [p.payload for p, _ in blocked], [p.scale for p, _ in blocked],
                                        [b for p, _ in blocked for b in p.block], ws.bad, backend=backend)
        written = [local(p) for p in params if isinstance(local(p), Float8Tensor)]
        if written:  # the ops bumped the payloads' and scales' versions; the weights themselves, as copy_ would
            torch.autograd.graph.increment_version(written)
        return (ws.bad == 0).reshape(())

    def _agree_amaxes(self, ws: "_Workspace") -> None:
        """FSDP2: every amax of the first pass and the skip flag, MAX over the shard group in one all-reduce, so each
        state and FP8 weight is scaled as the whole tensor would be and a non-finite gradient on any rank's rows skips
        the step on all."""
        packed = torch.cat([ws.amax.reshape(-1), ws.bad.to(torch.float32)])
        self._shard_comm.all_reduce(packed, op=torch.distributed.ReduceOp.MAX, tag="fsdp optimizer amax").wait()
        ws.amax.copy_(packed[:-1].view_as(ws.amax))
        ws.bad.copy_(packed[-1:].to(torch.int32))

    def _append_row(self, lists: dict, p: torch.Tensor, group: dict, device: torch.device) -> None:
        """Add parameter ``p``'s row to the ops' ``lists``: its gradient, master (or itself), moments, the parameter
        refreshed from the master, their scales, step count, kind and hyper-parameters; empty placeholders where it
        has no such tensor."""
        state = self.state[p]
        p, grad = local(p), local(p.grad)  # under FSDP2: this rank's rows
        empty = lambda: torch.empty(0, dtype=torch.float32, device=device)  # noqa: E731
        parts = payload_and_scale(grad)
        lists["grads"].append(parts[0] if parts is not None else grad)
        lists["grad_scales"].append(parts[1] if parts is not None else empty())
        if isinstance(p, Float8Tensor) and p.block is not None:  # quantized after the passes (_multi_tensor_step)
            kind, weight, weight_scale, param, param_scale = 3, state["master"], state["master_scale"], empty(), empty()
        elif isinstance(p, Float8Tensor):
            kind, weight, weight_scale = 2, state["master"], state["master_scale"]
            param, param_scale = p.payload, p.scale
        elif "master" in state:
            kind, weight, weight_scale, param, param_scale = 1, state["master"], state["master_scale"], p.detach(), empty()
        else:
            kind, weight, weight_scale, param, param_scale = 0, p.detach(), empty(), empty(), empty()
        m_key, v_key = self._moment_keys(group)
        lists["weights"].append(weight)
        lists["weight_scales"].append(weight_scale)
        lists["params"].append(param)
        lists["param_scales"].append(param_scale)
        lists["exp_avgs"].append(state[m_key] if m_key else empty())
        lists["exp_avg_scales"].append(state[f"{m_key}_scale"] if m_key else empty())
        lists["exp_avg_sqs"].append(state[v_key] if v_key else empty())
        lists["exp_avg_sq_scales"].append(state[f"{v_key}_scale"] if v_key else empty())
        lists["steps"].append(state["step"])
        lists["kinds"].append(kind)
        lists["moments"].append(self._moment_count(group))
        beta1, beta2 = group.get("betas", (0.0, 0.0))
        lists["beta1"].append(float(beta1))
        lists["beta2"].append(float(beta2))
        lists["lr"].append(float(group["lr"]))

    def _workspace(self, rows: int, device: torch.device) -> "_Workspace":
        """The step's per-row scratch tensors (old scales, bias corrections, amaxes, new scales, the skip flag), kept
        while the number of rows and the device stay (allocations only: no launch)."""
        ws = self.__dict__.get("_step_workspace")
        if ws is None or ws.rows != rows or ws.bad.device != device:
            ws = self.__dict__["_step_workspace"] = _Workspace(rows, device)
        return ws

    def _device_tables(self, lists: dict, groups: list, device: torch.device) -> dict:
        """The Triton launches' tables (:func:`fp8.kernels.triton_multi_tensor.state_table`): the whole step's
        (``"all"``) and each group's (keyed by its first row), uploaded once and cached on the optimizer while no
        state tensor moves (``_fused_adam_tables[0]``: ``(key, tables)``); only the gradients' addresses are
        uploaded each step."""
        from ..kernels import triton_multi_tensor as mt

        scratch = self.__dict__.get("_step_scratch")
        if scratch is None or scratch.device != device:
            scratch = self.__dict__["_step_scratch"] = torch.ones(1, dtype=torch.float32, device=device)
        rows, fmaxes = mt.state_table(*(lists[key] for key in ops.STATE_LISTS), lists["kinds"], lists["moments"],
                                      scratch)
        key = (tuple(map(tuple, rows)), tuple((r.start, r.stop) for _, r in groups))
        cache = self.__dict__.setdefault("_fused_adam_tables", {})
        cached = cache.get(0)
        if cached is not None and cached[0] == key:
            return cached[1]
        table = mt.device_table(rows, torch.int64, device)
        fmax = mt.device_table(fmaxes, torch.float32, device)
        tables = {"all": [table, fmax]}
        for _, r in groups:
            blocks, _ = mt.block_table([row[9] for row in rows[r]], device)
            tables[r.start] = [table[r], fmax[r], blocks]
        cache[0] = (key, tables)
        return tables

    _has_fused_step = False

    def _fused_step(self, params: list[torch.Tensor], agreed_ok: torch.Tensor | None = None) -> torch.Tensor:
        """The whole update as fused kernels (subclasses with ``_has_fused_step``), skipped where
        ``agreed_ok`` is given and not set; returns the 0-d bool "step taken" flag."""
        raise NotImplementedError

    def _masked_param_update(self, p: torch.Tensor, group: dict, ok: torch.Tensor, row: int | None = None) -> None:
        """Update one parameter and its states, every write masked by the 0-d bool ``ok`` (the torch path); ``row``:
        its position among the step's parameters (stochastic rounding's bits)."""
        state = self.state[p]
        before = dict(state)
        g = grad_value(p.grad)
        if group.get("maximize", False):
            g = -g
        has_master = "master" in state
        w = self._load(state, "master") if has_master else p.detach().to(torch.float32, copy=True)
        state["step"] = state["step"] + 1
        delayed = "master_amax" in state  # this parameter's states use delayed scaling
        self._update(w, g, state, group, delayed=delayed, row=row)
        if has_master:
            self._store_master(p, state, w, delayed=delayed)
        for key, old in before.items():
            if isinstance(old, torch.Tensor) and state[key] is not old:
                state[key] = select_where(ok, state[key], old)
        if delayed and isinstance(p, Float8Tensor):
            self._refresh_param_delayed(p, state, ok)
        elif has_master:
            self._refresh_param(p, state)  # a skipped step re-quantizes the unchanged master: same bits
        else:
            p.copy_(torch.where(ok, w.to(p.dtype), p))

    def _refresh_param_delayed(self, p: Float8Tensor, state: dict, ok: torch.Tensor) -> None:
        """Re-quantize FP8 weight ``p`` from its stored master with a delayed scale (from
        ``state["param_amax"]``, the previous step's stored-master amax; current when it does not fit),
        record the new amax; every write masked by ``ok``."""
        value = self._load(state, "master")
        amax = amax_of(value)
        if p.block is not None:  # a recipe's block scales: current per block (fp8.recipes)
            payload, scales = quantize_to_blocks(value.reshape(p.shape), p.block, p.format)
            p.payload.copy_(select_where(ok, payload, p.payload))
            p.scale.copy_(torch.where(ok, scales, p.scale))
            state["param_amax"] = torch.where(ok, amax, state["param_amax"])
            return
        scale = delayed_or_current_scale(amax, state["param_amax"], p.format.max, p.scale)
        payload = quantize(value, scale, p.format)
        p.payload.copy_(select_where(ok, payload, p.payload))
        p.scale.copy_(torch.where(ok, scale, p.scale))
        state["param_amax"] = torch.where(ok, amax, state["param_amax"])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear gradients (FP8 gradients included)."""
        self.follow_sharding()
        for p in chain.from_iterable(group["params"] for group in self.param_groups):
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    # -- checkpoints ------------------------------------------------------------------------------
    LEVEL = "O2"
    """The opt level whose machinery this class is (a constant of the class: O3 for the sharded optimizers)."""

    @property
    def opt_level(self) -> str:
        """The opt level this optimizer's state belongs to (:data:`LEVEL` at this optimizer's precision; recorded in
        :meth:`state_dict`, checked on load)."""
        return level_name(self.LEVEL, self.precision)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """torch's optimizer state dict plus ``skipped_steps`` and ``opt_level``."""
        self.follow_sharding()
        state = super().state_dict()
        state["skipped_steps"] = self.skipped_steps
        state["opt_level"] = self.opt_level
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore hyper-parameters and states, keeping each state's stored dtype (payloads and scales
        are restored bit for bit), and re-quantize the FP8 weights from the restored masters. A state
        dict of another opt level is refused (:class:`fp8.optim.levels.OptLevelMismatchError`)."""
        from .levels import check_opt_level

        check_opt_level(state_dict, self.opt_level, self)
        self.follow_sharding()
        saved_ids = chain.from_iterable(group["params"] for group in state_dict["param_groups"])
        params = chain.from_iterable(group["params"] for group in self.param_groups)
        id_to_param = dict(zip(saved_ids, params))
        super().load_state_dict(state_dict)  # validates groups, restores hyper-parameters
        self.skipped_steps = state_dict.get("skipped_steps", 0)
        with torch.no_grad():
            for saved_id, saved_state in state_dict["state"].items():
                p = id_to_param[saved_id]
                self.state[p] = {
                    k: v.to(device=p.device, copy=True) if isinstance(v, torch.Tensor) else v
                    for k, v in saved_state.items()
                }
                if "master" in self.state[p]:
                    self._refresh_param(p, self.state[p])
