"""Worker of the Megatron GPT tests: trains a tiny GPT (mock data) for several parallel layouts and opt
levels in one launch and writes each rank's per-iteration losses, gradient norms and bytes sent.

Run under ``torchrun`` (or plain ``python`` for the single-process reference)::

    python tests/megatron_worker.py --out DIR --seed S --configs '[{"name": "tp2", "tp": 2, "levels": ["none"]}]'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402

from megatron.core import parallel_state  # noqa: E402
from megatron.training import training  # noqa: E402
from megatron.training.arguments import baseline_argv, parse_args, parse_config  # noqa: E402
from megatron.training.monitoring.log import TrainingLogger  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
         "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "16", "--mock-data",
         "--vocab-size", "512", "--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1", "--no-progress",
         "--lr", "3e-3", "--lr-warmup-iters", "0"]


def run_config(config: dict, level: str, seed: int, out: str) -> None:
    flags = MODEL + ["--seed", str(seed), "--fp8-opt-level", level,
                     "--tensor-model-parallel-size", str(config.get("tp", 1)),
                     "--pipeline-model-parallel-size", str(config.get("pp", 1))]
    if config.get("sp"):
        flags.append("--sequence-parallel")
    if config.get("bf16"):
        flags.append("--bf16")
    if config.get("distopt"):
        flags.append("--use-distributed-optimizer")
    if config.get("vp"):
        flags += ["--num-layers-per-virtual-pipeline-stage", str(config["vp"])]
    flags += config.get("flags", [])  # any other pretrain_gpt.py flags (e.g. the MoE ones)
    if level == "none":  # the config's FP8-only flags have no effect at the baseline, which refuses them
        flags = baseline_argv(flags)
    cfg = parse_config(flags)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    training.initialize_distributed(cfg)
    datasets = training.Datasets(cfg)
    logger = TrainingLogger(cfg, rank=dist.get_rank(), is_logging_rank=False)
    history = training.train_level(cfg, datasets, logger)
    rank = dist.get_rank()
    result = {
        "losses": [r["loss"] for r in history["train"]],
        "grad_norms": [r["grad_norm"] for r in history["train"]],
        "val_loss": history["valid"][-1]["val_loss"],
        "comm_bytes": history["train"][-1]["comm_bytes"],
        "comm_calls": None,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
        "dp_rank": parallel_state.get_data_parallel_rank(),
        "fp8_weights": history["summary"]["fp8_weights"],
        "high_precision_linears": history["summary"]["high_precision_linears"],
    }
    with open(os.path.join(out, f"{config['name']}_{level}_rank{rank}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--configs", required=True)
    a = p.parse_args()
    for config in json.loads(a.configs):
        for level in config["levels"]:
            run_config(config, level, a.seed, a.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
