"""``Float8Tensor``: an FP8 payload with its fp32 scale, as a ``torch.Tensor`` subclass.

The tensor reports the high-precision dtype it stands for (``dtype``) and its shape, so it can be
an ``nn.Parameter``, a ``.grad``, go through ``.detach()``, ``.to(device)``, views and transposes,
``state_dict`` and ``torch.save``. Storage is the FP8 payload (``payload``, 1 byte per element)
plus a 0-d fp32 ``scale`` that the tensor owns; its value is ``payload / scale``.

What an op does with a ``Float8Tensor`` operand is explicit: :data:`OP_TABLE` maps the ops with an FP8
meaning to their handlers (views, copies, moves, ``copy_``, gradient accumulation, and ``mm``/``addmm``, so
``torch.mm``, ``@``, ``torch.matmul`` and ``F.linear`` run the FP8 GEMM of :mod:`fp8.gemm`, a plain
operand cast to E4M3 with a current scale, for evaluation only: with grad enabled and an operand requiring
grad they raise, since training goes through the one FP8 linear recipe, :class:`fp8.Float8Linear`); :data:`DEQUANTIZE_OPS` lists the ops allowed to run on the
dequantized value (they return ordinary tensors); any other op raises ``NotImplementedError`` naming it
(call ``.dequantize()`` first). In-place operations on a ``Float8Tensor`` compute in fp32 and re-quantize
the result into it with a fresh power-of-two scale taken from the result's amax (current scaling), so
nothing overflows; an in-place write to a partial view (a slice, a row) keeps the scale it shares with the
whole tensor.

Imports go one way: this module imports :mod:`fp8.gemm` and :mod:`fp8.kernels`, which work on payloads and
scales and never import it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .blocks import Block, block_scales, dequantize_blocks, grid_shape, is_tensorwise, quantize_blocks, transpose_block
from .cast import quantize
from .formats import E4M3, FP8_DTYPES, FP8Format, get_format
from .gemm import fp8_mm_payload
from .kernels import grad_accumulate
from .kernels.backend import KERNEL_BACKENDS
from .scaling import amax_of, compute_scale
from .subclass_dispatch import (
    ScaledTensor, as_list as _as_list, chunk_cat_values, dispatch, metadata_hash, on_values, to_copy,
)

__all__ = ["Float8Tensor", "to_float8", "OP_TABLE", "DEQUANTIZE_OPS", "cached_operand", "refresh_cached_operands",
           "relayout_"]

aten = torch.ops.aten

class Float8Tensor(ScaledTensor):
    """FP8 payload (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``) plus its fp32 scale.

    Construct with :func:`to_float8` or ``Float8Tensor(payload, scale, dtype)``; ``dequantize()``
    returns the high-precision value ``payload / scale`` in ``dtype``.
    """

    _shares_scale: bool = False  # a view: its scale object is shared with the tensor it views

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                accumulate_backend: str = "auto", block: Block | None = None):
        get_format(data.dtype)  # validates the payload dtype
        return ScaledTensor.__new__(cls, data, scale, dtype)

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                 accumulate_backend: str = "auto", block: Block | None = None):
        if is_tensorwise(block):
            block = None
            if scale.numel() != 1:
                raise ValueError(
                    f"a tensor-wise Float8Tensor takes one scale, got shape {tuple(scale.shape)}; pass block= for a "
                    f"grid of block scales (fp8.blocks)"
                )
            if scale.dim() != 0:
                scale = scale.reshape(())
        else:
            block = (int(block[0]), int(block[1]))
            if data.dim() != 2 or tuple(scale.shape) != grid_shape(block, tuple(data.shape)):
                raise ValueError(
                    f"a block-scaled Float8Tensor needs a 2-D payload and a scale grid of shape grid_shape(block, "
                    f"payload shape); got payload {tuple(data.shape)}, block {block}, scales {tuple(scale.shape)}"
                )
        self._data = data
        self._block = block
        self._scale = scale.to(device=data.device, dtype=torch.float32)
        self.accumulate_backend = accumulate_backend

    # -- public accessors -------------------------------------------------------------------
    @property
    def block(self) -> Block | None:
        """The block of each scale of :attr:`scale` (:mod:`fp8.blocks`): ``None`` for one tensor-wise 0-d
        scale; ``(rows, cols)`` (``0``: the whole dimension) for a grid of block scales of a 2-D payload."""
        return self.__dict__.get("_block")

    @property
    def accumulate_backend(self) -> str:
        """Kernel backend of ``acc += new`` / ``acc.add_(new)`` into this whole FP8 tensor (gradient
        accumulation, :func:`fp8.kernels.accumulate_fp8_grad`): ``"auto"`` (the default) runs the Triton
        kernel for CUDA tensors and the torch reference elsewhere; ``"torch"``/``"triton"`` force one.
        Carried by the tensor (views, copies, moves and checkpoints keep it); an FP8 linear's weight and
        weight gradient take it from ``Float8LinearConfig.accumulate_backend``."""
        return self.__dict__.get("_accumulate_backend", "auto")  # "auto" for tensors saved before it existed

    @accumulate_backend.setter
    def accumulate_backend(self, backend: str) -> None:
        if backend not in KERNEL_BACKENDS:
            raise ValueError(f"accumulate_backend must be one of {KERNEL_BACKENDS}, got {backend!r}")
        self._accumulate_backend = backend

    @property
    def format(self) -> FP8Format:
        """The payload's :class:`FP8Format`."""
        return get_format(self._data.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:  # type: ignore[override]
        """The value ``payload / scale`` as an ordinary tensor in ``dtype`` (default: ``self.dtype``)."""
        return dequantize_blocks(self._data, self._scale, self.block, dtype or self.dtype)

    @property
    def transpose_cache(self) -> tuple[torch.Tensor, ...]:
        """The tensors this FP8 weight holds for its linear's input-gradient GEMM ``dX = dY @ W`` (:func:`cached_operand`):
        the payload transposed into the column-major layout ``torch._scaled_mm`` takes (the rowwise recipe: the weight
        re-quantized per input channel, with its scale grid), made at the first backward after the weight was written
        and reused by every backward until the next write (the optimizer step). Empty where none is held: GEMMs that
        do not run ``torch._scaled_mm`` (the emulated CPU default) never make one. :func:`fp8.memory_report` counts
        these bytes as ``"weight transposes"``."""
        memos = self.__dict__.get(_OPERAND_MEMO) or {}
        return tuple(t for _, value in memos.values() for t in value if t is not None)

    def __getstate__(self):
        # Pickling (torch.save, multiprocessing) leaves the operand cache behind: it is rebuilt from the payload.
        state = dict(self.__dict__)
        state.pop(_OPERAND_MEMO, None)
        return state

    def __deepcopy__(self, memo):
        held = self.__dict__.pop(_OPERAND_MEMO, None)  # a copy starts without the operand cache
        try:
            return super().__deepcopy__(memo)
        finally:
            if held is not None:
                self.__dict__[_OPERAND_MEMO] = held

    def __repr__(self) -> str:  # type: ignore[override]
        # Metadata only: no host read of the scale (a device sync on CUDA), and no format spec on values,
        # which are symbolic while torch.compile traces (Inductor's trace logging calls repr).
        block = "" if self.block is None else f", block={self.block}"
        return (
            f"Float8Tensor(format={self.format.name}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"device={self.device}{block})"
        )

    # -- subclass protocol (torch.compile, FSDP2, serialization) ----------------------------
    def __tensor_flatten__(self):
        return ["_data", "_scale"], {"dtype": self.dtype, "accumulate_backend": self.accumulate_backend,
                                     "block": self.block}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8Tensor(inner["_data"], inner["_scale"], meta["dtype"], meta.get("accumulate_backend", "auto"),
                            meta.get("block"))

    def _stable_hash_for_caching(self) -> str:
        """A hash of this tensor's metadata for torch.compile's AOT autograd cache (torch's protocol for
        traceable wrapper subclasses; see ``torch._functorch._aot_autograd.autograd_cache``): class,
        outer shape/stride/dtype/device/requires_grad, the payload's and scale's metadata and the
        accumulation backend (the flattened metadata). Never the values, and stable across processes (no
        Python ``hash``)."""

        def meta(t: torch.Tensor) -> tuple:
            return (str(t.dtype), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.device.type)

        key = (type(self).__qualname__, meta(self), self.requires_grad, meta(self._data), meta(self._scale),
               self.accumulate_backend, self.block)
        return metadata_hash(key)

    # -- FSDP2's all-gather extension (torch.distributed.fsdp.fully_shard; docs/fsdp.md) -----------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """What FSDP2 all-gathers for this shard of an FP8 weight: its payload as bytes (1 per element, padded to
        FSDP's padded shard rows) and, as metadata, its scale. The scale is one value on every rank of the shard
        group (the optimizers agree it when they quantize the shards: :mod:`fp8.fsdp`), so the gathered weight is
        one FP8 tensor, the same on every rank. Tensor-wise weights only (block scales would split at shard
        boundaries: refused by :func:`fp8.fsdp.check_shardable`)."""
        if self.block is not None:
            raise NotImplementedError(
                f"FSDP2 all-gathers tensor-wise FP8 weights only; this weight has block scales ({self.block}): use "
                f"recipe='tensorwise' with fully_shard")
        data = self._data
        rows = -(-int(outer_size[0]) // mesh.size()) if len(outer_size) else 0
        if data.dim() and data.shape[0] != rows:  # a shard shorter than FSDP's padded one: its padded rows
            padded = (rows, *data.shape[1:])
            need = (data.storage_offset() + rows * (data.stride(0) if data.dim() else 1)) * data.element_size()
            if data.is_contiguous() and data.untyped_storage().nbytes() >= need:
                data = data.as_strided(padded, data.stride(), data.storage_offset())
            else:
                grown = data.new_zeros(padded)
                grown[: data.shape[0]].copy_(data)
                data = grown
        return (data.view(torch.uint8),), (self._scale,)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The unsharded FP8 weight from the gathered bytes and the (agreed) scale: a :class:`Float8Tensor`
        reporting ``param_dtype`` (a ``MixedPrecisionPolicy``'s, so its gradient matches the other parameters'),
        sharing the shard's scale tensor (no copy). With ``out`` (FSDP's unsharded parameter from the previous
        all-gather, whose storage FSDP refilled with the version counter preserved, as autograd's saved tensors need
        between the forward and a backward that gathers again) nothing is left to do: the scale is shared, and the
        optimizer's write of it after each step is what invalidates operands memoized from the weight."""
        (data,) = all_gather_outputs
        (scale,) = metadata
        data = data.view(self._data.dtype)
        # operands derived from a gathered weight are not memoized on it (cached_operand): they would outlive FSDP2's
        # reshard, a full-size copy of every weight on every rank
        scale._fp8_fsdp_gathered = True
        if out is not None:
            if out._scale is not scale:  # the shard's scale tensor was replaced (a load): share the new one
                out._scale = scale
            return None
        return Float8Tensor(data, scale, param_dtype, self.accumulate_backend), (data,)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(Float8Tensor, OP_TABLE, DEQUANTIZE_OPS, func, args, kwargs or {}, _dequantized)


_OPERAND_MEMO = "_fp8_operand_memo"


def cached_operand(weight: Float8Tensor | None, payload: torch.Tensor, scale: torch.Tensor, key: tuple,
                   build: Callable[[], tuple]) -> tuple:
    """``build()`` (a tuple of tensors made from ``payload`` and ``scale``: a GEMM operand in another layout), kept
    with ``weight`` (:attr:`Float8Tensor.transpose_cache`) and returned again while ``weight`` is unchanged, so an
    operand derived from the weight is made once per optimizer step instead of once per backward.

    ``payload`` and ``scale`` are the ones the caller read (saved for backward); the memo is used only when they are
    ``weight``'s own. One memo is held per ``key`` (the layout: a transpose, a re-quantized copy, a stack of
    experts), each guarded by the version counters of the weight, its payload and its scale: every write of a
    :class:`Float8Tensor` bumps them (in-place ops, ``copy_``, ``load_state_dict``, the optimizers' refresh, the O3
    all-gather; :func:`_written` where the write itself does not), so a stale memo is never returned; it is dropped
    before its replacement is built. Not memoized (``build()`` each call) without a ``weight``, while
    ``torch.compile`` traces, for inference tensors, or for a weight FSDP2 gathered (its scale marked by
    :meth:`Float8Tensor.fsdp_post_all_gather`: a memo would outlive the reshard)."""
    if (weight is None or payload is not weight.__dict__.get("_data") or scale is not weight.__dict__.get("_scale")
            or torch.compiler.is_compiling() or not _plain(payload) or payload.is_inference()
            or getattr(scale, "_fp8_fsdp_gathered", False)):
        return build()
    versions = (weight._version, payload._version, scale._version)
    memos = weight.__dict__.setdefault(_OPERAND_MEMO, {})
    memo = memos.get(key)
    if memo is not None:
        if memo[0] == versions:
            return memo[1]
        del memos[key]  # free the stale operand before its replacement is made
    value = build()
    memos[key] = (versions, value)
    return value


@torch.no_grad()
def relayout_(weight: Float8Tensor, block) -> None:
    """Re-quantize ``weight`` in place into scales per ``block`` (None: one tensor-wise scale; :mod:`fp8.blocks`) from
    its own values, same format and shape: exact where every new power-of-two scale is at least the old scale of the
    values it covers (from one tensor-wise scale to per-row or per-block ones). The object is kept (an optimizer or a
    module holding it sees the new layout); the operands derived from it (:func:`cached_operand`) are dropped and its
    version bumped."""
    fresh = to_float8(weight.dequantize(torch.float32), weight.format, dtype=weight.dtype,
                      accumulate_backend=weight.accumulate_backend, block=block)
    weight.__dict__["_data"], weight.__dict__["_scale"], weight.__dict__["_block"] = fresh._data, fresh._scale, \
        fresh.block
    weight.__dict__.pop(_OPERAND_MEMO, None)
    torch.autograd.graph.increment_version([weight])


def refresh_cached_operands(weights: list, key: tuple, refresh: Callable[[list[tuple[Float8Tensor, tuple]]], None]
                            ) -> None:
    """Bring the operands kept under ``key`` (:func:`cached_operand`) up to date for every weight of ``weights`` that
    holds one made before its last write: ``refresh([(weight, operands), ...])`` rewrites them in place (one
    multi-tensor kernel for all) and returns None, or returns the new operands (a list, one tuple per weight); then
    they count as made from the weights as they are now."""
    stale = []
    for weight in weights:
        memo = (weight.__dict__.get(_OPERAND_MEMO) or {}).get(key)
        if memo is not None and memo[0] != (weight._version, weight._data._version, weight._scale._version):
            stale.append((weight, memo[1]))
    if not stale:
        return
    with torch.no_grad():
        fresh = refresh(stale)
    values = fresh if fresh is not None else [value for _, value in stale]
    for (weight, _), value in zip(stale, values):
        weight.__dict__[_OPERAND_MEMO][key] = ((weight._version, weight._data._version, weight._scale._version), value)


def _written(t: Float8Tensor) -> None:
    """Mark ``t``'s payload and scale as written in place: writes made inside ``__torch_dispatch__`` (and by kernels
    writing through pointers) leave the inner tensors' version counters as they were, and :func:`cached_operand`
    and autograd's saved-tensor checks read them."""
    inner = [x for x in (t._data, t._scale) if _plain(x) and not x.is_inference()]
    if inner:
        torch.autograd.graph.increment_version(inner)


_ADDEND_DTYPES = (torch.float32, torch.bfloat16, torch.float16, *FP8_DTYPES)


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
    if acc.block is not None or getattr(new, "block", None) is not None:
        return False  # block-scaled: the generic path re-quantizes per block
    if acc._shares_scale and acc._data.numel() != acc._data.untyped_storage().nbytes():
        return False  # a partial view keeps the scale it shares: the generic path handles it
    if not _plain(acc._data) or not acc._data.is_contiguous():
        return False
    inner = new._data if isinstance(new, Float8Tensor) else new
    return _plain(inner) and inner.dtype in _ADDEND_DTYPES and inner.device == acc._data.device


def _like(src: Float8Tensor, data: torch.Tensor, scale: torch.Tensor, block: Block | None = None) -> Float8Tensor:
    """A Float8Tensor of ``src``'s dtype and accumulation backend on a new payload and scale (and ``block``,
    default ``src``'s)."""
    return Float8Tensor(data, scale, src.dtype, src.accumulate_backend, src.block if block is None else block)


_BLOCK_SAFE_VIEWS = frozenset({aten.detach.default, aten.alias.default})
_BLOCK_TRANSPOSES = frozenset({aten.t.default, aten.transpose.int, aten.permute.default})


def _block_view(func, args, kwargs):
    """A view of a block-scaled tensor: detach/alias share the grid; a 2-D transpose transposes it. Other views
    would cut blocks apart: refused."""
    src = args[0]
    if func in _BLOCK_SAFE_VIEWS:
        view = _like(src, func(src._data, *args[1:], **kwargs), src._scale)
    elif func in _BLOCK_TRANSPOSES and src._data.dim() == 2:
        if func is aten.t.default:
            swap = True
        elif func is aten.transpose.int:
            swap = args[1] % 2 != args[2] % 2
        else:
            swap = [d % 2 for d in args[1]] == [1, 0]
        data = func(src._data, *args[1:], **kwargs)
        view = _like(src, data, src._scale.t(), transpose_block(src.block)) if swap else _like(src, data, src._scale)
    else:
        raise NotImplementedError(
            f"{func} on a block-scaled Float8Tensor (block {src.block}) would split its scale blocks; call "
            f".dequantize() first (FSDP2's fully_shard splits weights by rows: it shards tensor-wise FP8 weights only, "
            f"fp8.initialize(..., recipe='tensorwise'))"
        )
    view._shares_scale = True
    return view


def _payload_view(func, args, kwargs):
    """Ops that only re-index the payload: applied to the payload, the scale is shared."""
    src = args[0]
    if src.block is not None:
        return _block_view(func, args, kwargs)
    out = func(src._data, *args[1:], **kwargs)
    views = [_like(src, o, src._scale) for o in _as_list(out)]
    for view in views:
        view._shares_scale = True
    return views if isinstance(out, (list, tuple)) else views[0]


def _payload_copy(func, args, kwargs):
    """clone/cat/stack on Float8Tensors sharing one scale and format: done on the payloads, the result
    owning a copy of the scale; otherwise (mixed scales, formats or plain tensors) on the dequantized values."""
    tensors = args[0] if func in (aten.cat.default, aten.stack.default) else [args[0]]
    first = tensors[0]
    same = all(isinstance(t, Float8Tensor) for t in tensors) and not any(
        t._data.dtype != first._data.dtype or t.dtype != first.dtype for t in tensors)
    if first.block is not None or any(getattr(t, "block", None) is not None for t in tensors):
        if func is not aten.clone.default:
            return _dequantized(func, args, kwargs)
        return _like(first, func(first._data, *args[1:], **kwargs), first._scale.clone())
    if same and any(t._scale is not first._scale and not torch.equal(t._scale, first._scale) for t in tensors[1:]):
        same = False
    if not same:
        return _dequantized(func, args, kwargs)
    if func in (aten.cat.default, aten.stack.default):
        data = func([t._data for t in tensors], *args[1:], **kwargs)
    else:
        data = func(first._data, *args[1:], **kwargs)
    if isinstance(data, (list, tuple)):
        return [_like(first, d, first._scale.clone()) for d in data]
    return _like(first, data, first._scale.clone())


def _new_filled(func, args, kwargs):
    """``new_zeros`` / ``new_empty`` of a Float8Tensor (FSDP2 pads shards with them): an FP8 tensor of the given
    shape on a fresh payload with its own copy of the scale (a scale grid of the new shape for block scales); with a
    ``dtype`` other than this tensor's, a plain tensor."""
    src, size = args[0], list(args[1])
    dtype = kwargs.get("dtype")
    if dtype is not None and dtype != src.dtype:
        return func(src._data, size, **{**kwargs, "dtype": dtype})
    data = func(src._data, size, **{k: v for k, v in kwargs.items() if k != "dtype"})
    if src.block is None:
        return _like(src, data, src._scale.clone())
    grid = grid_shape(src.block, tuple(size))
    return _like(src, data, torch.ones(grid, dtype=torch.float32, device=data.device))


def _to_copy(func, args, kwargs):
    """``.to()``: a device move keeps FP8; a dtype change returns the dequantized value."""
    return to_copy(args, kwargs, _like)


def _copy_into(func, args, kwargs):
    """``dst.copy_(src)``: into a Float8Tensor, re-quantized (:func:`_assign`); into a plain tensor, the
    dequantized value."""
    if isinstance(args[0], Float8Tensor):
        _assign(args[0], args[1])
        return args[0]
    return _dequantized(func, args, kwargs)


def _add_inplace(func, args, kwargs):
    """``acc += new``: a whole FP8 gradient takes the fused accumulation (:mod:`fp8.kernels.grad_accumulate`,
    on ``acc``'s own ``accumulate_backend``); anything else the generic in-place path (same semantics)."""
    if _accumulates(args, kwargs):
        out = grad_accumulate.accumulate_fp8_grad(args[0], args[1], backend=args[0].accumulate_backend)
        _written(args[0])
        return out
    return _dequantized(func, args, kwargs)


def _gemm_operand(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(payload, scale)`` of a GEMM operand: a Float8Tensor's own; a plain tensor cast to E4M3 with a
    current power-of-two scale from its amax."""
    if isinstance(t, Float8Tensor):
        return t._data, t._scale
    scale = compute_scale(amax_of(t), E4M3)
    return quantize(t, scale, E4M3), scale


def _gemm_block(t: torch.Tensor) -> Block | None:
    return t.block if isinstance(t, Float8Tensor) else None


def _mm(func, args, kwargs):
    """``a @ b`` with a Float8Tensor operand (``torch.mm``, ``@``, ``torch.matmul`` and ``F.linear`` reach
    here): the FP8 GEMM (:func:`fp8.gemm.fp8_mm_payload`, fp32 accumulation, emulated where
    ``torch._scaled_mm`` cannot run) in the promoted dtype of the operands, a plain operand cast to E4M3
    with a current scale."""
    a, b = args
    if torch.is_grad_enabled() and any(t.requires_grad for t in (a, b)):
        # Autograd would record this GEMM with torch's own backward: a second, implicit FP8 training recipe
        # (current-scaled gradients, none of the recipe's formats, accumulation or collectives).
        raise RuntimeError(
            "a GEMM with a Float8Tensor operand that requires grad (e.g. F.linear(x, fp8_weight) while training) "
            "would train outside the FP8 linear recipe: use fp8.Float8Linear (fp8.initialize converts nn.Linear), "
            "or run it under torch.no_grad() / on a frozen model (fp8.freeze) for evaluation")
    out_dtype = torch.promote_types(a.dtype, b.dtype)
    return fp8_mm_payload(*_gemm_operand(a), *_gemm_operand(b), out_dtype, a_block=_gemm_block(a),
                          b_block=_gemm_block(b))


def _addmm(func, args, kwargs):
    """``beta * input + alpha * (mat1 @ mat2)`` (``F.linear`` with a bias): the product as in :func:`_mm`,
    then the add in high precision."""
    bias, mat1, mat2 = args
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    out = _mm(aten.mm.default, (mat1, mat2), {})
    if alpha != 1:
        out = out * alpha
    if beta == 0:
        return out
    bias = bias.dequantize() if isinstance(bias, Float8Tensor) else bias
    return (out + (bias if beta == 1 else bias * beta)).to(out.dtype)


def _dequantized(func, args, kwargs):
    """An op of :data:`DEQUANTIZE_OPS` on the dequantized values. An in-place op on a Float8Tensor (also
    ``_foreach_*_``) computes in fp32 and re-quantizes the result into it (:func:`_assign`); ``out=`` a
    Float8Tensor is refused."""
    return on_values(Float8Tensor, func, args, kwargs, _value32, _value, _assign)


def _value32(t):
    return t.dequantize(torch.float32) if isinstance(t, Float8Tensor) else t


def _value(t):
    return t.dequantize() if isinstance(t, Float8Tensor) else t


_PAYLOAD_VIEW_OPS = (
    aten.detach.default, aten.alias.default, aten.t.default, aten.transpose.int, aten.view.default,
    aten._unsafe_view.default, aten.as_strided.default, aten.slice.Tensor, aten.select.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.expand.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.unbind.int,
)

OP_TABLE = {
    **{op: _payload_view for op in _PAYLOAD_VIEW_OPS},
    aten.clone.default: _payload_copy,
    aten.cat.default: _payload_copy,
    aten.stack.default: _payload_copy,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_into,
    aten.add_.Tensor: _add_inplace,
    aten.mm.default: _mm,
    aten.addmm.default: _addmm,
    aten.new_zeros.default: _new_filled,
    aten.new_empty.default: _new_filled,
    "fsdp::chunk_cat": chunk_cat_values,
}
"""What each op means with a :class:`Float8Tensor` operand, ``{op: handler(func, args, kwargs)}``: views
re-index the payload and share the scale; clone/cat/stack copy payloads; ``.to()`` moves FP8 or
dequantizes on a dtype change; ``copy_`` into FP8 re-quantizes; ``add_`` into a whole FP8 gradient is the
fused accumulation; ``mm``/``addmm`` (``torch.mm``, ``@``, ``torch.matmul`` and ``F.linear`` on operands
they fold to 2-D) run the FP8 GEMM, a plain operand cast to E4M3 with a current scale; ``new_zeros``/``new_empty``
make FP8 tensors with their own scale (FSDP2's shard padding); FSDP2's ``fsdp::chunk_cat`` (keyed by name: its
library registers on import) copies an FP8 gradient's value into the reduce-scatter buffer's dtype. Ops in neither this
table nor :data:`DEQUANTIZE_OPS` raise ``NotImplementedError``."""

DEQUANTIZE_OPS = frozenset({
    # reading values: comparisons, tests, norms and reductions (clipping, finite checks, logging)
    aten.equal, aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.isnan, aten.isinf, aten.isfinite,
    aten.abs, aten.amax, aten.amin, aten.max, aten.min, aten.sum, aten.mean, aten.linalg_vector_norm,
    aten._foreach_norm, aten.allclose, aten.isclose, aten.where,
    # arithmetic with a high-precision result
    aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.pow, aten.clamp, aten.relu,
    # in-place updates of FP8 parameters and gradients (fp32, then re-quantized)
    aten.add_, aten.sub_, aten.mul_, aten.div_, aten.zero_, aten.fill_, aten.lerp_, aten.addcmul_,
    aten.addcdiv_, aten._foreach_add_, aten._foreach_mul_, aten._foreach_div_, aten._foreach_zero_,
    aten._foreach_copy_,
})
"""Ops allowed to run on a :class:`Float8Tensor`'s dequantized value (an overload packet matches all its
overloads): reading values (comparisons, reductions, norms), arithmetic whose result is a high-precision
tensor, and in-place updates of FP8 parameters and gradients (computed in fp32 and re-quantized with a
current scale, :func:`_assign`). Anything else raises ``NotImplementedError``: call ``.dequantize()``
first, so no high-precision computation on FP8 data is silent."""


def _assign(dst: Float8Tensor, src: torch.Tensor) -> None:
    """Write ``src`` into ``dst`` in place (:func:`_assign_values`) and mark its payload and scale written
    (:func:`_written`)."""
    _assign_values(dst, src)
    _written(dst)


@torch.no_grad()
def _assign_values(dst: Float8Tensor, src: torch.Tensor) -> None:
    """Write ``src`` into ``dst`` in place: payload and scale when ``src`` is FP8 of the same format,
    otherwise re-quantized with a current power-of-two scale from ``src``'s amax. A partial view
    (a slice or row of a larger FP8 tensor) shares its scale with the rest of the payload, so it is
    written with that scale (values beyond its range saturate) instead of re-scaling what it does not cover."""
    partial_view = dst._shares_scale and dst._data.numel() != dst._data.untyped_storage().nbytes()
    if dst.block is not None:
        if isinstance(src, Float8Tensor) and src._data.dtype == dst._data.dtype and src.block == dst.block:
            dst._data.copy_(src._data)
            dst._scale.copy_(src._scale)
            return
        value = src.dequantize(torch.float32) if isinstance(src, Float8Tensor) else src
        value = value.to(torch.float32).expand(dst.shape)
        scales = block_scales(value, dst.block, dst.format)
        dst._data.copy_(quantize_blocks(value, scales, dst.block, dst.format))
        dst._scale.copy_(scales)
        return
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
    accumulate_backend: str = "auto",
    block: Block | None = None,
) -> Float8Tensor:
    """Quantize ``x`` into a :class:`Float8Tensor` of format ``fmt``.

    With ``scale=None`` the scale is the current power-of-two scale from ``x``'s amax. The result
    reports ``dtype`` (default: ``x``'s dtype), owns a copy of the scale, and accumulates in-place adds
    with ``accumulate_backend`` (:attr:`Float8Tensor.accumulate_backend`). ``block`` (a 2-D ``x``) quantizes
    with one current power-of-two scale per block instead (:mod:`fp8.blocks`; ``scale`` is then the grid).
    """
    fmt = get_format(fmt)
    if isinstance(x, Float8Tensor):
        x = x.dequantize()
    if not x.is_floating_point():
        raise TypeError(f"to_float8 takes a floating-point tensor, got {x.dtype}")
    if not is_tensorwise(block):
        scales = block_scales(x, block, fmt, margin) if scale is None else scale.detach().to(x.device, torch.float32).clone()
        return Float8Tensor(quantize_blocks(x.detach(), scales, block, fmt), scales, dtype or x.dtype,
                            accumulate_backend, block)
    if scale is None:
        scale = compute_scale(amax_of(x), fmt, margin)
    else:
        scale = scale.detach().to(device=x.device, dtype=torch.float32).clone()
    return Float8Tensor(quantize(x.detach(), scale, fmt), scale, dtype or x.dtype, accumulate_backend)
