"""fp8: the FP8 engine of fp8lm (pure PyTorch; no Megatron import).

Quick use::

    import fp8
    model, optimizer = fp8.initialize(model, optimizer, opt_level="O1")
    ...  # train
    fp8.export_fp8(model, "out", format="compressed-tensors")  # the FP8 weights as trained, for vLLM/SGLang/transformers

``fp8.checkpoint`` (sharded checkpoints) is imported on first use: ``torch.distributed.checkpoint`` is a
heavy import that ``import fp8`` does not pay for.
"""

import importlib

from .cast import dequantize, quantize, quantize_transpose
from .convert import convert_to_float8_linear, layer_precisions, set_high_precision, set_high_precision_forward
from .fallback import FallbackConfig
from .smooth_swiglu import smooth_swiglu
from .frozen import freeze
from .formats import E4M3, E5M2, FP8Format, get_format
from .gemm import fp8_mm, scaled_mm_supported
from .initialize import OPT_LEVEL_ALIASES, OPT_LEVELS, initialize, normalize_opt_level
from .export import export_fp8, import_fp8
from .linear import Float8Linear, Float8LinearConfig
from .moe import Float8Experts
from . import distributed, optim
from .memory import MEMORY_CATEGORIES, memory_report
from .optim.clip import clip_grad_norm_
from .scaling import ScalingConfig, ScalingState, compute_scale, set_amax_reduction_group, update_scales
from .serialization import safe_globals
from .scaled_fp16 import ScaledFloat16Tensor, to_scaled_fp16
from .tensor import Float8Tensor, to_float8

__all__ = [
    "E4M3", "E5M2", "FP8Format", "get_format",
    "ScalingConfig", "ScalingState", "compute_scale", "update_scales", "set_amax_reduction_group",
    "Float8Tensor", "to_float8", "ScaledFloat16Tensor", "to_scaled_fp16", "quantize", "dequantize", "quantize_transpose",
    "fp8_mm", "scaled_mm_supported",
    "Float8Linear", "Float8LinearConfig", "Float8Experts", "convert_to_float8_linear", "set_high_precision_forward", "set_high_precision", "FallbackConfig", "smooth_swiglu", "layer_precisions", "freeze",
    "initialize", "export_fp8", "import_fp8", "OPT_LEVELS", "OPT_LEVEL_ALIASES", "normalize_opt_level", "memory_report", "MEMORY_CATEGORIES", "safe_globals", "clip_grad_norm_", "optim", "distributed",
]


def __getattr__(name: str):
    """``fp8.checkpoint``, imported on first access (module ``__getattr__``, PEP 562)."""
    if name == "checkpoint":
        return importlib.import_module(f"{__name__}.checkpoint")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
