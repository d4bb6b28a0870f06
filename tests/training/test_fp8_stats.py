"""FP8 numerics statistics (issue 27): ``fp8.stats`` against counts made by hand on the real casts, and
``pretrain_gpt.py --fp8-stats-interval`` end to end (JSON log, alarm, ``--fp8-stats-stop``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fp8
from fp8.formats import E4M3, E5M2
from fp8.stats import FP8Statistics, flush_and_saturation_counts
from megatron.training.monitoring.fp8_numerics import alarms, merge_rank_stats

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=str)
def test_flush_and_saturation_follow_the_real_cast(fmt, seed):
    g = torch.Generator().manual_seed(seed)
    # magnitudes spread from 2^-30 to past the format's max at scale 8, both signs, some exact zeros
    top = int(math.log2(fmt.max))
    x = torch.randn(4096, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-30, top, (4096,), generator=g))
    x[::97] = 0.0
    scale = torch.tensor(2.0 ** 3)
    flushed, saturated, finite, nonzero = flush_and_saturation_counts(x, scale, fmt).tolist()
    scaled = x * 8.0
    in_range = scaled.abs() <= fmt.max
    cast = scaled[in_range].to(fmt.dtype).to(torch.float64)  # the real round-to-nearest-even cast
    assert flushed == int(((cast == 0) & (scaled[in_range] != 0)).sum())
    assert saturated == int((~in_range).sum())
    assert finite == x.numel()
    assert nonzero == int((x != 0).sum()) < finite  # the flush fraction's denominator: zeros cannot flush
    assert flushed > 0 and saturated > 0  # the sample reaches both ends (the test can fail)


def _model(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))
    return fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2")


def test_statistics_count_the_casts_of_the_observed_steps_only(seed):
    model, optimizer = _model(seed)
    stats = FP8Statistics(model, interval=2)
    assert sorted(stats.layers) == ["0", "2"]
    first = model[0]
    x = torch.randn(128, 32, generator=torch.Generator().manual_seed(seed))
    stats.begin_step(1)  # not observed (interval 2)
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    assert stats.read() == {}
    # Force layer 0's input into saturation: a delayed scale 2^10 times too large for x.
    with torch.no_grad():
        first.input_scaling.scale.fill_(2.0 ** 10)
        first.input_scaling.has_history.fill_(True)
    first.input_scaling.config = first.input_scaling.config.__class__(
        **{**first.input_scaling.config.__dict__, "kind": "delayed"})
    stats.begin_step(2)
    model(x).square().mean().backward()
    report = stats.read()
    expected = float(((x.double().abs() * 2.0 ** 10) > E4M3.max).sum()) / x.numel()
    assert report["0"]["input"]["saturated"] == pytest.approx(expected, abs=0)
    assert report["0"]["input"]["scale"] == 2.0 ** 10
    assert report["0"]["input"]["amax"] == pytest.approx(float(x.abs().max()))
    assert report["2"]["input"]["saturated"] == 0.0
    weight = first.weight
    assert report["0"]["weight"]["scale"] == float(weight.scale)
    assert report["0"]["weight"]["amax"] == pytest.approx(float(weight.dequantize().abs().max()))
    assert report["0"]["weight"]["grad_scale"] == pytest.approx(float(weight.grad.scale))
    found = alarms(report, 2, saturation=1e-3, flush=0.5)
    assert len(found) == 1 and "0 input" in found[0] and "saturate" in found[0]


def test_ranks_merge_by_their_largest_values():
    a = {"l": {"input": {"amax": 1.0, "scale": 4.0, "flush_to_zero": 0.1, "saturated": 0.0},
               "weight": {"amax": 1.0, "scale": 2.0, "flush_to_zero": 0.0, "saturated": 0.0, "grad_scale": float("nan")}}}
    b = {"l": {"input": {"amax": 3.0, "scale": 4.0, "flush_to_zero": 0.0, "saturated": 0.2},
               "weight": {"amax": 0.5, "scale": 2.0, "flush_to_zero": 0.0, "saturated": 0.0, "grad_scale": 8.0}}}
    merged = merge_rank_stats([a, b])
    assert merged["l"]["input"] == {"amax": 3.0, "scale": 4.0, "flush_to_zero": 0.1, "saturated": 0.2}
    assert merged["l"]["weight"]["grad_scale"] == 8.0
    # pipeline stages report their layers by global name: distinct layers stay apart
    assert sorted(merge_rank_stats([{"decoder.layers.0.x": a["l"]}, {"decoder.layers.1.x": b["l"]}])) == \
        ["decoder.layers.0.x", "decoder.layers.1.x"]


FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "4", "--mock-data", "--vocab-size", "256", "--train-iters", "6", "--log-interval", "3",
         "--eval-interval", "0", "--no-progress", "--fp8-stats-interval", "2"]


def test_pretrain_gpt_logs_statistics_and_stops_on_an_alarm(tmp_path):
    log = tmp_path / "log.jsonl"
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *FLAGS, "--log-json", str(log)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    with_stats = [r for r in records if "fp8_stats" in r]
    assert [r["iteration"] for r in with_stats] == [3, 6]  # read at the log points only
    layers = with_stats[-1]["fp8_stats"]
    assert len(layers) == 8  # 2 layers x 4 linears; the output layer is not FP8
    for operands in layers.values():
        assert set(operands) == {"input", "grad_output", "weight"}
        assert operands["input"]["saturated"] == 0.0 and operands["input"]["scale"] > 0
    # Every non-zero value flushed to zero counts as an alarm at threshold 0: the run stops naming a layer.
    stopped = subprocess.run([sys.executable, "pretrain_gpt.py", *FLAGS, "--fp8-stats-flush-alarm", "0",
                              "--fp8-stats-stop"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    flushed = any(op["flush_to_zero"] > 0 for r in with_stats for layer in r["fp8_stats"].values()
                  for name, op in layer.items() if name != "weight")
    if flushed:  # the same seed and data: the same casts flush in the second run
        assert stopped.returncode == 1, stopped.stderr[-2000:]
        assert "--fp8-stats-stop: iteration 3: decoder.layers." in stopped.stderr
        assert "FP8 alarm, iteration 3: decoder.layers." in stopped.stderr
    else:
        assert stopped.returncode == 0


def test_statistics_need_an_fp8_level():
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *FLAGS, "--fp8-opt-level", "none"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "it needs --fp8-opt-level O1/O2/O3" in proc.stderr


def test_the_flush_fraction_is_over_non_zero_values(seed):
    """Half the input exactly zero, the other half flushed by a scale far too small: the fraction is 1 (every value that
    could flush did), not the 0.5 a count over all values would say, and the flush alarm fires."""
    model, optimizer = _model(seed)
    stats = FP8Statistics(model, interval=1)
    first = model[0]
    x = torch.randn(128, 32, generator=torch.Generator().manual_seed(seed)) * 1e-3
    x[::2] = 0.0
    with torch.no_grad():
        first.input_scaling.scale.fill_(2.0 ** -60)
        first.input_scaling.has_history.fill_(True)
    first.input_scaling.config = first.input_scaling.config.__class__(
        **{**first.input_scaling.config.__dict__, "kind": "delayed"})
    stats.begin_step(1)
    model(x).square().mean().backward()
    report = stats.read()
    assert report["0"]["input"]["flush_to_zero"] == 1.0
    found = alarms(report, 1, saturation=1e-3, flush=0.5)
    assert any("0 input" in line and "flush" in line for line in found), found
