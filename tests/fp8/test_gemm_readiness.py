"""Hardware GEMM readiness, checked on the CPU (issue 22): every FP8 GEMM of a training step, for each recipe
(:mod:`fp8.recipes`), can run on an FP8 GPU.

1. Forced hardware (tensorwise, rowwise: the recipes the CPU's ``torch._scaled_mm`` takes): a training step with
   ``gemm_backend="scaled_mm"``; every ``aten._scaled_mm`` call is recorded (a ``TorchDispatchMode``) and replayed
   on ``meta`` tensors of the same shapes, strides and dtypes: torch's ``meta`` kernel enforces CUDA's layout, size
   and scale rules (the CPU kernel is lenient).
2. Dispatch audit: a training step records the operands of every GEMM (``fp8.linear``'s :func:`fp8.gemm.mm`, with
   a count of the emulation's ``aten.mm`` calls proving none was missed) and asks :func:`fp8.gemm.gemm_path`, the
   function the GEMM itself runs, for a simulated compute capability 9.0 GPU (H100/H200); each GEMM is then run
   by ``mm`` itself on ``meta`` copies for that GPU (its CUDA ``_scaled_mm`` calls meet the ``meta``
   kernel and :func:`fp8.gemm.scaled_mm_call_problem`, the Triton block GEMM's scale grids meet its torch
   reference's checks). No GEMM of any recipe is emulated there. ``pytest -s`` prints the table.
3. The checks fail where the rules are broken (row-major ``mat2``, K not a multiple of 16, row-wise fp32 output,
   an old GPU, no Triton), and the row-wise choice for non-bf16 outputs (``scaled_mm_rowwise_epilogue``: unit-scale
   tensor-wise GEMM in fp32, scales after) gives the emulation's bits and stays within the fp32 summation bound
   of float64.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fp8
import fp8.grouped_gemm
import fp8.linear
import fp8.tensor
from fp8.blocks import BLOCK, COLWISE, ROWWISE, TILE, dequantize_blocks, quantize_to_blocks
from fp8.fp4 import nvfp4_call_problem
from fp8.gemm import (GEMM_PATHS, GemmTarget, Operand, fp8_mm_payload, gemm_path, logical_shape, mm, mx_call_problem,
                      scaled_mm_call_problem)
from fp8.kernels.triton_block_gemm import block_mm_reference
from fp8.linear import Float8LinearConfig
from fp8.recipes import RECIPES

HOPPER = GemmTarget("cuda", (9, 0), triton=True)
"""A simulated H100/H200: CUDA, compute capability 9.0, Triton installed."""

BLACKWELL_GPU = GemmTarget("cuda", (10, 0), triton=True)
"""A simulated B200/GB200: CUDA, compute capability 10.0 (block-scaled MXFP8 GEMMs), Triton installed."""

TARGETS = {"mxfp8": BLACKWELL_GPU, "nvfp4": BLACKWELL_GPU}
"""The GPU each recipe's audit is decided for (default :data:`HOPPER`): MXFP8 needs Blackwell (refused on Hopper)."""

# Layer widths and (batch, sequence) per recipe: multiples of 16 (of 128 for blockwise), tokens differing from
# every width so a GEMM's pass follows from its K (weight gradient: K = tokens).
SHAPES = {
    "tensorwise": ((64, 96, 48), (2, 16)),
    "rowwise": ((64, 96, 48), (2, 16)),
    "blockwise": ((384, 512, 640), (2, 128)),
    "mxfp8": ((64, 96, 160), (2, 32)),
    "nvfp4": ((64, 96, 160), (2, 32)),
}
DTYPES = (torch.float32, torch.bfloat16)


def _meta(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized ``meta`` tensor of ``t``'s shape, strides and dtype."""
    return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")


@dataclass(frozen=True)
class GemmCall:
    """One :func:`fp8.gemm.mm` call of a step, its tensors as ``meta`` copies (``*_scale``: the operands' ``scale_inv``)."""

    phase: str
    a: torch.Tensor
    a_scale: torch.Tensor
    b: torch.Tensor
    b_scale: torch.Tensor
    out_dtype: torch.dtype
    backend: str
    a_block: tuple | None
    b_block: tuple | None
    a_global: torch.Tensor | None = None  # NVFP4's per-tensor factors
    b_global: torch.Tensor | None = None


class _AtenRecorder(TorchDispatchMode):
    """Records ``aten._scaled_mm`` calls (as ``meta`` copies of their arguments) and counts ``aten.mm`` calls."""

    def __init__(self):
        super().__init__()
        self.scaled_mm: list[dict] = []  # each call's arguments by name (self, mat2, scale_a, ..., out_dtype)
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._scaled_mm.default, torch.ops.aten._scaled_mm_v2.default):
            named = dict(zip((arg.name for arg in func._schema.arguments), args), **kwargs)
            self.scaled_mm.append({k: _meta(v) if isinstance(v, torch.Tensor) else v for k, v in named.items()})
        elif func is torch.ops.aten.mm.default:
            self.mm += 1
        return func(*args, **kwargs)


def _recording_mm(calls: list, phase: list) -> Callable:
    """:func:`fp8.gemm.mm` recording each call (as a :class:`GemmCall` of ``meta`` copies, in pass ``phase[0]``)."""
    def record(a, b, out_dtype=torch.float32, backend="auto", *args, **kwargs):
        glob = [None if op.global_scale_inv is None else _meta(op.global_scale_inv) for op in (a, b)]
        calls.append(GemmCall(phase[0], _meta(a.data), _meta(a.scale_inv), _meta(b.data), _meta(b.scale_inv),
                              out_dtype, backend, a.block, b.block, *glob))
        return mm(a, b, out_dtype, backend, *args, **kwargs)

    return record


def _train_step(recipe, dtype, backend, monkeypatch, seq=None):
    """One O2 training step of a two-layer FP8 MLP (input gradient too, so every layer runs all three GEMMs).
    Returns the recorded :class:`GemmCall` list, the ``_AtenRecorder``, the layer widths and the token count."""
    widths, (batch, default_seq) = SHAPES[recipe]
    seq = seq or default_seq
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(widths[0], widths[1]), nn.GELU(), nn.Linear(widths[1], widths[2])).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fp8.initialize(model, optimizer, "O2", config=Float8LinearConfig(recipe=recipe,
                                                                                        gemm_backend=backend))
    assert all(m.config.recipe == recipe for m in model if isinstance(m, fp8.Float8Linear))
    calls: list[GemmCall] = []
    phase = ["fwd"]

    record = _recording_mm(calls, phase)
    monkeypatch.setattr(fp8.linear, "mm", record)  # the FP8 linear's one GEMM call (forward, both backward GEMMs)
    x = torch.randn(batch, seq, widths[0], dtype=dtype, requires_grad=True)
    with _AtenRecorder() as aten:
        loss = model(x).float().pow(2).mean()
        phase[0] = "bwd"
        loss.backward()
        phase[0] = "step"
        optimizer.step()
        optimizer.zero_grad()
    monkeypatch.undo()
    return calls, aten, widths, batch * seq


def _pass_and_layer(call: GemmCall, widths, tokens) -> tuple[str, int]:
    (m, k), n = logical_shape(call.a), call.b.shape[1]
    layers = list(zip(widths, widths[1:]))  # (in, out) per layer
    if call.phase == "fwd":
        return "fwd", layers.index((k, n))
    assert call.phase == "bwd", f"a GEMM outside forward and backward: {call}"
    if k in (tokens, *(-(-tokens // m) * m for m in (16, 32, 128))):  # the token count, padded to the GEMM's multiple
        return "wgrad", layers.index((n, m))
    return "dgrad", layers.index((n, k))


def _audit(recipe, dtype, calls, widths, tokens, target=None) -> list[dict]:
    """The path :func:`gemm_path` gives each GEMM of the step on ``target`` (default: the recipe's
    :data:`TARGETS`); each GEMM is also run for ``target`` on ``meta`` copies of its operands (the CUDA calls it would
    make meet torch's ``meta`` kernel)."""
    target = target or TARGETS.get(recipe, HOPPER)
    rows = []
    for call in calls:
        gemm_pass, layer = _pass_and_layer(call, widths, tokens)
        choice = gemm_path(call.a, call.b, call.out_dtype, target, call.backend, call.a_block, call.b_block)
        scaled_mm_calls = []
        if choice.path.startswith("scaled_mm"):
            with _AtenRecorder() as aten:
                out = mm(Operand(call.a, call.a_scale, call.a_block, global_scale_inv=call.a_global),
                         Operand(call.b, call.b_scale, call.b_block, global_scale_inv=call.b_global),
                         call.out_dtype, call.backend, target=target)
            scaled_mm_calls = aten.scaled_mm
            assert out.shape == (call.a.shape[0], call.b.shape[1]) and out.dtype == call.out_dtype
        elif choice.path == "triton_block":  # the kernel's operand and scale-grid checks, on meta tensors
            block_mm_reference(call.a, call.a_scale, call.a_block, call.b, call.b_scale, call.b_block, call.out_dtype)
        rows.append(dict(recipe=recipe, dtype=str(dtype).removeprefix("torch."), gemm_pass=gemm_pass, layer=layer,
                         shape=(*logical_shape(call.a), call.b.shape[1]),
                         blocks=f"{call.a_block or 'tensor'} x {call.b_block or 'tensor'}",
                         out=str(call.out_dtype).removeprefix("torch."), path=choice.path, reason=choice.reason,
                         scaled_mm_calls=scaled_mm_calls))
    return rows


def _table(rows) -> str:
    lines = [f"{'recipe':<10} {'model':<8} {'pass':<5} {'layer':<5} {'M x K x N':<16} {'scale blocks (a x b)':<26} "
             f"{'out':<8} path"]
    for r in rows:
        lines.append(f"{r['recipe']:<10} {r['dtype']:<8} {r['gemm_pass']:<5} {r['layer']:<5} "
                     f"{' x '.join(map(str, r['shape'])):<16} {r['blocks']:<26} {r['out']:<8} {r['path']}")
    return "\n".join(lines)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_forced_hardware_scaled_mm_calls_meet_cuda_rules_on_meta(recipe, dtype, monkeypatch):
    """(1) Every ``_scaled_mm`` call of a forced-hardware step replays on ``meta`` tensors (CUDA's layout, size
    and scale rules) without error; there is one per GEMM (none emulated)."""
    calls, aten, _, _ = _train_step(recipe, dtype, "scaled_mm", monkeypatch)
    assert len(calls) == 6 and len(aten.scaled_mm) == len(calls) and aten.mm == 0
    for call in aten.scaled_mm:
        out = torch.ops.aten._scaled_mm.default(**call)
        assert out.shape == (call["self"].shape[0], call["mat2"].shape[1]) and out.device.type == "meta"


EXPECTED_PATHS = {  # (recipe, model dtype) -> {pass: path} on a compute capability 9.0 GPU
    ("tensorwise", torch.float32): dict.fromkeys(("fwd", "dgrad", "wgrad"), "scaled_mm_tensorwise"),
    ("tensorwise", torch.bfloat16): dict.fromkeys(("fwd", "dgrad", "wgrad"), "scaled_mm_tensorwise"),
    ("rowwise", torch.float32): dict.fromkeys(("fwd", "dgrad", "wgrad"), "scaled_mm_rowwise_epilogue"),
    ("rowwise", torch.bfloat16): {"fwd": "scaled_mm_rowwise", "dgrad": "scaled_mm_rowwise",
                                  "wgrad": "scaled_mm_rowwise_epilogue"},  # the weight gradient stays fp32
    ("blockwise", torch.float32): dict.fromkeys(("fwd", "dgrad", "wgrad"), "triton_block"),
    ("blockwise", torch.bfloat16): dict.fromkeys(("fwd", "dgrad", "wgrad"), "triton_block"),
    ("mxfp8", torch.float32): dict.fromkeys(("fwd", "dgrad", "wgrad"), "scaled_mm_mx"),
    ("mxfp8", torch.bfloat16): dict.fromkeys(("fwd", "dgrad", "wgrad"), "scaled_mm_mx"),
    ("nvfp4", torch.float32): dict.fromkeys(("fwd", "dgrad", "wgrad"), "scaled_mm_nvfp4"),
    ("nvfp4", torch.bfloat16): dict.fromkeys(("fwd", "dgrad", "wgrad"), "scaled_mm_nvfp4"),
}


def test_dispatch_audit_on_a_compute_capability_9_gpu_emulates_no_gemm(monkeypatch):
    """(2) The audit table of a training step per recipe and model dtype: every GEMM (forward, input gradient,
    weight gradient of every layer) takes a hardware path on an H100/H200 (MXFP8: on a B200, :data:`TARGETS`), the
    one expected for its recipe."""
    rows = []
    for recipe in RECIPES:
        for dtype in DTYPES:
            calls, aten, widths, tokens = _train_step(recipe, dtype, "auto", monkeypatch)
            assert aten.mm == len(calls) == 6  # CPU "auto" emulates: one aten.mm per GEMM, each one recorded
            rows += _audit(recipe, dtype, calls, widths, tokens)
    print("\nFP8 GEMM dispatch audit, simulated CUDA compute capability 9.0 (mxfp8, nvfp4: 10.0; Triton installed):\n"
          + _table(rows))
    assert {r["path"] for r in rows} <= set(GEMM_PATHS) - {"emulated"}, _table(rows)
    for r in rows:
        expected = EXPECTED_PATHS[(r["recipe"], getattr(torch, r["dtype"]))][r["gemm_pass"]]
        assert r["path"] == expected, (r, r["reason"])
        if r["path"].startswith("scaled_mm"):
            assert len(r["scaled_mm_calls"]) == 1
            call = r["scaled_mm_calls"][0]
            scale_a, scale_b, out_dtype = call["scale_a"], call["scale_b"], call["out_dtype"]
            if r["path"] == "scaled_mm_nvfp4":  # packed E2M1, [swizzled E4M3 per 16, fp32 per tensor] per operand
                (scale_a, global_a), (scale_b, _) = scale_a, scale_b
                assert nvfp4_call_problem(call["self"], call["mat2"], scale_a, scale_b, "cuda", (10, 0)) is None
                assert global_a.numel() == 1 and global_a.dtype == torch.float32
                continue
            if r["path"] == "scaled_mm_mx":  # aten._scaled_mm_v2: swizzled E8M0 scales, one per 32 along K
                (scale_a,), (scale_b,) = scale_a, scale_b
                assert mx_call_problem(call["self"], call["mat2"], scale_a, scale_b, out_dtype, BLACKWELL_GPU) is None
                continue
            assert scaled_mm_call_problem(call["self"], call["mat2"], scale_a, scale_b, out_dtype, HOPPER) is None
            if r["path"] == "scaled_mm_rowwise":
                assert out_dtype == torch.bfloat16 and scale_a.shape == (r["shape"][0], 1)
            else:  # tensor-wise call (the epilogue path's unit scales included)
                assert scale_a.numel() == scale_b.numel() == 1
    passes = {(r["recipe"], r["dtype"], r["gemm_pass"], r["layer"]) for r in rows}
    assert len(passes) == len(rows) == len(RECIPES) * 2 * 3 * 2  # recipes x dtypes x passes x layers, each GEMM once


def test_token_counts_off_the_gemm_multiple_are_padded_not_emulated(monkeypatch):
    """A step whose token count is not a multiple of the GEMM's (12 tokens per sequence, 24 in all: the weight
    gradient's K; 2 x 96 tokens for blockwise's 128) runs every GEMM on hardware: the weight-gradient GEMM's operands
    are quantized into zero-padded columns (K = 32, K = 256), which add nothing to the sum."""
    for recipe, seq, padded in (("tensorwise", 12, 32), ("blockwise", 96, 256)):
        calls, _, widths, tokens = _train_step(recipe, torch.float32, "auto", monkeypatch, seq=seq)
        rows = _audit(recipe, torch.float32, calls, widths, tokens)
        assert not [r for r in rows if r["path"] == "emulated"], _table(rows)
        assert {r["shape"][1] for r in rows if r["gemm_pass"] == "wgrad"} == {padded}, _table(rows)


def _call_operands(m=32, k=64, n=48, b_layout="col"):
    a = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta").t() if b_layout == "col" else \
        torch.empty(k, n, dtype=torch.float8_e4m3fn, device="meta")
    one = torch.ones((), device="meta")
    return a, b, one


def test_call_rules_and_meta_replay_reject_what_cuda_rejects():
    a, b, one = _call_operands()
    assert scaled_mm_call_problem(a, b, one, one, torch.float32, HOPPER) is None
    torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)  # the meta kernel takes it
    a, b_row_major, one = _call_operands(b_layout="row")
    assert "mat2 must be column-major" in scaled_mm_call_problem(a, b_row_major, one, one, torch.float32, HOPPER)
    with pytest.raises(RuntimeError, match="col_major"):
        torch._scaled_mm(a, b_row_major, scale_a=one, scale_b=one, out_dtype=torch.float32)
    a, b, one = _call_operands(k=24)
    assert "multiples of 16" in scaled_mm_call_problem(a, b, one, one, torch.float32, HOPPER)
    with pytest.raises(RuntimeError, match="divisible by 16"):
        torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.float32)
    a, b, _ = _call_operands()
    sa, sb = torch.ones(32, 1, device="meta"), torch.ones(1, 48, device="meta")
    assert "bfloat16 only" in scaled_mm_call_problem(a, b, sa, sb, torch.float32, HOPPER)  # the meta kernel misses it
    torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
    assert scaled_mm_call_problem(a, b, sa, sb, torch.bfloat16, HOPPER) is None
    assert scaled_mm_call_problem(a, b, sa, sb, torch.float32, GemmTarget("cpu")) is None  # CPU writes fp32 row-wise
    assert "(32, 1) and (1, 48)" in scaled_mm_call_problem(a, b, torch.ones(32, 2, device="meta"), sb,
                                                            torch.bfloat16, HOPPER)
    assert "compute capability" in scaled_mm_call_problem(a, b, one, one, torch.float32, GemmTarget("cuda", (8, 0)))


def test_gemm_path_names_why_a_gemm_is_emulated():
    f8 = lambda *shape: torch.empty(*shape, dtype=torch.float8_e4m3fn, device="meta")  # noqa: E731
    assert gemm_path(f8(32, 64), f8(64, 48), torch.float32, HOPPER).path == "scaled_mm_tensorwise"
    choice = gemm_path(f8(32, 24), f8(24, 48), torch.float32, HOPPER)
    assert choice.path == "emulated" and not choice.hardware and "multiples of 16" in choice.reason
    choice = gemm_path(f8(32, 64), f8(64, 48), torch.float32, GemmTarget("cuda", (8, 0), triton=True))
    assert choice.path == "emulated" and "compute capability" in choice.reason
    blocks = dict(a_block=TILE, b_block=BLOCK)
    assert gemm_path(f8(32, 256), f8(256, 128), torch.float32, HOPPER, **blocks).path == "triton_block"
    choice = gemm_path(f8(32, 192), f8(192, 128), torch.float32, HOPPER, **blocks)
    assert choice.path == "emulated" and "multiple of 128" in choice.reason
    choice = gemm_path(f8(32, 256), f8(256, 128), torch.float32, GemmTarget("cuda", (9, 0)), **blocks)
    assert choice.path == "emulated" and "pip install triton" in choice.reason
    rows = dict(a_block=ROWWISE, b_block=COLWISE)
    assert gemm_path(f8(32, 64), f8(64, 48), torch.bfloat16, HOPPER, **rows).path == "scaled_mm_rowwise"
    choice = gemm_path(f8(32, 64), f8(64, 48), torch.float32, HOPPER, **rows)
    assert choice.path == "scaled_mm_rowwise_epilogue" and "bfloat16 only" in choice.reason
    assert gemm_path(f8(32, 64), f8(64, 48), torch.float32, GemmTarget("cpu"), "scaled_mm", **rows).path == \
        "scaled_mm_rowwise"  # the CPU writes fp32 row-wise itself
    assert gemm_path(f8(32, 64), f8(64, 48), torch.float32, GemmTarget("cpu"), **rows).path == "emulated"  # auto
    with pytest.raises(ValueError, match="backend='scaled_mm'.*multiples of 16"):
        fp8_mm_payload(f8(32, 24), torch.ones(()), f8(24, 48), torch.ones(()), backend="scaled_mm", target=HOPPER)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_rowwise_epilogue_equals_the_emulation_and_float64(gen, out_dtype):
    """The row-wise choice for outputs CUDA's row-wise kernel cannot write, run on CPU tensors (CPU tensor-wise
    ``_scaled_mm`` + the fp32 scale epilogue): the emulation's bits (power-of-two scales: scaling commutes with
    every fp32 rounding), and within the fp32 summation bound of float64: (K - 1) * 2**-24 * |A| @ |B| (Higham
    3.1, with 1% for gamma's denominator) plus half an ulp of ``out_dtype`` (normal or subnormal), 8 seeds each."""
    m, k, n = 48, 256, 80
    for _ in range(8):
        # Rows spread over 2**-8..2**2 (a per-row scale each), inside float16's range after a K = 256 sum.
        a = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-8, 3, (m, 1), generator=gen).float())
        w = torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-8, 1, (n, 1), generator=gen).float())
        qa, sa = quantize_to_blocks(a, ROWWISE, "e4m3")
        qw, sw = quantize_to_blocks(w, ROWWISE, "e4m3")
        args = (qa, sa, qw.t(), sw.t(), out_dtype)
        hw = fp8_mm_payload(*args, "scaled_mm", ROWWISE, COLWISE, target=HOPPER)
        assert gemm_path(qa, qw.t(), out_dtype, HOPPER, "scaled_mm", ROWWISE, COLWISE).path == \
            "scaled_mm_rowwise_epilogue"
        emulated = fp8_mm_payload(*args, "emulated", ROWWISE, COLWISE)
        assert hw.dtype == out_dtype and torch.equal(hw, emulated)
        da, dw = dequantize_blocks(qa, sa, ROWWISE, torch.float64), dequantize_blocks(qw, sw, ROWWISE, torch.float64)
        exact, magnitude = da @ dw.t(), da.abs() @ dw.abs().t()
        info = torch.finfo(out_dtype)
        half_ulp = 0.5 * info.eps * exact.abs() + 0.5 * info.smallest_normal * info.eps  # normal, subnormal
        bound = 1.01 * (k - 1) * 2.0**-24 * magnitude * (1 + info.eps) + half_ulp
        assert ((hw.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_training_step_with_the_gpu_paths_matches_the_emulation_bit_for_bit(recipe, monkeypatch):
    """The FP8 linear's GEMMs decided for a compute capability 9.0 GPU and run on CPU tensors (the rowwise
    recipe's fp32 GEMMs take the epilogue path) give the emulated step's bits: loss, gradients, weights."""
    results = []
    for simulate in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 48))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        backend = "scaled_mm" if simulate else "emulated"
        model, optimizer = fp8.initialize(model, optimizer, "O2",
                                          config=Float8LinearConfig(recipe=recipe, gemm_backend=backend))
        if simulate:
            monkeypatch.setattr(fp8.linear, "mm", functools.partial(mm, target=HOPPER))
        x = torch.randn(2, 16, 64, requires_grad=True)
        loss = model(x).pow(2).mean()
        loss.backward()
        grads = [x.grad] + [p.grad.clone() for p in model.parameters()]
        optimizer.step()
        monkeypatch.undo()
        weights = [m.weight.dequantize() for m in model if isinstance(m, fp8.Float8Linear)]
        results.append((loss.detach(), grads, weights))
    for got, want in zip(results[1], results[0]):
        got, want = (got, want) if isinstance(got, list) else ([got], [want])
        assert all(torch.equal(g, w) for g, w in zip(got, want))


MOE_SIZES = [5, 37, 0, 22]  # tokens routed to each expert: none a multiple of 16 (one expert gets none)


def _moe_step(recipe, grouped, monkeypatch):
    """One forward and backward of four FP8 experts on tokens routed unevenly (:data:`MOE_SIZES`): one
    :class:`fp8.Float8Linear` per expert on its own tokens (the per-expert path, megatron-core's SequentialMLP), or all
    of them in one grouped linear (``fp8.grouped_gemm``: Megatron's ``--moe-grouped-gemm``, transformers' experts).
    Returns the recorded :class:`GemmCall` list (CPU ``auto``: emulated here, audited for the GPU)."""
    from fp8.grouped_gemm import GroupedBlockLinearFunction, GroupedLinearFunction
    from fp8.linear import group_bounds

    k, n = (256, 384) if recipe == "blockwise" else (64, 96)  # multiples of every recipe's K block
    torch.manual_seed(0)
    config = Float8LinearConfig(recipe=recipe)
    experts = [fp8.Float8Linear.from_linear(nn.Linear(k, n, bias=False), config) for _ in MOE_SIZES]
    calls: list[GemmCall] = []
    phase = ["fwd"]

    record = _recording_mm(calls, phase)
    monkeypatch.setattr(fp8.linear, "mm", record)
    monkeypatch.setattr(fp8.grouped_gemm, "mm", record)  # the grouped forward GEMM where no grouped kernel runs
    x = torch.randn(sum(MOE_SIZES), k, requires_grad=True)
    if grouped and recipe == "tensorwise":
        offsets = torch.tensor([e for _, e in group_bounds(MOE_SIZES)], dtype=torch.int32)
        y = GroupedLinearFunction.apply(x, offsets, MOE_SIZES, experts[0].input_scaling,
                                        experts[0].grad_output_scaling, config, True, torch.float32,
                                        *(e.weight for e in experts))
    elif grouped:
        y = GroupedBlockLinearFunction.apply(x, MOE_SIZES, config, torch.float32, *(e.weight for e in experts))
    else:
        y = torch.cat([expert(x[s:e]) for expert, (s, e) in zip(experts, group_bounds(MOE_SIZES)) if e > s])
    assert y.shape == (sum(MOE_SIZES), n)  # no padding row in the output
    phase[0] = "bwd"
    y.square().mean().backward()
    monkeypatch.undo()
    assert all(e.weight.grad is not None for e, size in zip(experts, MOE_SIZES) if size or grouped)
    return calls, k, n


@pytest.mark.parametrize("grouped", [False, True], ids=["per-expert", "grouped"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_moe_expert_gemms_run_on_hardware_with_routed_tokens_padded(recipe, grouped, monkeypatch):
    """The MoE dispatch audit: every expert GEMM (forward, input gradient, weight gradient) of both expert paths takes
    a hardware path on a compute capability 9.0 GPU, whatever the tokens routed to each expert: the weight-gradient
    GEMM's K (the expert's tokens) is padded to the GEMM's multiple (16; 128 for blockwise) with zero columns, which
    add nothing, instead of falling back to the emulation. Each ``_scaled_mm`` call replays on ``meta`` tensors."""
    calls, k, n = _moe_step(recipe, grouped, monkeypatch)
    routed = [s for s in MOE_SIZES if s]
    multiple = {"blockwise": 128, "mxfp8": 32, "nvfp4": 32}.get(recipe, 16)
    target = TARGETS.get(recipe, HOPPER)
    assert len(calls) == 3 * len(routed)  # forward, input gradient, weight gradient per expert that got tokens
    wgrad_k = sorted(logical_shape(c.a)[1] for c in calls if c.phase == "bwd" and c.a.shape[0] == n)
    assert wgrad_k == sorted(-(-s // multiple) * multiple for s in routed), wgrad_k
    for call in calls:
        choice = gemm_path(call.a, call.b, call.out_dtype, target, call.backend, call.a_block, call.b_block)
        assert choice.path != "emulated", (recipe, grouped, call.phase, tuple(call.a.shape), tuple(call.b.shape),
                                           choice.reason)
        if choice.path.startswith("scaled_mm"):
            with _AtenRecorder() as aten:
                mm(Operand(call.a, call.a_scale, call.a_block, global_scale_inv=call.a_global),
                   Operand(call.b, call.b_scale, call.b_block, global_scale_inv=call.b_global),
                   call.out_dtype, call.backend, target=target)
            assert len(aten.scaled_mm) == 1
