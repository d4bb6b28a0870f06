"""NVFP4 numerics (NVIDIA Blackwell): E2M1 values packed two per byte, one E4M3 scale per 16 elements, one fp32 scale
per tensor; stochastic rounding; the 16x16 random Hadamard transform (the torch reference, the tests' oracle), and
the NVFP4 recipe's fused kernels as ``torch.library`` custom ops (:func:`nvfp4_amax`, :func:`nvfp4_quantize`: one
launch each, Triton on CUDA in :mod:`fp8.kernels.triton_fp4`; :func:`nvfp4_mm`, the GEMM call's CPU reference).

Format (NVIDIA's NVFP4, as cuBLAS and ``torch.nn.functional.scaled_mm`` read it):

- **E2M1** values (``torch.float4_e2m1fn_x2``: two per byte, the even element in the low nibble): magnitudes
  0, 0.5, 1, 1.5, 2, 3, 4, 6; sign bit 3 of each nibble. No inf or NaN.
- **Two-level scales**, ``value = e2m1 * block_scale * global_scale_inv``: one E4M3 ``block_scale`` per block of 16
  elements along K (``1x16``; weights in ``16x16`` 2-D blocks, so ``W`` and ``W^T`` share them) and one fp32
  ``global_scale_inv`` per tensor. Here the per-tensor scale is fp8's power of two (:func:`fp8.ops.power_of_two_scale`
  of the tensor's amax for ``6 * 448``: the amax maps into ``(1344, 2688]``, so every block's ``amax / 6`` fits
  E4M3), which makes ``e2m1 * block_scale * global_scale_inv`` exact in fp32 (the emulation equals the hardware's
  products); each block scale is ``amax_block * global_scale / 6`` rounded up to an E4M3 value, so no value
  saturates past 6 (rounding it to nearest, as NVIDIA's reference does, saturates the block's largest values when
  it rounds down, by up to 2**-4 relative for a normal E4M3 scale and far more for the subnormal scales of blocks
  ``2**-6`` below the tensor's amax: measured in ``tests/fp8/test_nvfp4.py``'s first version).
- **Rounding**: round to nearest, ties to even (forward operands) or stochastic (gradients: ``lower + 1{u < frac}``
  with ``u`` uniform in ``[0, 1)``, unbiased: ``E[q] = x`` inside the range).
- **Random Hadamard transform** (:func:`random_hadamard`): ``H = H_16 diag(s) / 4`` with a Sylvester Hadamard matrix
  ``H_16`` and random signs ``s``, orthogonal; applied to both operands of the weight-gradient GEMM along its K (the
  tokens) in groups of 16, it leaves the product unchanged in exact arithmetic (``(A H)(H^T B) = A B``) and spreads an
  outlier over its 16-element block before the 16-element scales see it.

GEMM: ``F.scaled_mm`` with ``[BlockWise1x16, TensorWise]`` scales per operand (the E4M3 block scales in cuBLAS's
swizzled layout, :mod:`fp8.microscaling`, and the 0-d fp32 ``global_scale_inv``) on compute capability >= 10.0:
:func:`nvfp4_call_problem` states its rules, checked against torch's ``meta`` kernel in the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .blocks import dequantize_blocks, expand_scales
from .microscaling import NVFP4_K_BLOCK, microscaling_problem, swizzle, swizzled_numel, unswizzle
from .ops import power_of_two_scale

__all__ = ["E2M1_MAX", "E2M1_VALUES", "NVFP4Operand", "quantize_nvfp4", "dequantize_nvfp4", "pack_e2m1",
           "unpack_e2m1", "round_e2m1", "random_hadamard", "hadamard_transform", "nvfp4_call_problem",
           "nvfp4_amax", "nvfp4_quantize", "nvfp4_mm", "sign_mask"]

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The E2M1 magnitudes by 3-bit code (exponent and mantissa bits; the sign is bit 3)."""

_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES, E2M1_VALUES[1:]))


def round_e2m1(v: torch.Tensor, stochastic: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, sign in bit 3) of fp32 ``v`` already scaled into ``[-6, 6]`` (clamped there): round to
    nearest, ties to the even code, or stochastic rounding (``generator``: the uniform draws' source)."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=v.device)
    mag = v.abs().clamp(max=E2M1_MAX).nan_to_num(nan=0.0)
    if stochastic:
        lower = (torch.bucketize(mag, grid, right=True) - 1).clamp(0, 6)
        lo, hi = grid[lower], grid[lower + 1]
        u = torch.rand(mag.shape, generator=generator, device=v.device, dtype=torch.float32)
        code = lower + (u < (mag - lo) / (hi - lo)).to(lower.dtype)
    else:
        mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=v.device)
        code = torch.bucketize(mag, mids, right=False)  # a value on a midpoint gets the lower code: ties fixed below
        tie = mag == mids[code.clamp(max=len(_MIDPOINTS) - 1)]
        code = torch.where(tie & (code % 2 == 1), code + 1, code)
    sign = ((v < 0) & (code > 0)).to(torch.uint8) << 3
    return code.to(torch.uint8) | sign


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """``(..., n)`` uint8 E2M1 codes (n even) as ``(..., n / 2)`` ``torch.float4_e2m1fn_x2``: element ``2i`` in the low
    nibble of byte ``i``, ``2i + 1`` in the high nibble (torch's and cuBLAS's order)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"E2M1 packs two values per byte: the last dimension must be even, got {tuple(codes.shape)}")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.float4_e2m1fn_x2)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """The fp32 values of ``(..., m)`` ``torch.float4_e2m1fn_x2`` data, ``(..., 2m)``."""
    bits = packed.view(torch.uint8)
    codes = torch.stack([bits & 0xF, bits >> 4], dim=-1).reshape(*bits.shape[:-1], 2 * bits.shape[-1])
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    mag = grid[(codes & 0x7).to(torch.int64)]
    return torch.where((codes & 0x8) > 0, -mag, mag)


@dataclass(frozen=True)
class NVFP4Operand:
    """An NVFP4 tensor (2-D, ``(rows, cols)``): ``data`` ``(rows, cols / 2)`` packed E2M1, ``block_scales`` the E4M3
    grid of ``block`` s (``(rows / br, cols / bc)``), ``global_scale_inv`` the 0-d fp32 per-tensor factor (a power of
    two): ``value = e2m1 * block_scale * global_scale_inv``."""

    data: torch.Tensor
    block_scales: torch.Tensor
    global_scale_inv: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], 2 * self.data.shape[1])

    def scale_inv(self) -> torch.Tensor:
        """The per-block fp32 factor ``block_scale * global_scale_inv`` (exact: a power of two times an E4M3 value)."""
        return self.block_scales.to(torch.float32) * self.global_scale_inv


def quantize_nvfp4(x: torch.Tensor, block: tuple[int, int] = (1, NVFP4_K_BLOCK), stochastic: bool = False,
                   generator: torch.Generator | None = None, global_amax: torch.Tensor | None = None) -> NVFP4Operand:
    """NVFP4 of 2-D ``x`` (columns a multiple of 16 and of ``block``'s, rows of ``block``'s): the per-tensor power-of-
    two scale from ``global_amax`` (default: ``x``'s finite amax; pass an amax agreed over a group to share it), one
    E4M3 scale per ``block`` (``(1, 16)`` activations and gradients, ``(16, 16)`` weights, ``(16, 1)`` along the
    rows), E2M1 values by round to nearest or stochastic rounding (module docstring). A block with a non-finite value
    gets a NaN block scale (the dequantized block is NaN, so the step's gradients are not finite and it is skipped)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_nvfp4 takes a 2-D tensor, got shape {tuple(x.shape)}")
    m, n = x.shape
    br, bc = block
    if n % 2 or m % br or n % bc:
        raise ValueError(f"shape {tuple(x.shape)} does not tile in {block} blocks with an even number of columns; "
                         f"pad it to multiples of {max(bc, 2)} columns and {br} rows")
    values = x.to(torch.float32)
    finite = torch.isfinite(values)
    mag = torch.where(finite, values.abs(), torch.zeros_like(values))
    amax = mag.amax() if global_amax is None else global_amax.to(torch.float32).reshape(())
    g = power_of_two_scale(amax, E2M1_MAX * E4M3_MAX)  # encode factor of the tensor
    blocks = mag.reshape(m // br, br, n // bc, bc)
    block_amax = blocks.amax(dim=(1, 3))
    bad = (~finite).reshape(m // br, br, n // bc, bc).any(dim=3).any(dim=1)
    wanted = (block_amax * g / E2M1_MAX).clamp(max=E4M3_MAX)
    scale = wanted.to(torch.float8_e4m3fn)
    low = scale.to(torch.float32) < wanted  # rounded down: one E4M3 step up (the next code), so nothing saturates
    scale = torch.where(low, (scale.view(torch.uint8) + 1).view(torch.float8_e4m3fn), scale)
    scale = torch.where(bad, torch.full_like(scale.view(torch.uint8), 0x7F).view(torch.float8_e4m3fn), scale)
    s32 = scale.to(torch.float32)
    per_elem = expand_scales(s32, block, (m, n))
    safe = torch.where(per_elem > 0, per_elem, torch.ones_like(per_elem))
    scaled = torch.where(per_elem > 0, values * g / safe, torch.zeros_like(values))  # a zero scale: an all-zero block
    codes = round_e2m1(scaled.clamp(-E2M1_MAX, E2M1_MAX), stochastic, generator)
    return NVFP4Operand(pack_e2m1(codes), scale, g.reciprocal(), (br, bc))


def dequantize_nvfp4(q: NVFP4Operand, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of ``q`` (exact in fp32)."""
    return (unpack_e2m1(q.data) * expand_scales(q.scale_inv(), q.block, q.shape)).to(dtype)


_SYLVESTER: dict[int, torch.Tensor] = {}


def random_hadamard(signs: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The 16x16 random Hadamard transform ``H_16 diag(signs) / 4`` (orthogonal: ``H H^T = I``) for 16 ``signs``
    (+-1; draw them once per run, e.g. ``torch.randint(0, 2, (16,), generator=g) * 2 - 1``)."""
    if signs.shape != (NVFP4_K_BLOCK,):
        raise ValueError(f"random_hadamard takes {NVFP4_K_BLOCK} signs, got shape {tuple(signs.shape)}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < NVFP4_K_BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * signs.to(torch.float64)[None, :] / math.sqrt(NVFP4_K_BLOCK)).to(dtype)


def hadamard_transform(x: torch.Tensor, h: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with ``h`` (16x16) applied to every group of 16 consecutive elements along ``dim`` (its size a multiple of
    16): along the tokens of both weight-gradient operands, ``(dY^T H)(H^T x)`` is ``dY^T x`` (``x`` and ``dY`` as
    ``(tokens, features)``, the transform on ``dim=0`` of each: ``H^T`` applied per group). In fp32 (or ``x``'s dtype)
    with one fixed order, ``out_i = (((0 + x_0 h_0i) + x_1 h_1i) + ...) + x_15 h_15i`` (the products exact: ``h``'s
    entries are +-1/4), the order :func:`nvfp4_quantize`'s Triton kernel sums in, so kernel and reference agree bit
    for bit."""
    moved = x.movedim(dim, -1)
    size = moved.shape[-1]
    if size % NVFP4_K_BLOCK:
        raise ValueError(f"the Hadamard transform works on groups of {NVFP4_K_BLOCK}: dimension {dim} has {size}")
    groups = moved.reshape(*moved.shape[:-1], size // NVFP4_K_BLOCK, NVFP4_K_BLOCK)
    hm = h.to(x.dtype)
    out = torch.zeros_like(groups)
    for j in range(NVFP4_K_BLOCK):  # out + x_j * h_j: the product is exact, so one rounding either way
        out = torch.addcmul(out, groups[..., j:j + 1], hm[j])
    return out.reshape(moved.shape).movedim(-1, dim)


def nvfp4_call_problem(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       kind: str, capability: tuple[int, int] | None) -> str | None:
    """Why ``F.scaled_mm(mat_a, mat_b, [scale_a, global_a], [BlockWise1x16, TensorWise], [scale_b, global_b], ...,
    swizzle [SWIZZLE_32_4_4, NO_SWIZZLE])`` would fail on a device of ``kind``/``capability``, or None: packed E2M1
    operands (``mat_a`` ``(M, K/2)`` row-major, ``mat_b`` ``(K/2, N)`` column-major), K a multiple of 32, N of 16,
    E4M3 block scales of the swizzled size (rows padded to 128, K blocks to 4), Blackwell."""
    fp4 = torch.float4_e2m1fn_x2
    if mat_a.dtype != fp4 or mat_b.dtype != fp4:
        return f"NVFP4 operands are torch.float4_e2m1fn_x2, got {mat_a.dtype} and {mat_b.dtype}"
    if mat_a.dim() != 2 or mat_b.dim() != 2 or mat_a.shape[1] != mat_b.shape[0]:
        return f"cannot multiply packed {tuple(mat_a.shape)} by {tuple(mat_b.shape)}"
    (m, k2), n = mat_a.shape, mat_b.shape[1]
    k = 2 * k2
    if k % 32 or n % 16:
        return f"NVFP4 GEMM M x K x N = {m} x {k} x {n}: K must be a multiple of 32 and N of 16"
    if not (mat_a.stride(1) == 1 and mat_a.stride(0) == k2):
        return "mat_a must be row-major"
    if not (mat_b.stride(0) == 1 and mat_b.stride(1) == k2):
        return "mat_b must be column-major (the transpose of a row-major (N, K/2) tensor)"
    for name, scale, rows in (("scale_a", scale_a, m), ("scale_b", scale_b, n)):
        want = swizzled_numel(rows, k // NVFP4_K_BLOCK)
        if scale.dtype != torch.float8_e4m3fn or scale.numel() != want:
            return f"{name} must be {want} float8_e4m3fn block scales (swizzled), got {scale.numel()} {scale.dtype}"
    return microscaling_problem(kind, capability, "NVFP4")


# -- fused kernels: torch.library custom ops (the torch reference; Triton on CUDA, fp8.kernels.triton_fp4) ------------
def sign_mask(signs) -> int:
    """The 16 Hadamard signs (+-1) as the fused kernels take them: bit ``i`` set where ``signs[i]`` is -1."""
    return sum(1 << i for i, s in enumerate(signs) if s < 0)


def _hadamard_of(mask: int) -> torch.Tensor:
    return random_hadamard(torch.tensor([-1.0 if mask >> i & 1 else 1.0 for i in range(NVFP4_K_BLOCK)]))


def _logical(x: torch.Tensor, transpose: bool, pad: int, signs: int, x_scale: torch.Tensor | None) -> torch.Tensor:
    """The fp32 matrix an NVFP4 kernel quantizes: ``x`` (dequantized by its 16x16 block ``x_scale`` grid when given)
    or its transpose (``transpose``), its columns (the GEMM's K) zero-padded to a multiple of ``pad`` and of 16,
    Hadamard-transformed along them when ``signs`` (a :func:`sign_mask`) is not -1."""
    values = x.to(torch.float32) if x_scale is None else dequantize_blocks(x, x_scale, (16, 16), torch.float32)
    if transpose:
        values = values.t()
    k = values.shape[1]
    kp = -(-k // max(pad, NVFP4_K_BLOCK)) * max(pad, NVFP4_K_BLOCK)
    if kp != k:
        values = torch.nn.functional.pad(values, (0, kp - k))
    if signs >= 0:
        values = hadamard_transform(values, _hadamard_of(signs).to(values.device), 1)
    return values.contiguous()


def _k_padded(x: torch.Tensor, transpose: bool, pad: int) -> int:
    k = x.shape[0] if transpose else x.shape[1]
    step = max(pad, NVFP4_K_BLOCK)
    return -(-k // step) * step


@torch.library.custom_op("fp8lm::nvfp4_amax", mutates_args=())
def nvfp4_amax(x: torch.Tensor, signs: int, transpose: bool, x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``[finite amax, non-finite flag]`` (fp32) of the matrix :func:`nvfp4_quantize` quantizes from the same
    arguments: ``x`` (an FP8 payload dequantized by its 16x16 block grid ``x_scale``, ``value = payload / scale``,
    when given: a weight), transposed with ``transpose``, transformed by the random Hadamard matrix of ``signs`` (a
    :func:`sign_mask`; -1: none) in groups of 16 along its columns (zero-padded to 16): the per-tensor amax of an
    NVFP4 operand, in one read (the transformed or dequantized tensor is never written)."""
    values = _logical(x, transpose, NVFP4_K_BLOCK, signs, x_scale)
    finite = torch.isfinite(values)
    amax = torch.where(finite, values.abs(), torch.zeros_like(values)).amax() if values.numel() else values.new_zeros(())
    flag = (~finite).any().to(torch.float32) if values.numel() else values.new_zeros(())
    return torch.stack([amax, flag])


@nvfp4_amax.register_fake
def _(x, signs, transpose, x_scale=None):
    return x.new_empty((2,), dtype=torch.float32)


@torch.library.custom_op("fp8lm::nvfp4_quantize", mutates_args=())
def nvfp4_quantize(x: torch.Tensor, amax2: torch.Tensor, block_rows: int, transpose: bool, pad: int, signs: int,
                   stochastic: bool, seed: int, x_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An NVFP4 GEMM operand in one pass: ``(data, scale_inv, hw_scale, global_scale_inv)`` of the matrix ``L`` =
    ``x`` or ``x^T`` (``transpose``: the weight-gradient operands, tokens along K; ``x`` an FP8 payload dequantized
    by its 16x16 block ``x_scale`` grid when given: a weight's copies), its columns zero-padded to a
    multiple of ``pad`` (and 16), Hadamard-transformed along them by the random Hadamard matrix of ``signs`` (a
    :func:`sign_mask`; -1: none; a constant of the kernel, no tensor to move), quantized as
    :func:`quantize_nvfp4` does with blocks of ``block_rows`` x 16 (1: activations, 16: weights) and the per-tensor
    scale from ``amax2[0]`` (:func:`fp8.ops.amax` of ``x``, or :func:`nvfp4_amax`; agreed over a group where one
    shares it). ``data`` uint8 ``(R, K/2)`` (view as ``torch.float4_e2m1fn_x2``), ``scale_inv`` the fp32 grid
    (``block_scale * global_scale_inv``), ``hw_scale`` the E4M3 block scales per row in cuBLAS's swizzled layout (what
    ``F.scaled_mm`` reads: no swizzle kernel per GEMM), ``global_scale_inv`` 0-d. ``stochastic``: stochastic rounding
    from the draws of ``seed`` (the Triton kernel's ``tl.rand`` on CUDA, a ``torch.Generator`` here: the same law,
    not the same draws)."""
    return _nvfp4_quantize_reference(x, amax2, block_rows, transpose, pad, signs, stochastic, seed, x_scale)


def _nvfp4_quantize_reference(x, amax2, block_rows, transpose, pad, signs, stochastic, seed, x_scale):
    """:func:`nvfp4_quantize`'s torch reference (its CPU implementation; CUDA runs it for an empty operand)."""
    values = _logical(x, transpose, pad, signs, x_scale)
    generator = None
    if stochastic:
        generator = torch.Generator(device=values.device)
        generator.manual_seed(seed)
    q = quantize_nvfp4(values, (block_rows, NVFP4_K_BLOCK), stochastic, generator, amax2[0])
    rows = values.shape[0]
    bits = q.block_scales.view(torch.uint8)
    per_row = bits.repeat_interleave(block_rows, dim=0) if block_rows > 1 else bits
    hw = swizzle(per_row[:rows]).reshape(-1).view(torch.float8_e4m3fn)
    return q.data.view(torch.uint8), q.scale_inv(), hw, q.global_scale_inv.reshape(())


@nvfp4_quantize.register_fake
def _(x, amax2, block_rows, transpose, pad, signs, stochastic, seed, x_scale=None):
    rows = x.shape[1] if transpose else x.shape[0]
    kp = _k_padded(x, transpose, pad)
    kb = kp // NVFP4_K_BLOCK
    return (x.new_empty((rows, kp // 2), dtype=torch.uint8),
            x.new_empty((rows // block_rows, kb), dtype=torch.float32),
            x.new_empty((swizzled_numel(rows, kb),), dtype=torch.float8_e4m3fn),
            x.new_empty((), dtype=torch.float32))


@torch.library.custom_op("fp8lm::nvfp4_mm", mutates_args=())
def nvfp4_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, global_a: torch.Tensor, scale_b: torch.Tensor,
             global_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The NVFP4 GEMM ``a @ b`` as ``F.scaled_mm`` takes it (packed ``a`` ``(M, K/2)`` row-major, ``b`` ``(K/2, N)``
    column-major, swizzled E4M3 block scales, 0-d fp32 global scales): the hardware call's reference where it has no
    kernel (the CPU with ``gemm_backend="scaled_mm"``: the GPU's op sequence, counted). Exact products, an fp32
    matmul: bit-identical to the emulated GEMM."""
    m, n = a.shape[0], b.shape[1]
    k = 2 * a.shape[1]
    sa = unswizzle(scale_a.view(torch.uint8), m, k // NVFP4_K_BLOCK).view(torch.float8_e4m3fn).to(torch.float32)
    sb = unswizzle(scale_b.view(torch.uint8), n, k // NVFP4_K_BLOCK).view(torch.float8_e4m3fn).to(torch.float32)
    va = unpack_e2m1(a) * (sa * global_a).repeat_interleave(NVFP4_K_BLOCK, dim=1)
    vb = unpack_e2m1(b.t()) * (sb * global_b).repeat_interleave(NVFP4_K_BLOCK, dim=1)
    return torch.mm(va, vb.t()).to(out_dtype)


@nvfp4_mm.register_fake
def _(a, b, scale_a, global_a, scale_b, global_b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _triton():
    from .kernels import triton_fp4  # noqa: PLC0415  (Triton is imported when a CUDA op first runs)

    return triton_fp4


@nvfp4_amax.register_kernel("cuda")
def _(x, signs, transpose, x_scale=None):
    return _triton().launch_nvfp4_amax(x, signs, transpose, x_scale)


@nvfp4_quantize.register_kernel("cuda")
def _(x, amax2, block_rows, transpose, pad, signs, stochastic, seed, x_scale=None):
    if _triton().is_empty_launch(x, transpose, pad):  # no program would write the global scale: the reference does
        return _nvfp4_quantize_reference(x, amax2, block_rows, transpose, pad, signs, stochastic, seed, x_scale)
    return _triton().launch_nvfp4_quantize(x, amax2, block_rows, transpose, pad, signs, stochastic, seed, x_scale)
