"""``memory_report``: bytes of model state actually held, by category."""

from __future__ import annotations

import torch
from torch import nn

from .scaled_fp16 import ScaledFloat16Tensor
from .scaling import ScalingState
from .tensor import Float8Tensor

__all__ = ["memory_report", "MEMORY_CATEGORIES", "WEIGHT_TRANSPOSES"]

MEMORY_CATEGORIES = ("weights", "master weights", "weight gradients", "optimizer states", "FP8 scaling metadata")
"""Keys of :func:`memory_report` (plus ``"total"``, :data:`WEIGHT_TRANSPOSES` when FP8 weights hold transposes, and
``"activations"`` when activations are measured)."""

WEIGHT_TRANSPOSES = "weight transposes"
"""Key of :func:`memory_report` for the input-gradient GEMM operands FP8 weights hold between optimizer steps
(:attr:`fp8.Float8Tensor.transpose_cache`), present only while some are held."""


class _Ledger:
    """Sums tensor bytes per category, counting each storage once."""

    def __init__(self) -> None:
        self.bytes = dict.fromkeys(MEMORY_CATEGORIES, 0)
        self._seen: set[tuple[str, int]] = set()

    def add(self, category: str, tensor: torch.Tensor | None) -> None:
        if tensor is None:
            return
        if isinstance(tensor, (Float8Tensor, ScaledFloat16Tensor)):
            self.add(category, tensor.payload)
            self.add("FP8 scaling metadata", tensor.scale)
            return
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        if storage.data_ptr() != 0 and key in self._seen:
            return
        self._seen.add(key)
        self.bytes[category] = self.bytes.get(category, 0) + storage.nbytes()


def _state_category(key: str) -> str:
    """Category of an optimizer state entry: FP8 optimizers keep masters under ``master`` and
    per-tensor scales under ``<name>_scale``."""
    if key == "master":
        return "master weights"
    if key.endswith("_scale"):
        return "FP8 scaling metadata"
    return "optimizer states"


def memory_report(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                  activations=None) -> dict[str, int]:
    """Bytes held by ``model``'s parameters, gradients and FP8 scaling state and by ``optimizer``'s
    state, per category of :data:`MEMORY_CATEGORIES`, plus ``"total"``.

    FP8 weights count 1 byte per element (block-scaled ones: their scale grids go to ``"FP8 scaling
    metadata"``, like tensor-wise scales); gradients count their storage: 2 bytes per element for the scaled FP16
    buffers of ``grad_accumulation="fp16"`` (their 4-byte scale under ``"FP8 scaling metadata"``), 4 for fp32 sums,
    1 for E4M3 gradients; master weights are the high-precision copies an FP8 optimizer keeps;
    each storage is counted once.

    ``"weight transposes"`` (:data:`WEIGHT_TRANSPOSES`, in the report only while some are held): the operands of the
    input-gradient GEMM ``dX = dY @ W`` that FP8 weights keep from their first backward after an optimizer step to
    the next step (:attr:`fp8.Float8Tensor.transpose_cache`), where that GEMM runs ``torch._scaled_mm`` (CUDA, or
    ``gemm_backend="scaled_mm"``): the payload transposed to column-major, 1 byte per weight element (the rowwise
    recipe: the weight re-quantized per input channel, 1 byte per element plus 4 per input channel). The emulated
    GEMM (the CPU default) holds none.

    ``activations`` (an :class:`fp8.activations.ActivationCompressor`: the one ``fp8.initialize(...,
    fp8_activations=True)`` put on the model, ``model.fp8_activation_compressor``, or
    ``ActivationCompressor(dtypes=())`` entered around an uncompressed forward, which only counts) adds
    ``"activations"``, the bytes held for backward now (its ledger,
    :meth:`~fp8.activations.ActivationCompressor.held_bytes`: FP8 copies plus the tensors saved as is, the model's
    own parameter storages excluded: FP8 weights' payloads are saved as plain tensors), to the report and its
    ``"total"``. Call it between a forward and its backward.
    """
    ledger = _Ledger()
    for param in model.parameters():
        ledger.add("weights", param)
    for param in model.parameters():
        for held in param.transpose_cache if isinstance(param, Float8Tensor) else ():
            ledger.add(WEIGHT_TRANSPOSES, held)
    # Masters before gradients: a master's transient .grad is a gradient, the master a master weight.
    inner = optimizer
    for master in getattr(optimizer, "master_weights", []):
        ledger.add("master weights", master)
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    for param in model.parameters():
        ledger.add("weight gradients", param.grad)
    for master in getattr(optimizer, "master_weights", []):
        ledger.add("weight gradients", master.grad)
    if inner is not None:
        for group in inner.param_groups:
            for param in group["params"]:
                ledger.add("weights", param)  # optimizer-only parameters; already-counted ones are skipped
                ledger.add("weight gradients", param.grad)
        for state in inner.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    ledger.add(_state_category(key), value)
    for module in model.modules():
        if isinstance(module, ScalingState):
            for buffer in module.buffers(recurse=False):
                ledger.add("FP8 scaling metadata", buffer)
    report = dict(ledger.bytes)
    report["total"] = sum(ledger.bytes.values())
    if activations is not None:
        own = set()
        for param in model.parameters():
            for t in (param.payload, param.scale) if isinstance(param, Float8Tensor) else (param,):
                own.add(t.untyped_storage().data_ptr())
        report["activations"] = activations.held_bytes(exclude=own)
        report["total"] += report["activations"]
    return report
