"""Tied embeddings under a sharded optimizer (O3, --use-distributed-optimizer) with pipeline and data parallelism.

At PP2 x DP2 the first stage's word embedding and the last stage's output weight (two copies of one tied weight)
may have different owners on their stages. Their gradients are summed over megatron-core's embedding group before
the data-parallel reduction to the owner (outside DDP's buckets), so both owners step the same gradient. Checked
on 4 gloo ranks against the single-process run: the losses (the bounds of tests/training/test_megatron_parallel.py for
fp32, of tests/training/test_bf16.py for --bf16), the two copies bit-identical after every step, and the embedding-group sum
counted like every collective.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.spawn import CachedLaunch, init_gloo_worker, megatron_run

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size", "128",
         "--no-progress", "--train-iters", "3", "--eval-interval", "0", "--lr", "3e-3", "--lr-warmup-iters", "0"]
CASES = {
    "O3": ["--fp32", "--fp8-opt-level", "O3"],
    "none-distopt": ["--fp32", "--fp8-opt-level", "none", "--use-distributed-optimizer"],
    "bf16-none-distopt": ["--bf16", "--fp8-opt-level", "none", "--use-distributed-optimizer"],
}
BOUNDS = {"O3": 5e-3, "none-distopt": 2e-5, "bf16-none-distopt": 5e-3}  # relative (fp32), absolute (bf16)


def _worker(rank: int, world: int, port: int, seed: int, out_dir: str) -> None:
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.training.distributed.grads import tied_embedding_weights

    init_gloo_worker(rank, world, port)
    layout = ["--pipeline-model-parallel-size", "2"] if world == 4 else []
    results = {}
    try:
        for name, extra in CASES.items():
            cfg, run, datasets = megatron_run(FLAGS + extra + layout + ["--seed", str(seed)], world)
            data = run.data_iterators(datasets.train)
            weights = tied_embedding_weights(run.bare_chunks)
            losses, identical = [], []
            for it in range(cfg.training.train_iters):
                losses.append(float(run.train_step(data, it)["loss"]))
                if world > 1:
                    group = parallel_state.get_embedding_group()
                    (weight,) = weights
                    copies = [torch.empty_like(weight) for _ in range(dist.get_world_size(group))]
                    dist.all_gather(copies, weight.detach().contiguous(), group=group)
                    identical.append(all(torch.equal(c.view(torch.uint8), copies[0].view(torch.uint8))
                                         for c in copies))
            results[name] = {"losses": losses, "identical": identical, "tied_in_ddp": any(
                id(w) in getattr(c, "_bucket_of", {}) for c in run.chunks for w in weights),
                "calls": dict(run.counter.calls), "n_tied": len(weights)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


_launch = CachedLaunch(_worker, "tied_sharded")
SEED = 1234


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return _launch(1, SEED, tmp_path_factory)[1][0], _launch(4, SEED, tmp_path_factory)[1]


@pytest.mark.parametrize("case", sorted(CASES))
def test_losses_match_single_process(runs, case):
    single, ranks = runs
    ref = single[case]["losses"]
    for r in ranks:
        assert r[case]["losses"] == ranks[0][case]["losses"]
    got = ranks[0][case]["losses"]
    bound = BOUNDS[case]
    for it, (g, w) in enumerate(zip(got, ref)):
        err = abs(g - w) if case.startswith("bf16") else abs(g - w) / abs(w)
        assert err <= bound, f"{case} iteration {it + 1}: {g} vs single-process {w}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_tied_copies_identical_after_every_step(runs, case):
    _, ranks = runs
    for rank, r in enumerate(ranks):
        assert r[case]["n_tied"] == 1, rank  # PP2: every rank holds one copy
        assert r[case]["identical"] == [True] * len(r[case]["losses"]), (rank, r[case]["identical"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_tied_sum_over_the_embedding_group_is_counted_outside_ddp(runs, case):
    _, ranks = runs
    for r in ranks:
        assert not r[case]["tied_in_ddp"]
        assert r[case]["calls"].get("tied embedding grads", 0) == len(r[case]["losses"])
