"""Cost of FP8 numerics statistics on the demo's throughput, measured in one process.

Builds ``pretrain_gpt.py``'s demo training run once (4 layers, hidden 128, Shakespeare, 16 x 128 tokens per
iteration, O2, ``TrainingRun`` with ``--fp8-stats-interval 10``) and trains it in blocks of ``--block`` (10)
iterations, each block ending with the loop's log point (one host read of the loss). A round runs three blocks in a
rotating order:

- ``off``: the statistics detached from the casts, nothing read (a run without ``--fp8-stats-interval``);
- ``interval 10``: the last step of the block observed (``begin_step`` with iteration numbers as the loop gives
  them), and the statistics read at the log point (``NumericsMonitor.read``: the host read, the gather over ranks,
  the merge and the alarms);
- ``interval 1``: every step observed, read at the log point.

Each observed block's time is compared with the ``off`` block of the same round (paired, so the machine's drift
between rounds cancels), on the wall clock and on the process's CPU time (which leaves out time the machine gave to
others); the overhead is the median of the per-round ratios, with its interquartile range. Tokens/s
are the block's tokens over the block's time. Prints a table and writes ``benchmarks/results/fp8_stats_overhead.json``::

    python benchmarks/fp8_stats_overhead.py --rounds 30
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEMO = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "16", "--global-batch-size", "16", "--eval-interval", "0", "--log-interval", "10",
        "--fp8-opt-level", "O2"]


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], statistics.median(values), q[2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--block", type=int, default=10, help="iterations per block (the statistics interval)")
    p.add_argument("--warmup", type=int, default=20, help="iterations trained before the first round")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "fp8_stats_overhead.json"))
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT))
    import torch

    from megatron.training import training
    from megatron.training.arguments import parse_args, parse_config

    iters = a.warmup + 3 * a.rounds * a.block
    cfg = parse_config([*DEMO, "--train-iters", str(iters), "--fp8-stats-interval", str(a.block)])
    training.initialize_distributed(cfg)
    datasets = training.Datasets(cfg)
    run = training.TrainingRun(cfg, datasets)
    assert run.numerics is not None
    data = run.data_iterators(datasets.train)
    tokens = cfg.training.global_batch_size * cfg.model.seq_length
    it = 0
    # the scaling states the statistics hook into (fp8.stats): detached during "off" blocks, as in a run without
    # --fp8-stats-interval
    hooked = [(state, state.stats) for chunk in run.bare_chunks for m in chunk.modules()
              for state in (getattr(m, "input_scaling", None), getattr(m, "grad_output_scaling", None))
              if state is not None and state.stats is not None]
    assert hooked, "no FP8 cast is observed"

    def block(observe_every: int | None) -> float:
        """One block of ``a.block`` iterations ending with a log point; ``observe_every``: observe the steps whose
        1-based number in the block is a multiple of it (None: statistics off). Seconds."""
        nonlocal it
        for state, site in hooked:
            state.stats = None if observe_every is None else site
        t0, c0 = time.perf_counter(), time.process_time()
        loss = None
        for k in range(1, a.block + 1):
            if observe_every is not None:
                # begin_step observes iterations that are multiples of the interval (a.block): give it one when
                # this step is to be observed, and one that is not otherwise
                run.numerics.begin_step(a.block if k % observe_every == 0 else 1)
            loss = run.train_step(data, it)["loss"]
            it += 1
        records = [{"iteration": it, "loss": float(loss)}]  # the log point's host read
        if observe_every is not None:
            run.numerics.read(records)
            assert "fp8_stats" in records[-1], "the observed block read no statistics"
        return time.perf_counter() - t0, time.process_time() - c0

    for _ in range(a.warmup // a.block):
        block(None)
    settings = {"off": None, f"interval {a.block}": a.block, "interval 1": 1}
    names = list(settings)
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(a.rounds):
        order = names[r % 3:] + names[:r % 3]
        for name in order:
            times[name].append(block(settings[name]))
    print(f"demo GPT at O2 on {torch.get_num_threads()} threads, one process: {a.rounds} rounds of 3 blocks of "
          f"{a.block} iterations ({tokens} tokens each)")
    print(f"{'statistics':<12} {'tokens/s':>9} {'wall-clock overhead':>20} {'IQR':>18} {'CPU-time overhead':>18} "
          f"{'IQR':>18}")
    rows = []
    for name in names:
        tps = statistics.median(a.block * tokens / wall for wall, _ in times[name])
        row = {"setting": name, "tokens_per_s_median": tps, "block_wall_seconds": [w for w, _ in times[name]],
               "block_cpu_seconds": [c for _, c in times[name]]}
        if name == "off":
            print(f"{name:<12} {tps:>9.0f} {'-':>20} {'-':>18} {'-':>18} {'-':>18}")
        else:
            line = f"{name:<12} {tps:>9.0f}"
            for i, clock in enumerate(("wall", "cpu")):
                ratios = [t[i] / off[i] - 1 for t, off in zip(times[name], times["off"])]
                lo, med, hi = _quantiles(ratios)
                row.update({f"{clock}_overhead_median": med, f"{clock}_overhead_q1": lo,
                            f"{clock}_overhead_q3": hi})
                line += f" {med:>+{20 if i == 0 else 18}.2%} {f'{lo:+.2%} .. {hi:+.2%}':>18}"
            print(line)
        rows.append(row)
    out = {"rounds": a.rounds, "block": a.block, "tokens_per_block": a.block * tokens,
           "threads": torch.get_num_threads(), "rows": rows}
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
