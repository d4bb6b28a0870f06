"""`make gpu-check` on a machine without a CUDA GPU stops at once with a message saying a CUDA GPU is needed,
and installs nothing (no Python, hence no pip, is even started). The CUDA-gated tests skip with a reason."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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

    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-rs", "-p",
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
    out = tmp_path / "smoke.json"
    proc = subprocess.run([sys.executable, "benchmarks/gpu_step.py", "--json", str(out), "--iters", "1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["mode"] == "smoke" and result["targets"] == ["targets are checked in full mode on a GPU only"]
    names = ["bf16", "bf16_mixed", "O1", "O2", "O3", "O2_rowwise", "O2_blockwise", "O2_blockwise_act"]
    assert [r["variant"] for r in result["model"]][:8] == names
    assert all("ms" in r for r in result["model"][:8]), result["model"]
    fp8lm = [r for r in result["linear"] if r["variant"] == "fp8lm"]
    assert len(fp8lm) == 4 and all(r["fp8"] and "speedup_vs_bf16" in r for r in fp8lm)  # CPU: min_fp8_dim 0
