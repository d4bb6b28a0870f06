"""Direct preference optimization (DPO) of a transformers causal LM with FP8, against a frozen FP8 reference.

    python examples/finetune/dpo.py --fp8-opt-level O2 --max-steps 60 --output out/dpo-o2 --log-json dpo.jsonl
    python examples/finetune/dpo.py --model DIR --data pairs.jsonl ...   # {"prompt", "chosen", "rejected"}
    torchrun --nproc_per_node 2 examples/finetune/dpo.py --fp8-opt-level O2 ...

The policy trains at ``--fp8-opt-level``; the reference (the policy's initial weights) is frozen with
``fp8.freeze`` (FP8 weights only: 1 byte per parameter plus scales, no gradients, no optimizer state), or held in
BF16 with ``--reference bf16`` (the default at ``--fp8-opt-level none``). Loss: the sigmoid DPO loss
``-log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r)))`` with log-probabilities summed over response tokens.
At the end: held-out reward accuracy and a memory table (policy, reference, total) against the BF16 pair.
Without ``--data``: the demo task (the true next speech vs the start of a speech from another play).
Docs: docs/finetune.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

if __name__ == "__main__" and not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron.training.finetune import cli, data, loop, runtime  # noqa: E402

KEYS = ("prompt", "chosen", "rejected")

# The BF16 pair the memory target compares against, per parameter (mixed-precision accounting of ZeRO,
# Rajbhandari et al. 2020: BF16 weights and gradients, fp32 master weights and Adam's two moments).
BF16_POLICY_BYTES = {"weights": 2, "master weights": 4, "weight gradients": 2, "optimizer states": 8}
BF16_REFERENCE_BYTES = {"weights": 2}


def encode_pairs(tokenizer, rows, max_length):
    out = []
    for r in rows:
        out.append((data.encode(tokenizer, r["prompt"], r["chosen"], max_length),
                    data.encode(tokenizer, r["prompt"], r["rejected"], max_length)))
    return out


def sequence_logps(model, pairs, pad_id, device):
    """Summed response log-probs of (chosen, rejected) for ``pairs`` in one forward of 2B sequences."""
    batch = data.collate([c for c, _ in pairs] + [r for _, r in pairs], pad_id)
    batch = {k: v.to(device) for k, v in batch.items()}
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logp, _ = data.response_logprobs(logits, batch["labels"])
    n = len(pairs)
    return logp[:n], logp[n:]


def dpo_terms(pc, pr, rc, rr, beta):
    """(loss, reward accuracy, reward margin, chosen rewards, rejected rewards) of a batch."""
    chosen = beta * (pc - rc)
    rejected = beta * (pr - rr)
    loss = -F.logsigmoid(chosen - rejected).mean()
    return loss, (chosen > rejected).float().mean(), (chosen - rejected).mean(), chosen, rejected


def build_reference(model_dir, args, rt):
    """The frozen reference: the initial weights, ``fp8.freeze``-d (``--reference fp8``) or in BF16."""
    import fp8

    reference, _ = runtime.load_model(model_dir, rt.device)
    if args.reference == "fp8":
        reference = fp8.freeze(reference, recipe=args.recipe, min_fp8_dim=args.fp8_min_dim,
                               embeddings=args.fp8_embeddings)
    else:
        reference = reference.to(torch.bfloat16)
        for p in reference.parameters():
            p.requires_grad_(False)
        reference.eval()
    return reference


def evaluate(policy, reference, pairs, pad_id, batch_size, beta, rt):
    """Held-out (reward accuracy, reward margin, DPO loss) over ``pairs`` (split over ranks)."""
    mine = pairs[rt.rank::rt.world]
    sums = torch.zeros(3, dtype=torch.float64, device=rt.device)  # correct, margin, loss: one host read at the end
    policy.eval()
    with torch.no_grad():
        for i in range(0, len(mine), batch_size):
            chunk = mine[i:i + batch_size]
            pc, pr = sequence_logps(policy, chunk, pad_id, rt.device)
            rc, rr = sequence_logps(reference, chunk, pad_id, rt.device)
            l, _, _, c, r = dpo_terms(pc, pr, rc.float(), rr.float(), beta)
            sums += torch.stack([(c > r).sum(), (c - r).sum(), l * len(chunk)]).double()
    policy.train()
    correct, margin, loss, n = (v * rt.world for v in runtime.all_mean([*sums.tolist(), float(len(mine))], rt))
    n = max(n, 1.0)
    return correct / n, margin / n, loss / n


def memory_table(policy_report, reference_report, n_params):
    """Rows policy / reference / total: measured bytes (``fp8.memory_report``) and the BF16 pair's bytes
    (computed from the parameter count with :data:`BF16_POLICY_BYTES` / :data:`BF16_REFERENCE_BYTES`)."""
    bf16_policy = n_params * sum(BF16_POLICY_BYTES.values())
    bf16_reference = n_params * sum(BF16_REFERENCE_BYTES.values())
    rows = {
        "policy": {"bytes": policy_report["total"], "bf16_bytes": bf16_policy, "by_category": policy_report},
        "reference": {"bytes": reference_report["total"], "bf16_bytes": bf16_reference,
                      "by_category": reference_report},
    }
    rows["total"] = {"bytes": rows["policy"]["bytes"] + rows["reference"]["bytes"],
                     "bf16_bytes": bf16_policy + bf16_reference}
    for row in rows.values():
        row["ratio_vs_bf16"] = round(row["bytes"] / row["bf16_bytes"], 4)
    return {"parameters": n_params, "bf16_pair_bytes_per_parameter": {
        "policy": BF16_POLICY_BYTES, "reference": BF16_REFERENCE_BYTES}, **rows}


def format_table(table) -> str:
    lines = [f"{'model':<10} {'bytes':>12} {'MiB':>8} {'BF16 pair MiB':>14} {'ratio':>7}"]
    for name in ("policy", "reference", "total"):
        row = table[name]
        lines.append(f"{name:<10} {row['bytes']:>12,d} {row['bytes'] / 2**20:>8.2f} "
                     f"{row['bf16_bytes'] / 2**20:>14.2f} {row['ratio_vs_bf16']:>7.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = cli.build_parser(__doc__.splitlines()[0], task="dpo")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO temperature beta")
    # DPO's defaults: one micro-batch per step, so FP8 weight gradients lose nothing to accumulation and hold
    # 1 byte instead of 4 (the memory target); the demo preference is learned at 1e-3 within 60 steps.
    parser.set_defaults(fp8_grad_accumulation="fp8", lr=1e-3, eval_examples=200)
    parser.add_argument("--reference", choices=["fp8", "bf16"], default=None,
                        help="how the frozen reference is held: fp8 (fp8.freeze; the default at the FP8 levels) "
                             "or bf16 (the default at --fp8-opt-level none)")
    args = parser.parse_args(argv)
    cli.check_args(args, parser)
    if args.reference is None:
        args.reference = "bf16" if args.fp8_opt_level == "none" else "fp8"
    if not args.beta > 0:
        parser.error(f"--beta must be positive, got {args.beta}")
    return cli.run_main(args, run)


def run(args, rt) -> int:
    import fp8

    started = time.perf_counter()
    log = runtime.JsonLog(args.log_json, rt)
    train_rows, eval_rows, model_dir, policy, tokenizer = loop.load_task(args, rt, "dpo", KEYS)
    n_params = sum(p.numel() for p in policy.parameters())
    pairs = encode_pairs(tokenizer, train_rows, args.max_length)
    held = encode_pairs(tokenizer, eval_rows, args.max_length)
    truncated = sum(c.truncated + r.truncated for c, r in pairs + held)
    log.print(f"dpo: {len(pairs)} training / {len(held)} held-out pairs, {truncated} sequences truncated to "
              f"--max-length {args.max_length}; model {model_dir}; opt level {args.fp8_opt_level}, recipe "
              f"{args.recipe}, reference {args.reference}, beta {args.beta}; {rt.world} rank(s) on {rt.device}")
    pad_id = tokenizer.pad_token_id
    reference = build_reference(model_dir, args, rt)

    train_model, policy, optimizer, scheduler = loop.training_setup(policy, args, rt)
    policy.train()
    record = {}
    policy_memory = None
    for step, idx in enumerate(runtime.batches(len(pairs), args.batch_size, rt, args.seed, args.max_steps)):
        t0 = time.perf_counter()
        chunk = [pairs[i] for i in idx]
        with torch.no_grad():
            rc, rr = sequence_logps(reference, chunk, pad_id, rt.device)
        pc, pr = sequence_logps(train_model, chunk, pad_id, rt.device)
        loss, acc, margin, _, _ = dpo_terms(pc, pr, rc.float(), rr.float(), args.beta)
        loss.backward()
        grad_norm, policy_memory = loop.optimizer_step(policy, optimizer, scheduler, args, policy_memory)
        loss_v, acc_v, margin_v = runtime.all_mean([loss.item(), acc.item(), margin.item()], rt)
        if loop.nonfinite(loss_v, step, log):
            return 1
        record = {"step": step, "loss": loss_v, "reward_accuracy": acc_v, "reward_margin": margin_v,
                  "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                  "step_s": round(time.perf_counter() - t0, 3)}
        log.write(record)
        if step % 10 == 0 or step == args.max_steps - 1:
            log.print(f"step {step:4d} loss {loss_v:.4f} reward acc {acc_v:.3f} margin {margin_v:+.4f} "
                      f"({record['step_s']:.2f} s)")
    heldout = evaluate(policy, reference, held, pad_id, args.batch_size, args.beta, rt) if held else None
    table = memory_table(policy_memory, fp8.memory_report(reference), n_params)
    reference_trainable = [n for n, p in reference.named_parameters() if p.requires_grad]
    summary = {"final": {"loss": record.get("loss"), "reward_accuracy": record.get("reward_accuracy"),
                         "reward_margin": record.get("reward_margin"),
                         "heldout_reward_accuracy": heldout[0] if heldout else None,
                         "heldout_reward_margin": heldout[1] if heldout else None,
                         "heldout_loss": heldout[2] if heldout else None,
                         "heldout_pairs": len(held), "steps": args.max_steps, "opt_level": args.fp8_opt_level,
                         "recipe": args.recipe, "reference": args.reference, "beta": args.beta,
                         "truncated": truncated, "world_size": rt.world,
                         "reference_trainable_parameters": len(reference_trainable),
                         "wall_s": round(time.perf_counter() - started, 1)}}
    log.write(summary)
    log.write({"memory": table})
    if heldout:
        log.print(f"held-out ({len(held)} pairs): reward accuracy {heldout[0]:.3f}, margin {heldout[1]:+.4f}, "
                  f"DPO loss {heldout[2]:.4f}")
    log.print("memory (fp8.memory_report after step 1; BF16 pair computed per parameter: policy "
              f"{sum(BF16_POLICY_BYTES.values())} B = BF16 weights + grads, fp32 masters + Adam; reference "
              f"{sum(BF16_REFERENCE_BYTES.values())} B):\n" + format_table(table))
    return loop.finish(policy, optimizer, tokenizer, args, rt, log)


if __name__ == "__main__":
    sys.exit(main())
