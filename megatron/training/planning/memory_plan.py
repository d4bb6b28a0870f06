"""Per-GPU memory model for GPT training with fp8lm on megatron-core: model state, activations and
communication buffers for a model config, a parallel layout (TP x PP x DP), micro-batch, sequence
length, activation recomputation and FP8 opt level; plus FP8-LM's Figure 1 question (the largest GPT
that fits on N x 80 GB GPUs per opt level). Its command line is ``tools/memory_planner.py``.

Python API (``pretrain_gpt.py --dry-run`` uses it): ``PlannerConfig`` (frozen, validated;
``PlannerConfig.from_args(namespace)`` takes pretrain_gpt.py's argparse namespace), ``plan_memory(config)
-> dict``, ``format_plan(plan) -> str``, ``largest_model`` and ``figure1``.

Assumptions (every figure is bytes on the worst GPU; docs/scale.md has the measured error):

Model (megatron-core GPTModel, local spec). Per layer: norm (LayerNorm weight+bias, RMSNorm weight) ->
fused QKV linear ((h + 2 g h / a) x h for g query groups, 3h x h without grouped-query attention) ->
attention -> output projection (h x h) -> norm -> fc1 (f x h, 2f x h with SwiGLU) -> fc2 (h x f); every linear has a bias unless ``add_bias_linear=False``; a final norm. The
vocabulary is padded to a multiple of ``make_vocab_size_divisible_by x TP``. Column-parallel weights and
biases (QKV, fc1, embeddings, output layer) are split over TP; row-parallel weights (proj, fc2) are split,
their biases and all norms replicated. Pipeline stage 0 holds the word (and learned position)
embeddings, the last stage the final norm and the output layer (with tied embeddings and PP > 1 the last
stage holds Megatron's copy of the word embedding). Virtual pipeline chunks leave the per-rank count
unchanged. ``params_per_gpu`` is the largest stage's count.

Which parameters are FP8 (O1-O3): the weights of QKV, proj, fc1 and fc2 (each TP shard's dimensions must
be multiples of 16, else a ``ValueError`` names the fix); embeddings, norms, biases and the output layer
stay high precision (``fp8_output_layer=True`` models a plain-PyTorch GPT whose LM head is converted too).

Model-state bytes per parameter (hp = 2 with ``bf16``, else 4; FP8-LM counts 16 B/param for BF16 mixed
precision, 2 weight + 2 gradient + 4 master + 8 Adam, and so does this planner's ``none``):

| level | FP8-layer weights | high-precision parameters |
| --- | --- | --- |
| none | hp weight + hp grad + FP32 master (bf16 only) + FP32 Adam m, v = 16 | same = 16 |
| O1 | FP8 weight 1 + grad G + FP32 master 4 + FP32 m, v 8 = 13 + G | 16 |
| O2 | 1 + G + FP16 master 2 + E4M3 m 1 + FP16 v 2 = 6 + G | hp + hp + FP32 master (bf16 only) + 1 + 2 = 11 |
| O3 | O2 with masters, m, v kept only for the tensors this DP rank owns | |

G, the gradient of an FP8 weight at the optimizer step, follows ``grad_accumulation`` (``fp8.Float8LinearConfig``,
pretrain_gpt's ``--fp8-grad-accumulation``). ``"fp16"`` (default) sums micro-batches in a scaled FP16 ``.grad``
(2 bytes per element plus a 4-byte scale per tensor), ``"fp32"`` in an fp32 one (4 bytes): with one DP rank that
sum is the step's gradient, G = 2 (fp16) or 4 (fp32); with several, the DP reduction quantizes it once and leaves
an E4M3 gradient (1 byte plus a 4-byte scale per tensor, at O3 only with the owner), and the sums held
during the accumulation window are the ``gradient_accumulation`` category: 2 (fp16, plus the scales) or 4 bytes per
FP8-weight element on every rank, less the step's FP8 gradient bytes of that rank (what the window holds beyond the
step's state).
It counts at the time of the activations (the last micro-batch's backward), not at the step; with one
micro-batch per step the sums turn into 1-byte gradients bucket by bucket during backward, so it is an upper
bound there. ``"fp8"`` re-rounds an E4M3 gradient after every micro-batch: G = 1 (plus scale), kept after the
reduction only by the owner at O3, no window bytes.

``use_distributed_optimizer=True`` (BF16 baseline only: Megatron's distributed optimizer, ZeRO-1) splits
the FP32 masters and Adam states evenly over DP and keeps the full gradient buffer. ``fp32_grads=True``
holds gradients of high-precision parameters (and, at ``none``, all) in FP32, as
Megatron's ``--accumulate-allreduce-grads-in-fp32`` main_grad (18 B/param for BF16). O1's master is
FP32 as in FP8-LM (the engine's O1 keeps the master in the model's own dtype: FP32 on CPU). The BF16
baseline is the engine's ``fp8.optim.AdamW(precision="O1")`` on a BF16 model (FP32 master, m, v, each with
an fp32 scale, as benchmarks/memory.py). Per tensor also: the optimizer's ``step`` (4 B), O2's per-tensor scales of m and v (and of the master of FP8
weights, 4 B each), each FP8 tensor's fp32 scale and each FP8 linear's two delayed-scaling states (amax
history of ``fp8_amax_history_len`` fp32 + scale + flag: 138 B at 16), with sequence parallelism (TP > 1)
each FP8 parallel linear's current-scaling state of its FP8 reduce-scatter (69 B), all under
``fp8_scaling_metadata`` or ``optimizer_states`` exactly as ``fp8.memory_report`` counts them. O3
ownership follows ``fp8.optim.partition_by_size`` (whole tensors, largest first to the least-loaded rank;
re-implemented in :func:`whole_tensor_partition` so planning imports no torch) over each stage's tensors;
the worst DP rank (by bytes) is reported (every rank's in ``stages[i]["dp_rank_bytes"]``). Gradients are
counted at the peak of the accumulation window (G above).

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
adapted). Per layer and token, with hp-byte activations: norm inputs (hp x h each, plus fp32 mean/rstd),
the inputs of the four linears (hp each, the projection's input being the attention output itself; FP8
levels save them in E4M3: 1 byte per element), the QKV
output kept by fused attention (SDPA/flash: q, k, v, output and an fp32 logsumexp per head; no s x s
matrices are stored: non-fused attention would add Korthikanti's 5 a s^2 b per layer), the
activation-function input (f, or 2f for SwiGLU, in hp), and two 1-byte dropout masks when
``hidden_dropout > 0``. Tensors inside the TP region (q, k, v, attention output, proj input, fc2 input,
activation input, logsumexp) are divided by TP; the QKV and fc1 inputs are never divided (fp8lm's
column-parallel linears keep the sequence-parallel all-gather's output, full sequence on every TP rank, for
their weight gradient instead of gathering again in backward as Megatron-LM does); the rest (norm inputs,
dropout masks) by TP only with sequence parallelism. Stage 0 adds the token and position ids (int64; with
TP the vocab-parallel embedding's 1-byte range mask) and the embedding dropout mask; the last stage (one
micro-batch: its backward frees them first) the final norm input, the output layer input, fp32 logits for
the loss (4 V / TP per token), the labels (int64), the loss's target mask (1 B) and the training loop's
fp32 loss mask. ``recompute_granularity="full"`` keeps only each layer's input (hp x h, /TP with SP) plus,
at the peak, the larger of the last stage's head and one layer's activations recomputed in backward (whose
input is already held);
``implementation="transformers"`` plans the activations of transformers' ``LlamaForCausalLM`` under ``fp8.initialize``
instead (one device; exact against the measured bytes, tests/test_memory_planner.py; its model state is planned as
the megatron-core GPT's, with the untied lm_head in FP8 where ``fp8.initialize`` converts it): each RMSNorm saves its input upcast to fp32 and the
normalized value, SwiGLU saves act(gate) besides gate and up, plain linears' inputs are compressible like any saved
tensor, q/k/v (and gate/up) share one FP8 cast of their input, an untied output layer with dimensions that are
multiples of 16 runs FP8, the loss keeps log-softmax's fp32 output exact, and the RoPE tables are saved.
``"selective"`` recomputes the attention core, which fused attention does not store anyway, so it equals
``"none"`` here. Pipeline: under 1F1B stage i holds min(PP - i, micro-batches) micro-batches in flight;
interleaved (virtual chunks of v layers, m = L / (PP v) chunks) stage i holds min(2 (PP - i - 1) + (m - 1)
PP + 1, m x micro-batches) chunk-micro-batches.

Communication buffers: data parallel (DP > 1): two gradient buckets in flight (``dp_bucket_bytes``,
25 MiB on the wire as torch/fp8lm DDP) plus an fp32 temporary of one bucket's elements (fp8lm's DDP
quantizes and sums in fp32); tensor parallel with SP: one all-gather buffer of a layer input (s b h hp);
pipeline (PP > 1): a send and a receive buffer of one micro-batch's hidden states.

Optimizer-step transients (not at the same time as activations): O1 dequantizes every FP8 gradient into
an FP32 master gradient before stepping (4 B per FP8 parameter; none for an fp32 gradient sum at one DP rank,
which the master uses as it is); per-tensor optimizers (none, O2, O3) hold
fp32 temporaries of the largest tensor (grad, master, m, v: 16 B per element); O3 also holds the FP8 weight
all-gather (send shard + DP x shard, shard = the largest rank's FP8 elements, 1 B each, and the same for
the high-precision parameters in hp). An Adam without fused kernels (torch's foreach AdamW) adds 4 B per
parameter at ``none``/O1: not counted (Megatron uses a fused Adam).

``total_bytes`` = weights + master weights + gradients + optimizer states + FP8 scaling metadata +
max(activations + communication buffers + gradient accumulation, optimizer-step transients). Not counted: CUDA context and
library workspaces (~0.5-1 GiB), allocator fragmentation (the Figure 1 mode keeps 10% headroom).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from ..config_rules import OPT_LEVELS, check_config, normalize_opt_level

__all__ = ["PlannerConfig", "plan_memory", "format_plan", "CATEGORIES", "OPT_LEVELS", "whole_tensor_partition",
           "default_min_fp8_dim", "GRAD_ACCUMULATION", "NORMALIZATIONS", "POSITION_EMBEDDINGS",
           "RECOMPUTE_GRANULARITIES"]

CATEGORIES = (
    "weights", "master_weights", "gradients", "optimizer_states", "fp8_scaling_metadata",
    "activations", "communication_buffers", "gradient_accumulation", "step_transients",
)
"""Keys of ``plan_memory(...)["bytes"]``."""

_IMPLEMENTATIONS = ("megatron-core", "transformers")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
GRAD_ACCUMULATION = ("fp16", "fp32", "fp8")  # fp8.linear.GRAD_ACCUMULATION (planning imports no torch)
SUM_BYTES = {"fp16": 2, "fp32": 4}  # bytes per element of an FP8 weight's gradient sum before the DP reduction
_RECIPES = ("tensorwise", "rowwise", "blockwise")  # fp8.recipes.RECIPES
_TILE = 128  # fp8.recipes.BLOCKWISE_TILE, fp8.activations' tile width
_MIN_COMPRESSED = 4096  # fp8.activations.ActivationCompressor's default min_numel
_MiB = 2**20
GiB = 2**30


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"PlannerConfig.{name} must be a positive int, got {value!r}")


def _one_of(flag: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{flag} must be one of {'|'.join(choices)}, got {value!r}")


@dataclass(frozen=True)
class PlannerConfig:
    """One training configuration to plan; names as pretrain_gpt.py's flags (dashes -> underscores).

    ``ffn_hidden_size`` defaults to ``4 * hidden_size``, ``max_position_embeddings`` to ``seq_length``.
    ``recompute_granularity``: none|selective|full. ``fp8_opt_level``: none|O1|O2|O3 (O0 = none). ``bf16``: 16-bit
    weights and activations (else FP32). ``global_batch_size=None`` assumes enough micro-batches to fill
    the pipeline. See the module docstring for ``fp32_grads``, ``fp8_output_layer``, ``dp_bucket_bytes``.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int = 50257
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    max_position_embeddings: int | None = None
    make_vocab_size_divisible_by: int = 128
    swiglu: bool = False
    normalization: str = "LayerNorm"
    untie_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "learned_absolute"
    add_bias_linear: bool = True
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    sequence_parallel: bool = False
    recompute_granularity: str = "none"
    data_parallel_size: int = 1
    fp8_opt_level: str = "none"
    bf16: bool = True
    fp32_grads: bool = False
    use_distributed_optimizer: bool = False
    hidden_dropout: float = 0.0
    fp8_output_layer: bool = False
    dp_bucket_bytes: int = 25 * _MiB
    fp8_amax_history_len: int = 16
    grad_accumulation: str = "fp16"
    pretrain_bf16: bool = False  # pretrain_gpt.py --bf16: torch's fused AdamW baseline (no state scales)
    min_fp8_dim: int = 0  # linears whose per-rank GEMM has min(in, out) below it stay high precision
    fp8_recipe: str = "tensorwise"  # scale granularity (fp8.recipes): tensorwise | rowwise | blockwise
    fp8_activations: bool = False  # tensors saved for backward stored as E4M3 in 1x128 tiles (fp8.activations)
    implementation: str = "megatron-core"  # whose layers save the activations: megatron-core | transformers (Llama)

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.max_position_embeddings is None:
            object.__setattr__(self, "max_position_embeddings", self.seq_length)
        if self.num_query_groups is None:
            object.__setattr__(self, "num_query_groups", self.num_attention_heads)
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size",
                     "ffn_hidden_size", "max_position_embeddings", "make_vocab_size_divisible_by",
                     "micro_batch_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                     "data_parallel_size", "dp_bucket_bytes", "num_query_groups", "fp8_amax_history_len"):
            _positive(name, getattr(self, name))
        object.__setattr__(self, "fp8_opt_level", normalize_opt_level(self.fp8_opt_level))  # O0 -> none
        for flag, value, choices in (("--fp8-recipe", self.fp8_recipe, _RECIPES),
                                     ("--fp8-grad-accumulation", self.grad_accumulation, GRAD_ACCUMULATION),
                                     ("implementation", self.implementation, _IMPLEMENTATIONS)):
            _one_of(flag, value, choices)
        if self.implementation == "transformers" and not (
                self.normalization == "RMSNorm" and self.swiglu and self.position_embedding_type == "rope"
                and self.tensor_model_parallel_size == self.pipeline_model_parallel_size == 1
                and self.hidden_dropout == 0.0 and not self.add_bias_linear and self.make_vocab_size_divisible_by == 1):
            raise ValueError(
                "implementation='transformers' models transformers' LlamaForCausalLM on one device: it needs "
                "normalization='RMSNorm', swiglu=True, position_embedding_type='rope', add_bias_linear=False, "
                "make_vocab_size_divisible_by=1 (transformers does not pad the vocabulary), tensor and pipeline "
                "parallel size 1 and hidden_dropout=0; plan other models with implementation='megatron-core'")
        for flag, value, choices in (("--normalization", self.normalization, NORMALIZATIONS),
                                     ("--position-embedding-type", self.position_embedding_type, POSITION_EMBEDDINGS),
                                     ("recompute_granularity", self.recompute_granularity, RECOMPUTE_GRANULARITIES)):
            _one_of(flag, value, choices)
        if not 0.0 <= self.hidden_dropout < 1.0:
            raise ValueError(f"hidden_dropout must be in [0, 1), got {self.hidden_dropout!r}")
        if self.num_layers_per_virtual_pipeline_stage is not None:
            _positive("num_layers_per_virtual_pipeline_stage", self.num_layers_per_virtual_pipeline_stage)
        if self.global_batch_size is not None:
            _positive("global_batch_size", self.global_batch_size)
        check_config(  # the rules pretrain_gpt.py's validate_args applies too (megatron/training/config_rules.py)
            num_layers=self.num_layers, hidden_size=self.hidden_size, num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups, ffn_hidden_size=self.ffn_hidden_size, seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size, global_batch_size=self.global_batch_size,
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size, data_parallel_size=self.data_parallel_size,
            num_layers_per_virtual_pipeline_stage=self.num_layers_per_virtual_pipeline_stage,
            sequence_parallel=self.sequence_parallel, fp8_opt_level=self.fp8_opt_level,
            use_distributed_optimizer=self.use_distributed_optimizer, swiglu=self.swiglu,
            max_position_embeddings=self.max_position_embeddings, position_embedding_type=self.position_embedding_type,
        )

    # -- derived sizes -------------------------------------------------------------------------------
    @property
    def fp8(self) -> bool:
        """Whether the transformer linears run in FP8 (any level but none)."""
        return self.fp8_opt_level != "none"

    @property
    def fp8_output(self) -> bool:
        """Whether the (untied) output layer runs FP8: ``fp8_output_layer``, or under ``implementation="transformers"``
        (``fp8.initialize`` converts the lm_head like any linear) when its dimensions are multiples of 16 and
        ``min(hidden, vocabulary) >= min_fp8_dim``."""
        if not (self.fp8 and self.untie_embeddings_and_output_weights):
            return False
        if self.fp8_output_layer:
            return True
        h, v = self.hidden_size, self.padded_vocab_size
        return self.implementation == "transformers" and h % 16 == 0 and v % 16 == 0 and min(h, v) >= self.min_fp8_dim

    @property
    def hp_bytes(self) -> int:
        """Bytes of a high-precision element (2 with bf16, else 4)."""
        return 2 if self.bf16 else 4

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary padded to a multiple of make_vocab_size_divisible_by x TP (as Megatron)."""
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    @property
    def world_size(self) -> int:
        """TP x PP x DP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.data_parallel_size

    @property
    def num_microbatches(self) -> int | None:
        """Micro-batches per step per DP rank, or None if ``global_batch_size`` is not given."""
        if self.global_batch_size is None:
            return None
        return self.global_batch_size // (self.micro_batch_size * self.data_parallel_size)

    @property
    def qkv_size(self) -> int:
        """Output features of the fused QKV projection: h + 2 x query groups x head dim."""
        return self.hidden_size + 2 * self.num_query_groups * (self.hidden_size // self.num_attention_heads)

    def _linear_shapes(self) -> list[tuple[str, int, int]]:
        h, f, tp = self.hidden_size, self.ffn_hidden_size, self.tensor_model_parallel_size
        fc1_out = 2 * f if self.swiglu else f
        return [("linear_qkv", h, self.qkv_size // tp), ("linear_proj", h // tp, h),
                ("linear_fc1", h, fc1_out // tp), ("linear_fc2", f // tp, h)]

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> PlannerConfig:
        """Build from pretrain_gpt.py's argparse namespace (missing optional attributes take defaults).

        ``recompute_activations`` means full recomputation unless ``recompute_granularity`` is given. The
        vocabulary: ``vocab_size`` if set, else the size of ``tokenizer_model`` (sentencepiece), else an error.
        ``data_parallel_size`` None: WORLD_SIZE / (TP x PP) from the environment, else 1.
        """
        def get(name: str, default=None):
            value = getattr(args, name, None)
            return default if value is None else value

        vocab = get("vocab_size")
        if vocab is None and get("tokenizer_model"):
            import sentencepiece

            vocab = sentencepiece.SentencePieceProcessor(model_file=str(get("tokenizer_model"))).get_piece_size()
        if vocab is None:
            raise ValueError("the vocabulary size is unknown: pass --vocab-size or --tokenizer-model")
        tp, pp = get("tensor_model_parallel_size", 1), get("pipeline_model_parallel_size", 1)
        dp = get("data_parallel_size")
        if dp is None:
            import os

            world = int(os.environ.get("WORLD_SIZE", tp * pp))
            if world % (tp * pp):
                raise ValueError(f"WORLD_SIZE {world} is not a multiple of TP x PP = {tp * pp}")
            dp = max(world // (tp * pp), 1)
        recompute = get("recompute_granularity") or ("full" if get("recompute_activations", False) else "none")
        level = get("fp8_opt_level", "none")
        values = dict(
            num_layers=get("num_layers"), hidden_size=get("hidden_size"),
            num_attention_heads=get("num_attention_heads"), seq_length=get("seq_length"), vocab_size=vocab,
            num_query_groups=get("num_query_groups"), fp8_amax_history_len=get("fp8_amax_history_len", 16),
            ffn_hidden_size=get("ffn_hidden_size"), max_position_embeddings=get("max_position_embeddings"),
            make_vocab_size_divisible_by=get("make_vocab_size_divisible_by", 128), swiglu=bool(get("swiglu", False)),
            normalization=get("normalization", "LayerNorm"),
            untie_embeddings_and_output_weights=bool(get("untie_embeddings_and_output_weights", False)),
            position_embedding_type=get("position_embedding_type", "learned_absolute"),
            add_bias_linear=not get("disable_bias_linear", False), micro_batch_size=get("micro_batch_size", 1),
            global_batch_size=get("global_batch_size"), tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            num_layers_per_virtual_pipeline_stage=get("num_layers_per_virtual_pipeline_stage"),
            sequence_parallel=bool(get("sequence_parallel", False)), recompute_granularity=recompute,
            data_parallel_size=dp, fp8_opt_level=normalize_opt_level(level or "none"),
            bf16=bool(get("bf16", False)),
            # --bf16 is pretrain_gpt.py's (and Megatron's) wherever it is given, the planner's command line
            # included: FP32 main gradients at level none (megatron/training/mixed_precision.py), stepped by
            # torch's fused AdamW: 18 B/param. FP8-LM's 16 B/param accounting (BF16 gradients) is
            # PlannerConfig(bf16=True) without fp32_grads, in Python.
            fp32_grads=bool(get("accumulate_allreduce_grads_in_fp32", False))
            or (bool(get("bf16", False)) and normalize_opt_level(level or "none") == "none"),
            pretrain_bf16=bool(get("bf16", False)),
            # pretrain_gpt.py's --fp8-min-dim and its default on this machine (2048 on CUDA, 0 elsewhere), as the
            # model applies it.
            min_fp8_dim=default_min_fp8_dim() if get("fp8_min_dim") is None else int(get("fp8_min_dim")),
            use_distributed_optimizer=bool(get("use_distributed_optimizer", False)),
            hidden_dropout=float(get("hidden_dropout", 0.0)),
            grad_accumulation=get("fp8_grad_accumulation", "fp16"),
            fp8_recipe=get("fp8_recipe", "tensorwise"), fp8_activations=bool(get("fp8_activations", False)),
            implementation=get("implementation", "megatron-core"),
        )
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            if values[name] is None:
                raise ValueError(f"--{name.replace('_', '-')} is required")
        values.update(overrides)
        return cls(**values)


# -- parameters ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Tensor:
    name: str
    numel: int
    fp8: bool  # an FP8 weight (one Float8Linear each)
    rows: int = 0  # an FP8 weight's (out, in) on this rank: its scale grid follows the recipe
    cols: int = 0


def default_min_fp8_dim() -> int:
    """pretrain_gpt.py's default ``--fp8-min-dim``: 2048 on CUDA (``fp8.convert.CUDA_MIN_FP8_DIM``), else 0."""
    import torch

    return 2048 if torch.cuda.is_available() else 0


def _stage_tensors(cfg: PlannerConfig, stage: int) -> list[_Tensor]:
    """The parameters one GPU of pipeline stage ``stage`` holds (any TP rank: all hold the same sizes)."""
    h, f, tp, pp = cfg.hidden_size, cfg.ffn_hidden_size, cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    fc1_out = 2 * f if cfg.swiglu else f
    bias = cfg.add_bias_linear
    tensors: list[_Tensor] = []

    def norm(prefix: str) -> None:
        tensors.append(_Tensor(f"{prefix}.weight", h, False))
        if cfg.normalization == "LayerNorm":
            tensors.append(_Tensor(f"{prefix}.bias", h, False))

    def linear(prefix: str, n_out: int, n_in: int, bias_numel: int) -> None:
        tensors.append(_Tensor(f"{prefix}.weight", n_out * n_in, cfg.fp8 and min(n_out, n_in) >= cfg.min_fp8_dim,
                               n_out, n_in))
        if bias:
            tensors.append(_Tensor(f"{prefix}.bias", bias_numel, False))

    if stage == 0:
        tensors.append(_Tensor("embedding.word_embeddings.weight", cfg.padded_vocab_size // tp * h, False))
        if cfg.position_embedding_type == "learned_absolute":
            tensors.append(_Tensor("embedding.position_embeddings.weight", cfg.max_position_embeddings * h, False))
    first = stage * (cfg.num_layers // pp)
    for layer in range(first, first + cfg.num_layers // pp):
        p = f"decoder.layers.{layer}"
        norm(f"{p}.input_layernorm")
        linear(f"{p}.self_attention.linear_qkv", cfg.qkv_size // tp, h, cfg.qkv_size // tp)
        linear(f"{p}.self_attention.linear_proj", h, h // tp, h)
        norm(f"{p}.pre_mlp_layernorm")
        linear(f"{p}.mlp.linear_fc1", fc1_out // tp, h, fc1_out // tp)
        linear(f"{p}.mlp.linear_fc2", h, f // tp, h)
    if stage == pp - 1:
        norm("decoder.final_layernorm")
        if cfg.untie_embeddings_and_output_weights or pp > 1:
            tensors.append(_Tensor("output_layer.weight", cfg.padded_vocab_size // tp * h, cfg.fp8_output))
    return tensors


def _total_params(cfg: PlannerConfig) -> int:
    """Parameters of the whole model (TP shards summed, Megatron's embedding copy on the last stage not counted)."""
    one_tp = dataclasses.replace(cfg, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                 num_layers_per_virtual_pipeline_stage=None, sequence_parallel=False,
                                 global_batch_size=None, vocab_size=cfg.padded_vocab_size,
                                 make_vocab_size_divisible_by=1, fp8_opt_level="none")
    return sum(t.numel for t in _stage_tensors(one_tp, 0))


# -- model state --------------------------------------------------------------------------------------
def _recipe(cfg: PlannerConfig, n_out: int, n_in: int) -> str:
    """The recipe a linear of this rank's shape runs: blockwise falls back to tensorwise where it cannot tile."""
    if cfg.fp8_recipe == "blockwise" and (n_out % _TILE or n_in % _TILE):
        return "tensorwise"
    return cfg.fp8_recipe


def _weight_scale_bytes(cfg: PlannerConfig, t: _Tensor) -> int:
    """Bytes of an FP8 weight's scale(s): one per tensor, per output channel or per 128 x 128 block."""
    recipe = _recipe(cfg, t.rows, t.cols)
    if recipe == "rowwise":
        return 4 * t.rows
    if recipe == "blockwise":
        return 4 * -(-t.rows // _TILE) * -(-t.cols // _TILE)
    return 4


def whole_tensor_partition(sizes: list[int], world_size: int) -> tuple[list[int], list[int]]:
    """(owner of each tensor, elements per rank) under O3's rule, as ``fp8.optim.partition_by_size``
    (largest first to the least-loaded rank, ties to the lower rank, then tensor order); kept here so
    planning imports no torch."""
    import heapq

    load = [(0, rank) for rank in range(world_size)]
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        used, rank = heapq.heappop(load)
        owners[i] = rank
        heapq.heappush(load, (used + sizes[i], rank))
    loads = [0] * world_size
    for used, rank in load:
        loads[rank] = used
    return owners, loads


_SCATTER_STATE_BYTES = 4 * 16 + 4 + 1
"""A sequence-parallel FP8 reduce-scatter's current-scaling state (fp8.parallel's ``_scatter_scaling``:
amax history of the default 16 fp32 + scale + flag), one per FP8 linear with SP and TP > 1."""


def _model_state(cfg: PlannerConfig, tensors: list[_Tensor]) -> tuple[dict[str, int], dict[str, int], list[dict[str, int]]]:
    """(bytes per category of the worst DP rank, step transients, bytes per category of every DP rank)
    for one stage's tensors."""
    hp, level, dp = cfg.hp_bytes, cfg.fp8_opt_level, cfg.data_parallel_size
    sp_scatter = cfg.sequence_parallel and cfg.tensor_model_parallel_size > 1
    hp_master = 4 if hp == 2 else 0  # FP32 parameters are their own master
    grad_hp = 4 if cfg.fp32_grads else hp
    sharded = level == "O3" and dp > 1
    owners = whole_tensor_partition([t.numel for t in tensors], dp)[0] if sharded else [0] * len(tensors)
    out = dict.fromkeys(CATEGORIES[:5], 0)  # held by every rank
    owned = [dict.fromkeys(CATEGORIES[:5], 0) for _ in range(dp if sharded else 1)]  # O2/O3: by the owner
    for t, owner in zip(tensors, owners):
        n, mine = t.numel, owned[owner]
        if t.fp8:
            out["weights"] += n
            scales = _weight_scale_bytes(cfg, t)
            out["fp8_scaling_metadata"] += scales + 2 * (4 * cfg.fp8_amax_history_len + 4 + 1)  # weight scales, states
            if sp_scatter and not t.name.endswith("output_layer.weight"):
                out["fp8_scaling_metadata"] += _SCATTER_STATE_BYTES
            if cfg.grad_accumulation in SUM_BYTES and dp == 1:
                out["gradients"] += SUM_BYTES[cfg.grad_accumulation] * n  # the sum over micro-batches is the step's
                if cfg.grad_accumulation == "fp16":
                    out["fp8_scaling_metadata"] += 4  # the FP16 buffer's scale
            elif level == "O1":
                out["gradients"] += n
                # gradient scale(s): the recipe's grid when held in E4M3 over micro-batches, else the DP reduction's
                out["fp8_scaling_metadata"] += scales if dp == 1 else 4
            else:  # E4M3 gradient after the reduction: with the owner (O3)
                mine["gradients"] += n
                mine["fp8_scaling_metadata"] += 4
            if level == "O1":
                out["master_weights"] += 4 * n
                out["optimizer_states"] += 8 * n + 4
            else:  # O2, O3: master, m, v and their scales live with the owner
                mine["master_weights"] += 2 * n
                mine["optimizer_states"] += 3 * n + 4
                mine["fp8_scaling_metadata"] += 3 * 4  # master, m, v scales
        else:
            out["weights"] += hp * n
            if level in ("none", "O1"):
                share = dp if cfg.use_distributed_optimizer else 1
                out["gradients"] += grad_hp * n
                out["master_weights"] += -(-hp_master * n // share)
                out["optimizer_states"] += -(-8 * n // share) + 4
                if level == "none" and hp == 2 and not cfg.pretrain_bf16:
                    out["fp8_scaling_metadata"] += 3 * 4  # fp8.optim.AdamW(precision="O1"): m, v, master scales
            else:
                mine["gradients"] += grad_hp * n
                mine["master_weights"] += hp_master * n
                mine["optimizer_states"] += 3 * n + 4
                mine["fp8_scaling_metadata"] += 2 * 4  # m, v scales
    per_rank = [{k: out[k] + mine[k] for k in out} for mine in owned]
    worst = max(per_rank, key=lambda d: sum(d.values()))  # first of the most loaded ranks
    largest = max(t.numel for t in tensors)
    fp8_numel = sum(t.numel for t in tensors if t.fp8)
    if level == "O1":
        # FP8 gradients are dequantized into fp32 master gradients; an fp32 sum not reduced to FP8 (one DP rank)
        # is the master gradient itself.
        held_in_fp32 = cfg.grad_accumulation == "fp32" and cfg.data_parallel_size == 1
        transient = 0 if held_in_fp32 else 4 * fp8_numel
    else:
        transient = 16 * largest
    if level == "O3" and cfg.data_parallel_size > 1:
        dp = cfg.data_parallel_size
        for is_fp8, elem in ((True, 1), (False, hp)):
            loads = [0] * dp
            for t, owner in zip(tensors, owners):
                if t.fp8 == is_fp8:
                    loads[owner] += t.numel
            transient += (dp + 1) * max(loads) * elem
    window = 0
    if cfg.grad_accumulation in SUM_BYTES and cfg.data_parallel_size > 1:
        # FP16 (+ scale) or fp32 sums on every rank until the reduction; beyond the step's E4M3 gradients (payload +
        # scale) of the worst rank (O3: only those it owns).
        worst_rank = per_rank.index(worst)  # 0 when not sharded: every owner is 0
        held = [t.numel for t, owner in zip(tensors, owners) if t.fp8 and owner == worst_rank]
        sum_scales = 4 * sum(t.fp8 for t in tensors) if cfg.grad_accumulation == "fp16" else 0
        window = SUM_BYTES[cfg.grad_accumulation] * fp8_numel + sum_scales - sum(held) - 4 * len(held)
    return worst, {"gradient_accumulation": window, "step_transients": transient}, per_rank


# -- activations ----------------------------------------------------------------------------------------
def _stored(cfg: PlannerConfig, width: float, elem: int, tokens: float) -> float:
    """Bytes per token of one tensor saved for backward, ``width`` values of ``elem`` bytes per token, over ``tokens``
    tokens: as is, or with ``fp8_activations`` (tensors of ``elem`` >= 2 bytes and at least 4,096 values) as E4M3 plus
    an fp32 scale per 1 x 128 tile of its last dimension (tiles of 128 consecutive values when it is shorter)."""
    if not cfg.fp8_activations or elem < 2 or width * tokens < _MIN_COMPRESSED:
        return elem * width
    scales = math.ceil(width / _TILE) if width >= _TILE else width / _TILE
    return width + 4 * scales


def _norm_saved(cfg: PlannerConfig, tokens: float) -> float:
    """Bytes per token a norm saves besides its statistics: its input (megatron-core); transformers' RMSNorm saves
    its input upcast to fp32 (a copy unless the model is fp32) and the normalized value before the weight (hp)."""
    h, hp = cfg.hidden_size, cfg.hp_bytes
    if cfg.implementation == "transformers":
        return _stored(cfg, h, 4, tokens) + _stored(cfg, h, hp, tokens)
    return _stored(cfg, h, hp, tokens)


def _fp8_input(cfg: PlannerConfig, width: int, n_out: int) -> float:
    """Bytes per token of an FP8 linear's saved input of ``width`` features: E4M3 plus the recipe's scales (a
    per-token scale rowwise, one per 1 x 128 tile blockwise; tensorwise: one per tensor, not per token)."""
    recipe = _recipe(cfg, n_out, width)
    if recipe == "rowwise":
        return width + 4
    if recipe == "blockwise":
        return width + 4 * math.ceil(width / _TILE)
    return width


def _layer_activation_bytes_per_token(cfg: PlannerConfig) -> float:
    """Bytes one transformer layer keeps for backward per token of one micro-batch (no recompute)."""
    h, f, a = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_attention_heads
    tp = cfg.tensor_model_parallel_size
    sp = tp if cfg.sequence_parallel else 1
    hp = cfg.hp_bytes
    tokens = cfg.seq_length * cfg.micro_batch_size
    stats = 8 if cfg.normalization == "LayerNorm" else 4
    mask = 1 if cfg.hidden_dropout > 0 else 0
    head_dim = h // a
    hf = cfg.implementation == "transformers"
    fc1_out = 2 * f if cfg.swiglu else f
    act_in = 2 * f if cfg.swiglu else f
    # norm inputs and statistics, dropout masks: /TP with SP
    seq_shard = 2 * (_norm_saved(cfg, tokens / sp) + stats) + 2 * mask * h
    # QKV and fc1 inputs: fp8lm's column-parallel linears save the all-gathered input (E4M3 + the recipe's scales;
    # the high-precision baseline's, inside its autograd function, as is: fp8.activations leaves such leaves alone)
    if cfg.fp8:
        gathered = _fp8_input(cfg, h, cfg.qkv_size // tp) + _fp8_input(cfg, h, fc1_out // tp)
    elif hf:  # F.linear saves its input like any op: fp8_activations compresses it
        gathered = 2 * _stored(cfg, h, hp, tokens)
    else:
        gathered = 2 * hp * h
    # q, k, v (per head: last dimension head_dim); attention output; fp32 logsumexp; proj input (the attention
    # output itself in high precision, a separate E4M3 copy in FP8); activation-function input; fc2 input
    qkv = _stored(cfg, cfg.qkv_size // tp, hp, tokens) if not cfg.fp8_activations else \
        (cfg.qkv_size // tp) / head_dim * _stored(cfg, head_dim, hp, tokens * head_dim)
    attn_out = _stored(cfg, h // tp, hp, tokens) if not cfg.fp8_activations else \
        (h // tp) / head_dim * _stored(cfg, head_dim, hp, tokens * head_dim)
    # (high precision: the attention output's own storage, unless fp8_activations stores a compressed copy of it)
    if cfg.fp8:
        proj_in = _fp8_input(cfg, h // tp, h)
    elif hf:  # a view of the attention output of another shape: compressed apart from it
        proj_in = _stored(cfg, h, hp, tokens) if cfg.fp8_activations else 0
    else:
        proj_in = hp * h // tp if cfg.fp8_activations else 0
    act = _stored(cfg, act_in // tp, hp, tokens)
    if hf:  # act(gate) * up keeps act(gate) as well as gate and up
        act = 3 * _stored(cfg, f, hp, tokens)
    fc2_in = _fp8_input(cfg, f // tp, h) if cfg.fp8 else (_stored(cfg, f, hp, tokens) if hf else hp * f // tp)
    sharded = qkv + attn_out + 4 * a / tp + proj_in + act + fc2_in
    return seq_shard / sp + gathered + sharded


def _activations(cfg: PlannerConfig, stage: int) -> int:
    """Activation bytes held at the peak by one GPU of ``stage`` (see the module docstring)."""
    tp, pp, L = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.num_layers
    sp = tp if cfg.sequence_parallel else 1
    tokens = cfg.seq_length * cfg.micro_batch_size
    hp = cfg.hp_bytes
    layers = L // pp
    nmb = cfg.num_microbatches
    vpp = cfg.num_layers_per_virtual_pipeline_stage
    if vpp is None:
        in_flight = pp - stage if nmb is None else min(pp - stage, nmb)
        layer_mbs = in_flight * layers  # layer x micro-batch activations held
    else:
        chunks = L // (pp * vpp)
        held = 2 * (pp - stage - 1) + (chunks - 1) * pp + 1
        if nmb is not None:
            held = min(held, chunks * nmb)
        in_flight = -(-held // chunks)
        layer_mbs = held * vpp
    full = _layer_activation_bytes_per_token(cfg)
    head = 0.0  # the last stage's final norm, output layer and loss (one micro-batch: freed first in backward)
    if stage == pp - 1:
        h, local = cfg.hidden_size, tokens / sp
        out_in = _fp8_input(cfg, h, cfg.padded_vocab_size) if cfg.fp8_output else _stored(cfg, h, hp, local)
        stats = 8 if cfg.normalization == "LayerNorm" else 4
        head += (_norm_saved(cfg, local) + stats + out_in) / sp
        # fp32 logits for the loss (4 V / TP); labels (int64), the vocab-parallel loss's target mask (bool) and
        # the training loop's fp32 loss mask (transformers: the shifted labels, int64)
        if cfg.implementation == "transformers":
            # log_softmax's fp32 output (kept exact by fp8.activations: its backward amplifies rounding errors), the
            # shifted labels (int64), the RoPE cos and sin tables (one row per sequence position)
            head += 4 * cfg.padded_vocab_size + 8 + 2 * cfg.seq_length * (h // cfg.num_attention_heads) * hp / tokens
        else:
            head += _stored(cfg, cfg.padded_vocab_size / tp, 4, tokens) + 8 + 1 + 4
    if cfg.recompute_granularity == "full":
        # Every layer's input (one checkpoint each) stays; in backward one layer at a time is recomputed (its
        # own input is the checkpointed one), after the head's tensors are freed: the peak is the larger of
        # the two.
        layer_in = _stored(cfg, cfg.hidden_size, hp, tokens / sp) / sp
        # With fp8_activations the checkpoint is a compressed copy: the layer recomputes from a restored one (a
        # leaf, kept as is by the recomputed layer), held beside it.
        restored = hp * cfg.hidden_size / sp if layer_in != hp * cfg.hidden_size / sp else 0
        per_token = layer_mbs * layer_in + max(full - layer_in + restored, head)
    else:
        per_token = layer_mbs * full + head
    if stage == 0:
        mask = 1 if cfg.hidden_dropout > 0 else 0
        ids = 8 + (1 if tp > 1 else 0)  # token ids (int64); with TP, the vocab-parallel embedding's range mask
        if cfg.position_embedding_type == "learned_absolute":
            ids += 8  # position ids (int64)
        per_token += in_flight * (ids + mask * cfg.hidden_size / sp)  # and the embedding dropout mask
    return int(math.ceil(per_token * tokens))


def _comm_buffers(cfg: PlannerConfig) -> int:
    tp, pp, dp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.data_parallel_size
    hp, tokens_h = cfg.hp_bytes, cfg.seq_length * cfg.micro_batch_size * cfg.hidden_size
    total = 0
    if dp > 1:
        wire = 1 if cfg.fp8 else hp
        total += 2 * cfg.dp_bucket_bytes + 4 * (cfg.dp_bucket_bytes // wire)
    if tp > 1 and cfg.sequence_parallel:
        total += tokens_h * hp
    if pp > 1:
        total += 2 * tokens_h * hp // (tp if cfg.sequence_parallel else 1)
    return total


# -- the plan -----------------------------------------------------------------------------------------
def plan_memory(config: PlannerConfig) -> dict:
    """Per-GPU memory plan of ``config``. Keys:

    - ``params_total``: the model's parameters (padded vocabulary); ``params_per_gpu``: the largest
      pipeline stage's parameters on one GPU; ``fp8_params_per_gpu``: of those, in FP8 weights;
    - ``bytes``: bytes per category of :data:`CATEGORIES` on the worst GPU (the stage with the largest
      ``total_bytes``, its worst DP rank); ``total_bytes``, ``total_gib``; ``model_state_bytes_per_param``;
    - ``worst_stage``; ``stages``: per pipeline stage ``{"stage", "params", "fp8_params", "bytes", "total_bytes",
      "dp_rank_bytes"}`` (``dp_rank_bytes``: the model-state categories of each data-parallel rank, which
      differ only under O3's whole-tensor sharding);
    - ``layout``: ``{"tp", "pp", "dp", "vpp", "world_size", "sequence_parallel", "num_microbatches"}``;
      ``config``: the config as a dict.
    """
    cfg = config
    stages = []
    comm = _comm_buffers(cfg)
    pp = cfg.pipeline_model_parallel_size
    by_kind: dict[tuple[bool, bool], tuple] = {}  # middle stages hold the same tensors: plan them once
    for stage in range(pp):
        kind = (stage == 0, stage == pp - 1)
        if kind not in by_kind:
            tensors = _stage_tensors(cfg, stage)
            by_kind[kind] = (*_model_state(cfg, tensors), sum(t.numel for t in tensors),
                             sum(t.numel for t in tensors if t.fp8))
        state, transient, per_rank, n_params, n_fp8 = by_kind[kind]
        b = {**state, "activations": _activations(cfg, stage), "communication_buffers": comm, **transient}
        total = sum(state.values()) + max(b["activations"] + comm + b["gradient_accumulation"], b["step_transients"])
        dp_rank_bytes = [dict(r) for r in per_rank] if len(per_rank) > 1 else \
            [dict(per_rank[0]) for _ in range(cfg.data_parallel_size)]
        stages.append({"stage": stage, "params": n_params, "fp8_params": n_fp8, "bytes": b, "total_bytes": total,
                       "dp_rank_bytes": dp_rank_bytes})
    worst = max(stages, key=lambda s: (s["total_bytes"], -s["stage"]))
    biggest = max(stages, key=lambda s: s["params"])
    state_bytes = sum(worst["bytes"][c] for c in CATEGORIES[:5])
    return {
        "params_total": _total_params(cfg),
        "params_per_gpu": biggest["params"],
        "fp8_params_per_gpu": biggest["fp8_params"],
        "bytes": dict(worst["bytes"]),
        "total_bytes": worst["total_bytes"],
        "total_gib": worst["total_bytes"] / GiB,
        "model_state_bytes_per_param": state_bytes / worst["params"],
        "worst_stage": worst["stage"],
        "stages": stages,
        "layout": {"tp": cfg.tensor_model_parallel_size, "pp": cfg.pipeline_model_parallel_size,
                   "dp": cfg.data_parallel_size, "vpp": cfg.num_layers_per_virtual_pipeline_stage,
                   "world_size": cfg.world_size, "sequence_parallel": cfg.sequence_parallel,
                   "num_microbatches": cfg.num_microbatches},
        "config": dataclasses.asdict(cfg),
    }


def format_plan(plan: dict) -> str:
    """A human-readable summary of :func:`plan_memory`'s result (what ``--dry-run`` prints)."""
    lay, cfg = plan["layout"], plan["config"]
    lines = [
        f"layout: TP={lay['tp']} PP={lay['pp']} DP={lay['dp']} (world size {lay['world_size']})"
        + (f", virtual pipeline {lay['vpp']} layers/chunk" if lay["vpp"] else "")
        + (", sequence parallel" if lay["sequence_parallel"] else "")
        + f"; fp8 opt level {cfg['fp8_opt_level']}, {'bf16' if cfg['bf16'] else 'fp32'}, "
          f"micro-batch {cfg['micro_batch_size']} x seq {cfg['seq_length']}, recompute {cfg['recompute_granularity']}",
        f"parameters: {plan['params_total']:,} in the model; {plan['params_per_gpu']:,} per GPU "
        f"(largest pipeline stage; {plan['fp8_params_per_gpu']:,} in FP8 weights)",
    ]
    for s in plan["stages"]:
        lines.append(f"  stage {s['stage']}: {s['params']:,} parameters per GPU, {s['total_bytes'] / GiB:.2f} GiB planned")
    lines.append(f"planned memory per GPU (worst: stage {plan['worst_stage']}):")
    for cat in CATEGORIES:
        lines.append(f"  {cat:<22} {plan['bytes'][cat] / GiB:10.3f} GiB")
    lines.append(f"  {'total':<22} {plan['total_gib']:10.3f} GiB "
                 f"(model state {plan['model_state_bytes_per_param']:.2f} B/param)")
    return "\n".join(lines)
