"""Automatic fallback (``fp8.initialize(..., auto_fallback=...)``, ``pretrain_gpt.py --fp8-auto-fallback``) on runs
where one linear's input keeps outgrowing its delayed scale: the loss with and without the fallback beside the
high-precision run, and the decisions taken.

- engine: :class:`fp8.testing.SaturatingMLP` (its second linear's input grows 4x per step and is divided back after
  it: the function is unchanged, the FP8 casts are not), AdamW lr 1e-3, 8 batches of 32 x 64 cycled, ``--steps`` (40)
  steps per seed and level (O1, O2), ``FallbackConfig(interval=2, patience=3)``; the gap is the mean loss of the last 8
  steps over the ``none`` run's.
- megatron: ``pretrain_gpt.py``'s demo GPT (4 layers, hidden 128, Shakespeare, 16 x 128 tokens per step) built in this
  process, ``decoder.layers.1.mlp.linear_fc1``'s input multiplied by ``--growth`` (4) per iteration and its output
  divided back (forward hooks), ``--iters`` (60) iterations at ``none``, O2 and O2 ``--fp8-auto-fallback`` (statistics and
  log points every 5 iterations, patience 3: a decision at the third alarmed check); the gap over the last 10
  iterations' mean loss.

::

    python benchmarks/auto_fallback.py [--seeds 5] [--json benchmarks/results/auto_fallback.json]
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
        "--micro-batch-size", "16", "--global-batch-size", "16", "--eval-interval", "0", "--log-interval", "5"]


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def engine(seeds: int, steps: int) -> list[dict]:
    import torch
    from torch import nn

    import fp8
    from fp8.testing import SaturatingMLP

    rows = []
    handler = _Lines()
    logging.getLogger("fp8.fallback").addHandler(handler)
    logging.getLogger("fp8.convert").setLevel(logging.ERROR)
    for level in ("O1", "O2"):
        for seed in range(seeds):
            g = torch.Generator().manual_seed(1000 + seed)
            X, Y = torch.randn(8, 32, 64, generator=g), torch.randint(0, 16, (8, 32), generator=g)

            def train(lvl, **kwargs):
                torch.manual_seed(seed)
                net = SaturatingMLP()
                net, opt = fp8.initialize(net, torch.optim.AdamW(net.parameters(), lr=1e-3), lvl, **kwargs)
                losses = []
                for t in range(steps):
                    loss = nn.functional.cross_entropy(net(X[t % 8]), Y[t % 8])
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    losses.append(loss.item())
                return sum(losses[-8:]) / 8, net

            base, _ = train("none")
            plain, _ = train(level)
            before = len(handler.lines)
            fell, net = train(level, auto_fallback=fp8.FallbackConfig(interval=2, patience=3))
            rows.append({"level": level, "seed": seed, "loss_none": base, "gap_without": plain / base - 1,
                         "gap_with": fell / base - 1, "decisions": handler.lines[before:],
                         "layer_precisions": fp8.layer_precisions(net)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def megatron(iters: int, growth: float) -> list[dict]:
    import torch

    from megatron.core import parallel_state
    from megatron.training import training
    from megatron.training.arguments import parse_config

    layer = "decoder.layers.1.mlp.linear_fc1"
    out = []
    for name, flags in (("none", ["--fp8-opt-level", "none"]), ("O2", ["--fp8-opt-level", "O2"]),
                        ("O2 --fp8-auto-fallback", ["--fp8-opt-level", "O2", "--fp8-auto-fallback",
                                                    "--fp8-stats-interval", "5"])):
        cfg = parse_config([*DEMO, "--train-iters", str(iters), *flags])
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        training.initialize_distributed(cfg)
        datasets = training.Datasets(cfg)
        run = training.TrainingRun(cfg, datasets)
        module = dict(run.bare_chunks[0].named_modules())[layer]
        state = {"iteration": 0}

        def grow(mod, inputs):
            return (inputs[0] * growth ** state["iteration"], *inputs[1:])

        def shrink(mod, inputs, output):  # (output, bias): the bias is added later, so the division is exact
            return (output[0] / growth ** state["iteration"], *output[1:])

        module.register_forward_pre_hook(grow)
        module.register_forward_hook(shrink)
        handler = _Lines()
        logging.getLogger("megatron.training").addHandler(handler)
        data = run.data_iterators(datasets.train)
        losses, records = [], []
        for it in range(iters):
            state["iteration"] = it + 1
            if run.numerics is not None:
                run.numerics.begin_step(it + 1)
            step = run.train_step(data, it)
            losses.append(float(step["loss"]))
            if (it + 1) % cfg.training.log_interval == 0 and run.numerics is not None:
                record = [{"iteration": it + 1, "loss": losses[-1]}]
                run.numerics.read(record)
                records.append(record[-1])
        logging.getLogger("megatron.training").removeHandler(handler)
        row = {"run": name, "final_loss": sum(losses[-10:]) / 10, "losses": losses,
               "fallback": [line for line in handler.lines if "auto fallback" in line],
               "alarms": sum("FP8 alarm" in line for line in handler.lines),
               "layer_precisions": next((r["layer_precisions"] for r in reversed(records) if "layer_precisions" in r),
                                        None)}
        out.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), flush=True)
        torch.manual_seed(0)
    base = out[0]["final_loss"]
    for row in out:
        row["gap"] = row["final_loss"] / base - 1
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--growth", type=float, default=4.0)
    p.add_argument("--json", default=None, help="write the results here (e.g. benchmarks/results/auto_fallback.json)")
    a = p.parse_args()
    warnings.filterwarnings("ignore")
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(1)
    result = {"command": "python benchmarks/auto_fallback.py " + " ".join(sys.argv[1:]),
              "engine": engine(a.seeds, a.steps), "megatron": megatron(a.iters, a.growth)}
    print("\nengine (SaturatingMLP): gap of the last 8 steps' mean loss over none")
    for r in result["engine"]:
        print(f"  {r['level']} seed {r['seed']}: without {r['gap_without']:+.2%}  with {r['gap_with']:+.2%}  "
              f"{'; '.join(r['decisions'])}")
    print("\nmegatron demo GPT: gap of the last 10 iterations' mean loss over none")
    for r in result["megatron"]:
        print(f"  {r['run']:<24} {r['final_loss']:.4f} {r['gap']:+.2%}  alarms {r['alarms']}  "
              f"{'; '.join(r['fallback'])}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1))
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
