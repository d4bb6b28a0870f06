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

import sys
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import fp8
import fp8.host_read
from tests.spawn import CachedLaunch

aten = torch.ops.aten
SYNC_OPS = {
    aten._local_scalar_dense.default, aten.equal.default, aten.nonzero.default, aten.masked_select.default,
    aten.is_nonzero.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
}
HOST_METHODS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}
# Host reads that never stall a device, by design: fp8.host_read.HostCopy.result reads a copy posted one
# update earlier, after waiting for it (it has landed: the wait is free, and every rank reads at the same step,
# never when its own copy happens to land). On CPU there is no event to tell the two apart, so the one method
# doing it is named here.
NON_SYNCING_READS = {fp8.host_read.HostCopy.result.__code__}


def _in_non_syncing_read() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in NON_SYNCING_READS:
            return True
        frame = frame.f_back
    return False


class _DispatchSyncs(TorchDispatchMode):
    def __init__(self, hits: list) -> None:
        super().__init__()
        self.hits = hits

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNC_OPS and not _in_non_syncing_read():
            self.hits.append(f"{func}\n{''.join(traceback.format_stack(limit=10)[:-1])}")
        return func(*args, **(kwargs or {}))


class _FunctionSyncs(TorchFunctionMode):
    def __init__(self, hits: list) -> None:
        super().__init__()
        self.hits = hits

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in HOST_METHODS and not _in_non_syncing_read():
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


def test_detector_exempts_only_the_history_probe_read():
    """The probe's host read is the one exemption; the same read of the same tensor elsewhere is flagged."""
    state = fp8.scaling.ScalingState(fp8.scaling.ScalingConfig(kind="delayed"))
    probe = fp8.scaling._HistoryProbe([state])
    with HostSyncDetector() as detector:
        assert probe.started() == [False]
    assert not detector.hits
    with HostSyncDetector() as detector:
        probe.copy.host.tolist()
    assert detector.hits


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


def _o1_run(make_optimizer, data, skip_index=None, detect_from=1):
    """O1 training over ``data`` (the step ``skip_index`` with a NaN gradient), steps from ``detect_from``
    on under the detector; returns (model, optimizer, detector hits)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 32))
    model, optimizer = fp8.initialize(model, make_optimizer(model.parameters()), "O1")
    hits = []
    for i, (x, y) in enumerate(data):
        detector = HostSyncDetector() if i >= detect_from else None
        if detector is not None:
            detector.__enter__()
        try:
            (model(x) - y).pow(2).mean().backward()
            if i == skip_index:
                model[2].weight.grad[0] = float("nan")
            fp8.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        finally:
            if detector is not None:
                detector.__exit__(None, None, None)
                hits += detector.hits
    return model, optimizer, hits


def _same_training_state(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        x = x.payload.view(torch.uint8) if isinstance(x, fp8.Float8Tensor) else x
        y = y.payload.view(torch.uint8) if isinstance(y, fp8.Float8Tensor) else y
        assert torch.equal(x, y), name


@pytest.mark.parametrize("kind", ["fused-AdamW", "SGD-momentum"])
def test_o1_steps_do_not_sync_and_skip_on_device(gen, kind):
    """O1 (torch.optim on high-precision masters): a fused torch optimizer skips through its ``found_inf``
    input (first step included); another optimizer whose states live on the parameters' device is stepped
    and masked back. Five steps, one with a NaN gradient, under the detector: no sync; the skipped step
    counts once and leaves exactly the state of a run that never took that step (bit for bit)."""
    make = {"fused-AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True),
            "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1)}[kind]
    data = [(torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)) for _ in range(6)]
    # torch creates SGD's momentum lazily on the first step: that step is decided on the host (documented).
    detect_from = 0 if kind == "fused-AdamW" else 1
    model, optimizer, hits = _o1_run(make, data, skip_index=3, detect_from=detect_from)
    assert not hits, "host syncs in the O1 step:\n" + "\n".join(hits[:3])
    assert optimizer.skipped_steps == 1 and int(optimizer.skipped_steps_counter) == 1
    reference, ref_optimizer, _ = _o1_run(make, data[:3] + data[4:], detect_from=len(data))
    _same_training_state(model, reference)
    for a, b in zip(optimizer.master_weights, ref_optimizer.master_weights):
        assert torch.equal(a, b)
    assert optimizer.state_dict()["skipped_steps"] == 1


def _o3_worker(rank: int, world: int, port: int, seed: int, out_dir: str) -> None:
    """O3 + the FP8 DDP wrapper on 2 gloo ranks: a first step, then five steps under the detector, the
    third with a NaN gradient on rank 1 only (both ranks must skip it)."""
    import os

    import torch.distributed as dist

    import fp8.distributed as fd

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                    torch.nn.Linear(64, 32))
        model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), "O3")
        fp8.set_amax_reduction_group(model, dist.group.WORLD)
        ddp = fd.DistributedDataParallel(model, o3_optimizer=optimizer)
        gen = torch.Generator().manual_seed(seed * 10 + rank)
        data = [(torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)) for _ in range(6)]
        poison = next(p for p in optimizer.owned_params if not isinstance(p, fp8.Float8Tensor))

        def wire():
            return [(p.payload.view(torch.uint8) if isinstance(p, fp8.Float8Tensor) else p.detach()).clone()
                    for p in model.parameters()]

        def step(x, y, nan=False):
            (ddp(x) - y).pow(2).mean().backward()
            if nan and rank == 1:
                poison.grad.view(-1)[0] = float("nan")
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()

        step(*data[0])
        mu_steps_before = ddp.grad_scaling.steps.clone()
        snapshots = []
        with HostSyncDetector() as detector:
            for i, (x, y) in enumerate(data[1:]):
                step(x, y, nan=(i == 2))
                snapshots.append(wire())
        out = {"hits": detector.hits[:3], "skipped": optimizer.skipped_steps, "snapshots": snapshots,
               "mu_steps": int(ddp.grad_scaling.steps - mu_steps_before),
               "mu_buffers_are_tensors": all(isinstance(b, torch.Tensor) for b in ddp.grad_scaling.buffers())}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


_o3_launch = CachedLaunch(_o3_worker, "no_host_sync_o3")


def test_o3_steps_do_not_sync_and_skip_on_every_rank(seed, tmp_path_factory):
    """O3 on 2 gloo ranks with the FP8 DDP wrapper (FP8 reduce-to-owner, mu updated on device, amaxes
    agreed across ranks), clipping, the sharded step and the weight all-gather: no sync in five steps.
    A NaN gradient on one rank only skips the step on both (cross-rank agreement on device): the
    parameters stay bit for bit what they were, the ranks stay identical, both count one skip."""
    _, results = _o3_launch(2, seed, tmp_path_factory)
    for rank, out in enumerate(results):
        assert not out["hits"], f"rank {rank}: host syncs in the O3 step:\n" + "\n".join(out["hits"])
        assert out["skipped"] == 1
        assert out["mu_steps"] == 5 and out["mu_buffers_are_tensors"]  # mu's rule closed every step on device
        snaps = out["snapshots"]
        assert all(torch.equal(a, b) for a, b in zip(snaps[1], snaps[2]))  # the skipped step changed nothing
        assert not all(torch.equal(a, b) for a, b in zip(snaps[2], snaps[3]))  # the next one trains again
    for a, b in zip(results[0]["snapshots"], results[1]["snapshots"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
