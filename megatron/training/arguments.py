"""Megatron-style command-line arguments of ``pretrain_gpt.py`` and their validation.

Flags keep Megatron-LM's names (``--num-layers``, ``--tensor-model-parallel-size``, ...); fp8lm adds
``--fp8-opt-level {none,O1,O2,O3}`` (``none`` is the high-precision baseline: BF16 mixed precision on
GPU, FP32 on CPU; ``O0`` is accepted as its alias and normalised to ``none``), ``--log-json``, ``--compare``, ``--plot``, ``--mock-data`` and ``--dry-run``.
:func:`validate_args` stops bad configurations at start-up with a message naming the fix (the layout rules it shares
with the memory planner are :func:`megatron.training.config_rules.check_config`); :func:`parse_config` returns the
frozen, typed :class:`~megatron.training.config.RunConfig` every component takes.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

import torch

from .compat import MegatronCoreVersionError, check_megatron_core_version
from .config import RunConfig, config_from_args
from .config_rules import (GEMM_BACKENDS, OPT_LEVELS, ConfigurationError, check_config, check_expert_fp8_shapes,
                           check_split, high_precision_layers, normalize_opt_level, opt_level_arg)
from .monitoring.output_paths import check_output_path

__all__ = ["parse_args", "check_recipe_hardware", "validate_args", "parse_config", "config_from_args", "RunConfig", "build_parser", "ConfigurationError", "OPT_LEVEL_CHOICES", "DEMO_DEFAULTS",
           "FP8_ONLY_FLAGS", "baseline_argv"]

OPT_LEVEL_CHOICES = OPT_LEVELS

DEMO_DEFAULTS = {
    "num_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "seq_length": 128, "micro_batch_size": 16,
    "global_batch_size": 16, "train_iters": 300, "lr": 1e-3, "min_lr": 1e-4, "lr_warmup_iters": 30,
    "eval_interval": 100, "eval_iters": 8, "compare": "none", "fp8_opt_level": "O2",
}
"""The embedded default run (``pretrain_gpt.py`` with no arguments): a small GPT on the Shakespeare
corpus, FP8 O2 beside the baseline, on CPU in a few minutes."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_gpt.py", description="Pretrain a GPT with megatron-core in FP8 (fp8lm).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument("--num-layers", type=int, default=4)
    m.add_argument("--hidden-size", type=int, default=128)
    m.add_argument("--ffn-hidden-size", type=int, default=None, help="default: 4 x hidden size")
    m.add_argument("--num-attention-heads", type=int, default=4)
    m.add_argument("--num-query-groups", type=int, default=None, help="grouped-query attention (default: heads)")
    m.add_argument("--seq-length", type=int, default=128)
    m.add_argument("--max-position-embeddings", type=int, default=None, help="default: seq length")
    m.add_argument("--vocab-size", type=int, default=None, help="vocabulary size without a tokenizer (mock data)")
    m.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    m.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"), default="LayerNorm")
    m.add_argument("--swiglu", action="store_true")
    m.add_argument("--disable-bias-linear", action="store_true")
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    m.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"), default="learned_absolute")
    m.add_argument("--init-method-std", type=float, default=0.02)
    m.add_argument("--hidden-dropout", type=float, default=0.0)
    m.add_argument("--attention-dropout", type=float, default=0.0)
    par = p.add_argument_group("parallelism")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--data-parallel-size", type=int, default=None,
                     help="--dry-run only: the data-parallel size to plan for (otherwise world size / (TP x PP))")
    par.add_argument("--recompute-activations", action="store_true", help="full activation recomputation")
    par.add_argument("--compile-layers", action="store_true",
                     help="torch.compile each transformer layer (fullgraph: one graph per layer, Inductor fusing the "
                          "non-GEMM ops around the FP8 GEMMs; compiled at the first step, which takes longer: "
                          "docs/gpu.md)")
    moe = p.add_argument_group("mixture of experts (megatron-core's MoE layer; docs/moe.md)")
    moe.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: dense MLPs)")
    moe.add_argument("--moe-router-topk", type=int, default=2, help="experts each token is routed to")
    moe.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="an expert's FFN size (default: --ffn-hidden-size)")
    moe.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                     help="FFN size of the shared expert every token also runs through (default: none)")
    moe.add_argument("--expert-model-parallel-size", type=int, default=1, help="ranks the experts are spread over")
    moe.add_argument("--moe-token-dispatcher-type", choices=("allgather", "alltoall"), default="allgather")
    moe.add_argument("--moe-grouped-gemm", action="store_true",
                     help="a rank's local experts as one grouped GEMM (FP8: one grouped FP8 GEMM)")
    moe.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="load-balancing loss coefficient")
    moe.add_argument("--moe-router-load-balancing-type", choices=("aux_loss", "seq_aux_loss", "sinkhorn", "none"),
                     default="aux_loss")
    moe.add_argument("--moe-fp8-dispatch", action="store_true",
                     help="expert-parallel token dispatch in E4M3 with per-token scales (needs --fp8-opt-level != none)")
    b = p.add_argument_group("batch and optimizer")
    b.add_argument("--micro-batch-size", type=int, default=16)
    b.add_argument("--global-batch-size", type=int, default=None, help="default: micro batch x data-parallel size")
    b.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    b.add_argument("--lr", type=float, default=1e-3)
    b.add_argument("--min-lr", type=float, default=0.0)
    b.add_argument("--lr-decay-style", choices=("constant", "linear", "cosine"), default="cosine")
    b.add_argument("--lr-warmup-iters", type=int, default=0)
    b.add_argument("--lr-decay-iters", type=int, default=None, help="default: train iters")
    b.add_argument("--weight-decay", type=float, default=0.1)
    b.add_argument("--adam-beta1", type=float, default=0.9)
    b.add_argument("--adam-beta2", type=float, default=0.95)
    b.add_argument("--adam-eps", type=float, default=1e-8)
    b.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    b.add_argument("--use-distributed-optimizer", action="store_true",
                   help="baseline (--fp8-opt-level none): shard FP32 Adam states over data parallel (ZeRO-1); "
                        "the FP8 equivalent is --fp8-opt-level O3")
    t = p.add_argument_group("training")
    t.add_argument("--train-iters", type=int, default=300)
    t.add_argument("--eval-interval", type=int, default=100)
    t.add_argument("--eval-iters", type=int, default=8)
    t.add_argument("--log-interval", type=int, default=10)
    t.add_argument("--max-skipped-steps", type=int, default=10,
                   help="stop with an error when more than N of the last --skipped-steps-window iterations were "
                        "skipped for non-finite gradients")
    t.add_argument("--skipped-steps-window", type=int, default=100)
    t.add_argument("--seed", type=int, default=1234)
    t.add_argument("--bf16", action="store_true", help="baseline and activations in BF16 (default on GPU)")
    t.add_argument("--fp32", action="store_true", help="baseline and activations in FP32 (default on CPU)")
    d = p.add_argument_group("data")
    d.add_argument("--data-path", default=None, help="PREFIX_text_document from tools/preprocess_data.py")
    d.add_argument("--tokenizer-model", default=None, help="sentencepiece model (PREFIX.model)")
    d.add_argument("--split", default="949,50,1")
    d.add_argument("--mock-data", action="store_true", help="synthetic tokens (tests, benchmarks)")
    c = p.add_argument_group("checkpointing")
    c.add_argument("--save", default=None)
    c.add_argument("--load", default=None)
    c.add_argument("--save-interval", type=int, default=None, help="default: at the end only")
    c.add_argument("--ckpt-step", type=int, default=None, help="--load this iteration instead of the latest")
    c.add_argument("--load-fallback", action="store_true",
                   help="--load: when the checkpoint fails its checksums, load the newest earlier iteration that "
                        "verifies (warned on stderr)")
    c.add_argument("--override-opt-param-scheduler", action="store_true",
                   help="--load: continue with this run's learning-rate schedule and batch size, not the checkpoint's")
    c.add_argument("--exit-interval", type=int, default=None, help="stop (after saving) at iterations divisible by N")
    c.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="stop (after saving) once this many minutes have passed since start-up")
    c.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM, finish the iteration, save (with --save) and stop")
    f = p.add_argument_group("fp8")
    f.add_argument("--fp8-opt-level", type=opt_level_arg, default="O2", metavar="{none,O1,O2,O3}",
                   help="FP8 opt level; none (alias O0) is the high-precision baseline")
    f.add_argument("--fp8-amax-history-len", type=int, default=16)
    f.add_argument("--fp8-margin", type=int, default=0)
    f.add_argument("--fp8-grad-accumulation", choices=("fp16", "fp32", "fp8"), default="fp16",
                   help="FP8 weight gradients over micro-batches (Float8LinearConfig.grad_accumulation): summed in a "
                        "scaled FP16 buffer (2 B/element, default) or in fp32 (4 B) and quantized once for the "
                        "data-parallel reduction, or held as E4M3 (1 B; one or a few micro-batches)")
    f.add_argument("--fp8-recipe", choices=("tensorwise", "rowwise", "blockwise", "mxfp8"), default="tensorwise",
                   help="granularity of the FP8 scales (fp8.recipes): one per tensor (delayed, E4M3/E5M2), per row "
                        "(tokens and output channels), DeepSeek-style blocks (1x128 activation and gradient tiles, "
                        "128x128 weight blocks) or MXFP8 (1x32 tiles and 32x32 weight blocks, E8M0 scales; NVIDIA "
                        "Blackwell, compute capability >= 10.0, emulated on the CPU), E4M3 everywhere for the last three")
    f.add_argument("--fp4-format", choices=("e2m1",), default=None,
                   help="with --fp4-recipe nvfp4: the FP4 value format (E2M1, Megatron's flag)")
    f.add_argument("--fp4-recipe", choices=("nvfp4",), default=None,
                   help="NVFP4 GEMMs (fp8.nvfp4; NVIDIA Blackwell, emulated on the CPU): E2M1 values, E4M3 scales per 16 "
                        "elements along K and one per tensor, 16x16 weight blocks (the weight held as E4M3), stochastic "
                        "rounding of output gradients, a 16x16 random Hadamard transform on the weight-gradient GEMM, "
                        "and the last transformer layer in high precision as NVIDIA's recipe keeps its last layers "
                        "(--num-layers-at-end-in-bf16 N sets how many, 0 none); needs --fp4-format e2m1; replaces "
                        "--fp8-recipe")
    f.add_argument("--no-fp4-hadamard", dest="fp4_hadamard", action="store_false",
                   help="--fp4-recipe nvfp4 without the random Hadamard transform of the weight-gradient operands")
    f.add_argument("--no-fp4-stochastic-rounding", dest="fp4_stochastic_rounding", action="store_false",
                   help="--fp4-recipe nvfp4 rounding output gradients to nearest instead of stochastically")
    f.add_argument("--fp4-bf16-forward-from-iteration", type=int, default=None, metavar="N",
                   help="--fp4-recipe nvfp4 with the forward GEMMs in BF16 from iteration N on (1-based, as the logs "
                        "count; the backward GEMMs stay NVFP4), as NVIDIA's NVFP4 recipe does for the last part of "
                        "training; decided from the iteration number, so a resumed run switches at the same iteration")
    f.add_argument("--fp8-high-precision-from-iteration", type=int, default=None, metavar="N",
                   help="from iteration N on (1-based, as the logs count) every FP8 linear runs in high precision: its "
                        "forward GEMM (--fp8-high-precision-mode forward, the default; the backward stays FP8) or all "
                        "three GEMMs (linear; the input is then saved in high precision), weights still FP8 at rest; "
                        "decided from the iteration number, so a resumed run switches at the same iteration")
    f.add_argument("--fp8-high-precision-mode", choices=("forward", "linear"), default="forward",
                   help="what --fp8-high-precision-from-iteration runs in high precision: the forward GEMM or the "
                        "whole linear")
    f.add_argument("--swiglu-smooth", action="store_true",
                   help="Smooth-SwiGLU (with --swiglu, the tensorwise recipe, dense MLPs): each MLP's linear_fc2 scales "
                        "its input (the gated product) per channel by a power of two before the FP8 cast and folds the "
                        "inverse into its weight operand: the same function, no saturation on outlier channels "
                        "(fp8.smooth_swiglu; docs/precision.md)")
    f.add_argument("--fp8-gemm-backend", choices=GEMM_BACKENDS, default="auto",
                   help="the FP8 GEMMs of every FP8 linear (Float8LinearConfig.gemm_backend): auto (torch._scaled_mm or "
                        "the Triton block GEMM on a CUDA GPU where they take the operands, the emulation elsewhere, the "
                        "CPU included), scaled_mm (the hardware GEMM everywhere: a GEMM it cannot take is refused at "
                        "start-up, naming the layer and the shape; on CPU torch's reference _scaled_mm, bit-identical "
                        "to the emulation and much slower) or emulated (dequantize, fp32 matmul)")
    f.add_argument("--fp8-activations", action="store_true",
                   help="store the tensors non-linear ops save for backward (norms, activations, gated products, "
                        "attention inputs) as E4M3 in 1x128 tiles (fp8.activations), at every opt level")
    f.add_argument("--first-last-layers-bf16", action="store_true",
                   help="keep the first --num-layers-at-start-in-bf16 and last --num-layers-at-end-in-bf16 "
                        "transformer layers out of FP8 (high precision: BF16 with --bf16 or autocast, FP32 on CPU)")
    f.add_argument("--num-layers-at-start-in-bf16", type=int, default=1,
                   help="with --first-last-layers-bf16: global layers at the start kept out of FP8")
    f.add_argument("--num-layers-at-end-in-bf16", type=int, default=1,
                   help="with --first-last-layers-bf16: global layers at the end kept out of FP8")
    f.add_argument("--fp8-precision-config", default=None, metavar="FILE",
                   help="per-linear precision rules (JSON or YAML): ordered glob patterns over module names "
                        "(decoder.layers.<i>.mlp.linear_fc1, ...) -> bf16/high or fp8 with a recipe and formats; the "
                        "first match wins (docs/precision.md)")
    f.add_argument("--fp8-stats-interval", type=int, default=0,
                   help="FP8 numerics statistics every N steps (amax, scale, flushed-to-zero and saturated fractions per "
                        "FP8 GEMM operand), read at --log-interval into the JSON log and TensorBoard; 0: off")
    f.add_argument("--fp8-stats-saturation-alarm", type=float, default=1e-3,
                   help="warn when more than this fraction of an operand's values saturate")
    f.add_argument("--fp8-stats-flush-alarm", type=float, default=0.5,
                   help="warn when more than this fraction of an operand's non-zero values flush to zero")
    f.add_argument("--fp8-stats-loss-spike", type=float, default=2.0,
                   help="warn when a logged loss exceeds this many times the mean of the previous ones (0: off)")
    f.add_argument("--fp8-stats-stop", action="store_true", help="stop the run (exit status 1) on an FP8 alarm")
    f.add_argument("--fp8-auto-fallback", action="store_true",
                   help="a linear whose input or output gradient raises an FP8 alarm (saturation, flush to zero, "
                        "non-finite values, or a loss spike its amax growth is blamed for) at --fp8-fallback-patience "
                        "consecutive checks moves one rung down --fp8-fallback-ladder, on every rank at the same "
                        "iteration, logged and kept in checkpoints (fp8.fallback; docs/precision.md); checks are the "
                        "log points with statistics (--fp8-stats-interval, 10 by default with this flag)")
    f.add_argument("--fp8-fallback-patience", type=int, default=3, metavar="K",
                   help="with --fp8-auto-fallback: consecutive alarmed checks before a linear moves")
    f.add_argument("--fp8-fallback-ladder", default="tensorwise,rowwise,blockwise,high",
                   help="with --fp8-auto-fallback: the settings a linear steps through, least safe first "
                        "(tensorwise, rowwise, blockwise: FP8 recipes; high: all its GEMMs in high precision)")
    f.add_argument("--fp8-fallback-restore-after", type=int, default=0, metavar="M",
                   help="with --fp8-auto-fallback: move a linear one rung back after M consecutive clean checks "
                        "(0: never)")
    f.add_argument("--fp8-min-dim", type=int, default=None,
                   help="linears whose per-rank GEMM has min(in, out) below this stay in high precision (announced "
                        "at start-up); default: 2048 on CUDA (the measured FP8/BF16 crossover), 0 on CPU")
    f.add_argument("--fp8-pipeline", choices=("auto", "on", "off"), default="auto",
                   help="FP8 messages between pipeline stages (auto: on with FP8 levels)")
    o = p.add_argument_group("output")
    o.add_argument("--log-json", default=None, help="one JSON object per iteration")
    o.add_argument("--compare", default=None,
                   help="also train these levels (comma-separated, e.g. none,O1) at the same seed and data, then "
                        "print a side-by-side summary and plot the loss curves")
    o.add_argument("--plot", default=None, help="loss-curve PNG (default: next to --log-json, or ./loss_curves.png)")
    o.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress display")
    o.add_argument("--tensorboard-dir", default=None, metavar="DIR",
                   help="TensorBoard event files, one run per opt level (DIR/<level>): loss, validation loss, lr, grad "
                        "norm, skipped steps, tokens/s, memory by category, bytes sent by what travelled")
    o.add_argument("--wandb-project", default=None, help="the same scalars to Weights & Biases (needs wandb)")
    o.add_argument("--collective-trace", default=None, metavar="DIR",
                   help="record every rank's torch.distributed calls (fp8lm's and megatron-core's) in DIR/rank<R>.jsonl "
                        "and check them against NCCL's rules at the end (fp8.comm_trace); a violation (a pipeline "
                        "deadlock, a collective issued by some ranks only) fails the run with exit status 1")
    o.add_argument("--dry-run", action="store_true",
                   help="build the model on the meta device, validate, print parameters per rank and planned memory")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv``; with no arguments at all, the embedded default demo run (:data:`DEMO_DEFAULTS`).
    ``args.explicit_flags``: the destinations the command line set (what :func:`validate_args` refuses where it has no
    effect)."""
    parser = build_parser()
    demo = argv is not None and len(argv) == 0
    args = parser.parse_args(argv)
    args.demo = demo
    args.explicit_flags = _explicit_flags(parser, sys.argv[1:] if argv is None else argv)
    if demo:
        for key, value in DEMO_DEFAULTS.items():
            setattr(args, key, value)
    return args


def _explicit_flags(parser: argparse.ArgumentParser, argv: list[str]) -> frozenset[str]:
    """The destinations ``argv`` sets itself (a flag given with its default value included): ``argv`` parsed again
    into a namespace holding a marker for every destination (argparse fills in only what is missing)."""
    unset = object()
    namespace = argparse.Namespace(**{dest: unset for dest in vars(parser.parse_args([]))})
    parser.parse_args(argv, namespace=namespace)
    return frozenset(dest for dest, value in vars(namespace).items() if value is not unset)


FP8_ONLY_FLAGS = ("--fp8-amax-history-len", "--fp8-margin", "--fp8-grad-accumulation", "--fp8-recipe", "--fp4-format",
                  "--fp4-recipe", "--no-fp4-hadamard", "--no-fp4-stochastic-rounding",
                  "--fp8-gemm-backend", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16",
                  "--num-layers-at-end-in-bf16", "--fp8-precision-config", "--fp8-min-dim",
                  "--fp8-stats-saturation-alarm", "--fp8-stats-flush-alarm", "--fp8-stats-loss-spike", "--fp8-stats-stop",
                  "--fp8-auto-fallback", "--fp8-fallback-patience", "--fp8-fallback-ladder", "--fp8-fallback-restore-after",
                  "--fp8-high-precision-from-iteration", "--fp8-high-precision-mode", "--swiglu-smooth")
"""Flags that only change FP8 training: refused where no FP8 level trains (``--fp8-opt-level none`` and no FP8 level
in ``--compare``). ``--fp8-activations`` and ``--fp8-pipeline on`` act at every level."""


def baseline_argv(argv: list[str]) -> list[str]:
    """``argv`` less the :data:`FP8_ONLY_FLAGS` (with their values: ``--flag V`` or ``--flag=V``): the same run at
    ``--fp8-opt-level none``, which refuses them. For harnesses that train one set of flags at several levels."""
    switches = {"--first-last-layers-bf16", "--fp8-stats-stop", "--no-fp4-hadamard", "--no-fp4-stochastic-rounding",
                "--fp8-auto-fallback", "--swiglu-smooth"}
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in FP8_ONLY_FLAGS:
            skip = arg not in switches
        elif arg.split("=", 1)[0] not in FP8_ONLY_FLAGS:
            out.append(arg)
    return out


def _compare_levels(args: argparse.Namespace) -> list[str]:
    """``--compare``'s levels, normalised, each once, in the order given."""
    return list(dict.fromkeys(normalize_opt_level(lvl.strip(), "--compare")
                              for lvl in (args.compare or "").split(",") if lvl.strip()))


def _trained_levels(args: argparse.Namespace) -> set[str]:
    """The opt levels the run trains: ``--fp8-opt-level`` and ``--compare``'s (which train with the same flags)."""
    return {args.fp8_opt_level, *_compare_levels(args)}


def _them(flags: list[str]) -> str:
    return "it" if len(flags) == 1 else "them"


def _given(args: argparse.Namespace, flag: str) -> bool:
    """Whether the command line set ``flag`` (a namespace not made by :func:`parse_args`: set to a non-default)."""
    dest = flag.lstrip("-").replace("-", "_")
    explicit = vars(args).get("explicit_flags")
    if explicit is not None:
        return dest in explicit
    return vars(args).get(dest) != build_parser().get_default(dest)


def _check_no_silent_flags(args: argparse.Namespace) -> None:
    """Flags that would have no effect in this configuration, refused naming why (rc 2 from pretrain_gpt.py)."""
    levels = _trained_levels(args)
    if levels == {"none"}:
        idle = [flag for flag in FP8_ONLY_FLAGS if _given(args, flag)]
        if idle:
            raise ConfigurationError(f"{', '.join(idle)}: no effect, no FP8 level trains (--fp8-opt-level none"
                                     f"{'' if not args.compare else ', --compare ' + args.compare}): drop "
                                     f"{_them(idle)}, or train an FP8 level (--fp8-opt-level O1/O2/O3 or --compare O2)")
    if not args.first_last_layers_bf16:
        idle = [flag for flag in ("--num-layers-at-start-in-bf16", "--num-layers-at-end-in-bf16") if _given(args, flag)]
        if idle:
            raise ConfigurationError(f"{', '.join(idle)}: no effect without --first-last-layers-bf16 (the counts of "
                                     f"the layers it keeps out of FP8): add it, or drop {_them(idle)}")
    if not args.fp8_stats_interval:
        idle = [flag for flag in ("--fp8-stats-saturation-alarm", "--fp8-stats-flush-alarm", "--fp8-stats-loss-spike",
                                  "--fp8-stats-stop") if _given(args, flag)]
        if idle:
            raise ConfigurationError(f"{', '.join(idle)}: no effect without --fp8-stats-interval N (the alarms read "
                                     f"the FP8 statistics it collects): add it, or drop {_them(idle)}")
    if args.mock_data:
        idle = [flag for flag in ("--data-path", "--tokenizer-model") if _given(args, flag)]
        if idle:
            raise ConfigurationError(f"--mock-data trains on synthetic tokens, so {' and '.join(idle)} would be "
                                     f"ignored: drop --mock-data to train on the data, or drop {', '.join(idle)}")


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _check_fp8_stats(args: argparse.Namespace) -> None:
    if args.fp8_stats_interval < 0:
        raise ConfigurationError(f"--fp8-stats-interval must be >= 0 (0: off), got {args.fp8_stats_interval}")
    if args.fp8_stats_interval and args.fp8_opt_level == "none":
        raise ConfigurationError("--fp8-stats-interval collects FP8 statistics: it needs --fp8-opt-level O1/O2/O3")
    for flag, value in (("--fp8-stats-saturation-alarm", args.fp8_stats_saturation_alarm),
                        ("--fp8-stats-flush-alarm", args.fp8_stats_flush_alarm)):
        if not 0.0 <= value <= 1.0:
            raise ConfigurationError(f"{flag} is a fraction in [0, 1], got {value}")
    if args.fp8_stats_loss_spike < 0:
        raise ConfigurationError(f"--fp8-stats-loss-spike must be >= 0 (0: off), got {args.fp8_stats_loss_spike}")
    fallback_flags = [flag for flag, given in (
        ("--fp8-fallback-patience", args.fp8_fallback_patience != 3),
        ("--fp8-fallback-ladder", args.fp8_fallback_ladder != "tensorwise,rowwise,blockwise,high"),
        ("--fp8-fallback-restore-after", args.fp8_fallback_restore_after != 0)) if given]
    if not args.fp8_auto_fallback:
        if fallback_flags:
            raise ConfigurationError(f"{', '.join(fallback_flags)} apply to --fp8-auto-fallback: add it, or drop them")
        return
    if args.fp8_opt_level == "none":
        raise ConfigurationError("--fp8-auto-fallback moves FP8 linears: it needs --fp8-opt-level O1/O2/O3")
    if args.fp8_stats_stop:
        raise ConfigurationError("--fp8-auto-fallback acts on FP8 alarms and --fp8-stats-stop stops the run at the "
                                 "first one: use one of them")
    from .monitoring.fp8_numerics import fallback_config

    try:
        ladder = fallback_config(args).ladder
    except ValueError as error:
        raise ConfigurationError(f"--fp8-fallback-*: {error}") from None
    recipe = "nvfp4" if args.fp4_recipe else args.fp8_recipe
    if recipe not in ("tensorwise", "rowwise", "blockwise"):
        raise ConfigurationError(f"--fp8-auto-fallback observes the tensorwise, rowwise and blockwise recipes' casts; "
                                 f"the run's recipe {recipe} is not one of them: drop the flag")
    if recipe not in ladder:
        raise ConfigurationError(f"--fp8-auto-fallback moves linears down --fp8-fallback-ladder from their recipe, and "
                                 f"--fp8-recipe {recipe} is not on it: start the ladder at it, e.g. '{recipe},high'")
    if args.sequence_parallel and all(s == "high" for s in ladder[ladder.index(recipe) + 1:]):
        raise ConfigurationError("--fp8-auto-fallback with --sequence-parallel: linears whose inputs are all-gathered "
                                 "in FP8 do not run in high precision, so this ladder could never move one; put a "
                                 "recipe on --fp8-fallback-ladder after the run's (e.g. tensorwise,rowwise,blockwise)")
    if args.fp8_stats_interval == 0:
        args.fp8_stats_interval = 10  # the statistics the fallback decides from: every 10 steps


def _check_moe(args: argparse.Namespace, dp: int) -> None:
    """The mixture-of-experts flags: consistent with each other and the layout (fills --moe-ffn-hidden-size)."""
    ep = args.expert_model_parallel_size
    if args.num_experts is None:
        moe_only = [flag for flag, value in (("--expert-model-parallel-size", ep != 1),
                                             ("--moe-ffn-hidden-size", args.moe_ffn_hidden_size is not None),
                                             ("--moe-grouped-gemm", args.moe_grouped_gemm),
                                             ("--moe-fp8-dispatch", args.moe_fp8_dispatch),
                                             ("--moe-shared-expert-intermediate-size",
                                              args.moe_shared_expert_intermediate_size is not None)) if value]
        if moe_only:
            raise ConfigurationError(f"{', '.join(moe_only)} need(s) --num-experts (the model has dense MLPs)")
        return
    if args.num_experts < 1:
        raise ConfigurationError(f"--num-experts must be >= 1, got {args.num_experts}")
    if not 1 <= args.moe_router_topk <= args.num_experts:
        raise ConfigurationError(f"--moe-router-topk {args.moe_router_topk} must be in [1, --num-experts "
                                 f"{args.num_experts}]")
    if ep < 1 or args.num_experts % ep:
        raise ConfigurationError(f"--expert-model-parallel-size {ep} must divide --num-experts {args.num_experts}")
    if dp % ep:
        raise ConfigurationError(
            f"--expert-model-parallel-size {ep} must divide the data-parallel size {dp} (experts are spread over "
            f"data-parallel ranks): launch a multiple of TP x PP x EP processes")
    # --compare's levels train with the same flags: a baseline level among them dispatches in its own dtype
    levels = _trained_levels(args)
    if args.moe_fp8_dispatch and (levels == {"none"} or args.moe_token_dispatcher_type != "alltoall"):
        raise ConfigurationError("--moe-fp8-dispatch dispatches tokens in FP8 over the expert-parallel all-to-all: it "
                                 "needs --fp8-opt-level O1/O2/O3 and --moe-token-dispatcher-type alltoall")
    if args.moe_fp8_dispatch and ep == 1:
        raise ConfigurationError("--moe-fp8-dispatch: at --expert-model-parallel-size 1 no token leaves its rank (there "
                                 "is no all-to-all to send in FP8); set --expert-model-parallel-size > 1 or drop the flag")
    if ep > 1 and args.bf16 and args.use_distributed_optimizer and args.fp8_opt_level == "none":
        raise ConfigurationError("--bf16 --use-distributed-optimizer gathers BF16 parameters over the whole "
                                 "data-parallel group, which expert parallelism splits: drop "
                                 "--use-distributed-optimizer, or use --fp8-opt-level O3 (experts sharded over the "
                                 "expert-data-parallel group)")
    if args.moe_grouped_gemm and args.tensor_model_parallel_size > 1:
        raise ConfigurationError("--moe-grouped-gemm runs each expert unsplit (expert tensor-parallel size 1), but "
                                 f"--tensor-model-parallel-size {args.tensor_model_parallel_size} splits the experts: use "
                                 "--tensor-model-parallel-size 1 (spread the experts with "
                                 "--expert-model-parallel-size instead), or drop --moe-grouped-gemm")
    if args.moe_shared_expert_intermediate_size is not None and not args.disable_bias_linear:
        raise ConfigurationError("--moe-shared-expert-intermediate-size: megatron-core's shared expert takes no bias; "
                                 "add --disable-bias-linear")
    if args.tensor_model_parallel_size > 1 and not args.disable_bias_linear:
        raise ConfigurationError("experts split by tensor parallelism take no bias (megatron-core): add "
                                 "--disable-bias-linear, or use --tensor-model-parallel-size 1")
    if args.moe_aux_loss_coeff < 0:
        raise ConfigurationError(f"--moe-aux-loss-coeff must be >= 0, got {args.moe_aux_loss_coeff}")
    for flag, value in (("--moe-ffn-hidden-size", args.moe_ffn_hidden_size),
                        ("--moe-shared-expert-intermediate-size", args.moe_shared_expert_intermediate_size)):
        if value is not None and value < 1:
            raise ConfigurationError(f"{flag} must be >= 1, got {value} (leave --moe-ffn-hidden-size out for the "
                                     f"dense --ffn-hidden-size)")
    args.moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size
    if levels - {"none"}:
        check_expert_fp8_shapes(args.moe_ffn_hidden_size, args.moe_shared_expert_intermediate_size,
                                args.tensor_model_parallel_size)


def validate_args(args: argparse.Namespace, world_size: int | None = None) -> argparse.Namespace:
    """Check and complete ``args`` (derived sizes filled in); raise :class:`ConfigurationError` naming the fix."""
    try:
        check_megatron_core_version()  # the one version megatron/training/compat/ patches
    except MegatronCoreVersionError as error:
        raise ConfigurationError(str(error)) from None
    args.fp8_opt_level = normalize_opt_level(args.fp8_opt_level)
    _resolve_fp4_recipe(args)
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if tp < 1 or pp < 1:
        raise ConfigurationError("--tensor-model-parallel-size and --pipeline-model-parallel-size must be >= 1")
    if args.dry_run:
        dp = args.data_parallel_size or max(1, (world_size or _world()) // (tp * pp))
    else:
        world = world_size or _world()
        if world % (tp * pp):
            raise ConfigurationError(
                f"world size {world} is not divisible by TP x PP = {tp} x {pp}: launch a multiple of {tp * pp} processes"
            )
        dp = world // (tp * pp)
        if args.data_parallel_size is not None and args.data_parallel_size != dp:
            raise ConfigurationError(
                f"--data-parallel-size {args.data_parallel_size} != world size / (TP x PP) = {dp}; it is only for --dry-run"
            )
    args.data_parallel_size = dp
    check_split(args.split)
    # Every output path, before any training (megatron/training/monitoring/output_paths.py).
    for flag, path, is_dir in (("--save", args.save, True), ("--log-json", args.log_json, False),
                               ("--plot", args.plot, False), ("--collective-trace", args.collective_trace, True),
                               ("--tensorboard-dir", args.tensorboard_dir, True)):
        check_output_path(path, flag, directory=is_dir)
    for flag, value, package in (("--tensorboard-dir", args.tensorboard_dir, "tensorboard"),
                                 ("--wandb-project", args.wandb_project, "wandb")):
        if value and importlib.util.find_spec(package) is None:
            raise ConfigurationError(f"{flag} needs the {package} package: pip install {package}")
    if args.sequence_parallel and tp == 1:
        args.sequence_parallel = False
    args.ffn_hidden_size = args.ffn_hidden_size or 4 * args.hidden_size
    args.max_position_embeddings = args.max_position_embeddings or args.seq_length
    if args.global_batch_size is None:
        args.global_batch_size = args.micro_batch_size * dp
    check_config(  # the rules the memory planner applies too (megatron/training/config_rules.py)
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, ffn_hidden_size=args.ffn_hidden_size, seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        sequence_parallel=args.sequence_parallel, fp8_opt_level=args.fp8_opt_level,
        use_distributed_optimizer=args.use_distributed_optimizer, swiglu=args.swiglu,
        max_position_embeddings=args.max_position_embeddings, position_embedding_type=args.position_embedding_type,
    )
    _check_no_silent_flags(args)
    _check_moe(args, dp)
    for switch, value in (("--fp4-bf16-forward-from-iteration", args.fp4_bf16_forward_from_iteration),
                          ("--fp8-high-precision-from-iteration", args.fp8_high_precision_from_iteration)):
        if value is None:
            continue
        if value < 1:
            raise ConfigurationError(f"{switch} {value}: iterations count from 1")
        for flag, on in (("--sequence-parallel", args.sequence_parallel), ("--num-experts", args.num_experts)):
            if on:
                raise ConfigurationError(f"{switch} with {flag}: the high-precision GEMMs run on linears whose input "
                                         f"is neither all-gathered nor routed to experts; drop one of the two")
    if args.fp8_high_precision_from_iteration is not None:
        if args.fp8_opt_level == "none":
            raise ConfigurationError("--fp8-high-precision-from-iteration switches FP8 linears: it needs "
                                     "--fp8-opt-level O1/O2/O3")
        if args.fp4_bf16_forward_from_iteration is not None:
            raise ConfigurationError("--fp4-bf16-forward-from-iteration and --fp8-high-precision-from-iteration both "
                                     "schedule the switch: pass one (the second also takes --fp8-high-precision-mode)")
    elif args.fp8_high_precision_mode != "forward":
        raise ConfigurationError("--fp8-high-precision-mode applies to --fp8-high-precision-from-iteration: add it, or "
                                 "drop the mode")
    _check_fp8_stats(args)
    if args.swiglu_smooth:
        for problem, fix in ((not args.swiglu, "add --swiglu (it smooths the gated product)"),
                             (args.fp8_recipe != "tensorwise" or args.fp4_recipe is not None,
                              f"the {args.fp4_recipe or args.fp8_recipe} recipe scales each token or tile from its own "
                              f"amax and never saturates: drop --swiglu-smooth, or use --fp8-recipe tensorwise"),
                             (args.num_experts is not None, "MoE experts are not smoothed: drop --swiglu-smooth or "
                                                            "--num-experts")):
            if problem:
                raise ConfigurationError(f"--swiglu-smooth: {fix}")
    high_precision_layers(args.first_last_layers_bf16, args.num_layers_at_start_in_bf16,  # checked at start-up
                          args.num_layers_at_end_in_bf16, args.num_layers)
    # the rules of --fp8-precision-config, read and checked once now (matched when the model is built), as the
    # checkpoints save and compare them: [pattern, precision, overrides] each (None without a file)
    args.fp8_precision_rules = None
    if args.fp8_precision_config:
        if args.first_last_layers_bf16:
            raise ConfigurationError("--first-last-layers-bf16 and --fp8-precision-config both choose layers' "
                                     "precision: use one (a rule like 'decoder.layers.0.*' -> bf16 keeps a layer)")
        from fp8.precision_rules import load_precision_file

        try:
            rules = load_precision_file(args.fp8_precision_config)
        except (OSError, ValueError) as error:
            raise ConfigurationError(f"--fp8-precision-config: {error}") from None
        args.fp8_precision_rules = [[r.pattern, r.precision, [list(pair) for pair in r.overrides]] for r in rules]
    if args.lr < 0 or args.min_lr < 0:
        raise ConfigurationError(f"--lr {args.lr} and --min-lr {args.min_lr} must be >= 0")
    if args.min_lr > args.lr:
        raise ConfigurationError(f"--min-lr {args.min_lr} is above --lr {args.lr}: the schedule decays from --lr to "
                                 f"--min-lr; lower --min-lr")
    if args.max_skipped_steps < 0 or args.skipped_steps_window < 1:
        raise ConfigurationError(f"--max-skipped-steps must be >= 0 and --skipped-steps-window >= 1, got "
                                 f"{args.max_skipped_steps} and {args.skipped_steps_window}")
    if args.train_iters < 1:
        raise ConfigurationError(f"--train-iters must be >= 1, got {args.train_iters}")
    args.virtual_pipeline_model_parallel_size = None
    if args.num_layers_per_virtual_pipeline_stage is not None:
        args.virtual_pipeline_model_parallel_size = args.num_layers // pp // args.num_layers_per_virtual_pipeline_stage
    args.num_microbatches = args.global_batch_size // (args.micro_batch_size * dp)
    if args.fp8_opt_level != "none":
        if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
            cap = ".".join(map(str, torch.cuda.get_device_capability()))
            raise ConfigurationError(
                f"FP8 needs a GPU of compute capability >= 8.9 (H100/H200/L40/RTX 4090); this one is {cap}: use "
                f"--fp8-opt-level none"
            )
    if args.fp8_min_dim is not None and args.fp8_min_dim < 0:
        raise ConfigurationError(f"--fp8-min-dim must be >= 0 (0 runs every eligible linear in FP8), got {args.fp8_min_dim}")
    if args.bf16 and args.fp32:
        raise ConfigurationError("--bf16 and --fp32 exclude each other")
    if not args.bf16 and not args.fp32:
        args.bf16 = torch.cuda.is_available()
    args.params_dtype = torch.bfloat16 if args.bf16 else torch.float32
    if args.data_path is None and not args.mock_data and args.tokenizer_model is not None:
        raise ConfigurationError("--tokenizer-model given without --data-path")
    if args.mock_data and args.vocab_size is None:
        args.vocab_size = 1024
    args.compare_levels = [lvl for lvl in _compare_levels(args) if lvl != args.fp8_opt_level]
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    if args.compile_layers and args.fp8_recipe == "nvfp4" and args.fp4_stochastic_rounding:
        raise ConfigurationError("--compile-layers with --fp4-recipe nvfp4: stochastic rounding draws a new seed per cast "
                                 "on the host, which a compiled graph would hold fixed; add --no-fp4-stochastic-rounding "
                                 "or drop --compile-layers")
    if args.compile_layers:
        from .model import check_compile_layers  # imports megatron-core: only when the flag is given

        check_compile_layers(config_from_args(args))
    check_recipe_hardware(args)
    if args.fp8_gemm_backend == "scaled_mm":
        from .model import check_gemm_backend  # imports megatron-core: only when the check is asked for

        # every FP8 GEMM of the run decided for this machine's device, before anything runs
        check_gemm_backend(config_from_args(args))
    return args


def _resolve_fp4_recipe(args: argparse.Namespace) -> None:
    """``--fp4-format e2m1 --fp4-recipe nvfp4`` (Megatron's flags) select the ``nvfp4`` recipe: both or neither, and
    not beside another ``--fp8-recipe``; the NVFP4 switches only with it."""
    if (args.fp4_recipe is None) != (args.fp4_format is None):
        given, missing = ("--fp4-recipe", "--fp4-format e2m1") if args.fp4_format is None else \
            ("--fp4-format", "--fp4-recipe nvfp4")
        raise ConfigurationError(f"{given} needs {missing} (NVFP4: E2M1 values with the nvfp4 scaling recipe)")
    if args.fp4_recipe is None:
        if not (args.fp4_hadamard and args.fp4_stochastic_rounding) or args.fp4_bf16_forward_from_iteration is not None:
            raise ConfigurationError("--no-fp4-hadamard, --no-fp4-stochastic-rounding and --fp4-bf16-forward-from-"
                                     "iteration apply to --fp4-recipe nvfp4; add --fp4-format e2m1 --fp4-recipe nvfp4, "
                                     "or drop them")
        return
    n = args.fp4_bf16_forward_from_iteration
    if n is not None and n < 1:
        raise ConfigurationError(f"--fp4-bf16-forward-from-iteration {n}: iterations count from 1")
    if args.fp8_recipe not in ("tensorwise", "nvfp4"):
        raise ConfigurationError(f"--fp4-recipe nvfp4 and --fp8-recipe {args.fp8_recipe} both choose the linears' "
                                 f"recipe: pass one of them")
    args.fp8_recipe = "nvfp4"
    if not args.first_last_layers_bf16 and not args.fp8_precision_config:
        # NVIDIA's NVFP4 recipe keeps the last layers in BF16: by default the last --num-layers-at-end-in-bf16 (1);
        # --num-layers-at-end-in-bf16 0 puts every layer in NVFP4
        args.first_last_layers_bf16 = True
        if not _given(args, "--num-layers-at-start-in-bf16"):
            args.num_layers_at_start_in_bf16 = 0


def check_recipe_hardware(args, target=None) -> None:
    """A recipe whose GEMMs need a newer GPU than this machine's (``--fp8-recipe mxfp8`` below compute capability 10.0)
    is refused before anything runs, naming the GPU generation it needs (``--fp8-gemm-backend emulated`` runs it)."""
    if args.fp8_opt_level == "none" and not args.compare_levels:
        return
    from fp8.gemm import GemmTarget
    from fp8.recipes import get_recipe

    if target is None:  # model.gemm_target's choice, without importing megatron-core for it
        target = GemmTarget.of(torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu")
    flag = "--fp4-recipe nvfp4" if args.fp8_recipe == "nvfp4" else f"--fp8-recipe {args.fp8_recipe}"
    problem = get_recipe(args.fp8_recipe).hardware_problem(target, args.fp8_gemm_backend)
    if problem is not None:
        raise ConfigurationError(f"{flag}: {problem}")


def parse_config(argv: list[str] | None = None, world_size: int | None = None) -> RunConfig:
    """``argv`` parsed (:func:`parse_args`), validated (:func:`validate_args`, which raises
    :class:`ConfigurationError` naming the fix) and frozen into the run's :class:`~megatron.training.config.RunConfig`."""
    return config_from_args(validate_args(parse_args(argv), world_size))
