"""The FP8 Adam/AdamW update as Triton kernels over all of an optimizer's tensors (CUDA; interpreter in tests).

:func:`fused_adam_step` does what :meth:`fp8.optim.base.FP8Optimizer.step`'s torch path does for
:class:`fp8.optim.Adam`/``AdamW``, with the state layout of :mod:`fp8.optim.base`: stage 1 over every
tensor (amaxes of the new states, non-finite gradient flag), new power-of-two scales on device, stage 2
over every tensor (writes, masked by the flag). No host sync. Results equal the torch path up to fp32
rounding of the update math (fused multiply-adds), i.e. at most one step of the storage format.
"""

from __future__ import annotations

import torch

from ..scaling import compute_scale, power_of_two_scale
from ..tensor import Float8Tensor

__all__ = ["fused_adam_step"]

_BLOCK = 1024


def _payload_and_scale(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(t, Float8Tensor):
        return t.payload, t.scale
    return t.detach(), torch.ones((), dtype=torch.float32, device=t.device)


def _fmax(dtype: torch.dtype) -> float:
    return {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.float16: 65504.0}.get(dtype, float("inf"))


def _new_scale(amax: torch.Tensor, payload: torch.Tensor, old: torch.Tensor, scaled: bool) -> torch.Tensor:
    if not scaled:
        return torch.ones_like(old)
    return power_of_two_scale(amax, _fmax(payload.dtype), previous=old)


@torch.no_grad()
def fused_adam_step(optimizer, params: list[torch.Tensor]) -> torch.Tensor:
    """One Adam/AdamW step of ``optimizer`` (an :class:`fp8.optim.Adam`) over ``params`` (those with a
    gradient, states initialized) with the Triton kernels; returns the 0-d bool "step taken" flag."""
    import triton

    from .triton_adam import adam_stage1_kernel, adam_stage2_kernel
    from .triton_formats import format_code, payload_view

    device = params[0].device
    bad = torch.zeros((), dtype=torch.int32, device=device)
    work = []
    for group in optimizer.param_groups:
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            step = (state["step"] + 1).to(torch.float64)
            bc1 = (1 - beta1**step).to(torch.float32)
            bc2 = (1 - beta2**step).sqrt().to(torch.float32)
            step_size = lr / bc1
            g, g_scale = _payload_and_scale(p.grad)
            has_master = "master" in state
            w, w_scale = (state["master"], state["master_scale"]) if has_master else (p.detach(), torch.ones((), device=device))
            if not has_master and p.dtype != torch.float32:
                raise ValueError("fused_adam_step: parameters without a master must be fp32")
            scalars = dict(lr=lr, omb1=1 - beta1, beta2=beta2, omb2=1 - beta2, eps=eps, weight_decay=wd,
                           decay_factor=1 - lr * wd)
            flags = dict(G_FMT=format_code(g.dtype), W_FMT=format_code(w.dtype), M_FMT=format_code(state["exp_avg"].dtype),
                         V_FMT=format_code(state["exp_avg_sq"].dtype), MAXIMIZE=bool(group.get("maximize", False)),
                         DECOUPLED=bool(group["decoupled_weight_decay"]), HAS_DECAY=bool(wd))
            args = (payload_view(g), g_scale, payload_view(w), w_scale, payload_view(state["exp_avg"]), state["exp_avg_scale"],
                    payload_view(state["exp_avg_sq"]), state["exp_avg_sq_scale"], step_size, bc2)
            amax = torch.zeros(3, dtype=torch.float32, device=device)
            grid = (triton.cdiv(p.numel(), _BLOCK),)
            adam_stage1_kernel[grid](*args, amax, bad, p.numel(), **scalars, **flags, BLOCK=_BLOCK)
            work.append((p, state, has_master, w, args, amax, scalars, flags, grid))
    ok = bad == 0
    for p, state, has_master, w, args, amax, scalars, flags, grid in work:
        precision = optimizer.precision
        m_scaled = precision.format("exp_avg").scaled_max is not None
        v_scaled = precision.format("exp_avg_sq").scaled_max is not None
        w_scaled = has_master and isinstance(p, Float8Tensor) and precision.format("master").scaled_max is not None
        scales = [
            _new_scale(amax[0], state["exp_avg"], state["exp_avg_scale"], m_scaled),
            _new_scale(amax[1], state["exp_avg_sq"], state["exp_avg_sq_scale"], v_scaled),
            _new_scale(amax[2], w, state["master_scale"], w_scaled) if has_master else torch.ones((), device=p.device),
        ]
        # The refreshed FP8 weight's scale comes from the stored master's amax: rounding is monotonic,
        # so that amax is the stored value of the new master's amax.
        if isinstance(p, Float8Tensor):
            stored = (amax[2] * scales[2]).clamp(max=_fmax(w.dtype)).to(w.dtype).to(torch.float32) * scales[2].reciprocal()
            scales.append(compute_scale(stored, p.format, previous=p.scale))
        else:
            scales.append(torch.ones((), device=p.device))
        new_scales = torch.stack(scales)
        target = p.payload if isinstance(p, Float8Tensor) else p.detach()
        adam_stage2_kernel[grid](
            *args, new_scales, bad, payload_view(target), p.numel(), **scalars, **flags,
            P_FMT=format_code(target.dtype), M_MAX=_fmax(state["exp_avg"].dtype), V_MAX=_fmax(state["exp_avg_sq"].dtype),
            W_MAX=_fmax(w.dtype), P_MAX=_fmax(target.dtype), M_SCALED=m_scaled, V_SCALED=v_scaled, W_SCALED=w_scaled,
            P_SCALED=isinstance(p, Float8Tensor), HAS_PARAM=has_master, BLOCK=_BLOCK,
        )
        state["exp_avg_scale"] = torch.where(ok, scales[0], state["exp_avg_scale"])
        state["exp_avg_sq_scale"] = torch.where(ok, scales[1], state["exp_avg_sq_scale"])
        if has_master:
            state["master_scale"] = torch.where(ok, scales[2], state["master_scale"])
        if isinstance(p, Float8Tensor):
            p.scale.copy_(torch.where(ok, scales[3], p.scale))
        state["step"] = torch.where(ok, state["step"] + 1, state["step"])
    return ok
