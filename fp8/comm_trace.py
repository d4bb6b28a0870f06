"""Collective traces, checked against NCCL's rules: what gloo forgives and NCCL does not, found on the CPU.

gloo matches point-to-point messages by peer whatever the order they were posted in, and a collective that
one rank issues and another does not may simply wait; on NCCL the first is a deadlock and the second a hang
(or mismatched data). A :class:`CollectiveTrace` records one rank's ``torch.distributed`` calls in issue
order: kind, process group (its name, the same on every rank, and its global ranks), bytes, dtype, peer,
the ``batch_isend_irecv`` group an operation belongs to, and the tag of what travelled. :class:`fp8.comm.Collectives`
records into the trace of its :class:`fp8.comm.CommBytesCounter`; ``megatron.training.compat.core_trace`` records
the calls megatron-core makes itself. :func:`check_traces` applies NCCL's rules to every rank's trace:

- **Collectives.** Every rank of a group issues the same collectives on it in the same order, each with the
  same kind, size (bytes), dtype, reduce op and root (all-to-all with uneven splits: the same kind). A rank
  that issues one more than another makes the others hang.
- **Point-to-point.** NCCL runs the operations between two ranks (over one group) in issue order on one
  stream, a ``batch_isend_irecv`` group as one unit. Sends from ``a`` to ``b`` pair with ``b``'s receives
  from ``a`` in order (same bytes; same tag where both have one, so an activation never lands in a gradient's
  buffer). Units run one after the other on each side: a unit waits until every operation in it has met
  its partner in the other side's running unit. Both ranks posting an unbatched receive (or send) first is
  the classic deadlock; the simulation finds it and any longer cycle of the same kind.

``tools/check_collective_trace.py DIR`` checks the ``rank*.jsonl`` files that ``pretrain_gpt.py
--collective-trace DIR`` writes.
"""

from __future__ import annotations

import contextlib
import json
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["TraceCall", "CollectiveTrace", "Violation", "check_traces", "load_traces", "P2P_KINDS"]

P2P_KINDS = frozenset({"send", "recv"})
"""Point-to-point kinds; every other kind is a collective over the whole group."""

_UNEVEN = frozenset({"all_to_all_v"})  # ranks may pass different sizes: only the kind must agree


@dataclass(frozen=True)
class TraceCall:
    """One call handed to the backend by one rank.

    ``nbytes``: the tensor NCCL sizes the call by (all-reduce/broadcast: the tensor; all-gather: the gathered
    output; reduce-scatter/all-to-all: the full input; send/recv: the message). ``peer``/``root``: global
    ranks. ``batch``: the rank-local id of the ``batch_isend_irecv`` group, None for an unbatched operation.
    ``source``: ``"fp8lm"`` (through :class:`fp8.comm.Collectives`) or ``"megatron-core"``.
    """

    seq: int
    kind: str
    group: str
    ranks: tuple[int, ...]
    nbytes: int
    dtype: str
    peer: int | None = None
    batch: int | None = None
    tag: str | None = None
    op: str | None = None
    root: int | None = None
    source: str = "fp8lm"

    def describe(self) -> str:
        what = f"{self.kind} #{self.seq} ({self.nbytes} B {self.dtype}"
        if self.peer is not None:
            what += f", peer {self.peer}"
        if self.batch is not None:
            what += f", batch {self.batch}"
        if self.tag:
            what += f", tag {self.tag!r}"
        return what + f", {self.source})"


class CollectiveTrace:
    """One rank's calls in issue order (:class:`TraceCall`); ``batch()`` marks a ``batch_isend_irecv`` group."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.calls: list[TraceCall] = []
        self._batch: int | None = None
        self._batches = 0

    def record(self, kind: str, group: str, ranks: Sequence[int], nbytes: int, dtype: str, *, peer: int | None = None,
               tag: str | None = None, op: str | None = None, root: int | None = None,
               source: str = "fp8lm") -> TraceCall:
        """Append one call (``group``: the process group's name; ``ranks``: its global ranks)."""
        batch = self._batch if kind in P2P_KINDS else None
        call = TraceCall(len(self.calls), kind, group, tuple(int(r) for r in ranks), int(nbytes), str(dtype),
                         peer, batch, tag, op, root, source)
        self.calls.append(call)
        return call

    @contextlib.contextmanager
    def batch(self) -> Iterator[int]:
        """Point-to-point operations recorded inside form one ``batch_isend_irecv`` group."""
        if self._batch is not None:
            raise RuntimeError("batch_isend_irecv groups do not nest")
        self._batch, self._batches = self._batches, self._batches + 1
        try:
            yield self._batch
        finally:
            self._batch = None

    def save(self, path: str | Path) -> Path:
        """Write the trace as JSON lines (a header with the rank, then one call a line)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as f:
            f.write(json.dumps({"rank": self.rank, "calls": len(self.calls)}) + "\n")
            for call in self.calls:
                f.write(json.dumps(asdict(call)) + "\n")
        return path

    @staticmethod
    def load(path: str | Path) -> tuple[int, list[TraceCall]]:
        """``(rank, calls)`` of a file written by :meth:`save`."""
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        if not lines:
            raise ValueError(f"{path}: empty trace file (the rank died before writing it?)")
        calls = []
        for number, line in enumerate(lines, start=1):
            try:
                fields = json.loads(line)
                if number == 1:
                    rank = int(fields["rank"])
                    continue
                fields["ranks"] = tuple(fields["ranks"])
                calls.append(TraceCall(**fields))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}: line {number} is not a trace record ({error}); the file is truncated or "
                                 f"not one CollectiveTrace.save wrote: trace the run again") from None
        return rank, calls


def load_traces(directory: str | Path, world_size: int | None = None) -> dict[int, list[TraceCall]]:
    """The ``rank*.jsonl`` traces in ``directory`` by global rank (with ``world_size``: ranks 0 to
    ``world_size - 1``, each required)."""
    directory = Path(directory)
    if world_size is None:
        files = sorted(directory.glob("rank*.jsonl"))
    else:
        files = [directory / f"rank{r}.jsonl" for r in range(world_size)]
        missing = [f.name for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{directory}: no trace for {', '.join(missing)} (did those ranks die?)")
    if not files:
        raise FileNotFoundError(f"no rank*.jsonl collective traces in {directory} (run with --collective-trace DIR)")
    traces = {}
    for file in files:
        rank, calls = CollectiveTrace.load(file)
        traces[rank] = calls
    return traces


@dataclass(frozen=True)
class Violation:
    """A broken NCCL rule: ``rule`` (``"collective"``, ``"p2p-deadlock"``, ``"p2p-mismatch"``, ``"missing"``)."""

    rule: str
    message: str

    def __str__(self) -> str:
        return f"[{self.rule}] {self.message}"


def check_traces(traces: Mapping[int, Sequence[TraceCall]]) -> list[Violation]:
    """Every violation of NCCL's rules in the traces of all ranks (empty: NCCL would run them as gloo did)."""
    violations = _check_members(traces)
    violations += _check_collectives(traces)
    violations += _check_p2p(traces)
    return violations


def _check_members(traces: Mapping[int, Sequence[TraceCall]]) -> list[Violation]:
    needed = {r for calls in traces.values() for c in calls for r in c.ranks}
    return [Violation("missing", f"rank {r} takes part in traced calls but has no trace") for r in sorted(needed - set(traces))]


def _check_collectives(traces: Mapping[int, Sequence[TraceCall]]) -> list[Violation]:
    by_group: dict[str, dict[int, list[TraceCall]]] = defaultdict(lambda: defaultdict(list))
    members: dict[str, tuple[int, ...]] = {}
    for rank, calls in traces.items():
        for call in calls:
            if call.kind not in P2P_KINDS:
                by_group[call.group][rank].append(call)
                members[call.group] = call.ranks
    violations = []
    for group, per_rank in sorted(by_group.items()):
        ranks = [r for r in members[group] if r in traces]
        ref = ranks[0]
        for rank in ranks[1:]:
            mine, theirs = per_rank.get(rank, []), per_rank.get(ref, [])
            problem = _first_collective_mismatch(theirs, mine)
            if problem is not None:
                i, detail = problem
                violations.append(Violation("collective", (
                    f"group {group} (ranks {list(members[group])}): call {i} on the group differs between rank {ref} "
                    f"and rank {rank}: {detail}")))
                break  # later calls of this group are shifted: one report per group
    return violations


def _first_collective_mismatch(a: Sequence[TraceCall], b: Sequence[TraceCall]) -> tuple[int, str] | None:
    for i, (x, y) in enumerate(zip(a, b)):
        same = x.kind == y.kind and (x.kind in _UNEVEN or (x.nbytes, x.dtype, x.op, x.root) == (y.nbytes, y.dtype, y.op, y.root))
        if not same:
            return i, f"{x.describe()} vs {y.describe()}"
    if len(a) != len(b):
        longer, extra = ("first", a[len(b)]) if len(a) > len(b) else ("second", b[len(a)])
        return min(len(a), len(b)), (
            f"{len(a)} vs {len(b)} calls; the {longer} rank goes on with {extra.describe()}, which the other never "
            f"issues (a hang on NCCL)")
    return None


def _check_p2p(traces: Mapping[int, Sequence[TraceCall]]) -> list[Violation]:
    # Units per (group, rank, peer): consecutive operations of one batch form one unit, an unbatched one its own.
    units: dict[tuple[str, int, int], list[list[TraceCall]]] = defaultdict(list)
    last_batch: dict[tuple[str, int, int], int | None] = {}
    for rank, calls in traces.items():
        for call in calls:
            if call.kind not in P2P_KINDS:
                continue
            key = (call.group, rank, call.peer)
            if call.batch is not None and last_batch.get(key) == call.batch and units[key]:
                units[key][-1].append(call)
            else:
                units[key].append([call])
            last_batch[key] = call.batch
    violations = []
    pairs = sorted({(g, min(r, p), max(r, p)) for g, r, p in units})
    for group, a, b in pairs:
        violations += _simulate_pair(group, a, b, units.get((group, a, b), []), units.get((group, b, a), []))
    return violations


def _simulate_pair(group: str, a: int, b: int, units_a: list[list[TraceCall]], units_b: list[list[TraceCall]]) -> list[Violation]:
    """Pair sends with receives in order per direction, then run both sides' units in order: a unit completes
    once each of its operations has met its partner in the other side's running unit."""
    where = f"group {group}, ranks {a} and {b}"
    violations = []
    partner: dict[tuple[int, int], tuple[int, int]] = {}  # (side, op id) -> (other side, op id)
    flat = {0: [c for u in units_a for c in u], 1: [c for u in units_b for c in u]}
    ops = {side: {id(c): i for i, c in enumerate(calls)} for side, calls in flat.items()}
    for sender, receiver in ((0, 1), (1, 0)):
        sends = [c for c in flat[sender] if c.kind == "send"]
        recvs = [c for c in flat[receiver] if c.kind == "recv"]
        src, dst = (a, b) if sender == 0 else (b, a)
        for s, r in zip(sends, recvs):
            if s.nbytes != r.nbytes or (s.tag and r.tag and s.tag != r.tag):
                violations.append(Violation("p2p-mismatch", (
                    f"{where}: rank {src}'s {s.describe()} meets rank {dst}'s {r.describe()}")))
            partner[(sender, ops[sender][id(s)])] = (receiver, ops[receiver][id(r)])
            partner[(receiver, ops[receiver][id(r)])] = (sender, ops[sender][id(s)])
        if len(sends) != len(recvs):
            extra = sends[len(recvs)] if len(sends) > len(recvs) else recvs[len(sends)]
            owner = src if len(sends) > len(recvs) else dst
            violations.append(Violation("p2p-mismatch", (
                f"{where}: rank {src} sends {len(sends)} messages to rank {dst}, which receives {len(recvs)}; rank "
                f"{owner}'s {extra.describe()} has no partner (a hang on NCCL)")))
    if violations:
        return violations
    # Run the units: ids of each side's units, in order.
    seq = {0: [[ops[0][id(c)] for c in u] for u in units_a], 1: [[ops[1][id(c)] for c in u] for u in units_b]}
    head = {0: 0, 1: 0}
    done: set[tuple[int, int]] = set()
    while head[0] < len(seq[0]) or head[1] < len(seq[1]):
        progressed = False
        running = {side: set(seq[side][head[side]]) if head[side] < len(seq[side]) else set() for side in (0, 1)}
        for side in (0, 1):
            for op in running[side]:
                other_side, other = partner[(side, op)]
                if (side, op) not in done and other in running[other_side]:
                    done.update({(side, op), (other_side, other)})
                    progressed = True
        for side in (0, 1):
            if head[side] < len(seq[side]) and all((side, op) in done for op in seq[side][head[side]]):
                head[side] += 1
                progressed = True
        if not progressed:
            first = {side: flat[side][seq[side][head[side]][0]] if head[side] < len(seq[side]) else None for side in (0, 1)}
            describe = " and ".join(
                f"rank {rank} waits in {first[side].describe()}" + (" (unbatched)" if first[side].batch is None else "")
                for side, rank in ((0, a), (1, b)) if first[side] is not None)
            violations.append(Violation("p2p-deadlock", (
                f"{where}: {describe}; each partner is queued behind the other's blocked operation (NCCL runs a "
                f"pair's operations in issue order: post both directions as one batch_isend_irecv group)")))
            break
    return violations
