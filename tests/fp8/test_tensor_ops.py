"""Float8Tensor's explicit op table: ``mm``/``linear``/``matmul``/``@`` run the FP8 GEMM (vs float64 within
the analytic FP8 bound), an op outside the table and ``DEQUANTIZE_OPS`` raises naming itself, allow-listed ops
work; the accumulation backend is carried per tensor; the GEMM and the kernels never import fp8.tensor."""

from __future__ import annotations

import ast
import io
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import fp8
from fp8.scaling import amax_of, compute_scale
from fp8.tensor import DEQUANTIZE_OPS, OP_TABLE, Float8Tensor
from tests.fp8_bounds import product_error_bound, quantization_error_bound

ROOT = Path(__file__).resolve().parents[2]


def _bound(a64: torch.Tensor, b_plain: torch.Tensor) -> torch.Tensor:
    """|a @ FP8(b) - a @ b| for an exact (already FP8) ``a`` and a plain ``b`` cast to E4M3 with its current
    scale: the cast's element bound through the product, plus fp32 accumulation over K (2x headroom)."""
    b64 = b_plain.double()
    eb = quantization_error_bound(b64, compute_scale(amax_of(b_plain), "e4m3"), "e4m3")
    k = a64.shape[-1]
    return product_error_bound(a64, torch.zeros_like(a64), b64, eb) + 2 * k * 2.0**-24 * (a64.abs() @ (b64.abs() + eb))


def test_mm_matmul_and_linear_run_the_fp8_gemm(gen):
    w8 = fp8.to_float8(torch.randn(48, 64, generator=gen) * 0.1)  # an FP8 weight (out x in)
    x = torch.randn(32, 64, generator=gen) * 3
    w64 = w8.dequantize(torch.float64)
    x_as_fp8 = fp8.to_float8(x)  # what the handlers cast the plain operand to
    expected = fp8.fp8_mm(x_as_fp8, w8.t())
    bias = torch.randn(48, generator=gen)
    results = {
        "mm": torch.mm(x, w8.t()),
        "@": x @ w8.t(),
        "matmul": torch.matmul(x, w8.t()),
        "linear": F.linear(x, w8),
        "linear 3-D": F.linear(x.reshape(4, 8, 64), w8).reshape(32, 48),
    }
    bound = _bound(w64, x.t()).t()  # x @ W^T = (W @ x^T)^T: W exact, x cast
    for name, out in results.items():
        assert type(out) is torch.Tensor and out.dtype == torch.float32, name
        assert torch.equal(out, expected), name
        err = (out.double() - x.double() @ w64.t()).abs()
        assert (err <= bound).all(), name
    assert torch.equal(F.linear(x, w8, bias), expected + bias)  # addmm: the product, then the bias in fp32
    # The FP8 operand on the left, a plain one on the right.
    a8 = fp8.to_float8(torch.randn(32, 64, generator=gen))
    b = torch.randn(64, 48, generator=gen)
    out = a8 @ b
    assert torch.equal(out, fp8.fp8_mm(a8, fp8.to_float8(b)))
    err = (out.double() - a8.dequantize(torch.float64) @ b.double()).abs()
    assert (err <= _bound(a8.dequantize(torch.float64), b)).all()
    # It is not the high-precision product of the dequantized values (b was cast to E4M3).
    assert not torch.equal(out, a8.dequantize() @ b)


def test_addmm_beta_alpha(gen):
    w8 = fp8.to_float8(torch.randn(32, 48, generator=gen))
    x, bias = torch.randn(16, 48, generator=gen), torch.randn(32, generator=gen)
    product = fp8.fp8_mm(fp8.to_float8(x), w8.t())
    assert torch.equal(torch.addmm(bias, x, w8.t(), beta=0.5, alpha=2.0), product * 2.0 + bias * 0.5)
    assert torch.equal(torch.addmm(bias, x, w8.t(), beta=0), product)


@pytest.mark.parametrize("op", [torch.sin, torch.exp, lambda t: torch.bmm(t.unsqueeze(0), t.t().unsqueeze(0))])
def test_an_op_outside_the_table_raises_naming_it(op, gen):
    t = fp8.to_float8(torch.randn(16, 16, generator=gen))
    with pytest.raises(NotImplementedError, match=r"aten\.(sin|exp|bmm)\.default.*\.dequantize\(\) .*first"):
        op(t)
    op(t.dequantize())  # the fix the message names


def test_allow_listed_ops_work(gen, tmp_path):
    t = fp8.to_float8(torch.randn(16, 32, generator=gen) * 5)
    value = t.dequantize()
    assert torch.equal(t.float(), value) and torch.equal(t.to(torch.float64), value.double())
    assert t.to(torch.bfloat16).dtype == torch.bfloat16
    assert isinstance(t.clone(), Float8Tensor) and isinstance(t.detach(), Float8Tensor)
    assert torch.equal(t, t.clone()) and bool((t == value).all()) and not bool((t != value).any())
    assert torch.equal(t + 1.0, value + 1.0) and torch.equal(t * t, value * value) and torch.equal(t.sum(), value.sum())
    assert torch.equal(t.abs().amax(), value.abs().amax()) and bool(torch.isfinite(t).all())
    repr(t)
    buf = io.BytesIO()
    torch.save({"w": t}, buf)
    buf.seek(0)
    with torch.serialization.safe_globals(fp8.safe_globals()):
        loaded = torch.load(buf)["w"]
    assert isinstance(loaded, Float8Tensor) and torch.equal(loaded.payload.view(torch.uint8), t.payload.view(torch.uint8))
    t.mul_(2.0)  # in place: fp32, re-quantized
    assert isinstance(t, Float8Tensor) and torch.equal(t.dequantize(), value * 2)
    # The table and the allow-list are disjoint aten ops.
    assert all(isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) for op in DEQUANTIZE_OPS)
    assert not any(op in DEQUANTIZE_OPS for op in OP_TABLE)


def test_accumulate_backend_is_carried_per_tensor(gen, tmp_path):
    assert isinstance(Float8Tensor.__dict__["accumulate_backend"], property)  # no class-level switch
    a = fp8.to_float8(torch.randn(16, 16, generator=gen), accumulate_backend="torch")
    b = fp8.to_float8(torch.randn(16, 16, generator=gen))
    assert a.accumulate_backend == "torch" and b.accumulate_backend == "auto"
    for derived in (a.t(), a[2:], a.clone(), a.detach(), a.to("cpu")):
        assert derived.accumulate_backend == "torch"
    buf = io.BytesIO()
    torch.save(a, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=False).accumulate_backend == "torch"
    with pytest.raises(ValueError, match="accumulate_backend must be one of"):
        a.accumulate_backend = "cuda"
    with pytest.raises(ValueError, match="accumulate_backend must be one of"):
        fp8.Float8LinearConfig(accumulate_backend="cuda")
    config = fp8.Float8LinearConfig(grad_accumulation="fp8", accumulate_backend="torch")
    layer = fp8.Float8Linear(32, 48, config=config)
    for _ in range(2):
        layer(torch.randn(16, 32, generator=gen)).sum().backward()
    assert layer.weight.accumulate_backend == "torch" and layer.weight.grad.accumulate_backend == "torch"


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at module level or inside functions, as absolute names."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_gemm_and_kernels_do_not_import_the_tensor_class():
    """fp8.tensor imports the GEMM (its mm handlers) and the kernels (FP8 gradient accumulation); they take
    payloads and scales and import it nowhere, not even inside a function. (optimizer_update.py is moving
    out of fp8.kernels and is not checked here.)"""
    files = [ROOT / "fp8" / "gemm.py"] + [
        p for p in (ROOT / "fp8" / "kernels").glob("*.py") if p.name != "optimizer_update.py"
    ]
    for path in files:
        assert "fp8.tensor" not in _imports(path), path
    assert {"fp8.gemm.fp8_mm_payload", "fp8.kernels.grad_accumulate"} <= _imports(ROOT / "fp8" / "tensor.py")
