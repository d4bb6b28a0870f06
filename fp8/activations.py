"""FP8 activation compression: tensors saved for backward are stored as E4M3 in 1x128 tiles and restored
for the backward (``torch.autograd.graph.saved_tensors_hooks``).

:class:`ActivationCompressor` holds the pack/unpack hooks; ``with compressor:`` installs them, so every
tensor an op saves for its backward inside the block goes through :meth:`ActivationCompressor.pack`.
:func:`compress_activations` installs a compressor around a model's forward (a forward pre-hook enters it,
a forward hook exits it), so any PyTorch or Hugging Face model gets compression without code changes.

What is compressed: the intermediates of the forward (tensors with a ``grad_fn``) in float32, bfloat16 or
float16 with at least ``min_numel`` elements: norm inputs and their fp32 intermediates, activation-function
inputs, gated products, attention inputs and probabilities, residual branches, linear inputs. Each is
viewed as ``(-1, last dim)`` (as ``(-1, group)`` when its last dimension is shorter than ``group`` and
divides evenly, so small heads share a tile) and quantized with :func:`fp8.blocks.quantize_to_blocks`: one
power-of-two scale per ``1 x group`` tile (:data:`fp8.blocks.TILE` for the default 128), 1 byte per element
plus 4 bytes per tile. Restored values are ``payload / scale`` in the original dtype, shape, strides (for
dense layouts; a strided slice comes back contiguous) and device. For a value in the normal range of its
tile the relative error is at most ``2**-4`` (E4M3, ``FP8Format.max_relative_error``).

What is left alone (saved as is):

- parameters, views of them (``F.linear`` saves ``weight.t()``) and their dtype copies (autocast's BF16 weight):
  the backward reads the weight exactly;
- leaves: inputs the caller holds anyway, constants, and the non-differentiable statistics
  fused kernels return (the log-sum-exp of fused attention, the mean/rstd of fused norms); compressing a
  tensor held elsewhere would add memory, and these statistics are amplified by the backward
  (``exp(lse)``). ``compress_leaves=True`` compresses leaves too, except parameters (``nn.Parameter`` or
  ``requires_grad`` leaves);
- FP8 tensors (``torch.float8_*`` dtypes and :class:`fp8.Float8Tensor`, e.g. the payloads
  :class:`fp8.linear.Float8LinearFunction` saves) and any other tensor subclass;
- non-floating tensors, float64, tensors below ``min_numel`` (the FP8 linear's 0-d scales);
- per-row statistics (last dimension 1, e.g. an eager RMSNorm's rstd: ``1/hidden`` of the bytes, used
  cubed by ``rsqrt``'s backward) and expanded tensors (a zero stride: materializing them costs more);
- outputs of the ops in ``keep_ops`` (:data:`EXACT_OPS`: log-softmax and logsumexp, whose backward
  exponentiates the saved value, tanh and sigmoid, whose backward reads ``1 - y**2`` / ``y * (1 - y)``
  and cancels near saturation);
- anything compression would not shrink.

Stored once: a tensor saved by several ops (same storage pointer, offset, shape, strides, dtype, device
and version counter) is packed once. The compressor keeps, per active context, a map from that key to a
*weak* reference to the packed handle and a weak reference to the storage it came from (a storage's Python
object lives exactly as long as the storage). A hit requires both alive and the tensor's storage to be that
very storage object, so a freed address reused by another tensor never matches, and the version in the key
rules out in-place changes since. Every op saving it gets the
same handle object, so the bytes exist once. The only strong references to a handle are the autograd
graph's saved-variable slots: when the backward frees the graph (or the graph is dropped), the handle and
its payload are freed; the map is cleared when the outermost context exits. ``stats.held_bytes`` counts
the bytes of the handles alive now (it returns to 0 after the backward).

Limitations: double backward (``create_graph=True``) does not differentiate through restored tensors;
activation checkpointing's own saved-tensor hooks take precedence inside checkpointed regions.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields

import torch

from .blocks import dequantize_blocks, grid_shape, quantize_to_blocks
from .cast import payload_and_scale
from .formats import get_format

__all__ = ["ActivationCompressor", "ActivationStats", "EXACT_OPS", "compress_activations"]

EXACT_OPS = frozenset({"LogSoftmaxBackward0", "LogsumexpBackward0", "TanhBackward0", "SigmoidBackward0"})
"""Autograd nodes whose outputs are saved exactly: their backward amplifies a relative rounding error."""

COMPRESSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes compressed by default."""


@dataclass
class ActivationStats:
    """The compressor's ledger (bytes and counts since construction or :meth:`reset`).

    ``tensors``/``saved_bytes``/``stored_bytes``: tensors compressed (each once), their bytes in their own
    dtype and their bytes stored (payload + scales). ``deduplicated``: saves served by a handle already
    packed. ``passed``/``passed_bytes``: saved tensors left alone (parameters included). ``held_bytes``:
    stored bytes of the handles alive now (held by autograd graphs); not reset.
    """

    tensors: int = 0
    saved_bytes: int = 0
    stored_bytes: int = 0
    deduplicated: int = 0
    passed: int = 0
    passed_bytes: int = 0
    held_bytes: int = 0

    @property
    def ratio(self) -> float:
        """``stored_bytes / saved_bytes`` of the compressed tensors (1.0 before any)."""
        return self.stored_bytes / self.saved_bytes if self.saved_bytes else 1.0

    def reset(self) -> None:
        """Zero the counters (``held_bytes`` keeps counting the live handles)."""
        for f in fields(self):
            if f.name != "held_bytes":
                setattr(self, f.name, 0)

    def as_dict(self) -> dict:
        """The counters and the ratio, for reports and JSON."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["ratio"] = self.ratio
        return out


class _Packed:
    """One compressed saved tensor: E4M3 payload ``(rows, cols)``, its tile scales and how to restore it."""

    __slots__ = ("payload", "scales", "block", "shape", "stride", "dtype", "nbytes", "ledger", "__weakref__")

    def __init__(self, payload, scales, block, shape, stride, dtype, ledger: ActivationStats):
        self.payload, self.scales, self.block = payload, scales, block
        self.shape, self.stride, self.dtype = shape, stride, dtype
        self.nbytes = payload.numel() * payload.element_size() + scales.numel() * scales.element_size()
        self.ledger = ledger
        ledger.held_bytes += self.nbytes

    def __del__(self):
        self.ledger.held_bytes -= self.nbytes

    def restore(self) -> torch.Tensor:
        """The value ``payload / scale`` in the original dtype, shape and (dense) strides."""
        value = dequantize_blocks(self.payload, self.scales, self.block, self.dtype).reshape(self.shape)
        if self.stride is None or value.stride() == self.stride:
            return value
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=value.device).copy_(value)


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers its memory without gaps or overlaps (its strides permute a contiguous layout)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _parameter_like(t: torch.Tensor) -> bool:
    """A parameter (a leaf requiring grad) or a view of one (``F.linear`` saves ``weight.t()``): held by the model."""
    if isinstance(t, torch.nn.Parameter) or (t.grad_fn is None and t.requires_grad):
        return True
    base = t._base
    return base is not None and base.grad_fn is None and base.requires_grad


def _copy_of_parameter(t: torch.Tensor) -> bool:
    """A dtype copy of a parameter (autocast's BF16 weight): kept exact, as the weight it stands for."""
    fn = t.grad_fn
    if fn is None or fn.name() != "ToCopyBackward0":
        return False
    inputs = [f for f, _ in fn.next_functions if f is not None]
    return bool(inputs) and all(f.name().endswith("AccumulateGrad") for f in inputs)


class ActivationCompressor:
    """Pack/unpack hooks storing saved-for-backward tensors as FP8 in ``1 x group`` tiles.

    ``min_numel``: smaller tensors are left alone. ``fmt``: ``"e4m3"`` (or ``"e5m2"``). ``group``: tile
    width along the last dimension. ``dtypes``: the floating dtypes compressed. ``keep_ops``: autograd node
    names whose outputs are kept exact (default :data:`EXACT_OPS`). ``compress_leaves``: also compress
    leaf tensors that are not parameters. ``with compressor:`` installs the hooks (re-entrant);
    :attr:`stats` is the ledger. See the module docstring for what is compressed and how a tensor saved
    several times is stored once.
    """

    def __init__(self, min_numel: int = 4096, fmt: str = "e4m3", group: int = 128,
                 dtypes: tuple[torch.dtype, ...] = COMPRESSED_DTYPES, keep_ops: frozenset[str] = EXACT_OPS,
                 compress_leaves: bool = False):
        if int(group) < 1:
            raise ValueError(f"group must be a positive tile width, got {group}; the default is 128")
        if int(min_numel) < 0:
            raise ValueError(f"min_numel must be >= 0, got {min_numel}")
        self.fmt = get_format(fmt)
        self.group = int(group)
        self.min_numel = int(min_numel)
        self.dtypes = tuple(dtypes)
        self.keep_ops = frozenset(keep_ops)
        self.compress_leaves = bool(compress_leaves)
        self.stats = ActivationStats()
        self._contexts: list = []
        self._seen: dict = {}
        self._handles: list = []
        self._kept: dict[int, tuple] = {}  # storages saved as is: data_ptr -> (weak ref, bytes)

    def __repr__(self) -> str:
        return (f"ActivationCompressor(min_numel={self.min_numel}, fmt={self.fmt.name!r}, group={self.group}, "
                f"compress_leaves={self.compress_leaves})")

    # -- context -----------------------------------------------------------------------------------
    def __enter__(self) -> "ActivationCompressor":
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        self._contexts.append(hooks)
        return self

    def __exit__(self, *exc) -> None:
        if not self._contexts:
            raise RuntimeError("ActivationCompressor exited more often than entered; pair `with compressor:` blocks")
        self._contexts.pop().__exit__(*exc)
        if not self._contexts:
            self._seen.clear()

    @property
    def active(self) -> bool:
        """Whether the hooks are installed now."""
        return bool(self._contexts)

    # -- hooks -------------------------------------------------------------------------------------
    def _leave_alone(self, t: torch.Tensor) -> bool:
        if _parameter_like(t) or _copy_of_parameter(t) or payload_and_scale(t) is not None:
            return True
        if type(t) is not torch.Tensor or t.dtype not in self.dtypes:
            return True  # subclasses (Float8Tensor, DTensor, ...), FP8 / integer / bool / float64
        if t.numel() < max(self.min_numel, 1) or t.dim() == 0 or t.shape[-1] == 1:
            return True
        if t.grad_fn is None and (t.requires_grad or not self.compress_leaves):
            return True  # a parameter, or a leaf: held by its owner, or a fused kernel's statistic
        if t.grad_fn is not None and t.grad_fn.name() in self.keep_ops:
            return True
        return any(st == 0 and sz > 1 for sz, st in zip(t.shape, t.stride()))  # expanded

    def _rows(self, t: torch.Tensor) -> tuple[int, int]:
        last = t.shape[-1]
        if last < self.group and t.numel() % self.group == 0:
            return (t.numel() // self.group, self.group)
        return (t.numel() // last, last)

    def _pass(self, t: torch.Tensor):
        self.stats.passed += 1
        self.stats.passed_bytes += t.numel() * t.element_size()
        if not _parameter_like(t):
            parts = payload_and_scale(t)
            for x in parts if parts is not None else (t,):
                try:
                    storage = x.untyped_storage()
                    ptr = storage.data_ptr()
                except RuntimeError:  # a tensor subclass without storage of its own
                    continue
                if ptr:
                    self._kept[ptr] = (weakref.ref(storage), storage.nbytes())
        # an op's own output returned as is would make a reference cycle (tensor -> grad_fn -> saved slot
        # -> tensor) that never frees; a detached alias shares the storage without the cycle.
        return t if t.grad_fn is None else t.detach()

    def pack(self, t: torch.Tensor):
        """Saved-tensor pack hook: a handle to the FP8 copy of ``t``, or ``t`` (detached) when left alone."""
        if self._leave_alone(t):
            return self._pass(t)
        rows = self._rows(t)
        block = (1, self.group)
        grid = grid_shape(block, rows)
        saved = t.numel() * t.element_size()
        stored = t.numel() * self.fmt.dtype.itemsize + grid[0] * grid[1] * 4
        if stored >= saved:
            return self._pass(t)
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version)
        hit = self._seen.get(key)
        if hit is not None:
            source, packed = hit[0](), hit[1]()
            if source is storage and packed is not None:
                self.stats.deduplicated += 1
                return packed
        with torch.no_grad():
            dense = _is_dense(t)
            x = t.detach().contiguous().reshape(rows)
            payload, scales = quantize_to_blocks(x, block, self.fmt)
        packed = _Packed(payload, scales, block, tuple(t.shape), t.stride() if dense else None, t.dtype, self.stats)
        self.stats.tensors += 1
        self.stats.saved_bytes += saved
        self.stats.stored_bytes += packed.nbytes
        self._seen[key] = (weakref.ref(storage), weakref.ref(packed))
        return packed

    def held_bytes(self, exclude: set[int] | frozenset[int] = frozenset()) -> int:
        """Bytes held for backward now through this compressor: its FP8 copies alive (``stats.held_bytes``) plus
        the storages of the tensors it saved as is that are still alive (each once; parameters not counted). Read
        between a forward and its backward, the activation memory of that forward (the engine's ledger:
        :func:`fp8.memory_report` reports it). ``ActivationCompressor(dtypes=())`` compresses nothing and only counts.
        ``exclude``: storage pointers not to count (the model's own: an FP8 weight's payload is saved as a plain tensor)."""
        alive = 0
        for ptr, (ref, nbytes) in list(self._kept.items()):
            if ref() is None:
                del self._kept[ptr]
            elif ptr not in exclude:
                alive += nbytes
        return self.stats.held_bytes + alive

    def unpack(self, packed) -> torch.Tensor:
        """Saved-tensor unpack hook: the restored tensor (or the tensor saved as is)."""
        if isinstance(packed, _Packed):
            with torch.no_grad():
                return packed.restore()
        return packed

    # -- model hooks ---------------------------------------------------------------------------------
    def _forward_pre_hook(self, module, args) -> None:
        self.__enter__()

    def _forward_hook(self, module, args, output) -> None:
        if self._contexts:
            self.__exit__(None, None, None)

    def remove(self) -> None:
        """Remove the hooks :func:`compress_activations` put on the model (the compressor stays usable)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def compress_activations(model: torch.nn.Module, **options) -> ActivationCompressor:
    """Compress the tensors ``model``'s forward saves for backward; returns the compressor (``.remove()``
    undoes it, ``.stats`` is its ledger).

    A forward pre-hook on ``model`` enters the compressor and a forward hook (``always_call``, so also when
    the forward raises) exits it: the hooks are active during ``model``'s forward only. ``options`` are
    :class:`ActivationCompressor`'s.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compress_activations takes an nn.Module, got {type(model).__name__}; "
                        "for other code use `with ActivationCompressor(...):`")
    for hook in model._forward_pre_hooks.values():
        if isinstance(getattr(hook, "__self__", None), ActivationCompressor):
            raise ValueError("this model's activations are already compressed; call .remove() on the compressor "
                             "compress_activations returned before installing another")
    compressor = ActivationCompressor(**options)
    compressor._handles.append(model.register_forward_pre_hook(compressor._forward_pre_hook))
    compressor._handles.append(model.register_forward_hook(compressor._forward_hook, always_call=True))
    return compressor
