"""Cost of FP8 numerics statistics on the demo's throughput: ``pretrain_gpt.py``'s demo model (4 layers, hidden
128, Shakespeare, 16 x 128 tokens per iteration) at O2, trained ``--iters`` iterations without statistics and with
``--fp8-stats-interval`` 10 (and 1), alternating ``--repeats`` times; tokens/s after the first iteration from the
run summary (``--log-json``), the median per setting. Prints a table and writes
``benchmarks/results/fp8_stats_overhead.json``::

    python benchmarks/fp8_stats_overhead.py --iters 100 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tokens_per_s(iters: int, extra: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "log.jsonl"
        cmd = [sys.executable, "pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "128",
               "--num-attention-heads", "4", "--seq-length", "128", "--micro-batch-size", "16",
               "--global-batch-size", "16", "--train-iters", str(iters), "--eval-interval", "0", "--log-interval", "10",
               "--no-progress", "--fp8-opt-level", "O2", "--log-json", str(log), *extra]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        summary = json.loads(log.read_text().splitlines()[-1])["summary"][0]
        return float(summary["tokens_per_s"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "fp8_stats_overhead.json"))
    a = p.parse_args()
    settings = {"off": [], "interval 10": ["--fp8-stats-interval", "10"], "interval 1": ["--fp8-stats-interval", "1"]}
    runs: dict[str, list[float]] = {name: [] for name in settings}
    for _ in range(a.repeats):
        for name, extra in settings.items():
            runs[name].append(_tokens_per_s(a.iters, extra))
    base = statistics.median(runs["off"])
    print(f"demo GPT at O2, {a.iters} iterations, median of {a.repeats} runs (alternating)")
    print(f"{'statistics':<12} {'tokens/s':>9} {'vs off':>8}   runs")
    rows = []
    for name, values in runs.items():
        med = statistics.median(values)
        rows.append({"setting": name, "tokens_per_s": med, "runs": values, "overhead": 1 - med / base})
        print(f"{name:<12} {med:>9.0f} {-(1 - med / base):>+8.1%}   {', '.join(f'{v:.0f}' for v in values)}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"iters": a.iters, "repeats": a.repeats, "rows": rows}, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
