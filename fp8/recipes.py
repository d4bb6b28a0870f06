"""FP8 scaling recipes: which block of each GEMM operand shares one scale (:mod:`fp8.blocks`).

An FP8 linear ``y = x @ W^T`` runs three GEMMs; each operand's scales must be constant along the
dimension the GEMM sums over, or vary in the 128-element K blocks the block GEMM takes:

=============  =====================  =====================  ======================================
recipe         forward ``x @ W^T``    input grad ``dY @ W``  weight grad ``dY^T @ x``
=============  =====================  =====================  ======================================
tensorwise     x: tensor, W: tensor   dY: tensor, W: tensor  dY: tensor, x: tensor
rowwise        x: per token (row),    dY: per token,         dY: per output feature (column),
               W: per output channel  W: per input channel   x: per input feature (column)
blockwise      x: 1x128 tiles,        dY: 1x128 tiles,       dY: 128x1 tiles, x: 128x1 tiles
               W: 128x128 blocks      W: 128x128 blocks
=============  =====================  =====================  ======================================

``mxfp8`` (:mod:`fp8.mxfp8`, NVIDIA Blackwell) scales 1x32 activation tiles, 32x1 along the tokens for the weight
gradient, and 32x32 weight blocks, with power-of-two (E8M0) scales, E4M3 everywhere; its GEMMs run on compute
capability >= 10.0 (:meth:`Recipe.hardware_problem` refuses older GPUs) and are emulated exactly on the CPU.
``nvfp4`` (:mod:`fp8.nvfp4`, Blackwell) runs the GEMMs in E2M1 with E4M3 scales per 16 along K and one per tensor
(1x16 activation tiles, 16x16 weight blocks; the weight held as E4M3 in 16x16 blocks), stochastic rounding of the
output gradient and a 16x16 random Hadamard transform on the weight-gradient operands.

``tensorwise`` is FP8-LM's recipe: delayed scaling of activations (E4M3) and output gradients (E5M2),
each from its own amax history. ``rowwise`` and ``blockwise`` scale every block from its own current amax
and use E4M3 everywhere (fine scales leave E5M2's range unneeded: twice the precision). Operands whose
GEMM needs another layout than the one they are held in are re-quantized from their exact dequantized
values (the rowwise weight for the input gradient, the saved activation and the output gradient for the
weight gradient): with power-of-two scales that is exact except for values that fall below the normal
range of their new block. On CUDA, row-wise GEMMs writing fp32 or fp16 (the weight gradient always; forward
and input gradient of models not in bf16), which CUDA's row-wise ``torch._scaled_mm`` cannot write, run a
tensor-wise FP8 GEMM with the row and column scales applied after it in fp32 (:mod:`fp8.gemm`): not emulated,
not rounded to bf16.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import mxfp8, nvfp4
from .blocks import BLOCK, COLWISE, MX_BLOCK, MX_TILE, MX_TILE_T, ROWWISE, TENSORWISE, TILE, TILE_T, Block
from .nvfp4 import NVFP4_BLOCK, NVFP4_TILE, NVFP4_TILE_T
from .gemm import GEMM_BACKENDS, GemmTarget
from .microscaling import BLACKWELL, microscaling_problem
from .quantizers import refresh_weight_operands as _refresh_core_operands
from .quantizers import (
    GEMM_PAD, BlockWeightQuantizer, LinearQuantizers, RowwiseQuantizer, RowwiseWeightQuantizer,
    TensorwiseQuantizer, TensorwiseWeightQuantizer, TileQuantizer,
)
from .scaling import ScalingState

__all__ = ["RECIPES", "Recipe", "get_recipe", "BLOCKWISE_TILE", "LinearQuantizers", "refresh_weight_operands"]

RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4")
"""Names of the scaling recipes (``fp8.initialize(recipe=...)``, ``Float8LinearConfig(recipe=...)``)."""

BLOCKWISE_TILE = 128
"""Tile and block edge of the ``blockwise`` recipe: layers whose dimensions are not multiples of it run
``tensorwise`` (logged)."""


@dataclass(frozen=True)
class Recipe:
    """Blocks of every operand of an FP8 linear's three GEMMs (2-D views: x ``(tokens, in)``, W ``(out, in)``,
    dY ``(tokens, out)``), and the format of output gradients."""

    name: str
    input: Block             # x, forward
    weight: Block            # W at rest, forward (and input gradient where ``dgrad_weight`` is the same)
    grad_output: Block       # dY, input gradient
    dgrad_weight: Block      # W, input gradient
    wgrad_grad_output: Block  # dY, weight gradient (taken transposed)
    wgrad_input: Block       # x, weight gradient
    grad_fmt: str            # dY's format in the rowwise/blockwise recipes (tensorwise: the config's)
    tile: int = 0            # K block of the GEMMs (128 blockwise, 32 mxfp8): layer widths must be multiples of it
    min_capability: tuple[int, int] | None = None  # the CUDA compute capability its hardware GEMMs need
    factory: Callable[..., LinearQuantizers] | None = None  # the recipe module's make_quantizers (mxfp8, nvfp4)
    options: tuple[tuple[str, object], ...] = ()  # keyword options of the factory (nvfp4: hadamard, stochastic_rounding)

    @property
    def tensorwise(self) -> bool:
        """Whether one scale covers each tensor (delayed or current scaling from the linear's scaling states)."""
        return self.name == "tensorwise"

    @property
    def blockwise(self) -> bool:
        """Whether scales vary along K in 128-element blocks (the block GEMM, dimensions in multiples of 128)."""
        return self.name == "blockwise"

    @property
    def token_multiple(self) -> int:
        """The multiple a weight-gradient GEMM's K (the tokens) is padded to: 16 for ``torch._scaled_mm``, the K block
        otherwise (128 for the block GEMM, 32 for MXFP8)."""
        return max(self.tile, GEMM_PAD)

    def dims_problem(self, in_features: int, out_features: int) -> str | None:
        """Why a linear of these widths cannot run this recipe (its GEMMs' K blocks must tile both), or None."""
        if self.tile and (in_features % self.tile or out_features % self.tile):
            return (f"in_features={in_features}, out_features={out_features} are not multiples of the {self.name} "
                    f"recipe's {self.tile}-element blocks")
        return None

    def hardware_problem(self, target: GemmTarget, backend: str = "auto") -> str | None:
        """Why this recipe cannot start on ``target`` with GEMM ``backend``, naming the GPU generation it needs and
        the fix, or None: a CUDA GPU older than :attr:`min_capability` has no hardware GEMM for it, and emulating
        every GEMM there would be silently slow (``backend="emulated"`` asks for exactly that, and is allowed); the
        CPU runs the exact emulation."""
        if backend not in GEMM_BACKENDS:
            raise ValueError(f"backend must be one of {GEMM_BACKENDS}, got {backend!r}")
        if self.min_capability is None or backend == "emulated" or target.kind == "cpu":
            return None
        return microscaling_problem(target.kind, target.capability, self.name.upper())

    def grad_format(self, configured: str) -> str:
        """The output gradient's format: ``configured`` (the linear's ``grad_output.fmt``) under ``tensorwise``, the
        recipe's own (E4M3: fine scales leave E5M2's range unneeded) otherwise."""
        return configured if self.tensorwise else self.grad_fmt

    def make_quantizers(self, input_state: ScalingState, grad_output_state: ScalingState,
                        weight_fmt: str) -> "LinearQuantizers":
        """One quantizer per tensor role of a linear (:mod:`fp8.quantizers`): the input and output gradient (with the
        linear's scaling states under ``tensorwise``), and the weight held at rest in :attr:`weight` blocks."""
        if self.factory is not None:
            return self.factory(input_state, grad_output_state, weight_fmt, **dict(self.options))
        if self.tensorwise:
            return LinearQuantizers(TensorwiseQuantizer(input_state), TensorwiseQuantizer(grad_output_state),
                                    TensorwiseWeightQuantizer())
        if self.blockwise:
            return LinearQuantizers(TileQuantizer("e4m3", state=input_state),
                                    TileQuantizer(self.grad_fmt, state=grad_output_state), BlockWeightQuantizer())
        return LinearQuantizers(RowwiseQuantizer("e4m3", input_state), RowwiseQuantizer(self.grad_fmt, grad_output_state),
                                RowwiseWeightQuantizer(weight_fmt))


_RECIPES = {
    "tensorwise": Recipe("tensorwise", TENSORWISE, TENSORWISE, TENSORWISE, TENSORWISE, TENSORWISE, TENSORWISE,
                         "e5m2"),
    "rowwise": Recipe("rowwise", ROWWISE, ROWWISE, ROWWISE, COLWISE, COLWISE, COLWISE, "e4m3"),
    "blockwise": Recipe("blockwise", TILE, BLOCK, TILE, BLOCK, TILE_T, TILE_T, "e4m3", tile=BLOCKWISE_TILE),
    "mxfp8": Recipe("mxfp8", MX_TILE, MX_BLOCK, MX_TILE, MX_BLOCK, MX_TILE_T, MX_TILE_T, "e4m3", tile=mxfp8.MX_K_BLOCK,
                    min_capability=BLACKWELL, factory=mxfp8.make_quantizers),
    "nvfp4": Recipe("nvfp4", NVFP4_TILE, NVFP4_BLOCK, NVFP4_TILE, NVFP4_BLOCK, NVFP4_TILE_T, NVFP4_TILE_T, "e4m3",
                    tile=32, min_capability=BLACKWELL, factory=nvfp4.make_quantizers),
}


def get_recipe(name: str) -> Recipe:
    """The :class:`Recipe` called ``name``; a ``ValueError`` names the choices."""
    if name not in _RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {name!r}")
    return _RECIPES[name]


def refresh_weight_operands(params) -> None:
    """After an optimizer step wrote FP8 weights: the GEMM operands every recipe's weights keep, brought up to date at
    the end of the step (the optimizers call it): the quantizer core's (tensorwise, rowwise, blockwise:
    :func:`fp8.quantizers.refresh_weight_operands`) and each recipe module's own (MXFP8:
    :func:`fp8.mxfp8.refresh_weight_operands`; NVFP4: :func:`fp8.nvfp4.refresh_weight_operands`)."""
    params = list(params)
    _refresh_core_operands(params)
    mxfp8.refresh_weight_operands(params)
    nvfp4.refresh_weight_operands(params)
