"""Worker of the checkpoint tests: runs a list of tasks (train a tiny GPT on mock data, optionally
saving, loading, or being killed in the middle of a save) in one launch; writes each rank's losses or
the error each task stopped with.

    python tests/checkpoint_worker.py --out DIR --seed S --tasks '[{"name": "a", "flags": [...]}]'
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402

from megatron.core import parallel_state  # noqa: E402
from megatron.training import training  # noqa: E402
from megatron.training.arguments import parse_args, parse_config  # noqa: E402
from megatron.training.monitoring.log import TrainingLogger  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "16", "--mock-data",
         "--vocab-size", "512", "--eval-interval", "1000", "--eval-iters", "1", "--no-progress",
         "--lr", "3e-3", "--lr-warmup-iters", "0", "--lr-decay-iters", "8"]


def run_task(task: dict, seed: int, out: str) -> None:
    flags = MODEL + ["--seed", str(seed)] + task["flags"]
    cfg = parse_config(flags)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    training.initialize_distributed(cfg)
    if task.get("kill_in_save"):  # die while the checkpoint's files are being written
        import torch.distributed.checkpoint as dcp

        writer_finish = dcp.FileSystemWriter.finish
        count = {"n": 0}

        def finish(self, *a, **k):
            count["n"] += 1
            if count["n"] == task["kill_in_save"]:
                os.kill(os.getpid(), signal.SIGKILL)
            return writer_finish(self, *a, **k)

        dcp.FileSystemWriter.finish = finish
    result: dict = {"name": task["name"]}
    if task.get("init_only"):  # build the model and save it untrained (iteration 0), or as loaded (--load)
        from megatron.training.checkpointing.checkpoint import load_checkpoint, save_checkpoint

        run = training.TrainingRun(cfg, training.Datasets(cfg))
        iteration = load_checkpoint(cfg.checkpoint.load, run, cfg.checkpoint.ckpt_step) if cfg.checkpoint.load else 0
        save_checkpoint(task["init_only"], run, iteration)
        with open(os.path.join(out, f"{task['name']}_rank{dist.get_rank()}.json"), "w") as f:
            json.dump(result, f)
        return
    if task.get("export_eval"):  # load an exported state dict (safetensors) strictly, evaluate one global batch
        import torch
        from safetensors.torch import load_file

        datasets = training.Datasets(cfg)
        run = training.TrainingRun(cfg, datasets)
        (chunk,) = run.bare_chunks
        state = load_file(task["export_eval"])
        own = chunk.state_dict()
        result["extra_keys"] = sorted(set(own) - set(state))
        chunk.load_state_dict({**{k: v for k, v in own.items() if k not in state}, **state}, strict=True)
        result["missing_in_model"] = sorted(set(state) - set(own))
        data = run.data_iterators(datasets.train, consumed=task["consumed"])
        with torch.no_grad():
            losses = run.forward_backward(forward_step_func=training.gpt_forward_step, data_iterator=data,
                                          model=run._model_arg(), num_microbatches=cfg.training.num_microbatches,
                                          seq_length=cfg.model.seq_length, micro_batch_size=cfg.training.micro_batch_size,
                                          forward_only=True)
        result["eval_loss"] = float(run._mean(run.loss_sum_count(losses)))
        with open(os.path.join(out, f"{task['name']}_rank{dist.get_rank()}.json"), "w") as f:
            json.dump(result, f)
        return
    try:
        datasets = training.Datasets(cfg)
        logger = TrainingLogger(cfg, rank=dist.get_rank(), is_logging_rank=False)
        history = training.train_level(cfg, datasets, logger)
        result["iterations"] = [r["iteration"] for r in history["train"]]
        result["losses"] = [r["loss"] for r in history["train"]]
        result["stopped"] = history.get("stopped")
    except Exception as error:  # noqa: BLE001 - the tests read the message
        result["error"] = f"{type(error).__name__}: {error}"
    with open(os.path.join(out, f"{task['name']}_rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--tasks", required=True)
    a = p.parse_args()
    for task in json.loads(a.tasks):
        run_task(task, a.seed, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
