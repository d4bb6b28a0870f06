"""Stochastic rounding of the optimizers' first moment (``OptimizerPrecision(exp_avg_rounding="stochastic")``): the
grid rounding's exact expectation, the counter-based bits, the Triton helpers against the torch reference bit for bit,
the per-parameter path against the multi-tensor step, the E4M3 dead band it removes, and resume."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (lazily, by the kernels)

import pytest
import torch

import fp8
from fp8.optim import OptimizerPrecision
from fp8.optim.precision import STOCHASTIC_BITS, STOCHASTIC_GRIDS, rounding_bits, stochastic_grid

SR = OptimizerPrecision(exp_avg_rounding="stochastic")
FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.float16: 65504.0}


def _needs_triton():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernel tests run under TRITON_INTERPRET=1")


def _values(gen, dtype) -> torch.Tensor:
    """Values over the format's whole range: every binade from below the smallest subnormal to the largest finite
    value, signed, exact grid points, zero and +-fmax."""
    mantissa, emin = STOCHASTIC_GRIDS[dtype]
    fmax = FMAX[dtype]
    exponents = torch.empty(4000).uniform_(emin - mantissa - 2, float(torch.log2(torch.tensor(fmax))), generator=gen)
    y = torch.exp2(exponents) * torch.where(torch.rand(4000, generator=gen) < 0.5, -1.0, 1.0)
    on_grid = (torch.randn(200, generator=gen) * 4).to(dtype).float()
    return torch.cat([y.clamp(-fmax, fmax), on_grid, torch.tensor([0.0, -0.0, fmax, -fmax])])


@pytest.mark.parametrize("dtype", list(STOCHASTIC_GRIDS), ids=["e4m3", "e5m2", "fp16"])
def test_each_value_rounds_to_a_neighbour_with_the_exact_expectation(gen, dtype):
    """With all bits 0 a value rounds up, with all bits 1 down (unless within 2**-20 of a spacing of the upper one);
    in between it rounds up exactly when ``bits < frac * 2**20``, so its expectation is the value to 2**-20 of a
    spacing: checked at every threshold analytically, on both neighbours, across subnormals and the top binade."""
    y = _values(gen, dtype)
    n = y.numel()
    top = torch.full((n,), 2**STOCHASTIC_BITS - 1, dtype=torch.int64)
    up = stochastic_grid(y, torch.zeros(n, dtype=torch.int64), dtype)
    down = stochastic_grid(y, top, dtype)
    for q in (up, down):
        assert torch.equal(q.to(dtype).float(), q)  # on the grid: the cast that follows is exact
        assert (q.abs() <= FMAX[dtype]).all()
    mantissa, emin = STOCHASTIC_GRIDS[dtype]
    exponent = torch.floor(torch.log2(y.abs().double())).clamp(min=emin)
    spacing = torch.exp2(exponent - mantissa)
    frac = (y.abs().double() / spacing) - torch.floor(y.abs().double() / spacing)
    low = (y.abs().double() - frac * spacing) * torch.sign(y.double())
    exact = frac == 0
    near_top = frac * 2**STOCHASTIC_BITS > 2**STOCHASTIC_BITS - 1  # rounds up even with all bits set
    assert (down.double().abs() <= y.double().abs())[~near_top].all()
    assert torch.equal(up.double()[exact], y.double()[exact]) and torch.equal(down.double()[exact], y.double()[exact])
    inexact = ~exact
    assert torch.equal(up.double()[inexact].abs(), low.abs()[inexact] + spacing[inexact])  # the upper neighbour
    # the threshold: bits below ceil(frac * 2**20) round up, the rest down
    threshold = torch.ceil(frac * 2**STOCHASTIC_BITS).to(torch.int64)
    below = stochastic_grid(y, (threshold - 1).clamp(min=0), dtype)
    at = stochastic_grid(y, threshold.clamp(max=2**STOCHASTIC_BITS - 1), dtype)
    moves = inexact & (threshold > 0) & (threshold < 2**STOCHASTIC_BITS)
    assert torch.equal(below[moves], up[moves])
    assert torch.equal(at.double()[moves].abs(), low.abs()[moves])
    expectation = low.abs() + spacing * threshold.double() / 2**STOCHASTIC_BITS
    assert ((expectation - y.double().abs()).abs() <= spacing * 2.0**-STOCHASTIC_BITS).all()
    nan = stochastic_grid(torch.tensor([float("nan")]), torch.zeros(1, dtype=torch.int64), dtype)
    assert torch.isnan(nan).all()


def test_the_bits_are_uniform_and_differ_by_row_step_and_element():
    """2**20 draws: every one of 256 bins holds its share within 5 standard deviations (chi-square well under its
    99.99th percentile); neighbouring rows, steps and elements are uncorrelated (|r| < 0.01, 10 standard errors)."""
    n = 2**20
    step = torch.tensor(7.0)
    bits = rounding_bits(3, step, n)
    assert bits.dtype == torch.int64 and int(bits.min()) >= 0 and int(bits.max()) < 2**STOCHASTIC_BITS
    counts = torch.bincount(bits >> (STOCHASTIC_BITS - 8), minlength=256).double()
    expected = n / 256
    assert ((counts - expected).abs() <= 5 * expected**0.5).all()
    assert float(((counts - expected) ** 2 / expected).sum()) < 380  # chi-square, 255 dof: 99.99th pct ~ 360
    u = bits.double() / 2**STOCHASTIC_BITS - 0.5
    for other in (rounding_bits(4, step, n), rounding_bits(3, step + 1, n), torch.roll(bits, 1)):
        v = other.double() / 2**STOCHASTIC_BITS - 0.5
        assert abs(float((u * v).mean() / (u.std() * v.std()))) < 0.01
    assert torch.equal(rounding_bits(3, step, 10), bits[:10])  # a pure function: nothing to save or restore


def _helpers_kernel():
    """A Triton kernel writing ``rounding_bits`` and ``stochastic_grid`` of its input (module-level names: the
    interpreter resolves a kernel's globals)."""
    import triton
    import triton.language as tl

    global _tl_bits, _tl_grid
    from fp8.kernels.triton_formats import rounding_bits as _tl_bits, stochastic_grid as _tl_grid

    @triton.jit
    def kernel(y_ptr, bits_ptr, out_ptr, row_ptr, step_ptr, n, fmt, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        bits = _tl_bits(tl.load(row_ptr), tl.load(step_ptr), offs)  # device values, as the optimizer's kernels read
        tl.store(bits_ptr + offs, bits, mask=mask)
        tl.store(out_ptr + offs, _tl_grid(tl.load(y_ptr + offs, mask=mask, other=0.0), bits, fmt), mask=mask)

    return kernel


def test_triton_helpers_equal_the_torch_reference_bit_for_bit(gen):
    _needs_triton()
    import triton

    from fp8.kernels.triton_formats import FORMAT_CODES

    kernel = _helpers_kernel()
    for dtype in STOCHASTIC_GRIDS:
        y = _values(gen, dtype)
        n = y.numel()
        for row, step in ((0, 1.0), (5, 12345.0)):
            bits, out = torch.empty(n, dtype=torch.int64), torch.empty(n)
            kernel[(triton.cdiv(n, 1024),)](y, bits, out, torch.tensor([row]), torch.tensor([step]), n,
                                            FORMAT_CODES[dtype], BLOCK=1024)
            want_bits = rounding_bits(row, torch.tensor(step), n)
            assert torch.equal(bits, want_bits)
            assert torch.equal(out.view(torch.int32), stochastic_grid(y, want_bits, dtype).view(torch.int32))


def _params(seed: int):
    """tests/fp8/test_kernels.py's parameters: an FP8 weight, an fp32 and a bf16 vector."""
    from tests.fp8.test_kernels import adam_setup

    params, _ = adam_setup(seed, fp8.optim.AdamW)
    return params


def _grads(params, g):
    params[0].grad = fp8.to_float8(torch.randn(40, 52, generator=g) * 1e-3)
    params[1].grad = torch.randn(1100, generator=g)
    params[2].grad = torch.randn(300, generator=g).to(torch.bfloat16)


@pytest.mark.parametrize("opt_cls,kwargs", [
    (fp8.optim.AdamW, dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)),
    (fp8.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
], ids=["AdamW", "SGD"])
def test_the_triton_step_rounds_as_the_torch_step(gen, opt_cls, kwargs):
    """Five steps with two param groups (rows numbered across groups) and a skipped step: the Triton update passes
    against the torch reference within the bounds the round-to-nearest passes meet (tests/fp8/test_kernels.py), and
    the first moments identical in almost every element (the bits are the same; only fp32 update math that differs
    by an ulp can move a value across a threshold)."""
    _needs_triton()
    from tests.fp8.test_kernels import close_to_torch_path

    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    key = "exp_avg" if opt_cls is fp8.optim.AdamW else "momentum_buffer"
    runs = {}
    for backend in ("torch", "triton"):
        params = _params(seed)
        opt = opt_cls([{"params": params[:1]}, {"params": params[1:], "lr": 1e-3}], precision=SR,
                      kernel_backend=backend, **kwargs)
        g = torch.Generator().manual_seed(seed + 1)
        for step in range(5):
            _grads(params, g)
            if step == 3:
                params[1].grad[17] = float("nan")
            opt.step()
        runs[backend] = (params, opt)
    (p_ref, o_ref), (p_tri, o_tri) = runs["torch"], runs["triton"]
    assert o_ref.skipped_steps == o_tri.skipped_steps == 1
    for a, b in zip(p_ref, p_tri):
        s_ref, s_tri = o_ref.state[a], o_tri.state[b]
        close_to_torch_path(s_ref[key], s_tri[key], s_ref[f"{key}_scale"], s_tri[f"{key}_scale"])
        assert (s_ref[key].float() != s_tri[key].float()).float().mean() <= 0.02


def _nearest_run(seed: int, precision, steps: int = 4):
    params = _params(seed)
    opt = fp8.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "lr": 1e-3}], lr=1e-2, precision=precision)
    g = torch.Generator().manual_seed(seed + 1)
    return params, opt, g


def test_the_per_parameter_path_rounds_as_the_multi_tensor_step(gen):
    """The per-parameter branch of the step (taken for block-scaled gradients; forced here by marking one gradient
    block-scaled) numbers its rows as the multi-tensor step does, so the two store the same first moments bit for
    bit."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    p_a, o_a, g_a = _nearest_run(seed, SR)
    p_b, o_b, g_b = _nearest_run(seed, SR)
    calls = []
    update = o_b._masked_param_update
    o_b._masked_param_update = lambda p, group, ok, row=None: (calls.append(row), update(p, group, ok, row))
    for _ in range(4):
        _grads(p_a, g_a)
        o_a.step()
        _grads(p_b, g_b)
        p_b[1].grad.block = "forced"  # what _step_masked reads to pick the per-parameter branch
        o_b.step()
    assert calls == [0, 1, 2] * 4  # the per-parameter branch ran, rows numbered across the two groups
    for a, b in zip(p_a, p_b):
        assert torch.equal(o_a.state[a]["exp_avg"].view(torch.uint8), o_b.state[b]["exp_avg"].view(torch.uint8))
        assert torch.equal(o_a.state[a]["exp_avg_scale"], o_b.state[b]["exp_avg_scale"])
    # and differ from round to nearest
    p_c, o_c, g_c = _nearest_run(seed, "O2")
    for _ in range(4):
        _grads(p_c, g_c)
        o_c.step()
    assert not torch.equal(o_a.state[p_a[1]]["exp_avg"].float(), o_c.state[p_c[1]]["exp_avg"].float())


def test_a_large_tensor_is_rounded_in_chunks_as_in_one_piece(monkeypatch):
    """The torch path rounds ROUNDING_CHUNK elements at a time (bounded temporaries): the same bits as in one piece."""
    import fp8.optim.precision as precision

    y = (torch.randn(10_000) * 100).clamp(-448, 448)
    step = torch.tensor(3.0)
    whole = precision.stochastic_grid(y, rounding_bits(7, step, y.numel()), torch.float8_e4m3fn)
    monkeypatch.setattr(precision, "ROUNDING_CHUNK", 1024)
    assert torch.equal(precision.round_stochastically(y, 7, step, torch.float8_e4m3fn), whole)


def test_a_compiled_step_rounds_as_the_eager_step():
    """``torch.compile(optimizer.step, fullgraph=True)`` with stochastic rounding: the same states as eager."""
    torch._dynamo.reset()
    runs = []
    for compiled in (False, True):
        params, opt, g = _nearest_run(11, SR)
        step = torch.compile(opt.step, fullgraph=True) if compiled else opt.step
        for _ in range(3):
            _grads(params, g)
            step()
        runs.append((params, opt))
    (p_e, o_e), (p_c, o_c) = runs
    for a, b in zip(p_e, p_c):
        assert torch.equal(o_e.state[a]["exp_avg"].view(torch.uint8), o_c.state[b]["exp_avg"].view(torch.uint8))


def test_switching_the_rounding_mode_at_a_resume_is_allowed(gen):
    """The rounding mode is not a storage layout: an O2 state dict loads into a stochastic-rounding optimizer (and
    back), which keeps the level's name "O2"."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    params, nearest, g = _nearest_run(seed, "O2")
    _grads(params, g)
    nearest.step()
    _, stochastic, _ = _nearest_run(seed, SR)
    assert stochastic.opt_level == nearest.opt_level == "O2"
    stochastic.load_state_dict(copy.deepcopy(nearest.state_dict()))
    nearest.load_state_dict(copy.deepcopy(stochastic.state_dict()))


def test_stochastic_rounding_removes_the_e4m3_dead_band():
    """Adam's E4M3 first moment of 4096 elements fed a constant gradient of 1.0 for 200 steps (lr 0: only the moments
    move). Round to nearest stops where an update, (1 - beta1) * (1 - m), falls below half the spacing: at m = 0.75
    (scaled to 384, where the spacing is 32 and the update 12.8), 25% short of the gradient for ever. Stochastic
    rounding reaches 1.0 (measured: every element exactly 1.0, where it then stays; bound 0.01 on the mean)."""
    results = {}
    for rounding in ("nearest", "stochastic"):
        param = torch.nn.Parameter(torch.zeros(4096))
        opt = fp8.optim.Adam([param], lr=0.0, precision=OptimizerPrecision(exp_avg_rounding=rounding))
        for _ in range(200):
            param.grad = torch.ones(4096)
            opt.step()
        state = opt.state[param]
        results[rounding] = (state["exp_avg"].float() / state["exp_avg_scale"]).double()
    assert float(results["nearest"].max()) <= 0.8  # stuck in the dead band
    assert abs(float(results["stochastic"].mean()) - 1.0) < 0.01


def test_a_resumed_run_continues_bit_for_bit(gen):
    """The bits are a function of (row, step, element): a run resumed from its state dict rounds as the uninterrupted
    run (no generator state to save)."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    p_a, o_a, g = _nearest_run(seed, SR)
    for step in range(6):
        _grads(p_a, g)
        o_a.step()
        if step == 2:
            # a copy: the step updates the states in place
            saved = (copy.deepcopy(o_a.state_dict()), [p.detach().clone() for p in p_a], g.get_state())
    p_b, o_b, _ = _nearest_run(seed, SR)
    state, values, rng = saved
    with torch.no_grad():
        for p, v in zip(p_b, values):
            p.copy_(v)
    o_b.load_state_dict(state)
    g.set_state(rng)
    for _ in range(3):
        _grads(p_b, g)
        o_b.step()
    for a, b in zip(p_a, p_b):
        assert torch.equal(o_a.state[a]["exp_avg"].view(torch.uint8), o_b.state[b]["exp_avg"].view(torch.uint8))


def test_misconfigurations_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match="'nearest', 'stochastic'"):
        OptimizerPrecision(exp_avg_rounding="random")
    for exp_avg in ("fp32", "bf16"):
        with pytest.raises(ValueError, match="exp_avg='e4m3'"):
            OptimizerPrecision(exp_avg=exp_avg, exp_avg_rounding="stochastic")
    with pytest.raises(ValueError, match="state_scaling='current'"):
        OptimizerPrecision(state_scaling="delayed", exp_avg_rounding="stochastic")


def test_fp8_initialize_takes_it(gen):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = fp8.initialize(model, opt, "O2", optimizer_precision=SR)
    assert opt.precision.exp_avg_rounding == "stochastic"
    x = torch.randn(16, 64)
    for _ in range(3):
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(s["exp_avg"].float()).all() for s in opt.state.values())


@pytest.mark.parametrize("n_params", [3, 9])
def test_it_adds_one_launch_per_step_whatever_the_parameter_count(gen, n_params):
    """The rounding happens inside the update pass (one op per param group, as before); the step counts it reads are
    one stack per step: one launch more than round to nearest, for 3 parameters as for 9."""
    from fp8.launches import LaunchCounter

    counts = {}
    for precision in ("O2", SR):
        g = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(fp8.to_float8(torch.randn(32, 32, generator=g))) for _ in range(n_params)]
        opt = fp8.optim.AdamW(params, lr=1e-3, precision=precision)
        for step in range(2):
            for p in params:
                p.grad = torch.randn(32, 32, generator=g)
            if step == 0:
                opt.step()
                continue
            with LaunchCounter() as counter:
                opt.step()
        counts[precision if isinstance(precision, str) else "SR"] = counter
    fused = lambda c: {op: n for op, n in c.by_op.items() if op.startswith("fp8lm.")}  # noqa: E731
    assert fused(counts["SR"]) == fused(counts["O2"])
    assert counts["SR"].launches == counts["O2"].launches + 1
