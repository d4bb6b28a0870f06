"""Peak host memory per rank through construction and the first training step, at TP1 and TP2.

Builds ``pretrain_gpt.py``'s training run (``TrainingRun``: megatron-core GPTModel with fp8lm's FP8 layers,
sharded initialisation, the optimizer) of a GPT with a few hundred million parameters on CPU processes (gloo),
then runs one training step (``TrainingRun.train_step``: forward, backward, gradient reductions, optimizer step)
on mock data. Each rank's peak resident memory (``VmHWM``, reset through ``/proc/self/clear_refs`` once the
libraries are imported and the process group is up) is read after construction and after the step, with the
resident size before construction. ``--steps 0`` measures construction only. Prints a table and writes
``benchmarks/results/init_memory.json``.

Resident memory counts what the C allocator keeps as well as live tensors: glibc's default raises its mmap
threshold after large frees (up to 32 MiB), so later tensors below it come from the heap and are not returned to the
system when freed. ``--malloc-mmap-threshold 65536`` starts the ranks with ``MALLOC_MMAP_THRESHOLD_=65536`` (every
tensor over 64 KiB mapped and unmapped on its own), so the peaks follow the live tensors.

    python benchmarks/init_memory.py [--layers 24 --hidden 1024 --level O2 --steps 1 --tp 1,2,2sp]
                                     [--malloc-mmap-threshold 65536]
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
    from fp8.memory import memory_report

    from megatron.core import parallel_state
    from megatron.training import training
    from megatron.training.arguments import parse_args, parse_config

    tp = os.environ.get("WORLD_SIZE", "1")
    flags = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden), "--num-attention-heads", str(a.heads),
             "--seq-length", str(a.seq), "--micro-batch-size", "1", "--global-batch-size", "1", "--mock-data",
             "--vocab-size", str(a.vocab), "--fp8-opt-level", a.level, "--tensor-model-parallel-size", tp,
             "--train-iters", str(max(1, a.steps)), "--eval-interval", "0"]
    if a.sequence_parallel and tp != "1":
        flags.append("--sequence-parallel")
    cfg = parse_config(flags)
    training.initialize_distributed(cfg)
    datasets = training.Datasets(cfg)
    Collectives().barrier("benchmark")
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident size
    before = _status("VmRSS")
    t0 = time.perf_counter()
    run = training.TrainingRun(cfg, datasets)
    seconds = time.perf_counter() - t0
    construction_peak = _status("VmHWM")
    row = {"tp": parallel_state.get_tensor_model_parallel_world_size(), "rank": dist.get_rank(),
           "sequence_parallel": bool(cfg.parallel.sequence_parallel), "params_on_rank": run.params,
           "rss_before_bytes": before, "peak_bytes": construction_peak,
           "construction_peak_bytes": construction_peak - before, "seconds": seconds}
    if a.steps:
        data = run.data_iterators(datasets.train)
        t0 = time.perf_counter()
        for it in range(a.steps):
            float(run.train_step(data, it)["loss"])  # one host read per step: the step has finished
        row["step_seconds"] = (time.perf_counter() - t0) / a.steps
        row["peak_bytes"] = _status("VmHWM")
        row["step_peak_bytes"] = row["peak_bytes"] - before
        row["rss_after_step_bytes"] = _status("VmRSS") - before
        row["model_state_bytes"] = memory_report(torch.nn.ModuleList(run.bare_chunks), run.optimizer.inner)["total"]
    rows = Collectives().all_gather_object(row, "benchmark")
    if dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def _layouts(spec: str) -> list[tuple[int, bool]]:
    """``"1,2,2sp"`` -> [(1, False), (2, False), (2, True)] (``sp``: with ``--sequence-parallel``)."""
    out = []
    for item in spec.split(","):
        sp = item.endswith("sp")
        out.append((int(item[:-2] if sp else item), sp))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--level", default="O2", choices=("none", "O1", "O2", "O3"))
    p.add_argument("--steps", type=int, default=1, help="training steps after construction (0: construction only)")
    p.add_argument("--tp", default="1,2,2sp", help="layouts, comma-separated: a TP size, 'sp' appended for "
                                                  "--sequence-parallel (default 1,2,2sp)")
    p.add_argument("--malloc-mmap-threshold", type=int, default=None,
                   help="start the ranks with MALLOC_MMAP_THRESHOLD_ set to this many bytes (glibc)")
    p.add_argument("--json", default=None, help="default: benchmarks/results/init_memory.json, or "
                                                "init_memory_mmap<BYTES>.json with --malloc-mmap-threshold")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--sequence-parallel", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    results = []
    if a.json is None:
        suffix = "" if a.malloc_mmap_threshold is None else f"_mmap{a.malloc_mmap_threshold}"
        a.json = str(ROOT / "benchmarks" / "results" / f"init_memory{suffix}.json")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    for tp, sp in _layouts(a.tp):
        out = Path(a.json).with_suffix(f".tp{tp}{'sp' if sp else ''}.tmp")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp), "--master_port",
               str(29500 + tp * 7 + sp + os.getpid() % 1000), __file__, "--worker", "--out", str(out),
               "--layers", str(a.layers), "--hidden", str(a.hidden), "--heads", str(a.heads), "--vocab", str(a.vocab),
               "--seq", str(a.seq), "--level", a.level, "--steps", str(a.steps)] + (["--sequence-parallel"] if sp else [])
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        if a.malloc_mmap_threshold is not None:
            env["MALLOC_MMAP_THRESHOLD_"] = str(a.malloc_mmap_threshold)
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"TP{tp} launch failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results += json.loads(out.read_text())
        out.unlink()
    total = results[0]["params_on_rank"] * results[0]["tp"]
    mib = 2 ** 20
    allocator = ("glibc default" if a.malloc_mmap_threshold is None
                 else f"MALLOC_MMAP_THRESHOLD_={a.malloc_mmap_threshold}")
    print(f"GPT {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}, seq {a.seq}, --fp8-opt-level {a.level}: "
          f"~{total / 1e6:.0f}M parameters; peaks above the resident size before construction; allocator: {allocator}")
    print(f"{'layout':>8} {'rank':>4} {'params/rank':>12} {'RSS before':>11} {'construction':>13} {'first step':>11} "
          f"{'model state':>12} {'build':>6} {'step':>6}")
    def cell(value, unit="MiB", div=mib):
        return "-" if value is None else f"{value / div:.0f}{unit}"

    for r in results:
        layout = f"TP{r['tp']}{'+SP' if r['sequence_parallel'] else ''}"
        print(f"{layout:>8} {r['rank']:>4} {r['params_on_rank'] / 1e6:>11.1f}M {cell(r['rss_before_bytes']):>11} "
              f"{cell(r['construction_peak_bytes']):>13} {cell(r.get('step_peak_bytes')):>11} "
              f"{cell(r.get('model_state_bytes')):>12} {cell(r['seconds'], 's', 1):>6} "
              f"{cell(r.get('step_seconds'), 's', 1):>6}")
    by_layout: dict = {}
    for r in results:
        by_layout.setdefault((r["tp"], r["sequence_parallel"]), []).append(r)
    ratios = {}
    if (1, False) in by_layout:
        base = by_layout[(1, False)]
        for (tp, sp), rows in by_layout.items():
            if tp == 1:
                continue
            name = f"TP{tp}{'+SP' if sp else ''}"
            for key in ("construction_peak_bytes", "step_peak_bytes"):
                if key in rows[0]:
                    ratios[f"{name} / TP1 {key}"] = max(x[key] for x in rows) / max(x[key] for x in base)
    for name, ratio in ratios.items():
        print(f"per-rank peak, {name.replace('_bytes', '').replace('_', ' ')}: {ratio:.2f}")
    Path(a.json).write_text(json.dumps({"model": {"layers": a.layers, "hidden": a.hidden, "heads": a.heads,
                                                  "vocab": a.vocab, "seq": a.seq, "level": a.level, "params": total,
                                                  "steps": a.steps},
                                        "malloc_mmap_threshold": a.malloc_mmap_threshold,
                                        "ranks": results, "ratios": ratios}, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
