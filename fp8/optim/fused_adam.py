"""The FP8 Adam/AdamW update with opt-in delayed state scaling (``OptimizerPrecision(state_scaling="delayed")``) as
multi-tensor Triton kernels (CUDA; interpreter in tests): the optimizer-level driver (state layout, scales, tables)
over the plain-tensor kernels of :mod:`fp8.kernels.triton_adam`.

The default, current state scaling runs :meth:`fp8.optim.FP8Optimizer._multi_tensor_step` (the custom ops of
:mod:`fp8.optim.ops`, on every device). Here, with delayed state scaling, the parameters with a master take the
single-pass kernel (:func:`_delayed_launch`; see ``docs/gpu.md``) and the fp32 parameters (their own master, current
scaling) the two-stage kernels: per param group a fixed number of launches and device-side torch ops (scales computed
for the whole group at once), no host sync. The per-group tables of addresses are built on the host and uploaded
without blocking (cached while the states stay in place). Results equal the torch path up to fp32 rounding of the
update math (fused multiply-adds); scales and skips are identical.
"""

from __future__ import annotations

import torch

from ..scaling import power_of_two_scale
from ..scaled_fp16 import ScaledFloat16Tensor
from ..tensor import Float8Tensor
from .base import grads_finite_flag
from .precision import DELAYED_HEADROOM, delayed_or_current_scale

__all__ = ["fused_adam_step", "mark_fp8_weights_written"]

_BLOCK = 1024


def _payload_and_scale(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(t, (Float8Tensor, ScaledFloat16Tensor)):  # scaled gradients: FP8 or FP16 payload
        return t.payload, t.scale
    return t.detach(), torch.ones((), dtype=torch.float32, device=t.device)


def _fmax(dtype: torch.dtype) -> float:
    return {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.float16: 65504.0}.get(dtype, float("inf"))


def _device_table(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host-built table on ``device`` without a host sync: on CUDA copied from pinned memory
    with ``non_blocking=True`` (the caching host allocator keeps the buffer until the copy ran)."""
    table = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table.to(device)


def _static_tables(optimizer, group_index: int, rows: list[tuple], device: torch.device):
    """The per-group tables that change only when a state tensor is re-allocated: tensor table
    (addresses, numel, format codes, flags), fmax table and block table; cached on the optimizer,
    keyed by the addresses, so a steady-state step uploads only the gradients' addresses."""
    key = tuple(rows)
    cache = optimizer.__dict__.setdefault("_fused_adam_tables", {})
    cached = cache.get(group_index)
    if cached is not None and cached[0] == key:
        return cached[1]
    table, fmaxes, blocks = [], [], []
    for i, (addrs, numel, codes, flags, fmax, *extra) in enumerate(rows):
        table.append([*addrs, numel, codes, flags, *(extra[0] if extra else ())])
        fmaxes.append(list(fmax))
        blocks.extend([i, b] for b in range(max(1, -(-numel // _BLOCK))))
    tables = (_device_table(table, torch.int64, device), _device_table(fmaxes, torch.float32, device),
              _device_table(blocks, torch.int32, device), len(blocks))
    cache[group_index] = (key, tables)
    return tables


@torch.no_grad()
def fused_adam_step(optimizer, params: list[torch.Tensor], agreed_ok: torch.Tensor | None = None) -> torch.Tensor:
    """One Adam/AdamW step of ``optimizer`` (an :class:`fp8.optim.Adam`) over ``params`` (those with a
    gradient, states initialized) with the multi-tensor Triton kernels: one stage-1 and one stage-2
    launch per param group. Skipped on device when a gradient is not finite or ``agreed_ok`` (0-d bool,
    optional) is unset. Returns the 0-d bool "step taken" flag."""
    from ..kernels.triton_adam import adam_stage1_kernel, adam_stage2_kernel
    from ..kernels.triton_formats import format_code

    device = params[0].device
    bad = torch.zeros(1, dtype=torch.int32, device=device)
    if agreed_ok is not None:
        bad = (~agreed_ok.to(device)).to(torch.int32).reshape(1)
    ones = torch.ones((), dtype=torch.float32, device=device)
    scratch = optimizer.__dict__.get("_fused_adam_scratch")  # address for scales a tensor does not have
    if scratch is None or scratch.device != device:  # (kept: its address is part of the cached tables)
        scratch = optimizer.__dict__["_fused_adam_scratch"] = torch.zeros(1, dtype=torch.float32, device=device)
    precision = optimizer.precision
    m_scaled = precision.format("exp_avg").scaled_max is not None
    v_scaled = precision.format("exp_avg_sq").scaled_max is not None
    master_scaled = precision.format("master").scaled_max is not None
    delayed_mode = precision.state_scaling == "delayed"
    if delayed_mode:
        # The single pass writes as it reads, so whether the step is taken is decided before it: one
        # finiteness reduction over the gradients (on device, no host sync).
        bad = bad | (~grads_finite_flag(params).to(device)).to(torch.int32).reshape(1)
    launches = []
    for group_index, group in enumerate(optimizer.param_groups):
        ps = [p for p in group["params"] if p.grad is not None]
        if delayed_mode:
            delayed_ps = [p for p in ps if "master_amax" in optimizer.state[p]]
            if delayed_ps:
                _delayed_launch(optimizer, group_index, group, delayed_ps, bad, scratch, ones)
            ps = [p for p in ps if "master_amax" not in optimizer.state[p]]  # fp32 params: current scaling
        if not ps:
            continue
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        rows, grads, old = [], [], []
        for p in ps:
            state = optimizer.state[p]
            g, g_scale = _payload_and_scale(p.grad)
            g = g.contiguous()
            has_master = "master" in state
            if not has_master and p.dtype != torch.float32:
                raise ValueError("fused_adam_step: parameters without a master must be fp32")
            is_fp8 = isinstance(p, Float8Tensor)
            w, w_scale = (state["master"], state["master_scale"]) if has_master else (p.detach(), ones)
            target = p.payload if is_fp8 else p.detach()
            m, v = state["exp_avg"], state["exp_avg_sq"]
            w_scaled = has_master and is_fp8 and master_scaled
            addrs = (w.data_ptr(), m.data_ptr(), v.data_ptr(), target.data_ptr(),
                     (w_scale if has_master else scratch).data_ptr(), state["exp_avg_scale"].data_ptr(),
                     state["exp_avg_sq_scale"].data_ptr(), (p.scale if is_fp8 else scratch).data_ptr(),
                     state["step"].data_ptr())
            codes = format_code(w.dtype) | format_code(m.dtype) << 4 | format_code(v.dtype) << 8 | format_code(target.dtype) << 12
            flags = (int(m_scaled) | int(v_scaled) << 1 | int(w_scaled) << 2 | int(is_fp8) << 3 | int(has_master) << 4
                     | int(has_master) << 5)  # a master, and a parameter refreshed from it
            rows.append((addrs, p.numel(), codes, flags,
                         (_fmax(m.dtype), _fmax(v.dtype), _fmax(w.dtype), _fmax(target.dtype))))
            grads.append((g, [g.data_ptr(), format_code(g.dtype)]))
            old.extend([g_scale, w_scale, state["exp_avg_scale"], state["exp_avg_sq_scale"], p.scale if is_fp8 else ones])
        table, fmax_table, blocks, n_blocks = _static_tables(optimizer, group_index, rows, device)
        grad_table = _device_table([row for _, row in grads], torch.int64, device)
        old_scales = torch.stack([s.reshape(()).to(torch.float32) for s in old]).view(len(ps), 5)
        steps = torch.stack([optimizer.state[p]["step"] for p in ps]) + 1
        step64 = steps.to(torch.float64)
        bc1 = (1 - beta1**step64).to(torch.float32)
        bc2 = (1 - beta2**step64).sqrt().to(torch.float32)
        bc = torch.stack([lr / bc1, bc2], dim=1).contiguous()
        amax = torch.zeros(len(ps), 3, dtype=torch.float32, device=device)
        scalars = dict(lr=lr, omb1=1 - beta1, beta2=beta2, omb2=1 - beta2, eps=eps, weight_decay=wd,
                       decay_factor=1 - lr * wd)
        flags = dict(MAXIMIZE=bool(group.get("maximize", False)), DECOUPLED=bool(group["decoupled_weight_decay"]),
                     HAS_DECAY=bool(wd), BLOCK=_BLOCK)
        adam_stage1_kernel[(n_blocks,)](blocks, table, grad_table, old_scales, bc, amax, bad, **scalars, **flags)
        launches.append((grads, table, fmax_table, blocks, n_blocks, grad_table, old_scales, bc, amax, scalars, flags))
    ok = bad[0] == 0
    for grads, table, fmax_table, blocks, n_blocks, grad_table, old_scales, bc, amax, scalars, flags in launches:
        new_scales = _new_scales(optimizer, table, fmax_table, old_scales, amax)
        adam_stage2_kernel[(n_blocks,)](blocks, table, grad_table, old_scales, bc, fmax_table, new_scales, bad,
                                        **scalars, **flags)
    mark_fp8_weights_written(params)
    return ok


def mark_fp8_weights_written(params: list[torch.Tensor]) -> None:
    """The kernels write the FP8 weights' payloads and scales through their addresses, which autograd does not see:
    bump their version counters, as an in-place op would, so the transposes cached with the weights
    (:attr:`fp8.Float8Tensor.transpose_cache`) are rebuilt and a graph still holding the old values fails loudly."""
    written = [t for p in params if isinstance(p, Float8Tensor) for t in (p.payload, p.scale)]
    if written:
        torch.autograd.graph.increment_version(written)


def _delayed_launch(optimizer, group_index: int, group: dict, ps: list[torch.Tensor], bad: torch.Tensor,
                    scratch: torch.Tensor, ones: torch.Tensor) -> None:
    """Delayed state scaling for the parameters ``ps`` of one group (those with a master): the single
    pass (:func:`~fp8.kernels.triton_adam.adam_delayed_kernel`) reads every state from its buffer and
    writes the other buffer of each state (two buffers per state, swapped after the step), so a state
    that outgrew its delayed scale is recomputed from intact inputs by the fix-up launch, which does
    nothing else for the other tensors. Scales, overflow decisions and amax histories are computed on
    device over the group's tables: no host sync."""
    from ..kernels.triton_adam import adam_delayed_fixup_kernel, adam_delayed_kernel
    from ..kernels.triton_formats import format_code

    device = ps[0].device
    precision = optimizer.precision
    m_scaled = precision.format("exp_avg").scaled_max is not None
    v_scaled = precision.format("exp_avg_sq").scaled_max is not None
    master_scaled = precision.format("master").scaled_max is not None
    beta1, beta2 = group["betas"]
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    spares = optimizer.__dict__.setdefault("_delayed_spares", {})
    keys = ("master", "exp_avg", "exp_avg_sq")
    rows, grads, old, hist = [], [], [], []
    for p in ps:
        state = optimizer.state[p]
        g, g_scale = _payload_and_scale(p.grad)
        g = g.contiguous()
        is_fp8 = isinstance(p, Float8Tensor)
        target = p.payload if is_fp8 else p.detach()
        spare = spares.get(p)
        if spare is None or any(
            spare[k].shape != state[k].shape or spare[k].dtype != state[k].dtype or spare[k].device != state[k].device
            or spare[k].data_ptr() == state[k].data_ptr() for k in keys
        ):
            spare = spares[p] = {k: torch.empty_like(state[k]) for k in keys}
        w, m, v = state["master"], state["exp_avg"], state["exp_avg_sq"]
        w_scaled = is_fp8 and master_scaled
        addrs = (w.data_ptr(), m.data_ptr(), v.data_ptr(), target.data_ptr(), state["master_scale"].data_ptr(),
                 state["exp_avg_scale"].data_ptr(), state["exp_avg_sq_scale"].data_ptr(),
                 (p.scale if is_fp8 else scratch).data_ptr(), state["step"].data_ptr())
        extra = (spare["master"].data_ptr(), spare["exp_avg"].data_ptr(), spare["exp_avg_sq"].data_ptr(),
                 state["exp_avg_amax"].data_ptr(), state["exp_avg_sq_amax"].data_ptr(), state["master_amax"].data_ptr(),
                 (state["param_amax"] if is_fp8 else scratch).data_ptr())
        codes = format_code(w.dtype) | format_code(m.dtype) << 4 | format_code(v.dtype) << 8 | format_code(target.dtype) << 12
        flags = int(m_scaled) | int(v_scaled) << 1 | int(w_scaled) << 2 | int(is_fp8) << 3 | 1 << 4
        rows.append((addrs, p.numel(), codes, flags,
                     (_fmax(m.dtype), _fmax(v.dtype), _fmax(w.dtype), _fmax(target.dtype)), extra))
        grads.append((g, [g.data_ptr(), format_code(g.dtype)]))
        old.extend([g_scale, state["master_scale"], state["exp_avg_scale"], state["exp_avg_sq_scale"],
                    p.scale if is_fp8 else ones])
        hist.extend([state["exp_avg_amax"], state["exp_avg_sq_amax"], state["master_amax"],
                     state["param_amax"] if is_fp8 else scratch.reshape(())])
    parities = optimizer.__dict__.setdefault("_delayed_parity", {})  # which buffer is live, per group (cache key)
    parity = parities.get(group_index, 0)
    table, fmax, blocks, n_blocks = _static_tables(optimizer, ("delayed", group_index, parity), rows, device)
    grad_table = _device_table([row for _, row in grads], torch.int64, device)
    n = len(ps)
    old_scales = torch.stack([s.reshape(()).to(torch.float32) for s in old]).view(n, 5)
    history = torch.stack([h.reshape(()).to(torch.float32) for h in hist]).view(n, 4)
    step64 = (torch.stack([optimizer.state[p]["step"] for p in ps]) + 1).to(torch.float64)
    bc = torch.stack([lr / (1 - beta1**step64).to(torch.float32), (1 - beta2**step64).sqrt().to(torch.float32)],
                     dim=1).contiguous()
    flag_bits = table[:, 11]
    one = torch.ones(n, dtype=torch.float32, device=device)
    scaled = [(flag_bits & bit) != 0 for bit in (1, 2, 4, 8)]
    delayed = torch.stack([torch.where(scaled[k], power_of_two_scale(history[:, k], fmax[:, k], margin=DELAYED_HEADROOM), one)
                           for k in range(4)], dim=1).contiguous()
    amax = torch.zeros(n, 3, dtype=torch.float32, device=device)
    scalars = dict(lr=lr, omb1=1 - beta1, beta2=beta2, omb2=1 - beta2, eps=eps, weight_decay=wd, decay_factor=1 - lr * wd)
    consts = dict(MAXIMIZE=bool(group.get("maximize", False)), DECOUPLED=bool(group["decoupled_weight_decay"]),
                  HAS_DECAY=bool(wd), BLOCK=_BLOCK)
    adam_delayed_kernel[(n_blocks,)](blocks, table, grad_table, old_scales, bc, fmax, delayed, amax, bad,
                                     **scalars, **consts)
    # The scales each state ends with: delayed where its new amax fits, current otherwise (as the torch path).
    final_m = torch.where(scaled[0], delayed_or_current_scale(amax[:, 0], history[:, 0], fmax[:, 0], old_scales[:, 2]), one)
    final_v = torch.where(scaled[1], delayed_or_current_scale(amax[:, 1], history[:, 1], fmax[:, 1], old_scales[:, 3]), one)
    final_w = torch.where(scaled[2], delayed_or_current_scale(amax[:, 2], history[:, 2], fmax[:, 2], old_scales[:, 1]), one)
    w_dtype = precision.format("master").dtype  # FP8 weights' masters share one dtype
    stored = (amax[:, 2] * final_w).clamp(max=_fmax(w_dtype)).to(w_dtype).to(torch.float32) * final_w.reciprocal()
    final_p = torch.where(scaled[3], delayed_or_current_scale(stored, history[:, 3], fmax[:, 3], old_scales[:, 4]), one)
    final = torch.stack([final_m, final_v, final_w, final_p], dim=1).contiguous()
    redo = (final != delayed).any(dim=1).to(torch.int32)
    new_history = torch.stack([amax[:, 0], amax[:, 1], amax[:, 2], torch.where(scaled[3], stored, 0.0)], dim=1).contiguous()
    adam_delayed_fixup_kernel[(n_blocks,)](blocks, table, grad_table, old_scales, bc, fmax, final, redo, new_history,
                                           bad, **scalars, **consts)
    for p in ps:  # the written buffers become the states (a skipped step copied the inputs into them)
        state, spare = optimizer.state[p], spares[p]
        for k in keys:
            state[k], spare[k] = spare[k], state[k]
    parities[group_index] = 1 - parity


def _new_scales(optimizer, table: torch.Tensor, fmax: torch.Tensor, old: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``(n, 4)`` fp32 new scales (moment 1, moment 2, master, FP8 weight) of one group, on device and
    elementwise over its tensors: a power of two from each amax (the previous scale kept for an amax of
    0, inf or NaN), 1 for unscaled roles. Same values as the torch path's per-tensor scales."""
    flags = table[:, 11]
    one = torch.ones_like(amax[:, 0])
    m = torch.where((flags & 1) != 0, power_of_two_scale(amax[:, 0], fmax[:, 0], previous=old[:, 2]), one)
    v = torch.where((flags & 2) != 0, power_of_two_scale(amax[:, 1], fmax[:, 1], previous=old[:, 3]), one)
    w = torch.where((flags & 4) != 0, power_of_two_scale(amax[:, 2], fmax[:, 2], previous=old[:, 1]), one)
    # The refreshed FP8 weight's scale comes from the stored master's amax: rounding is monotonic, so
    # that amax is the stored value of the new master's amax. FP8 weights' masters share one dtype.
    w_dtype = optimizer.precision.format("master").dtype
    stored = (amax[:, 2] * w).clamp(max=_fmax(w_dtype)).to(w_dtype).to(torch.float32) * w.reciprocal()
    p = torch.where((flags & 8) != 0, power_of_two_scale(stored, fmax[:, 3], previous=old[:, 4]), one)
    return torch.stack([m, v, w, p], dim=1).contiguous()
