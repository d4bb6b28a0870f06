"""The delayed-scaling training step needs no device-to-host synchronisation, and the FP8 linear and
optimizer compile without graph breaks.

:class:`HostSyncDetector` records every operation that would make the host wait for a GPU, run on any device.
On a CPU-only machine there is no CUDA to observe, so the detector models which tensors live where and flags
what would block on a GPU.

**The model: host data and device data.** A tensor is *host data* when it was made on the host inside the
detector: by a tensor factory given no device (``torch.tensor(list)``, ``torch.arange(n)``, ``torch.zeros(n)``;
the default device being the CPU) or the device ``"cpu"`` spelled as a string, from Python values (a scalar
lifted by ``x[mask] = 0.0``), by ``.cpu()``/``.to("cpu")``/``.numpy()``, or computed only from host data. Every
other tensor is *device data*: what existed before the detector was entered (a model's parameters, its
batches, its buffers; name known host tensors with ``host_tensors=``), what a factory builds with a device given
as a ``torch.device`` object, an int or ``"cuda"`` (``torch.zeros(n, device=x.device)``: a device a tensor or
config reports stands for the GPU, since on a GPU it is one), and everything computed from device data. Pinned
host memory (``pin_memory()``, ``pin_memory=True``; on a CPU machine, where pinning needs CUDA, named with
``pinned_tensors=``) is host data that can be copied to the device without a sync.

**What is flagged** (each hit names the call, what it is, and the first file:line of the caller):

- *Host reads of device data*: at the dispatcher ``aten._local_scalar_dense`` (``.item()``, ``bool()``,
  ``int()``, ``float()``, ``if tensor:``), ops with data-dependent output shapes (``nonzero``, ``masked_select``,
  ``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``) or host results (``equal``); at the Python level the tensor methods handing values to the host
  (``item``, ``tolist``, ``numpy``, ``cpu``, ``__bool__``, ``__int__``, ``__float__``, ``__index__``). The same
  calls on host data are free and not flagged. A device-to-host copy (``.to("cpu")``, ``host.copy_(device)``)
  blocks unless ``non_blocking=True``; a non-blocking copy is not a sync, but reading its host tensor before any
  stream or event synchronisation is flagged too (on a GPU the values may not have landed).
- *Host-to-device copies from pageable memory*: ``.to(<device>)``, ``.to(device_tensor)``, ``.cuda()`` and
  ``device.copy_(host)`` of host data (not flagged when the source is pinned and the copy ``non_blocking``);
  ``torch.tensor``/``torch.as_tensor``/``torch.asarray``/``Tensor.new_tensor`` of Python values, NumPy arrays or
  host tensors with a device; a host tensor of one or more dimensions used as an operand of a device op (on a GPU
  either an error or an implicit copy, e.g. host indices for a device tensor). A 0-d host tensor in an
  elementwise op is read on the host as a scalar (free).
- *Stream and event synchronisation*: ``torch.cuda.synchronize``, ``torch.cuda.Event.synchronize``,
  ``torch.cuda.Stream.synchronize``, ``torch.accelerator.synchronize`` and the CPU stand-ins megatron-core gets
  from :mod:`megatron.training.compat.cpu` (``CudaOnCpu.synchronize``, ``HostStream.synchronize``):
  wrapped at the Python level while the detector is active (and only then), so the call itself is caught on a
  machine without CUDA.
- *Boolean-mask indexing* of device data: ``x[mask]`` (``aten.index`` with a bool index: a data-dependent
  shape) and ``x[mask] = values`` (``aten.index_put_`` with a bool index), except ``x[mask] = <host scalar>``,
  which ATen runs as ``masked_fill_`` (``canDispatchToMaskedFill``: no sync).

A call caught at the Python level is one hit (the dispatcher's view of the same call is not counted again). An
op on a tensor subclass (:class:`fp8.Float8Tensor`, the scaled FP16 buffer) is left to the subclass, whose own
ops on its payload and scale then pass the dispatcher's checks.
Where the host and the device are one (CPU), a move between them returns a new tensor, as on a GPU, so a host
tensor stays host data after its copy went to the device. The two reads of :class:`fp8.host_read.HostCopy` (its
copy, asynchronous and pinned on a GPU, and :meth:`~fp8.host_read.HostCopy.result`, a read one update later
whose wait is free) are the named exemption (:data:`NON_SYNCING_READS`).

Not seen: code a CPU run does not take (a ``device.type == "cuda"`` branch, e.g. pinning), the inside of a
``torch.library`` custom op (one op here, one kernel there), and kernels that read a device scalar on the host
inside ATen (e.g. ``fill_`` with a 0-d device value). Syncs outside the code the tests guard (a branch only a GPU
takes; other tests' own scaffolding) are listed in :data:`KNOWN_SYNCS`
and recorded apart (``known_hits``), each by the function it is in and its kind, so nothing else is let through.

A self-check per case proves the detector catches it, and others that it leaves alone what does not sync.
``torch.compile(fullgraph=True)`` refuses any graph break, which any such sync inside the compiled functions
would cause.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

import fp8
import fp8.host_read
from megatron.training.compat import cpu as cpu_compat
from tests.spawn import CachedLaunch

aten = torch.ops.aten
SYNC_OPS = {
    aten._local_scalar_dense.default, aten.equal.default, aten.nonzero.default, aten.masked_select.default,
    aten.is_nonzero.default, aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
    aten.bincount.default,
}
HOST_METHODS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__"}
DATA_DEPENDENT = {aten.repeat_interleave.Tensor}
"""Ops whose output size is read from device data unless given (``output_size=``)."""
MASK_READS = {aten.index.Tensor}
MASK_WRITES = {aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
FACTORIES = {getattr(torch, name) for name in (
    "tensor", "as_tensor", "asarray", "from_numpy", "frombuffer", "arange", "zeros", "ones", "full", "empty",
    "empty_strided", "eye", "linspace", "logspace", "rand", "randn", "randint", "randperm", "scalar_tensor")}
"""Tensor factories: host data when given no device (the default device being the CPU) or ``"cpu"``."""
FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
"""Factories that take their values from host data (Python values, NumPy arrays, host tensors)."""
SYNC_CALLS = [(torch.cuda, "synchronize", "torch.cuda.synchronize"),
              (torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize"),
              (torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize"),
              (torch.accelerator, "synchronize", "torch.accelerator.synchronize"),
              (cpu_compat.CudaOnCpu, "synchronize", "torch.cuda.synchronize (cpu_compat's stand-in)"),
              (cpu_compat.HostStream, "synchronize", "torch.cuda Event/Stream.synchronize (cpu_compat's stand-in)")]
"""Host-blocking calls wrapped while a detector is active: (owner, attribute, name reported)."""
# Host reads that never stall a device, by design: fp8.host_read.HostCopy posts a device-to-host copy (on a GPU
# into pinned memory, non-blocking) and HostCopy.result reads it one update later, after waiting for it (it has
# landed: the wait is free, and every rank reads at the same step, never when its own copy happens to land). On
# CPU there is no event to tell the two apart, so the two methods doing it are named here.
NON_SYNCING_READS = {fp8.host_read.HostCopy.result.__code__, fp8.host_read.HostCopy.__init__.__code__}
_SCALAR_ASSIGNMENT = ("a Python scalar assigned to one element of a device tensor is a 0-d host tensor copied to the "
                      "device (on CUDA a pageable copy and a stream sync); `[:1].fill_(value)` (a fill kernel, the "
                      "value its argument) would not sync")
KNOWN_SYNCS = {
    # a GPU-only path: on CUDA the table is pinned and copied without blocking; pinning needs CUDA, so on the CPU the
    # same function copies from pageable memory (the branch a GPU never takes)
    ("fp8/optim/fused_adam.py:_device_table", "host-to-device copy from pageable memory"):
        "the fused Adam's address tables, built on the host: pinned and copied with non_blocking=True on CUDA",
    # other tests' own NaN injections (test scaffolding around the step under test, in their owners' files)
    ("tests/training/test_training_device.py:finalize", "host-to-device copy from pageable memory"):
        f"the test's poisoned gradient, `grad.view(-1)[0] = float('nan')`: {_SCALAR_ASSIGNMENT}",
    ("tests/fp8/test_delayed_state_scaling.py:step", "host-to-device copy from pageable memory"):
        f"the test's poisoned gradient, `model[2].bias.grad[0] = float('nan')`: {_SCALAR_ASSIGNMENT}",
}
"""Syncs the tests do not count, by (origin, kind) of :class:`Hit` (each with what it is): a branch a GPU does not
take, other tests' scaffolding. Recorded apart
(:attr:`HostSyncDetector.known_hits`) so every test keeps failing on any other sync. Remove an entry once its
code is changed (the per-layout report of tests/training/test_host_sync_layouts.py prints the known hits it still sees)."""
_THIS_FILE = os.path.abspath(__file__)
_DETECTOR_FUNCTIONS = {"__torch_dispatch__", "__torch_function__", "_check", "_copy", "_from_data", "record", "read",
                       "synchronize"}
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _in_non_syncing_read() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code in NON_SYNCING_READS:
            return True
        frame = frame.f_back
    return False


def _short(filename: str) -> str:
    for marker in ("site-packages" + os.sep, os.path.dirname(os.path.dirname(os.path.dirname(_THIS_FILE))) + os.sep):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def _where() -> tuple[str, str, list[str]]:
    """(site, origin, stack): ``site`` the innermost caller outside the detector as file:line (with the first
    caller outside torch when that one is inside torch), ``origin`` that first caller outside torch as
    ``file:function`` (what a known sync is recognised by, whatever its line), ``stack`` the stack without the
    detector's frames, innermost last."""
    frames = [f for f in traceback.extract_stack(sys._getframe(1))
              if not (os.path.abspath(f.filename) == _THIS_FILE and f.name in _DETECTOR_FUNCTIONS)]
    if not frames:
        return "?", "?", []
    inner = frames[-1]
    site = f"{_short(inner.filename)}:{inner.lineno}"
    outside = next((f for f in reversed(frames) if not os.path.abspath(f.filename).startswith(_TORCH_DIR)), inner)
    if outside is not inner:
        site += f" (from {_short(outside.filename)}:{outside.lineno})"
    return site, f"{_short(outside.filename)}:{outside.name}", traceback.format_list(frames[-14:])


class Hit(str):
    """One host sync: the text (what, its kind, where, the stack) with ``what``, ``kind``, ``site`` (file:line)
    and ``origin`` (file:function of the first caller outside torch) as attributes."""

    def __new__(cls, what: str, kind: str = "", site: str = "", origin: str = "", stack: tuple = ()):
        self = super().__new__(cls, f"{what} [{kind}] at {site}\n{''.join(stack)}")
        self.what, self.kind, self.site, self.origin = what, kind, site, origin
        return self

    def __reduce__(self):
        return (_rebuild_hit, (str(self), self.what, self.kind, self.site, self.origin))

    @property
    def name(self) -> str:
        """``site: what (kind)``, one line."""
        return f"{self.site}: {self.what} ({self.kind})"


def _rebuild_hit(text: str, what: str, kind: str, site: str, origin: str) -> Hit:
    hit = str.__new__(Hit, text)
    hit.what, hit.kind, hit.site, hit.origin = what, kind, site, origin
    return hit


def count_hits(hits: list[Hit]) -> dict[str, int]:
    """Hits by :attr:`Hit.name`, most frequent first."""
    return dict(collections.Counter(hit.name for hit in hits).most_common())


class _Provenance:
    """Which tensors are host data (pinned or not), which host tensors hold an asynchronous device-to-host copy
    not yet synchronised, and the recorded hits."""

    def __init__(self, host_tensors, pinned_tensors, known) -> None:
        self.known = dict(known)
        self.known_hits: list[Hit] = []
        self.host = WeakIdKeyDictionary()
        self.pinned = WeakIdKeyDictionary()
        self.pending = WeakIdKeyDictionary()
        self.fresh = WeakIdKeyDictionary()  # 0-d tensors ATen made from nothing (autograd's zeros_like of a scalar)
        self.hits: list[Hit] = []
        self.quiet = 0  # > 0 while a call already recorded (at the Python level) runs through the dispatcher
        for t in host_tensors:
            self.host[t] = True
        for t in pinned_tensors:
            self.host[t] = self.pinned[t] = True

    def is_host(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.host

    def set_host(self, t, host: bool, pinned: bool = False) -> None:
        if not isinstance(t, torch.Tensor):
            return
        if host:
            self.host[t] = True
            if pinned:
                self.pinned[t] = True
        else:
            for table in (self.host, self.pinned, self.pending, self.fresh):
                table.pop(t, None)

    def record(self, what: str, kind: str) -> bool:
        if _in_non_syncing_read():
            return False
        site, origin, stack = _where()
        hit = Hit(what, kind, site, origin, tuple(stack))
        (self.known_hits if (origin, kind) in self.known else self.hits).append(hit)
        return True

    def read(self, t, what: str) -> bool:
        """A host read of ``t``: a sync when ``t`` is device data or an unsynchronised copy."""
        if not isinstance(t, torch.Tensor):
            return False
        if t in self.pending:
            return self.record(what, "read of an asynchronous device-to-host copy before any synchronize")
        if t not in self.host:
            return self.record(what, "device-to-host read")
        return False


def _names_host(device) -> bool | None:
    """Whether a device argument names the host (the string ``"cpu"``), the device (any other), or nothing
    (None)."""
    if device is None:
        return None
    if isinstance(device, str):
        return device.split(":")[0] == "cpu"
    return False


def _parse_to(args, kwargs):
    """``Tensor.to``'s (target, non_blocking): target the tensor given (``.to(other)``), ``"host"``, ``"device"``,
    or None (no device given)."""
    rest, kw = list(args[1:]), {k: v for k, v in kwargs.items() if k != "copy"}
    try:
        _, _, non_blocking, _ = torch._C._nn._parse_to(*rest, **kw)
    except TypeError:  # a positional copy flag
        _, _, non_blocking, _ = torch._C._nn._parse_to(*rest[:-1], **kw)
    spec = kw.get("device", kw.get("other"))
    if spec is None and rest and isinstance(rest[0], (torch.Tensor, str, torch.device, int)):
        spec = rest[0]
    if isinstance(spec, torch.Tensor):
        return spec, non_blocking
    names = _names_host(spec)
    return (None if names is None else "host" if names else "device"), non_blocking


class _Dispatch(TorchDispatchMode):
    def __init__(self, state: _Provenance) -> None:
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor for t in types):
            return NotImplemented  # a tensor subclass's own dispatch (Float8Tensor) first: its ops then come here
        kwargs = kwargs or {}
        state = self.state
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        host = [state.is_host(t) for t in tensors]
        if not state.quiet and tensors:
            self._check(func, args, kwargs, tensors, host)
        out = func(*args, **kwargs)
        if func is aten.lift_fresh.default or (tensors and all(host)):
            for t in tree_leaves(out):
                state.set_host(t, True)  # made from Python values, or from host data only
        elif not tensors and isinstance(out, torch.Tensor) and out.dim() == 0:
            state.fresh[out] = True
        return out

    def _check(self, func, args, kwargs, tensors, host) -> None:
        state = self.state
        if func in SYNC_OPS:
            for t, h in zip(tensors, host):
                if not h or t in state.pending:
                    state.read(t, str(func))
                    return
            return
        if func in DATA_DEPENDENT and not host[0] and kwargs.get("output_size") is None:
            state.record(str(func), "data-dependent output shape")
            return
        if func in MASK_READS and not host[0] and _has_mask(args[1]):
            state.record(f"{func} with a boolean mask", "boolean-mask indexing (data-dependent shape)")
            return
        if func in MASK_WRITES and not host[0] and _has_mask(args[1]):
            value = args[2]
            masks = [i for i in args[1] if i is not None]
            scalar = (state.is_host(value) and value.numel() == 1) or value in state.fresh
            if not (scalar and len(masks) == 1 and not state.is_host(masks[0])):
                state.record(f"{func} with a boolean mask", "boolean-mask indexing (data-dependent shape)")
                return
        if func in (aten.copy_.default, aten._copy_from.default):
            dst, src = args[0], args[1]
            non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            _copy(state, str(func), src, dst_host=state.is_host(dst), non_blocking=non_blocking)
            return
        if any(host) and not all(host):
            # a host tensor of >= 1 dimension beside device data: an implicit copy to the device (or an error)
            if any(h and t.dim() > 0 for t, h in zip(tensors, host)):
                state.record(f"{func} with a host tensor operand", "host-to-device copy (host operand of a device op)")


def _has_mask(indices) -> bool:
    return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)


def _copy(state: _Provenance, what: str, src, dst_host: bool, non_blocking: bool) -> bool:
    """A copy of ``src`` to the host (``dst_host``) or the device: whether it was recorded as a sync."""
    if not isinstance(src, torch.Tensor):
        return False
    src_host = state.is_host(src)
    if src_host and not dst_host:
        if non_blocking and src in state.pinned:
            return False
        return state.record(what, "host-to-device copy from pageable memory" if src not in state.pinned else
                            "host-to-device copy, blocking")
    if dst_host and not src_host:
        if non_blocking:
            return False
        return state.record(what, "device-to-host copy, blocking")
    return False


class _Function(TorchFunctionMode):
    def __init__(self, state: _Provenance) -> None:
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        state = self.state
        name = getattr(func, "__name__", None)
        method = bool(args) and isinstance(args[0], torch.Tensor) and func not in FACTORIES
        recorded, after = False, None
        if not state.quiet:
            if method and name in HOST_METHODS:
                if not (name == "numpy" and args[0] in state.pending):  # a view of the host buffer, no read
                    recorded = state.read(args[0], f"Tensor.{name}")
                if name == "cpu":
                    after = ("host", False)
            elif method and name in ("to", "cuda"):
                target, non_blocking = (_parse_to(args, kwargs) if name == "to" else
                                        ("device", bool(kwargs.get("non_blocking", False))))
                if isinstance(target, torch.Tensor):
                    target = "host" if state.is_host(target) else "device"
                if target is not None:
                    recorded = _copy(state, f"Tensor.{name}", args[0], target == "host", non_blocking)
                    after = (target, non_blocking)
            elif method and name == "copy_":
                recorded = _copy(state, "Tensor.copy_", args[1], state.is_host(args[0]),
                                 bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False)))
            elif method and name == "new_tensor":
                target = _names_host(kwargs.get("device"))
                target = state.is_host(args[0]) if target is None else target
                if not target:
                    recorded = self._from_data("Tensor.new_tensor", args[1] if len(args) > 1 else kwargs.get("data"))
                after = ("host" if target else "device", False)
            elif method and name == "pin_memory":
                after = ("pinned", False)
            elif func in FACTORIES:
                data = (args[0] if args else kwargs.get("data", kwargs.get("obj"))) if func in FROM_DATA else None
                source = data if isinstance(data, torch.Tensor) else None
                target = _names_host(kwargs.get("device"))
                if target is None:  # no device given: where the data is, else the default device (the host)
                    target = state.is_host(source) if source is not None else torch.get_default_device().type == "cpu"
                if func in FROM_DATA and not target:
                    recorded = self._from_data(f"torch.{name}(..., device=...)", data)
                elif source is not None and target:
                    recorded = _copy(state, f"torch.{name}", source, dst_host=True, non_blocking=False)
                after = ("pinned" if kwargs.get("pin_memory") else "host" if target else "device", False)
        if recorded:
            state.quiet += 1
        try:
            out = func(*args, **kwargs)
        finally:
            if recorded:
                state.quiet -= 1
        if after is not None and isinstance(out, torch.Tensor):
            kind, non_blocking = after
            source = args[0] if method else (args[0] if args and func in FROM_DATA else None)
            src_host = state.is_host(source)
            to_host = kind in ("host", "pinned")
            if out is source and to_host != src_host:
                out = out.clone()  # a move between host and device makes a new tensor, as on a GPU
            state.set_host(out, to_host, pinned=kind == "pinned")
            if to_host and non_blocking and isinstance(source, torch.Tensor) and not src_host:
                state.pending[out] = True
        return out

    def _from_data(self, what: str, data) -> bool:
        """``data`` (Python values, a NumPy array or a tensor) put on the device: a copy from the host unless
        ``data`` is device data already."""
        if isinstance(data, torch.Tensor):
            return _copy(self.state, what, data, dst_host=False, non_blocking=False)
        return self.state.record(what, "host-to-device copy from pageable memory (Python values)")


class HostSyncDetector:
    """Context manager recording every host sync (module docstring) in ``hits`` (:class:`Hit`, with its stack).

    ``host_tensors``: tensors made before the detector that are host data (everything else made before is device
    data); ``pinned_tensors``: host tensors in pinned memory (on a GPU, where ``pin_memory()`` made them);
    ``known``: syncs recorded in ``known_hits`` instead of ``hits``, by (origin, kind) (default
    :data:`KNOWN_SYNCS`)."""

    def __init__(self, host_tensors=(), pinned_tensors=(), known=None) -> None:
        self._host, self._pinned = list(host_tensors), list(pinned_tensors)
        self._known = KNOWN_SYNCS if known is None else known

    def __enter__(self):
        self.state = _Provenance(self._host, self._pinned, self._known)
        self.hits = self.state.hits
        self.known_hits = self.state.known_hits
        self._modes = [_Dispatch(self.state), _Function(self.state)]
        self._wrapped = []
        for owner, attr, what in SYNC_CALLS:
            original = getattr(owner, attr, None)
            if original is None:
                continue
            if isinstance(owner, type):
                original = owner.__dict__.get(attr, original)
            own = not isinstance(owner, type) or attr in owner.__dict__
            setattr(owner, attr, self._sync_call(original, what))
            self._wrapped.append((owner, attr, original if own else None))
        for mode in self._modes:
            mode.__enter__()
        return self

    def _sync_call(self, original, what: str):
        state = self.state

        def synchronize(*args, **kwargs):
            state.record(what, "stream/event synchronization")
            state.pending.clear()  # what was copied before has landed
            return original(*args, **kwargs)

        synchronize.__wrapped__ = original
        return synchronize

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        for owner, attr, original in reversed(self._wrapped):
            if original is None:
                delattr(owner, attr)  # inherited: the base class's again
            else:
                setattr(owner, attr, original)

    def mark_host(self, *tensors, pinned: bool = False) -> None:
        """Declare ``tensors`` host data (``pinned``: in pinned memory) while the detector runs."""
        for t in tensors:
            self.state.set_host(t, True, pinned=pinned)

    def summary(self) -> dict[str, int]:
        """The hits counted by site and what (:func:`count_hits`)."""
        return count_hits(self.hits)


def _one_hit(probe, kind: str | None = None, **detector_kwargs) -> Hit:
    """The one hit ``probe()`` makes under a detector (a call that needs CUDA may raise after it was caught)."""
    with HostSyncDetector(**detector_kwargs) as detector:
        with contextlib.suppress(AssertionError, AttributeError, RuntimeError):
            probe()
    assert len(detector.hits) == 1, f"expected one hit, got {len(detector.hits)}:\n" + "\n".join(detector.hits)
    if kind is not None:
        assert detector.hits[0].kind == kind, detector.hits[0]
    return detector.hits[0]


def _no_hit(probe, **detector_kwargs) -> None:
    with HostSyncDetector(**detector_kwargs) as detector:
        probe()
    assert not detector.hits, "\n".join(detector.hits)


def test_detector_catches_every_kind_of_host_read():
    t = torch.tensor([1.0, 2.0])  # made before the detector: device data
    probes = [lambda: bool(t[0]), lambda: t.sum().item(), lambda: t.tolist(), lambda: float(t[0]), lambda: int(t[1]),
              lambda: t.nonzero(), lambda: t.masked_select(t > 1), lambda: torch.equal(t, t), lambda: t.cpu(),
              lambda: None if t.sum() > 0 else None, lambda: t.unique(), lambda: t.numpy(),
              lambda: t.to("cpu"), lambda: torch.as_tensor(t, device="cpu"), lambda: torch.empty(2).copy_(t),
              lambda: torch.repeat_interleave(t.long())]
    for probe in probes:
        _one_hit(probe)  # once: the dispatcher's view of a call caught at the Python level is not counted again


# Host data is made inside the detector from Python values (torch.arange(4.0): a factory given no device); device data
# is what existed before it (the model's tensors) or what a factory makes on a device named by a torch.device object.
H2D_PROBES = {
    "Tensor.to(a torch.device)": lambda host, dev: host.to(dev.device),
    "Tensor.to(device=..., dtype=...)": lambda host, dev: host.to(device=dev.device, dtype=torch.float64),
    "Tensor.to(a device tensor)": lambda host, dev: host.to(dev),
    "Tensor.to(non_blocking=True) from pageable memory": lambda host, dev: host.to(dev.device, non_blocking=True),
    "Tensor.cuda()": lambda host, dev: host.cuda(),
    "device.copy_(host)": lambda host, dev: dev.copy_(host),
    "device[:] = host": lambda host, dev: dev.__setitem__(slice(None), host),
    "device[0] = a Python scalar (a 0-d host tensor copied)": lambda host, dev: dev.__setitem__(0, 1.0),
    "a host operand of a device op": lambda host, dev: dev + host,
    "host indices of a device tensor": lambda host, dev: dev[host.long()],
    "torch.tensor(list, device=...)": lambda host, dev: torch.tensor([1.0, 2.0], device=dev.device),
    "torch.as_tensor(list, device=...)": lambda host, dev: torch.as_tensor([1, 2], device=dev.device),
    "torch.as_tensor(numpy, device=...)": lambda host, dev: torch.as_tensor(host.numpy(), device=dev.device),
    "torch.as_tensor(host tensor, device=...)": lambda host, dev: torch.as_tensor(host, device=dev.device),
    "torch.tensor(scalar, device='cuda')": lambda host, dev: torch.tensor(3.0, device="cuda"),
    "Tensor.new_tensor(list) of a device tensor": lambda host, dev: dev.new_tensor([1.0, 2.0]),
}


@pytest.mark.parametrize("case", list(H2D_PROBES))
def test_detector_catches_host_to_device_copies(case):
    dev = torch.zeros(4)
    _one_hit(lambda: H2D_PROBES[case](torch.arange(4.0), dev))


def test_detector_catches_boolean_mask_indexing_and_data_dependent_shapes():
    x = torch.randn(6)
    mask, scalar, counts = x > 0, torch.ones(()), torch.tensor([1, 2])
    kind = "boolean-mask indexing (data-dependent shape)"
    _one_hit(lambda: x[mask], kind)
    _one_hit(lambda: x.__setitem__(mask, scalar), kind)  # a device value: no masked_fill_ path
    _one_hit(lambda: x.__setitem__(torch.arange(6.0) > 0, 0.0), kind)  # a host mask: not masked_fill_ either
    _one_hit(lambda: x.index_put_((mask,), scalar), kind)
    _one_hit(lambda: torch.repeat_interleave(torch.arange(2, device=x.device), counts), "data-dependent output shape")
    # x[mask] = <Python scalar> is masked_fill_ (ATen's canDispatchToMaskedFill): no sync, on its autograd path too
    _no_hit(lambda: x.__setitem__(mask, 0.0))
    y = torch.randn(6, 2, requires_grad=True)
    _no_hit(lambda: (y * 2).__setitem__(mask, 0.0))
    with HostSyncDetector() as detector:
        z = y * 2
        z[mask, :] = 0.0
        z.sum().backward()
    assert not detector.hits, "\n".join(detector.hits)


def test_detector_catches_stream_and_event_synchronization():
    """The calls themselves, caught without CUDA (torch then refuses them); restored afterwards."""
    originals = (torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize,
                 cpu_compat.HostStream.synchronize)
    kind = "stream/event synchronization"
    _one_hit(lambda: torch.cuda.synchronize(), kind)
    _one_hit(lambda: torch.cuda.Event.synchronize(object.__new__(torch.cuda.Event)), kind)
    _one_hit(lambda: torch.cuda.Stream.synchronize(object.__new__(torch.cuda.Stream)), kind)
    _one_hit(lambda: torch.accelerator.synchronize(), kind)
    _one_hit(lambda: cpu_compat.CudaOnCpu().synchronize(), kind)  # megatron-core's torch.cuda on a CPU machine
    _one_hit(lambda: cpu_compat.CudaOnCpu().Stream().record_event().synchronize(), kind)  # its streams and events
    assert (torch.cuda.synchronize, torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize,
            cpu_compat.HostStream.synchronize) == originals
    assert "synchronize" not in vars(torch.cuda.ExternalStream)


def test_detector_catches_reading_an_asynchronous_copy_before_synchronizing():
    dev = torch.arange(4.0)
    kind = "read of an asynchronous device-to-host copy before any synchronize"
    _one_hit(lambda: dev.to("cpu", non_blocking=True).tolist(), kind)
    _one_hit(lambda: dev.to("cpu"), "device-to-host copy, blocking")

    def copy_wait_read():
        host = dev.to("cpu", non_blocking=True)  # not a sync
        host.numpy()  # a view of the buffer, not a read
        cpu_compat.HostStream().synchronize()  # the one sync: the copy has landed
        assert host.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert _one_hit(copy_wait_read).kind == "stream/event synchronization"


def test_detector_leaves_alone_what_does_not_sync():
    dev, mask = torch.zeros(4), torch.zeros(4) > 0
    pinned = torch.ones(4)
    _no_hit(lambda: torch.tensor([3, 5]).cumsum(0).tolist())  # host data read on the host
    _no_hit(lambda: [int(n) for n in torch.as_tensor([1, 2]).cpu()] + torch.tensor([1]).numpy().tolist())
    _no_hit(lambda: (torch.zeros(4, device=dev.device), torch.full((), 2.0, device=dev.device),
                     torch.arange(4, device=dev.device), torch.as_tensor(dev), dev.to(dev.device), dev.double(),
                     dev.to(dev), torch.empty_like(dev), dev.new_zeros(3)))  # made or kept on the device
    _no_hit(lambda: pinned.to(dev.device, non_blocking=True) + dev, pinned_tensors=[pinned])  # pinned, asynchronous
    _no_hit(lambda: (dev.__setitem__(mask, 1.0), dev[:1].fill_(1.0), dev.__setitem__(slice(0, 1), 0.0)))  # fills
    _no_hit(lambda: dev * torch.tensor(2.0) + 1)  # a 0-d host tensor is read as a scalar
    _no_hit(lambda: (dev[torch.zeros(2, dtype=torch.long, device=dev.device)], dev.nonzero_static(size=2),
                     torch.repeat_interleave(dev.long(), torch.ones(4, dtype=torch.long, device=dev.device),
                                             output_size=4)))  # device indices, static sizes

    # a host tensor copied to the device stays host data, the copy is device data (a new tensor, as on a GPU)
    with HostSyncDetector() as detector:
        host = torch.tensor([1, 2, 3])
        detector.mark_host(host, pinned=True)
        on_device = host.to(dev.device, non_blocking=True)
        assert on_device is not host and host.tolist() == [1, 2, 3]
        on_device.tolist()  # the device copy is device data: its read is a sync
    assert [h.what for h in detector.hits] == ["Tensor.tolist"]


def test_known_core_syncs_are_kept_apart_and_nothing_else():
    dev = torch.zeros(3)

    def known_site():
        dev.tolist()
        dev.to(torch.float64).__setitem__(0, 1.0)  # another kind in the same function: not covered

    known = {("tests/training/test_no_host_sync.py:known_site", "device-to-host read"): "a test entry"}
    with HostSyncDetector(known=known) as detector:
        known_site()
        dev.tolist()
    assert [h.origin for h in detector.known_hits] == ["tests/training/test_no_host_sync.py:known_site"]
    assert [(h.origin, h.kind) for h in detector.hits] == [
        ("tests/training/test_no_host_sync.py:known_site", "host-to-device copy from pageable memory"),
        ("tests/training/test_no_host_sync.py:test_known_core_syncs_are_kept_apart_and_nothing_else", "device-to-host read")]
    assert all(origin.startswith(("fp8/", "tests/")) for origin, _ in KNOWN_SYNCS)  # the FP8 core, test scaffolding


def test_detector_exempts_only_the_history_probe_read():
    """The probe's host read is the one exemption; the same read of the same tensor elsewhere is flagged."""
    state = fp8.scaling.ScalingState(fp8.scaling.ScalingConfig(kind="delayed"))
    probe = fp8.scaling.HistoryProbe([state])
    with HostSyncDetector() as detector:
        assert probe.started() == [False]
    assert not detector.hits
    with HostSyncDetector() as detector:
        probe.copy.host.tolist()
    assert detector.hits


def _model_and_optimizer(opt_level="O2"):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 32))
    return fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), opt_level)


def test_o2_delayed_scaling_steps_do_not_sync(gen):
    """Forward, backward, clipping, optimizer step (masters, moments, FP8 weight refresh, scale update),
    zero_grad: five steps, the fourth with a NaN gradient (skipped on device), without a single sync."""
    model, optimizer = _model_and_optimizer()
    assert model[0].input_scaling.config.kind == "delayed" and model[0].grad_output_scaling.config.kind == "delayed"
    data = [(torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)) for _ in range(6)]

    def step(x, y, poison=False):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        if poison:
            model[2].weight.grad[:1].fill_(float("nan"))  # a fill kernel (x[0] = nan would copy a host scalar)
        fp8.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    step(*data[0])  # first step (current-scaling fallback) outside, so the mode sees steady state and one first
    history_before = model[0].input_scaling.amax_history.clone()
    with HostSyncDetector() as detector:
        losses = [step(x, y, poison=(i == 3)) for i, (x, y) in enumerate(data[1:])]
    assert not detector.hits, "host syncs in the training step:\n" + "\n".join(detector.hits[:3])
    assert optimizer.skipped_steps == 1 and int(optimizer.skipped_steps_counter) == 1  # read after: a sync is fine here
    assert all(torch.isfinite(loss) for loss in losses)
    assert not torch.equal(model[0].input_scaling.amax_history, history_before)  # the histories moved on device


def test_first_step_does_not_sync_either(gen):
    model, optimizer = _model_and_optimizer()
    x = torch.randn(16, 32, generator=gen)  # the batch, on the device before the step
    with HostSyncDetector() as detector:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not detector.hits, "\n".join(detector.hits[:3])


def test_linear_and_optimizer_compile_without_graph_breaks(gen):
    """fullgraph=True raises on any graph break: the FP8 linear's forward and backward and the O2
    optimizer step (masters, compressed moments, FP8 weight refresh, delayed-scale update) each compile
    into one graph, and the compiled training matches eager training."""
    torch._dynamo.reset()
    eager, eager_opt = _model_and_optimizer()
    torch.manual_seed(0)
    model, optimizer = _model_and_optimizer()
    model.load_state_dict(eager.state_dict())
    optimizer.load_state_dict(eager_opt.state_dict())
    compiled_model = torch.compile(model, fullgraph=True)
    compiled_step = torch.compile(optimizer.step, fullgraph=True)
    for _ in range(3):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)
        for m, opt_step, opt in ((eager, eager_opt.step, eager_opt), (compiled_model, compiled_step, optimizer)):
            (m(x) - y).pow(2).mean().backward()
            opt_step()
            opt.zero_grad()
    for (name, a), b in zip(eager.state_dict().items(), model.state_dict().values()):
        a = a.dequantize() if isinstance(a, fp8.Float8Tensor) else a
        b = b.dequantize() if isinstance(b, fp8.Float8Tensor) else b
        # Inductor may fuse fp32 math differently: one rounding step of E4M3 at most on the weights.
        assert torch.allclose(a.float(), b.float(), rtol=2**-3, atol=1e-6), name


def _o1_run(make_optimizer, data, skip_index=None, detect_from=1):
    """O1 training over ``data`` (the step ``skip_index`` with a NaN gradient), steps from ``detect_from``
    on under the detector; returns (model, optimizer, detector hits)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 32))
    model, optimizer = fp8.initialize(model, make_optimizer(model.parameters()), "O1")
    hits = []
    for i, (x, y) in enumerate(data):
        detector = HostSyncDetector() if i >= detect_from else None
        if detector is not None:
            detector.__enter__()
        try:
            (model(x) - y).pow(2).mean().backward()
            if i == skip_index:
                model[2].weight.grad[:1].fill_(float("nan"))
            fp8.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
        finally:
            if detector is not None:
                detector.__exit__(None, None, None)
                hits += detector.hits
    return model, optimizer, hits


def _same_training_state(a, b):
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        x = x.payload.view(torch.uint8) if isinstance(x, fp8.Float8Tensor) else x
        y = y.payload.view(torch.uint8) if isinstance(y, fp8.Float8Tensor) else y
        assert torch.equal(x, y), name


@pytest.mark.parametrize("kind", ["fused-AdamW", "SGD-momentum"])
def test_o1_steps_do_not_sync_and_skip_on_device(gen, kind):
    """O1 (torch.optim on high-precision masters): a fused torch optimizer skips through its ``found_inf``
    input (first step included); another optimizer whose states live on the parameters' device is stepped
    and masked back. Five steps, one with a NaN gradient, under the detector: no sync; the skipped step
    counts once and leaves exactly the state of a run that never took that step (bit for bit)."""
    make = {"fused-AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True),
            "SGD-momentum": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1)}[kind]
    data = [(torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)) for _ in range(6)]
    # torch creates SGD's momentum lazily on the first step: that step is decided on the host (documented).
    detect_from = 0 if kind == "fused-AdamW" else 1
    model, optimizer, hits = _o1_run(make, data, skip_index=3, detect_from=detect_from)
    assert not hits, "host syncs in the O1 step:\n" + "\n".join(hits[:3])
    assert optimizer.skipped_steps == 1 and int(optimizer.skipped_steps_counter) == 1
    reference, ref_optimizer, _ = _o1_run(make, data[:3] + data[4:], detect_from=len(data))
    _same_training_state(model, reference)
    for a, b in zip(optimizer.master_weights, ref_optimizer.master_weights):
        assert torch.equal(a, b)
    assert optimizer.state_dict()["skipped_steps"] == 1


def _o3_worker(rank: int, world: int, port: int, seed: int, out_dir: str) -> None:
    """O3 + the FP8 DDP wrapper on 2 gloo ranks: a first step, then five steps under the detector, the
    third with a NaN gradient on rank 1 only (both ranks must skip it)."""
    import os

    import torch.distributed as dist

    import fp8.distributed as fd

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                    torch.nn.Linear(64, 32))
        model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1), "O3")
        fp8.set_amax_reduction_group(model, dist.group.WORLD)
        ddp = fd.DistributedDataParallel(model, o3_optimizer=optimizer)
        gen = torch.Generator().manual_seed(seed * 10 + rank)
        data = [(torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)) for _ in range(6)]
        poison = next(p for p in optimizer.owned_params if not isinstance(p, fp8.Float8Tensor))

        def wire():
            return [(p.payload.view(torch.uint8) if isinstance(p, fp8.Float8Tensor) else p.detach()).clone()
                    for p in model.parameters()]

        def step(x, y, nan=False):
            (ddp(x) - y).pow(2).mean().backward()
            if nan and rank == 1:
                poison.grad.view(-1)[:1].fill_(float("nan"))
            optimizer.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad()

        step(*data[0])
        mu_steps_before = ddp.grad_scaling.steps.clone()
        snapshots = []
        with HostSyncDetector() as detector:
            for i, (x, y) in enumerate(data[1:]):
                step(x, y, nan=(i == 2))
                snapshots.append(wire())
        out = {"hits": detector.hits[:3], "skipped": optimizer.skipped_steps, "snapshots": snapshots,
               "mu_steps": int(ddp.grad_scaling.steps - mu_steps_before),
               "mu_buffers_are_tensors": all(isinstance(b, torch.Tensor) for b in ddp.grad_scaling.buffers())}
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


_o3_launch = CachedLaunch(_o3_worker, "no_host_sync_o3")


def test_o3_steps_do_not_sync_and_skip_on_every_rank(seed, tmp_path_factory):
    """O3 on 2 gloo ranks with the FP8 DDP wrapper (FP8 reduce-to-owner, mu updated on device, amaxes
    agreed across ranks), clipping, the sharded step and the weight all-gather: no sync in five steps.
    A NaN gradient on one rank only skips the step on both (cross-rank agreement on device): the
    parameters stay bit for bit what they were, the ranks stay identical, both count one skip."""
    _, results = _o3_launch(2, seed, tmp_path_factory)
    for rank, out in enumerate(results):
        assert not out["hits"], f"rank {rank}: host syncs in the O3 step:\n" + "\n".join(out["hits"])
        assert out["skipped"] == 1
        assert out["mu_steps"] == 5 and out["mu_buffers_are_tensors"]  # mu's rule closed every step on device
        snaps = out["snapshots"]
        assert all(torch.equal(a, b) for a, b in zip(snaps[1], snaps[2]))  # the skipped step changed nothing
        assert not all(torch.equal(a, b) for a, b in zip(snaps[2], snaps[3]))  # the next one trains again
    for a, b in zip(results[0]["snapshots"], results[1]["snapshots"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
