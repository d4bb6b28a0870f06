"""Host syncs of pretrain_gpt.py's training loop, counted per layout (the detector of tests/training/test_no_host_sync.py).

One launch of 2 gloo processes (tests/host_sync_worker.py) builds ``TrainingRun`` (megatron-core's schedules, fp8lm's
FP8 layers, data-parallel wrappers, optimizers) for each layout, trains 3 iterations (first-step scaling; the
delayed-scaling histories and their probes settle after 2 optimizer steps), then watches 2 iterations:

- dense, 0 host syncs: TP2 + sequence parallelism at O2, PP2 (1F1B, FP8 pipeline messages) at O2, DP2 at O3 (FP8
  reduce-to-owner, sharded step, weight all-gather);
- MoE, expert parallelism 2 (megatron-core's all-to-all dispatcher, ``--moe-grouped-gemm``: FP8GroupedMLP) at O2,
  and at O3 with the tokens dispatched in FP8: exactly 1 per MoE layer and micro-batch, megatron-core's own wait for
  its host copy of the per-expert token counts (``token_dispatcher.py``, ``_maybe_dtoh_and_synchronize``: the
  event's ``synchronize()``; an all-to-all with uneven splits needs the counts on the host).

The syncs ``KNOWN_SYNCS`` of tests/training/test_no_host_sync.py lists (a GPU-only branch, other tests' scaffolding) are
counted apart and printed with the rest (``pytest -s`` or ``-rP``). A planted host read of the loss (PP2, one more iteration) must be caught once per
micro-batch on the last stage: the detector sees inside megatron-core's schedules.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest

from tests.spawn import run_worker

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "host_sync_worker.py"
SEED = 5
MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size",
         "256", "--no-progress", "--lr", "3e-3", "--lr-warmup-iters", "0", "--seed", str(SEED), "--train-iters", "10",
         "--eval-interval", "0"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", "--moe-token-dispatcher-type",
       "alltoall", "--expert-model-parallel-size", "2", "--moe-grouped-gemm"]
DENSE = {
    "tp2-sp-o2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--fp8-opt-level", "O2"],
    "pp2-o2": ["--pipeline-model-parallel-size", "2", "--fp8-opt-level", "O2"],
    "dp2-o3": ["--fp8-opt-level", "O3"],
}
MOE_LAYOUTS = {
    "ep2-moe-o2": MOE + ["--fp8-opt-level", "O2"],
    "ep2-moe-o3-fp8-dispatch": MOE + ["--fp8-opt-level", "O3", "--moe-fp8-dispatch"],
}
CANARY = "pp2-o2"
DISPATCHER_WAIT = ("megatron/core/transformer/moe/token_dispatcher.py:_maybe_dtoh_and_synchronize",
                   "stream/event synchronization")
"""megatron-core's all-to-all dispatcher waiting for its host copy of the split sizes and token counts."""


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("host_sync")
    configs = [{"name": name, "flags": MODEL + flags, "canary": name == CANARY}
               for name, flags in {**DENSE, **MOE_LAYOUTS}.items()]
    run_worker(WORKER, 2, ["--out", str(out), "--configs", json.dumps(configs)], SEED)
    runs = {name: [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in range(2)]
            for name in {**DENSE, **MOE_LAYOUTS}}
    print("\n" + report(runs))
    return runs


def _listing(hits: list[dict], full: int = 2) -> str:
    counts = collections.Counter(f"{h['site']}: {h['what']} ({h['kind']})" for h in hits)
    lines = [f"  {n} x {name}" for name, n in counts.most_common()]
    return "\n".join(lines + [h["text"] for h in hits[:full]])


def report(runs: dict) -> str:
    """Per layout and rank: host syncs per micro-batch, each named, and the FP8 core's known ones apart."""
    lines = []
    for name, ranks in runs.items():
        for r in ranks:
            per = r["iterations"] * r["microbatches"]
            lines.append(f"{name} rank {r['rank']}: {len(r['hits']) / per:g} host syncs per micro-batch "
                         f"({len(r['hits'])} in {r['iterations']} iterations x {r['microbatches']} micro-batches, "
                         f"{r['moe_layers']} MoE layers); known (KNOWN_SYNCS): {len(r['known_hits']) / r['iterations']:g} "
                         f"per iteration; the log point's flush: {len(r['flush_hits'])}")
            for label, hits in (("", r["hits"]), ("known: ", r["known_hits"]), ("flush: ", r["flush_hits"])):
                counts = collections.Counter(f"{h['site']}: {h['what']} ({h['kind']})" for h in hits)
                lines += [f"    {label}{n} x {site}" for site, n in counts.most_common()]
    return "\n".join(lines)


@pytest.mark.parametrize("layout", list(DENSE))
def test_dense_layouts_do_not_sync(results, layout):
    for r in results[layout]:
        assert r["finite_loss"]
        assert not r["hits"], (f"{layout} rank {r['rank']}: {len(r['hits'])} host syncs in {r['iterations']} "
                               f"iterations x {r['microbatches']} micro-batches:\n{_listing(r['hits'])}")


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_layouts_sync_once_per_moe_layer_in_megatron_core(results, layout):
    for r in results[layout]:
        assert r["finite_loss"] and r["moe_layers"] == 4
        others = [h for h in r["hits"] if (h["origin"], h["kind"]) != DISPATCHER_WAIT]
        assert not others, f"{layout} rank {r['rank']}: host syncs besides megatron-core's:\n{_listing(others)}"
        expected = r["moe_layers"] * r["iterations"] * r["microbatches"]
        assert len(r["hits"]) == expected, (
            f"{layout} rank {r['rank']}: {len(r['hits'])} waits of megatron-core's dispatcher, expected one per MoE "
            f"layer and micro-batch ({expected}):\n{_listing(r['hits'])}")


def test_the_detector_sees_inside_the_schedule(results):
    """The planted read of the loss is caught once per micro-batch, on the last pipeline stage only."""
    first, last = results[CANARY]
    assert not first["canary_hits"]
    assert len(last["canary_hits"]) == last["microbatches"], _listing(last["canary_hits"])
    assert all(h["what"] == "Tensor.__bool__" and "host_sync_worker.py" in h["site"] for h in last["canary_hits"])
