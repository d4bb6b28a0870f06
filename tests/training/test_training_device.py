"""pretrain_gpt.py's training loop on a GPU's terms, checked on CPU.

- Device placement: every tensor the loop's own reductions (loss, gradient norm, O3 clipping) hand to a
  collective lives on the process group's device. On CPU the check uses a process group whose backend
  map knows only the ``meta`` device: a CPU tensor given to it fails exactly as a CPU tensor given to
  NCCL does ("No backend type associated with device type cpu"), and model tensors on ``meta`` pass.
- Host reads: a steady-state training step (forward/backward schedule, gradient finalisation, norm,
  clipping, skip decision, optimizer step) at every opt level, data parallel over 2 gloo ranks, runs
  without a single host read, a step with a non-finite gradient included (skipped on device on both
  ranks); the log-interval flush reads the interval's values in a bounded number of reads that does
  not grow with the number of layers.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from tests.spawn import CachedLaunch, init_gloo_worker

LEVELS = ("none", "O1", "O2", "O3")
FLAGS = ["--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128", "--seq-length", "32",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size", "256",
         "--train-iters", "8", "--eval-interval", "0", "--no-progress", "--fp32"]


def _poisoning(original, state):
    def finalize(chunks, *args, **kwargs):
        original(chunks, *args, **kwargs)
        # After the data-parallel reduction the replicas hold the same gradients: poison every rank, except
        # under O3 (gradients sharded to owners) where one rank's NaN must stop the step on both.
        if state["poison"] and (torch.distributed.get_rank() == 1 or not state["sharded"]):
            grad = next(p.grad for c in chunks for p in c.parameters() if p.grad is not None and p.grad.dim() == 1)
            grad.view(-1)[0] = float("nan")
    return finalize


def _snapshot(chunks):
    out = []
    for c in chunks:
        for p in c.parameters():
            t = p.payload.view(torch.uint8) if hasattr(p, "payload") else p.detach()
            out.append(t.clone())
    return out


def _meta_checks(results: dict) -> None:
    """The loop's reductions with model tensors on ``meta`` and a group that accepts only ``meta``."""
    import torch.distributed as dist

    from fp8.comm import Collectives
    from fp8.optim.sharded import ShardedAdamW
    from megatron.training import training
    from megatron.training.distributed.grads import clip_and_poison_, global_grad_norm

    group = dist.new_group([0, 1], backend="meta:gloo")
    try:
        dist.all_reduce(torch.zeros(1), group=group)
        results["meta_group_refuses_cpu"] = False
    except Exception as error:  # noqa: BLE001
        results["meta_group_refuses_cpu"] = "device type cpu" in str(error)
    meta = torch.device("meta")
    model = torch.nn.Sequential(torch.nn.Linear(16, 16, device=meta), torch.nn.LayerNorm(16, device=meta))
    for p in model.parameters():
        p.grad = torch.empty_like(p)
        p.tensor_model_parallel = p.dim() == 2
    norm = global_grad_norm([model], 0, Collectives(group), True)
    results["norm_device"] = str(norm.device)
    finite = clip_and_poison_([p.grad for p in model.parameters()], norm, 1.0)
    results["finite_device"] = str(finite.device)
    fake_run = types.SimpleNamespace(device=meta, world=Collectives(group))
    losses = [{"lm loss": torch.empty((), device=meta)} for _ in range(3)]
    results["loss_device"] = str(training.TrainingRun.loss_sum_count(fake_run, losses).device)
    results["empty_loss_device"] = str(training.TrainingRun.loss_sum_count(fake_run, []).device)
    # O3's clipping on a rank owning no gradient this step (its partial norm is a zero it creates itself).
    params = [torch.nn.Parameter(torch.empty(8, device=meta)), torch.nn.Parameter(torch.empty(8, device=meta))]
    optimizer = ShardedAdamW(params, lr=1e-3, process_group=group, precision="O1")
    for p in optimizer.owned_params:
        p.grad = None
    results["o3_clip_device"] = str(optimizer.clip_grad_norm_(1.0).device)


def _worker(rank: int, world: int, port: int, seed: int, out_dir: str) -> None:
    import torch.distributed as dist

    from megatron.core import parallel_state
    from megatron.training import training
    from megatron.training.arguments import parse_config
    from tests.training.test_no_host_sync import HostSyncDetector

    init_gloo_worker(rank, world, port)
    results: dict = {"levels": {}}
    state = {"poison": False, "sharded": False}
    training.finalize_model_grads = _poisoning(training.finalize_model_grads, state)
    try:
        for layers in (2, 4):
            for level in LEVELS:
                flags = FLAGS + ["--num-layers", str(layers), "--fp8-opt-level", level, "--seed", str(seed)]
                cfg = parse_config(flags, world_size=world)
                state["sharded"] = level == "O3"
                if parallel_state.model_parallel_is_initialized():
                    parallel_state.destroy_model_parallel()
                training.initialize_distributed(cfg)
                run = training.TrainingRun(cfg, training.Datasets(cfg))
                # Batches are prepared on the host beforehand: data loading is host work, not a device sync.
                source = run.data_iterators(training.Datasets(cfg).train)
                data = iter([next(source) for _ in range(5 * cfg.training.num_microbatches)])
                pending = training.PendingRecords(cfg, run)
                run.train_step(data, 0)  # the first step (lazy state, first scales) outside the detector
                snapshots = []
                with HostSyncDetector() as step_detector:
                    for it in range(1, 5):
                        state["poison"] = it == 2
                        pending.add(it + 1, run.train_step(data, it), {}, 0.0, run.mu())
                        state["poison"] = False
                        snapshots.append(_snapshot(run.bare_chunks))
                with HostSyncDetector() as flush_detector:
                    records = pending.flush()
                results["levels"][(layers, level)] = {
                    "step_hits": step_detector.hits[:3], "flush_hits": flush_detector.hits,
                    "skipped": [r["skipped"] for r in records], "skipped_steps": run.skipped_steps,
                    "losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
                    "skip_kept_params": all(torch.equal(a, b) for a, b in zip(snapshots[0], snapshots[1])),
                    "next_step_trains": not all(torch.equal(a, b) for a, b in zip(snapshots[1], snapshots[2])),
                    "params": [t for t in snapshots[-1]],
                }
        # Pipeline parallel (PP=2, 1F1B, FP8 messages at O2): the step reads nothing either, and a NaN
        # gradient on the last stage only skips the step on both stages (the norm is summed over them).
        results["pp2"] = {}
        for level in ("none", "O2", "O2-interleaved"):
            flags = FLAGS + ["--num-layers", "4", "--fp8-opt-level", level.split("-")[0], "--seed", str(seed),
                             "--pipeline-model-parallel-size", "2"]
            if level.endswith("interleaved"):
                flags += ["--num-layers-per-virtual-pipeline-stage", "1"]
            cfg = parse_config(flags, world_size=world)
            state["sharded"] = True  # poison rank 1 (the last stage) only
            parallel_state.destroy_model_parallel()
            training.initialize_distributed(cfg)
            run = training.TrainingRun(cfg, training.Datasets(cfg))
            source = run.data_iterators(training.Datasets(cfg).train)
            data = ([iter([next(src) for _ in range(5 * cfg.training.num_microbatches)]) for src in source]
                    if isinstance(source, list) else iter([next(source) for _ in range(5 * cfg.training.num_microbatches)]))
            run.train_step(data, 0)
            with HostSyncDetector() as step_detector:
                skipped = []
                for it in range(1, 5):
                    state["poison"] = it == 2
                    skipped.append(run.train_step(data, it)["skipped"])
                    state["poison"] = False
            results["pp2"][level] = {"step_hits": step_detector.hits[:3], "skipped": [bool(x) for x in skipped],
                                     "overlapped": run.schedule_kwargs["p2p_communicator"].overlapped_calls}
        _meta_checks(results)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


_launch = CachedLaunch(_worker, "training_device")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _launch(2, 1234, tmp_path_factory)[1]


@pytest.mark.parametrize("level", LEVELS)
def test_training_step_reads_nothing_to_the_host(results, level):
    for rank, out in enumerate(results):
        for layers in (2, 4):
            r = out["levels"][(layers, level)]
            assert not r["step_hits"], f"rank {rank}, {layers} layers: host reads in the step:\n" + "\n".join(r["step_hits"])


@pytest.mark.parametrize("level", LEVELS)
def test_flush_reads_do_not_grow_with_layers(results, level):
    for out in results:
        small, large = out["levels"][(2, level)]["flush_hits"], out["levels"][(4, level)]["flush_hits"]
        assert len(small) == len(large), (len(small), len(large))
        # One batched read of the interval's values; the rest is inside the one object all-gather of the
        # host-side byte counters (fp8.comm's size exchange and unpickling of the gathered bytes).
        values_reads = [h for h in small if "in flush" in h and "in all_gather_object" not in h]
        assert len(values_reads) == 1 and values_reads[0].startswith("Tensor.tolist"), values_reads
        assert all("in all_gather_object" in h for h in small if h not in values_reads)


@pytest.mark.parametrize("level", LEVELS)
def test_non_finite_gradient_skips_the_step_on_device_on_every_rank(results, level):
    for layers in (2, 4):
        per_rank = [out["levels"][(layers, level)] for out in results]
        for r in per_rank:
            assert r["skipped"] == [False, True, False, False]
            assert r["skipped_steps"] == 1
            assert r["skip_kept_params"] and r["next_step_trains"]
            assert all(v == v for v in r["losses"])  # the loss stays finite: the step, not the data, was bad
        for a, b in zip(per_rank[0]["params"], per_rank[1]["params"]):
            assert torch.equal(a, b)  # data-parallel replicas stay identical
        assert per_rank[0]["losses"] == per_rank[1]["losses"]
        assert list(map(repr, per_rank[0]["norms"])) == list(map(repr, per_rank[1]["norms"]))  # nan == nan here
        assert per_rank[0]["norms"][1] != per_rank[0]["norms"][1]  # the poisoned step's norm is NaN


def test_reductions_hand_collectives_tensors_on_the_groups_device(results):
    for out in results:
        assert out["meta_group_refuses_cpu"]  # the check can fail: a CPU tensor is refused by this group
        for key in ("norm_device", "finite_device", "loss_device", "empty_loss_device", "o3_clip_device"):
            assert out[key] == "meta", key


@pytest.mark.parametrize("level", ["none", "O2", "O2-interleaved"])
def test_pipeline_parallel_step_reads_nothing_and_skips_on_every_stage(results, level):
    for rank, out in enumerate(results):
        r = out["pp2"][level]
        assert not r["step_hits"], f"stage {rank}: host reads in the step:\n" + "\n".join(r["step_hits"])
        assert r["skipped"] == [False, True, False, False]
        # The interleaved schedule overlaps its pipeline messages (asynchronous requests); 1F1B waits at once.
        assert (r["overlapped"] > 0) == level.endswith("interleaved"), r["overlapped"]
