"""Megatron mixture-of-experts GPT in FP8 (issue 26): megatron-core's MoE layer with fp8lm's linears as experts.

A tiny MoE GPT (4 layers, 4 experts, top-2, load-balancing loss) trained for 3 iterations on mock data by
``tests/megatron_worker.py``: one process at none/O2/O3, then 2 processes with tensor + sequence parallelism and the
all-to-all token dispatcher (none, O2; experts without bias) and with data parallelism and the all-gather dispatcher
(none, O2, O3; experts with bias), each against the one-process run of the same model at its level. Bounds as tests/test_megatron_parallel.py's, widened for routing: top-2
routing is a discrete choice, so a router logit that ties within fp32 rounding may send a token elsewhere in
another layout (2e-4 relative for the fp32 baseline instead of 2e-5; FP8 levels 5e-3 as there).
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from megatron.training.arguments import ConfigurationError, parse_args, validate_args
from tests.spawn import run_worker

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "megatron_worker.py"
SEED = int(os.environ.get("FP8LM_TEST_SEED", random.SystemRandom().randrange(2**31))) % 100_000
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--fp8-min-dim", "0"]
NO_BIAS = MOE + ["--disable-bias-linear"]  # experts split by tensor parallelism take no bias (megatron-core)
LAYERS, EXPERTS = 4, 4
TWO = [
    {"name": "moe_tp2sp", "tp": 2, "sp": True, "levels": ["none", "O2"], "reference": "moe_single_nobias",
     "flags": NO_BIAS + ["--moe-token-dispatcher-type", "alltoall"]},
    {"name": "moe_dp2", "levels": ["none", "O2", "O3"], "reference": "moe_single", "flags": MOE},
]
SINGLE = [{"name": "moe_single", "levels": ["none", "O2", "O3"], "flags": MOE},
          {"name": "moe_single_nobias", "levels": ["none", "O2"], "flags": NO_BIAS}]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    for nproc, configs in ((1, SINGLE), (2, TWO)):
        run_worker(WORKER, nproc, ["--out", str(out), "--seed", str(SEED), "--configs", json.dumps(configs)], SEED)

    def load(name: str, level: str) -> list[dict]:
        files = sorted(out.glob(f"{name}_{level}_rank*.json"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
        return [json.loads(p.read_text()) for p in files]

    return load


@pytest.mark.parametrize("name,reference,level", [(c["name"], c["reference"], level) for c in TWO
                                                  for level in c["levels"]])
def test_losses_match_single_process(results, name, reference, level):
    reference = results(reference, level)[0]["losses"]
    ranks = results(name, level)
    assert len(ranks) == 2
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"]  # every rank reports the same (all-reduced) loss
    bound = 2e-4 if level == "none" else 5e-3
    for it, (got, want) in enumerate(zip(ranks[0]["losses"], reference)):
        assert abs(got - want) <= bound * abs(want), (
            f"{name} {level} iteration {it + 1}: loss {got} vs single-process {want} (seed {SEED})")


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_every_expert_linear_is_fp8_and_the_loss_follows_the_baseline(results, level):
    single = results("moe_single", level)[0]
    # Per layer: the attention's two linears and each expert's two; the router stays FP32 (not counted).
    assert single["fp8_weights"] == LAYERS * (2 + 2 * EXPERTS)
    assert results("moe_single", "none")[0]["fp8_weights"] == 0
    base = results("moe_single", "none")[0]["losses"]
    for got, want in zip(single["losses"], base):
        assert abs(got - want) <= 0.01 * want, (level, single["losses"], base)
    # Tensor parallelism splits each expert: the same count of FP8 weights on each rank.
    if level == "O2":
        assert all(r["fp8_weights"] == LAYERS * (2 + 2 * EXPERTS) for r in results("moe_tp2sp", "O2"))


def _validate(flags: list[str], world: int = 1):
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--mock-data",
            "--vocab-size", "128"]
    return validate_args(parse_args(base + flags), world_size=world)


@pytest.mark.parametrize("flags,world,needle", [
    (["--moe-router-topk", "2", "--expert-model-parallel-size", "2"], 2, "need(s) --num-experts"),
    (["--num-experts", "4", "--moe-router-topk", "5"], 1, "--moe-router-topk 5 must be in [1, --num-experts 4]"),
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], 4, "must divide --num-experts 6"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2"], 1, "must divide the data-parallel size 1"),
    (["--num-experts", "4", "--moe-fp8-dispatch"], 1, "needs --fp8-opt-level O1/O2/O3 and --moe-token-dispatcher-type"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2"], 2, "expert parallelism"),
    (["--num-experts", "4", "--moe-grouped-gemm"], 1, "--moe-grouped-gemm is not available yet"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 2, "add --disable-bias-linear"),
])
def test_moe_flags_are_checked_up_front(flags, world, needle):
    with pytest.raises(ConfigurationError) as error:
        _validate(flags, world)
    assert needle in str(error.value)


def test_moe_flags_fill_the_expert_ffn_size():
    args = _validate(["--num-experts", "4", "--ffn-hidden-size", "96"])
    assert args.moe_ffn_hidden_size == 96
    assert _validate(["--num-experts", "4", "--moe-ffn-hidden-size", "32"]).moe_ffn_hidden_size == 32


def test_dry_run_counts_the_experts_and_plans_no_memory_it_cannot_model():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "pretrain_gpt.py", "--dry-run", "--num-experts", "4", "--mock-data",
                           "--vocab-size", "512"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.split("dry run json: ", 1)[1])
    assert result["plan"] is None and result["plan_not_modelled"] == "--num-experts (mixture of experts)"
    dense = subprocess.run([sys.executable, "pretrain_gpt.py", "--dry-run", "--mock-data", "--vocab-size", "512"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    dense_params = json.loads(dense.stdout.split("dry run json: ", 1)[1])["max_params_per_rank"]
    # 4 experts of the dense FFN (h -> 4h -> h with biases) per layer in place of one, plus the router (h -> 4
    # experts, with a bias as the linears have one)
    h, layers, experts = 128, 4, 4
    ffn = 2 * h * 4 * h + 4 * h + h
    assert result["max_params_per_rank"] == dense_params + layers * ((experts - 1) * ffn + experts * h + experts)
