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
- The quantizers here are the torch reference (82 launches for a row-wise operand, 105 for a column-wise one with the
  transform, counted on the CPU); the fused Triton kernels are not written yet.
"""

from __future__ import annotations

import torch

from .blocks import dequantize_blocks
from .fp4 import NVFP4Operand, dequantize_nvfp4, hadamard_transform, quantize_nvfp4, random_hadamard
from .gemm import Operand
from .quantizers import ActivationQuantizer, LinearQuantizers, WeightQuantizer
from .tensor import cached_operand

__all__ = ["NVFP4_TILE", "NVFP4_TILE_T", "NVFP4_BLOCK", "HADAMARD_SIGNS", "NVFP4Quantizer", "NVFP4WeightQuantizer",
           "make_quantizers"]

NVFP4_TILE = (1, 16)
NVFP4_TILE_T = (16, 1)
NVFP4_BLOCK = (16, 16)
TOKEN_PAD = 32
HADAMARD_SIGNS = (1, -1, -1, 1, 1, 1, -1, 1, -1, 1, 1, -1, 1, -1, -1, -1)
"""The random sign diagonal of the weight-gradient GEMM's Hadamard transform (drawn once, fixed: every rank and every
linear uses the same ``H``)."""


def _operand(q) -> Operand:
    return Operand(q.data, q.scale_inv(), q.block, global_scale_inv=q.global_scale_inv)


class NVFP4Quantizer(ActivationQuantizer):
    """An activation role of an NVFP4 linear (module docstring): 1x16 blocks along the features (row-wise operand),
    and for the weight-gradient GEMM the tokens zero-padded to 32, optionally Hadamard-transformed along them, then
    1x16 blocks along them (column-wise operand, ``(features, tokens)``). ``stochastic``: stochastic rounding."""

    pad = TOKEN_PAD
    per_token = False  # the per-tensor scale depends on all the rows: a group's rows quantized alone differ

    def __init__(self, stochastic: bool, hadamard: bool) -> None:
        self.fmt = "e2m1"
        self.stochastic = stochastic
        self.hadamard = hadamard

    def _rows(self, x: torch.Tensor) -> Operand:
        return _operand(quantize_nvfp4(x, NVFP4_TILE, self.stochastic))

    def columnwise(self, x: torch.Tensor) -> Operand:
        tokens = x.shape[0]
        padded = -(-tokens // TOKEN_PAD) * TOKEN_PAD
        values = x.to(torch.float32)
        if padded != tokens:
            values = torch.nn.functional.pad(values, (0, 0, 0, padded - tokens))
        if self.hadamard:
            h = random_hadamard(torch.tensor(HADAMARD_SIGNS, dtype=torch.float32, device=x.device))
            values = hadamard_transform(values, h, 0)
        return _operand(quantize_nvfp4(values.t().contiguous(), NVFP4_TILE, self.stochastic))

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
    the same 16x16 scales."""

    block = NVFP4_BLOCK

    @staticmethod
    def _operands(payload, scale, weight) -> tuple[Operand, Operand]:
        def build():
            w = dequantize_blocks(payload, scale, NVFP4_BLOCK, torch.float32)
            amax = w.abs().amax()
            forward = quantize_nvfp4(w, NVFP4_BLOCK, global_amax=amax)             # (out, in / 2)
            dgrad = quantize_nvfp4(w.t().contiguous(), NVFP4_BLOCK, global_amax=amax)  # (in, out / 2)
            return (forward.data, forward.scale_inv(), forward.global_scale_inv, dgrad.data, dgrad.scale_inv())

        return cached_operand(weight, payload, scale, ("nvfp4",), build)

    def forward_b(self, payload, scale, weight, backend, target=None):
        data, inv, g, _, _ = self._operands(payload, scale, weight)
        return Operand(data.t(), inv.t(), NVFP4_BLOCK, global_scale_inv=g)  # W^T: (in, out), packed along in

    def dgrad_b(self, payload, scale, weight, a, out_dtype, backend, target=None):
        _, _, g, data_t, inv_t = self._operands(payload, scale, weight)
        return Operand(data_t.t(), inv_t.t(), NVFP4_BLOCK, global_scale_inv=g)  # W: (out, in), packed along out


def make_quantizers(input_state, grad_output_state, weight_fmt: str, *, hadamard: bool = True,
                    stochastic_rounding: bool = True) -> LinearQuantizers:
    """The quantizers of an NVFP4 linear: the input rounded to nearest, the output gradient stochastically (unless
    ``stochastic_rounding`` is False), both Hadamard-transformed for the weight gradient (unless ``hadamard`` is
    False); the E4M3 16x16 weight's NVFP4 copies."""
    return LinearQuantizers(NVFP4Quantizer(False, hadamard), NVFP4Quantizer(stochastic_rounding, hadamard),
                            NVFP4WeightQuantizer())
