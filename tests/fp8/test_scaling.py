"""Formats and power-of-two scaling: scale formula, non-finite amax, current and delayed state."""

from __future__ import annotations

import math

import pytest
import torch

import fp8
from fp8.scaling import ScalingConfig, ScalingState, compute_scale


def test_formats_match_torch():
    assert fp8.E4M3.dtype is torch.float8_e4m3fn and fp8.E5M2.dtype is torch.float8_e5m2
    assert fp8.E4M3.max == torch.finfo(torch.float8_e4m3fn).max == 448.0
    assert fp8.E5M2.max == torch.finfo(torch.float8_e5m2).max == 57344.0
    assert fp8.E4M3.min_normal == torch.finfo(torch.float8_e4m3fn).smallest_normal
    assert fp8.E5M2.min_normal == torch.finfo(torch.float8_e5m2).smallest_normal
    assert fp8.get_format("E5M2") is fp8.E5M2 and fp8.get_format(torch.float8_e4m3fn) is fp8.E4M3
    with pytest.raises(ValueError, match="e4m3"):
        fp8.get_format("e3m4")


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("margin", [0, 2])
def test_scale_is_power_of_two_formula(fmt, margin, gen):
    amax = torch.exp(torch.empty(200, dtype=torch.float64).uniform_(-30, 30, generator=gen))
    for a in amax.tolist():
        scale = compute_scale(torch.tensor(a), fmt, margin).item()
        expected = 2.0 ** (math.floor(math.log2(fmt.max / torch.tensor(a, dtype=torch.float32).item())) - margin)
        assert scale == expected
        assert math.log2(scale) == int(math.log2(scale))
        # The largest value lands inside the format's range, within a factor 2 of the top (margin 0).
        assert a * scale <= fmt.max * (1 + 1e-6)
        if margin == 0:
            assert a * scale > fmt.max / 2 * (1 - 1e-6)


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan"), -float("inf")])
def test_non_finite_or_zero_amax_keeps_previous_scale(bad):
    previous = torch.tensor(0.125)
    assert compute_scale(torch.tensor(bad), "e4m3", previous=previous).item() == 0.125
    assert compute_scale(torch.tensor(bad), "e4m3").item() == 1.0


def test_extreme_amax_gives_finite_scale():
    for amax in (1e-40, 1e-30, 3e38):
        scale = compute_scale(torch.tensor(amax), "e4m3")
        assert torch.isfinite(scale) and scale > 0 and torch.isfinite(scale.reciprocal())


def test_scaling_config_validation():
    with pytest.raises(ValueError, match="kind"):
        ScalingConfig(kind="just-in-time")
    with pytest.raises(ValueError, match="history_len"):
        ScalingConfig(history_len=0)
    with pytest.raises(ValueError, match="format"):
        ScalingConfig(fmt="int8")
    with pytest.raises(Exception):
        ScalingConfig().kind = "current"  # frozen


def test_current_scaling_uses_the_tensor_amax(gen):
    state = ScalingState(ScalingConfig(kind="current"))
    x = torch.randn(64, 64, generator=gen) * 7
    assert state.scale_for(x).item() == compute_scale(x.abs().max(), "e4m3").item()


def test_delayed_scaling_history(gen):
    cfg = ScalingConfig(kind="delayed", history_len=4)
    state = ScalingState(cfg)
    mags = [3.0, 100.0, 5.0, 2.0, 1.5, 1.2, 1.1]
    used = []
    for step, mag in enumerate(mags):
        x = torch.randn(256, generator=gen)
        x = x / x.abs().max() * mag
        used.append(state.scale_for(x).item())
        assert state.amax_history[0].item() == pytest.approx(mag)
        state.update()
        window = mags[max(0, step - 3): step + 1]
        assert state.scale.item() == compute_scale(torch.tensor(max(window)), "e4m3").item()
        assert state.amax_history[0].item() == 0.0
        assert state.amax_history[1].item() == pytest.approx(mag)
    # Step 0 has no history: it falls back to current scaling; later steps use the previous update's scale.
    assert used[0] == compute_scale(torch.tensor(3.0), "e4m3").item()
    assert used[2] == compute_scale(torch.tensor(100.0), "e4m3").item()
    # Step 5 uses the window of steps 1-4 (still holding the spike); step 6 uses steps 2-5 -> 5.
    assert used[5] == compute_scale(torch.tensor(100.0), "e4m3").item()
    assert used[6] == compute_scale(torch.tensor(5.0), "e4m3").item()


def test_delayed_scaling_records_max_over_micro_batches(gen):
    state = ScalingState(ScalingConfig(kind="delayed"))
    state.scale_for(torch.full((4,), 2.0))
    state.scale_for(torch.full((4,), 9.0))
    state.scale_for(torch.full((4,), 1.0))
    assert state.amax_history[0].item() == 9.0


def test_scaling_state_is_checkpointed(gen):
    state = ScalingState(ScalingConfig(kind="delayed"))
    state.scale_for(torch.randn(32, generator=gen))
    state.update()
    other = ScalingState(ScalingConfig(kind="delayed"))
    other.load_state_dict(state.state_dict())
    assert torch.equal(other.scale, state.scale) and torch.equal(other.amax_history, state.amax_history)
    assert bool(other.has_history)
