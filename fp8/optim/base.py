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

from ..kernels.backend import KERNEL_BACKENDS, resolve_backend
from ..blocks import quantize_to_blocks
from ..cast import payload_and_scale, quantize
from ..formats import FP8_DTYPES, byte_view
from ..scaling import amax_of, discard_step_amaxes, update_scales
from ..tensor import Float8Tensor
from .levels import level_name
from .skipped import SkippedStepsCounter
from .precision import (
    STORAGE_FORMATS, OptimizerPrecision, StorageFormat, decode, delayed_or_current_scale, encode, encode_delayed,
)

__all__ = ["FP8Optimizer", "grads_are_finite", "grads_finite_flag", "grad_value", "skip_step", "select_where"]

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


def grads_finite_flag(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """0-d bool tensor on device: whether every gradient of ``params`` is finite (no host sync)."""
    flags = []
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        parts = payload_and_scale(grad)  # FP8 or FP16 payload with its scale(s)
        if parts is not None:
            flags.append(torch.isfinite(parts[0].to(torch.float32)).all() & torch.isfinite(parts[1]).all())
        else:
            flags.append(torch.isfinite(grad).all())
    if not flags:
        return torch.ones((), dtype=torch.bool)
    return torch.stack(flags).all()


def select_where(ok: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` where the 0-d bool ``ok`` is set, else ``old`` (any dtype, FP8 included; no host sync)."""
    if new.dtype in FP8_DTYPES:  # torch.where has no FP8 kernel: select the bytes
        return torch.where(ok, byte_view(new), byte_view(old)).view(new.dtype)
    return torch.where(ok, new, old)


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
    ) -> None:
        if kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {kernel_backend!r}")
        if scaling_module is not None and not isinstance(scaling_module, nn.Module):
            raise TypeError(f"scaling_module must be an nn.Module (the model) or None, got {type(scaling_module).__name__}")
        self.precision = OptimizerPrecision.preset(precision) if isinstance(precision, str) else precision
        self.kernel_backend = kernel_backend
        self.scaling_module = scaling_module
        super().__init__(params, defaults)
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
               delayed: bool = False) -> None:
        """Store ``value`` as ``state[key]`` in ``role``'s format (or ``fmt``): with ``delayed`` (a step of a
        parameter whose states use delayed scaling) from its amax history, else with a current scale."""
        previous = state.get(f"{key}_scale")
        fmt = fmt or self.precision.format(role)
        if delayed and f"{key}_amax" in state:
            state[key], state[f"{key}_scale"], state[f"{key}_amax"] = encode_delayed(
                value, fmt, previous, state[f"{key}_amax"])
            return
        state[key], state[f"{key}_scale"] = encode(value, fmt, previous)

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
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        zeros = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        for key, role in self._moment_roles(group).items():
            self._store(state, key, role, zeros)
        if self._uses_delayed_state_scaling(p):
            # Amax histories of the delayed state scales: 0 = none yet, so the first step scales currently.
            keys = [*self._moment_roles(group), "master"] + (["param"] if isinstance(p, Float8Tensor) else [])
            for key in keys:
                state[f"{key}_amax"] = torch.zeros((), dtype=torch.float32, device=p.device)
        if self.needs_master(p):
            if initial_master is None:
                initial_master = p.dequantize(torch.float32) if isinstance(p, Float8Tensor) else p
            self._store_master(p, state, initial_master.detach().to(torch.float32))
            self._refresh_param(p, state)

    def _refresh_param(self, p: torch.Tensor, state: dict) -> None:
        """Write the stored master into the model parameter (FP8: re-quantized, current scale)."""
        p.copy_(self._load(state, "master"))

    def master_value(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 master value of parameter ``p`` (its own value for FP32 parameters)."""
        state = self.state[p]
        return self._load(state, "master") if "master" in state else p.detach().to(torch.float32)

    # -- the step ---------------------------------------------------------------------------------
    def _update(self, w: torch.Tensor, g: torch.Tensor, state: dict, group: dict, delayed: bool = False) -> None:
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
        self._step_masked()
        return loss

    @torch.no_grad()
    def _step_masked(self, agreed_ok: torch.Tensor | None = None) -> torch.Tensor:
        """The step's work (no closure): every write masked by the device flag "all gradients finite",
        and by ``agreed_ok`` too when given (e.g. O3's cross-rank agreement); returns the flag used."""
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not self.state[p]:
                    self._init_state(p, group)
        device = self._skipped_counter.device
        block_scaled = any(getattr(p, "block", None) is not None or getattr(p.grad, "block", None) is not None
                           for p in params)
        if params and self._has_fused_step and not block_scaled and resolve_backend(self.kernel_backend, *params) == "triton":
            ok = self._fused_step(params, agreed_ok)
        else:
            ok = grads_finite_flag(params).to(device)
            if agreed_ok is not None:
                ok = ok & agreed_ok.to(device)
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._masked_param_update(p, group, ok)
        self._skipped_counter += (~ok).to(torch.int64)
        if self.scaling_module is not None:
            discard_step_amaxes(self.scaling_module, keep=ok)
            update_scales(self.scaling_module, enabled=ok)
        return ok

    _has_fused_step = False

    def _fused_step(self, params: list[torch.Tensor], agreed_ok: torch.Tensor | None = None) -> torch.Tensor:
        """The whole update as fused kernels (subclasses with ``_has_fused_step``), skipped where
        ``agreed_ok`` is given and not set; returns the 0-d bool "step taken" flag."""
        raise NotImplementedError

    def _masked_param_update(self, p: torch.Tensor, group: dict, ok: torch.Tensor) -> None:
        """Update one parameter and its states, every write masked by the 0-d bool ``ok`` (the torch path)."""
        state = self.state[p]
        before = dict(state)
        g = grad_value(p.grad)
        if group.get("maximize", False):
            g = -g
        has_master = "master" in state
        w = self._load(state, "master") if has_master else p.detach().to(torch.float32, copy=True)
        state["step"] = state["step"] + 1
        delayed = "master_amax" in state  # this parameter's states use delayed scaling
        self._update(w, g, state, group, delayed=delayed)
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
