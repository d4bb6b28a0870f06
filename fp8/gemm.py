"""FP8 x FP8 GEMM: ``torch._scaled_mm`` where it can run, an exact emulation elsewhere.

``fp8_mm(a, b)`` multiplies ``a`` (M x K) by ``b`` (K x N), both :class:`fp8.Float8Tensor`, with fp32
accumulation (operands are taken by their payload and scale: :mod:`fp8.tensor` imports this module for
its ``mm``/``linear``/``@`` handlers, so this one does not import it).

One function decides every GEMM's path: :func:`gemm_path`, pure (it reads the operands' shapes and dtypes,
their scale blocks, the output dtype, the backend and a :class:`GemmTarget`: device kind, CUDA compute
capability, Triton installed), so a GEMM can be decided for a device this process does not have (the
readiness audit asks it for a compute-capability 9.0 GPU on a CPU machine). :func:`fp8_mm_payload` runs
what it decides (:data:`GEMM_PATHS`):

- ``scaled_mm_tensorwise``: ``torch._scaled_mm`` with the two 0-d scales.
- ``scaled_mm_rowwise``: scales constant along K (per-row scales of ``a``, per-column scales of ``b``, or one
  of them tensor-wise) as ``torch._scaled_mm``'s row-wise scaling: scales ``(M, 1)`` and ``(1, N)``.
- ``scaled_mm_rowwise_epilogue``: the same GEMM where row-wise ``_scaled_mm`` cannot write the output dtype (on
  CUDA it writes bfloat16 only, so an fp32 weight gradient or the activations of an fp32/fp16 model): a
  tensor-wise ``_scaled_mm`` of the payloads with unit scales writing fp32, then the row and column scales
  applied in fp32 and the result cast to the output dtype. That is the row-wise GEMM with an fp32 output: the
  FP8 products accumulated in fp32 (in the kernel's summation order), then scaled by the same reciprocal scales
  (exact with this package's power-of-two scales; on CPU it equals the emulation bit for bit). Nothing is
  rounded to bfloat16, the weight gradient stays fp32 end to end and stays an FP8 GEMM (no high-precision
  weight-gradient GEMM on saved high-precision activations, as torchao's ``rowwise_with_gw_hp``); the cost is
  one more elementwise pass over the (M, N) fp32 output.
- ``triton_block``: scales that vary along K in 128-element blocks (DeepSeek-style ``1x128`` x ``128x128`` or
  ``128x1``) run the Triton block GEMM on CUDA (:mod:`fp8.kernels.triton_block_gemm`).
- ``scaled_mm_mx``: MXFP8 operands (E4M3 payloads, one power-of-two scale per 32 elements along K: ``1x32`` or
  ``32x32`` blocks of ``a``, ``32x1`` or ``32x32`` of ``b``) run ``torch.nn.functional.scaled_mm`` with E8M0 scales in
  cuBLAS's swizzled layout (:func:`fp8.ops.mx_scales`, one kernel per operand) on NVIDIA Blackwell (compute capability
  >= 10.0); an operand may carry its scales already in that layout (:attr:`Operand.hw_scale`: a weight's, made once
  per optimizer step). On the CPU with ``backend="scaled_mm"`` the call's reference (:func:`fp8.ops.mx_mm`) runs on
  the same swizzled scales: the GPU's op sequence, bit-identical to the emulation.
- ``scaled_mm_nvfp4``: NVFP4 operands (packed E2M1, ``torch.float4_e2m1fn_x2``, along K; :attr:`Operand.global_scale_inv`
  the per-tensor factor) run ``torch.nn.functional.scaled_mm`` with ``[BlockWise1x16, TensorWise]`` scales (the E4M3
  block scales swizzled: :attr:`Operand.hw_scale` as the recipe's quantize kernel writes them) on compute capability
  >= 10.0 (:mod:`fp8.nvfp4`); on the CPU with ``backend="scaled_mm"`` the call's reference
  (:func:`fp8.fp4.nvfp4_mm`), bit-identical to the emulation, which unpacks them.
- ``emulated``: dequantize to fp32 and run an fp32 matmul: on CPU it equals ``_scaled_mm`` bit for bit, and
  ``backend="auto"`` takes it there (:data:`GEMM_BACKENDS`: CPU ``_scaled_mm`` is orders of magnitude slower);
  elsewhere it is the fallback, logged once per reason, for what no hardware path takes.

The hardware paths follow ``torch._scaled_mm``'s rules as the GPU enforces them (CPU is more lenient, so
they are checked on every device): ``a`` row-major, ``b`` column-major (the GEMM copies an operand held in
the other layout), K and N multiples of 16, not both operands E5M2, fp32 scales (0-d, or ``(M, 1)`` and
``(1, N)``), and a CPU or a CUDA GPU of compute capability >= 8.9. :func:`scaled_mm_call_problem` checks a
``_scaled_mm`` call against them (with the output-dtype rule that torch's ``meta`` kernel does not check);
every call this module makes passes through it. ``backend="scaled_mm"`` forces a hardware path and raises a
``ValueError`` naming the fix where there is none; ``backend="emulated"`` forces the emulation.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from . import ops
from .blocks import Block, dequantize_blocks, expand_scales, is_tensorwise, scales_constant_along
from .cast import payload_and_scale
from .formats import E5M2
from .fp4 import nvfp4_call_problem, nvfp4_mm, unpack_e2m1
from .kernels.backend import triton_available
from .microscaling import BLACKWELL, MX_K_BLOCK, microscaling_problem, swizzle, swizzled_numel

__all__ = [
    "Operand", "mm", "fp8_mm", "fp8_mm_payload", "gemm_path", "GemmPath", "GemmTarget", "GEMM_PATHS", "scaled_mm_supported",
    "scaled_mm_problem", "scaled_mm_call_problem", "mx_call_problem", "mx_blocks", "mx_scale", "GEMM_BACKENDS",
    "SCALED_MM_MX", "SCALED_MM_NVFP4", "logical_shape",
]

logger = logging.getLogger(__name__)

GEMM_BACKENDS = ("auto", "scaled_mm", "emulated")
"""``auto`` picks ``scaled_mm`` on a CUDA GPU where it can run and ``emulated`` elsewhere, the CPU included (there
the two are bit-identical and torch 2.13's CPU ``_scaled_mm`` is a reference loop: measured 300-1,300x slower
than the emulation on 2 cores, e.g. 7.7 s against 0.04 s for 1024 x 512 x 512); the others force one."""

SCALED_MM_TENSORWISE = "scaled_mm_tensorwise"
SCALED_MM_ROWWISE = "scaled_mm_rowwise"
SCALED_MM_ROWWISE_EPILOGUE = "scaled_mm_rowwise_epilogue"
TRITON_BLOCK = "triton_block"
SCALED_MM_MX = "scaled_mm_mx"
SCALED_MM_NVFP4 = "scaled_mm_nvfp4"
EMULATED = "emulated"
GEMM_PATHS = (SCALED_MM_TENSORWISE, SCALED_MM_ROWWISE, SCALED_MM_ROWWISE_EPILOGUE, TRITON_BLOCK, SCALED_MM_MX,
              SCALED_MM_NVFP4, EMULATED)
"""The paths :func:`gemm_path` chooses from (module docstring); all but ``emulated`` run on FP8 (or FP4) hardware."""

FP4 = torch.float4_e2m1fn_x2

_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_SCALED_MM_OUT = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class GemmTarget:
    """The device a GEMM is decided for: its ``kind`` (``torch.device.type``: ``"cpu"``, ``"cuda"``, ...), a CUDA
    GPU's compute ``capability`` and whether Triton is installed. :meth:`of` reads a real device; a target built
    by hand (``GemmTarget("cuda", (9, 0), triton=True)``: an H100/H200) decides for a device this process lacks."""

    kind: str
    capability: tuple[int, int] | None = None
    triton: bool = False

    @classmethod
    def of(cls, device: torch.device | str) -> "GemmTarget":
        """The target of ``device`` (a CUDA device's capability is queried; Triton matters on CUDA only)."""
        device = torch.device(device)
        if device.type == "cuda":
            return cls("cuda", tuple(torch.cuda.get_device_capability(device)), triton_available())
        return cls(device.type)

    def fp8_problem(self) -> str | None:
        """Why this target runs no FP8 GEMM (``torch._scaled_mm``: a CPU or a CUDA GPU of compute capability
        >= 8.9; FP8 ``tl.dot``: such a GPU), or None if it does."""
        if self.kind == "cpu" and hasattr(torch, "_scaled_mm"):
            return None
        if self.kind == "cuda" and self.capability is not None and tuple(self.capability) >= (8, 9):
            return None
        where = f"a CUDA GPU of compute capability {self.capability}" if self.kind == "cuda" else self.kind
        return (f"{where} has no FP8 GEMM support (torch._scaled_mm needs a CPU or a CUDA GPU of compute capability "
                f">= 8.9, e.g. H100/H200/L40/RTX 4090, and so does the Triton block GEMM); use gemm_backend='emulated'")


@dataclass(frozen=True)
class GemmPath:
    """:func:`gemm_path`'s answer: the ``path`` (one of :data:`GEMM_PATHS`) and the ``reason`` it was taken
    (for ``emulated``: what rules out the hardware, naming the fix)."""

    path: str
    reason: str

    @property
    def hardware(self) -> bool:
        """Whether the GEMM runs on FP8 hardware (every path but ``emulated``)."""
        return self.path != EMULATED

    @property
    def scaled_mm(self) -> bool:
        """Whether the GEMM runs ``torch._scaled_mm`` (the ``scaled_mm_*`` paths), which takes its second operand
        column-major (and copies one held row-major)."""
        return self.path in (SCALED_MM_TENSORWISE, SCALED_MM_ROWWISE, SCALED_MM_ROWWISE_EPILOGUE)


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs FP8 on ``device`` (CPU, or CUDA compute capability >= 8.9)."""
    return GemmTarget.of(device).fp8_problem() is None


def scaled_mm_problem(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """Why ``torch._scaled_mm`` cannot take ``a @ b`` (shape and format rules), or None if it can."""
    if a.dim() != 2 or b.dim() != 2:
        return f"operands must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}"
    k, n = b.shape
    if a.shape[1] % 16 or k % 16 or n % 16:
        return (
            f"shapes {tuple(a.shape)} @ {tuple(b.shape)}: K and N must be multiples of 16 (for a linear "
            f"layer: its in/out features, and for its weight-gradient GEMM the number of tokens, batch x "
            f"sequence; pad them to multiples of 16)"
        )
    if a.dtype == E5M2.dtype and b.dtype == E5M2.dtype:
        return "both operands are E5M2; one must be E4M3"
    return None


def _rowwise_output_problem(out_dtype: torch.dtype, target: GemmTarget) -> str | None:
    """Why row-wise ``torch._scaled_mm`` cannot write ``out_dtype`` on ``target``, or None if it can."""
    if target.kind == "cuda" and out_dtype != torch.bfloat16:
        return f"row-wise torch._scaled_mm on CUDA writes bfloat16 only, not {out_dtype}"
    return None


def _block_operands_problem(a, a_block, b, b_block) -> str | None:
    from .kernels.triton_block_gemm import block_operands_problem  # the kernel's own operand rules, device aside

    return block_operands_problem(a, a_block, b, b_block)


def gemm_path(
    a: torch.Tensor,
    b: torch.Tensor,
    out_dtype: torch.dtype,
    target: GemmTarget,
    backend: str = "auto",
    a_block: Block | None = None,
    b_block: Block | None = None,
) -> GemmPath:
    """The path of the GEMM ``a @ b`` (FP8 payloads M x K and K x N, any device, ``meta`` included: only shapes
    and dtypes are read) with scale blocks ``a_block``/``b_block`` (None: tensor-wise) writing ``out_dtype`` with
    ``backend`` on ``target``. The one decision :func:`fp8_mm_payload` runs (module docstring); a ``ValueError``
    for a bad backend or operands that cannot be multiplied."""
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"backend must be one of {GEMM_BACKENDS}, got {backend!r}")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or (a.dtype == FP4) != (b.dtype == FP4):
        raise ValueError(f"fp8_mm: cannot multiply {tuple(a.shape)} {a.dtype} by {tuple(b.shape)} {b.dtype}")
    if backend == "emulated":
        return GemmPath(EMULATED, "backend='emulated' requested")
    if backend == "auto" and target.kind == "cpu":
        return GemmPath(EMULATED, "backend='auto' on the CPU: the emulation is bit-identical to CPU torch._scaled_mm "
                                  "and 300-1,300x faster")
    if a.dtype == FP4:
        problem = _nvfp4_problem(a, b, target)
        if problem is None:
            return GemmPath(SCALED_MM_NVFP4, "NVFP4: E2M1, one E4M3 scale per 16 along K and one per tensor (F.scaled_mm)")
        return GemmPath(EMULATED, problem)
    if mx_blocks(a_block, b_block):
        problem = _mx_problem(a, b, out_dtype, target)
        if problem is None:
            return GemmPath(SCALED_MM_MX, "MXFP8: one E8M0 scale per 32 elements along K (F.scaled_mm)")
        return GemmPath(EMULATED, problem)
    tensorwise = is_tensorwise(a_block) and is_tensorwise(b_block)
    if tensorwise or (scales_constant_along(a_block, tuple(a.shape), 1)
                      and scales_constant_along(b_block, tuple(b.shape), 0)):
        problem = scaled_mm_problem(a, b) or target.fp8_problem()
        if problem is None:
            if tensorwise:
                return GemmPath(SCALED_MM_TENSORWISE, "tensor-wise scales")
            output_problem = _rowwise_output_problem(out_dtype, target)
            if output_problem is None:
                return GemmPath(SCALED_MM_ROWWISE, "scales constant along K")
            return GemmPath(SCALED_MM_ROWWISE_EPILOGUE, f"scales constant along K; {output_problem}: tensor-wise "
                                                        f"GEMM writing fp32, row/column scales applied after")
    elif target.kind == "cpu" and backend == "scaled_mm":
        # The block GEMM's own reference (fp8.ops.block_mm): the GPU's kernel sequence, where CPU _scaled_mm has none.
        problem = _block_operands_problem(a, a_block, b, b_block)
        if problem is None:
            return GemmPath(TRITON_BLOCK, f"block scales {a_block} x {b_block} vary along K (fp8.ops.block_mm)")
    elif target.kind == "cuda":
        problem = _block_operands_problem(a, a_block, b, b_block)
        if problem is None and not target.triton:
            problem = "the block-scaled GEMM needs Triton: pip install triton (or use gemm_backend='emulated')"
        if problem is None:
            problem = target.fp8_problem()
        if problem is None:
            return GemmPath(TRITON_BLOCK, f"block scales {a_block} x {b_block} vary along K")
    else:
        problem = (f"block scales that vary along K ({a_block} x {b_block}) have no torch._scaled_mm path on "
                   f"{target.kind}")
    return GemmPath(EMULATED, problem)


def mx_blocks(a_block: Block | None, b_block: Block | None) -> bool:
    """Whether operands scaled in these blocks are MXFP8's: ``a`` (M x K) in ``1x32`` or ``32x32`` blocks and ``b``
    (K x N) in ``32x1`` or ``32x32`` (one scale per 32 elements along K, :mod:`fp8.mxfp8`)."""
    return (a_block is not None and b_block is not None and tuple(a_block) in ((1, MX_K_BLOCK), (MX_K_BLOCK, MX_K_BLOCK))
            and tuple(b_block) in ((MX_K_BLOCK, 1), (MX_K_BLOCK, MX_K_BLOCK)))


_MX_OUT = (torch.bfloat16, torch.float32)


def _mx_problem(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, target: GemmTarget) -> str | None:
    """Why the MXFP8 GEMM ``a @ b`` has no hardware path on ``target``, or None."""
    k = a.shape[1]
    if k % MX_K_BLOCK:
        return f"MXFP8 GEMM {tuple(a.shape)} @ {tuple(b.shape)}: K must be a multiple of {MX_K_BLOCK}"
    if a.dtype != torch.float8_e4m3fn or b.dtype != torch.float8_e4m3fn:
        return f"MXFP8 operands are E4M3 here, got {a.dtype} and {b.dtype}"
    problem = scaled_mm_problem(a, b)
    if problem is not None:
        return problem
    if out_dtype not in _MX_OUT:
        return f"the MXFP8 GEMM writes {_MX_OUT}, not {out_dtype}"
    if target.kind == "cpu":  # gemm_backend="scaled_mm": the call's reference (fp8.ops.mx_mm), the GPU's op sequence
        return None
    return microscaling_problem(target.kind, target.capability, "MXFP8")


def _nvfp4_problem(a: torch.Tensor, b: torch.Tensor, target: GemmTarget) -> str | None:
    """Why the NVFP4 GEMM of packed ``a`` (M x K/2, row-major) and ``b`` (K/2 x N, column-major) has no hardware path
    on ``target``, or None."""
    (m, k), n = logical_shape(a), logical_shape(b)[1]
    if k % 32 or n % 16:
        return f"NVFP4 GEMM M x K x N = {m} x {k} x {n}: K must be a multiple of 32 and N of 16"
    if target.kind == "cpu":  # gemm_backend="scaled_mm": the call's reference (fp8.fp4.nvfp4_mm), the GPU's op sequence
        return None
    return microscaling_problem(target.kind, target.capability, "NVFP4")


def _nvfp4_scales(op: "Operand", k_dim: int) -> torch.Tensor:
    """An NVFP4 operand's E4M3 block scales (one per 16 along K per row) in cuBLAS's swizzled layout:
    :attr:`Operand.hw_scale` as the recipe's kernel wrote them (:func:`fp8.fp4.nvfp4_quantize`), else made here."""
    if op.hw_scale is not None:
        return op.hw_scale
    grid, block = (op.scale_inv, op.block) if k_dim == 1 else (op.scale_inv.t(), (op.block[1], op.block[0]))
    rows = logical_shape(op.data)[0] if k_dim == 1 else logical_shape(op.data)[1]
    full = grid.repeat_interleave(block[0], dim=0)[:rows] if block[0] > 1 else grid
    e4m3 = (full / op.global_scale_inv).to(torch.float8_e4m3fn)  # exact: scale_inv = e4m3 value * global factor
    return swizzle(e4m3.view(torch.uint8)).view(torch.float8_e4m3fn)


def mx_scale(op: "Operand", k_dim: int) -> torch.Tensor:
    """The swizzled E8M0 scales the MXFP8 GEMM reads for operand ``op`` (its ``k_dim``: 1 for ``a``, M x K; 0 for
    ``b``, K x N): :attr:`Operand.hw_scale` when it carries them, else made from its ``scale_inv`` grid."""
    if op.hw_scale is not None:
        return op.hw_scale
    rows = op.data.shape[0] if k_dim == 1 else op.data.shape[1]
    k = op.data.shape[k_dim]
    grid, block = (op.scale_inv, op.block) if k_dim == 1 else (op.scale_inv.t(), (op.block[1], op.block[0]))
    repeat = block[0] or rows
    if block[1] != MX_K_BLOCK or grid.shape != (-(-rows // repeat), k // MX_K_BLOCK):
        raise ValueError(f"scales in blocks {op.block} do not give one scale per {MX_K_BLOCK} elements along K={k} "
                         f"of {rows} rows (grid {tuple(op.scale_inv.shape)})")
    return ops.mx_scales(grid, rows, repeat)  # one kernel: repeat, E8M0, swizzle


def mx_call_problem(mat_a: torch.Tensor, mat_b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                    out_dtype: torch.dtype, target: GemmTarget) -> str | None:
    """Why the MXFP8 ``F.scaled_mm(mat_a, mat_b, scale_a, BlockWise1x32, scale_b, BlockWise1x32, SWIZZLE_32_4_4, ...)``
    would fail on ``target`` (any device, ``meta`` included), or None: the rules :func:`_mx_problem` decides on plus
    layouts (``mat_a`` row-major, ``mat_b`` column-major) and the swizzled scales' dtype and padded size."""
    problem = _mx_problem(mat_a, mat_b, out_dtype, target)
    if problem is not None:
        return problem
    if not _row_major(mat_a):
        return f"mat_a must be row-major, got stride {mat_a.stride()} for shape {tuple(mat_a.shape)}"
    if not _col_major(mat_b):
        return f"mat_b must be column-major, got stride {mat_b.stride()} for shape {tuple(mat_b.shape)}"
    (m, k), n = mat_a.shape, mat_b.shape[1]
    for name, scale, rows in (("scale_a", scale_a, m), ("scale_b", scale_b, n)):
        want = swizzled_numel(rows, k // MX_K_BLOCK)
        if scale.dtype != torch.float8_e8m0fnu or scale.numel() != want:
            return f"{name} must be {want} float8_e8m0fnu scales (swizzled), got {scale.numel()} {scale.dtype}"
    return None


def scaled_mm_call_problem(
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    target: GemmTarget,
) -> str | None:
    """Why ``torch._scaled_mm(mat1, mat2, scale_a=..., scale_b=..., out_dtype=...)`` would fail on ``target`` under
    the GPU's rules (module docstring; any device, ``meta`` included), or None if it would run. It adds to torch's
    ``meta`` kernel the rules that kernel does not check: row-wise scaling writes bfloat16 only on CUDA, and FP8
    needs a CPU or a CUDA GPU of compute capability >= 8.9."""
    if mat1.dim() != 2 or mat2.dim() != 2 or mat1.shape[1] != mat2.shape[0]:
        return f"cannot multiply {tuple(mat1.shape)} by {tuple(mat2.shape)}"
    if mat1.dtype not in _FP8_DTYPES or mat2.dtype not in _FP8_DTYPES:
        return f"operands must be FP8 (float8_e4m3fn or float8_e5m2), got {mat1.dtype} and {mat2.dtype}"
    problem = scaled_mm_problem(mat1, mat2) or target.fp8_problem()
    if problem is not None:
        return problem
    if not _row_major(mat1):
        return f"mat1 must be row-major, got stride {mat1.stride()} for shape {tuple(mat1.shape)}"
    if not _col_major(mat2):
        return (f"mat2 must be column-major, got stride {mat2.stride()} for shape {tuple(mat2.shape)} "
                f"(pass the transpose of a row-major (N, K) tensor)")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        return f"scales must be fp32, got {scale_a.dtype} and {scale_b.dtype}"
    if out_dtype not in _SCALED_MM_OUT:
        return f"out_dtype must be one of {_SCALED_MM_OUT}, got {out_dtype}"
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return None
    m, n = mat1.shape[0], mat2.shape[1]
    if tuple(scale_a.shape) != (m, 1) or tuple(scale_b.shape) != (1, n):
        return (f"scales must be 0-d (tensor-wise) or ({m}, 1) and (1, {n}) (row-wise), got {tuple(scale_a.shape)} "
                f"and {tuple(scale_b.shape)}")
    if not (scale_a.is_contiguous() and scale_b.is_contiguous()):
        return "row-wise scales must be contiguous"
    return _rowwise_output_problem(out_dtype, target)


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) == t.shape[1]


def _col_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) == t.shape[0]


@dataclass(frozen=True)
class Operand:
    """One FP8 GEMM operand: the payload as the GEMM reads it (any strides), its ``scale_inv`` (``value = payload *
    scale_inv``: 0-d, or a grid of ``block``s of ``data``'s orientation, :mod:`fp8.blocks`) and ``block`` (None:
    tensor-wise)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    block: Block | None = None
    hw_scale: torch.Tensor | None = None
    """The scales already in the hardware GEMM's layout (an MXFP8 weight's swizzled E8M0 scales, made once per
    optimizer step), or None: made from ``scale_inv`` by the GEMM. Dropped by :attr:`t`."""
    global_scale_inv: torch.Tensor | None = None
    """NVFP4 (``data`` packed E2M1, ``torch.float4_e2m1fn_x2``, two values per byte along its contiguous dimension):
    the 0-d per-tensor factor; ``scale_inv`` is then the E4M3 block scale times it (exact, :mod:`fp8.fp4`)."""

    @property
    def t(self) -> "Operand":
        """The transposed operand (views only). :attr:`hw_scale` is kept where the operand's K is its own: NVFP4 data
        is packed along K, and 1xk / kx1 tiles run along K, so a transpose never changes which dimension is K; a
        square block's (a weight's 32x32) serves both orientations with different layouts, so it is dropped."""
        scale = self.scale_inv.t() if self.scale_inv.dim() == 2 else self.scale_inv
        own_k = self.global_scale_inv is not None or (self.block is not None and self.block[0] != self.block[1])
        return Operand(self.data.t(), scale, None if self.block is None else (self.block[1], self.block[0]),
                       hw_scale=self.hw_scale if own_k else None, global_scale_inv=self.global_scale_inv)

    @property
    def shape(self) -> tuple[int, int]:
        """The operand's logical shape (packed E2M1 data counts two values per byte along its contiguous dimension)."""
        return logical_shape(self.data)


def logical_shape(data: torch.Tensor) -> tuple[int, int]:
    """The shape of the values a GEMM payload holds: its own, or for packed E2M1 twice its contiguous dimension."""
    if data.dtype != FP4:
        return tuple(data.shape)
    return (data.shape[0], 2 * data.shape[1]) if data.stride(1) == 1 else (2 * data.shape[0], data.shape[1])


def _values(data: torch.Tensor) -> torch.Tensor:
    """A payload's values in fp32 (packed E2M1 unpacked along its contiguous dimension)."""
    if data.dtype != FP4:
        return data.to(torch.float32)
    return unpack_e2m1(data) if data.stride(1) == 1 else unpack_e2m1(data.t()).t()


def _dequantized(op: Operand) -> torch.Tensor:
    if is_tensorwise(op.block):
        return _values(op.data) * op.scale_inv.to(torch.float32)
    values = _values(op.data)
    return values * expand_scales(op.scale_inv, op.block, tuple(values.shape))


def _outer(op: Operand, rows: bool) -> torch.Tensor:
    """A scale-constant-along-K operand's ``scale_inv`` as ``_scaled_mm``'s row-wise ``(M, 1)`` (``rows``) or
    ``(1, N)`` tensor."""
    m = op.data.shape[0] if rows else op.data.shape[1]
    shape = (m, 1) if rows else (1, m)
    if is_tensorwise(op.block):
        return op.scale_inv.reshape(1, 1).expand(*shape).contiguous()
    scale = op.scale_inv.reshape(shape)  # per-row grids are (M, 1), per-column (1, N): their own layout
    return scale if scale.is_contiguous() else scale.contiguous()


_UNIT: dict[torch.device, torch.Tensor] = {}


def _unit(device: torch.device) -> torch.Tensor:
    """A 0-d fp32 one on ``device``, made once (a fresh one would be a fill kernel per GEMM)."""
    if device not in _UNIT:
        _UNIT[device] = torch.ones((), dtype=torch.float32, device=device)
    return _UNIT[device]


def mm(a: Operand, b: Operand, out_dtype: torch.dtype = torch.float32, backend: str = "auto",
       target: GemmTarget | None = None, defer_scales: bool = False):
    """``a @ b`` of FP8 operands (``a`` M x K, ``b`` K x N), fp32 accumulation, in ``out_dtype``: the path
    :func:`gemm_path` decides, one launch on the hardware paths (``torch._scaled_mm`` with the operands' ``scale_inv``;
    :func:`fp8.ops.block_mm`). With ``defer_scales`` returns ``(out, row, col)``: on the row-wise epilogue path
    (CUDA row-wise GEMMs writing fp32) ``out`` is the fp32 product of the payloads and ``row`` ``(M, 1)`` / ``col``
    ``(1, N)`` the scales still to apply (the caller fuses them into its next kernel); elsewhere ``row = col = None``.
    ``target``: as :func:`fp8_mm_payload`'s."""
    target = target or GemmTarget.of(a.data.device)
    choice = gemm_path(a.data, b.data, out_dtype, target, backend, a.block, b.block)
    out, row, col = _run(choice, a, b, out_dtype, backend, target, defer_scales)
    return (out, row, col) if defer_scales else out


def _run(choice: GemmPath, a: Operand, b: Operand, out_dtype, backend, target, defer_scales):
    if choice.path == EMULATED:
        if backend == "scaled_mm":
            raise ValueError(f"fp8_mm(backend='scaled_mm'): {choice.reason}; use backend='auto' or 'emulated'")
        if backend == "auto" and target.kind != "cpu":
            _log_fallback(choice.reason)
        return torch.mm(_dequantized(a), _dequantized(b)).to(out_dtype), None, None
    if choice.path == SCALED_MM_NVFP4:
        if a.global_scale_inv is None or b.global_scale_inv is None:
            raise ValueError("an NVFP4 operand without its one per-tensor scale (rows gathered over a sequence-parallel "
                             "group, each rank's with its own) has no NVFP4 GEMM yet: run nvfp4 without "
                             "--sequence-parallel, or gemm_backend='emulated'")
        F = torch.nn.functional
        lhs = a.data if a.data.stride(1) == 1 else a.data.contiguous()
        rhs = b.data if b.data.stride(0) == 1 else b.data.t().contiguous().t()
        recipes = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
        swizzles = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
        sa, sb = _nvfp4_scales(a, 1), _nvfp4_scales(b, 0)
        problem = nvfp4_call_problem(lhs, rhs, sa, sb, "cuda" if target.kind == "cpu" else target.kind,
                                     BLACKWELL if target.kind == "cpu" else target.capability)
        if problem is not None:
            raise RuntimeError(f"fp8_mm: internal error, the NVFP4 F.scaled_mm call breaks the GPU's rules: {problem}")
        if target.kind == "cpu":  # F.scaled_mm has no NVFP4 kernel on the CPU: its reference, on the same operands
            return nvfp4_mm(lhs, rhs, sa, a.global_scale_inv, sb, b.global_scale_inv, out_dtype), None, None
        return F.scaled_mm(lhs, rhs, [sa, a.global_scale_inv.reshape(())], recipes,
                           [sb, b.global_scale_inv.reshape(())], recipes, swizzles, swizzles,
                           output_dtype=out_dtype), None, None
    if choice.path == SCALED_MM_MX:
        lhs = a.data if _row_major(a.data) else a.data.contiguous()
        rhs = b.data if _col_major(b.data) else b.data.t().contiguous().t()
        sa, sb = mx_scale(a, 1), mx_scale(b, 0)
        if target.kind == "cpu":  # F.scaled_mm has no MX kernel on the CPU: its reference, on the same operands
            problem = mx_call_problem(lhs, rhs, sa, sb, out_dtype, target)
            if problem is not None:
                raise RuntimeError(f"fp8_mm: internal error, the MXFP8 call breaks the GPU's rules: {problem}")
            return ops.mx_mm(lhs, rhs, sa, sb, out_dtype), None, None
        return _scaled_mm_mx(lhs, rhs, sa, sb, out_dtype, target), None, None
    if choice.path == TRITON_BLOCK:
        return ops.block_mm(a.data, a.scale_inv, list(a.block), b.data, b.scale_inv, list(b.block), out_dtype), None, None
    lhs = a.data if _row_major(a.data) else a.data.contiguous()
    rhs = b.data if _col_major(b.data) else b.data.t().contiguous().t()
    if choice.path == SCALED_MM_TENSORWISE:
        return _scaled_mm(lhs, rhs, a.scale_inv, b.scale_inv, out_dtype, target), None, None
    sa, sb = _outer(a, rows=True), _outer(b, rows=False)
    if choice.path == SCALED_MM_ROWWISE:
        return _scaled_mm(lhs, rhs, sa, sb, out_dtype, target), None, None
    unit = _unit(a.data.device)
    out = _scaled_mm(lhs, rhs, unit, unit, torch.float32, target)
    if defer_scales:
        return out, sa, sb
    return ops.apply_scales(out, sa, sb, out_dtype), None, None


def _scaled_mm(mat1, mat2, scale_a, scale_b, out_dtype, target: GemmTarget) -> torch.Tensor:
    """``torch._scaled_mm``, every call of this module, checked first (:func:`scaled_mm_call_problem`)."""
    problem = scaled_mm_call_problem(mat1, mat2, scale_a, scale_b, out_dtype, target)
    if problem is not None:  # gemm_path ruled this out: a bug here, not a user error
        raise RuntimeError(f"fp8_mm: internal error, the torch._scaled_mm call breaks the GPU's rules: {problem}")
    return torch._scaled_mm(mat1, mat2, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def _scaled_mm_mx(mat_a, mat_b, scale_a, scale_b, out_dtype, target: GemmTarget) -> torch.Tensor:
    """The MXFP8 ``F.scaled_mm`` call, checked first (:func:`mx_call_problem`)."""
    problem = mx_call_problem(mat_a, mat_b, scale_a, scale_b, out_dtype, target)
    if problem is not None:
        raise RuntimeError(f"fp8_mm: internal error, the MXFP8 F.scaled_mm call breaks the GPU's rules: {problem}")
    F = torch.nn.functional
    swz = F.SwizzleType.SWIZZLE_32_4_4
    return F.scaled_mm(mat_a, mat_b, scale_a, F.ScalingType.BlockWise1x32, scale_b, F.ScalingType.BlockWise1x32,
                       swizzle_a=swz, swizzle_b=swz, output_dtype=out_dtype)


def _inverse(scale: torch.Tensor) -> torch.Tensor:
    return scale.to(torch.float32).reciprocal()


def fp8_mm_payload(
    a_payload: torch.Tensor,
    a_scale: torch.Tensor,
    b_payload: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    a_block: Block | None = None,
    b_block: Block | None = None,
    target: GemmTarget | None = None,
) -> torch.Tensor:
    """:func:`fp8_mm` on plain FP8 payloads (``torch.float8_*`` tensors, ``a_payload`` M x K and ``b_payload`` K x N)
    and their fp32 scales (``value = payload / scale``: 0-d, or grids of ``a_block``/``b_block``, module docstring):
    :func:`mm` on their :class:`Operand` (the reciprocals taken here). Same rules, same fallback, same errors.

    The path is :func:`gemm_path`'s for ``target`` (default: the operands' device). Another ``target`` is for
    audits and tests: the chosen path runs on the operands' own device, so it must be able to run there (e.g.
    ``meta`` operands with a CUDA target replay the CUDA ``_scaled_mm`` calls against torch's ``meta`` kernel)."""
    a_block = None if is_tensorwise(a_block) else a_block
    b_block = None if is_tensorwise(b_block) else b_block
    return mm(Operand(a_payload, _inverse(a_scale), a_block), Operand(b_payload, _inverse(b_scale), b_block),
              out_dtype, backend, target)


def fp8_mm(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype = torch.float32, backend: str = "auto"
) -> torch.Tensor:
    """``a @ b`` for FP8 operands ``a`` (M x K) and ``b`` (K x N), accumulated in fp32, in ``out_dtype``.

    ``backend="scaled_mm"`` raises a ``ValueError`` naming the fix when the hardware path cannot
    run; ``"auto"`` falls back to the emulated path then (logged once per reason). The work is
    :func:`fp8_mm_payload`'s, on the operands' payloads and scales.
    """
    if backend not in GEMM_BACKENDS:
        raise ValueError(f"backend must be one of {GEMM_BACKENDS}, got {backend!r}")
    a_parts, b_parts = payload_and_scale(a), payload_and_scale(b)
    if a_parts is None or b_parts is None:
        raise TypeError("fp8_mm takes two Float8Tensor operands; quantize with fp8.to_float8 first")
    return fp8_mm_payload(*a_parts, *b_parts, out_dtype, backend)


_LOGGED_FALLBACKS: set[str] = set()


def _log_fallback(problem: str) -> None:
    if problem not in _LOGGED_FALLBACKS:
        _LOGGED_FALLBACKS.add(problem)
        logger.info("fp8_mm: using the emulated GEMM: %s", problem)
