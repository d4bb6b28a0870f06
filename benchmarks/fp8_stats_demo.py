"""FP8 numerics statistics of the demo run with one layer forced into saturation, and the alarm naming it.

Builds ``pretrain_gpt.py``'s demo training run (4 layers, hidden 128, Shakespeare, O2, ``--fp8-stats-interval 10
--log-interval 10``) in this process and trains ``--iters`` (40) iterations as the training loop does (statistics
observed every 10th step, read and merged at the log points, alarms checked by ``NumericsMonitor``). At iteration
``--spike-at`` (30) the input of one linear (``--layer``, default ``decoder.layers.1.mlp.linear_fc1``) is multiplied
by ``2**--spike-log2`` (8) for that step only: an activation outlier, which the delayed input scale (chosen from the
previous steps' amax) cannot hold, so its values saturate. Prints each layer's input statistics at the observed
iterations and the alarms raised (the WARNING lines of the run's logger), and writes
``benchmarks/results/fp8_stats_demo.json``::

    python benchmarks/fp8_stats_demo.py
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DEMO = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "128",
        "--micro-batch-size", "16", "--global-batch-size", "16", "--eval-interval", "0", "--log-interval", "10",
        "--fp8-opt-level", "O2", "--fp8-stats-interval", "10"]


class _Alarms(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--spike-at", type=int, default=30)
    p.add_argument("--spike-log2", type=int, default=8)
    p.add_argument("--layer", default="decoder.layers.1.mlp.linear_fc1")
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "fp8_stats_demo.json"))
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT))
    from megatron.training import training
    from megatron.training.arguments import parse_args, parse_config

    cfg = parse_config([*DEMO, "--train-iters", str(a.iters)])
    training.initialize_distributed(cfg)
    datasets = training.Datasets(cfg)
    run = training.TrainingRun(cfg, datasets)
    modules = dict(run.bare_chunks[0].named_modules())
    if a.layer not in modules:
        sys.exit(f"--layer {a.layer}: no such module; FP8 linears: "
                 f"{', '.join(n for n in modules if n in run.numerics.stats[0].layers)}")
    state = {"iteration": 0}

    def outlier(module, inputs):
        if state["iteration"] == a.spike_at:
            return (inputs[0] * 2.0 ** a.spike_log2, *inputs[1:])
        return None

    modules[a.layer].register_forward_pre_hook(outlier)
    handler = _Alarms()
    logging.getLogger("megatron.training").addHandler(handler)
    data = run.data_iterators(datasets.train)
    logged = []
    for it in range(a.iters):
        state["iteration"] = it + 1
        run.numerics.begin_step(it + 1)
        step = run.train_step(data, it)
        if (it + 1) % cfg.training.log_interval == 0:
            records = [{"iteration": it + 1, "loss": float(step["loss"])}]
            before = len(handler.lines)
            run.numerics.read(records)
            records[-1]["alarms"] = handler.lines[before:]
            logged.append(records[-1])
    print(f"demo GPT at O2, --fp8-stats-interval 10; {a.layer}'s input x 2^{a.spike_log2} at iteration {a.spike_at}")
    names = sorted(logged[-1]["fp8_stats"])
    for record in logged:
        print(f"\niteration {record['iteration']}: loss {record['loss']:.4f}")
        print(f"  {'layer':<42} {'input amax':>10} {'scale':>8} {'saturated':>10} {'flushed':>8}")
        for name in names:
            s = record["fp8_stats"][name]["input"]
            print(f"  {name:<42} {s['amax']:>10.4g} {s['scale']:>8.4g} {s['saturated']:>10.3%} "
                  f"{s['flush_to_zero']:>8.3%}")
        for line in record["alarms"]:
            print(f"  WARNING {line}")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"layer": a.layer, "spike_at": a.spike_at, "spike_log2": a.spike_log2,
                                        "records": logged}, indent=1))
    print(f"\nwrote {a.json}")


if __name__ == "__main__":
    main()
