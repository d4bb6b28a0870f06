"""FP8-LM's Figure 1 question, from the memory planner: the largest GPT that fits N x 80 GB GPUs per opt level.

    python benchmarks/figure1.py [--gpus 8,16,...] [--min-dp 8] [--output benchmarks/results/figure1]

The GPT family has L = h/128 layers and h/128 heads (GPT-3 175B's shape ratio), sequence 2048, micro-batch 1,
full recomputation and sequence parallelism; every layout TP (power of two <= 8) x PP x DP is tried and the
smallest that fits is kept. Each opt level's plan is ``megatron.training.planning.memory_plan.plan_memory``'s.
Writes a Markdown table, the rows as JSON and a PNG (``--output`` stem; ``benchmarks/report.py`` copies the PNG
into docs/figures/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.training.planning.memory_plan import PlannerConfig, plan_memory  # noqa: E402

__all__ = ["FIGURE1_LEVELS", "largest_model", "figure1", "write_figure1", "main"]

_NONE_DO = "none+DO"
FIGURE1_LEVELS = ("none", _NONE_DO, "O1", "O2", "O3")
"""Figure 1's columns: the BF16 baseline without and with Megatron's distributed optimizer, then O1-O3."""


def _figure1_config(hidden: int, gpus: int, tp: int, pp: int, level: str, seq: int) -> PlannerConfig:
    layers = hidden // 128
    return PlannerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=hidden // 128, seq_length=seq,
        vocab_size=50257, micro_batch_size=1, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        data_parallel_size=gpus // (tp * pp), sequence_parallel=tp > 1, recompute_granularity="full",
        fp8_opt_level="none" if level == _NONE_DO else level, use_distributed_optimizer=level == _NONE_DO, bf16=True,
        # Both sides sum micro-batch gradients accurately: BF16 in FP32 main gradients (Megatron's --bf16),
        # FP8 levels in scaled FP16 buffers (grad_accumulation="fp16", the default).
        fp32_grads=level in ("none", _NONE_DO),
    )


def _fits(hidden: int, gpus: int, level: str, capacity: float, seq: int, max_tp: int,
          min_dp: int = 1) -> PlannerConfig | None:
    """The first layout (smallest TP x PP, then smallest TP) under which this GPT fits, or None."""
    layers = hidden // 128
    layouts = []
    tp = 1
    while tp <= min(max_tp, gpus):
        for pp in range(1, layers + 1):
            if layers % pp == 0 and gpus % (tp * pp) == 0 and gpus // (tp * pp) >= min_dp:
                layouts.append((tp * pp, tp, pp))
        tp *= 2
    for _, tp, pp in sorted(layouts):
        try:
            cfg = _figure1_config(hidden, gpus, tp, pp, level, seq)
        except ValueError:  # e.g. heads not divisible by TP: not a valid layout for this shape
            continue
        if plan_memory(cfg)["total_bytes"] <= capacity:
            return cfg
    return None


def largest_model(gpus: int, level: str, capacity: float = 0.9 * 80e9, seq: int = 2048,
                  max_tp: int = 8, step: int = 256, min_dp: int = 1) -> tuple[PlannerConfig, dict] | None:
    """The largest GPT of the family L = h / 128 layers, h / 128 heads (GPT-3 175B's shape ratio),
    h a multiple of ``step``, that fits ``gpus`` GPUs of ``capacity`` bytes at ``level`` with micro-batch 1,
    full recomputation and sequence parallelism, over every layout TP (power of two <= max_tp) x PP x DP
    with DP >= ``min_dp``.
    Returns (config, plan) or None. Binary search over h (fitting is monotone in h for a fixed family)."""
    lo, hi = 0, 1
    while _fits(hi * step, gpus, level, capacity, seq, max_tp, min_dp) is not None:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _fits(mid * step, gpus, level, capacity, seq, max_tp, min_dp) is not None:
            lo = mid
        else:
            hi = mid
    if lo == 0:
        return None
    cfg = _fits(lo * step, gpus, level, capacity, seq, max_tp, min_dp)
    return cfg, plan_memory(cfg)


def figure1(gpu_counts=(8, 16, 32, 64, 128, 256, 512), capacity: float = 0.9 * 80e9, seq: int = 2048,
            min_dp: int = 1) -> list[dict]:
    """Rows ``{"gpus", "level", "params", "hidden", "layers", "tp", "pp", "dp", "gib_per_gpu"}`` for each
    GPU count and level of :data:`FIGURE1_LEVELS` (``params`` 0: nothing fits)."""
    rows = []
    for gpus in gpu_counts:
        for level in FIGURE1_LEVELS:
            found = largest_model(gpus, level, capacity, seq, min_dp=min_dp) if gpus >= min_dp else None
            if found is None:
                rows.append({"gpus": gpus, "level": level, "params": 0})
                continue
            cfg, plan = found
            rows.append({"gpus": gpus, "level": level, "params": plan["params_total"], "hidden": cfg.hidden_size,
                         "layers": cfg.num_layers, "tp": cfg.tensor_model_parallel_size,
                         "pp": cfg.pipeline_model_parallel_size, "dp": cfg.data_parallel_size,
                         "gib_per_gpu": plan["total_gib"]})
    return rows


def write_figure1(args: argparse.Namespace) -> None:
    """Compute the rows for ``args`` and write ``args.output``'s .md, .json and .png."""
    gpu_counts = tuple(int(g) for g in args.gpus.split(","))
    capacity = args.gpu_memory_gb * 1e9 * (1 - args.headroom)
    rows = figure1(gpu_counts, capacity, args.seq_length, args.min_dp)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = [f"largest GPT (L = h/128, seq {args.seq_length}, micro-batch 1, full recompute, SP) fitting "
             f"N x {args.gpu_memory_gb:g} GB with {args.headroom:.0%} headroom, data parallel >= {args.min_dp}",
             "",
             "| GPUs | " + " | ".join(FIGURE1_LEVELS) + " | O3 / none+DO |", "| ---: |" + " ---: |" * (len(FIGURE1_LEVELS) + 1)]
    for gpus in gpu_counts:
        cells = []
        by = {r["level"]: r for r in rows if r["gpus"] == gpus}
        for level in FIGURE1_LEVELS:
            r = by[level]
            cells.append("-" if not r["params"] else
                         f"{r['params'] / 1e9:.1f}B (TP{r['tp']} PP{r['pp']} DP{r['dp']})")
        ratio = by["O3"]["params"] / by[_NONE_DO]["params"] if by[_NONE_DO]["params"] else float("nan")
        table.append(f"| {gpus} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    text = "\n".join(table)
    print(text)
    out.with_suffix(".md").write_text(text + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    labels = {"none": "BF16 mixed precision", _NONE_DO: "BF16 + distributed optimizer (ZeRO-1)",
              "O1": "FP8 O1", "O2": "FP8 O2", "O3": "FP8 O3 (FP8 distributed optimizer)"}
    styles = {"none": ("o", "-", 10), _NONE_DO: ("s", "--", 7), "O1": ("^", ":", 7), "O2": ("D", "-", 9),
              "O3": ("*", "--", 7)}  # distinct markers and dashes: levels that coincide stay visible
    for level in FIGURE1_LEVELS:
        pts = [(r["gpus"], r["params"] / 1e9) for r in rows if r["level"] == level and r["params"]]
        marker, dash, size = styles[level]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, linestyle=dash, markersize=size,
                label=labels[level])
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(list(gpu_counts), [str(g) for g in gpu_counts])
    ax.set_xlabel(f"number of {args.gpu_memory_gb:g} GB GPUs")
    ax.set_ylabel("largest trainable GPT (billion parameters)")
    ax.set_title(f"Largest GPT that fits (planner; seq 2048, mb 1, full recompute, DP >= {args.min_dp})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(f"wrote {out.with_suffix('.md')}, {out.with_suffix('.json')}, {out.with_suffix('.png')}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", default="8,16,32,64,128,256,512", help="GPU counts")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="memory per GPU (1e9 bytes)")
    p.add_argument("--headroom", type=float, default=0.1, help="fraction kept free")
    p.add_argument("--min-dp", type=int, default=1, help="smallest data-parallel size allowed")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--output", default="benchmarks/results/figure1", help="path stem of .md/.json/.png")
    write_figure1(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
