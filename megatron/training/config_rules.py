"""The configuration rules of a GPT training run, in one place: ``pretrain_gpt.py``'s
:func:`megatron.training.arguments.validate_args` and the memory planner's
:class:`megatron.training.planning.memory_plan.PlannerConfig` both call :func:`check_config`, so a layout one of
them accepts the other accepts too. Every error is a :class:`ConfigurationError` (a ``ValueError``)
whose message names the flag and the fix. Plain Python: importing this module imports no torch.

Also the vocabulary of FP8 opt levels (:data:`OPT_LEVELS`, :func:`normalize_opt_level`): ``none`` is the
high-precision baseline, ``O0`` its accepted alias (``fp8.initialize``'s historical name).
"""

from __future__ import annotations

import argparse

__all__ = ["ConfigurationError", "check_split", "check_expert_fp8_shapes", "high_precision_layers", "OPT_LEVELS", "OPT_LEVEL_ALIASES", "normalize_opt_level", "opt_level_arg",
           "check_config", "GEMM_BACKENDS"]

OPT_LEVELS = ("none", "O1", "O2", "O3")
"""FP8 opt levels: ``none`` (the high-precision baseline), ``O1``, ``O2``, ``O3``."""

OPT_LEVEL_ALIASES = {"O0": "none"}
"""Accepted spellings, normalised to the name in :data:`OPT_LEVELS`."""

GEMM_BACKENDS = ("auto", "scaled_mm", "emulated")
"""``--fp8-gemm-backend``'s choices: :data:`fp8.gemm.GEMM_BACKENDS` (repeated here so that this module imports no
torch; ``tests/training/test_gemm_backend_flag.py`` checks they agree)."""


class ConfigurationError(ValueError):
    """A configuration that cannot run; the message names the fix."""


def normalize_opt_level(level: str, flag: str = "--fp8-opt-level") -> str:
    """``level`` as named in :data:`OPT_LEVELS` (``O0`` -> ``none``); raises naming the choices."""
    level = OPT_LEVEL_ALIASES.get(level, level)
    if level not in OPT_LEVELS:
        raise ConfigurationError(
            f"{flag} must be one of {'|'.join(OPT_LEVELS)} (O0 is accepted for none), got {level!r}"
        )
    return level


def opt_level_arg(text: str) -> str:
    """argparse ``type=`` of ``--fp8-opt-level`` (pretrain_gpt.py, tools/memory_planner.py): the level's name
    (``O0`` -> ``none``), else a usage error naming the choices."""
    try:
        return normalize_opt_level(text)
    except ConfigurationError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def check_config(
    *,
    num_layers: int,
    hidden_size: int,
    num_attention_heads: int,
    num_query_groups: int | None,
    ffn_hidden_size: int,
    seq_length: int,
    micro_batch_size: int,
    global_batch_size: int | None,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    data_parallel_size: int,
    num_layers_per_virtual_pipeline_stage: int | None,
    sequence_parallel: bool,
    fp8_opt_level: str,
    use_distributed_optimizer: bool,
    swiglu: bool = False,
    max_position_embeddings: int | None = None,
    position_embedding_type: str = "learned_absolute",
) -> None:
    """Raise :class:`ConfigurationError` (naming the fix) unless the model, its parallel layout (TP x PP x DP,
    virtual pipeline, sequence parallelism), the batch and the FP8 level fit together as megatron-core and
    fp8lm need. ``num_query_groups=None``: no grouped-query attention. ``global_batch_size=None``: not
    checked (the planner's "enough micro-batches"). ``max_position_embeddings=None``: the sequence length."""
    tp, pp, dp = tensor_model_parallel_size, pipeline_model_parallel_size, data_parallel_size
    for flag, value in (("--num-layers", num_layers), ("--hidden-size", hidden_size),
                        ("--num-attention-heads", num_attention_heads), ("--seq-length", seq_length),
                        ("--micro-batch-size", micro_batch_size)):
        if value < 1:
            raise ConfigurationError(f"{flag} must be >= 1, got {value}")
    if position_embedding_type == "learned_absolute" and max_position_embeddings is not None \
            and seq_length > max_position_embeddings:
        raise ConfigurationError(
            f"--seq-length {seq_length} is above --max-position-embeddings {max_position_embeddings} (learned "
            f"positions): raise --max-position-embeddings (it defaults to --seq-length) or shorten the sequences"
        )
    heads = num_attention_heads
    level = normalize_opt_level(fp8_opt_level)
    if heads % tp:
        raise ConfigurationError(
            f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}: use a TP size that "
            f"divides the number of heads"
        )
    groups = num_query_groups or heads
    if heads % groups or groups % tp:
        # megatron-core splits the query groups over TP (num_query_groups % tensor_model_parallel_size == 0).
        raise ConfigurationError(
            f"--num-query-groups {groups} must divide --num-attention-heads {heads} and be divisible by "
            f"--tensor-model-parallel-size {tp} (megatron-core splits the query groups over TP): use a multiple of "
            f"{tp} that divides {heads}, or a TP size that divides {groups}"
        )
    if hidden_size % heads:
        raise ConfigurationError(
            f"--hidden-size {hidden_size} is not divisible by --num-attention-heads {heads}: change one of them"
        )
    if ffn_hidden_size % tp:
        raise ConfigurationError(
            f"--ffn-hidden-size {ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}: use a "
            f"multiple of {tp}"
        )
    if num_layers % pp:
        raise ConfigurationError(
            f"--num-layers {num_layers} is not divisible by --pipeline-model-parallel-size {pp}: use a PP size that "
            f"divides the number of layers"
        )
    vpp = num_layers_per_virtual_pipeline_stage
    if vpp is not None:
        if vpp < 1:
            raise ConfigurationError(f"--num-layers-per-virtual-pipeline-stage must be >= 1, got {vpp}")
        if pp < 2:
            raise ConfigurationError(
                "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1: drop it or raise PP"
            )
        if (num_layers // pp) % vpp:
            raise ConfigurationError(
                f"--num-layers-per-virtual-pipeline-stage {vpp} must divide the layers per pipeline stage "
                f"({num_layers // pp})"
            )
    if sequence_parallel and tp > 1 and seq_length % tp:
        raise ConfigurationError(
            f"--seq-length {seq_length} must be divisible by TP ({tp}) with --sequence-parallel: change one of them"
        )
    if global_batch_size is not None:
        if global_batch_size < 1 or global_batch_size % (micro_batch_size * dp):
            raise ConfigurationError(
                f"--global-batch-size {global_batch_size} must be a multiple of micro batch x data-parallel size "
                f"({micro_batch_size} x {dp})"
            )
        microbatches = global_batch_size // (micro_batch_size * dp)
        if vpp is not None and microbatches % pp:
            raise ConfigurationError(
                f"the interleaved schedule needs the number of micro-batches ({microbatches}) to be a multiple of PP "
                f"({pp}): change --global-batch-size"
            )
    if use_distributed_optimizer and level in ("O1", "O2"):
        raise ConfigurationError(
            f"--use-distributed-optimizer shards the baseline's optimizer (--fp8-opt-level none); for FP8 use "
            f"--fp8-opt-level O3 (the FP8 distributed optimizer) instead of {level} with it"
        )
    if level != "none":
        _check_fp8_shapes(hidden_size, ffn_hidden_size, heads, groups, swiglu, tp, micro_batch_size * seq_length)


def _check_fp8_shapes(h: int, f: int, heads: int, groups: int, swiglu: bool, tp: int, tokens: int) -> None:
    """FP8 GEMMs need every TP shard's linear dimensions, and the tokens of a micro-batch (the weight
    gradient's inner dimension), to be multiples of 16."""
    qkv = h + 2 * groups * (h // heads)
    fc1 = 2 * f if swiglu else f
    for name, n_in, n_out in (("linear_qkv", h, qkv // tp), ("linear_proj", h // tp, h),
                              ("linear_fc1", h, fc1 // tp), ("linear_fc2", f // tp, h)):
        if n_in % 16 or n_out % 16:
            raise ConfigurationError(
                f"FP8 GEMMs need dimensions that are multiples of 16 on every TP shard: {name} is {n_out} x {n_in} "
                f"with TP={tp}; make --hidden-size and --ffn-hidden-size a multiple of 16 x TP = {16 * tp} "
                f"(e.g. {16 * tp * max(1, round(h / (16 * tp)))}), or use --fp8-opt-level none"
            )
    if tokens % 16:
        raise ConfigurationError(
            f"micro batch x seq length = {tokens} tokens must be a multiple of 16 for FP8 weight-gradient GEMMs: "
            f"change --micro-batch-size or --seq-length"
        )


def check_expert_fp8_shapes(moe_ffn_hidden_size: int, shared_expert_size: int | None, tp: int) -> None:
    """The experts' FP8 GEMMs (an expert's FFN and the shared expert's, split by TP as megatron-core splits them) need
    dimensions that are multiples of 16 on every shard."""
    for flag, size in (("--moe-ffn-hidden-size", moe_ffn_hidden_size),
                       ("--moe-shared-expert-intermediate-size", shared_expert_size)):
        if size is None:
            continue
        if size % tp or (size // tp) % 16:
            multiple = 16 * tp
            raise ConfigurationError(
                f"{flag} {size}: FP8 expert GEMMs need it to be a multiple of 16 x TP = {multiple} (each "
                f"tensor-parallel shard a multiple of 16), e.g. {multiple * -(-size // multiple)}; "
                f"or use --fp8-opt-level none")


def check_split(split: str) -> list[float]:
    """The three weights of ``--split`` (train, validation, test; fewer are padded with 0s, as in
    megatron-core); :class:`ConfigurationError` unless they are up to three non-negative finite numbers with
    a positive sum (megatron-core's own parser reads the digits and dots only: ``-1,2,0`` as ``1,2,0``,
    ``1e-3`` as two numbers, and makes NaN of a zero sum)."""
    parts = [part.strip() for part in str(split).replace("/", ",").split(",")]
    usage = "give up to three non-negative weights with a positive sum, e.g. --split 949,50,1"
    if not 1 <= len(parts) <= 3:
        raise ConfigurationError(f"--split {split!r} has {len(parts)} parts: {usage}")
    try:
        weights = [float(part) for part in parts]
    except ValueError:
        raise ConfigurationError(f"--split {split!r}: not numbers: {usage}") from None
    if any(not (w >= 0 and w != float("inf")) for w in weights):
        raise ConfigurationError(f"--split {split!r} has a negative or non-finite weight: {usage}")
    if sum(weights) <= 0:
        raise ConfigurationError(f"--split {split!r} sums to 0 (no data for any split): {usage}")
    return weights + [0.0] * (3 - len(weights))


def high_precision_layers(first_last_layers_bf16: bool, num_layers_at_start_in_bf16: int,
                          num_layers_at_end_in_bf16: int, num_layers: int) -> frozenset[int]:
    """The global transformer layer numbers (1-based, as megatron-core numbers them) kept out of FP8 by
    ``--first-last-layers-bf16`` (empty without it); a count that is negative or leaves no layer in FP8 is refused."""
    if not first_last_layers_bf16:
        return frozenset()
    start, end, n = num_layers_at_start_in_bf16, num_layers_at_end_in_bf16, num_layers
    if start < 0 or end < 0:
        raise ConfigurationError(f"--num-layers-at-start-in-bf16 {start} and --num-layers-at-end-in-bf16 {end} must "
                                 f"be >= 0")
    if start + end >= n:
        raise ConfigurationError(
            f"--num-layers-at-start-in-bf16 {start} + --num-layers-at-end-in-bf16 {end} leave none of the {n} layers in "
            f"FP8: lower them, or train the baseline (--fp8-opt-level none)")
    return frozenset(range(1, start + 1)) | frozenset(range(n - end + 1, n + 1))
