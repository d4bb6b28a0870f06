"""O1 optimizer: a ``torch.optim`` optimizer stepping high-precision master copies of FP8 weights.

The wrapped optimizer keeps the original high-precision weight ``Parameter`` objects (the masters)
in its param groups; the model holds their FP8 copies. ``step()`` dequantizes each FP8 weight
gradient into its master's ``.grad``, runs the wrapped optimizer, re-quantizes the FP8 weights from
the updated masters (current power-of-two scale), frees the transient master gradients and closes
the step for the model's delayed scaling states.

The wrapper's own work is a fixed number of multi-tensor ops (:mod:`fp8.optim.ops`) whatever the number of FP8
weights: one finiteness check over every gradient, one dequantization of the FP8 weights' gradients per master dtype,
and the refresh (amaxes, then the casts); only block-scaled weights (recipes ``rowwise``/``blockwise``) are refreshed
one by one. A step whose gradients hold inf or NaN is skipped, decided on device where the wrapped optimizer allows
it (no host synchronisation): a fused ``torch.optim`` optimizer (``fused=True``: Adam, AdamW, SGD,
Adagrad) takes the flag as its ``found_inf`` input and skips on device; any other optimizer whose states
live on the parameters' device is stepped and then masked back (``torch.where`` over a copy of its
parameters and states taken before the step, one transient copy; two ops for all of them). A step whose optimizer state is not
created yet (torch creates it lazily on the first step), or whose states live on another device (torch's
non-capturable Adam keeps ``step`` on the host), is decided on the host (one sync), as before.
``skipped_steps`` is a device counter, read (and new skips logged) when the host asks for it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import logging

import torch
from torch import nn

from ..cast import payload_and_scale
from ..comm import Collectives, CommBytesCounter
from ..distributed.sharding import ParamSlots, local, shard_like, swap_params
from ..recipes import refresh_weight_operands
from ..scaling import discard_step_amaxes, update_scales
from ..tensor import Float8Tensor
from . import ops
from .skipped import SkippedStepsCounter
from .base import grads_finite_flag, op_backend

logger = logging.getLogger(__name__)

__all__ = ["MasterWeightOptimizer"]


class MasterWeightOptimizer(SkippedStepsCounter, torch.optim.Optimizer):
    """Wraps ``optimizer`` so it steps on FP8 weights through their high-precision masters.

    ``pairs`` lists ``(master, fp8_weight)``: the master is a parameter of ``optimizer``, the FP8
    weight a :class:`Float8Tensor` parameter of ``model``. ``param_groups`` and ``state`` are the
    wrapped optimizer's, so learning-rate schedulers work unchanged. ``state_dict()`` holds the
    wrapped optimizer's state and the master weights.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        pairs: list[tuple[nn.Parameter, nn.Parameter]],
        model: nn.Module,
        comm_counter: CommBytesCounter | None = None,
    ) -> None:
        # Not calling Optimizer.__init__: param groups and state are the wrapped optimizer's own.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.pairs = pairs
        self.model = model
        self._slots = ParamSlots(model)
        self._slots.remember(optimizer.param_groups)
        self._comm_counter = comm_counter
        self._shard_comm: Collectives | None = None
        first = next((m for m, _ in pairs), None)
        if first is None:
            first = next((p for g in optimizer.param_groups for p in g["params"]), None)
        self._init_skipped_counter(first.device if first is not None else "cpu")
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, OrderedDict())
        self._patch_step_function()

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self):
        return self.optimizer.state

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({len(self.pairs)} FP8 weights, {self.optimizer!r})"

    @property
    def master_weights(self) -> list[nn.Parameter]:
        """The high-precision master copies of the FP8 weights, in model order."""
        return [master for master, _ in self.pairs]

    # -- FSDP2 ------------------------------------------------------------------------------------
    @torch.no_grad()
    def follow_sharding(self) -> None:
        """Take over the parameters FSDP2 put in place since the last call (``fully_shard`` after
        ``fp8.initialize``): each FP8 weight's master and optimizer state cut to the rows this rank holds (DTensors
        like the weight's shard), the wrapped optimizer's other parameters swapped for their shards; the steps then
        agree the finiteness flag and the FP8 weights' amaxes over the shard group. Called by :meth:`step`,
        :meth:`zero_grad`, :meth:`state_dict` and :meth:`load_state_dict`; a host-side scan when nothing moved."""
        self._slots.put_back(self.optimizer.param_groups)
        moved = self._slots.take_sharded()
        if not moved:
            return
        new_of = {id(old): new for _, old, new in moved}
        swap: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # id(old) -> (old, new, shard ref)
        pairs = []
        for master, weight in self.pairs:
            new_weight = new_of.get(id(weight))
            if new_weight is None:
                pairs.append((master, weight))
                continue
            new_master = nn.Parameter(shard_like(master, new_weight), requires_grad=master.requires_grad)
            swap[id(master)] = (master, new_master, new_weight)
            pairs.append((new_master, new_weight))
        for _, old, new in moved:
            if id(old) not in swap and not isinstance(local(new), Float8Tensor):
                swap[id(old)] = (old, new, new)
        swap_params(self.optimizer.param_groups, self.optimizer.state, swap, as_dtensor=True)
        self._slots.remember(self.optimizer.param_groups)
        self.pairs = pairs
        mesh = moved[0][2].device_mesh
        self._shard_comm = Collectives(mesh.get_group(), self._comm_counter)

    def _agree(self, t: torch.Tensor, op, tag: str) -> None:
        """All-reduce ``t`` in place over the shard group (after FSDP2 sharded the model); nothing otherwise."""
        if self._shard_comm is not None and self._shard_comm.world_size > 1:
            self._shard_comm.all_reduce(t, op=op, tag=tag).wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the wrapped optimizer's gradients and those of the FP8 weights."""
        self.follow_sharding()
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for _, fp8_weight in self.pairs:
            if set_to_none:
                fp8_weight.grad = None
            elif fp8_weight.grad is not None:
                fp8_weight.grad.zero_()

    def _backend(self) -> str:
        """The multi-tensor ops' backend: Triton where the FP8 weights are on CUDA (and Triton is installed)."""
        return op_backend("auto", [w for _, w in self.pairs])

    @torch.no_grad()
    def load_master_grads(self) -> None:
        """Each master's ``.grad``: its FP8 weight's gradient in the master's dtype (one multi-tensor
        :func:`fp8.optim.ops.dequantize_grads` per master dtype; a plain gradient already in it is taken as it is).
        Called by :meth:`step` before the step: the hook a subclass overrides to take gradients from elsewhere
        (pretrain_gpt.py's ``--bf16`` optimizer: FP32 main gradients)."""
        by_dtype: dict[torch.dtype, list] = {}
        for master, fp8_weight in self.pairs:
            grad = fp8_weight.grad  # under FSDP2: a DTensor of the reduced fp32 rows, taken as it is below
            parts = payload_and_scale(grad) if grad is not None else None
            if grad is None:
                master.grad = None
            elif getattr(grad, "block", None) is not None:  # a grid of block scales
                master.grad = grad.dequantize(master.dtype)
            elif parts is None and grad.dtype == master.dtype:
                master.grad = grad
            else:
                payload, scale = parts if parts is not None else (grad, grad.new_empty(0, dtype=torch.float32))
                by_dtype.setdefault(master.dtype, []).append((master, payload, scale))
        for dtype, rows in by_dtype.items():
            grads = ops.dequantize_grads([r[1] for r in rows], [r[2] for r in rows], dtype, backend=self._backend())
            for (master, _, _), grad in zip(rows, grads):
                master.grad = grad

    @torch.no_grad()
    def refresh_fp8_weights(self) -> None:
        """Re-quantize every FP8 weight from its master (current power-of-two scale), as ``fp8_weight.copy_(master)``
        would: a zeroed amax buffer, one multi-tensor amax (:func:`fp8.optim.ops.amaxes_`) and one multi-tensor cast
        (:func:`fp8.optim.ops.quantize_weights_`) for all tensor-wise weights; one
        :func:`fp8.optim.ops.quantize_weight_blocks_` for all block-scaled ones; high-precision weights by one
        ``torch._foreach_copy_``."""
        tensorwise, blocked, plain = [], [], []
        for master, fp8_weight in self.pairs:
            master, fp8_weight = local(master), local(fp8_weight)  # under FSDP2: this rank's rows
            if not isinstance(fp8_weight, Float8Tensor):  # a high-precision weight (Megatron's BF16 training)
                plain.append((master.detach(), fp8_weight.detach()))
            elif fp8_weight.block is None:
                tensorwise.append((master.detach(), fp8_weight))
            else:
                blocked.append((master.detach(), fp8_weight))
        if plain:
            torch._foreach_copy_([w for _, w in plain], [m for m, _ in plain])
        if tensorwise:
            self._refresh_tensorwise(tensorwise)
        if blocked:  # per-block current scales, as copy_ makes them: one multi-tensor op for all
            weights = [w for _, w in blocked]
            no_scales = [torch.empty(0, dtype=torch.float32, device=w.device) for w in weights]
            ops.quantize_weight_blocks_([m for m, _ in blocked], no_scales, [w.payload for w in weights],
                                        [w.scale for w in weights], [b for w in weights for b in w.block], None,
                                        backend=self._backend())
            torch.autograd.graph.increment_version(weights)
        # the weights' GEMM operands for the next step (transposes, scale_inv): multi-tensor kernels for all
        refresh_weight_operands([local(w) for _, w in self.pairs])

    def _refresh_tensorwise(self, tensorwise: list) -> None:
        """The tensor-wise weights of :meth:`refresh_fp8_weights`: one multi-tensor amax, one multi-tensor cast."""
        masters = [m for m, _ in tensorwise]
        weights = [w for _, w in tensorwise]
        backend = self._backend()
        amax = torch.zeros(len(masters), dtype=torch.float32, device=masters[0].device)
        ops.amaxes_(masters, amax, backend=backend)
        # FSDP2: every rank's rows of a weight take the whole weight's scale (the gathered weight is one FP8 tensor)
        self._agree(amax, torch.distributed.ReduceOp.MAX, "fsdp weight amax")
        ops.quantize_weights_(masters, amax, [w.payload for w in weights], [w.scale for w in weights], backend=backend)
        torch.autograd.graph.increment_version(weights)  # the op bumped payloads and scales; the weights, as copy_

    # -- the step ---------------------------------------------------------------------------------
    def _fused_found_inf(self) -> bool:
        """Whether the wrapped optimizer skips on device through a ``found_inf`` input (fused torch.optim)."""
        return bool(getattr(self.optimizer, "_step_supports_amp_scaling", False)) and bool(
            self.optimizer.defaults.get("fused"))

    def _stepped(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def _maskable(self, stepped: list[torch.Tensor], device: torch.device) -> bool:
        """Whether the step can be undone on device: every stepped parameter has its state already
        (torch creates it lazily on the first step) and every state tensor lives on ``device``."""
        for p in stepped:
            state = self.optimizer.state.get(p)
            if not state or p.device != device:
                return False
            if any(isinstance(v, torch.Tensor) and v.device != device for v in state.values()):
                return False
        return True

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):  # type: ignore[override]
        """One optimizer step on the masters, then refreshed FP8 weights and closed scaling step.
        Skipped (counted in ``skipped_steps``, logged when it is read) if any gradient is not finite;
        decided on device where the wrapped optimizer allows it (module docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.follow_sharding()
        device = self._skipped_counter.device
        params = [w for _, w in self.pairs] + [p for g in self.optimizer.param_groups for p in g["params"]]
        ok = grads_finite_flag(params).to(device)  # one multi-tensor check
        if self._shard_comm is not None:  # FSDP2: each rank saw its rows only; skip on every rank or on none
            flag = ok.to(torch.int32).reshape(1)
            self._agree(flag, torch.distributed.ReduceOp.MIN, "fsdp finite flag")
            ok = (flag > 0).reshape(())
        self.load_master_grads()
        stepped = self._stepped()
        if self._fused_found_inf():
            self._found_inf_step(ok)
        elif self._maskable(stepped, device):
            self._masked_step(stepped, ok)
        elif not bool(ok):  # host decision: lazily created state, or states off the parameters' device
            for master, _ in self.pairs:
                master.grad = None
            self._skipped_counter += 1
            discard_step_amaxes(self.model)
            return loss
        else:
            self.optimizer.step()
        self.refresh_fp8_weights()  # a skipped step re-quantizes the unchanged masters: same bits
        for master, _ in self.pairs:
            master.grad = None  # transient: the FP8 gradient is the one kept
        self._skipped_counter += (~ok).to(torch.int64)
        discard_step_amaxes(self.model, keep=ok)
        update_scales(self.model, enabled=ok)
        return loss

    def _found_inf_step(self, ok: torch.Tensor) -> None:
        """A fused torch.optim step told to skip on device (``found_inf``, as torch's GradScaler does)."""
        opt = self.optimizer
        found_inf = (~ok).to(torch.float32)
        previous = getattr(opt, "found_inf", None)
        if previous is not None:  # a GradScaler's flag too: skip if either says so
            found_inf = torch.maximum(found_inf, previous.to(found_inf.device, torch.float32).reshape(()))
        opt.found_inf = found_inf
        try:
            opt.step()
        finally:
            if previous is None:
                del opt.found_inf
            else:
                opt.found_inf = previous

    def _masked_step(self, stepped: list[torch.Tensor], ok: torch.Tensor) -> None:
        """Step, then keep the old parameters and states where ``ok`` is not set (on device): one multi-tensor copy
        before the step (:func:`fp8.optim.ops.clone_tensors`), one multi-tensor restore after it
        (:func:`fp8.optim.ops.restore_unless_`)."""
        backend = self._backend()
        before = [(p, dict(self.optimizer.state[p])) for p in stepped]
        originals: dict[int, torch.Tensor] = {}
        for p, state in before:
            originals.setdefault(id(p), local(p.detach()))
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    originals.setdefault(id(v), local(v))
        copies = dict(zip(originals, ops.clone_tensors(list(originals.values()), backend=backend)))
        self.optimizer.step()
        targets: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for p, old_state in before:
            targets.setdefault(id(p), (local(p.detach()), copies[id(p)]))
            state = self.optimizer.state[p]
            for key, old in old_state.items():
                if not isinstance(old, torch.Tensor):
                    continue
                new, saved = state.get(key), copies[id(old)]
                if new is None:
                    continue
                if local(new).shape == saved.shape and new.dtype == saved.dtype and new.device == saved.device:
                    targets.setdefault(id(new), (local(new), saved))  # restored in place (a replaced state: the new tensor)
                else:
                    state[key] = torch.where(ok, new, saved) if local(new) is new else new  # (a DTensor: kept)
        ops.restore_unless_([t for t, _ in targets.values()], [s for _, s in targets.values()], ok, backend=backend)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of high-precision parameters to the wrapped optimizer."""
        self._slots.put_back(self.optimizer.param_groups)  # a pending outside remap first (FP8Optimizer's reason)
        self.optimizer.add_param_group(param_group)
        self._slots.remember(self.optimizer.param_groups)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Wrapped optimizer state, the master weights (in model order) and ``skipped_steps``."""
        self.follow_sharding()
        state = {
            "optimizer": self.optimizer.state_dict(),
            "master_weights": [m.detach() for m in self.master_weights],
            "skipped_steps": self.skipped_steps,
            "opt_level": self.opt_level,
        }
        # the hooks torch.optim.Optimizer.state_dict runs (register_state_dict_post_hook: fp8.fallback,
        # fp8.schedule), run here as this state dict is not torch's
        for hook in self._optimizer_state_dict_post_hooks.values():
            state = hook(self, state) or state
        return state

    opt_level = "O1"
    """The opt level this optimizer's state belongs to (recorded in :meth:`state_dict`, checked on load)."""

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore the wrapped optimizer and the masters, and re-quantize the FP8 weights from them. A state
        dict of another opt level is refused (:class:`fp8.optim.levels.OptLevelMismatchError`)."""
        from .levels import check_opt_level

        for hook in self._optimizer_load_state_dict_pre_hooks.values():  # as torch's load_state_dict runs them
            state_dict = hook(self, state_dict) or state_dict
        check_opt_level(state_dict, self.opt_level, self)
        self.follow_sharding()
        masters = state_dict["master_weights"]
        if len(masters) != len(self.pairs):
            raise ValueError(
                f"checkpoint holds {len(masters)} master weights, this model has {len(self.pairs)} FP8 weights; "
                f"load it into a model converted with the same opt_level and module filter"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.skipped_steps = state_dict.get("skipped_steps", 0)
        for (master, _), saved in zip(self.pairs, masters):
            master.copy_(saved)
        self.refresh_fp8_weights()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)
