"""FP8 layer selection is announced at WARNING (how many linears run in FP8, which stay in high precision
and why), in fp8.initialize and in pretrain_gpt.py, whose --fp8-min-dim applies to the Megatron layers."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8
from megatron.training.arguments import ConfigurationError, parse_config

ROOT = Path(__file__).resolve().parents[2]


def _model():
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                               torch.nn.Linear(64, 10))


def test_initialize_announces_selection_at_warning(caplog):
    model = _model()
    with caplog.at_level(logging.WARNING, logger="fp8"):
        fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O2", min_fp8_dim=0)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    message = next(m for m in warnings if "linear layer(s) run in FP8" in m)
    assert message.startswith("fp8: 2 of 3 linear layer(s) run in FP8; 1 stay in high precision")
    assert "not multiples of 16" in message and ": 3" in message


def test_initialize_warns_when_no_fp8_gemm_runs(caplog):
    model = _model()
    with caplog.at_level(logging.WARNING, logger="fp8"):
        fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1", min_fp8_dim=2048)
    message = next(r.getMessage() for r in caplog.records if "run in FP8" in r.getMessage())
    assert message.startswith("fp8: 0 of 3 linear layer(s) run in FP8")
    assert "smaller than min_fp8_dim=2048" in message and message.endswith("no FP8 GEMM will run")
    assert not any(isinstance(p, fp8.Float8Tensor) for p in model.parameters())


def test_negative_min_dim_is_refused():
    with pytest.raises(ConfigurationError, match="--fp8-min-dim must be >= 0"):
        parse_config(["--fp8-min-dim", "-1"], world_size=1)


_SCRIPT = r"""
import json, logging, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, ".")
from megatron.training.arguments import parse_config
from megatron.training import training
flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--mock-data", "--vocab-size", "256", "--no-progress", "--train-iters", "1",
         "--eval-interval", "0", "--fp8-opt-level", "O2"]
out = {}
for min_dim in ("0", "128"):
    cfg = parse_config(flags + ["--fp8-min-dim", min_dim])
    out[min_dim] = training.pretrain(cfg)[-1]["summary"]["fp8_weights"]
print("RESULT " + json.dumps(out))
"""


def test_pretrain_applies_min_dim_and_announces_it():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert out == {"0": 8, "128": 0}  # 2 layers x 4 linears in FP8, or none below --fp8-min-dim 128
    lines = [line for line in proc.stderr.splitlines() if "linear layer(s) run in FP8" in line]
    assert len(lines) == 2, proc.stderr[-2000:]
    assert "pipeline stage 0: 8 of 9 linear layer(s) run in FP8; 1 stay in high precision: 1 vocabulary " \
           "projection (output layer: high precision, as in Transformer Engine): output_layer" in lines[0]
    assert "0 of 9 linear layer(s) run in FP8" in lines[1] and "below min_fp8_dim=128" not in lines[1]
    assert "8 smaller than min_fp8_dim=128" in lines[1] and lines[1].endswith("no FP8 GEMM will run")


def test_planner_applies_the_same_selection(monkeypatch):
    from fp8.convert import CUDA_MIN_FP8_DIM
    from megatron.training.planning.memory_plan import PlannerConfig, plan_memory

    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--mock-data",
             "--vocab-size", "256", "--fp8-opt-level", "O2"]
    small = PlannerConfig.from_run_config(parse_config(flags + ["--fp8-min-dim", "128"], world_size=1))
    every = PlannerConfig.from_run_config(parse_config(flags + ["--fp8-min-dim", "0"], world_size=1))
    assert plan_memory(small)["fp8_params_per_gpu"] == 0
    assert plan_memory(every)["fp8_params_per_gpu"] == 2 * (3 * 64 * 64 + 64 * 64 + 2 * 4 * 64 * 64)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    from megatron.training.planning.memory_plan import default_min_fp8_dim

    assert default_min_fp8_dim() == CUDA_MIN_FP8_DIM  # pretrain_gpt's CUDA default
