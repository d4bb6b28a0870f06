"""Multi-process gloo test launches: a free port, one cached launch per world size, and a worker script
run under torchrun."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.launch import spawn


def init_gloo_worker(rank: int, world: int, port: int) -> None:
    """One spawned worker's environment (torchrun's variables, one thread, warnings off) and gloo default group."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def megatron_run(flags: list[str], world: int):
    """``(cfg, run, datasets)``: pretrain_gpt.py's training set-up (``megatron.training.training.TrainingRun``) for
    ``flags`` in this worker, megatron-core's parallel state (re-)initialised."""
    from megatron.core import parallel_state
    from megatron.training import training
    from megatron.training.arguments import parse_config

    cfg = parse_config(flags, world_size=world)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    training.initialize_distributed(cfg)
    datasets = training.Datasets(cfg)
    return cfg, training.TrainingRun(cfg, datasets), datasets


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
                spawn(self.worker, (world, free_port(), seed, str(out_dir)), world)
                results = [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)]
                self._launched[world] = (seed, results)
            except Exception as error:  # noqa: BLE001 - reported by every dependent test
                self._launched[world] = error
        launched = self._launched[world]
        if isinstance(launched, BaseException):
            raise RuntimeError(f"the {world}-process {self.name} launch failed (seed {seed})") from launched
        return launched


def run_worker(script: Path, nproc: int, args: list[str], seed: int, allow_kill: bool = False) -> None:
    """Run ``script args`` in one process, or under torchrun on ``nproc`` processes (a free port), from the
    repository root with one thread per process; raise with its output if it fails (a SIGKILL is accepted
    when ``allow_kill``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(script)] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
        str(free_port()), str(script)]
    proc = subprocess.run([*cmd, *args], cwd=Path(script).resolve().parents[1], env=env, capture_output=True,
                          text=True, timeout=900)
    if proc.returncode != 0 and not (allow_kill and proc.returncode == -signal.SIGKILL):
        raise RuntimeError(f"launch of {nproc} processes failed (seed {seed}, rc {proc.returncode}):\n"
                           f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
