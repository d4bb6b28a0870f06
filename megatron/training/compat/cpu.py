"""Run megatron-core 0.16.1 on machines without CUDA (CPU + gloo): the one compatibility layer.

megatron-core hard-codes CUDA in a few places that a GPT training step reaches. :func:`enable`
redirects exactly those, and only when CUDA is absent (on a GPU machine it does nothing and returns
False). Nothing in torch itself is changed: the redirections are rebinds inside megatron-core's modules.

What it redirects, and why:

1. ``torch.cuda.current_device()`` and ``device="cuda"`` in buffer allocations, by giving four
   megatron-core modules a view of ``torch`` whose tensor factories place ``cuda`` requests on the CPU
   and whose ``torch.cuda.current_device()`` is the CPU: ``pipeline_parallel.schedules`` (token counters
   allocated with ``device="cuda"``), ``tensor_parallel.mappings`` (sequence-parallel gather/scatter
   buffers of the embedding and output layer), ``tensor_parallel.layers`` (the output layer),
   ``utils`` (``GlobalMemoryBuffer``), ``models.common.embeddings.rotary_pos_embedding`` (RoPE's
   inverse frequencies) and the mixture-of-experts ``transformer.moe.router`` (moves the router weight to
   ``torch.cuda.current_device()``), ``moe_utils`` and ``token_dispatcher`` (routing buffers on ``cuda``; the
   all-to-all dispatcher's side stream and event for its host copies of the split sizes: the host's order,
   :class:`HostStream`; ``torch.cuda.synchronize`` is :class:`CudaOnCpu`'s). The dispatcher's host copies
   themselves (``maybe_move_tensor_to_cpu``, which copies only CUDA tensors) are made on the CPU too, by
   :func:`host_copy`: a host tensor of their own, copied without blocking and read after the dispatcher's event
   synchronisation, as on a GPU (what reads them then reads host data on both, one data flow to check:
   ``tests/training/test_no_host_sync.py``).
2. The RNG tracker (``tensor_parallel.random``): a tracker of named CPU generator states replaces the
   CUDA one (``TransformerBlock`` forks it under sequence parallelism), and the module's CUDA RNG
   state get/set helpers (used by activation recomputation) read and write the CPU generator.
3. Tied input/output embeddings across pipeline stages: ``LanguageModule`` moves the shared weight with
   ``.cuda()`` before all-reducing it over the embedding group; the same all-reduce is done in place.

Pipeline receive buffers are allocated by fp8lm's own communicator (:mod:`megatron.training.compat.pipeline_p2p`), on the
model's device, so megatron-core's P2P module needs nothing. :func:`seed` seeds the CPU generator and the
tracker the way ``model_parallel_cuda_manual_seed`` seeds CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import torch

from fp8.comm import Collectives

__all__ = ["enable", "enabled", "seed", "CPURNGStatesTracker", "CudaOnCpu", "HostStream", "host_copy"]

_ENABLED = False
_REBOUND_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.utils",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
)
_FACTORIES = frozenset({"empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "empty_like",
                        "zeros_like", "ones_like"})


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class HostStream:
    """A CUDA stream or event as megatron-core's MoE all-to-all dispatcher uses one, on a CPU machine: the host runs
    every operation in order, so waiting, recording and synchronising are immediate. :meth:`synchronize` stands for
    the event's host-blocking wait (a host-sync detector watches it as it watches ``torch.cuda.Event.synchronize``)."""

    def wait_stream(self, stream) -> None:
        return None

    def record_event(self, event=None) -> "HostStream":
        return self

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_HOST_STREAM = HostStream()


class CudaOnCpu:
    """``torch.cuda`` as seen by megatron-core on a CPU machine: the current device is the CPU; streams and
    events are the host's order (:class:`HostStream`); :meth:`synchronize` stands for ``torch.cuda.synchronize``."""

    def current_device(self) -> torch.device:
        return torch.device("cpu")

    def synchronize(self, device=None) -> None:
        return None

    def Stream(self, *args, **kwargs) -> HostStream:  # noqa: N802 (torch.cuda's name)
        return _HOST_STREAM

    def current_stream(self, device=None) -> HostStream:
        return _HOST_STREAM

    def stream(self, stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _TorchOnCpu:
    """``torch`` with CUDA placement requests of tensor factories answered by the CPU."""

    def __init__(self) -> None:
        self.cuda = CudaOnCpu()

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in _FACTORIES:
            @functools.wraps(attr)
            def on_cpu(*args, device=None, **kwargs):
                return attr(*args, device=_cpu_device(device), **kwargs)
            return on_cpu
        return attr


def host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """megatron-core's ``moe_utils.maybe_move_tensor_to_cpu`` on a CPU machine: the copy a GPU makes of a device
    tensor (``tensor.to("cpu", non_blocking=True)``, then NumPy when ``as_numpy``), a host tensor of its own, not
    the device tensor itself; anything else (an int, None) is returned as it is."""
    if torch.is_tensor(tensor):
        tensor = tensor.to("cpu", non_blocking=True, copy=True)
        if as_numpy:
            tensor = tensor.numpy()
    return tensor


def _cpu_rng_state(device="cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _tracker_base():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    return CudaRNGStatesTracker


CPURNGStatesTracker: type | None = None
"""The CPU tracker class (megatron-core's tracker subclassed), built by :func:`enable`: built lazily so
importing this module never imports megatron-core."""


def _make_tracker_class():
    base = _tracker_base()

    class _CPURNGStatesTracker(base):
        """megatron-core's named RNG state tracker, with the states of the CPU generator."""

        def add(self, name, seed):
            self._is_initialized = True
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name="model-parallel-rng"):
            if name not in self.states_:
                raise KeyError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    _CPURNGStatesTracker.__name__ = _CPURNGStatesTracker.__qualname__ = "CPURNGStatesTracker"
    return _CPURNGStatesTracker


def _setup_embeddings_without_cuda(original):
    @functools.wraps(original)
    def setup(self):
        # Run megatron-core's set-up with the embedding-group all-reduce (which calls .cuda()) turned off,
        # then do that all-reduce in place.
        self._is_in_embd_group = lambda: False
        try:
            original(self)
        finally:
            del self._is_in_embd_group
        if torch.distributed.is_initialized() and self._is_in_embd_group():
            weight = self.shared_embedding_or_output_weight()
            if weight.device.type != "meta":  # a model built on meta (--dry-run) holds no values to agree on
                Collectives(self.embd_group).all_reduce(weight.data, tag="tied embedding init").wait()

    setup._fp8lm_cpu_compat = True
    return setup


def enabled() -> bool:
    """Whether :func:`enable` has redirected megatron-core's CUDA calls in this process."""
    return _ENABLED


def enable() -> bool:
    """Redirect megatron-core's hard-coded CUDA calls to the CPU when CUDA is absent; idempotent.

    Returns True when the redirections are active (no CUDA), False on a CUDA machine (nothing done).
    """
    global _ENABLED, CPURNGStatesTracker
    if torch.cuda.is_available():
        return False
    if _ENABLED:
        return True
    proxy = _TorchOnCpu()
    for name in _REBOUND_MODULES:
        importlib.import_module(name).torch = proxy
    importlib.import_module("megatron.core.transformer.moe.token_dispatcher").maybe_move_tensor_to_cpu = host_copy
    from megatron.core.models.common.language_module import language_module
    from megatron.core.tensor_parallel import random

    random._get_cuda_rng_state = _cpu_rng_state
    random._set_cuda_rng_state = _set_cpu_rng_state
    CPURNGStatesTracker = _make_tracker_class()
    random._CUDA_RNG_STATE_TRACKER = CPURNGStatesTracker()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    cls = language_module.LanguageModule
    if not getattr(cls.setup_embeddings_and_output_layer, "_fp8lm_cpu_compat", False):
        cls.setup_embeddings_and_output_layer = _setup_embeddings_without_cuda(cls.setup_embeddings_and_output_layer)
    _ENABLED = True
    return True


def seed(seed_value: int, tp_rank: int = 0, pp_rank: int = 0) -> None:
    """Seed like megatron-core's ``model_parallel_cuda_manual_seed``, on whichever device runs.

    The default generators get ``seed_value + 100 * pp_rank`` (data-parallel-replicated randomness);
    the tracker's model-parallel state gets ``seed_value + 2718 + tp_rank`` (e.g. dropout inside
    tensor-parallel regions).
    """
    from megatron.core.tensor_parallel import random

    base = seed_value + 100 * pp_rank
    torch.manual_seed(base)
    if torch.cuda.is_available():
        random.model_parallel_cuda_manual_seed(base, te_rng_tracker=False)
        return
    tracker = random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add("data-parallel-rng", base)
    tracker.add("model-parallel-rng", base + 2718 + tp_rank)
    tracker.add("expert-parallel-rng", base + 1024 + tp_rank)
