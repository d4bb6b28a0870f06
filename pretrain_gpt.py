#!/usr/bin/env python3
"""Pretrain a GPT with megatron-core in FP8 (fp8lm).

With no arguments it runs the embedded default: a small GPT trained on the public-domain Shakespeare
corpus on CPU, the FP8 O2 level beside the baseline, ending with a side-by-side summary and a loss-curve
PNG. With Megatron-style flags it trains the configuration given, under ``torchrun`` for tensor,
sequence, pipeline and data parallelism (``--help`` lists the flags).
"""

from __future__ import annotations

import sys
import time
import warnings

from megatron.training.arguments import ConfigurationError, config_from_args, parse_args, validate_args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # megatron-core warns at import about optional accelerators (Apex, Transformer Engine) we do not use.
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"megatron\.core.*")
    args = parse_args(argv)
    args.start_time = time.time()  # --exit-duration-in-mins counts from here
    if args.demo:  # the embedded default run's outputs: JSON log, loss curves and TensorBoard files side by side
        args.log_json = args.log_json or "runs/demo/log.jsonl"
        args.tensorboard_dir = args.tensorboard_dir or "runs/demo/tensorboard"
    try:
        config = config_from_args(validate_args(args))
    except ConfigurationError as error:
        print(f"pretrain_gpt.py: configuration error: {error}", file=sys.stderr)
        return 2
    if config.dry_run:
        from megatron.training.planning.dry_run import dry_run

        dry_run(config)
        return 0
    from fp8.checkpoint import CheckpointCorruptedError
    from megatron.training.checkpointing.checkpoint import CheckpointMismatchError
    from megatron.training.compat.core_trace import CollectiveTraceError
    from megatron.training.data.datasets import DataError
    from megatron.training.monitoring.health import RunHealthError
    from megatron.training.training import pretrain

    try:
        pretrain(config)
    except (FileNotFoundError, ConfigurationError, DataError, CheckpointMismatchError, CheckpointCorruptedError,
            RunHealthError, CollectiveTraceError) as error:
        print(f"pretrain_gpt.py: {error}", file=sys.stderr)
        return 1 if isinstance(error, (RunHealthError, CollectiveTraceError)) else 2  # the run failed / bad input
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
