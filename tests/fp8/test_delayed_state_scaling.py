"""Opt-in delayed state scaling (``OptimizerPrecision(state_scaling="delayed")``): the torch reference
path against float64 torch.optim, the Triton single-pass kernel against the torch reference (under
TRITON_INTERPRET=1), the overflow path (a gradient spike: never clamped), no host sync, exact resume."""

from __future__ import annotations

import io
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import fp8
from fp8.optim import Adam, AdamW, OptimizerPrecision
from tests.fp8.test_optim import CONTRIBUTION, OPTIMIZERS, STEPS

DELAYED_O2 = OptimizerPrecision("e4m3", "fp16", "fp16", state_scaling="delayed")


def _float64_run(name: str, precision: OptimizerPrecision, gen: torch.Generator, steps: int = STEPS,
                 spike_at: int | None = None) -> dict[str, float]:
    """As ``tests/fp8/test_optim.py::test_matches_torch_optim_in_float64``; returns |w - w_ref| / |w_ref - w_0|
    per parameter (FP8 weight, fp32 vector, bf16 vector). ``spike_at``: that step's gradients x 1e4."""
    ours_cls, ref_cls, kwargs = OPTIMIZERS[name]
    w0 = torch.randn(64, 64, generator=gen, dtype=torch.float64) * 0.02
    v0 = torch.randn(1024, generator=gen, dtype=torch.float64)
    b0 = torch.randn(512, generator=gen, dtype=torch.float64).to(torch.bfloat16).to(torch.float64)
    weight = torch.nn.Parameter(fp8.to_float8(w0.float()))
    vector = torch.nn.Parameter(v0.float())
    half = torch.nn.Parameter(b0.to(torch.bfloat16))
    ours = ours_cls([weight, vector, half], precision=precision, initial_masters={weight: w0.float()}, **kwargs)
    refs = [torch.nn.Parameter(t.clone()) for t in (w0, v0, b0)]
    reference = ref_cls(refs, **kwargs)
    for step in range(steps):
        spike = 1e4 if step == spike_at else 1.0
        magnitude = torch.exp(torch.empty(64, 64, dtype=torch.float64).uniform_(-9, 0, generator=gen)) * spike
        g_weight = fp8.to_float8((torch.randn(64, 64, generator=gen, dtype=torch.float64) * magnitude).float())
        g_vector = torch.randn(1024, generator=gen, dtype=torch.float64).float() * spike
        g_half = (torch.randn(512, generator=gen, dtype=torch.float64) * spike).to(torch.bfloat16)
        weight.grad, vector.grad, half.grad = g_weight, g_vector, g_half
        for ref, g in zip(refs, (g_weight.dequantize(torch.float64), g_vector, g_half)):
            ref.grad = g.to(torch.float64)
        ours.step()
        reference.step()
    out = {}
    for label, param, ref, start in (("weight", weight, refs[0], w0), ("vector", vector, refs[1], v0),
                                     ("half", half, refs[2], b0)):
        value = ours.master_value(param).double()
        out[label] = ((value - ref.detach()).norm() / (ref.detach() - start).norm()).item()
    assert torch.equal(weight.payload.view(torch.uint8),
                       fp8.quantize(ours.master_value(weight), weight.scale, "e4m3").view(torch.uint8))
    return out


def _no_state_clamped(opt, params) -> None:
    """Every scaled state's recorded amax fits under its scale: nothing was clamped when it was stored."""
    for p in params:
        state = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq", "master"):
            if f"{key}_amax" in state:
                top = {torch.float8_e4m3fn: 448.0, torch.float16: 65504.0}.get(state[key].dtype)
                if top is not None:
                    assert state[f"{key}_amax"] * state[f"{key}_scale"] <= top, key
        if isinstance(p, fp8.Float8Tensor) and "param_amax" in state:
            assert state["param_amax"] * p.scale <= p.format.max


def test_state_scaling_option_is_validated_and_opt_in():
    assert OptimizerPrecision().state_scaling == "current"
    assert fp8.optim.PRECISION_PRESETS["O2"].state_scaling == "current"
    assert DELAYED_O2 == OptimizerPrecision(state_scaling="delayed")
    with pytest.raises(ValueError, match="state_scaling='late'"):
        OptimizerPrecision(state_scaling="late")
    weight = torch.nn.Parameter(fp8.to_float8(torch.randn(8, 8)))
    assert "master_amax" not in AdamW([weight]).state[weight]  # current: no histories
    state = AdamW([weight], precision=DELAYED_O2).state[weight]
    assert all(state[f"{k}_amax"] == 0 for k in ("exp_avg", "exp_avg_sq", "master", "param"))  # no history yet


# |w - w_ref| / |w_ref - w_0| after 200 steps, O2 (e4m3 / fp16 / fp16), measured worst over 8 seeds with
# both state scalings (see docs/gpu.md); the bound is tests/fp8/test_optim.py's, the sum of the role contributions.
BOUND_WITH_MASTER = CONTRIBUTION[("exp_avg", "e4m3")] + CONTRIBUTION[("exp_avg_sq", "fp16")] + CONTRIBUTION[("master", "fp16")]
BOUND_MOMENTS = CONTRIBUTION[("exp_avg", "e4m3")] + CONTRIBUTION[("exp_avg_sq", "fp16")]


@pytest.mark.parametrize("name,spike_at", [("AdamW", None), ("Adam", None), ("AdamW", 100)])
def test_delayed_state_scaling_matches_torch_optim_in_float64(name, spike_at, gen):
    """The torch path with delayed state scaling against torch.optim in float64, as the O2 tests of
    ``tests/fp8/test_optim.py`` (same bounds): the FP8 weight's master and moments are delayed-scaled, the
    bf16 vector's moments too (its fp32 master is unscaled), the fp32 vector keeps current scaling.
    ``spike_at``: that step's gradients are 1e4 times larger (the overflow path, then recovery)."""
    errors = _float64_run(name, DELAYED_O2, gen, spike_at=spike_at)
    assert errors["weight"] < BOUND_WITH_MASTER, errors
    assert errors["vector"] < BOUND_MOMENTS and errors["half"] < BOUND_MOMENTS, errors


def test_gradient_spike_takes_the_overflow_path_without_clamping(gen):
    """A gradient x 1e4 at step 3 makes the moments outgrow their delayed scales: they are stored with
    their current scales (nothing clamped, checked after every step), and the next steps return to
    delayed scales (one power of two of headroom over the previous amax)."""
    weight = torch.nn.Parameter(fp8.to_float8(torch.randn(32, 32, generator=gen) * 0.02))
    half = torch.nn.Parameter(torch.randn(100, generator=gen).to(torch.bfloat16))
    opt = AdamW([weight, half], lr=1e-3, betas=(0.9, 0.95), precision=DELAYED_O2)
    delayed_steps = 0
    for step in range(8):
        spike = 1e4 if step == 3 else 1.0
        weight.grad = fp8.to_float8(torch.randn(32, 32, generator=gen) * 1e-3 * spike)
        half.grad = (torch.randn(100, generator=gen) * spike).to(torch.bfloat16)
        history = opt.state[weight]["exp_avg_sq_amax"].clone()
        opt.step()
        _no_state_clamped(opt, [weight, half])
        state = opt.state[weight]
        delayed = fp8.scaling.power_of_two_scale(history, 65504.0, margin=1)
        current = fp8.scaling.power_of_two_scale(state["exp_avg_sq_amax"], 65504.0)
        if step == 3:  # v grew ~1e8-fold: current scale, not the (overflowing) delayed one
            assert torch.equal(state["exp_avg_sq_scale"], current) and not torch.equal(current, delayed)
        elif step > 0 and torch.equal(state["exp_avg_sq_scale"], delayed):
            delayed_steps += 1
    assert delayed_steps >= 5  # the common case: the delayed scale fits


def _triton_ready():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("kernel tests run under TRITON_INTERPRET=1")


@pytest.mark.parametrize("opt_cls,kwargs", [
    (AdamW, dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)),
    (Adam, dict(lr=1e-2, weight_decay=0.01, maximize=True)),
], ids=["AdamW", "Adam-L2-maximize"])
def test_single_pass_kernel_matches_the_torch_path(gen, opt_cls, kwargs, monkeypatch):
    """The Triton single pass + fix-up against the torch reference, both with delayed state scaling,
    over six steps: a gradient spike x 1e3 at step 2 (moments outgrow their delayed scales: the fix-up
    recomputes those tensors from their intact inputs), a NaN gradient at step 4 (skipped on device by
    both), steady steps otherwise (no tensor recomputed: one pass). Scales, step counts and skips are
    identical; payloads within the bounds of tests/fp8/test_kernels.py (``close_to_torch_path``: 4 storage
    steps at the tensor's amax, 16 ulps for fp32, at most 10% of elements differing), and the amax
    histories (of the fp32 values, which differ by the kernel's fp32 rounding) within 4 steps of their
    state's storage format (16 ulps for fp32)."""
    _triton_ready()
    import fp8.kernels.triton_adam as ta
    from tests.fp8.test_kernels import adam_setup, close_to_torch_path

    redo_per_step, passes = [], []
    single, fixup = ta.adam_delayed_kernel, ta.adam_delayed_fixup_kernel

    class _Spy:
        def __init__(self, kernel, record):
            self.kernel, self.record = kernel, record

        def __getitem__(self, grid):
            def launch(*args, **kw):
                self.record(args)
                return self.kernel[grid](*args, **kw)
            return launch

    monkeypatch.setattr(ta, "adam_delayed_kernel", _Spy(single, lambda a: passes.append(1)))
    monkeypatch.setattr(ta, "adam_delayed_fixup_kernel", _Spy(fixup, lambda a: redo_per_step.append(a[7].clone())))
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    runs = {}
    for backend in ("torch", "triton"):
        params, opt = adam_setup(seed, opt_cls, precision=DELAYED_O2, kernel_backend=backend, **kwargs)
        g = torch.Generator().manual_seed(seed + 1)
        for step in range(6):
            spike = 1e3 if step == 2 else 1.0
            params[0].grad = fp8.to_float8(torch.randn(40, 52, generator=g) * 1e-3 * spike)
            params[1].grad = torch.randn(1100, generator=g)
            params[2].grad = (torch.randn(300, generator=g) * spike).to(torch.bfloat16)
            if step == 4:
                params[1].grad[17] = float("nan")
            opt.step()
            _no_state_clamped(opt, params)
        runs[backend] = (params, opt)
    # Rows: FP8 weight, bf16 vector (the fp32 vector has no master: current scaling, two-stage kernels).
    assert len(passes) == 6 and len(redo_per_step) == 6
    assert redo_per_step[0].tolist() == [1, 1]  # first step: no history, current scaling
    assert redo_per_step[2].tolist() == [1, 1]  # the spike
    assert redo_per_step[5].sum() == 0  # steady state after the spike: one pass
    (p_ref, o_ref), (p_tri, o_tri) = runs["torch"], runs["triton"]
    assert o_ref.skipped_steps == o_tri.skipped_steps == 1
    for a, b in zip(p_ref, p_tri):
        s_ref, s_tri = o_ref.state[a], o_tri.state[b]
        assert s_ref.keys() == s_tri.keys()
        for key, value in s_ref.items():
            if key.endswith("_amax"):  # of the fp32 values: within 4 storage steps, as the payloads
                stored = s_ref.get(key[:-5], a.payload if key == "param_amax" else None)
                step = {torch.float8_e4m3fn: 2**-3, torch.float16: 2**-10, torch.float32: 4 * 2**-23}[stored.dtype]
                assert torch.allclose(value, s_tri[key], rtol=4 * step, atol=0), key
            elif value.dim() == 0:  # step, scales
                assert torch.equal(value, s_tri[key]), key
        for key in ("exp_avg", "exp_avg_sq", "master"):
            if key in s_ref:
                close_to_torch_path(s_ref[key], s_tri[key], s_ref[f"{key}_scale"], s_tri[f"{key}_scale"])
        if isinstance(a, fp8.Float8Tensor):
            close_to_torch_path(a.payload, b.payload, a.scale, b.scale)
        else:
            close_to_torch_path(a.detach(), b.detach(), torch.ones(()), torch.ones(()))


def test_state_dict_round_trip_keeps_the_amax_histories(gen):
    """Save after three delayed steps, load into a fresh optimizer: histories and scales restored bit for
    bit, and three more steps give the same bits as the uninterrupted run."""
    def make():
        torch.manual_seed(0)
        w = torch.nn.Parameter(fp8.to_float8(torch.randn(24, 24) * 0.02))
        h = torch.nn.Parameter(torch.randn(50).to(torch.bfloat16))
        return [w, h], AdamW([w, h], lr=1e-3, precision=DELAYED_O2)

    grads = [(torch.randn(24, 24, generator=gen) * 1e-3, torch.randn(50, generator=gen)) for _ in range(6)]

    def train(params, opt, steps):
        for gw, gh in steps:
            params[0].grad, params[1].grad = fp8.to_float8(gw), gh.to(torch.bfloat16)
            opt.step()

    params, opt = make()
    train(params, opt, grads[:3])
    buffer = io.BytesIO()
    torch.save({"opt": opt.state_dict(), "w": params[0].dequantize(), "h": params[1].detach()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    params2, opt2 = make()
    opt2.load_state_dict(saved["opt"])
    params2[1].data.copy_(saved["h"])
    for a, b in zip(params, params2):
        for key, value in opt.state[a].items():
            assert torch.equal(value.view(torch.uint8) if value.element_size() == 1 else value,
                               opt2.state[b][key].view(torch.uint8) if value.element_size() == 1 else opt2.state[b][key]), key
    assert set(opt2.state[params2[0]]) >= {"exp_avg_amax", "exp_avg_sq_amax", "master_amax", "param_amax"}
    assert opt2.state[params2[0]]["master_amax"] > 0
    train(params, opt, grads[3:])
    train(params2, opt2, grads[3:])
    assert torch.equal(params[0].payload.view(torch.uint8), params2[0].payload.view(torch.uint8))
    assert torch.equal(params[0].scale, params2[0].scale) and torch.equal(params[1].detach(), params2[1].detach())


def test_delayed_state_scaling_step_does_not_sync(gen, monkeypatch):
    """The delayed-mode O2 training step (torch path, the CPU path) under the host-sync detector of
    tests/training/test_no_host_sync.py, a NaN step included; and the fused path's host-side glue (scales,
    overflow decisions, tables, buffer swap) with the kernels stubbed out."""
    from tests.training.test_no_host_sync import HostSyncDetector

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2")
    optimizer.precision = DELAYED_O2
    params = [p for p in model.parameters()]
    optimizer.state.clear()
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer._init_state(p, group)
    data = [(torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)) for _ in range(5)]

    def step(x, y, poison=False):
        (model(x) - y).pow(2).mean().backward()
        if poison:
            model[2].bias.grad[0] = float("nan")
        optimizer.step()
        optimizer.zero_grad()

    step(*data[0])
    with HostSyncDetector() as detector:
        for i, (x, y) in enumerate(data[1:]):
            step(x, y, poison=(i == 2))
    assert not detector.hits, "\n".join(detector.hits[:3])
    assert optimizer.skipped_steps == 1
    assert any("master_amax" in optimizer.state[p] for p in params)
    pytest.importorskip("triton")
    import fp8.kernels.triton_adam as ta

    class _Stub:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(grid)

    launched = []
    for name in ("adam_stage1_kernel", "adam_stage2_kernel", "adam_delayed_kernel", "adam_delayed_fixup_kernel"):
        monkeypatch.setattr(ta, name, _Stub())
    optimizer.kernel_backend = "triton"
    (model(data[0][0]) - data[0][1]).pow(2).mean().backward()
    with HostSyncDetector() as detector:
        optimizer.step()
    assert not detector.hits, "\n".join(detector.hits[:3])
    assert len(launched) == 4  # one group: single pass + fix-up (FP8 weights), stages 1 + 2 (fp32 biases)
