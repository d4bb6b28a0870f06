"""The optimizer step as multi-tensor ops: each a ``torch.library`` custom op (namespace ``fp8lm``) over lists of
tensors, so a step is a fixed number of ops however many parameters it updates.

Each op has a torch reference (the CPU implementation: the optimizer's torch math, looping over the tensors inside the
op) and a CUDA implementation in Triton, registered with ``register_kernel("cuda")``, that is exactly one kernel
launch (:mod:`fp8.kernels.triton_multi_tensor`, :mod:`fp8.kernels.triton_adam`; Triton is imported when a launch first
runs, never at ``import fp8``). Seen by :class:`fp8.launches.LaunchCounter` a custom op is one op, so the op sequence a
CPU step dispatches is the GPU's kernel sequence, and each has a fake implementation, so ``torch.compile`` sees one
op. The ``backend`` argument picks the implementation: ``"triton"`` (on CUDA tensors; on CPU tensors under
``TRITON_INTERPRET=1``, which is how the tests compare the two) or ``"torch"`` (the reference, on any device).

Writes of the references go through ``.data``: the op itself bumps each mutated tensor's version counter once (as a
Triton kernel writing through addresses leaves it, and as one in-place op would).

The ops (lists are per row, one row per tensor or parameter):

- :func:`mark_nonfinite_`: a flag set where any element of any tensor is inf or NaN (the skip decision).
- :func:`amaxes_`, :func:`quantize_weights_`: an FP8 weight refresh from its master (amaxes, then the cast with the scale
  from each amax); :func:`quantize_weight_blocks_` the same for block-scaled weights (per-block scales, one pass).
- :func:`dequantize_grads`: scaled gradients as high-precision tensors (O1's master gradients).
- :func:`clone_tensors`, :func:`restore_unless_`: a copy of tensors, and their values restored from it unless a step was
  taken (O1's masked step of a wrapped optimizer).
- the optimizer states' update (:class:`fp8.optim.FP8Optimizer`): :func:`prepare_states_` (old scales, bias
  corrections, zeroed amaxes, the skip flag), a first pass per param group (:func:`adam_stage1_`,
  :func:`sgd_stage1_`: amaxes of the new states, non-finite gradients), :func:`state_scales_` (the new scales),
  and a second pass per group (:func:`adam_stage2_`, :func:`sgd_stage2_`: states, masters and parameters written,
  masked by the skip flag).

The state ops take the same lists (``weights``: each parameter's master, or the fp32 parameter that is its own;
``params``: what is refreshed from it: the FP8 payload, the 16-bit parameter, or an empty placeholder; moments, scales
and step counts, empty placeholders where a tensor has none) and ``kinds`` (0: fp32 parameter, its own master; 1:
16-bit parameter with an fp32 master; 2: FP8 weight; 3: block-scaled FP8 weight, whose master the passes update and
:func:`quantize_weight_blocks_` then quantizes into it), plus ``tables``: the cached device tables of the Triton
launches (:func:`fp8.kernels.triton_multi_tensor.state_table`), or an empty list (built per call; the reference
ignores them).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import custom_op

from ..cast import dequantize as dequantize_payload
from ..blocks import block_size, quantize_to_blocks
from ..cast import quantize
from ..formats import FP8_DTYPES, get_format
from ..scaling import amax_of, power_of_two_scale
from .precision import STOCHASTIC_GRIDS, decode, round_stochastically

__all__ = [
    "mark_nonfinite_", "amaxes_", "quantize_weights_", "quantize_weight_blocks_", "dequantize_grads", "clone_tensors", "restore_unless_", "prepare_states_",
    "adam_stage1_", "adam_stage2_", "sgd_stage1_", "sgd_stage2_", "state_scales_", "select_where", "adam_update_",
    "sgd_update", "OP_BACKENDS", "STATE_LISTS",
]

OP_BACKENDS = ("torch", "triton")
"""What the ``backend`` argument of every op takes."""


def select_where(ok: Tensor, new: Tensor, old: Tensor) -> Tensor:
    """``new`` where the 0-d bool ``ok`` is set, else ``old`` (any dtype, FP8 included; no host sync)."""
    if new.dtype in FP8_DTYPES:  # torch.where has no FP8 kernel: select the bytes
        return torch.where(ok, new.view(torch.uint8), old.view(torch.uint8)).view(new.dtype)
    return torch.where(ok, new, old)


def _launchers():
    """The Triton launchers' module (imported at the first launch: Triton is never imported by ``import fp8``)."""
    from ..kernels import triton_multi_tensor

    return triton_multi_tensor


def _check_backend(backend: str) -> None:
    if backend not in OP_BACKENDS:
        raise ValueError(f"backend must be one of {OP_BACKENDS}, got {backend!r}")


def _implementations(op, reference, launch) -> None:
    """``op``'s CPU kernel runs ``reference`` (``launch`` when ``backend="triton"``: the interpreter, in tests); its
    CUDA kernel runs ``launch``, the Triton launch (``reference`` when ``backend="torch"``). Elsewhere (and for a call
    without tensors) the op's own body runs the reference."""

    def default(*args, backend="torch", **kwargs):
        _check_backend(backend)
        return (launch if backend == "triton" else reference)(*args, **kwargs)

    def cuda(*args, backend="torch", **kwargs):
        _check_backend(backend)
        return (reference if backend == "torch" else launch)(*args, **kwargs)

    op.register_kernel("cpu")(default)
    op.register_kernel("cuda")(cuda)


def _scaled_max(dtype: torch.dtype) -> float | None:
    """The largest value of a scaled storage dtype (FP8, FP16; stored with a power-of-two scale), None for others."""
    return {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.float16: 65504.0}.get(dtype)


# -- the skip decision -------------------------------------------------------------------------------------------------
@custom_op("fp8lm::mark_nonfinite_", mutates_args=("flag",))
def mark_nonfinite_(tensors: list[Tensor], flag: Tensor, *, backend: str = "torch") -> None:
    """Set ``flag`` (int32, one element) to 1 when any element of ``tensors`` is inf or NaN; leave it otherwise."""
    _check_backend(backend)
    return _mark_nonfinite_reference(tensors, flag)


def _mark_nonfinite_reference(tensors, flag):
    if not tensors:
        return
    finite = torch.stack([torch.isfinite(t.to(torch.float32) if t.dtype in FP8_DTYPES else t).all()
                          for t in tensors]).all()
    flag.data.copy_(torch.where(finite, flag, torch.ones_like(flag)))


_implementations(mark_nonfinite_, _mark_nonfinite_reference,
                 lambda tensors, flag: _launchers().launch_mark_nonfinite(tensors, flag))


@mark_nonfinite_.register_fake
def _(tensors, flag, *, backend="torch"):
    return None


# -- an FP8 weight refresh from its master (O1) ----------------------------------------------------------------------
@custom_op("fp8lm::amaxes_", mutates_args=("out",))
def amaxes_(tensors: list[Tensor], out: Tensor, *, backend: str = "torch") -> None:
    """``out[i]`` (fp32) becomes ``max(out[i], tensors[i].abs().amax())`` (NaN if either is NaN)."""
    _check_backend(backend)
    return _amax_reference(tensors, out)


def _amax_reference(tensors, out):
    for i, t in enumerate(tensors):
        value = amax_of(t.to(torch.float32) if t.dtype in FP8_DTYPES else t)
        out.data[i].copy_(torch.maximum(out[i], value))


_implementations(amaxes_, _amax_reference, lambda tensors, out: _launchers().launch_amax(tensors, out))


@amaxes_.register_fake
def _(tensors, out, *, backend="torch"):
    return None


@custom_op("fp8lm::quantize_weights_", mutates_args=("payloads", "scales"))
def quantize_weights_(values: list[Tensor], amax: Tensor, payloads: list[Tensor], scales: list[Tensor], *,
              backend: str = "torch") -> None:
    """Each FP8 ``payloads[i]`` becomes ``values[i]`` cast with ``scale = power_of_two_scale(amax[i], format max,
    previous=scales[i])``, and ``scales[i]`` that scale (as ``Float8Tensor.copy_`` re-quantizes)."""
    _check_backend(backend)
    return _quantize_reference(values, amax, payloads, scales)


def _quantize_reference(values, amax, payloads, scales):
    for i, (value, payload, scale) in enumerate(zip(values, payloads, scales)):
        fmt = get_format(payload.dtype)
        new_scale = power_of_two_scale(amax[i], fmt.max, previous=scale)
        payload.data.copy_(quantize(value, new_scale, fmt))
        scale.data.copy_(new_scale)


_implementations(quantize_weights_, _quantize_reference,
                 lambda values, amax, payloads, scales: _launchers().launch_quantize(values, amax, payloads, scales))


@quantize_weights_.register_fake
def _(values, amax, payloads, scales, *, backend="torch"):
    return None


@custom_op("fp8lm::quantize_weight_blocks_", mutates_args=("payloads", "scales"))
def quantize_weight_blocks_(values: list[Tensor], value_scales: list[Tensor], payloads: list[Tensor],
                            scales: list[Tensor], blocks: list[int], bad: Tensor | None, *,
                            backend: str = "torch") -> None:
    """Block-scaled FP8 weights refreshed from their masters (the ``rowwise`` and ``blockwise`` recipes' weights): each
    2-D ``payloads[i]`` and its scale grid ``scales[i]`` become ``values[i]`` (as many elements; divided by the 0-d
    ``value_scales[i]``, a stored master's scale; an empty one: none) quantized with one current power-of-two scale
    per block of ``blocks[2 * i]`` x ``blocks[2 * i + 1]`` elements (0: the whole dimension), as
    :func:`fp8.blocks.quantize_to_blocks` (``Float8Tensor.copy_``) does; nothing where ``bad`` (int32, one element)
    is set."""
    _check_backend(backend)
    return _quantize_blocks_reference(values, value_scales, payloads, scales, blocks, bad)


def _resolved_blocks(payloads, blocks) -> list[tuple[int, int]]:
    """Each payload's block from the flat ``blocks`` list, sizes resolved (:func:`fp8.blocks.block_size`)."""
    return [block_size((blocks[2 * i], blocks[2 * i + 1]), tuple(p.shape)) for i, p in enumerate(payloads)]


def _quantize_blocks_reference(values, value_scales, payloads, scales, blocks, bad):
    ok = None if bad is None else bad.reshape(()) == 0
    for value, value_scale, payload, scale, block in zip(values, value_scales, payloads, scales,
                                                         _resolved_blocks(payloads, blocks)):
        value = decode(value, value_scale) if value_scale.numel() else value.to(torch.float32)
        new, grid = quantize_to_blocks(value.reshape(payload.shape), block, get_format(payload.dtype))
        if ok is not None:
            new, grid = select_where(ok, new, payload), torch.where(ok, grid, scale)
        payload.data.copy_(new)
        scale.data.copy_(grid)


def _quantize_blocks_launch(values, value_scales, payloads, scales, blocks, bad):
    _launchers().launch_block_quantize([v.contiguous() for v in values],
                                       [s if s.numel() else None for s in value_scales], payloads, scales,
                                       _resolved_blocks(payloads, blocks), bad)


_implementations(quantize_weight_blocks_, _quantize_blocks_reference, _quantize_blocks_launch)


@quantize_weight_blocks_.register_fake
def _(values, value_scales, payloads, scales, blocks, bad, *, backend="torch"):
    return None


@custom_op("fp8lm::dequantize_grads", mutates_args=())
def dequantize_grads(payloads: list[Tensor], scales: list[Tensor], dtype: torch.dtype, *,
               backend: str = "torch") -> list[Tensor]:
    """``payloads[i] / scales[i]`` in ``dtype`` (``fp8.cast.dequantize``); an empty ``scales[i]`` means none (a
    cast)."""
    _check_backend(backend)
    return _dequantize_reference(payloads, scales, dtype)


def _dequantize_reference(payloads, scales, dtype):
    return [dequantize_payload(p, s, dtype) if s.numel() else p.to(dtype, copy=True) for p, s in zip(payloads, scales)]


def _dequantize_launch(payloads, scales, dtype):
    outs = [torch.empty(p.shape, dtype=dtype, device=p.device) for p in payloads]
    _launchers().launch_dequantize([p.contiguous() for p in payloads], [s if s.numel() else None for s in scales],
                                   outs)
    return outs


_implementations(dequantize_grads, _dequantize_reference, _dequantize_launch)


@dequantize_grads.register_fake
def _(payloads, scales, dtype, *, backend="torch"):
    return [torch.empty(p.shape, dtype=dtype, device=p.device) for p in payloads]


# -- a masked step of a wrapped optimizer (O1) -------------------------------------------------------------------------
@custom_op("fp8lm::clone_tensors", mutates_args=())
def clone_tensors(tensors: list[Tensor], *, backend: str = "torch") -> list[Tensor]:
    """A copy of each tensor (contiguous ones: one Triton launch)."""
    _check_backend(backend)
    return _clone_reference(tensors)


def _clone_reference(tensors):
    return [t.clone() for t in tensors]


def _clone_launch(tensors):
    if not all(t.is_contiguous() for t in tensors):
        return _clone_reference(tensors)
    outs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    _launchers().launch_copy(tensors, outs)
    return outs


_implementations(clone_tensors, _clone_reference, _clone_launch)


@clone_tensors.register_fake
def _(tensors, *, backend="torch"):
    return [torch.empty_like(t) for t in tensors]


@custom_op("fp8lm::restore_unless_", mutates_args=("tensors",))
def restore_unless_(tensors: list[Tensor], saved: list[Tensor], ok: Tensor, *, backend: str = "torch") -> None:
    """Where the 0-d bool ``ok`` is False, each tensor takes back the values of ``saved[i]`` (same shape and dtype);
    left as it is otherwise."""
    _check_backend(backend)
    return _restore_reference(tensors, saved, ok)


def _restore_reference(tensors, saved, ok):
    for t, s in zip(tensors, saved):
        t.data.copy_(select_where(ok, t, s))


def _restore_launch(tensors, saved, ok):
    if not all(t.is_contiguous() and s.is_contiguous() for t, s in zip(tensors, saved)):
        return _restore_reference(tensors, saved, ok)
    _launchers().launch_copy(saved, tensors, unless_ok=ok)


_implementations(restore_unless_, _restore_reference, _restore_launch)


@restore_unless_.register_fake
def _(tensors, saved, ok, *, backend="torch"):
    return None


# -- the optimizer states (FP8Optimizer) -------------------------------------------------------------------------------
def adam_update_(w: Tensor, g: Tensor, m: Tensor, v: Tensor, lr_bc: Tensor, bc2: Tensor, *, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float, decoupled: bool) -> None:
    """Adam's update of the fp32 master value ``w`` and moments ``m``, ``v`` in place (fresh tensors) from the fp32
    gradient ``g``; ``lr_bc`` is ``lr / (1 - beta1**t)`` and ``bc2`` ``sqrt(1 - beta2**t)`` (0-d fp32)."""
    if weight_decay:
        if decoupled:
            w.mul_(1 - lr * weight_decay)
        else:
            g = g.add(w, alpha=weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / bc2).add_(eps)
    w.sub_(m / denom * lr_bc)


def sgd_update(w: Tensor, g: Tensor, previous: Tensor | None, first: Tensor, *, lr: float, momentum: float,
               dampening: float, weight_decay: float, nesterov: bool) -> Tensor | None:
    """SGD's update of the fp32 master value ``w`` in place from the fp32 gradient ``g``; returns the new momentum
    buffer (from ``previous``, a fresh tensor; the gradient itself where the 0-d bool ``first`` is set), None without
    momentum."""
    if weight_decay:
        g = g.add(w, alpha=weight_decay)
    buf = None
    if momentum:
        buf = torch.where(first, g, previous.mul_(momentum).add_(g, alpha=1 - dampening))
        g = g.add(buf, alpha=momentum) if nesterov else buf
    w.add_(g, alpha=-lr)
    return buf


def _encode(value: Tensor, scale: Tensor, dtype: torch.dtype, stochastic: tuple | None = None) -> Tensor:
    """``value`` stored in ``dtype`` with ``scale`` (:func:`fp8.optim.precision.encode` given its scale); rounded
    stochastically with ``stochastic = (row, step)`` (:func:`fp8.optim.precision.round_stochastically`)."""
    fmax = _scaled_max(dtype)
    if fmax is None:
        return value.to(dtype)
    scaled = (value * scale).clamp_(-fmax, fmax)
    return (scaled if stochastic is None else round_stochastically(scaled, *stochastic, dtype)).to(dtype)


def _grad_is_finite(grad: Tensor, scale: Tensor) -> Tensor:
    return torch.isfinite(grad.to(torch.float32) if grad.dtype in FP8_DTYPES else grad).all() & torch.isfinite(scale)


def _state_tables(tables, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales, exp_avg_sq_scales,
                  param_scales, steps, kinds, moments):
    """``(table, fmax, blocks, n_blocks)`` of the Triton launches: the cached device tables given (``tables``), or
    ones built for this call (``torch.compile``'s graphs, calls from tests)."""
    triton = _launchers()
    if tables:
        table, fmax, *blocks = tables
        return table, fmax, (blocks[0] if blocks else None), (blocks[0].shape[0] if blocks else 0)
    if isinstance(moments, int):
        moments = [moments] * len(kinds)
    device = steps[0].device
    scratch = torch.ones(1, dtype=torch.float32, device=device)  # read for missing tensors, never written
    rows, fmaxes = triton.state_table(weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                                      exp_avg_sq_scales, param_scales, steps, kinds, moments, scratch)
    blocks, n_blocks = triton.block_table([row[9] for row in rows], device)
    return (triton.device_table(rows, torch.int64, device), triton.device_table(fmaxes, torch.float32, device),
            blocks, n_blocks)


STATE_LISTS = ("weights", "exp_avgs", "exp_avg_sqs", "params", "weight_scales", "exp_avg_scales", "exp_avg_sq_scales",
               "param_scales", "steps")
"""The per-row state lists every state op takes, in their argument order (module docstring)."""


@custom_op("fp8lm::prepare_states_", mutates_args=("old", "bc", "amax", "bad"))
def prepare_states_(grad_scales: list[Tensor], weights: list[Tensor], exp_avgs: list[Tensor],
                    exp_avg_sqs: list[Tensor], params: list[Tensor], weight_scales: list[Tensor],
                    exp_avg_scales: list[Tensor], exp_avg_sq_scales: list[Tensor], param_scales: list[Tensor],
                    steps: list[Tensor], kinds: list[int], moments: list[int], beta1: list[float], beta2: list[float],
                    lr: list[float], bias_correction: bool, agreed: Tensor | None, old: Tensor, bc: Tensor,
                    amax: Tensor, bad: Tensor, tables: list[Tensor], *, backend: str = "torch") -> None:
    """Before a step's update passes, per row (every param group's): ``old[i]`` the old scales (gradient, master,
    first moment, second moment, FP8 parameter; 1 where there is none: an empty ``grad_scales[i]``, a parameter
    without master or scale, a missing moment); ``bc[i]`` Adam's ``(lr / (1 - beta1**t), sqrt(1 - beta2**t))`` for
    the new step ``t`` (``bias_correction``), else the step count before this step (twice); ``amax[i]`` zeroed;
    ``bad`` (int32, one element) "not ``agreed``" (0 without an agreement)."""
    _check_backend(backend)
    return _prepare_reference(grad_scales, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                              exp_avg_sq_scales, param_scales, steps, kinds, moments, beta1, beta2, lr,
                              bias_correction, agreed, old, bc, amax, bad, tables)


def _prepare_reference(grad_scales, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                       exp_avg_sq_scales, param_scales, steps, kinds, moments, beta1, beta2, lr, bias_correction,
                       agreed, old, bc, amax, bad, tables=None):
    one = torch.ones((), dtype=torch.float32, device=old.device)
    for i, kind in enumerate(kinds):
        scales = (grad_scales[i] if grad_scales[i].numel() else one, weight_scales[i] if kind else one,
                  exp_avg_scales[i] if moments[i] >= 1 else one, exp_avg_sq_scales[i] if moments[i] >= 2 else one,
                  param_scales[i] if kind == 2 else one)
        old.data[i].copy_(torch.stack([s.reshape(()).to(torch.float32) for s in scales]))
        if bias_correction:
            step = (steps[i] + 1).to(torch.float64)  # 1 - beta**step cancels: float64 keeps it exact to fp32 rounding
            bias_correction1 = (1 - beta1[i] ** step).to(torch.float32)
            bias_correction2_sqrt = (1 - beta2[i] ** step).sqrt().to(torch.float32)
            bc.data[i].copy_(torch.stack([lr[i] / bias_correction1, bias_correction2_sqrt]))
        else:
            bc.data[i].copy_(steps[i].to(torch.float32).expand(2))
    amax.data.zero_()
    bad.data.copy_((~agreed).to(bad.dtype).reshape(bad.shape) if agreed is not None else torch.zeros_like(bad))


def _prepare_launch(grad_scales, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                    exp_avg_sq_scales, param_scales, steps, kinds, moments, beta1, beta2, lr, bias_correction, agreed,
                    old, bc, amax, bad, tables=None):
    table, _, _, _ = _state_tables(tables, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                                   exp_avg_sq_scales, param_scales, steps, kinds, moments)
    hyper = [[b1, b2, r] for b1, b2, r in zip(beta1, beta2, lr)]
    _launchers().launch_prepare_states(table, [s if s.numel() else None for s in grad_scales], hyper, agreed, old, bc,
                                       amax, bad, bias_correction)


_implementations(prepare_states_, _prepare_reference, _prepare_launch)


@prepare_states_.register_fake
def _(*args, backend="torch"):
    return None


@custom_op("fp8lm::state_scales_", mutates_args=("new",))
def state_scales_(weights: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor], params: list[Tensor],
                  weight_scales: list[Tensor], exp_avg_scales: list[Tensor], exp_avg_sq_scales: list[Tensor],
                  param_scales: list[Tensor], steps: list[Tensor], kinds: list[int], moments: list[int], amax: Tensor,
                  old: Tensor, new: Tensor, tables: list[Tensor], *, backend: str = "torch") -> None:
    """Per row (every param group's), ``new[i]``: the scales (first moment, second moment, master, FP8 parameter)
    of the new values from their amaxes ``amax[i]`` (the first passes), a power of two per scaled role (the old scale
    ``old[i]`` where the amax is 0 or not finite), 1 for unscaled ones; the FP8 parameter's from the amax of its
    master as stored (rounding is monotonic: the stored value of the amax)."""
    _check_backend(backend)
    return _scales_reference(weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales, exp_avg_sq_scales,
                             param_scales, steps, kinds, moments, amax, old, new, tables)


def _scales_reference(weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales, exp_avg_sq_scales,
                      param_scales, steps, kinds, moments, amax, old, new, tables=None):
    one = torch.ones((), dtype=torch.float32, device=new.device)
    for i, kind in enumerate(kinds):
        out = []
        for k, (dtype, old_k) in enumerate(((exp_avgs[i].dtype if moments[i] >= 1 else None, 2),
                                            (exp_avg_sqs[i].dtype if moments[i] >= 2 else None, 3),
                                            (weights[i].dtype if kind in (2, 3) else None, 1))):
            fmax = _scaled_max(dtype) if dtype is not None else None
            out.append(power_of_two_scale(amax[i, k], fmax, previous=old[i, old_k]) if fmax is not None else one)
        p_scale = one
        if kind == 2:
            w_scale, w_dtype = out[2], weights[i].dtype
            stored = (amax[i, 2] * w_scale).clamp(max=_scaled_max(w_dtype) or float("inf")).to(w_dtype)
            p_scale = power_of_two_scale(stored.to(torch.float32) * w_scale.reciprocal(),
                                         get_format(params[i].dtype).max, previous=old[i, 4])
        new.data[i].copy_(torch.stack([*out, p_scale]))


def _scales_launch(weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales, exp_avg_sq_scales,
                   param_scales, steps, kinds, moments, amax, old, new, tables=None):
    table, fmax, _, _ = _state_tables(tables, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                                      exp_avg_sq_scales, param_scales, steps, kinds, moments)
    masters = {w.dtype for w, kind in zip(weights, kinds) if kind == 2} or {torch.float32}
    if len(masters) > 1:
        raise ValueError(f"state_scales_: the FP8 weights' masters share one storage dtype, got "
                         f"{sorted(map(str, masters))}")
    _launchers().launch_state_scales(table, fmax, amax, old, new, masters.pop())


_implementations(state_scales_, _scales_reference, _scales_launch)


@state_scales_.register_fake
def _(*args, backend="torch"):
    return None


def _decode_row(i: int, grads, weights, exp_avgs, exp_avg_sqs, old: Tensor, moments: int, maximize: bool):
    """Row ``i``'s fp32 gradient, master value and moments (fresh tensors), decoded with the old scales."""
    g = decode(grads[i], old[i, 0])
    if maximize:
        g = -g
    w = decode(weights[i], old[i, 1])
    m = decode(exp_avgs[i], old[i, 2]) if moments >= 1 else None
    v = decode(exp_avg_sqs[i], old[i, 3]) if moments >= 2 else None
    return g, w, m, v


def _record_amaxes(i: int, amax: Tensor, bad: Tensor, grad: Tensor, old: Tensor, m, v, w) -> None:
    zero = torch.zeros((), dtype=torch.float32, device=amax.device)
    amax.data[i].copy_(torch.stack([amax_of(m) if m is not None else zero, amax_of(v) if v is not None else zero,
                                    amax_of(w)]))
    bad.data.copy_(torch.where(_grad_is_finite(grad, old[i, 0]), bad, torch.ones_like(bad)))


def _write_row(i: int, kind: int, ok: Tensor, new: Tensor, w: Tensor, m, v, weights, exp_avgs, exp_avg_sqs, params,
               weight_scales, exp_avg_scales, exp_avg_sq_scales, param_scales, steps, stochastic_row0: int = -1,
               rounding_steps: Tensor | None = None) -> None:
    """Store row ``i``'s new moments, master and parameter with the new scales ``new[i]``, every write masked by the
    0-d bool ``ok``; the first moment rounded stochastically as the optimizer's row ``stochastic_row0 + i`` at step
    ``rounding_steps[i] + 1`` when ``stochastic_row0 >= 0`` (and its format takes it:
    :data:`fp8.optim.precision.STOCHASTIC_GRIDS`)."""
    for value, payloads, scales, k in ((m, exp_avgs, exp_avg_scales, 0), (v, exp_avg_sqs, exp_avg_sq_scales, 1)):
        if value is not None:
            stochastic = None
            if k == 0 and stochastic_row0 >= 0 and payloads[i].dtype in STOCHASTIC_GRIDS:
                stochastic = (stochastic_row0 + i, _steps_before(rounding_steps)[i] + 1)  # the step being taken
            payloads[i].data.copy_(select_where(ok, _encode(value, new[i, k], payloads[i].dtype, stochastic),
                                                payloads[i]))
            scales[i].data.copy_(torch.where(ok, new[i, k], scales[i]))
    if kind == 0:  # the fp32 parameter is its own master
        weights[i].data.copy_(torch.where(ok, w.to(weights[i].dtype), weights[i]))
    else:
        stored = _encode(w, new[i, 2], weights[i].dtype)
        weights[i].data.copy_(select_where(ok, stored, weights[i]))
        weight_scales[i].data.copy_(torch.where(ok, new[i, 2], weight_scales[i]))
        value = decode(stored, new[i, 2])
        if kind == 1:
            params[i].data.copy_(torch.where(ok, value.to(params[i].dtype), params[i]))
        elif kind == 2:
            fmt = get_format(params[i].dtype)
            params[i].data.copy_(select_where(ok, quantize(value, new[i, 3], fmt), params[i]))
            param_scales[i].data.copy_(torch.where(ok, new[i, 3], param_scales[i]))
    steps[i].data.copy_(torch.where(ok, steps[i] + 1, steps[i]))


def _adam_rows(grads, weights, exp_avgs, exp_avg_sqs, old, bc, lr, beta1, beta2, eps, weight_decay, decoupled,
               maximize):
    for i in range(len(grads)):
        g, w, m, v = _decode_row(i, grads, weights, exp_avgs, exp_avg_sqs, old, 2, maximize)
        adam_update_(w, g, m, v, bc[i, 0], bc[i, 1], lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                     weight_decay=weight_decay, decoupled=decoupled)
        yield i, w, m, v


def _steps_before(rounding_steps: Tensor | None) -> Tensor:
    """Stochastic rounding's step counts (taken before the pass), refused when missing."""
    if rounding_steps is None:
        raise ValueError("stochastic rounding (stochastic_row0 >= 0) needs rounding_steps: the step counts before "
                         "this step, one per row")
    return rounding_steps


def _rounding_args(rounding_steps: Tensor | None, stochastic_row0: int) -> dict:
    """A stage-2 kernel's stochastic-rounding arguments (none when it rounds to nearest)."""
    if stochastic_row0 < 0:
        return {}
    return dict(steps_ptr=_steps_before(rounding_steps).to(torch.float32).contiguous(), row0=stochastic_row0,
                STOCHASTIC=True)


def _adam_kernel_args(lr, beta1, beta2, eps, weight_decay, decoupled, maximize):
    scalars = dict(lr=lr, omb1=1 - beta1, beta2=beta2, omb2=1 - beta2, eps=eps, weight_decay=weight_decay,
                   decay_factor=1 - lr * weight_decay)
    flags = dict(MAXIMIZE=bool(maximize), DECOUPLED=bool(decoupled), HAS_DECAY=bool(weight_decay),
                 BLOCK=_launchers().BLOCK)
    return scalars, flags


@custom_op("fp8lm::adam_stage1_", mutates_args=("amax", "bad"))
def adam_stage1_(grads: list[Tensor], weights: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                 params: list[Tensor], weight_scales: list[Tensor], exp_avg_scales: list[Tensor],
                 exp_avg_sq_scales: list[Tensor], param_scales: list[Tensor], steps: list[Tensor], kinds: list[int],
                 old: Tensor, bc: Tensor, amax: Tensor, bad: Tensor, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, decoupled: bool, maximize: bool, tables: list[Tensor], *,
                 backend: str = "torch") -> None:
    """Adam's first pass over a param group (``fp8.kernels.triton_adam.adam_stage1_kernel``): ``amax[i]`` the amaxes
    of row ``i``'s new first moment, second moment and master value; ``bad`` set to 1 where a gradient (payload or
    scale) is not finite. Reads the old scales ``old`` and bias corrections ``bc`` of :func:`prepare_states_`."""
    _check_backend(backend)
    return _adam_stage1_reference(grads, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                                  exp_avg_sq_scales, param_scales, steps, kinds, old, bc, amax, bad, lr, beta1, beta2,
                                  eps, weight_decay, decoupled, maximize, tables)


def _adam_stage1_reference(grads, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                           exp_avg_sq_scales, param_scales, steps, kinds, old, bc, amax, bad, lr, beta1, beta2, eps,
                           weight_decay, decoupled, maximize, tables=None):
    for i, w, m, v in _adam_rows(grads, weights, exp_avgs, exp_avg_sqs, old, bc, lr, beta1, beta2, eps, weight_decay,
                                 decoupled, maximize):
        _record_amaxes(i, amax, bad, grads[i], old, m, v, w)


def _adam_stage1_launch(grads, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                        exp_avg_sq_scales, param_scales, steps, kinds, old, bc, amax, bad, lr, beta1, beta2, eps,
                        weight_decay, decoupled, maximize, tables=None):
    from ..kernels import triton_adam

    table, _, blocks, n_blocks = _state_tables(tables, weights, exp_avgs, exp_avg_sqs, params, weight_scales,
                                               exp_avg_scales, exp_avg_sq_scales, param_scales, steps, kinds, 2)
    scalars, flags = _adam_kernel_args(lr, beta1, beta2, eps, weight_decay, decoupled, maximize)
    _launchers().launch_state_stage(triton_adam.adam_stage1_kernel, blocks, n_blocks, table,
                                    [g.contiguous() for g in grads], old, bc, amax, bad, **scalars, **flags)


_implementations(adam_stage1_, _adam_stage1_reference, _adam_stage1_launch)


@adam_stage1_.register_fake
def _(*args, backend="torch"):
    return None


@custom_op("fp8lm::adam_stage2_", mutates_args=STATE_LISTS)
def adam_stage2_(grads: list[Tensor], weights: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                 params: list[Tensor], weight_scales: list[Tensor], exp_avg_scales: list[Tensor],
                 exp_avg_sq_scales: list[Tensor], param_scales: list[Tensor], steps: list[Tensor], kinds: list[int],
                 old: Tensor, bc: Tensor, new: Tensor, bad: Tensor, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, decoupled: bool, maximize: bool, tables: list[Tensor],
                 rounding_steps: Tensor | None = None, *, backend: str = "torch", stochastic_row0: int = -1) -> None:
    """Adam's second pass over a param group (``fp8.kernels.triton_adam.adam_stage2_kernel``): the moments, the
    master and the parameter refreshed from it written with the new scales ``new`` (:func:`state_scales_`), then the
    scales and the step count + 1; nothing where ``bad`` is set. ``stochastic_row0 >= 0``: the first moments rounded
    stochastically (``OptimizerPrecision(exp_avg_rounding="stochastic")``), the group's first row being the optimizer's
    row ``stochastic_row0``, with the step counts before this step in ``rounding_steps`` (fp32, one per row of the
    group: a copy taken before the pass, since the pass itself increments the counts while its blocks run)."""
    _check_backend(backend)
    return _adam_stage2_reference(grads, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                                  exp_avg_sq_scales, param_scales, steps, kinds, old, bc, new, bad, lr, beta1, beta2,
                                  eps, weight_decay, decoupled, maximize, tables, rounding_steps,
                                  stochastic_row0)


def _adam_stage2_reference(grads, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                           exp_avg_sq_scales, param_scales, steps, kinds, old, bc, new, bad, lr, beta1, beta2, eps,
                           weight_decay, decoupled, maximize, tables=None, rounding_steps=None,
                           stochastic_row0=-1):
    ok = bad.reshape(()) == 0
    for i, w, m, v in _adam_rows(grads, weights, exp_avgs, exp_avg_sqs, old, bc, lr, beta1, beta2, eps, weight_decay,
                                 decoupled, maximize):
        _write_row(i, kinds[i], ok, new, w, m, v, weights, exp_avgs, exp_avg_sqs, params, weight_scales,
                   exp_avg_scales, exp_avg_sq_scales, param_scales, steps, stochastic_row0, rounding_steps)


def _adam_stage2_launch(grads, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                        exp_avg_sq_scales, param_scales, steps, kinds, old, bc, new, bad, lr, beta1, beta2, eps,
                        weight_decay, decoupled, maximize, tables=None, rounding_steps=None, stochastic_row0=-1):
    from ..kernels import triton_adam

    table, fmax, blocks, n_blocks = _state_tables(tables, weights, exp_avgs, exp_avg_sqs, params, weight_scales,
                                                  exp_avg_scales, exp_avg_sq_scales, param_scales, steps, kinds, 2)
    scalars, flags = _adam_kernel_args(lr, beta1, beta2, eps, weight_decay, decoupled, maximize)
    _launchers().launch_state_stage(triton_adam.adam_stage2_kernel, blocks, n_blocks, table,
                                    [g.contiguous() for g in grads], old, bc, fmax, new, bad, **scalars, **flags,
                                    **_rounding_args(rounding_steps, stochastic_row0))


_implementations(adam_stage2_, _adam_stage2_reference, _adam_stage2_launch)


@adam_stage2_.register_fake
def _(*args, backend="torch", stochastic_row0=-1):
    return None


def _sgd_rows(grads, weights, exp_avgs, old, bc, lr, momentum, dampening, weight_decay, nesterov, maximize):
    moments = 1 if momentum else 0
    for i in range(len(grads)):
        g, w, m, _ = _decode_row(i, grads, weights, exp_avgs, exp_avgs, old, moments, maximize)
        buf = sgd_update(w, g, m, bc[i, 0] == 0, lr=lr, momentum=momentum, dampening=dampening,
                         weight_decay=weight_decay, nesterov=nesterov)
        yield i, w, buf


def _sgd_kernel_args(lr, momentum, dampening, weight_decay, nesterov, maximize):
    scalars = dict(lr=lr, momentum=momentum, omd=1 - dampening, weight_decay=weight_decay)
    flags = dict(MAXIMIZE=bool(maximize), HAS_DECAY=bool(weight_decay), MOMENTUM=bool(momentum),
                 NESTEROV=bool(nesterov), BLOCK_SIZE=_launchers().BLOCK)
    return scalars, flags


@custom_op("fp8lm::sgd_stage1_", mutates_args=("amax", "bad"))
def sgd_stage1_(grads: list[Tensor], weights: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                params: list[Tensor], weight_scales: list[Tensor], exp_avg_scales: list[Tensor],
                exp_avg_sq_scales: list[Tensor], param_scales: list[Tensor], steps: list[Tensor], kinds: list[int],
                old: Tensor, bc: Tensor, amax: Tensor, bad: Tensor, lr: float, momentum: float, dampening: float,
                weight_decay: float, nesterov: bool, maximize: bool, tables: list[Tensor], *,
                backend: str = "torch") -> None:
    """SGD's first pass over a param group: ``amax[i]`` the amaxes of the new momentum buffer (``exp_avgs``, with
    ``momentum``) and master value (columns 0 and 2); ``bad`` set to 1 where a gradient is not finite. The first
    step's test reads the step counts :func:`prepare_states_` wrote into ``bc``."""
    _check_backend(backend)
    return _sgd_stage1_reference(grads, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                                 exp_avg_sq_scales, param_scales, steps, kinds, old, bc, amax, bad, lr, momentum,
                                 dampening, weight_decay, nesterov, maximize, tables)


def _sgd_stage1_reference(grads, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                          exp_avg_sq_scales, param_scales, steps, kinds, old, bc, amax, bad, lr, momentum, dampening,
                          weight_decay, nesterov, maximize, tables=None):
    for i, w, buf in _sgd_rows(grads, weights, exp_avgs, old, bc, lr, momentum, dampening, weight_decay, nesterov,
                               maximize):
        _record_amaxes(i, amax, bad, grads[i], old, buf, None, w)


def _sgd_stage1_launch(grads, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                       exp_avg_sq_scales, param_scales, steps, kinds, old, bc, amax, bad, lr, momentum, dampening,
                       weight_decay, nesterov, maximize, tables=None):
    triton = _launchers()
    table, _, blocks, n_blocks = _state_tables(tables, weights, exp_avgs, exp_avg_sqs, params, weight_scales,
                                               exp_avg_scales, exp_avg_sq_scales, param_scales, steps, kinds,
                                               1 if momentum else 0)
    scalars, flags = _sgd_kernel_args(lr, momentum, dampening, weight_decay, nesterov, maximize)
    triton.launch_state_stage(triton.sgd_stage1_kernel, blocks, n_blocks, table, [g.contiguous() for g in grads], old,
                              bc, amax, bad, **scalars, **flags)


_implementations(sgd_stage1_, _sgd_stage1_reference, _sgd_stage1_launch)


@sgd_stage1_.register_fake
def _(*args, backend="torch"):
    return None


@custom_op("fp8lm::sgd_stage2_", mutates_args=STATE_LISTS)
def sgd_stage2_(grads: list[Tensor], weights: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
                params: list[Tensor], weight_scales: list[Tensor], exp_avg_scales: list[Tensor],
                exp_avg_sq_scales: list[Tensor], param_scales: list[Tensor], steps: list[Tensor], kinds: list[int],
                old: Tensor, bc: Tensor, new: Tensor, bad: Tensor, lr: float, momentum: float, dampening: float,
                weight_decay: float, nesterov: bool, maximize: bool, tables: list[Tensor],
                rounding_steps: Tensor | None = None, *, backend: str = "torch", stochastic_row0: int = -1) -> None:
    """SGD's second pass over a param group: momentum buffer, master and parameter written with the new scales
    ``new``, then the scales and the step count + 1; nothing where ``bad`` is set. ``stochastic_row0`` and
    ``rounding_steps``: as :func:`adam_stage2_`'s, for the momentum buffer."""
    _check_backend(backend)
    return _sgd_stage2_reference(grads, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                                 exp_avg_sq_scales, param_scales, steps, kinds, old, bc, new, bad, lr, momentum,
                                 dampening, weight_decay, nesterov, maximize, tables, rounding_steps, stochastic_row0)


def _sgd_stage2_reference(grads, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                          exp_avg_sq_scales, param_scales, steps, kinds, old, bc, new, bad, lr, momentum, dampening,
                          weight_decay, nesterov, maximize, tables=None, rounding_steps=None, stochastic_row0=-1):
    ok = bad.reshape(()) == 0
    for i, w, buf in _sgd_rows(grads, weights, exp_avgs, old, bc, lr, momentum, dampening, weight_decay, nesterov,
                               maximize):
        _write_row(i, kinds[i], ok, new, w, buf, None, weights, exp_avgs, exp_avg_sqs, params, weight_scales,
                   exp_avg_scales, exp_avg_sq_scales, param_scales, steps, stochastic_row0, rounding_steps)


def _sgd_stage2_launch(grads, weights, exp_avgs, exp_avg_sqs, params, weight_scales, exp_avg_scales,
                       exp_avg_sq_scales, param_scales, steps, kinds, old, bc, new, bad, lr, momentum, dampening,
                       weight_decay, nesterov, maximize, tables=None, rounding_steps=None, stochastic_row0=-1):
    triton = _launchers()
    table, fmax, blocks, n_blocks = _state_tables(tables, weights, exp_avgs, exp_avg_sqs, params, weight_scales,
                                                  exp_avg_scales, exp_avg_sq_scales, param_scales, steps, kinds,
                                                  1 if momentum else 0)
    scalars, flags = _sgd_kernel_args(lr, momentum, dampening, weight_decay, nesterov, maximize)
    triton.launch_state_stage(triton.sgd_stage2_kernel, blocks, n_blocks, table, [g.contiguous() for g in grads], old,
                              bc, fmax, new, bad, **scalars, **flags, **_rounding_args(rounding_steps, stochastic_row0))


_implementations(sgd_stage2_, _sgd_stage2_reference, _sgd_stage2_launch)


@sgd_stage2_.register_fake
def _(*args, backend="torch", stochastic_row0=-1):
    return None
