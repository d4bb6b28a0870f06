"""Run health: a run whose steps keep being skipped for non-finite gradients stops with a clear error.

An FP8 optimizer skips a step whose gradients hold inf or NaN (the weights stay as they were), which is what
a rare overflow needs; a run where most steps are skipped trains nothing and must not end with exit code 0.
:class:`SkipMonitor` reads the per-iteration records (``"skipped"``, read to the host at each log point),
warns at the first skipped step of a run and raises :class:`RunHealthError` when more than
``--max-skipped-steps`` of the last ``--skipped-steps-window`` iterations were skipped.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterable

__all__ = ["RunHealthError", "SkipMonitor"]


class RunHealthError(RuntimeError):
    """The run cannot make progress (the message says why and what to change)."""


class SkipMonitor:
    """Counts skipped steps over a sliding window of iterations (see the module docstring)."""

    def __init__(self, max_skipped: int, window: int, announce: bool = True) -> None:
        if max_skipped < 0 or window < 1:
            raise ValueError(f"--max-skipped-steps must be >= 0 and --skipped-steps-window >= 1, got {max_skipped} "
                             f"and {window}")
        self.max_skipped, self.window = max_skipped, window
        self.recent: deque[tuple[int, bool]] = deque(maxlen=window)
        self.announce = announce
        self.warned = False

    def observe(self, records: Iterable[dict]) -> None:
        """Take the records of one log interval (in iteration order); raise :class:`RunHealthError` when too
        many of the window's steps were skipped."""
        for record in records:
            skipped = bool(record["skipped"])
            self.recent.append((record["iteration"], skipped))
            if skipped and not self.warned:
                self.warned = True
                if self.announce:
                    print(f"warning: iteration {record['iteration']} was skipped: its gradients are not finite "
                          f"(loss {record['loss']}, gradient norm {record['grad_norm']}); the run stops when more "
                          f"than {self.max_skipped} of {self.window} consecutive iterations are skipped "
                          f"(--max-skipped-steps, --skipped-steps-window)", file=sys.stderr, flush=True)
            count = sum(s for _, s in self.recent)
            if count > self.max_skipped:
                first = self.recent[0][0]
                raise RunHealthError(
                    f"{count} of the {len(self.recent)} iterations {first}-{record['iteration']} were skipped for "
                    f"non-finite gradients (more than --max-skipped-steps {self.max_skipped}): the run is not "
                    f"training; lower --lr, set --clip-grad (e.g. 1.0) or check the data; nothing was saved after "
                    f"the last good checkpoint")
