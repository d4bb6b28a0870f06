"""``--tensorboard-dir``: the run's records as TensorBoard scalars, one run directory per opt level, read back with
tensorboard's own reader and compared with the ``--log-json`` records of the same run; ``--wandb-project`` without
wandb installed is refused at start-up naming the package."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "4", "--mock-data", "--vocab-size", "256", "--train-iters", "4", "--log-interval", "2",
         "--eval-interval", "2", "--eval-iters", "1", "--no-progress"]


def _scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_are_the_logged_records(tmp_path):
    tb, log = tmp_path / "tb", tmp_path / "log.jsonl"
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *FLAGS, "--compare", "none", "--tensorboard-dir", str(tb),
                           "--log-json", str(log), "--plot", str(tmp_path / "curves.png")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"tensorboard --logdir {tb}" in proc.stdout
    assert sorted(p.name for p in tb.iterdir()) == ["O2", "none"]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    records = [r for r in records if "summary" not in r]
    for level in ("O2", "none"):
        scalars = _scalars(tb / level)
        mine = [r for r in records if r["level"] == level]
        assert [r["iteration"] for r in mine] == [1, 2, 3, 4]
        for tag in ("loss", "lr", "grad_norm", "tokens_per_s", "skipped_steps"):
            assert [s for s, _ in scalars[tag]] == [1, 2, 3, 4], tag
            for (_, got), r in zip(scalars[tag], mine):
                assert got == pytest.approx(float(r[tag]), rel=1e-6), (level, tag)
        assert [s for s, _ in scalars["val_loss"]] == [2, 4]
        assert [v for _, v in scalars["val_loss"]] == pytest.approx([r["val_loss"] for r in mine if "val_loss" in r])
        assert "comm_bytes/total" in scalars
        memory = [t for t in scalars if t.startswith("memory/")]
        assert memory and all(v > 0 for t in memory for _, v in scalars[t] if t == "memory/total"), sorted(scalars)
    # Different levels, different curves: the files are not one run written twice.
    assert _scalars(tb / "O2")["loss"] != _scalars(tb / "none")["loss"]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed: nothing to refuse")
def test_wandb_without_the_package_is_refused_up_front():
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *FLAGS, "--wandb-project", "x"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--wandb-project needs the wandb package: pip install wandb" in proc.stderr
