"""One FP8 linear recipe: fp8.Float8Linear and the FP8 column/row parallel linears run the same autograd
function (fp8.linear.Float8LinearFunction; the parallel layers only add their collectives through
LinearHooks), with the same forward and gradients against float64 references (one rank; the multi-rank
layers are exercised by tests/training/test_megatron_parallel.py)."""

from __future__ import annotations

import ast
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import fp8
from fp8.linear import Float8LinearFunction
from fp8.parallel import ColumnParallelLinear, FP8ColumnParallelLinear, FP8RowParallelLinear, RowParallelLinear
from fp8.scaling import amax_of, compute_scale
from tests.fp8_bounds import product_error_bound, quantization_error_bound

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class _Config:
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    perform_initialization: bool = True


def _layer(kind: str, master: torch.Tensor, config: fp8.Float8LinearConfig | None):
    """A linear of ``kind`` whose weight is ``master`` (FP8 when ``config`` is set), and its forward."""
    out_features, in_features = master.shape
    if kind == "linear":
        linear = torch.nn.Linear(in_features, out_features, bias=False)
        with torch.no_grad():
            linear.weight.copy_(master)
        layer = fp8.Float8Linear.from_linear(linear, config)
        return layer, layer
    cls = {("column", True): FP8ColumnParallelLinear, ("row", True): FP8RowParallelLinear,
           ("column", False): ColumnParallelLinear, ("row", False): RowParallelLinear}[kind, config is not None]
    extra = {"fp8": config} if config is not None else {}
    with warnings.catch_warnings():  # copying ``master`` is "not a normal initialiser" (a warning, once)
        warnings.simplefilter("ignore", UserWarning)
        layer = cls(in_features, out_features, config=_Config(), init_method=lambda w: w.copy_(master), bias=False,
                    skip_bias_add=True, **extra)
    return layer, lambda x: layer(x)[0]


@pytest.mark.parametrize("kind", ["linear", "column", "row"])
def test_every_fp8_linear_runs_the_one_autograd_function(kind, gen):
    master = torch.randn(32, 48, generator=gen) * 0.1
    _, forward = _layer(kind, master, fp8.Float8LinearConfig())
    out = forward(torch.randn(16, 48, generator=gen, requires_grad=True))
    assert out.grad_fn._forward_cls is Float8LinearFunction
    if kind != "linear":  # the high-precision baseline keeps its own path
        _, forward = _layer(kind, master, None)
        out = forward(torch.randn(16, 48, generator=gen, requires_grad=True))
        assert out.grad_fn._forward_cls is not Float8LinearFunction


def test_parallel_linears_do_not_reimplement_the_recipe():
    """fp8/parallel/linear.py holds no FP8 cast or GEMM of its own: only fp8.linear's function and hooks."""
    tree = ast.parse((ROOT / "fp8" / "parallel" / "linear.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"cast", "gemm", "tensor"}, imported
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert "Float8LinearFunction" in names and not names & {"fp8_mm", "fp8_mm_payload", "quantize", "weight_grad"}


@pytest.mark.parametrize("mode", ["fp32", "fp8"])
def test_same_forward_and_gradients_against_float64(mode, gen):
    """Float8Linear, column and row (one rank): identical bits, each within the analytic FP8 bound of the
    float64 product (E4M3 input and weight, E5M2 output gradient, fp32 accumulation; an E4M3 weight gradient
    adds its own rounding)."""
    master = torch.randn(48, 64, generator=gen) * 0.2
    x = torch.randn(8, 4, 64, generator=gen) * 3
    g = torch.randn(8, 4, 48, generator=gen) * 1e-3
    config = fp8.Float8LinearConfig(grad_accumulation=mode)
    x64, w64, g64 = x.reshape(-1, 64).double(), master.double(), g.reshape(-1, 48).double()
    ex = quantization_error_bound(x, compute_scale(amax_of(x), "e4m3"), "e4m3").reshape(-1, 64)
    eg = quantization_error_bound(g, compute_scale(amax_of(g), "e5m2"), "e5m2").reshape(-1, 48)
    slack = 1 + 1e-5  # fp32 accumulation over K <= 64 (2**-24 * 64 = 4e-6, 2x headroom)
    results = {}
    for kind in ("linear", "column", "row"):
        layer, forward = _layer(kind, master, config)
        ew = quantization_error_bound(master, layer.weight.scale, "e4m3")
        xin = x.clone().requires_grad_(True)
        out = forward(xin)
        out.backward(g)
        grad_w = layer.weight.grad
        assert isinstance(grad_w, fp8.Float8Tensor) == (mode == "fp8")
        grad_w64 = grad_w.dequantize(torch.float64) if mode == "fp8" else grad_w.double()

        bound = product_error_bound(x64, ex, w64.t(), ew.t()) * slack + 1e-6
        assert torch.all((out.reshape(-1, 48).double() - x64 @ w64.t()).abs() <= bound), kind
        bound = product_error_bound(g64, eg, w64, ew) * slack + 1e-12
        assert torch.all((xin.grad.reshape(-1, 64).double() - g64 @ w64).abs() <= bound), kind
        exact_dw = g64.t() @ x64
        prod = product_error_bound(g64.t(), eg.t(), x64, ex) * slack
        if mode == "fp8":
            bound = prod + quantization_error_bound(exact_dw.abs() + prod, grad_w.scale, "e4m3")
        else:
            bound = prod + 1e-12
        assert torch.all((grad_w64 - exact_dw).abs() <= bound), kind
        results[kind] = (out, xin.grad, grad_w64)
    for kind in ("column", "row"):
        for a, b in zip(results[kind], results["linear"]):
            assert torch.equal(a, b), kind
