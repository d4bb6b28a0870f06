"""The FP8 weight's transpose for the input-gradient GEMM ``dX = dY @ W``, made once per optimizer step (issue 22).

``torch._scaled_mm`` takes its second operand column-major; the weight payload is ``(out, in)`` row-major, so
without a cache every backward (every micro-batch) copied it transposed. The copy is now kept with the weight
(:attr:`fp8.Float8Tensor.transpose_cache`), made at its first use, rewritten in place for all weights at the end of
every FP8 optimizer step by one multi-tensor kernel (:func:`fp8.quantizers.refresh_weight_operands`), rebuilt at the
next use after any other write (``load_state_dict``, any in-place op), and counted by ``fp8.memory_report`` as
``"weight transposes"``.

These run the hardware path on the CPU (``gemm_backend="scaled_mm"``; CPU ``_scaled_mm`` is a slow reference loop,
hence the small layers), count the transposed copies of the weight made under a dispatch mode, and compare every
result bit for bit with the uncached path (``fp8.quantizers.cached_operand`` replaced by one that always builds).
A tensor-wise weight keeps its transpose (column-major: the operand itself) with its ``scale_inv``
(:func:`fp8.ops.transpose_fp8` makes both in one kernel).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import fp8
import fp8.quantizers
from fp8.launches import LaunchCounter
from fp8.linear import Float8Linear, Float8LinearConfig
from fp8.optim.fused_adam import mark_fp8_weights_written

IN, HIDDEN, OUT, TOKENS = 32, 48, 16, 64  # all distinct, so a transposed weight copy is told apart by its shape
SCALED_MM = Float8LinearConfig(gemm_backend="scaled_mm")
E4M3 = torch.float8_e4m3fn


class _CountTransposes(TorchDispatchMode):
    """Counts ops writing E4M3 tensors shaped like the weights' transposes (``(in, out)``: ``W.t().contiguous()``)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.count = set(shapes), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        if not func.is_view and any(isinstance(t, torch.Tensor) and t.dtype == E4M3 and tuple(t.shape) in self.shapes for t in outs):
            self.count += 1
        return out


def _uncached(monkeypatch):
    monkeypatch.setattr(fp8.quantizers, "cached_operand", lambda weight, payload, scale, key, build: build())


def _model():
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT))


def _fp8_weights(model):
    return [m.weight for m in model.modules() if isinstance(m, Float8Linear)]


def _train(model, optimizer, batches, micro):
    """Steps of ``micro`` micro-batches each: every input gradient, the loss, the transposed copies made, and the
    cached tensors seen after each micro-batch (kept alive, so that identity comparisons cannot be fooled by a freed
    tensor's address being reused)."""
    shapes = [tuple(w.shape[::-1]) for w in _fp8_weights(model)]
    counter = _CountTransposes(shapes)
    refreshes = LaunchCounter()
    grads, ids = [], []
    for step in range(len(batches) // micro):
        for x in batches[step * micro:(step + 1) * micro]:
            x = x.clone().requires_grad_(True)
            with counter:
                model(x).square().mean().backward()
            grads.append(x.grad)
            ids.append(tuple(t for w in _fp8_weights(model) for t in _held(w)))
        with refreshes:
            optimizer.step()
        optimizer.zero_grad()
    return grads, counter.count, ids, refreshes.by_op["fp8lm.transpose_fp8_into_.default"]


def _held(weight):
    """The FP8 transpose a weight holds (its ``transpose_cache`` also holds the 0-d ``scale_inv``)."""
    return [t for t in weight.transpose_cache if t.dtype == E4M3]


def _setup(seed, level, config=SCALED_MM):
    torch.manual_seed(seed)
    model = _model()
    return fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), level, config=config)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_transpose_made_once_per_optimizer_step_and_bit_identical(level, seed, monkeypatch):
    steps, micro = 2, 3
    batches = [torch.randn(TOKENS // 4, 4, IN, generator=torch.Generator().manual_seed(seed + i))
               for i in range(steps * micro)]
    model, optimizer = _setup(seed, level)
    assert len(_fp8_weights(model)) == 2
    grads, copies, ids, refreshes = _train(model, optimizer, batches, micro)
    # One transposed copy per FP8 weight at its first use, then one multi-tensor refresh of both per optimizer step,
    # in place: never per micro-batch.
    assert copies == 2 and refreshes == steps
    for step in range(steps):
        seen = ids[step * micro:(step + 1) * micro]
        # the same tensors reused in a step
        assert len(seen[0]) == 2 and all(len(s) == 2 and all(a is b for a, b in zip(s, seen[0])) for s in seen)
    assert all(a is b for a, b in zip(ids[0], ids[micro]))  # the same buffers after the step, rewritten in place

    _uncached(monkeypatch)
    ref_model, ref_optimizer = _setup(seed, level)
    ref_grads, ref_copies, ref_ids, ref_refreshes = _train(ref_model, ref_optimizer, batches, micro)
    # Uncached, each micro-batch makes the operand twice per weight: the forward's scale_inv and the backward's
    # transpose come from the same kernel (fp8.ops.transpose_fp8), which the cache runs once per step.
    assert ref_copies == 2 * 2 * steps * micro and all(not i for i in ref_ids) and ref_refreshes == 0
    for got, want in zip(grads, ref_grads):
        assert torch.equal(got, want)
    for got, want in zip(model.state_dict().values(), ref_model.state_dict().values()):
        assert torch.equal(got.dequantize() if isinstance(got, fp8.Float8Tensor) else got,
                           want.dequantize() if isinstance(want, fp8.Float8Tensor) else want)


def _flip(payload, dim):
    return payload.view(torch.uint8).flip(dim).view(payload.dtype)


def _input_grad(model, x):
    x = x.clone().requires_grad_(True)
    model(x).square().mean().backward()
    return x.grad


def test_rebuilt_after_load_state_dict_and_in_place_writes(seed):
    torch.manual_seed(seed)
    model = Float8Linear(IN, HIDDEN, config=SCALED_MM)
    other = Float8Linear(IN, HIDDEN, config=SCALED_MM)
    x = torch.randn(TOKENS, IN)
    w = model.weight

    def fresh_grad():  # the same weight in a model that never cached anything
        ref = Float8Linear(IN, HIDDEN, config=SCALED_MM)
        ref.load_state_dict(model.state_dict())
        return _input_grad(ref, x)

    _input_grad(model, x)
    (held,) = _held(w)
    assert torch.equal(held, w.payload) and held.stride() == (1, HIDDEN)  # the payload, column-major
    _input_grad(model, x)
    assert _held(w)[0] is held

    writes = {
        "load_state_dict": lambda: model.load_state_dict(other.state_dict()),
        "copy_": lambda: w.copy_(torch.randn(HIDDEN, IN)),
        "detach().copy_": lambda: w.detach().copy_(torch.randn(HIDDEN, IN)),
        "data.copy_": lambda: w.data.copy_(torch.randn(HIDDEN, IN)),  # .data: an alias with its own version counter
        "mul_": lambda: w.mul_(-0.5),
        "row": lambda: w.detach()[3].copy_(torch.zeros(IN)),
        "payload.copy_": lambda: w.payload.copy_(_flip(w.payload, 0)),
        "payload view (O3 all-gather)": lambda: w.payload.detach().view(-1).copy_(_flip(w.payload, 1).reshape(-1)),
        # a kernel writing through the address (the fused Adam): autograd sees nothing until told
        "Triton Adam": lambda: (w.payload.data.copy_(_flip(w.payload, 0)), mark_fp8_weights_written([w])),
    }
    for name, write in writes.items():
        with torch.no_grad():
            write()
        got = _input_grad(model, x)
        assert _held(w)[0] is not held, name
        held = _held(w)[0]
        assert torch.equal(held, w.payload), name
        assert torch.equal(got, fresh_grad()), name


def test_memory_report_counts_exactly_the_held_bytes(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(Float8Linear(IN, HIDDEN, config=SCALED_MM), Float8Linear(HIDDEN, OUT, config=SCALED_MM))
    before = fp8.memory_report(model)
    assert "weight transposes" not in before
    _input_grad(model, torch.randn(TOKENS, IN))
    after = fp8.memory_report(model)
    held = sum(t.untyped_storage().nbytes() for w in _fp8_weights(model) for t in w.transpose_cache)
    # 1 byte per weight element, and a 4-byte scale_inv per weight
    assert after["weight transposes"] == held == IN * HIDDEN + HIDDEN * OUT + 2 * 4
    without = {k: v for k, v in after.items() if k not in ("weight transposes", "total")}
    assert after["total"] == sum(without.values()) + held


def test_emulated_gemm_holds_nothing(seed):
    """The CPU default (``gemm_backend="auto"``: the emulated GEMM) dequantizes the weight as is: no copy held, the
    memory figures unchanged."""
    torch.manual_seed(seed)
    model = nn.Sequential(Float8Linear(IN, HIDDEN), Float8Linear(HIDDEN, OUT, config=Float8LinearConfig(
        gemm_backend="emulated")))
    before = fp8.memory_report(model)
    _input_grad(model, torch.randn(TOKENS, IN))
    assert all(w.transpose_cache == () for w in _fp8_weights(model))
    after = fp8.memory_report(model)
    assert "weight transposes" not in after
    assert after["weights"] == before["weights"]


def test_rowwise_caches_the_requantized_weight(seed, monkeypatch):
    """Rowwise: ``dX = dY @ W`` takes W re-quantized per input channel; that operand (column-major, with its scale
    grid) is the one cached, bit-identical to re-quantizing every backward."""
    config = Float8LinearConfig(gemm_backend="scaled_mm", recipe="rowwise")
    torch.manual_seed(seed)
    model = Float8Linear(IN, HIDDEN, config=config)
    x = torch.randn(TOKENS, IN)
    got = [_input_grad(model, x) for _ in range(2)]
    forward_scales, data, scales = model.weight.transpose_cache  # the forward GEMM's (1, out) scale_inv too
    assert data.shape == (HIDDEN, IN) and data.stride() == (1, HIDDEN) and scales.numel() == IN
    assert forward_scales.shape == (1, HIDDEN)
    assert fp8.memory_report(model)["weight transposes"] == HIDDEN * IN + 4 * IN + 4 * HIDDEN
    _uncached(monkeypatch)
    ref = Float8Linear(IN, HIDDEN, config=config)
    ref.load_state_dict(model.state_dict())
    assert ref.weight.transpose_cache == ()
    for g in got:
        assert torch.equal(g, _input_grad(ref, x))


def test_copies_and_checkpoints_leave_the_cache_behind(seed):
    torch.manual_seed(seed)
    model = Float8Linear(IN, HIDDEN, config=SCALED_MM)
    _input_grad(model, torch.randn(TOKENS, IN))
    assert model.weight.transpose_cache
    assert copy.deepcopy(model).weight.transpose_cache == ()
    assert model.weight.transpose_cache  # the original keeps its own
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.weight.transpose_cache == () and torch.equal(loaded.weight.payload, model.weight.payload)


def test_rebuilt_after_a_compiled_optimizer_step(seed):
    """A ``torch.compile``d optimizer step writes the FP8 weight through AOT autograd, which bumps the version of the
    weight (not of its payload): the cache, guarded by both, is rebuilt after it."""
    torch._dynamo.reset()
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(IN, HIDDEN))
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2", config=SCALED_MM)
    step = torch.compile(optimizer.step, fullgraph=True)
    w, x = model[0].weight, torch.randn(TOKENS, IN)
    seen = []
    for _ in range(2):
        _input_grad(model, x)
        (held,) = _held(w)
        assert torch.equal(held, w.payload)
        seen.append(held)
        step()
        optimizer.zero_grad()
    assert seen[0] is not seen[1]
    got = _input_grad(model, x)
    assert torch.equal(_held(w)[0], w.payload)
    ref = Float8Linear(IN, HIDDEN, config=SCALED_MM)
    ref.load_state_dict(model[0].state_dict())
    assert torch.equal(got, _input_grad(ref, x))
