"""Scalars of a run for TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``).

Each logged iteration record (:class:`megatron.training.monitoring.log.TrainingLogger`'s, already read to the host at the log
interval) becomes scalars at its iteration: ``loss``, ``val_loss``, ``lr``, ``grad_norm``, ``skipped_steps``,
``tokens_per_s``, ``mu``, ``comm_bytes/<what travelled>`` and ``comm_bytes/total``, ``memory/<category>`` (model-state
bytes by :func:`fp8.memory_report` category) and ``fp8_stats/<layer>/<operand>/<statistic>`` (``--fp8-stats-interval``:
:mod:`megatron.training.monitoring.fp8_numerics`). Every opt level trained by one run (``--compare``) is its own run: ``DIR/<level>/`` for TensorBoard, a run named by the level
for W&B, so their curves overlay.
"""

from __future__ import annotations

import os

__all__ = ["record_scalars", "TensorBoardWriter", "WandbWriter", "scalar_writers"]

_PLAIN = ("loss", "val_loss", "lr", "grad_norm", "skipped_steps", "tokens_per_s", "mu")


def record_scalars(record: dict) -> dict[str, float]:
    """The scalars of one iteration record, by tag."""
    out = {name: float(record[name]) for name in _PLAIN if record.get(name) is not None}
    for tag, value in (record.get("comm_bytes") or {}).items():
        out[f"comm_bytes/{tag}"] = float(value)
    if record.get("comm_bytes_total") is not None:
        out["comm_bytes/total"] = float(record["comm_bytes_total"])
    for category, value in (record.get("memory") or {}).items():
        out[f"memory/{category}"] = float(value)
    for layer, operands in (record.get("fp8_stats") or {}).items():
        for operand, stats in operands.items():
            for stat, value in stats.items():
                out[f"fp8_stats/{layer}/{operand}/{stat}"] = float(value)
    return out


class _PerLevel:
    """One sink per opt level, ``open_sink(level)`` at the level's first record, ``close_sink`` on each at the end."""

    def __init__(self, open_sink, close_sink) -> None:
        self._open, self._close = open_sink, close_sink
        self._sinks: dict = {}

    def _sink(self, level: str):
        if level not in self._sinks:
            self._sinks[level] = self._open(level)
        return self._sinks[level]

    def close(self) -> None:
        for sink in self._sinks.values():
            self._close(sink)
        self._sinks.clear()


class TensorBoardWriter(_PerLevel):
    """Event files under ``directory/<level>/`` (``torch.utils.tensorboard``; needs the ``tensorboard`` package)."""

    def __init__(self, directory: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        super().__init__(lambda level: SummaryWriter(os.path.join(directory, level)), lambda writer: writer.close())
        self.directory = directory

    def add(self, level: str, record: dict) -> None:
        writer = self._sink(level)
        for tag, value in record_scalars(record).items():
            writer.add_scalar(tag, value, record["iteration"])
        writer.flush()


class WandbWriter(_PerLevel):
    """One W&B run per level in ``project`` (needs the ``wandb`` package)."""

    def __init__(self, project: str) -> None:
        import wandb

        super().__init__(lambda level: wandb.init(project=project, name=level, reinit="create_new"),
                         lambda run: run.finish())
        self.project = project

    def add(self, level: str, record: dict) -> None:
        self._sink(level).log(record_scalars(record), step=record["iteration"])


def scalar_writers(tensorboard_dir: str | None, wandb_project: str | None) -> list:
    """The writers a run asked for (none, one or both)."""
    writers: list = []
    if tensorboard_dir:
        writers.append(TensorBoardWriter(tensorboard_dir))
    if wandb_project:
        writers.append(WandbWriter(wandb_project))
    return writers
