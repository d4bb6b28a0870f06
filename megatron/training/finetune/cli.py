"""The command line both fine-tuning scripts share (``examples/finetune/sft.py``, ``dpo.py``): flags, their checks, and the one-line exit on bad input."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .data import DataError
from .runtime import setup_runtime

__all__ = ['DEFAULT_MAX_LENGTH', 'build_parser', 'check_args', 'die', 'run_main']


DEFAULT_MAX_LENGTH = 256


def build_parser(description: str, *, task: str) -> argparse.ArgumentParser:
    """The flags both scripts share (``task``: ``"sft"`` or ``"dpo"``, for the help texts)."""
    keys = "prompt/response" if task == "sft" else "prompt/chosen/rejected"
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help="a transformers causal-LM directory with its tokenizer (default: the demo base model, "
                        "a small Llama pretrained on the demo corpus, built and cached on first use)")
    p.add_argument("--data", type=Path, default=None, metavar="FILE.jsonl",
                   help=f"JSONL, one object per line with string fields {keys} (default: the demo task)")
    p.add_argument("--fp8-opt-level", default="none", choices=["none", "O1", "O2", "O3"],
                   help="fp8.initialize opt level (none: the high-precision baseline)")
    p.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise", "blockwise"],
                   help="granularity of the FP8 scales (fp8.initialize(..., recipe=))")
    p.add_argument("--fp8-grad-accumulation", default="fp16", choices=["fp16", "fp32", "fp8"],
                   help="how FP8 weights' gradients are held (Float8LinearConfig.grad_accumulation): fp16 (a scaled "
                        "FP16 buffer, 2 bytes/element, default), fp32 (4 bytes) or fp8 (1 byte; fine with one "
                        "micro-batch per step)")
    p.add_argument("--fp8-embeddings", action=argparse.BooleanOptionalAction, default=True,
                   help="at the FP8 levels, untied embedding tables in FP8 too (E4M3 rows, trained like FP8 weights: "
                        "fp8.initialize(..., fp8_embeddings=True)); --no-fp8-embeddings keeps them in high precision")
    p.add_argument("--fp8-min-dim", type=int, default=None,
                   help="linears with min(in, out) below it stay in high precision (fp8.initialize/fp8.freeze "
                        "min_fp8_dim; default: 2048 on CUDA, where smaller GEMMs gain nothing from FP8, 0 on CPU)")
    p.add_argument("--max-steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW; linear warm-up then cosine)")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clip (0: off)")
    p.add_argument("--batch-size", type=int, default=8, help="examples per step (global, split over ranks)")
    p.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH,
                   help="tokens per example (prompt + response); longer ones are truncated and counted")
    p.add_argument("--eval-examples", type=int, default=64,
                   help="held-out examples evaluated at the end (with --data: the file's last lines, at most a "
                        "fifth of it; 0: no evaluation)")
    p.add_argument("--demo-examples", type=int, default=2000, help="demo task: training examples built")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, metavar="DIR",
                   help="write the fine-tuned model (BF16, from the master weights) and tokenizer here")
    p.add_argument("--output-format", default="bf16", choices=["bf16", "compressed-tensors", "fp8-block"],
                   help="--output's format: bf16 (transformers, from the masters) or an FP8 serving format with the "
                        "FP8 weights as trained (fp8.export_fp8, docs/serving.md; FP8 opt levels). --model may also "
                        "be such an FP8 checkpoint: its E4M3 weights are taken as stored")
    p.add_argument("--log-json", type=Path, default=None, metavar="FILE",
                   help="JSON lines: one object per step, then the evaluation and summary objects")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return p


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("max_steps", "batch_size", "max_length"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.max_length < 8:
        parser.error(f"--max-length must be at least 8 tokens, got {args.max_length}")
    if not args.lr > 0:
        parser.error(f"--lr must be positive, got {args.lr}")
    if args.eval_examples < 0:
        parser.error(f"--eval-examples must be >= 0, got {args.eval_examples}")
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; pass a transformers model directory "
                     f"(save_pretrained output with its tokenizer)")
    if args.output_format != "bf16" and (args.fp8_opt_level == "none" or args.output is None):
        parser.error(f"--output-format {args.output_format} writes the FP8 weights as trained: it needs --output DIR "
                     "and an FP8 --fp8-opt-level (O1, O2 or O3); at none write --output-format bf16")
    if args.data is not None and not args.data.is_file():
        parser.error(f"--data {args.data}: no such file")
    from megatron.training.monitoring.output_paths import output_path_problem  # the check pretrain_gpt.py makes

    for flag, path, is_dir in (("--output", args.output, True), ("--log-json", args.log_json, False)):
        if (problem := output_path_problem(path, directory=is_dir)) is not None:
            parser.error(f"{flag} {path}: {problem}")


def die(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def run_main(args: argparse.Namespace, run) -> int:
    """``run(args, rt)`` on the runtime ``args`` ask for; bad data or flags found on the way: one line, exit 2."""
    from megatron.training.data.corpus import MissingCorpusError

    try:
        rt = setup_runtime(args)
        return run(args, rt)
    except DataError as e:
        die(str(e))
    except MissingCorpusError as e:  # the demo task and the demo base model are built from the corpus
        die(str(e.with_alternative("pass --data FILE.jsonl (your examples) and --model DIR (a transformers "
                                   "causal-LM directory with its tokenizer) to fine-tune without the demo corpus")))
    return 0
