"""The delayed-scaling training step needs no device-to-host synchronisation, and the FP8 linear and
optimizer compile without graph breaks.

On CPU there is no CUDA sync to observe, so the step is run under modes that flag every operation that
would sync on a GPU: at the dispatcher, ``aten._local_scalar_dense`` (``.item()``, ``bool()``, ``int()``,
``float()``, ``if tensor:``) and ops with data-dependent output shapes (``nonzero``, ``masked_select``,
``unique``) or host results (``equal``); at the Python level, the tensor methods that hand values to the
host (``item``, ``tolist``, ``numpy``, ``cpu``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``).
A self-check proves the detector catches each of them. ``torch.compile(fullgraph=True)`` refuses any
graph break, which any such sync inside the compiled functions would cause.
"""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import fp8

aten = torch.ops.aten
SYNC_OPS = {
    aten._local_scalar_dense.default, aten.equal.default, aten.nonzero.default, aten.masked_select.default,
    aten.is_nonzero.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
}
HOST_METHODS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}


class _DispatchSyncs(TorchDispatchMode):
    def __init__(self, hits: list) -> None:
        super().__init__()
        self.hits = hits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC_OPS:
            self.hits.append(f"{func}\n{''.join(traceback.format_stack(limit=10)[:-1])}")
        return func(*args, **(kwargs or {}))


class _FunctionSyncs(TorchFunctionMode):
    def __init__(self, hits: list) -> None:
        super().__init__()
        self.hits = hits

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in HOST_METHODS:
            self.hits.append(f"Tensor.{func.__name__}\n{''.join(traceback.format_stack(limit=10)[:-1])}")
        return func(*args, **(kwargs or {}))


class HostSyncDetector:
    """Context manager recording every host-sync candidate in ``hits`` (with its stack)."""

    def __enter__(self):
        self.hits: list[str] = []
        self._modes = [_DispatchSyncs(self.hits), _FunctionSyncs(self.hits)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def test_detector_catches_every_kind_of_sync():
    t = torch.tensor([1.0, 2.0])
    probes = [lambda: bool(t[0]), lambda: t.sum().item(), lambda: t.tolist(), lambda: float(t[0]), lambda: int(t[1]),
              lambda: t.nonzero(), lambda: t.masked_select(t > 1), lambda: torch.equal(t, t), lambda: t.cpu(),
              lambda: None if t.sum() > 0 else None, lambda: t.unique()]
    for probe in probes:
        with HostSyncDetector() as detector:
            probe()
        assert detector.hits, "the detector missed a sync"


def _model_and_optimizer(opt_level="O2"):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 32))
    return fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), opt_level)


def test_o2_delayed_scaling_steps_do_not_sync(gen):
    """Forward, backward, clipping, optimizer step (masters, moments, FP8 weight refresh, scale update),
    zero_grad: five steps, the fourth with a NaN gradient (skipped on device), without a single sync."""
    model, optimizer = _model_and_optimizer()
    assert model[0].input_scaling.config.kind == "delayed" and model[0].grad_output_scaling.config.kind == "delayed"
    data = [(torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)) for _ in range(6)]

    def step(x, y, poison=False):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        if poison:
            model[2].weight.grad[0] = float("nan")
        fp8.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    step(*data[0])  # first step (current-scaling fallback) outside, so the mode sees steady state and one first
    history_before = model[0].input_scaling.amax_history.clone()
    with HostSyncDetector() as detector:
        losses = [step(x, y, poison=(i == 3)) for i, (x, y) in enumerate(data[1:])]
    assert not detector.hits, "host syncs in the training step:\n" + "\n".join(detector.hits[:3])
    assert optimizer.skipped_steps == 1 and int(optimizer.skipped_steps_counter) == 1  # read after: a sync is fine here
    assert all(torch.isfinite(loss) for loss in losses)
    assert not torch.equal(model[0].input_scaling.amax_history, history_before)  # the histories moved on device


def test_first_step_does_not_sync_either(gen):
    model, optimizer = _model_and_optimizer()
    with HostSyncDetector() as detector:
        model(torch.randn(16, 32, generator=gen)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not detector.hits, "\n".join(detector.hits[:3])


def test_linear_and_optimizer_compile_without_graph_breaks(gen):
    """fullgraph=True raises on any graph break: the FP8 linear's forward and backward and the O2
    optimizer step (masters, compressed moments, FP8 weight refresh, delayed-scale update) each compile
    into one graph, and the compiled training matches eager training."""
    torch._dynamo.reset()
    eager, eager_opt = _model_and_optimizer()
    torch.manual_seed(0)
    model, optimizer = _model_and_optimizer()
    model.load_state_dict(eager.state_dict())
    optimizer.load_state_dict(eager_opt.state_dict())
    compiled_model = torch.compile(model, fullgraph=True)
    compiled_step = torch.compile(optimizer.step, fullgraph=True)
    for _ in range(3):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)
        for m, opt_step, opt in ((eager, eager_opt.step, eager_opt), (compiled_model, compiled_step, optimizer)):
            (m(x) - y).pow(2).mean().backward()
            opt_step()
            opt.zero_grad()
    for (name, a), b in zip(eager.state_dict().items(), model.state_dict().values()):
        a = a.dequantize() if isinstance(a, fp8.Float8Tensor) else a
        b = b.dequantize() if isinstance(b, fp8.Float8Tensor) else b
        # Inductor may fuse fp32 math differently: one rounding step of E4M3 at most on the weights.
        assert torch.allclose(a.float(), b.float(), rtol=2**-3, atol=1e-6), name
