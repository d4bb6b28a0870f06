"""Microscaling layout facts shared by the MXFP8 and NVFP4 GEMMs: block scales in the hardware's swizzled layout.

NVIDIA Blackwell's block-scaled GEMMs (cuBLAS, through ``torch.nn.functional.scaled_mm``) read one scale per
``k_block`` consecutive elements along K of each operand row (32 for MXFP8, E8M0 scales; 16 for NVFP4, E4M3 scales),
not as a ``(rows, K / k_block)`` matrix but in cuBLAS's 32_4_4 swizzled layout (``SwizzleType.SWIZZLE_32_4_4``): the
matrix is zero-padded to a multiple of 128 rows and of 4 K-blocks, cut into 128 x 4 tiles stored one after another
(row tiles outer, K tiles inner), and inside a tile the scale of row ``r`` and K-block ``c`` sits at ``(r % 32) * 16 +
(r // 32) * 4 + c``. torch's ``meta`` kernel checks the padded element count and the dtypes, so the layout of every call
is testable without a GPU; :func:`swizzle` and :func:`unswizzle` are exact inverses.

This module knows layouts only (no GEMM, no quantizer): :mod:`fp8.gemm` calls the hardware with what it makes.
"""

from __future__ import annotations

import torch

__all__ = ["MX_K_BLOCK", "NVFP4_K_BLOCK", "BLACKWELL", "microscaling_problem", "swizzled_numel", "swizzle",
           "unswizzle", "to_e8m0"]

MX_K_BLOCK = 32
"""Elements along K sharing one E8M0 scale in MXFP8 (OCP Microscaling spec)."""

NVFP4_K_BLOCK = 16
"""Elements along K sharing one E4M3 scale in NVFP4."""

BLACKWELL = (10, 0)
"""The first compute capability with block-scaled (MX/NVFP4) tensor-core GEMMs: B200, GB200, B300 (10.x)."""


def microscaling_problem(kind: str, capability: tuple[int, int] | None, fmt: str = "MXFP8") -> str | None:
    """Why a device of ``kind`` (``"cuda"``, ``"cpu"``, ...) and CUDA ``capability`` has no hardware GEMM for the
    block-scaled ``fmt`` (``"MXFP8"``, ``"NVFP4"``), naming the GPU generation it needs; None if it has one."""
    if kind == "cuda" and capability is not None and tuple(capability) >= BLACKWELL:
        return None
    where = f"a CUDA GPU of compute capability {tuple(capability)}" if kind == "cuda" and capability else kind
    if kind == "cuda" and capability:
        gen = {(9, 0): " (Hopper: H100/H200)", (8, 9): " (Ada: L4/L40/RTX 4090)", (8, 0): " (Ampere: A100)"}
        where += gen.get(tuple(capability), "")
    return (f"{where} has no {fmt} GEMM: block-scaled tensor-core GEMMs need NVIDIA Blackwell, compute capability "
            f">= 10.0 (B200, GB200, B300); run another recipe there, or pass gemm_backend='emulated' "
            f"(--fp8-gemm-backend emulated) to run the exact emulation")


def swizzled_numel(rows: int, k_blocks: int) -> int:
    """Elements of the swizzled layout of a ``(rows, k_blocks)`` scale matrix (128-row, 4-column tiles, padded)."""
    return -(-rows // 128) * 128 * (-(-k_blocks // 4) * 4)


def swizzle(scales: torch.Tensor) -> torch.Tensor:
    """A ``(rows, k_blocks)`` scale matrix in cuBLAS's 32_4_4 layout (module docstring), 1-D, zero-padded."""
    rows, kb = scales.shape
    pr, pk = -(-rows // 128) * 128, -(-kb // 4) * 4
    if (pr, pk) != (rows, kb):
        padded = scales.new_zeros((pr, pk))
        padded[:rows, :kb] = scales
        scales = padded
    # (row tile, 4 row groups of 32, 32 rows, K tile, 4 K-blocks) -> (row tile, K tile, 32 rows, 4 groups, 4 K-blocks)
    tiles = scales.reshape(pr // 128, 4, 32, pk // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1)


def unswizzle(flat: torch.Tensor, rows: int, k_blocks: int) -> torch.Tensor:
    """The ``(rows, k_blocks)`` matrix of a :func:`swizzle` d layout (its inverse)."""
    pr, pk = -(-rows // 128) * 128, -(-k_blocks // 4) * 4
    tiles = flat.reshape(pr // 128, pk // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(pr, pk)[:rows, :k_blocks]


def to_e8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 ``scale_inv`` values as E8M0 (``torch.float8_e8m0fnu``: an 8-bit exponent, 2**-127 to
    2**127), exact: fp8's scales are powers of two within ``2**+-126`` (:func:`fp8.ops.power_of_two_scale`). The byte
    is the fp32 exponent field, taken by bit operations (no rounding mode involved)."""
    bits = scale_inv.to(torch.float32).contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)
