"""Spawning gloo worker processes for measurements and tests.

:func:`spawn` runs ``worker(rank, *args)`` on ``nprocs`` processes like ``torch.multiprocessing.spawn``, and
ends each process with ``os._exit`` once its worker returned (results written, process group destroyed), so
interpreter finalisation, which destroys objects still referencing gloo process groups in arbitrary order, never
runs. One CI run lost a rank that had finished its work to SIGABRT ("terminate called without an active
exception"); 87 repeated launches here did not reproduce it. A worker that raises still fails the launch with its
traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch.multiprocessing as mp


def _run_then_exit(rank: int, worker: Callable, args: tuple) -> None:
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker: Callable, args: tuple, nprocs: int) -> None:
    """``worker(rank, *args)`` on ``nprocs`` spawned processes; raises if any fails (its traceback) or dies."""
    mp.spawn(_run_then_exit, args=(worker, args), nprocs=nprocs, join=True)
