"""FP8 GEMM with DeepSeek-style block scales: a Triton kernel and its torch reference.

``a`` (M x K) carries one scale per ``1x128`` tile (grid ``(M, K/128)``), ``b`` (K x N) one per
``128x128`` block (grid ``(K/128, ceil(N/128))``) or per ``128x1`` column tile (grid ``(K/128, N)``);
value = payload / scale (:mod:`fp8.blocks`). Both compute, for each 128-wide K block in ascending order,
the fp32 dot of the FP8 payload tiles, multiply it by the reciprocal scales of that block and add it to
an fp32 accumulator, cast to ``out_dtype`` at the end. With power-of-two scales that product is exact, so
kernel and reference differ only in the summation order inside each block's dot.

Triton is imported inside the functions that run the kernel, never when this module is imported.
"""

from __future__ import annotations

import functools

import torch

from ..formats import E5M2
from .backend import interpreter_enabled, triton_available

__all__ = ["block_mm_problem", "block_operands_problem", "block_mm", "block_mm_inverse", "block_mm_reference"]

_K_BLOCK = 128
_A_BLOCKS = ((1, 128),)
_B_BLOCKS = ((128, 128), (128, 1))
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_OUT = (torch.float32, torch.bfloat16, torch.float16)


def block_operands_problem(a: torch.Tensor, a_block, b: torch.Tensor, b_block) -> str | None:
    """Why the block GEMM cannot take these operands and blocks (shapes, formats, blocks, layouts; the device
    aside, so it also judges ``meta`` tensors), or None."""
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return f"cannot multiply {tuple(a.shape)} by {tuple(b.shape)}: pass 2-D (M x K) and (K x N) operands"
    if a.dtype not in _FP8 or b.dtype not in _FP8:
        return f"operands must be FP8 (float8_e4m3fn or float8_e5m2), got {a.dtype} and {b.dtype}; quantize them first"
    if a.dtype == E5M2.dtype and b.dtype == E5M2.dtype:
        return "both operands are E5M2; quantize one of them (the forward operand) to E4M3"
    if a_block is None or tuple(a_block) not in _A_BLOCKS:
        return f"a's block must be (1, 128) (activation tiles), got {a_block}; requantize a with fp8.blocks.TILE"
    if b_block is None or tuple(b_block) not in _B_BLOCKS:
        return (f"b's block must be (128, 128) or (128, 1), got {b_block}; requantize b with fp8.blocks.BLOCK "
                f"or fp8.blocks.TILE_T")
    if a.shape[1] % _K_BLOCK:
        return (f"K = {a.shape[1]} is not a multiple of 128: pad K (in-features, or tokens for a weight "
                f"gradient) to a multiple of 128")
    return None


def block_mm_problem(a: torch.Tensor, a_block, b: torch.Tensor, b_block) -> str | None:
    """Why :func:`block_mm` cannot take ``a @ b`` with these blocks, or None if it can."""
    problem = block_operands_problem(a, a_block, b, b_block)
    if problem is not None:
        return problem
    if not triton_available():
        return "the block-scaled GEMM needs Triton: pip install triton (or use gemm_backend='emulated')"
    if a.device != b.device:
        return f"operands are on different devices ({a.device}, {b.device}); move them to one"
    if a.device.type == "cuda":
        if torch.cuda.get_device_capability(a.device) < (8, 9):
            return (f"FP8 tl.dot needs a CUDA GPU of compute capability >= 8.9, {a.device} is lower; "
                    f"use gemm_backend='emulated'")
    elif not (a.device.type == "cpu" and interpreter_enabled()):
        return f"the Triton kernel runs on CUDA tensors (or CPU under TRITON_INTERPRET=1), got {a.device}"
    return None


def _scale_problem(a, a_scale, b, b_scale, b_block, out_dtype) -> str | None:
    (m, k), n = a.shape, b.shape[1]
    b_grid = (k // _K_BLOCK, -(-n // b_block[1]))
    if tuple(a_scale.shape) != (m, k // _K_BLOCK):
        return f"a_scale must be the (M, K/128) = {(m, k // _K_BLOCK)} grid of a's tiles, got {tuple(a_scale.shape)}"
    if tuple(b_scale.shape) != b_grid:
        return f"b_scale must be the {b_grid} grid of b's {tuple(b_block)} blocks, got {tuple(b_scale.shape)}"
    if out_dtype not in _OUT:
        return f"out_dtype must be one of {_OUT}, got {out_dtype}"
    return None


def _check(operand_problem, a, a_scale, a_block, b, b_scale, b_block, out_dtype) -> None:
    problem = operand_problem(a, a_block, b, b_block) or _scale_problem(a, a_scale, b, b_scale, b_block, out_dtype)
    if problem is not None:
        raise ValueError(problem)


def block_mm_reference(a, a_scale, a_block, b, b_scale, b_block, out_dtype=torch.float32) -> torch.Tensor:
    """Torch reference of :func:`block_mm` (fp32, the kernel's accumulation order; any device, no Triton)."""
    _check(block_operands_problem, a, a_scale, a_block, b, b_scale, b_block, out_dtype)
    n = b.shape[1]
    a_inv = a_scale.to(torch.float32).reciprocal()
    b_inv = b_scale.to(torch.float32).reciprocal().repeat_interleave(b_block[1], dim=1)[:, :n]
    acc = torch.zeros(a.shape[0], n, dtype=torch.float32, device=a.device)
    for kb in range(a.shape[1] // _K_BLOCK):
        ks = slice(kb * _K_BLOCK, (kb + 1) * _K_BLOCK)
        dot = a[:, ks].to(torch.float32) @ b[ks, :].to(torch.float32)
        acc = acc + dot * (a_inv[:, kb, None] * b_inv[None, kb, :])
    return acc.to(out_dtype)


@functools.cache
def _kernel():
    """The Triton kernel, defined on first use (importing this module does not import Triton). It calls no
    other ``@triton.jit`` function: the interpreter runs a nested kernel without its closure."""
    import triton
    import triton.language as tl

    @triton.jit
    def block_mm_kernel(
        a_ptr, b_ptr, sa_ptr, sb_ptr, out_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
        stride_sam, stride_sak, stride_sbk, stride_sbn, B_COLS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INVERSE: tl.constexpr,
    ):
        # 64-bit rows, cols and k: rows * stride_am, k * stride_ak (a column-major), k * stride_bk,
        # cols * stride_bn and rows * N pass 2**31 once M*K, K*N or M*N does. The scale grids' kb * stride
        # terms stay 32-bit: they pass 2**31 only past M*K or K*N = 2**38 (256 GiB of FP8).
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K).to(tl.int64)
        row_ok, col_ok = rows < M, cols < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kb in range(0, K // BLOCK_K):
            k = kb * BLOCK_K + ks
            a = tl.load(a_ptr + rows[:, None] * stride_am + k[None, :] * stride_ak, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptr + k[:, None] * stride_bk + cols[None, :] * stride_bn, mask=col_ok[None, :], other=0.0)
            sa = tl.load(sa_ptr + rows * stride_sam + kb * stride_sak, mask=row_ok, other=1.0)
            sb = tl.load(sb_ptr + kb * stride_sbk + (cols // B_COLS) * stride_sbn, mask=col_ok, other=1.0)
            dot = tl.dot(a, b, out_dtype=tl.float32)
            if INVERSE:  # the grids hold scale_inv (fp8.ops.block_mm)
                acc = acc + dot * (sa[:, None] * sb[None, :])
            else:
                acc = acc + dot * ((1.0 / sa)[:, None] * (1.0 / sb)[None, :])
        out = acc.to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], out, mask=row_ok[:, None] & col_ok[None, :])

    return block_mm_kernel


def block_mm(a, a_scale, a_block, b, b_scale, b_block, out_dtype=torch.float32) -> torch.Tensor:
    """``a @ b`` of block-scaled FP8 payloads (module docstring) with the Triton kernel, in ``out_dtype``
    (fp32, bf16 or fp16; row-major). Any strides of ``a`` and ``b``; a ``ValueError`` naming the fix when
    :func:`block_mm_problem` (or the scale grids' shapes) rules the input out."""
    return _launch(a, a_scale, a_block, b, b_scale, b_block, out_dtype, inverse=False)


def block_mm_inverse(a, a_scale_inv, a_block, b, b_scale_inv, b_block, out_dtype=torch.float32) -> torch.Tensor:
    """:func:`block_mm` with the grids holding ``scale_inv`` (``value = payload * scale_inv``): the CUDA kernel of
    :func:`fp8.ops.block_mm`."""
    return _launch(a, a_scale_inv, a_block, b, b_scale_inv, b_block, out_dtype, inverse=True)


def _launch(a, a_scale, a_block, b, b_scale, b_block, out_dtype, inverse: bool) -> torch.Tensor:
    _check(block_mm_problem, a, a_scale, a_block, b, b_scale, b_block, out_dtype)
    (m, k), n = a.shape, b.shape[1]
    # The interpreter's fp32 -> bf16 cast does not round to nearest even: there the kernel writes fp32
    # and torch casts (the same rounding as the GPU's store).
    store_dtype = torch.float32 if interpreter_enabled() else out_dtype
    if m == 0 or n == 0 or k == 0:
        return torch.zeros(m, n, dtype=out_dtype, device=a.device)
    out = torch.empty(m, n, dtype=store_dtype, device=a.device)
    sa, sb = a_scale.to(torch.float32), b_scale.to(torch.float32)
    block_m, block_n = 64, 128
    grid = (-(-m // block_m), -(-n // block_n))
    _kernel()[grid](
        a, b, sa, sb, out, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1), B_COLS=b_block[1],
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=_K_BLOCK, INVERSE=inverse,
    )
    return out.to(out_dtype)
