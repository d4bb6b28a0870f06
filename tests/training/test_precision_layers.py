"""``--first-last-layers-bf16 --num-layers-at-start-in-bf16 N --num-layers-at-end-in-bf16 M`` (Megatron's names):
the first N and last M transformer layers, by global layer number, keep their linears out of FP8 at any TP/PP
layout, and the start-up summary names them with the reason.

A 4-layer GPT trained for 3 iterations (``tests/megatron_worker.py``) in one process and at TP2 x PP2 (4
processes, 2 layers per stage); the layers kept are read from each rank's FP8 selection, and the losses of the two
layouts agree as in tests/training/test_megatron_parallel.py (5e-3 relative at the FP8 levels).
"""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import pytest

from megatron.training.arguments import ConfigurationError, parse_config
from megatron.training.model import kept_layers
from tests.spawn import run_worker

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "megatron_worker.py"
SEED = int(os.environ.get("FP8LM_TEST_SEED", random.SystemRandom().randrange(2**31))) % 100_000
KEEP = ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "1", "--num-layers-at-end-in-bf16", "2",
        "--fp8-min-dim", "0"]
LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("precision_layers")
    run_worker(WORKER, 1, ["--out", str(out), "--seed", str(SEED), "--configs",
                           json.dumps([{"name": "single", "levels": ["O2"], "flags": KEEP}])], SEED)
    run_worker(WORKER, 4, ["--out", str(out), "--seed", str(SEED), "--configs",
                           json.dumps([{"name": "tp2pp2", "tp": 2, "pp": 2, "levels": ["O2"], "flags": KEEP}])], SEED)

    def load(name: str) -> list[dict]:
        files = sorted(out.glob(f"{name}_O2_rank*.json"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
        return [json.loads(p.read_text()) for p in files]

    return load


def _kept_layers(names: list[str]) -> dict[int, set[str]]:
    """Global layer number (1-based) -> the linears of it kept out of FP8, from the names the FP8 selection reports:
    the single-process model's (``decoder.layers.<global index>``) on every pipeline stage."""
    out: dict[int, set[str]] = {}
    for name in names:
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
        if m:
            out.setdefault(1 + int(m.group(1)), set()).add(m.group(2))
    return out


def test_one_process_keeps_the_first_and_last_layers(results):
    (single,) = results("single")
    assert _kept_layers(single["high_precision_linears"]) == {1: set(LINEARS), 3: set(LINEARS), 4: set(LINEARS)}
    assert single["fp8_weights"] == 4  # layer 2's four linears


def test_tp2_pp2_keeps_the_same_global_layers_and_matches_one_process(results):
    ranks = results("tp2pp2")
    assert len(ranks) == 4
    kept: dict[int, set[str]] = {}
    for r in ranks:
        assert r["tp_rank"] in (0, 1) and r["pp_rank"] in (0, 1)
        layers = _kept_layers(r["high_precision_linears"])
        assert set(layers) <= ({1, 2} if r["pp_rank"] == 0 else {3, 4}), (r["pp_rank"], layers)  # 2 layers per stage
        for layer, linears in layers.items():
            assert linears == set(LINEARS), (r["pp_rank"], layer, linears)
            kept.setdefault(layer, set()).update(linears)
        # stage 0 holds layers 1 (kept) and 2 (FP8); stage 1 layers 3 and 4 (both kept)
        assert r["fp8_weights"] == (4 if r["pp_rank"] == 0 else 0)
    assert sorted(kept) == [1, 3, 4]
    reference = results("single")[0]["losses"]
    for got, want in zip(ranks[0]["losses"], reference):
        assert abs(got - want) <= 5e-3 * abs(want), (ranks[0]["losses"], reference, SEED)


def _args(flags: list[str]):
    base = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--mock-data", "--vocab-size",
            "128"]
    return parse_config(base + flags, world_size=1)


def test_layer_numbers_and_refusals():
    assert kept_layers(_args([])) == frozenset()
    assert kept_layers(_args(["--first-last-layers-bf16"])) == {1, 4}  # Megatron's defaults: 1 and 1
    assert kept_layers(_args(["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "0",
                                        "--num-layers-at-end-in-bf16", "3"])) == {2, 3, 4}
    with pytest.raises(ConfigurationError, match="leave none of the 4 layers in FP8"):
        _args(["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "2"])
    with pytest.raises(ConfigurationError, match="must be >= 0"):
        _args(["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "-1"])
