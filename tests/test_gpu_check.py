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
