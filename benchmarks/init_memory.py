"""Peak host memory per rank while the model is constructed, at TP1 and TP2 (sharded initialisation).

Builds ``pretrain_gpt.py``'s model (megatron-core GPTModel with fp8lm's FP8 layers, ``build_model``) of
a GPT with a few hundred million parameters on CPU processes (gloo), and reads each rank's peak resident
memory (``VmHWM``, reset through ``/proc/self/clear_refs`` just before construction) and its resident
memory before construction. Prints a table and writes ``benchmarks/results/init_memory.json``.

    python benchmarks/init_memory.py [--layers 24 --hidden 1024 --level O2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def worker(a: argparse.Namespace) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist

    from fp8.comm import Collectives

    from megatron.core import parallel_state
    from megatron.training import training
    from megatron.training.distributed import cpu_compat
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.model import build_model, padded_vocab_size, transformer_config_from_args

    flags = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
             "--seq-length", "1024", "--micro-batch-size", "1", "--mock-data", "--vocab-size", str(a.vocab),
             "--fp8-opt-level", a.level, "--tensor-model-parallel-size", os.environ.get("WORLD_SIZE", "1")]
    args = validate_args(parse_args(flags))
    training.initialize_distributed(args)
    cpu_compat.seed(args.seed, parallel_state.get_tensor_model_parallel_rank(), 0)
    config = transformer_config_from_args(args, torch.float32)
    vocab = padded_vocab_size(args.vocab_size, args)
    Collectives().barrier("benchmark")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    before = _status("VmRSS")
    t0 = time.perf_counter()
    chunks = build_model(args, config, vocab)
    seconds = time.perf_counter() - t0
    peak = _status("VmHWM")
    params = sum(p.numel() for c in chunks for p in c.parameters())
    row = {"tp": parallel_state.get_tensor_model_parallel_world_size(), "rank": dist.get_rank(),
           "params_on_rank": params, "rss_before_bytes": before, "peak_bytes": peak,
           "construction_peak_bytes": peak - before, "seconds": seconds}
    rows = Collectives().all_gather_object(row, "benchmark")
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--level", default="O2", choices=("none", "O1", "O2", "O3"))
    p.add_argument("--tp", default="1,2")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "init_memory.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    results = []
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    for tp in (int(t) for t in a.tp.split(",")):
        out = Path(a.json).with_suffix(f".tp{tp}.tmp")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp), "--master_port",
               str(29500 + tp * 7 + os.getpid() % 1000), __file__, "--worker", "--out", str(out),
               "--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads), "--vocab", str(a.vocab),
               "--level", a.level]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"TP{tp} launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results += json.loads(out.read_text())
        out.unlink()
    total = results[0]["params_on_rank"] * 1  # TP1 rank 0 holds the whole model
    print(f"GPT {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, --fp8-opt-level {a.level}: "
          f"{total / 1e6:.0f}M parameters")
    print(f"{'TP':>3} {'rank':>4} {'params/rank':>12} {'RSS before':>11} {'peak':>9} {'construction':>13} {'time':>7}")
    for r in results:
        print(f"{r['tp']:>3} {r['rank']:>4} {r['params_on_rank'] / 1e6:>11.1f}M {r['rss_before_bytes'] / 2**20:>9.0f}MiB "
              f"{r['peak_bytes'] / 2**20:>6.0f}MiB {r['construction_peak_bytes'] / 2**20:>10.0f}MiB {r['seconds']:>6.1f}s")
    by_tp = {}
    for r in results:
        by_tp.setdefault(r["tp"], []).append(r["construction_peak_bytes"])
    if 1 in by_tp and 2 in by_tp:
        ratio = max(by_tp[2]) / max(by_tp[1])
        print(f"construction peak per rank, TP2 / TP1: {ratio:.2f}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"model": {"layers": a.layers, "hidden": a.hidden, "heads": a.heads,
                                                  "vocab": a.vocab, "level": a.level, "params": total},
                                        "ranks": results}, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
