"""fp8.distributed: FP8 data parallelism on stock PyTorch collectives (gloo and NCCL).

- :func:`scaled_all_reduce`: average a list of gradients over a process group as 1-byte FP8 values
  with a scale shared by all ranks and the automatic scaling factor mu of FP8-LM
  (:class:`AutoScaleConfig`, :class:`AutoScaleState`).
- :class:`DistributedDataParallel`: drop-in for ``torch.nn.parallel.DistributedDataParallel`` that
  syncs FP8 weight gradients with the scaled FP8 all-reduce and other gradients in their own dtype,
  overlapping communication with backward.
- :class:`CommBytesCounter`, :func:`ring_bytes` (from :mod:`fp8.comm`, where every collective is counted) and
  :func:`counting_allreduce_hook` (stock torch DDP baselines counted the same way): bytes on the wire.

Usage::

    model, optimizer = fp8.initialize(model, optimizer, opt_level="O1")
    model = fp8.distributed.DistributedDataParallel(model)

At opt level O3 the wrapper is given the sharded optimizer, whose owners then receive the gradients:
``fp8.distributed.DistributedDataParallel(model, o3_optimizer=optimizer)``.
"""

from ..comm import Collectives, CommBytesCounter, ring_bytes
from .auto_scale import AutoScaleConfig, AutoScaleState
from .comm_hook import CountingHookState, counting_allreduce_hook
from .ddp import DistributedDataParallel
from .scaled_allreduce import DEFAULT_BUCKET_BYTES, scaled_all_reduce

__all__ = [
    "AutoScaleConfig", "AutoScaleState", "scaled_all_reduce", "DEFAULT_BUCKET_BYTES",
    "DistributedDataParallel", "Collectives",
    "CommBytesCounter", "CountingHookState", "counting_allreduce_hook", "ring_bytes",
]
