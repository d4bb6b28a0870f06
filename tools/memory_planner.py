"""Per-GPU memory planner for GPT training with fp8lm on megatron-core (command line): model state,
activations and communication buffers for a model config, a parallel layout (TP x PP x DP), micro-batch,
sequence length, activation recomputation and FP8 opt level; plus FP8-LM's Figure 1 question (the largest
GPT that fits on N x 80 GB GPUs per opt level).

    python tools/memory_planner.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\
        --seq-length 2048 --vocab-size 50257 --bf16 --fp8-opt-level O2 --data-parallel-size 8 [--json]
    python tools/memory_planner.py --figure1 --output benchmarks/results/figure1

The model (``PlannerConfig``, ``plan_memory``, ``format_plan``, ``largest_model``, ``figure1``) and its
assumptions live in the packaged module ``megatron.training.memory_plan``; its names are re-exported here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script from a checkout: the repository root holds megatron/training
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.training.config_rules import opt_level_arg  # noqa: E402
from megatron.training.memory_plan import (  # noqa: E402  (re-exported: the planner's Python API)
    _GRAD_ACCUMULATION,
    _NONE_DO,
    _NORMS,
    _POSITIONS,
    _RECOMPUTE,
    CATEGORIES,
    FIGURE1_LEVELS,
    OPT_LEVELS,
    PlannerConfig,
    _default_min_fp8_dim,
    figure1,
    format_plan,
    largest_model,
    plan_memory,
    whole_tensor_partition,
)

__all__ = ["PlannerConfig", "plan_memory", "format_plan", "CATEGORIES", "OPT_LEVELS", "FIGURE1_LEVELS",
           "largest_model", "figure1", "whole_tensor_partition", "build_parser", "main"]


def _figure1_main(args: argparse.Namespace) -> None:
    gpu_counts = tuple(int(g) for g in args.gpus.split(","))
    capacity = args.gpu_memory_gb * 1e9 * (1 - args.headroom)
    rows = figure1(gpu_counts, capacity, args.seq_length or 2048, args.min_dp)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    table = [f"largest GPT (L = h/128, seq {args.seq_length or 2048}, micro-batch 1, full recompute, SP) fitting "
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


# -- CLI ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's model and parallelism flags (training-only flags are accepted and ignored)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--ffn-hidden-size", type=int)
    p.add_argument("--num-attention-heads", type=int)
    p.add_argument("--num-query-groups", type=int, help="grouped-query attention (default: heads)")
    p.add_argument("--seq-length", type=int)
    p.add_argument("--max-position-embeddings", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    p.add_argument("--swiglu", action="store_true")
    p.add_argument("--normalization", choices=_NORMS, default="LayerNorm")
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    p.add_argument("--position-embedding-type", choices=_POSITIONS, default="learned_absolute")
    p.add_argument("--disable-bias-linear", action="store_true")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--recompute-activations", action="store_true", help="full recomputation")
    p.add_argument("--recompute-granularity", choices=_RECOMPUTE)
    p.add_argument("--data-parallel-size", type=int, default=None, help="default: WORLD_SIZE / (TP x PP), else 1")
    p.add_argument("--fp8-opt-level", type=opt_level_arg, default="none", metavar="{none,O1,O2,O3}",
                   help="none (alias O0): the high-precision baseline")
    p.add_argument("--fp8-grad-accumulation", choices=_GRAD_ACCUMULATION, default="fp32")
    p.add_argument("--fp8-recipe", choices=("tensorwise", "rowwise", "blockwise"), default="tensorwise",
                   help="scale granularity: the weights' and saved inputs' scale grids")
    p.add_argument("--fp8-activations", action="store_true",
                   help="tensors saved for backward stored as E4M3 in 1x128 tiles (fp8.activations)")
    p.add_argument("--implementation", choices=("megatron-core", "transformers"), default="megatron-core",
                   help="whose layers save the activations: pretrain_gpt.py's megatron-core GPT, or transformers' "
                        "LlamaForCausalLM trained with fp8.initialize (RMSNorm, SwiGLU, RoPE; one device)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    p.add_argument("--use-distributed-optimizer", action="store_true", help="BF16 baseline: Megatron's ZeRO-1")
    p.add_argument("--hidden-dropout", type=float, default=0.0)
    p.add_argument("--attention-dropout", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer-model")
    p.add_argument("--fp8-amax-history-len", type=int, default=16)
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.add_argument("--figure1", action="store_true", help="largest GPT per GPU count and opt level")
    p.add_argument("--gpus", default="8,16,32,64,128,256,512", help="--figure1: GPU counts")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="--figure1: memory per GPU (1e9 bytes)")
    p.add_argument("--headroom", type=float, default=0.1, help="--figure1: fraction kept free")
    p.add_argument("--min-dp", type=int, default=1, help="--figure1: smallest data-parallel size allowed")
    p.add_argument("--output", default="benchmarks/results/figure1", help="--figure1: path stem of .md/.json/.png")
    for flag, kind in (("--lr", float), ("--min-lr", float), ("--lr-decay-style", str), ("--lr-warmup-iters", int),
                       ("--weight-decay", float), ("--clip-grad", float), ("--train-iters", int),
                       ("--eval-interval", int), ("--eval-iters", int), ("--log-interval", int),
                       ("--data-path", str), ("--save", str), ("--load", str), ("--save-interval", int),
                       ("--seed", int), ("--log-json", str), ("--init-method-std", float), ("--optimizer", str),
                       ("--lr-decay-iters", int), ("--adam-beta1", float), ("--adam-beta2", float),
                       ("--adam-eps", float), ("--split", str), ("--fp8-margin", int), ("--fp8-pipeline", str),
                       ("--compare", str), ("--plot", str)):
        p.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    for flag in ("--dry-run", "--fp32", "--mock-data", "--no-progress"):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.figure1:
        _figure1_main(args)
        return 0
    try:
        plan = plan_memory(PlannerConfig.from_args(args))
    except ValueError as error:
        print(f"memory_planner: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
