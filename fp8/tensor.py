"""``Float8Tensor``: an FP8 payload with its fp32 scale, as a ``torch.Tensor`` subclass.

The tensor reports the high-precision dtype it stands for (``dtype``) and its shape, so it can be
an ``nn.Parameter``, a ``.grad``, go through ``.detach()``, ``.to(device)``, views and transposes,
``state_dict`` and ``torch.save``. Storage is the FP8 payload (``payload``, 1 byte per element)
plus a 0-d fp32 ``scale`` that the tensor owns; its value is ``payload / scale``.

Operations without an FP8 meaning run on the dequantized value and return ordinary tensors;
in-place operations on a ``Float8Tensor`` compute in fp32 and re-quantize the result into it with a
fresh power-of-two scale taken from the result's amax (current scaling), so nothing overflows; an
in-place write to a partial view (a slice, a row) keeps the scale it shares with the whole tensor.
"""

from __future__ import annotations

import hashlib

import torch
from torch.utils._pytree import tree_map

from .cast import dequantize, quantize
from .formats import FP8Format, get_format
from .scaling import amax_of, compute_scale

__all__ = ["Float8Tensor", "to_float8"]

aten = torch.ops.aten

# Ops that only re-index the payload: applied to the payload, the scale is shared.
_PAYLOAD_VIEW_OPS = {
    aten.detach.default,
    aten.alias.default,
    aten.t.default,
    aten.transpose.int,
    aten.view.default,
    aten._unsafe_view.default,
    aten.as_strided.default,
    aten.slice.Tensor,
    aten.select.int,
    aten.permute.default,
    aten.unsqueeze.default,
    aten.squeeze.dim,
    aten.expand.default,
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unbind.int,
}
# Ops that copy the payload: the result gets its own copy of the scale.
_PAYLOAD_COPY_OPS = {aten.clone.default, aten.cat.default, aten.stack.default}


class Float8Tensor(torch.Tensor):
    """FP8 payload (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``) plus its fp32 scale.

    Construct with :func:`to_float8` or ``Float8Tensor(payload, scale, dtype)``; ``dequantize()``
    returns the high-precision value ``payload / scale`` in ``dtype``.
    """

    _data: torch.Tensor
    _scale: torch.Tensor
    _shares_scale: bool = False  # a view: its scale object is shared with the tensor it views

    accumulate_backend: str = "auto"
    """Kernel backend of ``acc += new`` / ``acc.add_(new)`` into a whole FP8 tensor (gradient
    accumulation, :func:`fp8.kernels.accumulate_fp8_grad`): ``"auto"`` runs the Triton kernel for CUDA
    tensors and the torch reference elsewhere; tests set ``"triton"`` under ``TRITON_INTERPRET=1``."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
        get_format(data.dtype)  # validates the payload dtype
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=dtype,
            device=data.device,
            requires_grad=False,
        )

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32):
        if scale.numel() != 1:
            raise ValueError(f"Float8Tensor takes one tensor-wise scale, got shape {tuple(scale.shape)}")
        self._data = data
        if scale.dim() != 0:
            scale = scale.reshape(())
        self._scale = scale.to(device=data.device, dtype=torch.float32)

    # -- public accessors -------------------------------------------------------------------
    @property
    def payload(self) -> torch.Tensor:
        """The FP8 payload (a plain float8 tensor)."""
        return self._data

    @property
    def scale(self) -> torch.Tensor:
        """The fp32 scale: ``payload = cast(value * scale)``."""
        return self._scale

    @property
    def format(self) -> FP8Format:
        """The payload's :class:`FP8Format`."""
        return get_format(self._data.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:  # type: ignore[override]
        """The value ``payload / scale`` as an ordinary tensor in ``dtype`` (default: ``self.dtype``)."""
        return dequantize(self._data, self._scale, dtype or self.dtype)

    def __repr__(self) -> str:  # type: ignore[override]
        # Metadata only: no host read of the scale (a device sync on CUDA), and no format spec on values,
        # which are symbolic while torch.compile traces (Inductor's trace logging calls repr).
        return (
            f"Float8Tensor(format={self.format.name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device})"
        )

    # -- subclass protocol (torch.compile, FSDP2, serialization) ----------------------------
    def __tensor_flatten__(self):
        return ["_data", "_scale"], {"dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8Tensor(inner["_data"], inner["_scale"], meta["dtype"])

    def _stable_hash_for_caching(self) -> str:
        """A hash of this tensor's metadata for torch.compile's AOT autograd cache (torch's protocol for
        traceable wrapper subclasses; see ``torch._functorch._aot_autograd.autograd_cache``): class,
        outer shape/stride/dtype/device/requires_grad and the payload's and scale's metadata. Never the
        values, and stable across processes (no Python ``hash``)."""

        def meta(t: torch.Tensor) -> tuple:
            return (str(t.dtype), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.device.type)

        key = (type(self).__qualname__, meta(self), self.requires_grad, meta(self._data), meta(self._scale))
        return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PAYLOAD_VIEW_OPS:
            src = args[0]
            out = func(src._data, *args[1:], **kwargs)
            views = [Float8Tensor(o, src._scale, src.dtype) for o in _as_list(out)]
            for view in views:
                view._shares_scale = True
            return views if isinstance(out, (list, tuple)) else views[0]
        if func in _PAYLOAD_COPY_OPS:
            result = _payload_copy(func, args, kwargs)
            if result is not None:
                return result
        if func is aten._to_copy.default:
            return _to_copy(args[0], **kwargs)
        if func is aten.copy_.default and isinstance(args[0], Float8Tensor):
            _assign(args[0], args[1])
            return args[0]
        if func is aten.add_.Tensor and _accumulates(args, kwargs):
            from .kernels.grad_accumulate import accumulate_fp8_grad  # imports fp8.tensor: imported here

            return accumulate_fp8_grad(args[0], args[1], backend=Float8Tensor.accumulate_backend)

        def unwrap(t):
            return t.dequantize() if isinstance(t, Float8Tensor) else t

        plain_args, plain_kwargs = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        if args and _is_inplace(func):
            targets = _as_list(args[0])
            if any(isinstance(t, Float8Tensor) for t in targets):
                # In-place op (also _foreach_*_) on FP8: compute in fp32, re-quantize into the payloads.
                def unwrap32(t):
                    return t.dequantize(torch.float32) if isinstance(t, Float8Tensor) else t

                plain_args, plain_kwargs = tree_map(unwrap32, args), tree_map(unwrap32, kwargs)
                returned = func(*plain_args, **plain_kwargs)
                for target, result in zip(targets, _as_list(plain_args[0])):
                    if isinstance(target, Float8Tensor):
                        _assign(target, result)
                return None if returned is None else args[0]
        if "out" in kwargs and any(isinstance(t, Float8Tensor) for t in _as_list(kwargs["out"])):
            raise NotImplementedError(f"{func} with a Float8Tensor as out= is not supported; write to a plain tensor")
        return func(*plain_args, **plain_kwargs)


def _as_list(x) -> list:
    """The tensors in ``x`` (a tensor or a list/tuple of tensors)."""
    return list(x) if isinstance(x, (list, tuple)) else [x]


_ADDEND_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)


def _plain(t: torch.Tensor) -> bool:
    """A real tensor with storage (not a fake or functional tensor met while ``torch.compile`` traces)."""
    return type(t) is torch.Tensor or type(t) is torch.nn.Parameter


def _accumulates(args, kwargs) -> bool:
    """Whether ``aten.add_.Tensor(*args, **kwargs)`` is a gradient accumulation the fused path takes:
    a whole, contiguous FP8 target, an addend of the same shape (a Float8Tensor or a floating-point
    tensor), alpha 1, real tensors. Everything else takes the generic in-place path (same semantics)."""
    if len(args) != 2 or kwargs.get("alpha", 1) != 1:
        return False
    acc, new = args
    if not isinstance(acc, Float8Tensor) or not isinstance(new, torch.Tensor) or new.shape != acc.shape:
        return False
    if acc._shares_scale and acc._data.numel() != acc._data.untyped_storage().nbytes():
        return False  # a partial view keeps the scale it shares: the generic path handles it
    if not _plain(acc._data) or not acc._data.is_contiguous():
        return False
    inner = new._data if isinstance(new, Float8Tensor) else new
    return _plain(inner) and inner.dtype in _ADDEND_DTYPES and inner.device == acc._data.device


def _is_inplace(func) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``_foreach_mul_``, ...)."""
    schema = func._schema
    return bool(schema.arguments) and schema.arguments[0].is_write and not schema.arguments[0].kwarg_only


def _payload_copy(func, args, kwargs):
    """clone/split/cat/stack on Float8Tensors sharing one scale and format: done on the payloads."""
    tensors = args[0] if func in (aten.cat.default, aten.stack.default) else [args[0]]
    if not all(isinstance(t, Float8Tensor) for t in tensors):
        return None
    first = tensors[0]
    if any(t._data.dtype != first._data.dtype or t.dtype != first.dtype for t in tensors):
        return None
    if any(t._scale is not first._scale and not torch.equal(t._scale, first._scale) for t in tensors[1:]):
        return None
    if func in (aten.cat.default, aten.stack.default):
        data = func([t._data for t in tensors], *args[1:], **kwargs)
    else:
        data = func(first._data, *args[1:], **kwargs)
    if isinstance(data, (list, tuple)):
        return [Float8Tensor(d, first._scale.clone(), first.dtype) for d in data]
    return Float8Tensor(data, first._scale.clone(), first.dtype)


def _to_copy(src: Float8Tensor, dtype=None, device=None, **kwargs):
    """``.to()``: a device move keeps FP8; a dtype change returns the dequantized value."""
    kwargs.pop("layout", None)
    if dtype is not None and dtype != src.dtype:
        value = src.dequantize(dtype)
        return value.to(device=device) if device is not None else value
    data = aten._to_copy.default(src._data, device=device, **kwargs)
    return Float8Tensor(data, src._scale.to(device=data.device, copy=True), src.dtype)


@torch.no_grad()
def _assign(dst: Float8Tensor, src: torch.Tensor) -> None:
    """Write ``src`` into ``dst`` in place: payload and scale when ``src`` is FP8 of the same format,
    otherwise re-quantized with a current power-of-two scale from ``src``'s amax. A partial view
    (a slice or row of a larger FP8 tensor) shares its scale with the rest of the payload, so it is
    written with that scale (values beyond its range saturate) instead of re-scaling what it does not cover."""
    partial_view = dst._shares_scale and dst._data.numel() != dst._data.untyped_storage().nbytes()
    if isinstance(src, Float8Tensor) and src._data.dtype == dst._data.dtype and not partial_view:
        dst._data.copy_(src._data)
        dst._scale.copy_(src._scale)
        return
    value = src.dequantize(torch.float32) if isinstance(src, Float8Tensor) else src
    if partial_view:
        dst._data.copy_(quantize(value, dst._scale, dst.format))
        return
    scale = compute_scale(amax_of(value), dst.format, previous=dst._scale)
    dst._data.copy_(quantize(value, scale, dst.format))
    dst._scale.copy_(scale)


def to_float8(
    x: torch.Tensor,
    fmt: FP8Format | str = "e4m3",
    scale: torch.Tensor | None = None,
    margin: int = 0,
    dtype: torch.dtype | None = None,
) -> Float8Tensor:
    """Quantize ``x`` into a :class:`Float8Tensor` of format ``fmt``.

    With ``scale=None`` the scale is the current power-of-two scale from ``x``'s amax. The result
    reports ``dtype`` (default: ``x``'s dtype) and owns a copy of the scale.
    """
    fmt = get_format(fmt)
    if isinstance(x, Float8Tensor):
        x = x.dequantize()
    if not x.is_floating_point():
        raise TypeError(f"to_float8 takes a floating-point tensor, got {x.dtype}")
    if scale is None:
        scale = compute_scale(amax_of(x), fmt, margin)
    else:
        scale = scale.detach().to(device=x.device, dtype=torch.float32).clone()
    return Float8Tensor(quantize(x.detach(), scale, fmt), scale, dtype or x.dtype)
