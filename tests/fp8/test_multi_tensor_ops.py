"""The optimizer step's multi-tensor ops (:mod:`fp8.optim.ops`): each op's Triton implementation (run under
``TRITON_INTERPRET=1`` on CPU tensors) against its torch reference, and each op one Triton launch.

- Data movement and scale math (finite check, amaxes, the FP8 refresh, dequantization, copies and restores, the old
  scales and bias corrections, the new scales) are bit-exact: same operations, same rounding.
- The update passes (Adam's, SGD's) round their fp32 update math differently where the reference's kernels fuse
  multiply-adds: compared through whole optimizer runs with the bounds of ``tests/fp8/test_kernels.py``
  (``close_to_torch_path``), with identical scales, step counts and skips.
- Each op is one Triton launch (the CPU op sequence is the GPU's kernel sequence), and the step bumps every FP8
  weight's version counters once, as ``copy_`` did.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (lazily, by the kernels)

import pytest
import torch

import fp8
from fp8.launches import LaunchCounter
from fp8.optim import ops
from fp8.scaled_fp16 import to_scaled_fp16

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _needs_triton():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernel tests run under TRITON_INTERPRET=1")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8) if t.dtype.is_floating_point else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


@contextlib.contextmanager
def _triton_launches():
    """Counts the launches of every Triton kernel of the optimizer's kernel modules."""
    import fp8.kernels.triton_adam as ta
    import fp8.kernels.triton_multi_tensor as mt

    launched = []

    class Counting:
        def __init__(self, kernel, name):
            self.kernel, self.name = kernel, name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(self.name)
                return self.kernel[grid](*args, **kwargs)
            return launch

    patch = pytest.MonkeyPatch()
    for module in (ta, mt):
        for name, value in vars(module).items():
            if name.endswith("_kernel") and hasattr(value, "__getitem__"):  # a @triton.jit kernel (or interpreted)
                patch.setattr(module, name, Counting(value, name))
    try:
        yield launched
    finally:
        patch.undo()


def _tensors(gen, dtypes=(torch.float32, torch.bfloat16, torch.float16, E4M3, E5M2), sizes=(1, 1000, 2500)):
    return [(torch.randn(n, generator=gen) * 10).to(dtype) for dtype in dtypes for n in sizes]


@pytest.mark.parametrize("poison", [None, "inf", "nan"])
def test_finite_check(gen, poison):
    _needs_triton()
    tensors = _tensors(gen)
    if poison is not None:  # E4M3 (float8_e4m3fn) has no inf: an inf written there saturates, so it takes NaN only
        eligible = [t for t in tensors if poison == "nan" or t.dtype is not E4M3]
        eligible[int(torch.randint(0, len(eligible), (1,), generator=gen))].view(-1)[-1] = float(poison)
    flags = {}
    for backend in ("torch", "triton"):
        flags[backend] = torch.zeros(1, dtype=torch.int32)
        ops.mark_nonfinite_(tensors, flags[backend], backend=backend)
    assert flags["torch"].item() == flags["triton"].item() == int(poison is not None)


def test_fp8_refresh_amax_and_quantize(gen):
    """O1's refresh: amaxes (NaN wins), then each FP8 payload cast with the scale of its amax (the old scale kept
    where the amax is 0), bit for bit."""
    _needs_triton()
    values = [t for t in _tensors(gen, (torch.float32, torch.bfloat16)) for _ in (0,)]
    values.append(torch.zeros(300))  # amax 0: the previous scale stays
    nan = torch.randn(50, generator=gen)
    nan[3] = float("nan")
    values.append(nan)
    formats = [E4M3 if i % 2 else E5M2 for i in range(len(values))]
    out = {}
    for backend in ("torch", "triton"):
        amax = torch.zeros(len(values))
        ops.amaxes_(values, amax, backend=backend)
        payloads = [torch.zeros(v.shape, dtype=f) for v, f in zip(values, formats)]
        scales = [torch.tensor(2.0 ** -(i % 5)) for i in range(len(values))]
        ops.quantize_weights_(values, amax, payloads, scales, backend=backend)
        out[backend] = (amax, payloads, scales)
    (a_ref, p_ref, s_ref), (a_tri, p_tri, s_tri) = out["torch"], out["triton"]
    assert torch.isnan(a_ref[-1]) and torch.isnan(a_tri[-1])
    assert torch.equal(a_ref[:-1], a_tri[:-1])
    assert s_ref[-2].item() == 2.0 ** -((len(values) - 2) % 5)  # amax 0 kept the old scale
    for a, b in zip(p_ref + s_ref, p_tri + s_tri):
        assert _same(a, b)


def test_dequantize(gen):
    """Scaled gradients (FP16 and FP8 payloads with a scale, also one that is not a power of two, as after clipping)
    and a plain fp32 one, to bf16 and fp32, bit for bit."""
    _needs_triton()
    payloads = [to_scaled_fp16(torch.randn(40, 25, generator=gen) * 1e-3).payload,
                fp8.to_float8(torch.randn(1500, generator=gen)).payload,
                fp8.to_float8(torch.randn(7, generator=gen), "e5m2").payload,
                torch.randn(2049, generator=gen)]
    scales = [torch.tensor(4096.0), torch.tensor(3.0), torch.tensor(0.37), torch.empty(0)]
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        ref = ops.dequantize_grads(payloads, scales, dtype, backend="torch")
        tri = ops.dequantize_grads(payloads, scales, dtype, backend="triton")
        for a, b in zip(ref, tri):
            assert _same(a, b)


@pytest.mark.parametrize("taken", [True, False])
def test_clone_and_restore(gen, taken):
    """O1's masked step: a copy before, and the values restored from it where the step was not taken."""
    _needs_triton()
    for backend in ("torch", "triton"):
        tensors = _tensors(gen) + [torch.tensor(3.0), torch.randint(0, 9, (5,))]
        before = [t.clone() for t in tensors]
        saved = ops.clone_tensors(tensors, backend=backend)
        assert all(_same(s, t) and s.data_ptr() != t.data_ptr() for s, t in zip(saved, tensors))
        for t in tensors:
            t.reshape(-1).view(torch.uint8).add_(1) if t.is_floating_point() else t.add_(1)
        changed = [t.clone() for t in tensors]
        ops.restore_unless_(tensors, saved, torch.tensor(taken), backend=backend)
        for t, b, c in zip(tensors, before, changed):
            assert _same(t, c if taken else b)


def _optimizer_lists(opt):
    """The per-row lists and workspace of ``opt``'s multi-tensor step (as ``FP8Optimizer._multi_tensor_step``
    builds them)."""
    from fp8.optim.ops import STATE_LISTS

    lists = {key: [] for key in (*STATE_LISTS, "grads", "grad_scales", "kinds", "moments", "beta1", "beta2", "lr")}
    for group in opt.param_groups:
        for p in group["params"]:
            opt._append_row(lists, p, group, torch.device("cpu"))
    return lists, [lists[key] for key in STATE_LISTS]


def _setup(seed: int, opt_cls, **kwargs):
    g = torch.Generator().manual_seed(seed)
    weight = torch.nn.Parameter(fp8.to_float8(torch.randn(40, 52, generator=g) * 0.02))  # 2080: not a multiple of 1024
    vector = torch.nn.Parameter(torch.randn(1100, generator=g))
    half = torch.nn.Parameter(torch.randn(300, generator=g).to(torch.bfloat16))
    return [weight, vector, half], opt_cls([weight, vector, half], **kwargs)


def _grads(params, g, spike: float = 1.0):
    params[0].grad = to_scaled_fp16(torch.randn(40, 52, generator=g) * 1e-3 * spike)
    params[1].grad = torch.randn(1100, generator=g) * spike
    params[2].grad = (torch.randn(300, generator=g) * spike).to(torch.bfloat16)


@pytest.mark.parametrize("agreed", [None, True, False])
def test_prepare_and_scales_are_bit_exact(gen, agreed):
    """Old scales, bias corrections (``beta**t`` in fp64 by the kernel's binary exponentiation, as the reference's
    ``pow``), zeroed amaxes, the skip flag from the agreement; and the new scales from given amaxes (also 0, inf and
    NaN: the old scale kept), each role's format and the FP8 weight's stored-master amax."""
    _needs_triton()
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    params, opt = _setup(seed, fp8.optim.AdamW, lr=3e-3, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(seed + 1)
    for _ in range(int(torch.randint(1, 5, (1,), generator=gen))):
        _grads(params, g)
        opt.step()
    _grads(params, g)
    lists, state = _optimizer_lists(opt)
    n = len(lists["kinds"])
    amaxes = torch.rand(n, 3, generator=gen) * 10
    amaxes[0, 2], amaxes[1, 0], amaxes[2, 1] = 0.0, float("inf"), float("nan")
    out = {}
    for backend in ("torch", "triton"):
        old, bc, amax, new = torch.empty(n, 5), torch.empty(n, 2), torch.full((n, 3), 7.0), torch.empty(n, 4)
        bad = torch.full((1,), 5, dtype=torch.int32)
        ops.prepare_states_(lists["grad_scales"], *state, lists["kinds"], lists["moments"], lists["beta1"],
                            lists["beta2"], lists["lr"], True, None if agreed is None else torch.tensor(agreed), old, bc,
                            amax, bad, [], backend=backend)
        prepared = (old.clone(), bc.clone(), amax.clone(), bad.clone())
        ops.state_scales_(*state, lists["kinds"], lists["moments"], amaxes, old, new, [], backend=backend)
        out[backend] = (*prepared, new)
    for a, b in zip(out["torch"], out["triton"]):
        assert _same(a, b)
    assert out["torch"][3].item() == int(agreed is False) and not out["torch"][2].any()


SGD_CASES = [
    dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True),
    dict(lr=0.05, momentum=0.9, dampening=0.2, maximize=True),
    dict(lr=0.05, weight_decay=0.01),
]


@pytest.mark.parametrize("kwargs", SGD_CASES, ids=["nesterov", "dampening-maximize", "no-momentum"])
def test_sgd_kernels_match_the_torch_path(gen, kwargs):
    """SGD's passes (two param groups; an FP8 weight, fp32 and bf16 vectors): five steps, a gradient spike at step 1,
    a NaN gradient at step 3 (skipped by both) and an external "not ok" at step 4 (O3's agreement), then one more."""
    _needs_triton()
    from tests.fp8.test_kernels import close_to_torch_path

    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    runs = {}
    for backend in ("torch", "triton"):
        params, _ = _setup(seed, fp8.optim.SGD, lr=0.05)
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 0.01}]
        opt = fp8.optim.SGD(groups, kernel_backend=backend, **kwargs)
        g = torch.Generator().manual_seed(seed + 1)
        for step in range(6):
            _grads(params, g, spike=1e3 if step == 1 else 1.0)
            if step == 3:
                params[1].grad[17] = float("nan")
            if step == 4:
                opt._step_masked(torch.tensor(False))
            else:
                opt.step()
        runs[backend] = (params, opt)
    (p_ref, o_ref), (p_tri, o_tri) = runs["torch"], runs["triton"]
    assert o_ref.skipped_steps == o_tri.skipped_steps == 2
    for a, b in zip(p_ref, p_tri):
        s_ref, s_tri = o_ref.state[a], o_tri.state[b]
        assert s_ref.keys() == s_tri.keys()
        assert torch.equal(s_ref["step"], s_tri["step"]) and s_tri["step"] == 4
        for key in ("momentum_buffer", "master"):
            if key in s_ref:
                close_to_torch_path(s_ref[key], s_tri[key], s_ref[f"{key}_scale"], s_tri[f"{key}_scale"])
        if isinstance(a, fp8.Float8Tensor):
            close_to_torch_path(a.payload, b.payload, a.scale, b.scale)
        else:
            close_to_torch_path(a.detach(), b.detach(), torch.ones(()), torch.ones(()))


@pytest.mark.parametrize("opt_cls,kwargs", [
    (fp8.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (fp8.optim.SGD, dict(lr=0.05, momentum=0.9)),
], ids=["AdamW", "SGD"])
def test_each_op_of_the_step_is_one_triton_launch(gen, opt_cls, kwargs):
    """A step with the Triton backend: the ops the dispatcher sees are the kernels launched, one each (two param
    groups: one update pass of each stage per group)."""
    _needs_triton()
    params, _ = _setup(int(torch.randint(0, 2**31, (1,), generator=gen)), opt_cls, **kwargs)
    opt = opt_cls([{"params": params[:1]}, {"params": params[1:], "lr": 1e-3}], kernel_backend="triton", **kwargs)
    g = torch.Generator().manual_seed(0)
    _grads(params, g)
    opt.step()  # first step: states created
    _grads(params, g)
    with _triton_launches() as launched, LaunchCounter() as counter:
        opt.step()
    custom = sorted(op for op, n in counter.by_op.items() for _ in range(n) if op.startswith("fp8lm."))
    assert len(launched) == len(custom) == 6, (launched, custom)  # prepare, 2 x stage 1, scales, 2 x stage 2


def test_o1_ops_are_one_triton_launch_each(gen):
    """O1's ops (finite check, dequantization, copy, restore, amax, quantize): one launch per call."""
    _needs_triton()
    tensors = _tensors(gen, (torch.float32, torch.bfloat16))
    with _triton_launches() as launched:
        flag = torch.zeros(1, dtype=torch.int32)
        ops.mark_nonfinite_(tensors, flag, backend="triton")
        ops.dequantize_grads(tensors, [torch.empty(0)] * len(tensors), torch.float32, backend="triton")
        saved = ops.clone_tensors(tensors, backend="triton")
        ops.restore_unless_(tensors, saved, torch.tensor(False), backend="triton")
        amax = torch.zeros(len(tensors))
        ops.amaxes_(tensors, amax, backend="triton")
        ops.quantize_weights_(tensors, amax, [torch.empty(t.shape, dtype=E4M3) for t in tensors],
                      [torch.ones(()) for _ in tensors], backend="triton")
    assert len(launched) == 6, launched


@pytest.mark.parametrize("level,backend", [("O2", "torch"), ("O2", "triton"), ("O1", "auto")])
def test_a_step_bumps_each_fp8_weight_version_once(level, backend):
    """The FP8 linear keys the operands it caches from a weight (its transpose) on the versions of the weight, its
    payload and its scale: the step bumps each once, as the ``copy_`` of the per-parameter path did."""
    if backend == "triton":
        _needs_triton()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16))
    model, opt = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level)
    if backend != "auto":
        opt.kernel_backend = backend
    weights = [m.weight for m in model if isinstance(m, fp8.Float8Linear)]
    for _ in range(2):
        model(torch.randn(8, 32)).square().mean().backward()
        versions = [(w._version, w.payload._version, w.scale._version) for w in weights]
        opt.step()
        opt.zero_grad()
        assert [(w._version, w.payload._version, w.scale._version) for w in weights] == \
            [(a + 1, b + 1, c + 1) for a, b, c in versions]


def test_states_are_updated_in_place_without_touching_what_they_started_from(gen):
    """The step updates the moments and masters in place: each is its own storage from the start (fp32 states
    included), and an fp32 initial master is copied, never updated."""
    w0 = torch.randn(32, 32, generator=gen) * 0.02
    weight = torch.nn.Parameter(fp8.to_float8(w0))
    vector = torch.nn.Parameter(torch.randn(64, generator=gen))
    initial = w0.clone()
    opt = fp8.optim.AdamW([weight, vector], lr=1e-2, precision=fp8.optim.OptimizerPrecision("fp32", "fp32", "fp32"),
                          initial_masters={weight: w0})
    state = opt.state[weight]
    storages = {k: v.untyped_storage().data_ptr() for k, v in state.items()}
    assert len(set(storages.values())) == len(storages)
    for _ in range(3):
        weight.grad = fp8.to_float8(torch.randn(32, 32, generator=gen))
        vector.grad = torch.randn(64, generator=gen)
        opt.step()
    assert torch.equal(w0, initial)
    assert {k: v.untyped_storage().data_ptr() for k, v in state.items()} == storages
    assert not torch.equal(state["exp_avg"], state["exp_avg_sq"])


# -- block-scaled FP8 weights (the rowwise and blockwise recipes) -------------------------------------------------------
def _block_case(gen):
    """Masters of block-scaled weights: fp32, bf16 and a scaled FP16 master, row-wise and 128x128 blocks and a block
    of whole columns, shapes that leave partial blocks, a zero block and a NaN."""
    from fp8.blocks import grid_shape

    shapes = [((150, 140), (128, 128)), ((37, 300), (1, 0)), ((9, 130), (128, 128)), ((40, 20), (0, 1))]
    values, value_scales = [], []
    for i, (shape, _) in enumerate(shapes):
        v = torch.randn(*shape, generator=gen) * 10.0 ** (i - 2)
        if i == 0:
            v[:128, :128] = 0.0  # a zero block: scale 1
        if i == 2:
            v[3, 7] = float("nan")  # a NaN block: scale 1, NaN kept
        if i == 1:
            master = to_scaled_fp16(v)
            values.append(master.payload)
            value_scales.append(master.scale)
        else:
            values.append(v.to(torch.bfloat16) if i == 3 else v)
            value_scales.append(torch.empty(0))
    payloads = lambda: [torch.zeros(s, dtype=E4M3 if i % 2 == 0 else E5M2) for i, (s, _) in enumerate(shapes)]  # noqa: E731
    grids = lambda: [torch.full(grid_shape(b, s), 3.0) for s, b in shapes]  # noqa: E731
    return values, value_scales, payloads, grids, [x for _, b in shapes for x in b], shapes


@pytest.mark.parametrize("bad", [None, 0, 1])
def test_block_weight_refresh_matches_copy_and_its_triton_kernel(gen, bad):
    """``quantize_weight_blocks_``: the reference is ``Float8Tensor.copy_``'s (``quantize_to_blocks`` of the decoded
    master) and the Triton kernel gives the same bits; a set skip flag leaves payloads and grids as they were; one
    launch for all weights."""
    from fp8.blocks import quantize_to_blocks
    from fp8.optim.precision import decode

    values, value_scales, payloads, grids, blocks, shapes = _block_case(gen)
    flag = None if bad is None else torch.full((1,), bad, dtype=torch.int32)
    out = {}
    backends = ("torch", "triton") if os.environ.get("TRITON_INTERPRET") == "1" else ("torch",)
    for backend in backends:
        if backend == "triton":
            pytest.importorskip("triton")
        ps, gs = payloads(), grids()
        with _triton_launches() as launched:
            ops.quantize_weight_blocks_(values, value_scales, ps, gs, blocks, flag, backend=backend)
        assert len(launched) == (1 if backend == "triton" else 0), launched
        out[backend] = (ps, gs)
    for i, (shape, block) in enumerate(shapes):
        value = decode(values[i], value_scales[i]) if value_scales[i].numel() else values[i].to(torch.float32)
        want, want_grid = quantize_to_blocks(value, block, "e4m3" if i % 2 == 0 else "e5m2")
        if bad:
            want, want_grid = payloads()[i], grids()[i]
        for ps, gs in out.values():
            assert _same(ps[i], want) and _same(gs[i], want_grid), (i, shape, block)
    if not bad:
        assert out["torch"][1][0][0, 0] == 1.0  # the zero block
        assert torch.isnan(out["torch"][0][2].to(torch.float32)).sum() == 1


@pytest.mark.parametrize("recipe_block", [(1, 0), (128, 128)], ids=["rowwise", "blockwise"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_block_scaled_weights_take_the_multi_tensor_step(gen, recipe_block, backend):
    """A block-scaled FP8 weight steps in the multi-tensor path (kind 3): its master and moments evolve exactly as a
    tensor-wise FP8 weight's given the same master and gradients (the update never reads the weight), the weight is
    ``quantize_to_blocks`` of the new master after every step, and a skipped step (a NaN gradient) leaves it as it
    was; the step's ops are the same fixed set whatever the number of weights."""
    if backend == "triton":
        _needs_triton()
    from fp8.blocks import quantize_to_blocks

    shape = (72, 136)  # a partial 128x128 block and a partial column chunk; small for the Triton interpreter
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(*shape, generator=g) * 0.02
    blocked = torch.nn.Parameter(fp8.to_float8(w0, block=recipe_block))
    plain = torch.nn.Parameter(fp8.to_float8(w0))
    opts = [fp8.optim.AdamW([p], lr=1e-2, weight_decay=0.1, initial_masters={p: w0}, kernel_backend=backend)
            for p in (blocked, plain)]
    for step in range(4):
        grad = torch.randn(*shape, generator=g) * 1e-3
        if step == 2:
            grad[5, 5] = float("nan")
        before = (blocked.payload.clone(), blocked.scale.clone())
        for p, opt in zip((blocked, plain), opts):
            p.grad = to_scaled_fp16(grad)
            with LaunchCounter() as counter:
                opt.step()
            if p is blocked:
                assert counter.by_op.get("fp8lm.quantize_weight_blocks_.default") == 1, counter.by_op
                assert "aten.abs" not in counter.by_op and "aten.log2" not in counter.by_op, counter.by_op
        s_blk, s_pln = opts[0].state[blocked], opts[1].state[plain]
        for key in ("master", "master_scale", "exp_avg", "exp_avg_scale", "exp_avg_sq", "exp_avg_sq_scale", "step"):
            assert _same(s_blk[key], s_pln[key]), (step, key)
        if step == 2:
            assert _same(blocked.payload, before[0]) and _same(blocked.scale, before[1])
        else:
            want, grid = quantize_to_blocks(s_blk["master"].to(torch.float32) / s_blk["master_scale"], recipe_block,
                                            "e4m3")
            assert _same(blocked.payload, want) and _same(blocked.scale, grid), step
    assert opts[0].skipped_steps == opts[1].skipped_steps == 1
