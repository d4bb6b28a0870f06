"""``ScaledFloat16Tensor``: an FP16 payload with a power-of-two fp32 scale, the 2-byte weight gradient of
``Float8LinearConfig(grad_accumulation="fp16")`` (the default).

Its value is ``payload / scale``; it reports the dtype it stands for (float32: an FP8 weight's gradient stands for
its fp32 master's), so it can be an FP8 weight's ``.grad``. Each backward hands autograd the weight-gradient GEMM's
fp32 output as one of these (:func:`to_scaled_fp16`: the scale puts the amax
:data:`~fp8.kernels.grad_accumulate.FP16_HEADROOM_BITS` binades below the FP16 maximum); the first micro-batch's
becomes the ``.grad`` buffer, and every further one is added in place (autograd's ``grad += new``) by
:func:`fp8.kernels.accumulate_fp16_payload`: summed in fp32, written back in FP16 with the buffer's scale, lowered by
a power of two (exact) only when the sum would overflow it. The scale is chosen on the device: no host read.

Ops are explicit, as for :class:`fp8.Float8Tensor`: views, ``detach``, ``clone`` and device moves keep the payload and
scale; a dtype change, and the ops of :data:`fp8.tensor.DEQUANTIZE_OPS`, run on the dequantized fp32 value; in-place
updates (``zero_``, ``mul_``, ``copy_``, ...) compute in fp32 and store the result with the buffer's scale rule (a
partial view, e.g. a row, with the scale it shares); any
other op raises ``NotImplementedError`` naming it. Consumers that know the protocol read ``payload`` and ``scale``
directly (:func:`fp8.cast.payload_and_scale`): the optimizers, clipping, the FP8 data-parallel reductions (which
quantize the value once to E4M3 for the wire) and :func:`fp8.memory_report` (2 bytes per element plus the scale).
"""

from __future__ import annotations


import torch

from .cast import dequantize
from .kernels import grad_accumulate
from .kernels.backend import KERNEL_BACKENDS
from .subclass_dispatch import ScaledTensor, chunk_cat_values, dispatch, metadata_hash, on_values, to_copy
from .scaling import FP16_HEADROOM_BITS, FP16_MAX, finite_amax, fp16_accumulation_scale, power_of_two_scale

__all__ = ["ScaledFloat16Tensor", "to_scaled_fp16"]

aten = torch.ops.aten


class ScaledFloat16Tensor(ScaledTensor):
    """FP16 payload plus its 0-d fp32 power-of-two scale; ``dequantize()`` is ``payload / scale`` in ``dtype``.

    Construct with :func:`to_scaled_fp16` or ``ScaledFloat16Tensor(payload, scale, dtype, accumulate_backend)``;
    ``accumulate_backend`` (:data:`fp8.kernels.KERNEL_BACKENDS`) is the kernel backend of ``acc += new``."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                accumulate_backend: str = "auto"):
        if data.dtype != torch.float16:
            raise TypeError(f"ScaledFloat16Tensor takes a float16 payload, got {data.dtype}")
        return ScaledTensor.__new__(cls, data, scale, dtype)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                 accumulate_backend: str = "auto"):
        if accumulate_backend not in KERNEL_BACKENDS:
            raise ValueError(f"accumulate_backend must be one of {KERNEL_BACKENDS}, got {accumulate_backend!r}")
        if scale.numel() != 1:
            raise ValueError(f"a ScaledFloat16Tensor takes one scale, got shape {tuple(scale.shape)}")
        self._data = data
        self._scale = scale.reshape(()).to(device=data.device, dtype=torch.float32)
        self.accumulate_backend = accumulate_backend

    @property
    def block(self) -> None:
        """One tensor-wise scale (the :attr:`fp8.Float8Tensor.block` of such a tensor)."""
        return None

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:  # type: ignore[override]
        """The value ``payload / scale`` as an ordinary tensor in ``dtype`` (default: ``self.dtype``)."""
        return dequantize(self._data, self._scale, dtype or self.dtype)

    def __repr__(self) -> str:  # type: ignore[override]
        # Metadata only: no host read (a device sync on CUDA; symbolic values while torch.compile traces).
        return f"ScaledFloat16Tensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    # -- subclass protocol (torch.compile) ----------------------------------------------------
    def __tensor_flatten__(self):
        return ["_data", "_scale"], {"dtype": self.dtype, "accumulate_backend": self.accumulate_backend}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return ScaledFloat16Tensor(inner["_data"], inner["_scale"], meta["dtype"], meta["accumulate_backend"])

    def _stable_hash_for_caching(self) -> str:
        """Metadata hash for torch.compile's AOT autograd cache (as :class:`fp8.Float8Tensor`'s): never the values."""
        key = (type(self).__qualname__, str(self.dtype), tuple(self.shape), tuple(self.stride()), self.device.type,
               str(self._data.dtype), self.accumulate_backend)
        return metadata_hash(key)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from .tensor import DEQUANTIZE_OPS

        return dispatch(ScaledFloat16Tensor, _OP_TABLE, DEQUANTIZE_OPS, func, args, kwargs or {}, _dequantized)


def to_scaled_fp16(x: torch.Tensor, dtype: torch.dtype | None = None,
                   accumulate_backend: str = "auto") -> ScaledFloat16Tensor:
    """``x`` as a fresh FP16 gradient buffer: scale ``power_of_two_scale(finite amax, 65504, margin=11)`` (1.0 when
    ``x`` has no non-zero finite value), payload ``fp16(x * scale)`` (non-finite values kept); reports ``dtype``
    (default ``x``'s)."""
    scale = power_of_two_scale(finite_amax(x), FP16_MAX, FP16_HEADROOM_BITS)
    data = (x.detach().to(torch.float32) * scale).to(torch.float16)
    return ScaledFloat16Tensor(data, scale, dtype or x.dtype, accumulate_backend)


def _like(src: ScaledFloat16Tensor, data: torch.Tensor, scale: torch.Tensor) -> ScaledFloat16Tensor:
    return ScaledFloat16Tensor(data, scale, src.dtype, src.accumulate_backend)


def _whole(t: ScaledFloat16Tensor) -> bool:
    """Whether ``t`` covers its whole contiguous payload storage (not a slice or row of a larger buffer)."""
    data = t._data
    return data.is_contiguous() and data.numel() * data.element_size() == data.untyped_storage().nbytes()


def _plain(t: torch.Tensor) -> bool:
    """A real tensor with storage (not a fake or functional tensor met while ``torch.compile`` traces)."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


@torch.no_grad()
def _store(dst: ScaledFloat16Tensor, value: torch.Tensor) -> None:
    """Write the fp32 ``value`` into ``dst`` in place. A whole buffer takes the scale of the accumulation rule as if
    ``value`` were added to an empty buffer (fresh headroom scale); a partial view keeps the scale it shares (values
    beyond FP16 become inf, as they would in a 16-bit gradient: the optimizer's finite check then skips the step)."""
    value = value.to(torch.float32).expand(dst.shape)
    if _whole(dst):
        zero = torch.zeros((), dtype=torch.float32, device=value.device)
        scale = fp16_accumulation_scale(finite_amax(value), zero, dst._scale)
        dst._data.copy_((value * scale).to(torch.float16))
        dst._scale.copy_(scale)
    else:
        dst._data.copy_((value * dst._scale).to(torch.float16))
    _written(dst)


def _written(t: ScaledFloat16Tensor) -> None:
    """Bump the inner tensors' version counters (writes inside ``__torch_dispatch__`` do not)."""
    inner = [x for x in (t._data, t._scale) if _plain(x) and not x.is_inference()]
    if inner:
        torch.autograd.graph.increment_version(inner)


def _view(func, args, kwargs):
    src = args[0]
    out = func(src._data, *args[1:], **kwargs)
    if isinstance(out, (list, tuple)):
        return [_like(src, o, src._scale) for o in out]
    return _like(src, out, src._scale)


def _clone(func, args, kwargs):
    src = args[0]
    return _like(src, func(src._data, *args[1:], **kwargs), src._scale.clone())


def _to_copy(func, args, kwargs):
    """``.to()``: a device move keeps the payload and scale; a dtype change returns the dequantized value."""
    return to_copy(args, kwargs, _like)


def _copy_into(func, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(dst, ScaledFloat16Tensor):
        if isinstance(src, ScaledFloat16Tensor) and _whole(dst) and src.shape == dst.shape:
            dst._data.copy_(src._data)
            dst._scale.copy_(src._scale)
            _written(dst)
        else:
            _store(dst, _value(src))
        return dst
    return _dequantized(func, args, kwargs)


def _value(t) -> torch.Tensor:
    """The fp32 value of a scaled tensor (payload / scale), or ``t`` itself."""
    if isinstance(t, torch.Tensor) and hasattr(t, "dequantize") and hasattr(t, "payload"):
        return t.dequantize(torch.float32)
    return t


def _add_inplace(func, args, kwargs):
    """``acc += new`` (autograd's gradient accumulation): a whole, contiguous buffer and a same-shape addend (a
    scaled tensor or a floating-point one), alpha 1, real tensors take :func:`fp8.kernels.accumulate_fp16_payload`
    on ``acc``'s ``accumulate_backend``; anything else the generic in-place path."""
    acc, new = args[0], args[1] if len(args) > 1 else None
    if (isinstance(acc, ScaledFloat16Tensor) and isinstance(new, torch.Tensor) and kwargs.get("alpha", 1) == 1
            and new.shape == acc.shape and _whole(acc) and _plain(acc._data) and getattr(new, "block", None) is None):
        parts = (new.payload, new.scale) if hasattr(new, "payload") else (new, None)
        if _plain(parts[0]) and parts[0].is_floating_point() and parts[0].device == acc._data.device:
            grad_accumulate.accumulate_fp16_payload(acc._data, acc._scale, parts[0], parts[1],
                                                    backend=acc.accumulate_backend)
            _written(acc)
            return acc
    return _dequantized(func, args, kwargs)


def _zero(func, args, kwargs):
    dst = args[0]
    dst._data.zero_()  # the scale stays: an emptied buffer takes a fresh one at its next add
    _written(dst)
    return dst


def _dequantized(func, args, kwargs):
    """``func`` on the fp32 values; an in-place op on a ScaledFloat16Tensor stores its result back (:func:`_store`)."""
    return on_values(ScaledFloat16Tensor, func, args, kwargs, _value, _value, _store)


_VIEW_OPS = (
    aten.detach.default, aten.alias.default, aten.t.default, aten.transpose.int, aten.view.default,
    aten._unsafe_view.default, aten.as_strided.default, aten.slice.Tensor, aten.select.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.split.Tensor, aten.split_with_sizes.default,
    aten.unbind.int,
)

_OP_TABLE = {
    **{op: _view for op in _VIEW_OPS},
    aten.clone.default: _clone,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_into,
    aten.add_.Tensor: _add_inplace,
    aten.zero_.default: _zero,
    "fsdp::chunk_cat": chunk_cat_values,  # FSDP2's reduce-scatter copy-in: the value in the buffer's dtype
}
