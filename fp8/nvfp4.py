"""The NVFP4 recipe (NVIDIA Blackwell): E2M1 values with one E4M3 scale per 16 elements along each GEMM's K and one
per tensor (:mod:`fp8.fp4`), for inputs, weights and output gradients, after NVIDIA's NVFP4 pretraining recipe.

=============  ===================================  ==========================================================
operand        forward / input-gradient GEMMs       weight-gradient GEMM (K = the tokens)
=============  ===================================  ==========================================================
x              1x16, round to nearest               16x16 random Hadamard transform along the tokens, then 1x16
                                                    along them, round to nearest
dY             1x16, stochastic rounding            the same transform, 1x16 along the tokens, stochastic
W              16x16 blocks (``W`` and ``W^T``      -
               share them), round to nearest
=============  ===================================  ==========================================================

- **Weights at rest** are E4M3 in 16x16 blocks (a :class:`fp8.Float8Tensor`, 1 byte per element, the form every
  opt level, the FP8 optimizers, collectives and checkpoints already hold and move); the NVFP4 copies the GEMMs read
  (packed along ``in`` for the forward, along ``out`` for the input gradient, with the same 16x16 scales) are made from
  it once per optimizer step and kept with the weight (:func:`fp8.tensor.cached_operand`), 1.0 byte per element for
  both plus scales. Why not E2M1 at rest: an E2M1 weight cannot be updated in place by the FP8 optimizers' E4M3
  arithmetic, and an E4M3 master of the FP4 copy costs the same byte the E4M3 weight does; the price is a second
  rounding (E4M3 then E2M1, the first 2**-4 relative against E2M1's 2**-2).
- **Stochastic rounding** of the output gradient's operands (``Float8LinearConfig(fp4_stochastic_rounding=False)``,
  ``--no-fp4-stochastic-rounding``, rounds to nearest); the forward rounds to nearest.
- **The random Hadamard transform** on both weight-gradient operands along the tokens (``fp4_hadamard=False``,
  ``--no-fp4-hadamard``, leaves it out): one fixed 16x16 sign pattern (:data:`HADAMARD_SIGNS`) for every linear, so
  ``(dY^T H)(H^T x) = dY^T x``.
- The tokens of the weight-gradient operands are zero-padded to 32 (the GEMM's K multiple).
- GEMMs: ``F.scaled_mm`` with ``[BlockWise1x16, TensorWise]`` scales (:func:`fp8.gemm.gemm_path`'s
  ``scaled_mm_nvfp4``) on compute capability >= 10.0; the exact emulation on the CPU (unpacked E2M1 times the exact
  fp32 scale products, an fp32 matmul). Older GPUs refuse the recipe at start-up.
- Fused kernels (:mod:`fp8.fp4`'s custom ops, Triton on CUDA): an activation operand is two launches, its amax then
  one pass that transforms, transposes, scales, rounds, packs and writes the GEMM's swizzled E4M3 scales (no
  swizzle kernel per GEMM); a weight's two copies are three launches per optimizer step (the amax and two quantize
  passes, reading the E4M3 payload and its 16x16 scales).
"""

from __future__ import annotations

import torch

from . import ops
from .fp4 import NVFP4Operand, dequantize_nvfp4, nvfp4_amax, nvfp4_quantize, sign_mask
from .gemm import Operand
from .quantizers import ActivationQuantizer, LinearQuantizers, WeightQuantizer
from .tensor import Float8Tensor, cached_operand, refresh_cached_operands

__all__ = ["NVFP4_TILE", "NVFP4_TILE_T", "NVFP4_BLOCK", "HADAMARD_SIGNS", "NVFP4Quantizer", "NVFP4WeightQuantizer",
           "make_quantizers", "refresh_weight_operands"]

NVFP4_TILE = (1, 16)
NVFP4_TILE_T = (16, 1)
NVFP4_BLOCK = (16, 16)
TOKEN_PAD = 32
HADAMARD_SIGNS = (1, -1, -1, 1, 1, 1, -1, 1, -1, 1, 1, -1, 1, -1, -1, -1)
"""The random sign diagonal of the weight-gradient GEMM's Hadamard transform (drawn once, fixed: every rank and every
linear uses the same ``H``)."""


def _fused(out, block: tuple[int, int]) -> Operand:
    """The Operand of :func:`fp8.fp4.nvfp4_quantize`'s outputs (its swizzled scales as :attr:`Operand.hw_scale`)."""
    data, scale_inv, hw, global_scale_inv = out
    return Operand(data.view(torch.float4_e2m1fn_x2), scale_inv, block, hw_scale=hw, global_scale_inv=global_scale_inv)


class NVFP4Quantizer(ActivationQuantizer):
    """An activation role of an NVFP4 linear (module docstring): 1x16 blocks along the features (row-wise operand),
    and for the weight-gradient GEMM the tokens zero-padded to 32, optionally Hadamard-transformed along them, then
    1x16 blocks along them (column-wise operand, ``(features, tokens)``). ``stochastic``: stochastic rounding. Each
    operand is two launches: its amax (:func:`fp8.ops.amax`, or :func:`fp8.fp4.nvfp4_amax` of the transformed
    tokens), then :func:`fp8.fp4.nvfp4_quantize` (transform, transpose, scales, E2M1, packing and the GEMM's swizzled
    scales in one pass)."""

    pad = TOKEN_PAD
    per_token = False  # the per-tensor scale depends on all the rows: a group's rows quantized alone differ

    def __init__(self, stochastic: bool, hadamard: bool, state=None) -> None:
        self.fmt = "e2m1"
        self.stochastic = stochastic
        self.hadamard = hadamard
        self.state = state  # the role's fp8.scaling.ScalingState: the stochastic rounding's seeds (rounding_seed)
        self.signs = sign_mask(HADAMARD_SIGNS) if hadamard else -1

    def _seed(self) -> int:
        if not self.stochastic:
            return 0
        if self.state is None:  # a linear without scaling states (fp8.grouped_gemm's experts): a draw per call from
            return int(torch.randint(0, 2**30, ()).item())  # torch's CPU generator (host work, no device launch)
        return self.state.rounding_seed()

    def _rows(self, x: torch.Tensor) -> Operand:
        amax2 = ops.amax(x)
        if self.state is not None and self.state.amax_comm is not None:
            # a tensor-parallel linear: its ranks agree on the per-tensor scale, so rows all-gathered for sequence
            # parallelism share one (the NVFP4 GEMM takes one per operand); one small all-reduce on the device
            self.state.amax_comm.all_reduce(amax2, op=torch.distributed.ReduceOp.MAX, tag="fp8 amax").wait()
        return _fused(nvfp4_quantize(x, amax2, 1, False, 1, -1, self.stochastic, self._seed()), NVFP4_TILE)

    def columnwise(self, x: torch.Tensor) -> Operand:
        amax2 = nvfp4_amax(x, self.signs, True) if self.hadamard else ops.amax(x)
        return _fused(nvfp4_quantize(x, amax2, 1, True, TOKEN_PAD, self.signs, self.stochastic, self._seed()),
                      NVFP4_TILE)

    def quantize(self, x, record, columnwise, dst_cols=None, t_width=0):
        if dst_cols is not None:
            raise ValueError("the nvfp4 recipe quantizes grouped tokens group by group (fp8.linear's grouped core does)")
        return self._rows(x), (self.columnwise(x) if columnwise else None)

    def columnwise_from(self, rows, dst_cols=None, t_width=0):
        """From the row-wise operand's values (rows gathered over a sequence-parallel group, or a group's rows): a
        second rounding, E2M1 to E2M1 in other blocks."""
        return self.columnwise(dequantize_nvfp4_operand(rows))


def dequantize_nvfp4_operand(op: Operand) -> torch.Tensor:
    """The fp32 values of a row-wise NVFP4 operand (packed along its rows)."""
    block_scales = (op.scale_inv / op.global_scale_inv).to(torch.float8_e4m3fn)
    return dequantize_nvfp4(NVFP4Operand(op.data, block_scales, op.global_scale_inv, op.block))


class NVFP4WeightQuantizer(WeightQuantizer):
    """An E4M3 weight in 16x16 blocks as the NVFP4 GEMMs' operands (module docstring), made once per optimizer step
    and kept with the weight: ``W`` packed along ``in`` (the forward's K) and along ``out`` (the input gradient's K),
    the same 16x16 scales, each with its swizzled scales (:func:`fp8.fp4.nvfp4_quantize`, one launch each, reading
    the E4M3 payload and its scales, after their amax: three launches per weight per step)."""

    block = NVFP4_BLOCK

    @staticmethod
    def _operands(payload, scale, weight) -> tuple[torch.Tensor, ...]:
        """:func:`_operands_from`'s eight tensors, kept with the weight until it is written."""
        return cached_operand(weight, payload, scale, _KEY, lambda: _operands_from(payload, scale))

    def forward_b(self, payload, scale, weight, backend, target=None):
        data, inv, hw, g = self._operands(payload, scale, weight)[:4]
        return _fused((data, inv, hw, g), NVFP4_BLOCK).t  # W^T: (in, out), packed along in

    def dgrad_b(self, payload, scale, weight, a, out_dtype, backend, target=None):
        data_t, inv_t, hw_t, g = self._operands(payload, scale, weight)[4:]
        return _fused((data_t, inv_t, hw_t, g), NVFP4_BLOCK).t  # W: (out, in), packed along out


_KEY = ("nvfp4",)


def _operands_from(payload: torch.Tensor, scale: torch.Tensor) -> tuple:
    """A weight's two NVFP4 copies (forward, then input gradient: data, scale_inv, swizzled scales, global scale
    each), in three launches from the E4M3 payload and its 16x16 scales (never dequantized in memory)."""
    amax2 = nvfp4_amax(payload, -1, False, scale)
    forward = nvfp4_quantize(payload, amax2, 16, False, 1, -1, False, 0, scale)  # (out, in / 2)
    dgrad = nvfp4_quantize(payload, amax2, 16, True, 1, -1, False, 0, scale)    # (in, out / 2)
    return forward + dgrad


def refresh_weight_operands(params) -> None:
    """After an optimizer step wrote NVFP4 weights (E4M3 in 16x16 blocks): each weight among ``params`` holding a
    stale pair of NVFP4 copies gets them made again at the end of the step instead of at its next forward (three
    launches per weight: :func:`_operands_from`). A weight that never ran a forward keeps none."""
    if torch.compiler.is_compiling():
        return
    weights = [p for p in params if isinstance(p, Float8Tensor) and p.block == NVFP4_BLOCK]
    refresh_cached_operands(weights, _KEY, lambda stale: [_operands_from(w.payload, w.scale) for w, _ in stale])


def make_quantizers(input_state, grad_output_state, weight_fmt: str, *, hadamard: bool = True,
                    stochastic_rounding: bool = True) -> LinearQuantizers:
    """The quantizers of an NVFP4 linear: the input rounded to nearest, the output gradient stochastically (unless
    ``stochastic_rounding`` is False), both Hadamard-transformed for the weight gradient (unless ``hadamard`` is
    False); the E4M3 16x16 weight's NVFP4 copies."""
    return LinearQuantizers(NVFP4Quantizer(False, hadamard, input_state),
                            NVFP4Quantizer(stochastic_rounding, hadamard, grad_output_state), NVFP4WeightQuantizer())
