"""Worker of tests/training/test_host_sync_layouts.py: pretrain_gpt.py's training set-up (``TrainingRun``, megatron-core's
schedules) for several parallel layouts in one launch, the steady-state iterations under
:class:`tests.training.test_no_host_sync.HostSyncDetector`. Each configuration writes ``OUT/<name>_rank<R>.json``: every hit
(what, kind, site, origin, the first lines of its stack), the iterations and micro-batches watched, the MoE layers.

    torchrun --nproc_per_node 2 tests/host_sync_worker.py --out DIR --configs '[{"name": ..., "flags": [...]}]'

Per configuration: ``warmup`` iterations outside the detector (first-step scaling, the delayed-scaling histories
and their probes, lazily built optimizer states), then ``iterations`` under it, each the per-iteration body of
``training.train_iterations`` (the step, the records kept on the device, the exit check), then the log point's
flush under a second detector (``flush_hits``: one batched read per log interval, and the log gathering). The batches are drawn from the data
pipeline beforehand (data loading is host work) and declared pinned host data: on a GPU ``gpt_forward_step`` pins
them and copies them without blocking (``pin_memory()`` needs CUDA, so the worker names them). megatron-core's
all-to-all dispatcher builds its chunk-sorting indices on the host (``permute_idx_device == "cpu"`` without
permute fusion); they are declared host data too. With ``"canary": true`` one more iteration reads each
micro-batch's loss on the host under a second detector (its hits written as ``canary_hits``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.spawn import megatron_run  # noqa: E402
from tests.training.test_no_host_sync import HostSyncDetector  # noqa: E402


def _host_tensors(chunks) -> list[torch.Tensor]:
    """Tensors megatron-core keeps on the host: the all-to-all dispatcher's chunk-sorting indices."""
    out = []
    for chunk in chunks:
        for module in chunk.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is not None and getattr(dispatcher, "permute_idx_device", None) == "cpu":
                out += [dispatcher.sort_input_by_local_experts, dispatcher.restore_output_by_local_experts]
    return out


def _moe_layers(chunks) -> int:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return sum(isinstance(m, MoELayer) for c in chunks for m in c.modules())


def _hit(h) -> dict:
    return {"what": h.what, "kind": h.kind, "site": h.site, "origin": h.origin, "text": str(h)[:3000]}


def _canary_hits(run, data, it: int) -> list:
    """One more iteration whose loss function reads the loss on the host (a planted sync per micro-batch on the
    last pipeline stage): the hits the detector records there, proving it sees inside megatron-core's schedule."""
    from megatron.training import training

    loss_func = training.loss_func

    def reading_loss_func(loss_mask, output_tensor):
        loss, reported = loss_func(loss_mask, output_tensor)
        bool(torch.isfinite(loss))  # the planted host read
        return loss, reported

    training.loss_func = reading_loss_func
    try:
        with HostSyncDetector() as detector:
            run.train_step(data, it)
    finally:
        training.loss_func = loss_func
    return detector.hits


def run_config(config: dict, out: str) -> None:
    from megatron.training import training
    from megatron.training.exit import ExitPolicy

    cfg, run, datasets = megatron_run(config["flags"], int(os.environ["WORLD_SIZE"]))
    warmup, iterations = config.get("warmup", 3), config.get("iterations", 2)
    source = run.data_iterators(datasets.train)
    sources = source if isinstance(source, list) else [source]
    total = warmup + iterations + (1 if config.get("canary") else 0)
    batches = [[next(s) for _ in range(total * cfg.training.num_microbatches)] for s in sources]
    data = [iter(b) for b in batches]
    data = data if isinstance(source, list) else data[0]
    pending, sent = training.PendingRecords(cfg, run), training.BytesSince(run.counter)
    exit_policy = ExitPolicy(cfg.checkpoint, run.device, run.world)

    def iteration(it: int) -> dict:  # the per-iteration body of training.train_iterations, up to its log point
        if run.numerics is not None:
            run.numerics.begin_step(it + 1)
        step = run.train_step(data, it)
        pending.add(it + 1, step, *sent.take(), run.mu())
        exit_policy.reason(it + 1)
        return step

    for it in range(warmup):
        iteration(it)
    pending.flush()
    pinned = [t for b in batches for batch in b for t in batch.values() if isinstance(t, torch.Tensor)]
    with HostSyncDetector(host_tensors=_host_tensors(run.bare_chunks), pinned_tensors=pinned) as detector:
        for it in range(warmup, warmup + iterations):
            iteration(it)
    with HostSyncDetector() as flush_detector:  # the log point: one batched read of the interval's values
        records = pending.flush()
    finite = all(math.isfinite(r["loss"]) for r in records)
    canary = []
    if config.get("canary"):
        canary = _canary_hits(run, data, warmup + iterations)
    result = {
        "hits": [_hit(h) for h in detector.hits], "known_hits": [_hit(h) for h in detector.known_hits],
        "flush_hits": [_hit(h) for h in flush_detector.hits],
        "canary_hits": [_hit(h) for h in canary],
        "iterations": iterations, "microbatches": cfg.training.num_microbatches, "moe_layers": _moe_layers(run.bare_chunks),
        "finite_loss": finite, "rank": dist.get_rank(),
    }
    with open(os.path.join(out, f"{config['name']}_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--configs", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    for config in json.loads(a.configs):
        run_config(config, a.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
