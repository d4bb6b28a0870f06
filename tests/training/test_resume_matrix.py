"""Resume in every direction: ``pretrain_gpt.py --save`` at one parallel layout, ``--load`` at another.

Layouts (tests/checkpoint_worker.py, tiny SwiGLU GPT on mock data, 6 iterations, checkpoint at 3):
``1`` (one process), ``dp2``, ``tp2``, ``pp2`` (two) and ``tp2pp2`` (four). Every direction
1 <-> dp2 / tp2 / pp2 / tp2pp2 at ``none`` and ``O2``, and 1 <-> dp2 at ``O3`` too (the level that shards
the optimizer over data parallelism). Four launches: 1 process (the layout-1 references, saving at 3),
2 and 4 processes (their references, and resumes from layout 1), 1 process (resumes from the others).

Checked for each direction and level:

- the losses of iterations 4-6 after the resume within 1e-3 relative of the uninterrupted run that
  saved the checkpoint (the order of fp32 sums and, at FP8 levels, the amax of the new shards differ;
  measured: see the table printed by ``pytest -s tests/training/test_resume_matrix.py``);
- the parameters right after the load (saved again at the new layout, read back merged) equal to the
  saved ones, bit for bit, except where the load recomputes them: FP8 weights re-quantized from their
  masters at another tensor-parallel split (another shard, another scale), which stay within their
  FP8 rounding of the saved values.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests.resume_tasks import ResumeMatrix

SEED = int(os.environ.get("FP8LM_TEST_SEED", random.SystemRandom().randrange(2**31))) % 100_000
BOUND = 1e-3

LAYOUTS = {
    "1": (1, []),
    "dp2": (2, []),
    "tp2": (2, ["--tensor-model-parallel-size", "2"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "tp2pp2": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
}
LEVELS = {"dp2": ("none", "O2", "O3"), "tp2": ("none", "O2"), "pp2": ("none", "O2"), "tp2pp2": ("none", "O2")}
# (source layout, target layout, level): every layout to 1 and back.
CASES = [(a, b, lvl) for other, levels in LEVELS.items() for lvl in levels for a, b in (("1", other), (other, "1"))]


def _flags(layout: str, level: str, *extra: str) -> list[str]:
    return ["--fp8-opt-level", level, "--train-iters", "6", "--swiglu", *LAYOUTS[layout][1], *extra]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    m = ResumeMatrix(tmp_path_factory.mktemp("matrix"), SEED, _flags)
    m.launch(1, [m.ref("1", lvl) for lvl in ("none", "O2", "O3")])
    for world in (2, 4):
        tasks = []
        for layout, levels in LEVELS.items():
            if LAYOUTS[layout][0] == world:
                for lvl in levels:
                    tasks += [m.ref(layout, lvl), *m.resumes("1", layout, lvl)]
        m.launch(world, tasks)
    m.launch(1, [t for layout, levels in LEVELS.items() for lvl in levels for t in m.resumes(layout, "1", lvl)])
    return m


def _rel(matrix, source, target, level) -> list[float]:
    return matrix.relative_loss_after_resume(source, target, level)


@pytest.mark.parametrize("source,target,level", CASES, ids=[f"{a}->{b}-{lvl}" for a, b, lvl in CASES])
def test_resume_continues_the_loss(matrix, source, target, level):
    rel = _rel(matrix, source, target, level)
    assert max(rel) < BOUND, (SEED, source, target, level, rel)


@pytest.mark.parametrize("source,target,level", CASES, ids=[f"{a}->{b}-{lvl}" for a, b, lvl in CASES])
def test_parameters_equal_after_the_load(matrix, source, target, level):
    from megatron.training.checkpointing.checkpoint import read_checkpoint

    tp_changes = "tp2" in (source + target)
    for src in ("fp8", "master"):
        _, saved = read_checkpoint(matrix.ck / f"{source}_{level}", 3, source=src)
        _, loaded = read_checkpoint(matrix.ck / f"{source}_to_{target}_{level}", 3, source=src)
        assert sorted(saved) == sorted(loaded)
        for name, value in saved.items():
            if level == "none" or not tp_changes or torch.equal(loaded[name], value):
                assert torch.equal(loaded[name], value), (SEED, src, name)
                continue
            # Recomputed at the new split: an FP8 linear weight (re-quantized) or its compressed master (re-encoded).
            assert name.endswith(".weight") and ".linear_" in name, (SEED, src, name)
            err = (loaded[name] - value).abs().max() / value.abs().max()
            assert err < 2**-3, (SEED, src, name, float(err))


def test_print_matrix(matrix):
    """The table for the docs (``pytest -s``): maximum relative loss difference over iterations 4-6, one row per
    direction, a measured (finite) value within the bound in every cell a level covers."""
    import math

    rows = []
    for other, levels in LEVELS.items():
        for a, b in (("1", other), (other, "1")):
            cells = {lvl: max(_rel(matrix, a, b, lvl)) for lvl in levels}
            assert all(math.isfinite(v) and 0 <= v < BOUND for v in cells.values()), (a, b, cells, SEED)
            rows.append(f"| {_label(a)} -> {_label(b)} | "
                        + " | ".join(f"{cells[lvl]:.1e}" if lvl in cells else "-" for lvl in ("none", "O2", "O3")) + " |")
    print(f"\nresume matrix (seed {SEED}): max relative loss difference, iterations 4-6, vs the uninterrupted run\n"
          "| save -> load | none | O2 | O3 |\n|---|---|---|---|\n" + "\n".join(rows))


def _label(layout: str) -> str:
    return {"1": "TP1 PP1 DP1", "dp2": "DP2", "tp2": "TP2", "pp2": "PP2", "tp2pp2": "TP2 PP2"}[layout]
