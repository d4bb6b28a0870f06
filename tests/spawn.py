"""Multi-process gloo test launches: a free port, and one cached launch per world size."""

from __future__ import annotations

import socket
from collections.abc import Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for the gloo rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class CachedLaunch:
    """Runs ``worker(rank, world, port, seed, out_dir)`` on ``world`` processes once per world size per
    session (with the seed of the first test that asks) and returns ``(seed, per-rank results)``, the
    results read from ``out_dir/rank{r}.pt``. A failed launch fails every test that needs it, once."""

    def __init__(self, worker: Callable, name: str) -> None:
        self.worker = worker
        self.name = name
        self._launched: dict[int, tuple[int, list] | BaseException] = {}

    def __call__(self, world: int, seed: int, tmp_path_factory) -> tuple[int, list]:
        if world not in self._launched:
            out_dir = tmp_path_factory.mktemp(f"{self.name}_world{world}")
            try:
                mp.spawn(self.worker, args=(world, free_port(), seed, str(out_dir)), nprocs=world, join=True)
                results = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
                self._launched[world] = (seed, results)
            except Exception as error:  # noqa: BLE001 - reported by every dependent test
                self._launched[world] = error
        launched = self._launched[world]
        if isinstance(launched, BaseException):
            raise RuntimeError(f"the {world}-process {self.name} launch failed (seed {seed})") from launched
        return launched
