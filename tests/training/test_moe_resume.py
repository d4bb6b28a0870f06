"""Mixture-of-experts checkpoints reshard expert parallelism: ``--save`` at EP1 (one process) or EP2 (two
processes, each holding half of the experts), ``--load`` at the other.

A tiny MoE GPT (tests/checkpoint_worker.py's model with 4 experts, top-2, the all-to-all dispatcher) trains 6
iterations and saves at 3, at none and O3 (O3 shards the experts' optimizer states over the expert-data-parallel
group and the rest over data parallelism). Experts are saved under their global expert index, so the EP2 ranks'
local experts 0-1 are experts 0-1 and 2-3 of the checkpoint. Checked per direction and level: the losses of
iterations 4-6 after the resume within 1e-3 relative of the uninterrupted run (as tests/training/test_resume_matrix.py),
and the parameters right after the load, saved again and read back merged, bit-identical to the saved ones
(expert parallelism does not split a tensor: nothing is re-quantized).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from tests.resume_tasks import ResumeMatrix

SEED = int(os.environ.get("FP8LM_TEST_SEED", random.SystemRandom().randrange(2**31))) % 100_000
BOUND = 1e-3
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--moe-token-dispatcher-type", "alltoall", "--train-iters", "6"]
LAYOUTS = {"ep1": (1, []), "ep2": (2, ["--expert-model-parallel-size", "2"])}
LEVELS = ("none", "O3")
CASES = [(a, b, lvl) for lvl in LEVELS for a, b in (("ep1", "ep2"), ("ep2", "ep1"))]


def _flags(layout: str, level: str, *extra: str) -> list[str]:
    dispatch = ["--moe-fp8-dispatch"] if level != "none" and layout == "ep2" else []
    fp8 = ["--fp8-min-dim", "0"] if level != "none" else []  # an FP8 flag: refused at the baseline
    return ["--fp8-opt-level", level, *MOE, *fp8, *LAYOUTS[layout][1], *dispatch, *extra]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    m = ResumeMatrix(tmp_path_factory.mktemp("moe_resume"), SEED, _flags)
    m.launch(1, [m.ref("ep1", lvl) for lvl in LEVELS])
    m.launch(2, [t for lvl in LEVELS for t in (m.ref("ep2", lvl), *m.resumes("ep1", "ep2", lvl))])
    m.launch(1, [t for lvl in LEVELS for t in m.resumes("ep2", "ep1", lvl)])
    return m


@pytest.mark.parametrize("source,target,level", CASES, ids=[f"{a}->{b}-{lvl}" for a, b, lvl in CASES])
def test_resume_across_expert_parallelism_continues_the_loss(matrix, source, target, level):
    rel = matrix.relative_loss_after_resume(source, target, level)
    assert max(rel) < BOUND, (SEED, source, target, level, rel)


@pytest.mark.parametrize("source,target,level", CASES, ids=[f"{a}->{b}-{lvl}" for a, b, lvl in CASES])
def test_every_expert_is_loaded_as_saved(matrix, source, target, level):
    from megatron.training.checkpointing.checkpoint import read_checkpoint

    for src in ("fp8", "master"):
        _, saved = read_checkpoint(matrix.ck / f"{source}_{level}", 3, source=src)
        _, loaded = read_checkpoint(matrix.ck / f"{source}_to_{target}_{level}", 3, source=src)
        assert sorted(saved) == sorted(loaded)
        experts = {n for n in saved if ".mlp.experts.local_experts." in n}
        # 4 layers x 4 experts x 2 linears (weights and biases), every global expert index present
        assert {n.split(".mlp.experts.local_experts.")[1].split(".")[0] for n in experts} == {"0", "1", "2", "3"}
        for name, value in saved.items():
            assert torch.equal(loaded[name], value), (SEED, src, name)
