"""Model-state memory per parameter, measured with ``fp8.memory_report``: FP32, BF16 mixed precision,
O1 and O2 on a GPT of a few million parameters (and on its FP8 layers alone), plus the FP8-LM
ablation of the second moment in E4M3 vs FP16 on the quickstart model.

    python benchmarks/memory.py [--json benchmarks/results/memory.json] [--ablation-steps 300] [--dp-worlds 2,4]

Memory is read at the peak of a step: after backward (gradients held) with optimizer states
allocated. Prints a table and writes JSON.

Data parallel (``--dp-worlds``, gloo processes spawned here): per-rank bytes per parameter of O2 (FP8
DDP, full optimizer state on every rank), O3 (sharded FP8 optimizer, reduce-to-owner) and BF16 ZeRO-1
(BF16 weights and full BF16 gradients, FP32 master and AdamW states sharded by whole tensors), read
with ``fp8.memory_report`` on every rank right after the second step's backward and gradient
reduction, i.e. what the optimizer step sees; the worst rank and the mean over ranks are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import fp8  # noqa: E402
from fp8.comm import Collectives  # noqa: E402
from fp8.testing import GPTConfig, TinyGPT  # noqa: E402

VARIANTS = ("FP32", "BF16 mixed precision", "O1", "O2", "O1, fp32 gradient sums", "O2, fp32 gradient sums",
            "O1, E4M3 gradients", "O2, E4M3 gradients")
"""``O1``/``O2`` hold FP8-weight gradients as scaled FP16 sums (``grad_accumulation="fp16"``, the default);
``..., fp32 gradient sums`` as fp32 tensors (``"fp32"``); ``..., E4M3 gradients`` as 1-byte ``Float8Tensor``s
(``"fp8"``)."""
_GRADS = {"": "fp16", "fp32 gradient sums": "fp32", "E4M3 gradients": "fp8"}


def build(variant: str, model: torch.nn.Module):
    """Model and optimizer for ``variant``; BF16 mixed precision = BF16 weights and gradients, FP32
    master weights and AdamW states (Megatron's default), realised with fp8.optim's O1 precision."""
    if variant == "BF16 mixed precision":
        model = model.to(torch.bfloat16)
        return model, fp8.optim.AdamW(model.parameters(), lr=1e-4, precision="O1")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    name, _, grads = variant.partition(", ")
    level = {"FP32": "none", "O1": "O1", "O2": "O2"}[name]
    config = fp8.Float8LinearConfig(grad_accumulation=_GRADS[grads])
    return fp8.initialize(model, optimizer, opt_level=level, config=config)


def measure(variant: str, make_model, make_loss) -> dict:
    """Bytes per category at the peak of the second training step, and bytes per parameter."""
    torch.manual_seed(0)
    model = make_model()
    n_params = sum(p.numel() for p in model.parameters())
    model, optimizer = build(variant, model)
    for step in range(2):
        make_loss(model).backward()
        if step == 1:
            report = fp8.memory_report(model, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"variant": variant, "params": n_params, "bytes": report,
            "bytes_per_param": {k: v / n_params for k, v in report.items()}}


def gpt_case(d_model: int, n_layer: int):
    cfg = GPTConfig(vocab_size=256, seq_len=128, n_layer=n_layer, d_model=d_model, n_head=8)
    idx = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))

    def loss(model):
        return model(idx, idx)[1].float()

    return (lambda: TinyGPT(cfg)), loss


def linears_case(d_model: int, n_layer: int):
    x = torch.randn(64, d_model, generator=torch.Generator().manual_seed(0))

    def make():
        layers = []
        for _ in range(n_layer):
            layers += [torch.nn.Linear(d_model, 4 * d_model, bias=False), torch.nn.Linear(4 * d_model, d_model, bias=False)]
        return torch.nn.Sequential(*layers)

    def loss(model):
        dtype = next(model.parameters()).dtype
        return model(x.to(dtype)).float().pow(2).mean()

    return make, loss


def _dp_worker(rank: int, world: int, port: int, d_model: int, n_layer: int, out: str) -> None:
    import torch.distributed as dist

    import fp8.distributed as fd

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    make, loss = gpt_case(d_model, n_layer)
    rows = {}
    for variant in DP_VARIANTS:
        torch.manual_seed(0)
        model = make()
        n_params = sum(p.numel() for p in model.parameters())
        if variant == "BF16 ZeRO-1":
            model = model.to(torch.bfloat16)
            optimizer = fp8.optim.ShardedAdamW(model.parameters(), lr=1e-4, precision="O1")
            wrapped = None  # full local BF16 gradients (ZeRO-1 shards the optimizer state only)
        else:
            model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), opt_level=variant)
            wrapped = fd.DistributedDataParallel(model, o3_optimizer=optimizer if variant == "O3" else None)
        for step in range(2):
            loss(wrapped or model).backward()
            if step == 1:
                report = fp8.memory_report(model, optimizer)
            if wrapped is None:
                for p in model.parameters():  # ZeRO-1's reduce-scatter: keep the owned gradients only
                    if not optimizer.owns(p):
                        p.grad = None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        rows[variant] = {"params": n_params, "bytes": report, "bytes_per_param": {k: v / n_params for k, v in report.items()}}
    torch.save(rows, os.path.join(out, f"rank{rank}.pt"))
    Collectives().barrier("benchmark")
    dist.destroy_process_group()


DP_VARIANTS = ("O2", "O3", "BF16 ZeRO-1")


def measure_data_parallel(worlds: list[int], d_model: int, n_layer: int) -> list[dict]:
    """Per-rank model-state bytes per parameter under data parallelism (module docstring)."""
    import socket
    import tempfile

    from benchmarks.launch import spawn

    results = []
    for world in worlds:
        with tempfile.TemporaryDirectory() as out, socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()
            spawn(_dp_worker, (world, port, d_model, n_layer, out), world)
            per_rank = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]
        for variant in DP_VARIANTS:
            ranks = [r[variant]["bytes_per_param"] for r in per_rank]
            results.append({
                "world_size": world, "variant": variant, "params": per_rank[0][variant]["params"],
                "max_rank": {k: max(r[k] for r in ranks) for k in ranks[0]},
                "mean_rank": {k: sum(r[k] for r in ranks) / world for k in ranks[0]},
                "per_rank_total": [r["total"] for r in ranks],
            })
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--ablation-steps", type=int, default=300, help="0 skips the ablation")
    parser.add_argument("--json", default="benchmarks/results/memory.json")
    parser.add_argument("--dp-worlds", default="2,4", help="data-parallel sizes for O2/O3/ZeRO-1 ('' skips)")
    parser.add_argument("--skip-single", action="store_true", help="only the data-parallel table")
    args = parser.parse_args()

    rows = []
    for case_name, case in () if args.skip_single else (("GPT", gpt_case), ("FP8 layers only", linears_case)):
        make, loss = case(args.d_model, args.n_layer)
        for variant in VARIANTS:
            row = measure(variant, make, loss)
            row["model"] = case_name
            rows.append(row)

    categories = (*fp8.MEMORY_CATEGORIES, "total")
    dp_rows = measure_data_parallel([int(w) for w in args.dp_worlds.split(",") if w], args.d_model, args.n_layer)
    if dp_rows:
        print(f"data parallel, per-rank model-state bytes per parameter after backward + gradient reduction "
              f"(worst rank; GPT d_model={args.d_model} n_layer={args.n_layer}: {dp_rows[0]['params']:,} parameters)")
        print(f"{'ranks':<6} {'variant':<13}" + "".join(f"{c[:12]:>13}" for c in categories) + f"{'mean rank':>11}")
        for row in dp_rows:
            print(f"{row['world_size']:<6} {row['variant']:<13}" + "".join(f"{row['max_rank'][c]:>13.3f}" for c in categories)
                  + f"{row['mean_rank']['total']:>11.3f}")
    if not rows:
        out = Path(args.json).with_name("memory_dp.json")
        out.write_text(json.dumps({"data_parallel": dp_rows}, indent=1) + "\n")
        print(f"wrote {out}")
        return
    print(f"model-state bytes per parameter (fp8.memory_report, at the peak of a step); "
          f"GPT d_model={args.d_model} n_layer={args.n_layer}: {rows[0]['params']:,} parameters")
    header = f"{'model':<16} {'variant':<21}" + "".join(f"{c[:12]:>13}" for c in categories)
    print("(O1/O2: FP8-weight gradients as scaled FP16 sums, grad_accumulation='fp16'; 'fp32 gradient sums': 'fp32'; "
          "'E4M3 gradients': 'fp8')")
    print(header)
    for row in rows:
        print(f"{row['model']:<16} {row['variant']:<21}" + "".join(f"{row['bytes_per_param'][c]:>13.3f}" for c in categories))

    ablation = None
    if args.ablation_steps:
        out = Path(args.json).with_name("ablation_second_moment.json")
        os.makedirs(out.parent, exist_ok=True)
        # the engine quickstart's ablation: its script run as a module of its own (nothing imports the examples)
        quickstart = runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="quickstart_script")
        quickstart["main"](["--levels", "none,O2,O2:exp_avg_sq=e4m3", "--steps", str(args.ablation_steps),
                            "--json", str(out)])
        ablation = json.loads(out.read_text())

    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "ablation_second_moment": ablation, "data_parallel": dp_rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
