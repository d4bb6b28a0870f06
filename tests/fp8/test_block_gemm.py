"""The block-scaled FP8 GEMM (:mod:`fp8.kernels.triton_block_gemm`): the Triton kernel against its torch
reference (CPU under TRITON_INTERPRET=1; CUDA in the ``gpu`` test), the reference against float64, the
emulated ``fp8_mm_payload`` against the reference, and the messages of ``block_mm_problem``.

Bounds. A product of two FP8 values is exact in fp32 (at most 4 x 4 significant bits, exponents well
inside fp32's range), and with power-of-two scales so is its scaling. What remains is fp32 summation:
with u = 2**-24, a sum of n terms in any order is within gamma_{n-1} * sum|terms|, gamma_n = n u / (1 - n u)
<= 1.01 n u (Higham, Accuracy and Stability, 3.1). The kernel and the reference sum each 128-wide K block
(127 additions, order free inside ``tl.dot``) and then the K/128 blocks (same order in both), so each is within
1.01 * (127 + K/128) * u * S of the exact product, S = |A| @ |B| of the dequantized operands; two of them
differ by at most twice that. ``torch.mm`` over all of K (the emulation) is within 1.01 * (K - 1) * u * S.
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (lazily, by the kernels)

import pytest
import torch

from fp8.blocks import BLOCK, TILE, TILE_T, dequantize_blocks, quantize_to_blocks
from fp8.gemm import fp8_mm_payload
from fp8.kernels.triton_block_gemm import block_mm, block_mm_problem, block_mm_reference

U = 2.0**-24


def _needs_triton():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernel tests run under TRITON_INTERPRET=1")


def _operands(gen, m, k, n, b_block, fa="e4m3", fb="e4m3"):
    """Block-quantized ``a`` (M x K, 1x128 tiles) and ``b`` (K x N, column-major), values spread over
    2**-6..2**6 per row and column so that the block scales differ."""
    x = torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-6, 7, (m, 1), generator=gen).float())
    w = torch.randn(k, n, generator=gen) * torch.exp2(torch.randint(-6, 7, (1, n), generator=gen).float())
    a, sa = quantize_to_blocks(x, TILE, fa)
    b, sb = quantize_to_blocks(w, b_block, fb)
    return a, sa, b.t().contiguous().t(), sb


def _magnitude(a, sa, b, sb, b_block) -> torch.Tensor:
    """S = |A| @ |B| of the dequantized operands (float64)."""
    da = dequantize_blocks(a, sa, TILE).to(torch.float64)
    db = dequantize_blocks(b, sb, b_block).to(torch.float64)
    return da.abs() @ db.abs()


def _sum_bound(magnitude: torch.Tensor, additions: int) -> torch.Tensor:
    """gamma bound of ``additions`` fp32 roundings (module docstring), plus the smallest normal for zeros."""
    return 1.01 * additions * U * magnitude + 2.0**-126


@pytest.mark.parametrize("shape", [(32, 256, 256), (33, 256, 200)])  # partial row and column tiles
@pytest.mark.parametrize("b_block", [BLOCK, TILE_T])
@pytest.mark.parametrize("fmts", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2")])
def test_kernel_matches_the_reference(gen, shape, b_block, fmts):
    _needs_triton()
    m, k, n = shape
    a, sa, b, sb = _operands(gen, m, k, n, b_block, *fmts)
    wide = torch.zeros(m, k + 128, dtype=a.dtype)
    wide[:, :k] = a  # a strided view (row stride K + 128), b column-major: strides reach the kernel
    a_view = wide[:, :k]
    out = block_mm(a_view, sa, TILE, b, sb, b_block, torch.float32)
    ref = block_mm_reference(a, sa, TILE, b.contiguous(), sb, b_block, torch.float32)
    bound = _sum_bound(_magnitude(a, sa, b, sb, b_block), 2 * (127 + k // 128))
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert ((out.double() - ref.double()).abs() <= bound).all()
    bf16 = block_mm(a_view, sa, TILE, b, sb, b_block, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, out.to(torch.bfloat16))


@pytest.mark.parametrize("b_block", [BLOCK, TILE_T])
@pytest.mark.parametrize("fa", ["e4m3", "e5m2"])
def test_reference_matches_float64(gen, b_block, fa):
    m, k, n = 48, 384, 160
    a, sa, b, sb = _operands(gen, m, k, n, b_block, fa)
    ref = block_mm_reference(a, sa, TILE, b, sb, b_block).to(torch.float64)
    exact = dequantize_blocks(a, sa, TILE).double() @ dequantize_blocks(b, sb, b_block).double()
    assert ((ref - exact).abs() <= _sum_bound(_magnitude(a, sa, b, sb, b_block), 127 + k // 128)).all()


def test_emulated_fp8_mm_payload_matches_the_reference(gen):
    m, k, n = 32, 512, 256
    a, sa, b, sb = _operands(gen, m, k, n, BLOCK)
    emulated = fp8_mm_payload(a, sa, b, sb, torch.float32, a_block=TILE, b_block=BLOCK)  # CPU: the emulation
    ref = block_mm_reference(a, sa, TILE, b, sb, BLOCK)
    bound = _sum_bound(_magnitude(a, sa, b, sb, BLOCK), (k - 1) + (127 + k // 128))
    assert ((emulated.double() - ref.double()).abs() <= bound).all()


def test_problems_name_the_fix(gen):
    a, sa, b, sb = _operands(gen, 16, 256, 128, BLOCK)
    if os.environ.get("TRITON_INTERPRET") == "1":  # CPU tensors are the interpreter's
        problem = block_mm_problem(a, TILE, b, BLOCK)
        assert problem is None if importlib.util.find_spec("triton") else "pip install triton" in problem
    assert "multiple of 128" in block_mm_problem(a[:, :200], TILE, b[:200], BLOCK)
    assert "(1, 128)" in block_mm_problem(a, BLOCK, b, BLOCK)
    assert "(128, 128) or (128, 1)" in block_mm_problem(a, TILE, b, TILE)
    e5 = a.to(torch.float32).to(torch.float8_e5m2)
    assert "E4M3" in block_mm_problem(e5, TILE, b.to(torch.float32).to(torch.float8_e5m2), BLOCK)
    assert "FP8" in block_mm_problem(a.float(), TILE, b, BLOCK)
    with pytest.raises(ValueError, match="multiple of 128"):
        block_mm_reference(a[:, :200], sa[:, :2], TILE, b[:200], sb[:2], BLOCK)


def test_block_mm_rejects_what_it_cannot_take(gen):
    _needs_triton()
    a, sa, b, sb = _operands(gen, 16, 256, 128, BLOCK)
    with pytest.raises(ValueError, match="b's block"):
        block_mm(a, sa, TILE, b, sb, (128, 64), torch.float32)
    with pytest.raises(ValueError, match="a_scale must be"):
        block_mm(a, sa[:, :1], TILE, b, sb, BLOCK, torch.float32)
    with pytest.raises(ValueError, match="b_scale must be"):
        block_mm(a, sa, TILE, b, sb, TILE_T, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("b_block", [BLOCK, TILE_T])
def test_kernel_matches_the_reference_on_cuda(gen, b_block):
    """M=256, K=1024, N=512 on CUDA. Inside each 128-wide block Hopper's FP8 MMA keeps ~14 mantissa bits
    before the fp32 promotion (DeepSeek-V3 report, sec. 3.3.2): ~2**-13 relative to the block's magnitude;
    bound 2**-11 of S (as tests/e2e/test_gpu.py), plus the fp32 bound of the reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"FP8 tl.dot needs compute capability >= 8.9, this GPU is {torch.cuda.get_device_capability()}")
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set (this module sets it by default): run "
                    "`TRITON_INTERPRET=0 python -m pytest -m gpu tests/fp8/test_block_gemm.py`")
    m, k, n = 256, 1024, 512
    a, sa, b, sb = (t.cuda() for t in _operands(gen, m, k, n, b_block))
    out = block_mm(a, sa, TILE, b, sb, b_block, torch.float32)
    ref = block_mm_reference(a, sa, TILE, b, sb, b_block, torch.float32)
    magnitude = _magnitude(a, sa, b, sb, b_block)
    assert ((out.double() - ref.double()).abs() <= 2**-11 * magnitude + _sum_bound(magnitude, 127 + k // 128)).all()
    bf16 = block_mm(a, sa, TILE, b, sb, b_block, torch.bfloat16)
    assert ((bf16.double() - ref.double()).abs() <= 2**-8 * ref.double().abs() + 2**-11 * magnitude + 1e-30).all()
