"""Device values read on the host at a fixed point of the step, the same point on every rank.

A decision that changes which collectives a rank issues (stop per-cast amax all-reduces once the scaling
histories have started; stop the run after a signal) must be taken at the same step on every rank. Asking a
CUDA event whether a copy has landed (``event.query()``) answers differently on each rank; on NCCL one rank then
issues a collective the others do not, and the job hangs. :class:`HostCopy` starts a device-to-host copy
without a sync and has one way to read it, :meth:`HostCopy.result`, which waits for the copy. Callers post the
copy at one step and read it at the next, so the wait costs nothing (the copy landed long ago) and every rank
reads the same values at the same step whatever its timing.

``HostCopy(values, late=True)`` makes a CPU copy land late (made only when :meth:`HostCopy.result` asks for it; until
then the host buffer holds NaN), as GPU copies still in flight do: the tests make the copies of odd ranks late
(``tests/skewed_readiness.py``), so code that read a host buffer without waiting for it, or decided anything from
whether it had landed, would act differently on even and odd ranks, which the collective-trace checker
(:mod:`fp8.comm_trace`) reports.
"""

from __future__ import annotations

import torch

__all__ = ["HostCopy"]


class HostCopy:
    """An asynchronous copy of the 1-D device tensor ``values`` to the host; :meth:`result` waits for it and
    returns the values as a list. ``late`` defers a CPU tensor's copy to :meth:`result` (module docstring)."""

    def __init__(self, values: torch.Tensor, late: bool = False) -> None:
        values = values.detach().reshape(-1)
        cuda = values.device.type == "cuda"
        self._source: torch.Tensor | None = None
        self.event = None
        if cuda:
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        elif late:
            self.host = torch.full(values.shape, float("nan")).to(values.dtype)
            self._source = values.clone()
        else:
            self.host = values.to("cpu", copy=True)

    def result(self) -> list:
        """The copied values: waits for the copy (posted a step earlier by its callers, so it has landed and the
        wait costs nothing), then reads the host buffer."""
        if self.event is not None:
            self.event.synchronize()
        if self._source is not None:
            self.host.copy_(self._source)
            self._source = None
        return self.host.tolist()
