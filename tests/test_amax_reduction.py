"""Amax agreement across a process group: 2 gloo processes end with the same scales, equal to the
scales a single process computes from the ranks' combined data."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fp8
from fp8.scaling import ScalingConfig, ScalingState, amax_of, compute_scale
from tests.spawn import free_port

WORLD = 2


def _rank_data(seed: int, rank: int):
    gen = torch.Generator().manual_seed(seed * 10 + rank)
    mag = 10.0 ** (2 * rank)  # ranks differ by 100x
    return torch.randn(32, 64, generator=gen) * mag, torch.randn(32, 32, generator=gen) * mag * 1e-3


def _worker(rank: int, port: int, seed: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(seed)
        layer = fp8.Float8Linear(64, 32)
        fp8.set_amax_reduction_group(layer, dist.group.WORLD)
        x, g = _rank_data(seed, rank)
        layer(x).backward(g)
        fp8.update_scales(layer)
        current = ScalingState(ScalingConfig(kind="current"))
        current.amax_reduce_group = dist.group.WORLD
        current_scale = current.scale_for(x)
        torch.save(
            {"input": layer.input_scaling.scale, "grad": layer.grad_output_scaling.scale,
             "history": layer.input_scaling.amax_history, "current": current_scale},
            os.path.join(out_dir, f"rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def test_scales_agree_across_ranks(tmp_path, seed):
    mp.spawn(_worker, args=(free_port(), seed, str(tmp_path)), nprocs=WORLD, join=True)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    data = [_rank_data(seed, r) for r in range(WORLD)]
    x_amax = torch.stack([amax_of(x) for x, _ in data]).max()
    g_amax = torch.stack([amax_of(g) for _, g in data]).max()
    for result in results:
        assert result["input"].item() == compute_scale(x_amax, "e4m3").item()
        assert result["grad"].item() == compute_scale(g_amax, "e5m2").item()
        assert result["history"][1].item() == x_amax.item()
        assert result["current"].item() == compute_scale(x_amax, "e4m3").item()
    # Without agreement the ranks' own scales would differ (100x apart in magnitude).
    assert compute_scale(amax_of(data[0][0]), "e4m3") != compute_scale(amax_of(data[1][0]), "e4m3")
