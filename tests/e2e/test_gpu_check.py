"""`make gpu-check` on a machine without a CUDA GPU stops at once with a message saying a CUDA GPU is needed,
and installs nothing (no Python, hence no pip, is even started). The CUDA-gated tests skip with a reason.
The two-GPU runs (benchmarks/gpu_parallel.py) are tested without torchrun: their skip message, their
configurations validated by pretrain_gpt.py --dry-run, and the run/timeout/log/trace-check machinery on a
stand-in for torchrun."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("nvidia_smi", ["absent", "no-devices"])
def test_gpu_check_without_a_gpu_stops_at_once_installing_nothing(tmp_path, nvidia_smi):
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "python_calls.log"
    python = bin_dir / "python-logged"
    python.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    if nvidia_smi == "no-devices":  # the driver's tool present, no GPU behind it
        fake = bin_dir / "nvidia-smi"
        fake.write_text("#!/bin/sh\necho 'No devices were found'\nexit 6\n")
        fake.chmod(0o755)
        path = f"{bin_dir}:/usr/bin:/bin"
    else:
        path = "/usr/bin:/bin" if not Path("/usr/bin/nvidia-smi").exists() else str(bin_dir) + ":/bin"
        if shutil.which("nvidia-smi", path=path):
            pytest.skip("nvidia-smi is on the system path")
    start = time.perf_counter()
    proc = subprocess.run([make, "-s", "gpu-check", f"PYTHON={python}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PATH": path})
    elapsed = time.perf_counter() - start
    assert proc.returncode != 0
    assert "needs a CUDA GPU" in proc.stderr and "Nothing was installed" in proc.stderr
    assert not calls.exists(), calls.read_text()  # no Python started: no pip, no test, no benchmark
    assert elapsed < 10


def test_gpu_tests_are_marked_and_skip_with_a_reason_without_cuda():
    import torch

    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/e2e/test_gpu.py", "-rs", "-p",
                           "no:cacheprovider"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:]
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: the gpu tests ran")
    assert " passed" not in proc.stdout and "skipped" in proc.stdout
    assert "needs a CUDA GPU" in proc.stdout


def test_gpu_step_smoke_mode_runs_every_path_on_cpu(tmp_path):
    """benchmarks/gpu_step.py without CUDA: the smoke mode (tiny shapes) runs the model variants and the
    linears and writes its JSON; no target is judged from CPU timings."""
    import json

    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available: make gpu-check runs the full mode")
    out, parallel = tmp_path / "smoke.json", tmp_path / "parallel.json"
    parallel.write_text(json.dumps({"mode": "run", "gpus": 1, "runs": [], "ok": True, "seconds": 0.0,
                                    "skipped": "the two-GPU runs (PP2, TP2+SP) need 2 GPUs: --gpus 1"}))
    proc = subprocess.run([sys.executable, "benchmarks/gpu_step.py", "--json", str(out), "--iters", "1",
                           "--parallel-json", str(parallel)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "two-GPU runs skipped: the two-GPU runs (PP2, TP2+SP) need 2 GPUs" in proc.stdout
    result = json.loads(out.read_text())
    assert result["parallel"] == json.loads(parallel.read_text())  # merged into gpu_check.json
    assert result["mode"] == "smoke" and result["targets"] == ["targets are checked in full mode on a GPU only"]
    names = ["bf16", "bf16_mixed", "O1", "O2", "O3", "O2_rowwise", "O2_blockwise", "O2_blockwise_act"]
    assert [r["variant"] for r in result["model"]][:8] == names
    assert all("ms" in r for r in result["model"][:8]), result["model"]
    fp8lm = [r for r in result["linear"] if r["variant"] == "fp8lm"]
    assert len(fp8lm) == 4 and all(r["fp8"] and "speedup_vs_bf16" in r for r in fp8lm)  # CPU: min_fp8_dim 0


def _gpu_parallel():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_parallel", ROOT / "benchmarks" / "gpu_parallel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_parallel_with_one_gpu_says_the_two_gpu_runs_are_skipped(tmp_path):
    import json

    out = tmp_path / "parallel.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_parallel.py", "--gpus", "1", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "two-GPU runs skipped: the two-GPU runs (PP2, TP2+SP) need 2 GPUs: --gpus 1" in proc.stdout
    result = json.loads(out.read_text())
    assert result["runs"] == [] and result["ok"] and "need 2 GPUs" in result["skipped"]


def test_gpu_parallel_runs_are_pp2_and_tp2_sp_and_pretrain_gpt_accepts_them(tmp_path):
    """--dry-run: each torchrun command's pretrain_gpt.py arguments pass pretrain_gpt.py --dry-run (a 2-rank
    plan on the meta device), so a renamed flag or an invalid layout fails here, not on the GPU machine."""
    import json

    out = tmp_path / "dry.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_parallel.py", "--gpus", "2", "--dry-run", "--json", str(out),
                           "--out-dir", str(tmp_path / "runs")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {r["run"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"pp2", "tp2_sp"}
    for name, run in runs.items():
        assert run["validate_rc"] == 0, run.get("validate_tail")
        command = run["command"]
        assert command.startswith("torchrun --standalone --nproc_per_node 2 pretrain_gpt.py ")
        for flag in ("--mock-data", "--fp8-opt-level O2", "--fp8-min-dim 0", f"--log-json {tmp_path}/runs/{name}/log.jsonl",
                     f"--collective-trace {tmp_path}/runs/{name}/trace"):
            assert flag in command, (flag, command)
        assert run["validate"].startswith("dry run: GPT 4 layers x hidden 2048") and "= 2 ranks" in run["validate"]
    assert "--pipeline-model-parallel-size 2" in runs["pp2"]["command"]
    assert "--tensor-model-parallel-size 2 --sequence-parallel" in runs["tp2_sp"]["command"]
    assert "TP 1 x PP 2 x DP 1" in runs["pp2"]["validate"] and "TP 2 x PP 1 x DP 1" in runs["tp2_sp"]["validate"]
    assert "+ SP" in runs["tp2_sp"]["validate"]


_FAKE_TORCHRUN = """
import json, os, sys, time
args = sys.argv[1:]
log, trace = args[args.index("--log-json") + 1], args[args.index("--collective-trace") + 1]
os.makedirs(trace, exist_ok=True)
for rank in (0, 1):
    open(os.path.join(trace, f"rank{rank}.jsonl"), "w").write("{}\\n")
if "--pipeline-model-parallel-size" in args:  # pp2: trains and logs
    with open(log, "w") as f:
        for it in (1, 2):
            f.write(json.dumps({"iteration": it, "loss": 10.0 - it, "tokens_per_s": 1000.0 * it}) + "\\n")
        f.write(json.dumps({"summary": [{"final_train_loss": 8.25, "tokens_per_s": 2000.0, "fp8_weights": 16}]}) + "\\n")
else:  # tp2_sp: hangs (a deadlock), with a child process that must be killed with it
    import subprocess
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    time.sleep(60)
"""


def test_gpu_parallel_machinery_on_a_stand_in_for_torchrun(tmp_path, monkeypatch, capsys):
    """main() as on a two-GPU machine, torchrun replaced by a script: pp2 logs a summary, tp2_sp hangs and is
    killed at the timeout; the trace checker (a stand-in) runs on each trace; the JSON and exit status say so."""
    import json

    gp = _gpu_parallel()
    fake = tmp_path / "fake_torchrun.py"
    fake.write_text(_FAKE_TORCHRUN)
    monkeypatch.setattr(gp, "torchrun_command", lambda name, iters, run_dir: [
        sys.executable, str(fake), *gp.train_args(name, iters, run_dir)])
    root = tmp_path / "root"
    (root / "tools").mkdir(parents=True)
    (root / "tools" / "check_collective_trace.py").write_text(
        "import sys, os; print('checked', len(os.listdir(sys.argv[1])), 'ranks'); sys.exit(0)\n")
    monkeypatch.setattr(gp, "ROOT", root)
    out = tmp_path / "parallel.json"
    start = time.perf_counter()
    status = gp.main(["--gpus", "2", "--timeout-s", "3", "--json", str(out), "--out-dir", str(tmp_path / "runs")])
    assert time.perf_counter() - start < 40
    result = json.loads(out.read_text())
    pp2, tp2 = result["runs"]
    assert pp2["run"] == "pp2" and pp2["ok"] and pp2["rc"] == 0
    assert (pp2["final_loss"], pp2["tokens_per_s"], pp2["fp8_weights"], pp2["iterations"]) == (8.25, 2000.0, 16, 2)
    assert pp2["trace_check"]["status"] == "ok" and "checked 2 ranks" in pp2["trace_check"]["detail"]
    assert tp2["run"] == "tp2_sp" and not tp2["ok"] and tp2["rc"] == 124 and tp2["timed_out"]
    assert status == 1 and not result["ok"]
    printed = capsys.readouterr().out
    assert "pp2: PASS" in printed and "tp2_sp: FAIL exit 124 (timed out)" in printed


def test_gpu_parallel_trace_check_statuses(tmp_path, monkeypatch):
    gp = _gpu_parallel()
    monkeypatch.setattr(gp, "ROOT", tmp_path)
    assert gp.check_trace(tmp_path / "trace")["status"] == "checker missing"
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "check_collective_trace.py").write_text("import sys; print('rank 1 recv first'); sys.exit(1)\n")
    assert gp.check_trace(tmp_path / "trace")["status"] == "no trace"
    (tmp_path / "trace").mkdir()
    (tmp_path / "trace" / "rank0.jsonl").write_text("")
    check = gp.check_trace(tmp_path / "trace")
    assert check["status"] == "violation" and check["rc"] == 1 and "recv first" in check["detail"]
    assert not gp.run_ok({"rc": 0, "final_loss": 3.0, "trace_check": check})
    assert not gp.run_ok({"rc": 0, "final_loss": float("nan"), "trace_check": {"status": "ok"}})
    assert gp.run_ok({"rc": 0, "final_loss": 3.0, "trace_check": {"status": "ok"}})
