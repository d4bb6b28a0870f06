"""Bytes on the wire per training iteration of the Megatron GPT, per parallel layout and opt level.

Runs ``pretrain_gpt.py`` under ``torchrun`` (gloo, CPU) once per layout, training the baseline and the
three FP8 levels in the same launch (``--compare``) on mock data, and reads the bytes every rank sent in
the last iteration, counted at the collective calls (``comm_bytes_all_ranks`` of ``--log-json``), by
what travelled: sequence-parallel all-gathers and reduce-scatters, pipeline activations and gradients,
data-parallel gradients, sequence-parallel parameter gradients, tied-embedding gradients, O3 weight
all-gathers. Prints a table and writes ``benchmarks/results/megatron_comm.json``::

    python benchmarks/megatron_comm.py            # all layouts (2 and 4 processes), ~5 min on 2 cores
    python benchmarks/megatron_comm.py --layouts tp2sp pp2
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "tp2sp": (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    "dp2": (2, []),
    "tp2pp2sp": (4, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]),
    "dp2tp2sp": (4, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}
LEVELS = ("none", "O1", "O2", "O3")
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
         "--micro-batch-size", "4", "--global-batch-size", "16", "--mock-data", "--vocab-size", "2048",
         "--train-iters", "3", "--eval-interval", "0", "--no-progress"]
GROUPS = {
    "SP (all-gather + reduce-scatter)": ("sp all-gather", "sp reduce-scatter"),
    "PP (activations + gradients)": ("pp activations", "pp gradients"),
    "DP gradients": ("fp8 grads", "grads", "fp8 amax", "fp8 overflow"),
    "O3 weight all-gather": ("fp8 weights", "fp8 weight scales", "weights"),
    "tied embedding grads (PP)": ("tied embedding grads",),
    "other": (),
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(name: str) -> dict[str, dict[str, float]]:
    nproc, flags = LAYOUTS[name]
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(_port()), "pretrain_gpt.py", *MODEL, *flags, "--fp8-opt-level", "O2", "--compare", "none,O1,O3",
               "--log-json", log, "--plot", os.path.join(tmp, "p.png")]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{name} failed:\n{proc.stderr[-3000:]}")
        last: dict[str, dict[str, float]] = {}
        with open(log) as f:
            for line in f:
                record = json.loads(line)
                if "level" in record and "comm_bytes_all_ranks" in record:
                    last[record["level"]] = record["comm_bytes_all_ranks"]
        return last


def grouped(by_tag: dict[str, float]) -> dict[str, float]:
    out = dict.fromkeys(GROUPS, 0.0)
    for tag, value in by_tag.items():
        group = next((g for g, tags in GROUPS.items() if tag in tags), "other")
        out[group] += value
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "megatron_comm.json"))
    a = p.parse_args()
    results = {}
    for name in a.layouts:
        print(f"running {name} ({LAYOUTS[name][0]} processes) ...", flush=True)
        results[name] = run_layout(name)
    print("\nbytes sent per iteration, all ranks together (4-layer GPT, hidden 256, seq 128, global batch 16)")
    header = f"{'layout':<10} {'what':<34}" + "".join(f"{lvl:>12}" for lvl in LEVELS) + f"{'O2 vs none':>12}"
    print(header)
    table = {}
    for name, by_level in results.items():
        groups = {lvl: grouped(by_level.get(lvl, {})) for lvl in LEVELS}
        table[name] = {lvl: {"groups": groups[lvl], "by_tag": by_level.get(lvl, {}),
                             "total": sum(by_level.get(lvl, {}).values())} for lvl in LEVELS}
        for group in GROUPS:
            values = [groups[lvl][group] for lvl in LEVELS]
            if not any(values):
                continue
            ratio = f"{(values[2] / values[0] - 1) * 100:+.1f}%" if values[0] else ""
            print(f"{name:<10} {group:<34}" + "".join(f"{v / 1024:>10.0f}Ki" for v in values) + f"{ratio:>12}")
        totals = [table[name][lvl]["total"] for lvl in LEVELS]
        print(f"{name:<10} {'total':<34}" + "".join(f"{v / 1024:>10.0f}Ki" for v in totals)
              + f"{(totals[2] / totals[0] - 1) * 100:>+11.1f}%")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"model": MODEL, "layouts": {k: LAYOUTS[k][1] for k in results}, "results": table}, f, indent=1)
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    main()
