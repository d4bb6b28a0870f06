"""fp8.distributed without a process group: mu's rule (config validation, halving, growth, bounds,
checkpoint), ring byte costs and the counter, bucket planning, and clear errors."""

from __future__ import annotations

import io

import pytest
import torch

import fp8
import fp8.distributed as fd
from fp8.distributed.bucketing import plan_buckets
from fp8.distributed.scaled_allreduce import coalesce, count_at_max


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"threshold": -0.1}, "threshold"),
        ({"threshold": 1.0}, "threshold"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"growth_interval": 10.5}, "growth_interval"),
        ({"init_mu": 0.3}, "power of two"),
        ({"max_mu": 2.0}, "max_mu <= 1"),
        ({"min_mu": 0.5, "max_mu": 0.25}, "min_mu <= max_mu"),
        ({"init_mu": 2.0**-20}, "init_mu"),
        ({"fmt": "e3m4"}, "unknown FP8 format"),
    ],
)
def test_config_rejects_bad_values_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fd.AutoScaleConfig(**kwargs)


@pytest.mark.parametrize("world, expected", [(1, 1.0), (2, 0.5), (3, 0.25), (4, 0.25), (8, 0.125)])
def test_initial_mu_is_pre_scaling_by_default(world, expected):
    assert fd.AutoScaleConfig().initial_mu(world) == expected
    assert fd.AutoScaleState(world_size=world).mu.item() == expected
    assert fd.AutoScaleConfig(init_mu=1.0).initial_mu(world) == 1.0


def _step(state, at_max, values):
    state.record(torch.tensor(at_max), values)
    state.update()


def test_mu_halves_above_threshold_and_doubles_over_growth_interval():
    cfg = fd.AutoScaleConfig(threshold=1e-3, growth_interval=4, init_mu=0.5, min_mu=2.0**-3)
    state = fd.AutoScaleState(cfg)
    mus = []
    for _ in range(4):  # below the threshold: x 2**(1/4) per step
        _step(state, 1, 1000)  # fraction 1e-3 is not above 1e-3
        mus.append(state.mu.item())
    assert mus == pytest.approx([0.5 * 2 ** (k / 4) for k in range(1, 5)], rel=1e-6)
    assert state.mu.item() == 1.0 and state.mu_scale().item() == 1.0
    _step(state, 1, 1000)  # at max_mu: stays
    assert state.mu.item() == 1.0
    _step(state, 2, 1000)  # above: halves
    assert state.mu.item() == 0.5 and state.halvings.item() == 1
    assert state.last_overflow_fraction.item() == pytest.approx(2e-3)
    _step(state, 0, 1000)
    assert state.mu.item() == pytest.approx(0.5 * 2**0.25) and state.mu_scale().item() == 0.5  # power of two in scales
    for _ in range(5):
        _step(state, 500, 1000)
    assert state.mu.item() == 2.0**-3  # clamped at min_mu
    assert state.steps.item() == 12


def test_step_without_reductions_leaves_mu_alone():
    state = fd.AutoScaleState(fd.AutoScaleConfig(init_mu=0.25))
    state.update()
    assert state.mu.item() == 0.25 and state.steps.item() == 0


def test_mu_state_round_trips_through_a_checkpoint_and_converts_interval():
    state = fd.AutoScaleState(fd.AutoScaleConfig(growth_interval=100, init_mu=0.25))
    for _ in range(30):
        _step(state, 0, 10)
    buffer = io.BytesIO()
    torch.save(state.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    same = fd.AutoScaleState(fd.AutoScaleConfig(growth_interval=100, init_mu=1.0))
    same.load_state_dict(saved)
    assert same.mu.item() == state.mu.item() and same.steps.item() == 30
    other = fd.AutoScaleState(fd.AutoScaleConfig(growth_interval=1000, init_mu=1.0))
    other.load_state_dict(saved)
    assert other.mu.item() == pytest.approx(state.mu.item(), rel=1e-6)
    assert other.log2_mu_steps.item() == -1700 and other.growth_interval.item() == 1000


def test_mu_lives_on_the_state_device_without_host_sync():
    state = fd.AutoScaleState()
    assert all(b.device.type == "cpu" for b in state.buffers())
    assert state.mu.shape == () and state.mu_scale().dtype == torch.float32


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_ring_costs(world):
    b = 1000
    assert fd.ring_bytes("all_reduce", b, world) == pytest.approx(2 * (world - 1) / world * b)
    for kind in ("all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        assert fd.ring_bytes(kind, b, world) == pytest.approx((world - 1) / world * b)
    assert fd.ring_bytes("send", b, world) == b
    with pytest.raises(ValueError, match="unknown collective"):
        fd.ring_bytes("gossip", b, world)


def test_counter_sums_per_tag_and_kind():
    counter = fd.CommBytesCounter()
    counter.record("all_reduce", 400, 4, "grads")
    counter.record("all_to_all", 100, 4, "fp8 grads")
    counter.record("all_gather", 100, 4, "fp8 grads")
    assert counter.total == pytest.approx(600 + 75 + 75)
    assert counter.by_tag["fp8 grads"] == pytest.approx(150) and counter.calls["fp8 grads"] == 2
    assert counter.summary()["by_kind"]["all_reduce"] == pytest.approx(600)
    counter.reset()
    assert counter.total == 0


def test_count_at_max_reads_the_bytes(gen):
    for fmt in (fp8.E4M3, fp8.E5M2):
        values = torch.randn(1000, generator=gen) * fmt.max / 8
        values[::7] = fmt.max
        values[3::11] = -fmt.max
        payload = values.to(fmt.dtype)
        expected = (payload.float().abs() == fmt.max).sum().item()
        assert count_at_max(payload, fmt).item() == expected > 0


def test_buckets_split_by_kind_and_size_in_backward_order(seed):
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
    model, _ = fp8.initialize(model, None, "O1")
    params = list(model.parameters())  # 0.weight fp8, 0.bias, 2.weight fp8, 2.bias
    buckets = plan_buckets(params, bucket_bytes=2048)
    index = {id(p): i for i, p in enumerate(params)}
    assert [(b.fp8, [index[id(p)] for p in b.params]) for b in buckets] == [
        (True, [2]), (False, [3, 1]), (True, [0])
    ]
    assert buckets[0].nbytes == 64 * 32 and buckets[1].nbytes == 4 * (32 + 64)
    assert [len(b) for b in coalesce([torch.empty(10)] * 5, bucket_bytes=25)] == [2, 2, 1]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(params, 0)


def test_wrapper_and_collective_need_a_process_group():
    if torch.distributed.is_initialized():
        pytest.skip("a process group is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.DistributedDataParallel(torch.nn.Linear(16, 16))
    with pytest.raises(RuntimeError, match="init_process_group"):
        fd.scaled_all_reduce([torch.ones(3)], fd.AutoScaleState())

