"""Per-GPU memory planner for GPT training with fp8lm on megatron-core (command line): model state,
activations and communication buffers for a model config (dense or mixture-of-experts), a parallel layout
(TP x PP x DP, expert parallelism over DP), micro-batch, sequence length, activation recomputation and FP8 opt
level; for mixture-of-experts models also the expert-parallel all-to-all's bytes per step. FP8-LM's Figure 1
question (the largest GPT that fits on N x 80 GB GPUs per opt level) is answered from this model by
``benchmarks/figure1.py``.

    python tools/memory_planner.py --num-layers 32 --hidden-size 4096 --num-attention-heads 32 \\
        --seq-length 2048 --vocab-size 50257 --bf16 --fp8-opt-level O2 --data-parallel-size 8 [--json]
    python tools/memory_planner.py ... --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 8 \\
        --moe-token-dispatcher-type alltoall --moe-fp8-dispatch

The model (``PlannerConfig``, ``plan_memory``, ``format_plan``) and its
assumptions live in the packaged module ``megatron.training.planning.memory_plan``; its names are re-exported here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __name__ == "__main__":  # run as a script from a checkout: the repository root holds megatron/training
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.training.config_rules import opt_level_arg  # noqa: E402
from megatron.training.planning.memory_plan import (  # noqa: E402  (re-exported: the planner's Python API)
    CATEGORIES,
    GEMM_BACKENDS,
    GRAD_ACCUMULATION,
    MOE_DISPATCHERS,
    MOE_LOAD_BALANCING,
    NORMALIZATIONS,
    OPT_LEVELS,
    POSITION_EMBEDDINGS,
    RECOMPUTE_GRANULARITIES,
    PlannerConfig,
    format_plan,
    plan_memory,
    whole_tensor_partition,
)

__all__ = ["PlannerConfig", "plan_memory", "format_plan", "CATEGORIES", "OPT_LEVELS", "whole_tensor_partition",
           "build_parser", "main"]


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
    p.add_argument("--normalization", choices=NORMALIZATIONS, default="LayerNorm")
    p.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    p.add_argument("--position-embedding-type", choices=POSITION_EMBEDDINGS, default="learned_absolute")
    p.add_argument("--disable-bias-linear", action="store_true")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--global-batch-size", type=int)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--recompute-activations", action="store_true", help="full recomputation")
    p.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES)
    p.add_argument("--data-parallel-size", type=int, default=None, help="default: WORLD_SIZE / (TP x PP), else 1")
    p.add_argument("--fp8-opt-level", type=opt_level_arg, default="none", metavar="{none,O1,O2,O3}",
                   help="none (alias O0): the high-precision baseline")
    p.add_argument("--fp8-grad-accumulation", choices=GRAD_ACCUMULATION, default="fp16",
                   help="FP8 weight gradients over micro-batches: scaled FP16 sums (2 B/element), fp32 sums (4 B) or "
                        "E4M3 (1 B)")
    p.add_argument("--fp8-recipe", choices=("tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4"),
                   default="tensorwise",
                   help="scale granularity: the weights' and saved inputs' scale grids")
    p.add_argument("--fp8-activations", action="store_true",
                   help="tensors saved for backward stored as E4M3 in 1x128 tiles (fp8.activations)")
    p.add_argument("--implementation", choices=("megatron-core", "transformers"), default="megatron-core",
                   help="whose layers save the activations: pretrain_gpt.py's megatron-core GPT, or transformers' "
                        "LlamaForCausalLM trained with fp8.initialize (RMSNorm, SwiGLU, RoPE; one device)")
    p.add_argument("--bf16", action="store_true",
                   help="pretrain_gpt.py's --bf16 (Megatron's): BF16 parameters, FP32 main gradients at level none "
                        "(18 B/param for the baseline)")
    p.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    p.add_argument("--fp8-min-dim", type=int, default=None,
                   help="linears whose per-rank GEMM has min(in, out) below this stay in high precision, as "
                        "pretrain_gpt.py's flag; default: pretrain_gpt.py's on this machine (2048 with CUDA, else 0): "
                        "pass 2048 to plan a GPU run's default from a CPU machine")
    p.add_argument("--use-distributed-optimizer", action="store_true", help="BF16 baseline: Megatron's ZeRO-1")
    p.add_argument("--hidden-dropout", type=float, default=0.0)
    p.add_argument("--attention-dropout", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer-model")
    p.add_argument("--fp8-amax-history-len", type=int, default=16)
    p.add_argument("--num-experts", type=int, help="every MLP a mixture of this many routed experts (default: dense)")
    p.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    p.add_argument("--moe-ffn-hidden-size", type=int, help="an expert's FFN size (default: --ffn-hidden-size)")
    p.add_argument("--moe-shared-expert-intermediate-size", type=int, help="FFN size of the shared expert")
    p.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="data-parallel ranks the routed experts are spread over")
    p.add_argument("--moe-token-dispatcher-type", choices=MOE_DISPATCHERS, default="allgather")
    p.add_argument("--moe-fp8-dispatch", action="store_true",
                   help="the expert-parallel all-to-all's rows in FP8 with a per-row scale")
    p.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="load-balancing loss coefficient")
    p.add_argument("--moe-router-load-balancing-type", choices=MOE_LOAD_BALANCING, default="aux_loss")
    p.add_argument("--moe-grouped-gemm", action="store_true",
                   help="a rank's experts as one grouped GEMM: their weights keep no transposes (otherwise planned as "
                        "megatron-core's SequentialMLP: the grouped GEMM's saved tensors are not modelled); needs "
                        "--tensor-model-parallel-size 1")
    p.add_argument("--fp8-gemm-backend", choices=GEMM_BACKENDS, default="auto",
                   help="pretrain_gpt.py's: where the input-gradient GEMM runs torch._scaled_mm (scaled_mm; auto on a "
                        "GPU, which the planner plans) each FP8 weight keeps its transposed copy (weight_transposes)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    for flag, kind in (("--lr", float), ("--min-lr", float), ("--lr-decay-style", str), ("--lr-warmup-iters", int),
                       ("--weight-decay", float), ("--clip-grad", float), ("--train-iters", int),
                       ("--eval-interval", int), ("--eval-iters", int), ("--log-interval", int),
                       ("--data-path", str), ("--save", str), ("--load", str), ("--save-interval", int),
                       ("--seed", int), ("--log-json", str), ("--init-method-std", float), ("--optimizer", str),
                       ("--lr-decay-iters", int), ("--adam-beta1", float), ("--adam-beta2", float),
                       ("--adam-eps", float), ("--split", str), ("--fp8-margin", int), ("--fp8-pipeline", str),
                       ("--compare", str), ("--plot", str)):
        p.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    for flag in ("--dry-run", "--fp32", "--mock-data", "--no-progress", "--compile-layers"):
        p.add_argument(flag, action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        plan = plan_memory(PlannerConfig.from_args(args))
    except ValueError as error:
        print(f"memory_planner: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
