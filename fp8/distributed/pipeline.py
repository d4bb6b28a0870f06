"""Staged bucket reductions, issued in one deterministic order on every rank.

A reduction is a generator that issues an asynchronous collective and yields its work handle,
once per stage (e.g. amax all-reduce, all-to-all, all-gather), and returns its result. The
:class:`ReductionPipeline` starts reductions in launch order and, at each launch, moves every
earlier *eager* reduction one stage on (waiting for the collective it yielded). Collectives are thus
issued in an order fixed by the launch sequence alone, never by timing, so every rank issues the same
sequence while earlier buckets' communication overlaps later computation.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch.distributed as dist

__all__ = ["Reduction", "StagedReduction", "ReductionPipeline"]

Reduction = Generator["dist.Work | None", None, Any]
"""A staged reduction: yields each collective's work handle, returns its result."""


class StagedReduction:
    """One running :data:`Reduction`; ``on_done(result)`` is called when it returns."""

    def __init__(self, reduction: Reduction, eager: bool, on_done: Callable[[Any], None] | None = None) -> None:
        self._reduction = reduction
        self.eager = eager
        self._on_done = on_done
        self._work: dist.Work | None = None
        self.done = False
        self.result: Any = None
        self._resume()

    def _resume(self) -> None:
        try:
            self._work = next(self._reduction)
        except StopIteration as stop:
            self.done, self.result, self._work = True, stop.value, None
            if self._on_done is not None:
                self._on_done(self.result)

    def advance(self) -> None:
        """Wait for the pending collective and run the next stage (up to its collective, or the end)."""
        if self.done:
            return
        if self._work is not None:
            self._work.wait()
        self._resume()

    def finish(self) -> Any:
        """Run every remaining stage; returns the result."""
        while not self.done:
            self.advance()
        return self.result


class ReductionPipeline:
    """Reductions in flight, started and moved on in launch order."""

    def __init__(self) -> None:
        self._running: list[StagedReduction] = []

    def launch(self, reduction: Reduction, eager: bool = True, on_done: Callable[[Any], None] | None = None) -> None:
        """Move every running eager reduction one stage on, then start ``reduction`` (its first
        collective is issued now). Non-eager reductions (one collective only) wait for :meth:`drain`."""
        for running in self._running:
            if running.eager and not running.done:
                running.advance()
        self._running.append(StagedReduction(reduction, eager, on_done))

    def drain(self) -> list[Any]:
        """Finish every reduction in launch order; returns their results and empties the pipeline."""
        results = [running.finish() for running in self._running]
        self._running.clear()
        return results
