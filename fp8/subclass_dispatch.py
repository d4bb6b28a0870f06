"""The skeleton shared by fp8's scaled tensor subclasses (:class:`fp8.Float8Tensor`, :class:`fp8.ScaledFloat16Tensor`):
their base class :class:`ScaledTensor` (a payload and its fp32 scale presenting as a tensor of another dtype), and
their dispatch: an explicit op table first, then the ops allowed to run on the dequantized value,
else an error naming the fix; in-place ops on the values re-stored into the subclass; the metadata hash torch.compile's
AOT autograd cache asks of a traceable wrapper subclass.

Each subclass passes what differs (its op table, its allowed ops, how it is read and written) to these functions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection

import torch
from torch.utils._pytree import tree_map


class ScaledTensor(torch.Tensor):
    """A payload in a narrow dtype (:attr:`payload`) and its fp32 scale (:attr:`scale`: ``payload = cast(value *
    scale)``), presenting as a tensor of the payload's shape in a wider ``dtype``. Subclasses validate and store
    ``_data`` and ``_scale`` in ``__init__`` and give their op table to :func:`dispatch`."""

    _data: torch.Tensor
    _scale: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, *args, **kwargs):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=dtype,
                                                   device=data.device, requires_grad=False)

    @property
    def payload(self) -> torch.Tensor:
        """The payload (a plain tensor in the narrow dtype)."""
        return self._data

    @property
    def scale(self) -> torch.Tensor:
        """The fp32 scale(s): ``payload = cast(value * scale)``."""
        return self._scale

    __torch_function__ = torch._C._disabled_torch_function_impl


def as_list(x) -> list:
    """The tensors in ``x`` (a tensor or a list/tuple of tensors)."""
    return list(x) if isinstance(x, (list, tuple)) else [x]


def is_inplace(func) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``_foreach_mul_``, ...)."""
    schema = func._schema
    return bool(schema.arguments) and schema.arguments[0].is_write and not schema.arguments[0].kwarg_only


def dispatch(kind: type, table: dict, on_values: Collection, func, args, kwargs, run_on_values: Callable):
    """``func`` on a ``kind`` through its ``table`` (op -> ``handler(func, args, kwargs)``), or, for ops in
    ``on_values`` (ops or overload packets), ``run_on_values(func, args, kwargs)``; any other op is refused."""
    handler = table.get(func) or table.get(func._schema.name)  # an op of a library not imported here, by name
    if handler is not None:
        return handler(func, args, kwargs)
    if func in on_values or func.overloadpacket in on_values:
        return run_on_values(func, args, kwargs)
    raise NotImplementedError(
        f"{kind.__name__} has no implementation of {func} and it is not in fp8.tensor.DEQUANTIZE_OPS (the ops allowed "
        f"to run on the dequantized value); call .dequantize() on the {kind.__name__} first to run it in high precision"
    )


def on_values(kind: type, func, args, kwargs, inplace_value: Callable, value: Callable, store: Callable):
    """``func`` on the values of the ``kind`` tensors in its arguments (``value(t)``). An in-place op writing into a
    ``kind`` (also ``_foreach_*_``) runs on ``inplace_value(t)`` and each result is stored back (``store(target,
    result)``); ``out=`` a ``kind`` is refused."""
    if "out" in kwargs and any(isinstance(t, kind) for t in as_list(kwargs["out"])):
        raise NotImplementedError(f"{func} with a {kind.__name__} as out= is not supported; write to a plain tensor")
    if args and is_inplace(func):
        targets = as_list(args[0])
        if any(isinstance(t, kind) for t in targets):
            plain_args, plain_kwargs = tree_map(inplace_value, args), tree_map(inplace_value, kwargs)
            returned = func(*plain_args, **plain_kwargs)
            for target, result in zip(targets, as_list(plain_args[0])):
                if isinstance(target, kind):
                    store(target, result)
            return None if returned is None else args[0]
    return func(*tree_map(value, args), **tree_map(value, kwargs))


def to_copy(args, kwargs, like: Callable):
    """``.to()`` of a scaled tensor ``args[0]``: a device move keeps payload and scale (``like(src, payload, scale)``
    makes the result); a dtype change returns the dequantized value."""
    src, kwargs = args[0], dict(kwargs)
    dtype, device = kwargs.pop("dtype", None), kwargs.pop("device", None)
    kwargs.pop("layout", None)
    if dtype is not None and dtype != src.dtype:
        value = src.dequantize(dtype)
        return value.to(device=device) if device is not None else value
    data = torch.ops.aten._to_copy.default(src._data, device=device, **kwargs)
    return like(src, data, src._scale.to(device=data.device, copy=True))


def chunk_cat_values(func, args, kwargs):
    """FSDP2's ``fsdp::chunk_cat(tensors, dim, num_chunks, out=)`` (the copy of unsharded gradients into its
    reduce-scatter buffer) with scaled tensors among ``tensors``: each is dequantized straight into ``out``'s dtype
    (an fp32 reduction buffer gets the gradient's fp32 value, never a 16-bit rounding of it), then the copy."""
    tensors, out = args[0], kwargs["out"]
    # chunk_cat takes inputs of one dtype: the unit's plain gradients (e.g. bf16 under a MixedPrecisionPolicy) go to
    # the buffer's dtype as well, as FSDP2 would cast them there
    plain = [t.dequantize(out.dtype) if hasattr(t, "payload") and hasattr(t, "dequantize") else t.to(out.dtype)
             for t in tensors]
    return func(plain, *args[1:], **kwargs)


def metadata_hash(key: tuple) -> str:
    """A hash of a subclass's metadata ``key`` for torch.compile's AOT autograd cache: stable across processes (no
    Python ``hash``), never computed from values."""
    return hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()
