"""Supervised fine-tuning of a transformers causal LM with FP8 (``fp8.initialize``), loss on response tokens only.

    python examples/finetune/sft.py --fp8-opt-level O2 --max-steps 60 --output out/sft-o2 --log-json sft.jsonl
    python examples/finetune/sft.py --model DIR --data train.jsonl --fp8-opt-level O2 ...   # {"prompt", "response"}
    torchrun --nproc_per_node 2 examples/finetune/sft.py --fp8-opt-level O2 ...              # fp8.distributed

Without ``--data``: the demo task (continue a character's speech in Shakespeare's plays) on the demo base model.
Docs: docs/finetune.md.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from megatron.training.finetune import cli, data, loop, runtime  # noqa: E402

KEYS = ("prompt", "response")


def evaluate(model, examples, pad_id: int, batch_size: int, rt) -> float:
    """Mean loss per response token over ``examples`` (this rank's share, summed over ranks)."""
    sums = torch.zeros(2, dtype=torch.float64, device=rt.device)  # -log p, tokens: one host read at the end
    mine = examples[rt.rank::rt.world]
    model.eval()
    with torch.no_grad():
        for i in range(0, len(mine), batch_size):
            batch = {k: v.to(rt.device) for k, v in data.collate(mine[i:i + batch_size], pad_id).items()}
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            logp, n = data.response_logprobs(logits, batch["labels"])
            sums += torch.stack([-logp.sum(), n.sum()]).double()
    model.train()
    total, count = (v * rt.world for v in runtime.all_mean(sums.tolist(), rt))
    return total / max(count, 1.0)


def main(argv=None) -> int:
    parser = cli.build_parser(__doc__.splitlines()[0], task="sft")
    args = parser.parse_args(argv)
    cli.check_args(args, parser)
    return cli.run_main(args, run)


def run(args, rt) -> int:
    started = time.perf_counter()
    log = runtime.JsonLog(args.log_json, rt)
    train_rows, eval_rows, model_dir, model, tokenizer = loop.load_task(args, rt, "sft", KEYS)
    encoded = [data.encode(tokenizer, r["prompt"], r["response"], args.max_length) for r in train_rows]
    held = [data.encode(tokenizer, r["prompt"], r["response"], args.max_length) for r in eval_rows]
    truncated = sum(e.truncated for e in encoded) + sum(e.truncated for e in held)
    log.print(f"sft: {len(encoded)} training / {len(held)} held-out examples, {truncated} truncated to "
              f"--max-length {args.max_length}; model {model_dir}; opt level {args.fp8_opt_level}, recipe "
              f"{args.recipe}; {rt.world} rank(s) on {rt.device}")
    pad_id = tokenizer.pad_token_id

    train_model, model, optimizer, scheduler = loop.training_setup(model, args, rt)
    eval_before = evaluate(model, held, pad_id, args.batch_size, rt) if held else None
    model.train()
    loss_value = math.nan
    memory = None
    for step, idx in enumerate(runtime.batches(len(encoded), args.batch_size, rt, args.seed, args.max_steps)):
        t0 = time.perf_counter()
        batch = {k: v.to(rt.device) for k, v in data.collate([encoded[i] for i in idx], pad_id).items()}
        # Mean over the global batch's response tokens (labels are -100 on prompt and padding): each rank divides its
        # sum by the token count of all ranks, times the ranks, as DDP averages the gradients over them.
        logits = train_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logp, n = data.response_logprobs(logits, batch["labels"])
        loss = -logp.sum() * rt.world / runtime.global_sum(n.sum(), rt).clamp(min=1)
        loss.backward()
        grad_norm, memory = loop.optimizer_step(model, optimizer, scheduler, args, memory)
        (loss_value,) = runtime.all_mean([loss.item()], rt)
        if loop.nonfinite(loss_value, step, log):
            return 1
        record = {"step": step, "loss": loss_value, "lr": scheduler.get_last_lr()[0],
                  "grad_norm": grad_norm, "tokens": int((batch["labels"] != -100).sum()),
                  "step_s": round(time.perf_counter() - t0, 3)}
        log.write(record)
        if step % 10 == 0 or step == args.max_steps - 1:
            log.print(f"step {step:4d} loss {loss_value:.4f} lr {record['lr']:.2e} ({record['step_s']:.2f} s)")
    eval_after = evaluate(model, held, pad_id, args.batch_size, rt) if held else None
    summary = {"final": {"loss": loss_value, "heldout_loss_before": eval_before, "heldout_loss": eval_after,
                         "steps": args.max_steps, "opt_level": args.fp8_opt_level, "recipe": args.recipe,
                         "truncated": truncated, "world_size": rt.world,
                         "weights_checksum_per_rank": runtime.weights_checksums(model, rt),
                         "wall_s": round(time.perf_counter() - started, 1)},
               "memory": {"policy": memory}}
    log.write(summary)
    if held:
        log.print(f"held-out loss per response token: {eval_before:.4f} before, {eval_after:.4f} after")
    log.print(f"memory (bytes, fp8.memory_report after step 1): {memory}")
    return loop.finish(model, optimizer, tokenizer, args, rt, log)


if __name__ == "__main__":
    sys.exit(main())
