"""Shared test fixtures: a fresh random seed per run (reported, overridable with FP8LM_TEST_SEED)."""

from __future__ import annotations

import os
import random

import pytest
import torch

# Triton decides at kernel-definition time (when fp8.kernels is first imported, by any test module) whether
# kernels are interpreted: without CUDA, the kernel tests run them under the interpreter, so set it for the
# whole session before anything imports fp8.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_SEED = int(os.environ.get("FP8LM_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return f"fp8lm test seed: {_SEED} (rerun with FP8LM_TEST_SEED={_SEED})"


@pytest.fixture
def seed(request) -> int:
    """A fresh seed per test (run seed mixed with the test name); torch's global RNG is seeded with it."""
    value = (_SEED + sum(map(ord, request.node.nodeid))) % 2**31
    torch.manual_seed(value)
    return value


@pytest.fixture
def gen(seed) -> torch.Generator:
    """A torch.Generator seeded with :func:`seed`."""
    return torch.Generator().manual_seed(seed)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason, on machines without a CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); on a GPU machine: make gpu-check")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
