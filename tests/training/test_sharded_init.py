"""Sharded initialisation (fp8.parallel.init): every rank generates only its shards, and the initial
model is identical, value for value, at TP1, TP2 (SwiGLU: strided fc1), PP2 and TP2 x PP2.

The models are built by the training code at each layout, saved untrained (iteration 0) with
``pretrain_gpt.py``'s checkpoint format and read back merged (``read_checkpoint``): equality is exact.
The generator itself is checked against the normal distribution and for independence between keys."""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.training.test_checkpointing import ROOT, SEED, launch_checkpoint_worker  # noqa: E402

from fp8.parallel.init import initialize_sharded_weight, normal_shard  # noqa: E402


def _merge(parts, dim, stride):
    world = len(parts)
    blocks = [None] * (world * stride)
    for r, shard in enumerate(parts):
        for j, block in enumerate(torch.chunk(shard, stride, dim)):
            blocks[j * world + r] = block
    return torch.cat(blocks, dim)


@pytest.mark.parametrize("shape", [(96, 64), (48, 34), (36, 18)])
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("stride", [1, 2])
def test_shards_are_slices_of_the_full_weight(shape, dim, stride):
    init = functools.partial(torch.nn.init.normal_, mean=0.0, std=0.02)
    if shape[dim] % stride:
        pytest.skip("not divisible")
    torch.manual_seed(SEED)
    full = initialize_sharded_weight(shape, dim, 0, 1, init, stride)
    for world in (2, 3):
        if shape[dim] % (world * stride):
            continue
        parts = []
        for rank in range(world):
            torch.manual_seed(SEED)  # the layer seeds the generator the key is drawn from
            parts.append(initialize_sharded_weight(shape, dim, rank, world, init, stride))
        assert torch.equal(_merge(parts, dim, stride), full)


def test_generator_is_standard_normal_and_independent_across_keys():
    # 2^20 values: the mean's standard error is 1e-3 and the std's 7e-4; bounds at 5 standard errors.
    x = normal_shard(SEED, (1024, 1024), 0, 0, 1).flatten().double()
    y = normal_shard(SEED + 1, (1024, 1024), 0, 0, 1).flatten().double()
    assert abs(x.mean()) < 5e-3 and abs(x.std() - 1) < 3.5e-3
    # Tail mass beyond 3 sigma: 0.0027 expected, binomial standard error 5e-5.
    assert abs((x.abs() > 3).double().mean() - 0.0026998) < 2.5e-4
    assert abs(torch.corrcoef(torch.stack([x, y]))[0, 1]) < 5e-3
    assert abs(torch.corrcoef(torch.stack([x[:-1], x[1:]]))[0, 1]) < 5e-3


def test_initial_model_is_identical_across_layouts(tmp_path):
    from megatron.training.checkpointing.checkpoint import read_checkpoint

    layouts = {"tp1": [], "tp2": ["--tensor-model-parallel-size", "2"], "pp2": ["--pipeline-model-parallel-size", "2"],
               "tp2pp2": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]}

    def task(name, extra, swiglu):
        flags = ["--fp8-opt-level", "none", "--train-iters", "1", *extra] + (["--swiglu"] if swiglu else [])
        return {"name": name, "flags": flags, "init_only": str(tmp_path / name)}

    launch_checkpoint_worker(1, [task("tp1", [], False), task("tp1_swiglu", [], True)], tmp_path)
    launch_checkpoint_worker(2, [task(n, layouts[n], False) for n in ("tp2", "pp2")] + [task("tp2_swiglu", layouts["tp2"], True)],
            tmp_path)
    launch_checkpoint_worker(4, [task("tp2pp2", layouts["tp2pp2"], False)], tmp_path)
    reference = read_checkpoint(tmp_path / "tp1")[1]
    assert len(reference) > 20
    for name in ("tp2", "pp2", "tp2pp2"):
        state = read_checkpoint(tmp_path / name)[1]
        assert sorted(state) == sorted(reference), name
        for key, value in reference.items():
            assert torch.equal(state[key], value), (name, key)
    swiglu = read_checkpoint(tmp_path / "tp1_swiglu")[1]
    assert torch.equal(swiglu["decoder.layers.0.mlp.linear_fc1.weight"][:256],
                       read_checkpoint(tmp_path / "tp2_swiglu")[1]["decoder.layers.0.mlp.linear_fc1.weight"][:256])
    for key, value in read_checkpoint(tmp_path / "tp2_swiglu")[1].items():
        assert torch.equal(swiglu[key], value), key
    # Different layers and different weights do not repeat each other's values.
    w0, w1 = reference["decoder.layers.0.mlp.linear_fc1.weight"], reference["decoder.layers.1.mlp.linear_fc1.weight"]
    assert not torch.equal(w0, w1) and abs(torch.corrcoef(torch.stack([w0.flatten(), w1.flatten()]))[0, 1]) < 0.05
    assert abs(reference["embedding.word_embeddings.weight"].std() - 0.02) < 0.002
