"""The collectives megatron-core issues itself, recorded in a :class:`fp8.comm_trace.CollectiveTrace`.

Every collective of fp8lm goes through :class:`fp8.comm.Collectives`, which records into the trace of its
counter. A few megatron-core modules call ``torch.distributed`` directly: the tensor-parallel mappings and
layers (sequence-parallel gathers and scatters, the embedding and output-layer reductions), the
vocabulary-parallel cross-entropy and the tied-embedding set-up. :func:`trace_megatron_core` rebinds the names
those modules call through (their ``torch``, and the ``dist_all_gather_func`` / ``dist_reduce_scatter_func``
they bound at import) to thin views that record each call and forward it unchanged; :meth:`CoreTrace.close`
puts the previous bindings back. torch itself is not changed, and nothing is rebound unless a trace is asked
for (``pretrain_gpt.py --collective-trace DIR``).
"""

from __future__ import annotations

import importlib
import inspect

import torch.distributed as dist

from fp8.comm_trace import CollectiveTrace, check_traces, load_traces

__all__ = ["trace_megatron_core", "CoreTrace", "TRACED_MODULES", "check_trace_directory", "CollectiveTraceError"]

TRACED_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.cross_entropy",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.utils",
)
"""The megatron-core modules whose ``torch.distributed`` calls are recorded."""

# torch.distributed function -> the argument NCCL sizes the call by (a tensor, or a list of tensors; None: no data).
_SIZED_BY = {"all_reduce": "tensor", "all_gather_into_tensor": "output_tensor", "_all_gather_base": "output_tensor",
             "all_gather": "tensor_list", "reduce_scatter_tensor": "input", "_reduce_scatter_base": "input",
             "reduce_scatter": "input_list", "all_to_all_single": "input", "broadcast": "tensor", "isend": "tensor",
             "irecv": "tensor", "send": "tensor", "recv": "tensor", "barrier": None}
_CALLS = tuple(_SIZED_BY)
# The kind recorded, where it is not the function's name.
_KIND = {"all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather", "reduce_scatter_tensor":
         "reduce_scatter", "_reduce_scatter_base": "reduce_scatter", "all_to_all_single": "all_to_all", "isend": "send",
         "irecv": "recv"}
_FUNC_NAMES = {"dist_all_gather_func", "dist_reduce_scatter_func"}


def _record(trace: CollectiveTrace, name: str, function, args, kwargs) -> None:
    kind, sized_by = _KIND.get(name, name), _SIZED_BY[name]
    bound = inspect.signature(function).bind_partial(*args, **kwargs)
    bound.apply_defaults()
    values = bound.arguments
    group = values.get("group") or dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    nbytes, dtype = 0, "none"
    if sized_by is not None:
        sized = values[sized_by]
        tensors = list(sized) if isinstance(sized, (list, tuple)) else [sized]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        dtype = str(tensors[0].dtype)
    if kind == "all_to_all" and values.get("input_split_sizes") is not None:
        kind = "all_to_all_v"
    peer = root = None
    if kind in ("send", "recv"):
        peer = values.get("dst") if kind == "send" else values.get("src")
        if peer is None:  # given as a group rank
            peer = dist.get_global_rank(group, values.get("group_dst") if kind == "send" else values.get("group_src"))
    if kind == "broadcast":
        root = values.get("src")
        if root is None:
            root = dist.get_global_rank(group, values.get("group_src"))
    op = values.get("op")
    trace.record(kind, group.group_name, ranks, nbytes, dtype, peer=peer, root=root,
                 op=None if op is None or kind not in ("all_reduce", "reduce_scatter") else str(op),
                 source="megatron-core")


def _traced(trace: CollectiveTrace, name: str, function):
    def call(*args, **kwargs):
        _record(trace, name, function, args, kwargs)
        return function(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    call.__wrapped__ = function
    return call


class _TracedDistributed:
    """``torch.distributed`` as a traced megatron-core module sees it: the collectives recorded, the rest as is."""

    def __init__(self, trace: CollectiveTrace) -> None:
        self._calls = {name: _traced(trace, name, getattr(dist, name)) for name in _CALLS if hasattr(dist, name)}

    def __getattr__(self, name):
        return self._calls.get(name) or getattr(dist, name)


class _TracedTorch:
    """The ``torch`` a traced module sees: its previous ``torch`` (possibly the CPU compatibility view) with
    ``distributed`` recorded."""

    def __init__(self, inner, distributed: _TracedDistributed) -> None:
        self._inner = inner
        self.distributed = distributed

    def __getattr__(self, name):
        return getattr(self._inner, name)


class CoreTrace:
    """The rebinding made by :func:`trace_megatron_core`; :meth:`close` restores the previous names."""

    def __init__(self, trace: CollectiveTrace) -> None:
        self.trace = trace
        self._previous: list[tuple[object, str, object]] = []
        distributed = _TracedDistributed(trace)
        for module_name in TRACED_MODULES:
            module = importlib.import_module(module_name)
            self._rebind(module, "torch", _TracedTorch(module.torch, distributed))
            for name in _FUNC_NAMES:
                original = getattr(module, name, None)
                if original is not None:
                    self._rebind(module, name, _traced(trace, _torch_name(original), original))

    def _rebind(self, module, name: str, value) -> None:
        self._previous.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def close(self) -> None:
        """Put back the names this trace rebound (in reverse order)."""
        for module, name, value in reversed(self._previous):
            setattr(module, name, value)
        self._previous = []


def _torch_name(function) -> str:
    name = getattr(function, "__name__", "")
    if name not in _CALLS:
        raise ValueError(f"megatron-core binds an unknown torch.distributed function {function!r}; add it to _CALLS")
    return name


def trace_megatron_core(trace: CollectiveTrace) -> CoreTrace:
    """Record the ``torch.distributed`` calls of megatron-core's :data:`TRACED_MODULES` in ``trace`` until the
    returned :class:`CoreTrace` is closed."""
    if not isinstance(trace, CollectiveTrace):
        raise TypeError(f"trace_megatron_core takes a fp8.comm_trace.CollectiveTrace, got {type(trace).__name__}")
    return CoreTrace(trace)


class CollectiveTraceError(RuntimeError):
    """The recorded collectives break NCCL's rules: the run worked on gloo and would hang or deadlock on NCCL."""


def check_trace_directory(directory: str, world_size: int, log=print) -> int:
    """Check the traces of ranks ``0..world_size-1`` in ``directory`` (:func:`fp8.comm_trace.check_traces`);
    log a one-line summary and return the number of calls checked, or raise :class:`CollectiveTraceError`
    listing every violation."""
    traces = load_traces(directory, world_size)
    calls = sum(len(c) for c in traces.values())
    violations = check_traces(traces)
    if violations:
        raise CollectiveTraceError(
            f"collective trace {directory}: {len(violations)} violation(s) of NCCL's rules in {calls} calls on "
            f"{len(traces)} ranks:\n" + "\n".join(f"  {v}" for v in violations))
    p2p = sum(1 for c in traces.values() for call in c if call.kind in ("send", "recv"))
    log(f"collective trace {directory}: {calls} calls on {len(traces)} ranks ({p2p} point-to-point) follow NCCL's "
        f"rules: no pipeline deadlock, every group's collectives agree in kind, order and size")
    return calls
