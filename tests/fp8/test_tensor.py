"""Float8Tensor: payload + scale behaving as a torch.Tensor (views, autograd leaves, save/load)."""

from __future__ import annotations

import copy
import io

import pytest
import torch

import fp8
from fp8 import Float8Tensor


def _fp8(gen, shape=(32, 48), fmt="e4m3"):
    return fp8.to_float8(torch.randn(shape, generator=gen) * 3, fmt)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.payload.view(torch.uint8), b.payload.view(torch.uint8)) and torch.equal(a.scale, b.scale)


def test_holds_one_byte_per_element_and_reports_high_precision(gen):
    x = torch.randn(32, 48, generator=gen)
    t = fp8.to_float8(x)
    assert isinstance(t, Float8Tensor) and t.dtype == torch.float32 and t.shape == x.shape
    assert t.payload.dtype == torch.float8_e4m3fn and t.payload.untyped_storage().nbytes() == x.numel()
    assert t.scale.dtype == torch.float32 and t.scale.dim() == 0
    assert torch.equal(t.dequantize(), fp8.dequantize(t.payload, t.scale))
    assert t.dequantize(torch.float64).dtype == torch.float64


def test_views_share_payload_and_scale(gen):
    t = _fp8(gen)
    for view in (t.detach(), t.t(), t.transpose(0, 1), t.view(16, 96), t[2:10], t[3], t.unsqueeze(0)):
        assert isinstance(view, Float8Tensor) and view.scale is t.scale
    assert torch.equal(t.t().dequantize(), t.dequantize().t())
    assert torch.equal(t[2:10].dequantize(), t.dequantize()[2:10])
    assert torch.equal(t.reshape(-1).dequantize(), t.dequantize().reshape(-1))
    clone = t.clone()
    assert _same_bits(clone, t) and clone.scale is not t.scale


def test_to_device_keeps_fp8_and_dtype_change_dequantizes(gen):
    t = _fp8(gen)
    moved = t.to("cpu", copy=True)
    assert isinstance(moved, Float8Tensor) and _same_bits(moved, t)
    as64 = t.to(torch.float64)
    assert type(as64) is torch.Tensor and torch.equal(as64, t.dequantize(torch.float64))


def test_ops_without_fp8_meaning_run_on_the_value(gen):
    t = _fp8(gen)
    y = torch.randn(32, 48, generator=gen)
    out = t + y
    assert type(out) is torch.Tensor and torch.equal(out, t.dequantize() + y)
    assert torch.equal(t.sum(), t.dequantize().sum())
    assert torch.equal(torch.nn.functional.relu(t), torch.relu(t.dequantize()))


def test_inplace_ops_requantize_with_fresh_scale(gen):
    t = _fp8(gen)
    value = t.dequantize()
    t.mul_(1000.0)  # would overflow E4M3 with the old scale
    assert isinstance(t, Float8Tensor)
    assert torch.isfinite(t.dequantize()).all()
    nonzero = value != 0  # random payloads can hold exact zeros; they must stay zero
    assert torch.equal(t.dequantize()[~nonzero], value[~nonzero] * 1000)
    rel = ((t.dequantize() - value * 1000).abs()[nonzero] / (value * 1000).abs()[nonzero]).max()
    assert rel <= fp8.E4M3.max_relative_error
    a, b = _fp8(gen), _fp8(gen)
    expected = a.dequantize(torch.float64) + b.dequantize(torch.float64)
    a.add_(b)
    assert ((a.dequantize(torch.float64) - expected).abs() <= expected.abs() * 2**-4 + 1e-6).all()


def test_foreach_inplace_reaches_fp8_members(gen):
    grads = [_fp8(gen), torch.randn(8, generator=gen), _fp8(gen)]
    before = [g.dequantize() if isinstance(g, Float8Tensor) else g.clone() for g in grads]
    torch._foreach_mul_(grads, 0.5)
    for g, b in zip(grads, before):
        value = g.dequantize() if isinstance(g, Float8Tensor) else g
        assert torch.equal(value, b * 0.5)  # halving is exact in FP8 with a power-of-two rescale


def test_copy_into_fp8(gen):
    t = _fp8(gen)
    src = _fp8(gen)
    t.copy_(src)
    assert _same_bits(t, src) and t.scale is not src.scale
    plain = torch.randn(32, 48, generator=gen) * 1e4
    t.copy_(plain)
    assert _same_bits(t, fp8.to_float8(plain))


def test_parameter_and_autograd_leaf(gen):
    p = torch.nn.Parameter(_fp8(gen))
    assert isinstance(p, torch.nn.Parameter) and isinstance(p, Float8Tensor) and p.requires_grad
    module = torch.nn.Module()
    module.weight = p
    assert dict(module.named_parameters())["weight"] is p
    deep = copy.deepcopy(module)
    assert isinstance(deep.weight, Float8Tensor) and _same_bits(deep.weight, p) and deep.weight is not p


@pytest.mark.parametrize("weights_only", [True, False])
def test_torch_save_load_round_trip(gen, weights_only):
    state = {"w": _fp8(gen), "g": _fp8(gen, fmt="e5m2"), "plain": torch.randn(3, generator=gen)}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    with torch.serialization.safe_globals(fp8.safe_globals()):
        loaded = torch.load(buffer, weights_only=weights_only)
    assert _same_bits(loaded["w"], state["w"]) and _same_bits(loaded["g"], state["g"])
    assert loaded["g"].format is fp8.E5M2 and torch.equal(loaded["plain"], state["plain"])


def test_constructor_validation(gen):
    with pytest.raises(ValueError, match="float8"):
        Float8Tensor(torch.randn(4), torch.tensor(1.0))
    with pytest.raises(ValueError, match="tensor-wise Float8Tensor takes one scale.*block="):
        Float8Tensor(torch.randn(4).to(torch.float8_e4m3fn), torch.ones(2))
    with pytest.raises(ValueError, match="scale grid of shape grid_shape"):
        Float8Tensor(torch.randn(4, 256).to(torch.float8_e4m3fn), torch.ones(4, 1), block=(1, 128))
    with pytest.raises(TypeError, match="floating-point"):
        fp8.to_float8(torch.arange(4))


def test_inplace_write_to_a_partial_view_keeps_the_rest_intact(gen):
    t = fp8.to_float8(torch.tensor([[1.0, 100.0], [2.0, 3.0]]))
    before = t.dequantize()
    t[0, 0:1].mul_(1.0)  # a slice shares the scale of the whole tensor: no re-scaling
    assert torch.equal(t.dequantize(), before)
    t[1].copy_(torch.tensor([0.5, 0.25]))
    assert torch.equal(t.dequantize()[0], before[0])
    assert torch.equal(t.dequantize()[1], torch.tensor([0.5, 0.25]))
    chunks = t.split(1)
    assert all(isinstance(c, Float8Tensor) and c.scale is t.scale for c in chunks)


def test_inplace_add_is_the_fp8_grad_accumulation(gen, monkeypatch):
    """``acc += new`` (autograd's gradient accumulation) runs :func:`fp8.kernels.accumulate_fp8_grad`:
    the fp32 sum re-quantized with the power-of-two scale of the sum. Checked against a float64 sum:
    every element within half an E4M3 step of its value (2**-4 relative for normal values, half a
    subnormal step below), and against the generic in-place path bit for bit."""
    import fp8.kernels.grad_accumulate as grad_accumulate

    calls = []
    original = grad_accumulate.accumulate_fp8_grad
    monkeypatch.setattr(grad_accumulate, "accumulate_fp8_grad", lambda *a, **k: calls.append(1) or original(*a, **k))
    for addend_kind in ("fp32", "fp8", "bf16"):
        acc = fp8.to_float8(torch.randn(33, 47, generator=gen))
        new = torch.randn(33, 47, generator=gen) * 300.0  # the sum needs a smaller scale than acc had
        addend = {"fp32": new, "fp8": fp8.to_float8(new), "bf16": new.to(torch.bfloat16)}[addend_kind]
        total64 = acc.dequantize().double() + (addend.dequantize() if isinstance(addend, Float8Tensor) else addend).double()
        total32 = acc.dequantize() + (addend.dequantize() if isinstance(addend, Float8Tensor) else addend.float())
        expected_scale = fp8.compute_scale(total32.abs().amax(), "e4m3")
        twin = fp8.Float8Tensor(acc.payload.clone(), acc.scale.clone())
        before = len(calls)
        acc += addend
        assert len(calls) == before + 1 and isinstance(acc, Float8Tensor)
        assert torch.equal(acc.scale, expected_scale)
        assert torch.equal(acc.payload.view(torch.uint8), fp8.quantize(total32, expected_scale, "e4m3").view(torch.uint8))
        twin.add_(addend, alpha=1.0)  # alpha 1 is a plain add
        assert len(calls) == before + 2 and torch.equal(twin.payload.view(torch.uint8), acc.payload.view(torch.uint8))
        scale = acc.scale.double()
        err = (acc.dequantize().double() - total64).abs()
        bound = 2.0**-4 * total64.abs() + 2.0**-10 / scale + 1e-6 * total64.abs()  # E4M3 rounding (+ fp32 sum)
        assert (err <= bound).all(), (err - bound).max()
        assert total64.abs().max() * scale <= 448 and total64.abs().max() * scale > 224  # scale of the sum
    partial = fp8.to_float8(torch.randn(8, 8, generator=gen))
    before = len(calls)
    partial[2] += torch.ones(8)  # a partial view keeps its shared scale: the generic path
    partial.add_(torch.ones(8, 8), alpha=2.0)  # alpha != 1: the generic path
    assert len(calls) == before


def test_stable_hash_for_caching_follows_metadata_not_values(gen):
    """torch.compile's AOT autograd cache asks traceable subclasses for ``_stable_hash_for_caching``: same
    metadata gives the same hash (values never enter it), any metadata change a different one, and the
    hash is the same in another process (no Python ``hash``)."""
    import subprocess
    import sys

    a = fp8.to_float8(torch.randn(16, 32, generator=gen))
    b = fp8.to_float8(torch.randn(16, 32, generator=gen) * 1e3)
    h = a._stable_hash_for_caching()
    assert isinstance(h, str) and h == b._stable_hash_for_caching()
    others = [fp8.to_float8(torch.randn(16, 32, generator=gen), "e5m2"), fp8.to_float8(torch.randn(32, 16, generator=gen)),
              fp8.to_float8(torch.randn(16, 32, generator=gen), dtype=torch.bfloat16), a.t(),
              torch.nn.Parameter(fp8.to_float8(torch.randn(16, 32, generator=gen)))]
    assert len({h, *(o._stable_hash_for_caching() for o in others)}) == 1 + len(others)
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler

    reduced = AOTAutogradCachePickler.__new__(AOTAutogradCachePickler)._reduce_tensor_subclass(a)
    assert reduced[1] == (h,)  # torch's cache key takes it (no "does not implement" warning path)
    code = ("import torch, fp8\n"
            "print(fp8.Float8Tensor(torch.zeros(16, 32, dtype=torch.float8_e4m3fn), torch.ones(()))._stable_hash_for_caching())")
    env = {**__import__("os").environ, "PYTHONHASHSEED": "12345"}
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=root)
    assert out.returncode == 0, out.stderr
    h_zeros = fp8.Float8Tensor(torch.zeros(16, 32, dtype=torch.float8_e4m3fn), torch.ones(()))._stable_hash_for_caching()
    assert out.stdout.strip() == h_zeros == h


def test_fp8_mm_payload_is_fp8_mm_on_payloads(gen):
    """``fp8.gemm.fp8_mm_payload`` (plain payloads + scales, what the FP8 linear calls) gives ``fp8_mm``'s
    bits on every backend and the same errors."""
    from fp8.gemm import fp8_mm, fp8_mm_payload

    a = fp8.to_float8(torch.randn(32, 48, generator=gen))
    b = fp8.to_float8(torch.randn(64, 48, generator=gen), "e5m2").t()  # column-major K x N
    for backend in ("auto", "scaled_mm", "emulated"):
        expected = fp8_mm(a, b, torch.float32, backend)
        got = fp8_mm_payload(a.payload, a.scale, b.payload, b.scale, torch.float32, backend)
        assert torch.equal(expected, got), backend
    ref = (a.dequantize().double() @ b.dequantize().double())
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    odd = fp8.to_float8(torch.randn(48, 40, generator=gen))  # N = 40: not a multiple of 16
    with pytest.raises(ValueError, match="multiples of 16") as direct:
        fp8_mm(a, odd, backend="scaled_mm")
    with pytest.raises(ValueError, match="multiples of 16") as payload:
        fp8_mm_payload(a.payload, a.scale, odd.payload, odd.scale, backend="scaled_mm")
    assert str(direct.value) == str(payload.value)
    with pytest.raises(ValueError, match="backend must be one of"):
        fp8_mm_payload(a.payload, a.scale, b.payload, b.scale, backend="cuda")


def test_repr_reads_no_values():
    """repr is called by Inductor's trace logging on traced (symbolic) tensors and by debuggers on CUDA tensors:
    metadata only, no host read of the scale (a meta-device tensor has no values to read)."""
    t = fp8.Float8Tensor(torch.empty(4, 8, dtype=torch.float8_e4m3fn, device="meta"),
                         torch.empty((), device="meta"), torch.bfloat16)
    assert repr(t) == "Float8Tensor(format=e4m3, shape=(4, 8), dtype=torch.bfloat16, device=meta)"
