"""Shared test fixtures: a fresh random seed per run (reported, overridable with FP8LM_TEST_SEED)."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch

from tests import tiers

TIERS = Path(__file__).resolve().parent / "tiers.json"

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


def pytest_configure(config):
    """``FP8LM_RECORD_TIERS=PATH`` (``make test-tiers``): record every test's time and processes (:mod:`tests.tiers`)."""
    path = os.environ.get("FP8LM_RECORD_TIERS")
    if path:
        recorder = tiers.Recorder(Path(path))
        recorder.install()
        config.pluginmanager.register(recorder, "fp8lm-tiers")


def pytest_collection_modifyitems(config, items):
    """Tier markers (``slow``, ``multiprocess``) from ``tests/tiers.json`` (:mod:`tests.tiers`); tests marked ``gpu``
    are skipped, with the reason, on machines without a CUDA GPU."""
    recorded = tiers.load(TIERS)
    for item in items:
        for name in tiers.marks(item, recorded):
            item.add_marker(getattr(pytest.mark, name))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False); on a GPU machine: make gpu-check")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
