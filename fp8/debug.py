"""Find the first bad FP8 layer: one batch through the FP8 model beside a high-precision shadow of the same weights.

:func:`find_first_bad_layer` runs one forward and backward of the model (``run(model)`` returns the loss) with hooks on
every FP8 linear (:class:`fp8.Float8Linear`) that keep its input ``x``, output ``y``, output gradient ``dY`` and input
gradient ``dX``, and FP8 statistics (:class:`fp8.stats.FP8Statistics`) on its casts. The shadow of each linear is the
same computation in float64 on the same operands: ``x @ W^T (+ b)`` and ``dY @ W``, ``W`` the layer's weight values
(its FP8 weight dequantized: the shadow has the same weights, only the GEMMs' input casts differ). Each layer's errors
are local (its own inputs), so a bad layer is not hidden behind the error it sends downstream:

- ``forward_error``: ``||y - y_shadow|| / ||y_shadow||`` (relative Frobenius);
- ``input_grad_error``: ``||dX - dX_shadow|| / ||dX_shadow||``;
- ``saturated`` / ``flush_to_zero``: the fractions of the layer's input and output-gradient values the FP8 casts clamp
  to the format's largest value or round to zero (tensorwise casts: the per-row and per-tile recipes scale each
  block from its own amax and are not observed, NaN).

The report ranks the layers by their larger error, and names the first layer in forward order whose error passes
``threshold``: the default, 0.35, is 2.4x the largest error measured on healthy models (0.147: the input gradient of a
64-wide projection from E5M2 output gradients, whose 2 mantissa bits round each value by up to 2^-3; tensorwise,
rowwise and blockwise recipes, 5 seeds, ``tests/fp8/test_debug.py``), and a layer whose input saturates measures
0.84 to 0.92. The model's scaling
state (amax histories, scales), its statistics hooks and its parameters' gradients are as they were after the call.
``tools/fp8_debug.py`` runs it on a ``pretrain_gpt.py`` checkpoint (any layout) or an FP8 serving export.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from .linear import Float8Linear
from .scaling import ScalingState
from .stats import FP8Statistics

__all__ = ["DEFAULT_THRESHOLD", "LayerError", "DebugReport", "find_first_bad_layer"]

DEFAULT_THRESHOLD = 0.35
"""Relative error from which a layer counts as bad (module docstring)."""


@dataclass(frozen=True)
class LayerError:
    """One FP8 linear's errors against its high-precision shadow (module docstring); ``order``: its place in the
    forward (0 first)."""

    name: str
    order: int
    forward_error: float
    input_grad_error: float
    input_saturated: float = math.nan
    input_flush_to_zero: float = math.nan
    grad_saturated: float = math.nan
    grad_flush_to_zero: float = math.nan

    @property
    def error(self) -> float:
        """The larger of the two errors (NaN ones ignored)."""
        values = [e for e in (self.forward_error, self.input_grad_error) if not math.isnan(e)]
        return max(values) if values else math.nan


@dataclass
class DebugReport:
    """``layers`` ranked worst first (:attr:`LayerError.error`), the ``threshold``, and ``first_bad``: the first layer in
    forward order whose error passes it (None: none does)."""

    layers: list[LayerError] = field(default_factory=list)
    threshold: float = DEFAULT_THRESHOLD
    first_bad: str | None = None

    def table(self, limit: int | None = None) -> str:
        """The ranking as a markdown table (``limit`` rows)."""
        rows = ["| rank | layer | forward order | forward error | input-grad error | input saturated | input flushed "
                "| grad saturated | grad flushed |", "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for rank, e in enumerate(self.layers[:limit], 1):
            mark = " (first bad)" if e.name == self.first_bad else ""
            rows.append(f"| {rank} | {e.name}{mark} | {e.order} | {e.forward_error:.3g} | {e.input_grad_error:.3g} | "
                        f"{e.input_saturated:.3g} | {e.input_flush_to_zero:.3g} | {e.grad_saturated:.3g} | "
                        f"{e.grad_flush_to_zero:.3g} |")
        return "\n".join(rows)

    def as_dict(self) -> dict:
        return {"threshold": self.threshold, "first_bad": self.first_bad,
                "layers": [{**e.__dict__, "error": e.error} for e in self.layers]}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    denom = float(b.norm())
    return float((a - b).norm()) / denom if denom > 0 else (0.0 if float(a.norm()) == 0 else math.inf)


def find_first_bad_layer(model: nn.Module, run: Callable[[nn.Module], torch.Tensor],
                         threshold: float = DEFAULT_THRESHOLD) -> DebugReport:
    """Run ``run(model)`` (one batch: it returns the scalar loss; its backward runs here) and rank ``model``'s FP8
    linears against their high-precision shadow (module docstring). ``model``: an :func:`fp8.initialize` model (any
    level; its optimizer is not needed). Returns a :class:`DebugReport`; the model's scaling state, statistics hooks and
    gradients are left as they were."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    if not linears:
        raise ValueError("the model holds no FP8 linear (fp8.Float8Linear): call fp8.initialize(model, None, 'O1') "
                         "first (the debugger compares FP8 layers with their high-precision shadow)")
    if not threshold > 0:
        raise ValueError(f"threshold must be positive, got {threshold}")
    states = [m for m in model.modules() if isinstance(m, ScalingState)]
    saved_states = [{k: v.clone() for k, v in s.state_dict().items()} for s in states]
    saved_hooks = [s.stats for s in states]
    saved_grads = {p: p.grad for p in model.parameters()}
    captured: dict[str, dict[str, torch.Tensor]] = {name: {} for name in linears}
    order: list[str] = []

    def pre(name):
        def hook(module, args):
            captured[name]["x"] = args[0].detach()
            if name not in order:
                order.append(name)
        return hook

    def post(name):
        def hook(module, args, output):
            captured[name]["y"] = output.detach()
        return hook

    def backward(name):
        def hook(module, grad_input, grad_output):
            captured[name]["dY"] = grad_output[0].detach()
            if grad_input[0] is not None:
                captured[name]["dX"] = grad_input[0].detach()
        return hook

    handles = []
    stats = FP8Statistics(model, 1)
    try:
        for name, m in linears.items():
            handles += [m.register_forward_pre_hook(pre(name)), m.register_forward_hook(post(name)),
                        m.register_full_backward_hook(backward(name))]
        for p in model.parameters():
            p.grad = None
        stats.begin_step(1)
        with torch.enable_grad():
            loss = run(model)
            loss.backward()
        observed = stats.read()
    finally:
        for h in handles:
            h.remove()
        for s, values, hook in zip(states, saved_states, saved_hooks):
            s.load_state_dict(values)
            s.stats = hook
        for p, g in saved_grads.items():
            p.grad = g
    report = DebugReport(threshold=threshold)
    for name in order:
        module, got = linears[name], captured[name]
        with torch.no_grad():
            w = module.weight.dequantize(torch.float64)
            x = got["x"].reshape(-1, w.shape[1]).double()
            y_ref = x @ w.t()
            if module.bias is not None:
                y_ref = y_ref + module.bias.detach().double()
            forward = _rel(got["y"].reshape(-1, w.shape[0]).double(), y_ref)
            grad = math.nan
            if "dY" in got and "dX" in got:
                grad = _rel(got["dX"].reshape(-1, w.shape[1]).double(), got["dY"].reshape(-1, w.shape[0]).double() @ w)
        sites = observed.get(name, {})
        report.layers.append(LayerError(
            name, order.index(name), forward, grad,
            sites.get("input", {}).get("saturated", math.nan), sites.get("input", {}).get("flush_to_zero", math.nan),
            sites.get("grad_output", {}).get("saturated", math.nan),
            sites.get("grad_output", {}).get("flush_to_zero", math.nan)))
    report.first_bad = next((e.name for e in report.layers if e.error > threshold), None)
    report.layers.sort(key=lambda e: -e.error if not math.isnan(e.error) else math.inf)
    return report
