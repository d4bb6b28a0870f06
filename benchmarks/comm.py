"""Bytes on the wire per training step, and a 2-way data-parallel loss curve: FP8 DDP vs torch DDP.

Run under torchrun on CPU (gloo), from the repository root::

    torchrun --nproc_per_node 2 benchmarks/comm.py   # bytes table + FP8 vs FP32 loss curve
    torchrun --nproc_per_node 4 benchmarks/comm.py   # bytes table (add --curve-steps N for a curve)

Bytes are counted at the collective calls with ring costs (``fp8.distributed.bytes_counter``):
torch DDP with FP32 gradients and with BF16 gradients through a counting comm hook, and
``fp8.distributed.DistributedDataParallel`` on the O1 model (FP8 payloads, amax exchanges and the
gradients that stay in their own dtype, all counted). Prints a table, writes ``benchmarks/results/comm_<N>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp8  # noqa: E402
import fp8.distributed as fd  # noqa: E402
from fp8.comm import Collectives  # noqa: E402
from fp8.testing import GPTConfig, TinyGPT  # noqa: E402
from megatron.training.data.corpus import get_batch, load_corpus  # noqa: E402

VARIANTS = ("torch DDP FP32", "torch DDP BF16 grads", "fp8 DDP (ours)", "fp8 O3 (ours)")
WEIGHT_TAGS = ("fp8 weights", "fp8 weight scales", "weights")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=512, help="bytes model width")
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-head", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--bytes-batch", type=int, default=1, help="sequences per rank for the bytes steps")
    p.add_argument("--bytes-steps", type=int, default=2, help="counted steps (after one warm-up step)")
    p.add_argument("--curve-steps", type=int, default=None, help="loss-curve steps (default: 300 at 2 ranks, else 0)")
    p.add_argument("--curve-d-model", type=int, default=128)
    p.add_argument("--curve-n-layer", type=int, default=4)
    p.add_argument("--curve-batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--growth-interval", type=int, default=1000, help="steps for mu to double (loss curve)")
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="default: benchmarks/results/comm_<N>.json")
    return p.parse_args()


def wrap(model: torch.nn.Module, optimizer, variant: str, counter: fd.CommBytesCounter,
         scaling: fd.AutoScaleConfig | None = None):
    """(model, optimizer) ready for data parallelism as ``variant``, counting bytes in ``counter``."""
    if variant == "fp8 DDP (ours)":
        model, optimizer = fp8.initialize(model, optimizer, opt_level="O1")
        return fd.DistributedDataParallel(model, counter=counter, scaling=scaling), optimizer
    if variant == "fp8 O3 (ours)":  # sharded FP8 optimizer: reduce-to-owner + FP8 weight all-gather
        model, optimizer = fp8.initialize(model, optimizer, opt_level="O3")
        optimizer.counter = counter
        return fd.DistributedDataParallel(model, counter=counter, scaling=scaling, o3_optimizer=optimizer), optimizer
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    dtype = torch.bfloat16 if "BF16" in variant else None
    ddp.register_comm_hook(fd.CountingHookState(counter, dtype=dtype), fd.counting_allreduce_hook)
    return ddp, optimizer


def train_step(model, optimizer, x, y) -> torch.Tensor:
    _, loss = model(x, y)
    loss.backward()
    if isinstance(optimizer, fp8.optim.ShardedFP8Optimizer):  # gradients live on their owners
        optimizer.clip_grad_norm_(1.0)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def measure_bytes(args, world: int, rank: int) -> dict:
    """Bytes each rank sends per training step, per variant, counted at the collective calls."""
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.n_layer, d_model=args.d_model,
                    n_head=args.n_head)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    batches = [torch.randint(0, 256, (args.bytes_batch, args.seq_len + 1), generator=gen)
               for _ in range(args.bytes_steps + 1)]
    fields = ("vocab_size", "seq_len", "n_layer", "d_model", "n_head", "d_ff")
    out: dict = {"config": {k: getattr(cfg, k) for k in fields}}
    for variant in VARIANTS:
        torch.manual_seed(args.seed)
        model = TinyGPT(cfg)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
        counter = fd.CommBytesCounter()
        model, optimizer = wrap(model, optimizer, variant, counter)
        begin = None
        for i, tokens in enumerate(batches):
            if i == 1:  # the first step is a warm-up
                counter.reset()
                begin = time.perf_counter()
            train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
        summary = counter.summary()
        params = list(model.parameters())
        row = {
            "bytes_per_step": summary["total"] / args.bytes_steps,
            "by_tag": {k: v / args.bytes_steps for k, v in summary["by_tag"].items()},
            "calls_per_step": {k: v / args.bytes_steps for k, v in summary["calls"].items()},
            "step_s": (time.perf_counter() - begin) / args.bytes_steps,
            "elements": sum(p.numel() for p in params),
            "fp8_elements": sum(p.numel() for p in params if isinstance(p, fp8.Float8Tensor)),
        }
        if variant in ("fp8 DDP (ours)", "fp8 O3 (ours)"):
            row["mu"] = model.grad_scaling.mu.item()
            row["buckets"] = len(model.buckets)
        if variant == "fp8 O3 (ours)":
            row["weight_allgather"] = weight_allgather_bytes(optimizer, row["by_tag"])
        out[variant] = row
        del model, optimizer
    fp32, bf16, ours = (out[v]["bytes_per_step"] for v in VARIANTS[:3])
    out["reduction_vs_fp32_pct"] = 100 * (1 - ours / fp32)
    out["reduction_vs_bf16_pct"] = 100 * (1 - ours / bf16)
    return out


def weight_allgather_bytes(optimizer, by_tag: dict) -> dict:
    """Bytes per rank per step of O3's weight all-gather: measured (FP8 payloads + scales, other
    parameters in fp32) and the same all-gather with the FP8 weights in BF16, counted the same way."""
    from fp8.comm import Collectives
    from fp8.distributed.gather import start_owner_gather

    counter = fd.CommBytesCounter()
    comm = Collectives(optimizer.process_group, counter)
    weights = [p for p in optimizer.sharded_params if isinstance(p, fp8.Float8Tensor)]
    start_owner_gather([p.dequantize(torch.bfloat16) for p in weights], [optimizer.owner(p) for p in weights],
                       comm, "bf16 weights")()
    fp8_bytes = by_tag.get("fp8 weights", 0.0) + by_tag.get("fp8 weight scales", 0.0)
    return {"fp8_weights": fp8_bytes, "bf16_weights": counter.total, "plain_weights": by_tag.get("weights", 0.0),
            "fp8_vs_bf16_pct": 100 * (1 - fp8_bytes / counter.total)}


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches) -> float:
    model.eval()
    loss = sum(model(x, y)[1].item() for x, y in batches) / len(batches)
    model.train()
    return loss


def loss_curve(args, world: int, rank: int, variant: str, data, eval_batches) -> dict:
    """Train the curve model data parallel as ``variant``; every rank draws its own batches."""
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.curve_n_layer, d_model=args.curve_d_model,
                    n_head=max(1, args.curve_d_model // 32))
    torch.manual_seed(args.seed)
    model = TinyGPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    counter = fd.CommBytesCounter()
    ddp, optimizer = wrap(model, optimizer, variant, counter, fd.AutoScaleConfig(growth_interval=args.growth_interval))
    inner = ddp.module
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: warmup_cosine(s, args.curve_steps, max(1, args.curve_steps // 20)))
    gen = torch.Generator().manual_seed(args.seed * 1000 + 17 + rank)
    history, window = [], []
    start = time.perf_counter()
    for step in range(1, args.curve_steps + 1):
        x, y = get_batch(data, args.curve_batch, args.seq_len, gen)
        window.append(train_step(ddp, optimizer, x, y))
        schedule.step()
        if step % args.eval_interval == 0 or step == args.curve_steps:
            train = torch.stack(window).mean()
            Collectives().all_reduce(train, tag="benchmark").wait()  # mean train loss over ranks (no counter)
            entry = {"step": step, "train_loss": train.item() / world, "elapsed_s": time.perf_counter() - start}
            entry["val_loss"] = evaluate(inner, eval_batches)
            if isinstance(ddp, fd.DistributedDataParallel):
                entry["mu"] = ddp.grad_scaling.mu.item()
                entry["mu_halvings"] = ddp.grad_scaling.halvings.item()
            history.append(entry)
            window.clear()
            if rank == 0:
                extra = f"  mu {entry['mu']:.4f}" if "mu" in entry else ""
                print(f"[{variant}] step {step:4d}  train {entry['train_loss']:.4f}  val {entry['val_loss']:.4f}"
                      f"  {entry['elapsed_s']:6.1f} s{extra}", flush=True)
    return {"history": history, "final_val_loss": history[-1]["val_loss"],
            "final_train_loss": history[-1]["train_loss"], "bytes_per_step": counter.total / args.curve_steps,
            "wall_s": time.perf_counter() - start}


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if args.curve_steps is None:
        args.curve_steps = 300 if world == 2 else 0
    result: dict = {"world_size": world, "torch": torch.__version__, "backend": "gloo", "args": vars(args)}
    result["bytes"] = measure_bytes(args, world, rank)
    if args.curve_steps > 0:
        train_data, val_data = load_corpus()
        eval_gen = torch.Generator().manual_seed(args.seed + 1)
        eval_batches = [get_batch(val_data, args.curve_batch, args.seq_len, eval_gen) for _ in range(args.eval_batches)]
        result["curve"] = {v: loss_curve(args, world, rank, v, train_data, eval_batches)
                           for v in ("torch DDP FP32", "fp8 DDP (ours)")}
        fp32, ours = (result["curve"][v]["final_val_loss"] for v in ("torch DDP FP32", "fp8 DDP (ours)"))
        result["curve"]["val_gap_pct"] = 100 * (ours - fp32) / fp32
    if rank == 0:
        report(result)
        path = Path(args.json or f"benchmarks/results/comm_{world}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {path}")
    Collectives().barrier("benchmark")  # no rank tears its connections down while a peer still finishes a collective
    dist.destroy_process_group()


def report(result: dict) -> None:
    b = result["bytes"]
    world = result["world_size"]
    ours = b["fp8 DDP (ours)"]
    print(f"\nbytes sent per rank per training step, {world} ranks (gloo, ring costs counted at the calls); "
          f"model {b['config']}, {ours['elements']:,} parameters, {100 * ours['fp8_elements'] / ours['elements']:.2f}% "
          f"of them FP8 weights")
    print(f"{'variant':<22} {'bytes/step':>14} {'vs FP32':>9} {'vs BF16':>9}   breakdown")
    fp32, bf16 = b["torch DDP FP32"]["bytes_per_step"], b["torch DDP BF16 grads"]["bytes_per_step"]
    for variant in VARIANTS:
        row = b[variant]
        parts = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(row["by_tag"].items()))
        print(f"{variant:<22} {row['bytes_per_step']:>14,.0f} {100 * (1 - row['bytes_per_step'] / fp32):>8.2f}% "
              f"{100 * (1 - row['bytes_per_step'] / bf16):>8.2f}%   {parts}")
    o3 = b["fp8 O3 (ours)"]["weight_allgather"]
    print(f"O3 weight all-gather per rank per step: FP8 payloads + scales {o3['fp8_weights']:,.0f} bytes vs the same "
          f"all-gather in BF16 {o3['bf16_weights']:,.0f} ({o3['fp8_vs_bf16_pct']:.2f}% less); other parameters "
          f"(fp32) {o3['plain_weights']:,.0f}")
    if "curve" in result:
        c = result["curve"]
        print(f"\nloss curve, {world}-way data parallel (val loss every {result['args']['eval_interval']} steps)")
        fp32_h, ours_h = c["torch DDP FP32"]["history"], c["fp8 DDP (ours)"]["history"]
        print(f"{'step':>6} {'FP32 train':>11} {'FP32 val':>9} {'FP8 train':>10} {'FP8 val':>8} {'mu':>8}")
        for a, o in zip(fp32_h, ours_h):
            print(f"{a['step']:>6} {a['train_loss']:>11.4f} {a['val_loss']:>9.4f} {o['train_loss']:>10.4f} "
                  f"{o['val_loss']:>8.4f} {o['mu']:>8.4f}")
        fp32_val, fp8_val = c["torch DDP FP32"]["final_val_loss"], c["fp8 DDP (ours)"]["final_val_loss"]
        print(f"final val loss: FP32 {fp32_val:.4f}, FP8 {fp8_val:.4f} ({c['val_gap_pct']:+.2f}%)")


if __name__ == "__main__":
    main()
