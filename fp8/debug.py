"""Find the first bad FP8 layer: one batch through the FP8 model beside a high-precision shadow of the same weights.

:func:`find_first_bad_layer` runs one forward and backward of the model (``run(model)`` returns the loss) with hooks on
every FP8 linear (:class:`fp8.Float8Linear`) that keep its input ``x``, output ``y``, output gradient ``dY`` and input
gradient ``dX``, and FP8 statistics (:class:`fp8.stats.FP8Statistics`) on its casts. The shadow of each linear is the
same computation in float64 on the same operands: ``x @ W^T (+ b)`` and ``dY @ W``, ``W`` the layer's weight values
(its FP8 weight dequantized: the shadow has the same weights, only the GEMMs' input casts differ). Each layer's errors
are local (its own inputs), so a bad layer is not hidden behind the error it sends downstream:

- ``forward_error``: ``||y - y_shadow|| / ||y_shadow||`` (relative Frobenius);
- ``input_grad_error``: ``||dX - dX_shadow|| / ||dX_shadow||``;
- non-finite values: an error is inf when the layer's inputs are finite and its FP8 result is not (its weight or its
  casts made the inf/NaN: ranked first), NaN when its inputs already were not (the fault is upstream: ranked last);
- ``saturated`` / ``flush_to_zero``: the fractions of the layer's input and output-gradient values the FP8 casts clamp
  to the format's largest value or round to zero (tensorwise casts: the per-row and per-tile recipes scale each
  block from its own amax and are not observed, NaN).

The report ranks the layers by their larger error, and names the first layer in forward order whose error passes
``threshold``: the default, 0.35, is 2.4x the largest error measured on healthy models (0.147: the input gradient of a
64-wide projection from E5M2 output gradients, whose 2 mantissa bits round each value by up to 2^-3; tensorwise,
rowwise and blockwise recipes, 5 seeds, ``tests/fp8/test_debug.py``), and a layer whose input saturates measures
0.84 to 0.92. The model's scaling
state (amax histories, scales, written back in place, and their host-side flags), its statistics hooks and its parameters'
gradients are as they were after the call.
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


def _rel(got: torch.Tensor, ref: torch.Tensor, inputs_finite: bool) -> float:
    """``||got - ref|| / ||ref||`` in float64; NaN when the layer's inputs (``x``, or ``dY``) are not finite (the fault
    is upstream: not this layer's), inf when they are but its result or its shadow is not (its own weight or cast made
    the inf/NaN)."""
    if not inputs_finite:
        return math.nan
    if not bool(torch.isfinite(got).all()) or not bool(torch.isfinite(ref).all()):
        return math.inf
    denom = float(ref.norm())
    return float((got - ref).norm()) / denom if denom > 0 else (0.0 if float(got.norm()) == 0 else math.inf)


_STATE_ATTRS = ("history_confirmed", "_history_probe", "_seed_base", "_seed_calls", "stats")


def find_first_bad_layer(model: nn.Module, run: Callable[[nn.Module], torch.Tensor],
                         threshold: float = DEFAULT_THRESHOLD) -> DebugReport:
    """Run ``run(model)`` (one batch: it returns the scalar loss; its backward runs here) and rank ``model``'s FP8
    linears against their high-precision shadow (module docstring). ``model``: an :func:`fp8.initialize` model (any
    level; its optimizer is not needed), not wrapped for data parallelism (the backward here would reduce gradients).
    A linear called several times in the forward reports its worst call. An error is NaN when the layer's own operands
    are not finite (the fault is upstream) and inf when they are but its FP8 result is not. Returns a
    :class:`DebugReport`; the model's scaling state (buffers written back in place, the host-side flags too),
    statistics hooks and gradients are left as they were."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    if not linears:
        raise ValueError("the model holds no FP8 linear (fp8.Float8Linear): call fp8.initialize(model, None, 'O1') "
                         "first (the debugger compares FP8 layers with their high-precision shadow)")
    if not threshold > 0:
        raise ValueError(f"threshold must be positive, got {threshold}")
    states = [m for m in model.modules() if isinstance(m, ScalingState)]
    saved_buffers = [[(b, b.detach().clone()) for b in s.buffers()] for s in states]
    saved_attrs = [{a: getattr(s, a) for a in _STATE_ATTRS if hasattr(s, a)} for s in states]
    saved_grads = {p: p.grad for p in model.parameters()}
    forward_errors: dict[str, list[float]] = {name: [] for name in linears}
    grad_errors: dict[str, list[float]] = {name: [] for name in linears}
    order: list[str] = []

    def weight_of(module) -> torch.Tensor:
        return module.weight.dequantize(torch.float64)

    def post(name):
        # Each call measured at once (an output modified in place later changes nothing); the backward node of this
        # call hooked directly (no wrapping of the layer's tensors: in-place users and shared input casts unchanged).
        def hook(module, args, output):
            if name not in order:
                order.append(name)
            with torch.no_grad():
                w = weight_of(module)
                x = args[0].detach().reshape(-1, w.shape[1]).double()
                ref = x @ w.t()
                if module.bias is not None:
                    ref = ref + module.bias.detach().double()
                forward_errors[name].append(_rel(output.detach().reshape(-1, w.shape[0]).double(), ref,
                                                 bool(torch.isfinite(x).all())))
            node = output.grad_fn
            if node is not None:
                def on_backward(grad_inputs, grad_outputs):
                    if grad_inputs[0] is None or grad_outputs[0] is None:
                        return
                    with torch.no_grad():  # the weight again (not held from the forward: 8 bytes per element)
                        wb = weight_of(module)
                        dy = grad_outputs[0].detach().reshape(-1, wb.shape[0]).double()
                        grad_errors[name].append(_rel(grad_inputs[0].detach().reshape(-1, wb.shape[1]).double(),
                                                      dy @ wb, bool(torch.isfinite(dy).all())))
                node.register_hook(on_backward)
        return hook

    def worst(values: list[float]) -> float:
        if any(v == math.inf for v in values):
            return math.inf
        finite = [v for v in values if not math.isnan(v)]
        return max(finite) if finite else math.nan

    handles = []
    stats = FP8Statistics(model, 1)
    try:
        for name, m in linears.items():
            handles.append(m.register_forward_hook(post(name)))
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
        with torch.no_grad():
            for buffers, attrs, s in zip(saved_buffers, saved_attrs, states):
                for buffer, value in buffers:
                    buffer.copy_(value)
                for attr, value in attrs.items():
                    setattr(s, attr, value)
        for p, g in saved_grads.items():
            p.grad = g
    report = DebugReport(threshold=threshold)
    for name in order:
        sites = observed.get(name, {})
        report.layers.append(LayerError(
            name, order.index(name), worst(forward_errors[name]), worst(grad_errors[name]),
            sites.get("input", {}).get("saturated", math.nan), sites.get("input", {}).get("flush_to_zero", math.nan),
            sites.get("grad_output", {}).get("saturated", math.nan),
            sites.get("grad_output", {}).get("flush_to_zero", math.nan)))
    report.first_bad = next((e.name for e in report.layers if e.error > threshold), None)
    report.layers.sort(key=lambda e: -e.error if not math.isnan(e.error) else math.inf)
    return report
