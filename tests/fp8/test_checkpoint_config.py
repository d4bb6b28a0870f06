"""fp8.checkpoint.load_checkpoint refuses a model or optimizer other than the one saved (each difference
named) instead of reinterpreting bytes, and its errors are Exceptions."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import fp8
from fp8.checkpoint import CheckpointCorruptedError, CheckpointMismatchError, load_checkpoint, save_checkpoint
from fp8.optim.precision import OptimizerPrecision


def _build(seed: int, hidden: int = 64, optimizer=torch.optim.Adam, precision: OptimizerPrecision | None = None):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, hidden), nn.ReLU(), nn.Linear(hidden, 32))
    return fp8.initialize(model, optimizer(model.parameters(), lr=1e-3), "O2", optimizer_precision=precision)


def _step(model, optimizer, seed: int) -> None:
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_the_same_configuration_loads(tmp_path, seed):
    model, opt = _build(seed)
    _step(model, opt, seed)
    save_checkpoint(tmp_path / "c", model, opt)
    again, again_opt = _build(seed + 1)
    load_checkpoint(tmp_path / "c", again, again_opt)
    for a, b in zip(model.parameters(), again.parameters()):
        assert torch.equal(a.float() if not isinstance(a, fp8.Float8Tensor) else a.dequantize(),
                           b.float() if not isinstance(b, fp8.Float8Tensor) else b.dequantize())


@pytest.mark.parametrize("saved,loaded", [
    (OptimizerPrecision(exp_avg_rounding="stochastic"), None),
    (None, OptimizerPrecision(exp_avg_rounding="stochastic")),
], ids=["stochastic-to-nearest", "nearest-to-stochastic"])
def test_the_first_moments_rounding_mode_may_change_at_a_resume(tmp_path, seed, saved, loaded):
    """Not a storage layout: the states load bit for bit either way."""
    model, opt = _build(seed, precision=saved)
    _step(model, opt, seed)
    save_checkpoint(tmp_path / "c", model, opt)
    again, again_opt = _build(seed + 1, precision=loaded)
    load_checkpoint(tmp_path / "c", again, again_opt)
    for (p, s), (q, t) in zip(opt.state.items(), again_opt.state.items()):
        assert torch.equal(s["exp_avg"].view(torch.uint8), t["exp_avg"].view(torch.uint8))


@pytest.mark.parametrize("change,named", [
    ({"precision": OptimizerPrecision(exp_avg="fp16")}, "precision exp_avg 'e4m3' (checkpoint) vs 'fp16' (this run)"),
    ({"precision": OptimizerPrecision(exp_avg="fp16", exp_avg_rounding="stochastic")},
     "precision exp_avg 'e4m3' (checkpoint) vs 'fp16' (this run)"),
    ({"optimizer": torch.optim.AdamW}, "optimizer Adam (checkpoint) vs AdamW (this run)"),
    ({"hidden": 48}, "parameter 0.weight [[64, 32], 'torch.float8_e4m3fn'] (checkpoint) vs [[48, 32], "
                     "'torch.float8_e4m3fn'] (this run)"),
])
def test_another_configuration_is_refused_naming_each_difference(tmp_path, seed, change, named):
    model, opt = _build(seed)
    _step(model, opt, seed)
    save_checkpoint(tmp_path / "c", model, opt)
    other, other_opt = _build(seed, **change)
    with pytest.raises(CheckpointMismatchError, match=re.escape(named)):
        load_checkpoint(tmp_path / "c", other, other_opt)


def test_a_corrupted_file_is_an_exception_naming_it(tmp_path, seed):
    model, opt = _build(seed)
    save_checkpoint(tmp_path / "c", model, opt)
    data = next(f for f in sorted((tmp_path / "c").iterdir()) if f.suffix == ".distcp")
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])  # truncated
    with pytest.raises(CheckpointCorruptedError, match=data.name):
        load_checkpoint(tmp_path / "c", *_build(seed))
    assert issubclass(CheckpointCorruptedError, Exception) and issubclass(CheckpointMismatchError, Exception)


def test_one_checkpoint_error_hierarchy():
    """fp8's checkpoints and pretrain_gpt.py's raise the same classes, under one base (fp8.checkpoint)."""
    import fp8.checkpoint as engine
    from megatron.training.checkpointing import checkpoint as training

    for name in ("CheckpointMismatchError", "CheckpointNotFoundError", "CheckpointCorruptedError"):
        cls = getattr(engine, name)
        assert issubclass(cls, engine.CheckpointError)
        assert getattr(training, name, cls) is cls
    assert issubclass(engine.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(engine.CheckpointMismatchError, ValueError)
