"""Megatron mixture-of-experts GPT in FP8 (issue 26): megatron-core's MoE layer with fp8lm's linears as experts.

A tiny MoE GPT (4 layers, 4 experts, top-2, load-balancing loss) trained for 3 iterations on mock data by
``tests/megatron_worker.py``: one process at none/O2/O3, then 2 processes with tensor + sequence parallelism and the
all-to-all token dispatcher (none, O2; experts without bias), with data parallelism and the all-gather dispatcher
(none, O2, O3; experts with bias), with expert parallelism 2 (none, O2, O3; O2, O3 with the tokens dispatched in
FP8, and O2 rowwise with FP8 dispatch; --bf16 at none: FP32 main gradients), with pipeline parallelism 2 (none, O2), then 4 processes at DP4 x EP2 (none; O3 with FP8 dispatch: the experts reduced and owned over expert data
parallelism), each against the one-process run of the same model at its level. Bounds as tests/training/test_megatron_parallel.py's, widened for routing: top-2
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

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "megatron_worker.py"
SEED = int(os.environ.get("FP8LM_TEST_SEED", random.SystemRandom().randrange(2**31))) % 100_000
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--fp8-min-dim", "0"]
NO_BIAS = MOE + ["--disable-bias-linear"]  # experts split by tensor parallelism take no bias (megatron-core)
A2A = MOE + ["--moe-token-dispatcher-type", "alltoall"]
EP2 = A2A + ["--expert-model-parallel-size", "2"]
LAYERS, EXPERTS = 4, 4
TWO = [
    {"name": "moe_tp2sp", "tp": 2, "sp": True, "levels": ["none", "O2"], "reference": "moe_single_nobias",
     "flags": NO_BIAS + ["--moe-token-dispatcher-type", "alltoall"]},
    {"name": "moe_dp2", "levels": ["none", "O2", "O3"], "reference": "moe_single", "flags": MOE},
    # expert parallelism: each rank holds 2 of the 4 experts; tokens travel by all-to-all (FP8 with a scale per token)
    {"name": "moe_ep2", "levels": ["none", "O2", "O3"], "reference": "moe_single_a2a", "flags": EP2},
    {"name": "moe_ep2_fp8", "levels": ["O2", "O3"], "reference": "moe_single_a2a", "flags": EP2 + ["--moe-fp8-dispatch"]},
    {"name": "moe_ep2_fp8_rowwise", "levels": ["O2"], "reference": "moe_single_a2a_rowwise",
     "flags": EP2 + ["--moe-fp8-dispatch", "--fp8-recipe", "rowwise"]},  # E4M3 gradients on the wire
    {"name": "moe_pp2", "pp": 2, "levels": ["none", "O2"], "reference": "moe_single", "flags": MOE},
    {"name": "moe_ep2_bf16", "bf16": True, "levels": ["none"], "reference": "moe_single_a2a_bf16", "flags": EP2},
]
# DP4 x EP2: the experts' gradients reduced (O3: to their owners) over expert data parallelism (2 ranks each)
FOUR = [{"name": "moe_dp4_ep2", "levels": ["none"], "reference": "moe_single_a2a", "flags": EP2},
        {"name": "moe_dp4_ep2_fp8", "levels": ["O3"], "reference": "moe_single_a2a",
         "flags": EP2 + ["--moe-fp8-dispatch"]}]
SINGLE = [{"name": "moe_single", "levels": ["none", "O2", "O3"], "flags": MOE},
          {"name": "moe_single_nobias", "levels": ["none", "O2"], "flags": NO_BIAS},
          {"name": "moe_single_a2a", "levels": ["none", "O2", "O3"], "flags": A2A},
          {"name": "moe_single_a2a_bf16", "bf16": True, "levels": ["none"], "flags": A2A},
          {"name": "moe_single_a2a_rowwise", "levels": ["O2"], "flags": A2A + ["--fp8-recipe", "rowwise"]}]
MULTI = [(2, c, level) for c in TWO for level in c["levels"]] + [(4, c, level) for c in FOUR for level in c["levels"]]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    for nproc, configs in ((1, SINGLE), (2, TWO), (4, FOUR)):
        run_worker(WORKER, nproc, ["--out", str(out), "--seed", str(SEED), "--configs", json.dumps(configs)], SEED)

    def load(name: str, level: str) -> list[dict]:
        files = sorted(out.glob(f"{name}_{level}_rank*.json"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
        return [json.loads(p.read_text()) for p in files]

    return load


@pytest.mark.parametrize("nproc,name,reference,level", [(n, c["name"], c["reference"], level) for n, c, level in MULTI])
def test_losses_match_single_process(results, nproc, name, reference, level):
    reference = results(reference, level)[0]["losses"]
    ranks = results(name, level)
    assert len(ranks) == nproc
    for r in ranks:
        assert r["losses"] == ranks[0]["losses"]  # every rank reports the same (all-reduced) loss
    bound = 2e-4 if level == "none" and "bf16" not in name else 5e-3  # BF16 activations: as FP8
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
    (["--num-experts", "4", "--moe-fp8-dispatch", "--moe-token-dispatcher-type", "alltoall"], 1,
     "no token leaves its rank"),
    (["--num-experts", "4", "--moe-fp8-dispatch", "--moe-token-dispatcher-type", "alltoall", "--fp8-opt-level", "none",
      "--expert-model-parallel-size", "2"], 2, "needs --fp8-opt-level O1/O2/O3"),
    (["--num-experts", "4", "--expert-model-parallel-size", "2", "--bf16", "--use-distributed-optimizer",
      "--fp8-opt-level", "none"], 2,
     "drop --use-distributed-optimizer"),
    (["--num-experts", "4", "--moe-grouped-gemm", "--tensor-model-parallel-size", "2", "--disable-bias-linear"], 2,
     "--moe-grouped-gemm runs each expert unsplit"),
    (["--num-experts", "4", "--moe-shared-expert-intermediate-size", "64"], 1, "shared expert"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 2, "add --disable-bias-linear"),
])
def test_moe_flags_are_checked_up_front(flags, world, needle):
    with pytest.raises(ConfigurationError) as error:
        _validate(flags, world)
    assert needle in str(error.value)


def test_fp8_dispatch_with_a_compared_baseline_is_accepted():
    # --compare trains each level with the same flags: the baseline among them dispatches in its own dtype
    args = _validate(["--num-experts", "4", "--moe-fp8-dispatch", "--moe-token-dispatcher-type", "alltoall",
                      "--expert-model-parallel-size", "2", "--fp8-opt-level", "none", "--compare", "O2"], 2)
    assert args.moe_fp8_dispatch and args.compare_levels == ["O2"]


def test_moe_flags_fill_the_expert_ffn_size():
    args = _validate(["--num-experts", "4", "--ffn-hidden-size", "96"])
    assert args.moe_ffn_hidden_size == 96
    assert _validate(["--num-experts", "4", "--moe-ffn-hidden-size", "32"]).moe_ffn_hidden_size == 32


def test_dry_run_counts_the_experts_and_plans_their_memory():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "pretrain_gpt.py", "--dry-run", "--num-experts", "4", "--mock-data",
                           "--vocab-size", "512"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.split("dry run json: ", 1)[1])
    assert result["plan"] is not None and result["plan"]["layout"]["ep"] == 1  # tests/training/test_memory_plan_moe.py: figures
    dense = subprocess.run([sys.executable, "pretrain_gpt.py", "--dry-run", "--mock-data", "--vocab-size", "512"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    dense_params = json.loads(dense.stdout.split("dry run json: ", 1)[1])["max_params_per_rank"]
    # 4 experts of the dense FFN (h -> 4h -> h with biases) per layer in place of one, plus the router (h -> 4
    # experts, with a bias as the linears have one)
    h, layers, experts = 128, 4, 4
    ffn = 2 * h * 4 * h + 4 * h + h
    assert result["max_params_per_rank"] == dense_params + layers * ((experts - 1) * ffn + experts * h + experts)
