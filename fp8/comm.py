"""Every collective of fp8lm, in one place: counted by tag, FP8 carried as ``uint8``, on the group's device.

No other module of the project calls ``torch.distributed`` collectives; they all hold a
:class:`Collectives` over their process group. What it guarantees for every call:

- **Counted.** Each rank's bytes sent are recorded in an optional :class:`CommBytesCounter`, by tag
  (what travelled: ``"fp8 grads"``, ``"sp all-gather"``, ``"pp activations"``, ...) and by collective,
  with the ring costs of :data:`RING_FACTORS` (for a full tensor of ``B`` bytes over ``N`` ranks):

  - all-reduce: ``2 (N-1)/N * B`` (ring reduce-scatter then ring all-gather)
  - all-gather, reduce-scatter, all-to-all, broadcast: ``(N-1)/N * B`` (``B``: the gathered output,
    the scattered input, the full all-to-all input, the broadcast tensor)
  - all-to-all with uneven splits (``all_to_all_v``): ``B`` given as the bytes sent to the other ranks
  - send: ``B``; receive: 0 (the call is still counted)

  Python objects (checkpoint coordination, log gathering) travel as pickled ``uint8`` tensors through
  the same tensor collectives, so they are counted the same way.
- **FP8 as bytes.** gloo and NCCL refuse float8 tensors in collectives but carry the same bytes viewed
  as ``uint8`` (:func:`fp8.formats.byte_view`); sums (all-reduce, reduce-scatter) of FP8 are refused.
- **On the group's device.** Every tensor handed to the backend must be on :func:`group_device` (CUDA for
  NCCL, the CPU for gloo): a tensor elsewhere is refused with an error naming its tag and device, never
  copied behind the caller's back (on NCCL that would hide a misplaced tensor behind a host sync). The
  pickled-object helpers build their byte tensors on the group's device and read them back explicitly.
- **Traced, when asked.** With a :class:`fp8.comm_trace.CollectiveTrace` on the counter
  (``CommBytesCounter(trace=...)``), every call is also recorded in issue order (kind, group, peer, bytes,
  ``batch_isend_irecv`` group, tag) for :func:`fp8.comm_trace.check_traces`, which applies NCCL's rules.
- **Point-to-point in both directions is one group.** :meth:`Collectives.batch_isend_irecv` posts a
  schedule step's sends and receives as one ``batch_isend_irecv`` group, which NCCL runs without deadlock
  whatever the order of the operations inside.
"""

from __future__ import annotations

import contextlib
import pickle
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .comm_trace import CollectiveTrace
from .formats import FP8_DTYPES, byte_view

__all__ = ["Collectives", "CommBytesCounter", "P2PMessage", "RING_FACTORS", "ring_bytes", "group_device",
           "require_process_group"]

RING_FACTORS = {
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,
    "all_to_all_v": lambda n: 1.0,
    "recv": lambda n: 0.0,
}
"""Bytes each rank sends per byte of the full tensor, as a function of the group size ``N``."""

# all_gather_single replaces the deprecated all_gather_into_tensor in recent torch releases.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def ring_bytes(kind: str, nbytes: int, world_size: int) -> float:
    """Bytes each rank sends for collective ``kind`` on a ``nbytes``-byte tensor over ``world_size`` ranks."""
    if kind not in RING_FACTORS:
        raise ValueError(f"unknown collective {kind!r}; expected one of {sorted(RING_FACTORS)}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return RING_FACTORS[kind](world_size) * nbytes


class CommBytesCounter:
    """Accumulates ring-cost bytes sent by this rank, per tag (what travelled) and per collective.

    ``record`` is called at each collective call; ``total`` and ``by_tag`` read the sums (floats:
    the ring factors are fractional), ``calls`` the number of calls per tag; ``reset`` clears all.
    ``trace`` (a :class:`fp8.comm_trace.CollectiveTrace`, optional): every :class:`Collectives` counting here
    also records each call it hands the backend there, in issue order.
    """

    def __init__(self, trace: CollectiveTrace | None = None) -> None:
        self.trace = trace
        self.by_tag: dict[str, float] = defaultdict(float)
        self.by_kind: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def record(self, kind: str, nbytes: int, world_size: int, tag: str) -> float:
        """Count one ``kind`` collective on a ``nbytes``-byte tensor; returns the bytes this rank sends."""
        sent = ring_bytes(kind, nbytes, world_size)
        self.by_tag[tag] += sent
        self.by_kind[kind] += sent
        self.calls[tag] += 1
        return sent

    @property
    def total(self) -> float:
        """All bytes sent since the last reset."""
        return float(sum(self.by_tag.values()))

    def reset(self) -> None:
        """Forget every recorded call."""
        self.by_tag.clear()
        self.by_kind.clear()
        self.calls.clear()

    def summary(self) -> dict[str, dict[str, float]]:
        """Plain-dict copy: ``{"total": ..., "by_tag": {...}, "by_kind": {...}, "calls": {...}}``."""
        return {
            "total": self.total, "by_tag": dict(self.by_tag), "by_kind": dict(self.by_kind), "calls": dict(self.calls)
        }


def require_process_group(what: str) -> None:
    """Raise a clear error when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{what} needs an initialized process group: call torch.distributed.init_process_group('gloo' or 'nccl') "
            f"first (torchrun sets the rendezvous environment)"
        )


def group_device(group: dist.ProcessGroup | None = None) -> torch.device | None:
    """The device whose tensors ``group``'s backend carries: CUDA (the current device) for NCCL, the CPU for
    gloo/MPI, the device named by a one-device spec (``"meta:gloo"`` -> meta); ``None`` for a backend that
    serves several devices (``"cpu:gloo,cuda:nccl"``)."""
    backend = str(dist.get_backend(group)).lower()
    if "," in backend:
        return None
    device_type, _, name = backend.rpartition(":")
    if not device_type:
        device_type = {"nccl": "cuda", "xccl": "xpu"}.get(name, "cpu")
    if device_type in ("cuda", "xpu"):
        return torch.device(device_type, getattr(torch, device_type).current_device())
    return torch.device(device_type)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class P2PMessage:
    """One point-to-point operation of a :meth:`Collectives.batch_isend_irecv` group: ``kind`` ``"send"`` or
    ``"recv"``, the tensor sent or received into, the group rank of the peer, and the tag counted."""

    __slots__ = ("kind", "tensor", "peer", "tag")

    def __init__(self, kind: str, tensor: torch.Tensor, peer: int, tag: str) -> None:
        if kind not in ("send", "recv"):
            raise ValueError(f"P2PMessage kind must be 'send' or 'recv', got {kind!r}")
        self.kind, self.tensor, self.peer, self.tag = kind, tensor, peer, tag


class Collectives:
    """Collectives over one process group (``None``: the default group), counted, on the group's device.

    Every method returns a ``torch.distributed`` work handle (call ``.wait()`` to block); ``tag`` names
    what travelled in the counter. ``counter`` may be set later (with a trace on it, calls are also traced).
    ``device`` overrides the group's device.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, counter: CommBytesCounter | None = None,
                 device: torch.device | None = None) -> None:
        require_process_group("fp8 collectives")
        self.group = group if group is not None else dist.group.WORLD
        self.counter = counter
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.device = device if device is not None else group_device(self.group)
        self.global_ranks = tuple(dist.get_process_group_ranks(self.group))
        self.name = self.group.group_name

    # -- the rules: count (and trace), bytes on the wire, device ---------------------------------------
    def _count(self, kind: str, nbytes: int, tag: str, tensor: torch.Tensor | None = None, *, peer: int | None = None,
               op: dist.ReduceOp | None = None, root: int | None = None) -> None:
        """Count one call (``nbytes`` as :data:`RING_FACTORS` takes it) and, with a trace, record the call
        as NCCL sizes it (``tensor``: the tensor it is sized by; ``peer``/``root``: global ranks)."""
        if self.counter is None:
            return
        self.counter.record(kind, nbytes, self.world_size, tag)
        trace = self.counter.trace
        if trace is not None and tensor is not None:
            trace.record("all_to_all_v" if kind == "all_to_all_v" else kind, self.name, self.global_ranks,
                         _nbytes(tensor), str(byte_view(tensor).dtype), peer=peer, tag=tag,
                         op=None if op is None else str(op), root=root)

    def _place(self, tensor: torch.Tensor, tag: str) -> torch.Tensor:
        if tensor.dtype in FP8_DTYPES and not tensor.is_contiguous():
            raise ValueError(f"{tag!r}: FP8 tensors must be contiguous to travel as uint8; call .contiguous() first")
        if self.device is not None and tensor.device != self.device:
            raise ValueError(
                f"{tag!r}: a tensor on {tensor.device} handed to a collective of a group whose backend "
                f"({dist.get_backend(self.group)}) carries {self.device} tensors; allocate it on {self.device} "
                f"(collectives never copy behind the caller's back: on NCCL that is a hidden host sync)")
        return tensor

    def _run(self, call, writes: Sequence[torch.Tensor], reads: Sequence[torch.Tensor], tag: str):
        """Run ``call(*writes, *reads)`` (as ``uint8`` byte views, every tensor on the group's device)
        asynchronously."""
        tensors = [byte_view(self._place(t, tag)) for t in (*writes, *reads)]
        return call(*tensors)

    # -- tensor collectives ----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM, tag: str = "grads") -> dist.Work:
        """In-place all-reduce of ``tensor`` (not FP8: sums need arithmetic) with ``op``."""
        if tensor.dtype in FP8_DTYPES:
            raise TypeError("FP8 tensors cannot be all-reduced by the backend; use fp8.distributed.scaled_all_reduce")
        self._count("all_reduce", _nbytes(tensor), tag, tensor, op=op)
        return self._run(lambda t: dist.all_reduce(t, op=op, group=self.group, async_op=True), [tensor], [], tag)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, tag: str) -> dist.Work:
        """``output`` (``world_size`` times ``input`` along dim 0) gets every rank's ``input`` in rank order.
        Counted on the full ``output``."""
        self._count("all_gather", _nbytes(output), tag, output)
        return self._run(lambda o, i: _all_gather(o, i, group=self.group, async_op=True), [output], [input], tag)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, tag: str,
                       op: dist.ReduceOp = dist.ReduceOp.SUM) -> dist.Work:
        """``output`` gets chunk ``rank`` (along dim 0) of the reduction of ``input`` over the group (not FP8).
        Counted on the full ``input``."""
        if input.dtype in FP8_DTYPES:
            raise TypeError("FP8 tensors cannot be reduced by the backend; move them with all_to_all and sum in fp32")
        self._count("reduce_scatter", _nbytes(input), tag, input, op=op)
        return self._run(lambda o, i: dist.reduce_scatter_tensor(o, i, op=op, group=self.group, async_op=True),
                         [output], [input], tag)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, tag: str) -> dist.Work:
        """Equal-split all-to-all: chunk ``j`` of ``input`` goes to rank ``j``; chunk ``j`` of ``output``
        comes from rank ``j``. Counted on the full ``input``."""
        self._count("all_to_all", _nbytes(input), tag, input)
        return self._run(lambda o, i: dist.all_to_all_single(o, i, group=self.group, async_op=True), [output], [input],
                         tag)

    def all_to_all_v(
        self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int], input_splits: list[int], tag: str
    ) -> dist.Work:
        """All-to-all with uneven splits (1-d tensors): ``input_splits[j]`` elements go to rank ``j``,
        ``output_splits[j]`` elements come from rank ``j``. Counted as the bytes sent to other ranks."""
        sent = (sum(input_splits) - input_splits[self.rank]) * input.element_size()
        self._count("all_to_all_v", sent, tag, input)
        return self._run(lambda o, i: dist.all_to_all_single(
            o, i, output_split_sizes=list(output_splits), input_split_sizes=list(input_splits), group=self.group,
            async_op=True), [output], [input], tag)

    def broadcast(self, tensor: torch.Tensor, tag: str, src: int = 0) -> dist.Work:
        """In-place broadcast of ``tensor`` from group rank ``src``."""
        source = dist.get_global_rank(self.group, src)
        self._count("broadcast", _nbytes(tensor), tag, tensor, root=source)
        return self._run(lambda t: dist.broadcast(t, src=source, group=self.group, async_op=True), [tensor], [], tag)

    def send(self, tensor: torch.Tensor, peer: int, tag: str) -> dist.Work:
        """Asynchronous send of ``tensor`` to group rank ``peer``. On NCCL the operations between two ranks run
        in issue order: an exchange in both directions goes through :meth:`batch_isend_irecv` instead."""
        target = dist.get_global_rank(self.group, peer)
        self._count("send", _nbytes(tensor), tag, tensor, peer=target)
        return self._run(lambda t: dist.isend(t, target, group=self.group), [], [tensor], tag)

    def recv(self, tensor: torch.Tensor, peer: int, tag: str) -> dist.Work:
        """Asynchronous receive into ``tensor`` from group rank ``peer`` (counted as a call, 0 bytes sent)."""
        source = dist.get_global_rank(self.group, peer)
        self._count("recv", _nbytes(tensor), tag, tensor, peer=source)
        return self._run(lambda t: dist.irecv(t, source, group=self.group), [tensor], [], tag)

    def batch_isend_irecv(self, messages: Sequence[P2PMessage]) -> list[dist.Work]:
        """Post ``messages`` (sends and receives, to and from any group ranks) as one ``batch_isend_irecv``
        group: NCCL runs it as one unit, so the two directions of an exchange can never wait on each other.
        Each message is counted like :meth:`send`/:meth:`recv`. Returns the group's work handles (wait on all
        of them: NCCL may return one handle for the whole group)."""
        if not messages:
            return []
        ops = []
        trace = self.counter.trace if self.counter is not None else None
        with trace.batch() if trace is not None else contextlib.nullcontext():
            for m in messages:
                peer = dist.get_global_rank(self.group, m.peer)
                self._count(m.kind, _nbytes(m.tensor), m.tag, m.tensor, peer=peer)
                tensor = byte_view(self._place(m.tensor, m.tag))
                ops.append(dist.P2POp(dist.isend if m.kind == "send" else dist.irecv, tensor, peer, self.group))
        return list(dist.batch_isend_irecv(ops))

    def barrier(self, tag: str) -> None:
        """Block until every rank of the group arrives: a 1-element all-reduce on the group's device (so
        NCCL needs no device guess), counted as one."""
        self.all_reduce(torch.zeros(1, dtype=torch.int32, device=self._object_device()), tag=tag).wait()

    # -- Python objects, as pickled bytes through the tensor collectives -------------------------------
    def _object_device(self) -> torch.device:
        return self.device if self.device is not None else torch.device("cpu")

    def all_gather_object(self, obj: Any, tag: str) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order: sizes, then the padded pickles, all-gathered."""
        device = self._object_device()
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        sizes = torch.empty(self.world_size, dtype=torch.int64, device=device)
        self.all_gather(sizes, size, tag).wait()
        lengths = sizes.tolist()
        longest = max(lengths)
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[:payload.numel()] = payload
        gathered = torch.empty(self.world_size * longest, dtype=torch.uint8, device=device)
        self.all_gather(gathered, padded, tag).wait()
        host = gathered.cpu().view(self.world_size, longest)
        return [pickle.loads(host[r, :n].numpy().tobytes()) for r, n in enumerate(lengths)]

    def broadcast_object(self, obj: Any, tag: str, src: int = 0) -> Any:
        """Group rank ``src``'s ``obj`` (picklable) on every rank: its size, then its pickle, broadcast."""
        device = self._object_device()
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
        else:
            size = torch.empty(1, dtype=torch.int64, device=device)
        self.broadcast(size, tag, src).wait()
        if self.rank != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        self.broadcast(payload, tag, src).wait()
        return obj if self.rank == src else pickle.loads(payload.cpu().numpy().tobytes())
