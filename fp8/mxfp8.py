"""The MXFP8 recipe (OCP Microscaling, NVIDIA Blackwell): E4M3 values, one power-of-two (E8M0) scale per 32 elements
along each GEMM's K, for inputs, weights and output gradients.

=============  ==========================  ==========================  ==========================
operand        forward ``x @ W^T``         input grad ``dY @ W``       weight grad ``dY^T @ x``
=============  ==========================  ==========================  ==========================
activations    x: 1x32 (along features)    dY: 1x32 (along features)   dY, x: 32x1 (along tokens)
weight         W: 32x32 blocks             W: the same 32x32 blocks
=============  ==========================  ==========================  ==========================

Activations and output gradients are quantized once per use into both orientations from one read of each 32x32 square,
with both operands' swizzled E8M0 scales written by the same kernel (:func:`fp8.ops.quantize_mx`: Triton on CUDA, its
torch reference elsewhere), the tokens of the weight-gradient operands zero-padded to 32. Scales are fp8's power-of-two scales (:func:`fp8.ops.power_of_two_scale`:
the block's amax mapped into ``(224, 448]``, so no value saturates; the OCP spec's ``floor(log2(amax)) - 8`` exponent
may put up to 2x of headroom past 448 and clamp), and a power of two is an E8M0 value exactly.

**Weights at rest** are one E4M3 payload in 32x32 blocks (1 byte per element plus one scale per 1,024 elements): each
block gives one scale per 32 elements along K to the forward GEMM (``W^T``, K = in) and to the input-gradient GEMM
(``W``, K = out), so both GEMMs multiply by the same quantized weight (the input gradient is the exact gradient of the
forward's function of W's FP8 values), there is no second copy to re-quantize, and every opt level keeps the format it
trains with (no E4M3-per-tensor copy from which an MX copy is made each step). The price against 1x32 weight blocks:
an outlier raises the scale of 32 rows instead of one (measured in ``benchmarks/microscaling.py``). On Blackwell the
input-gradient GEMM reads ``W`` column-major, so, as for a tensor-wise weight, its transpose is made once per optimizer
step and kept with the weight, with both GEMMs' swizzled E8M0 scales (:attr:`fp8.gemm.Operand.hw_scale`), made again
at the end of every optimizer step (:func:`refresh_weight_operands`); elsewhere (the emulation) nothing is kept.

GEMMs: ``F.scaled_mm`` with ``BlockWise1x32`` scales in cuBLAS's swizzled layout on compute capability >= 10.0
(:func:`fp8.gemm.gemm_path`'s ``scaled_mm_mx``); the exact emulation on the CPU and with ``gemm_backend="emulated"``.
A GPU of compute capability < 10.0 refuses the recipe at start-up (:func:`fp8.recipes.Recipe.hardware_problem`).
"""

from __future__ import annotations

import torch

from . import ops
from .blocks import MX_BLOCK, MX_TILE, MX_TILE_T
from .gemm import SCALED_MM_MX, GemmTarget, Operand, gemm_path
from .microscaling import MX_K_BLOCK
from .quantizers import LinearQuantizers, TileQuantizer, WeightQuantizer
from .scaling import ScalingState
from .tensor import Float8Tensor, cached_operand, refresh_cached_operands

__all__ = ["MX_K_BLOCK", "MX_TILE", "MX_TILE_T", "MX_BLOCK", "MXWeightQuantizer", "MXTileQuantizer", "make_quantizers",
           "refresh_weight_operands"]


def _runs_mx(payload: torch.Tensor, backend: str, target: GemmTarget | None) -> bool:
    """Whether a weight's GEMMs run the MXFP8 hardware GEMM on ``target`` (default: the payload's device)."""
    target = target or GemmTarget.of(payload.device)
    out = torch.bfloat16
    return gemm_path(payload.t(), payload, out, target, backend, MX_TILE, MX_BLOCK).path == SCALED_MM_MX


def _operands_from(payload: torch.Tensor, inv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A 32x32-block weight's kept operands from its payload and ``scale_inv`` grid ``inv``: ``(inv, W^T row-major,
    the forward's swizzled E8M0 scales (N = out), the input gradient's (N = in))``."""
    n, k = payload.shape
    return inv, payload.t().contiguous(), ops.mx_scales(inv, n, MX_K_BLOCK), ops.mx_scales(inv.t(), k, MX_K_BLOCK)


class MXWeightQuantizer(WeightQuantizer):
    """An MXFP8 weight in 32x32 blocks (module docstring): ``W^T`` for the forward GEMM, ``W`` for the input gradient,
    both from the one payload; on the hardware GEMM the transposed copy and both swizzled E8M0 scale tensors are kept
    with the weight (made once per optimizer step)."""

    block = MX_BLOCK

    @staticmethod
    def _operands(payload, scale, weight) -> tuple[torch.Tensor, ...]:
        """``(scale_inv grid, W row-major transposed copy, forward hw scales, input-gradient hw scales)``."""
        return cached_operand(weight, payload, scale, ("mx",), lambda: _operands_from(payload, scale.reciprocal()))

    def forward_b(self, payload, scale, weight, backend, target=None):
        if not _runs_mx(payload, backend, target):
            return Operand(payload.t(), scale.reciprocal().t(), MX_BLOCK)
        inv, _, forward, _ = self._operands(payload, scale, weight)
        return Operand(payload.t(), inv.t(), MX_BLOCK, forward)

    def dgrad_b(self, payload, scale, weight, a, out_dtype, backend, target=None):
        if not _runs_mx(payload, backend, target):
            return Operand(payload, scale.reciprocal(), MX_BLOCK)
        inv, payload_t, _, dgrad = self._operands(payload, scale, weight)
        return Operand(payload_t.t(), inv, MX_BLOCK, dgrad)


def refresh_weight_operands(params) -> None:
    """After an optimizer step wrote MXFP8 weights: the operands they keep for the Blackwell GEMMs (module docstring)
    made again for every weight among ``params`` holding a stale set, at the end of the step instead of at each
    weight's next forward: the ``scale_inv`` grids rewritten in place by two multi-tensor kernels for all (copy,
    reciprocal), then per weight its transpose (one copy kernel) and both GEMMs' swizzled E8M0 scales
    (:func:`fp8.ops.mx_scales`, one kernel each): 3 launches per weight and step."""
    if torch.compiler.is_compiling():
        return
    weights = [p for p in params if isinstance(p, Float8Tensor) and p.block == MX_BLOCK]

    def rebuild(stale):
        invs = [value[0] for _, value in stale]
        torch._foreach_copy_(invs, [w.scale for w, _ in stale])
        torch._foreach_reciprocal_(invs)
        return [_operands_from(w.payload, inv) for (w, _), inv in zip(stale, invs)]

    refresh_cached_operands(weights, ("mx",), rebuild)


class MXTileQuantizer(TileQuantizer):
    """An MXFP8 activation role: 1x32 tiles and, from the same read, 32x1 tiles along the tokens written transposed
    (:class:`fp8.quantizers.TileQuantizer` with ``tile=32``), each operand with the swizzled E8M0 scales the hardware
    GEMM reads (:attr:`fp8.gemm.Operand.hw_scale`), all from one kernel (:func:`fp8.ops.quantize_mx`)."""

    def __init__(self, fmt: str = "e4m3") -> None:
        super().__init__(fmt, MX_K_BLOCK)

    def quantize(self, x, record, columnwise, dst_cols=None, t_width=0):
        if dst_cols is not None:
            raise ValueError("the mxfp8 recipe quantizes grouped tokens group by group (fp8.linear's grouped core does)")
        data, inv, hw, data_c, inv_c, hw_c = ops.quantize_mx(x, self.fmt, columnwise, self.pad)
        return (Operand(data, inv, MX_TILE, hw),
                Operand(data_c, inv_c, MX_TILE, hw_c) if columnwise else None)

    def columnwise(self, x):
        _, _, _, data_c, inv_c, hw_c = ops.quantize_mx(x, self.fmt, True, self.pad)
        return Operand(data_c, inv_c, MX_TILE, hw_c)

    def columnwise_from(self, rows, dst_cols=None, t_width=0):
        if dst_cols is not None:
            raise ValueError("the mxfp8 recipe quantizes grouped tokens group by group (fp8.linear's grouped core does)")
        _, _, _, data_c, inv_c, hw_c = ops.quantize_mx(rows.data, self.fmt, True, self.pad, rows.scale_inv)
        return Operand(data_c, inv_c, MX_TILE, hw_c)


def make_quantizers(input_state: ScalingState, grad_output_state: ScalingState, weight_fmt: str) -> LinearQuantizers:
    """The quantizers of an MXFP8 linear: 1x32 / 32x1 tiles for the input and output gradient (E4M3, current scales:
    the scaling states are not used) with their swizzled scales, 32x32 blocks for the weight."""
    return LinearQuantizers(MXTileQuantizer(), MXTileQuantizer(), MXWeightQuantizer())
