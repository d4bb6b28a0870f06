"""The steps both scripts run around their own loss: the task loaded, the optimizer and scheduler set up, one optimizer step, the non-finite stop and the finish."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

import torch

from .data import load_jsonl, split_heldout
from .demo import demo_rows, resolve_model
from .export import save_bf16
from .runtime import JsonLog, Runtime, clip, fp8_setup, load_model, lr_lambda, serving_checkpoint, teardown

__all__ = ['load_task', 'training_setup', 'optimizer_step', 'nonfinite', 'finish']


def load_task(args: argparse.Namespace, rt: Runtime, task: str, keys: Sequence[str]):
    """``(train_rows, eval_rows, model_dir, model, tokenizer)``: ``--data`` (its held-out tail) or the demo task of
    ``task``, and ``--model`` (or the demo base model) loaded on ``rt.device``."""
    if args.data is not None:
        train_rows, eval_rows = split_heldout(load_jsonl(args.data, keys), args.eval_examples)
    else:
        train_rows, eval_rows = demo_rows(task, args.demo_examples, args.eval_examples, args.seed)
    model_dir = resolve_model(args, rt)
    model, tokenizer = load_model(model_dir, rt.device)
    return train_rows, eval_rows, model_dir, model, tokenizer


def training_setup(model, args: argparse.Namespace, rt: Runtime):
    """AdamW on ``model`` through :func:`fp8_setup`, and the warm-up + cosine scheduler on the optimizer it returns:
    ``(train_model, model, optimizer, scheduler)``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    fp8_checkpoint = args.model if serving_checkpoint(args.model) else None  # its FP8 bytes taken as stored
    train_model, model, optimizer = fp8_setup(model, optimizer, args, rt, fp8_checkpoint)
    inner = getattr(optimizer, "optimizer", optimizer)
    return train_model, model, optimizer, torch.optim.lr_scheduler.LambdaLR(inner, lr_lambda(args))


def optimizer_step(model, optimizer, scheduler, args: argparse.Namespace, memory: dict | None):
    """Clip, step, schedule, then ``zero_grad``; ``(grad_norm, memory)`` where ``memory`` is ``fp8.memory_report`` taken
    at the first step (after the step, before ``zero_grad``: every state exists), or the one given."""
    import fp8

    grad_norm = clip(model, optimizer, args.clip_grad)
    optimizer.step()
    scheduler.step()
    if memory is None:
        memory = fp8.memory_report(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, memory


def nonfinite(loss_value: float, step: int, log: JsonLog) -> bool:
    """Whether the loss left the finite range (said in the log, which is closed: the script then exits 1)."""
    if math.isfinite(loss_value):
        return False
    log.print(f"error: loss is {loss_value} at step {step}; lower --lr or use --fp8-opt-level none")
    log.close()
    return True


def finish(model, optimizer, tokenizer, args: argparse.Namespace, rt: Runtime, log: JsonLog) -> int:
    """``--output`` (BF16 from the masters, or ``--output-format``'s FP8 serving format: the FP8 weights as trained),
    then the log closed and the process group torn down."""
    if args.output is not None and args.output_format != "bf16":
        if rt.main:
            import fp8

            report = fp8.export_fp8(model, args.output, args.output_format, tokenizer=tokenizer, dtype=torch.bfloat16)
            log.print(f"wrote {args.output} ({args.output_format}: {len(report.fp8_weights)} FP8 weights as trained, "
                      f"{report.bytes_on_disk:,} bytes on disk)")
    elif args.output is not None:
        save_bf16(model, optimizer, tokenizer, args.output, args.fp8_opt_level, rt)
        log.print(f"wrote {args.output} (BF16, transformers)")
    log.close()
    teardown(rt)
    return 0
