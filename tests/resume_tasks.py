"""Save-then-resume checks shared by the resume tests (tests/training/test_resume_matrix.py, tests/training/test_moe_resume.py): the
tasks of tests/checkpoint_worker.py that train a reference run saving at iteration 3, resume it at another layout
(and save the loaded parameters untrained), the launches, and the loss comparison after the resume."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.spawn import run_worker

WORKER = Path(__file__).resolve().parent / "checkpoint_worker.py"


class ResumeMatrix:
    """Tasks and results of one resume test under ``out``: ``flags(layout, level, *extra)`` gives a layout's
    ``pretrain_gpt.py`` flags; checkpoints go to ``out/ck``."""

    def __init__(self, out: Path, seed: int, flags: Callable[..., list[str]]) -> None:
        self.out, self.seed, self.flags = out, seed, flags
        self.ck = out / "ck"

    def ref(self, layout: str, level: str) -> dict:
        """Train ``layout`` at ``level``, saving at iteration 3 into ``ck/<layout>_<level>``."""
        return {"name": f"ref_{layout}_{level}",
                "flags": self.flags(layout, level, "--save", str(self.ck / f"{layout}_{level}"), "--save-interval", "3")}

    def resumes(self, source: str, target: str, level: str) -> list[dict]:
        """Resume ``source``'s checkpoint at ``target``: train on, and save the loaded parameters untrained."""
        load = ["--load", str(self.ck / f"{source}_{level}"), "--ckpt-step", "3"]
        name = f"{source}_to_{target}_{level}"
        return [{"name": name, "flags": self.flags(target, level, *load)},
                {"name": f"params_{name}", "flags": self.flags(target, level, *load), "init_only": str(self.ck / name)}]

    def launch(self, nproc: int, tasks: list[dict]) -> None:
        run_worker(WORKER, nproc, ["--out", str(self.out), "--seed", str(self.seed), "--tasks", json.dumps(tasks)],
                   self.seed)

    def __call__(self, name: str) -> dict:
        """Rank 0's result of task ``name`` (asserting it raised nothing)."""
        r = json.loads((self.out / f"{name}_rank0.json").read_text())
        assert "error" not in r, (self.seed, name, r["error"])
        return r

    def relative_loss_after_resume(self, source: str, target: str, level: str) -> list[float]:
        """Relative differences of iterations 4-6 after the resume to the uninterrupted run's losses."""
        full = dict(zip(*(self(f"ref_{source}_{level}")[k] for k in ("iterations", "losses"))))
        resumed = dict(zip(*(self(f"{source}_to_{target}_{level}")[k] for k in ("iterations", "losses"))))
        assert sorted(resumed) == [4, 5, 6], resumed
        return [abs(resumed[i] - full[i]) / abs(full[i]) for i in (4, 5, 6)]
