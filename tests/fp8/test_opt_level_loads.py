"""Optimizer state and fp8.checkpoint checkpoints are loaded at their own opt level only: a load across levels
(O2 -> O1, O1 -> O2, O3 -> O2, O2 -> O3, O3 at another data-parallel size through load_state_dict) raises
OptLevelMismatchError naming both levels, from ``load_state_dict`` and ``fp8.checkpoint.load_checkpoint`` alike,
instead of a KeyError or AttributeError; state dicts written before the level was recorded still load at theirs."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fp8
from fp8.checkpoint import load_checkpoint, save_checkpoint
from fp8.optim.levels import OptLevelMismatchError


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _build(level: str, seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    model, opt = fp8.initialize(model, torch.optim.Adam(model.parameters(), lr=1e-3), level)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed))
    model(x).float().square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _refused(saved: str, mine: str):
    return pytest.raises(OptLevelMismatchError, match=re.escape(f"saved at opt level {saved}") + ".*"
                         + re.escape(f"into an opt level {mine} optimizer"))


def test_o2_state_into_o1_is_refused_naming_both():
    _, o2 = _build("O2")
    _, o1 = _build("O1")
    with _refused("O2", "O1"):
        o1.load_state_dict(o2.state_dict())


def test_o1_state_into_o2_is_refused_naming_both():
    _, o1 = _build("O1")
    _, o2 = _build("O2")
    with _refused("O1", "O2"):
        o2.load_state_dict(o1.state_dict())


def test_o2_state_without_a_level_record_into_o1_is_refused_too():
    _, o2 = _build("O2")
    _, o1 = _build("O1")
    old = {k: v for k, v in o2.state_dict().items() if k != "opt_level"}
    with _refused("O2/O3", "O1"):
        o1.load_state_dict(old)


def test_o3_state_into_o2_and_back_is_refused(group):
    _, o3 = _build("O3")
    _, o2 = _build("O2")
    with _refused("O3", "O2"):
        o2.load_state_dict(o3.state_dict())
    with _refused("O2", "O3"):
        o3.load_state_dict(o2.state_dict())


def test_o3_state_of_another_data_parallel_size_is_refused(group):
    _, o3 = _build("O3")
    state = o3.state_dict()
    assert state["opt_level"] == "O3" and state["world_size"] == 1
    state["world_size"] = 2  # as one rank of two would have written it
    with pytest.raises(OptLevelMismatchError, match="one rank of 2 data-parallel ranks.*sharded over 1.*fp8.checkpoint"):
        o3.load_state_dict(state)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_each_level_loads_its_own_state_recorded_or_not(level):
    _, a = _build(level, seed=0)
    _, b = _build(level, seed=1)
    state = a.state_dict()
    assert state["opt_level"] == level
    b.load_state_dict(state)
    b.load_state_dict({k: v for k, v in state.items() if k != "opt_level"})  # written before the record


def test_fp8_checkpoint_of_o2_into_o1_is_refused_naming_both(tmp_path):
    model, o2 = _build("O2")
    save_checkpoint(tmp_path / "c", model, o2)
    other, o1 = _build("O1")
    with pytest.raises(OptLevelMismatchError, match=r"opt level O2 optimizer state.*into an opt level O1 optimizer"):
        load_checkpoint(tmp_path / "c", other, o1)


def test_fp8_checkpoint_of_o3_into_o2_is_refused_naming_both(tmp_path, group):
    model, o3 = _build("O3")
    save_checkpoint(tmp_path / "c", model, o3)
    other, o2 = _build("O2")
    with pytest.raises(OptLevelMismatchError, match=r"opt level O3 optimizer state.*into an opt level O2 optimizer"):
        load_checkpoint(tmp_path / "c", other, o2)
    again, o3_again = _build("O3", seed=1)
    load_checkpoint(tmp_path / "c", again, o3_again)  # its own level loads
