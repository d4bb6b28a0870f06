"""Stopping a run early, as Megatron-LM does: ``--exit-interval N`` (stop after an iteration that is a
multiple of N), ``--exit-duration-in-mins M`` (stop once M minutes have passed since start-up, start-up
included as in Megatron-LM) and
``--exit-signal-handler`` (SIGTERM or SIGUSR1, e.g. a Slurm preemption or the warning before the time
limit: finish the running iteration). The run saves a checkpoint first when ``--save`` is given, then stops.

The decision is agreed by every rank (one 2-value all-reduce per iteration, on the process group's
device) so that all ranks save the same iteration; without any of the three flags nothing runs. On a
GPU the host never drains the device queue for it: the all-reduced flags are copied to pinned host memory
behind an event and read one iteration later (the host waits only for the previous iteration's flags),
so a signal stops the run one iteration later than on CPU, at the same iteration on every rank.
"""

from __future__ import annotations

import signal
import time

import torch

from fp8.comm import Collectives
from fp8.host_read import HostCopy

from .config import CheckpointConfig

__all__ = ["ExitPolicy"]

_START = time.time()  # when ``CheckpointConfig.start_time`` (pretrain_gpt.py's start) is not set


class ExitPolicy:
    """Decides after each iteration whether the run stops there (and why)."""

    def __init__(self, checkpoint: CheckpointConfig, device: torch.device, world: Collectives | None = None) -> None:
        self.interval = checkpoint.exit_interval
        minutes = checkpoint.exit_duration_in_mins
        start = checkpoint.start_time or _START
        self.deadline = None if minutes is None else start + 60.0 * minutes
        self.device = device
        self.world = world  # every rank of the job (None: a single process)
        self.signalled: str | None = None
        self._previous: dict = {}
        self._in_flight: HostCopy | None = None
        if checkpoint.exit_signal_handler:
            for sig in (signal.SIGTERM, signal.SIGUSR1):
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.signalled = signal.Signals(signum).name

    def close(self) -> None:
        """Restore the previous signal handlers."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def reason(self, iteration: int) -> str | None:
        """Why the run stops after ``iteration`` (1-based count of finished iterations), or None."""
        if self.interval and iteration % self.interval == 0:
            return f"--exit-interval {self.interval}"
        if self.deadline is None and not self._previous:
            return None
        local = [float(self.signalled is not None), float(self.deadline is not None and time.time() >= self.deadline)]
        flags = torch.tensor(local, dtype=torch.float32).to(self.device, non_blocking=True)
        if self.world is not None and self.world.world_size > 1:
            self.world.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, tag="exit flags").wait()
        if flags.device.type == "cpu":
            return self._decide(flags.tolist())
        previous, self._in_flight = self._in_flight, HostCopy(flags)
        if previous is None:
            return None
        return self._decide(previous.result())  # the previous iteration's flags: long done, the queue stays full

    def _decide(self, flags: list[float]) -> str | None:
        signalled, late = flags
        if signalled:
            return self.signalled or "a signal on another rank"
        if late:
            return "--exit-duration-in-mins"
        return None
