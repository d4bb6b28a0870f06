"""Per-GPU memory model for GPT training with fp8lm on megatron-core: model state, activations and
communication buffers for a model config (dense or mixture-of-experts), a parallel layout (TP x PP x DP, experts
over EP data-parallel ranks), micro-batch, sequence length, activation recomputation and FP8 opt level, and the
expert-parallel all-to-all's bytes; plus FP8-LM's Figure 1 question (the largest GPT
that fits on N x 80 GB GPUs per opt level). Its command line is ``tools/memory_planner.py``.

Python API (``pretrain_gpt.py --dry-run`` uses it): ``PlannerConfig`` (frozen, validated;
``PlannerConfig.from_args(namespace)`` takes pretrain_gpt.py's argparse namespace), ``plan_memory(config)
-> dict``, ``format_plan(plan) -> str``, ``format_moe(plan)``, ``all_to_all_bytes(config)``, ``largest_model`` and
``figure1``.

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

Weight transposes (``weight_transposes``, model state: ``fp8.memory_report``'s ``"weight transposes"``): the GEMM
operands an FP8 weight keeps between optimizer steps (:mod:`fp8.quantizers`, :attr:`fp8.Float8Tensor.transpose_cache`;
made at the first use, refreshed in place at the end of each optimizer step, so one set is held for the whole run).
Where the input-gradient GEMM ``dX = dY @ W`` runs ``torch._scaled_mm``, which takes ``W`` column-major: the
transpose, 1 byte per FP8 weight element, and its fp32 ``scale_inv`` (4 bytes) under the tensorwise recipe; the weight
re-quantized per input channel plus its fp32 scales (1 byte per element + 4 per input channel) and the forward's
per-output-channel ``scale_inv`` (4 per output channel) under rowwise. Under blockwise only the ``scale_inv`` grid
(4 bytes per 128 x 128 block, on every device: the Triton block GEMM reads the weight as it is). Every rank holds
those of all its FP8 weights (O3 included: the weights are all-gathered). Whether that GEMM runs ``torch._scaled_mm``
follows ``fp8_gemm_backend`` (pretrain_gpt.py's ``--fp8-gemm-backend``) on ``gemm_device``: ``"scaled_mm"`` always,
``"emulated"`` never, ``"auto"`` on a GPU (``gemm_device="cuda"``, the default: the planner plans GPUs, whatever
machine it runs on) and not on the CPU (``gemm_device="cpu"``: the CPU runs this planner is validated against). The
experts of ``moe_grouped_gemm`` keep theirs as per-expert linears do, and on a GPU under tensorwise the grouped
forward GEMM keeps the experts' payloads stacked too (1 byte per element + 4 per output channel). At 7B (TP1) the
tensorwise transposes are 6.0 GiB per GPU (6,442,450,944 FP8 weight elements, plus 4 bytes per weight).

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
instead (one device; exact against the measured bytes, tests/training/test_memory_planner.py; its model state is planned as
the megatron-core GPT's, with the untied lm_head in FP8 where ``fp8.initialize`` converts it): each RMSNorm saves its input upcast to fp32 and the
normalized value, SwiGLU saves act(gate) besides gate and up, plain linears' inputs are compressible like any saved
tensor, q/k/v (and gate/up) share one FP8 cast of their input, an untied output layer with dimensions that are
multiples of 16 runs FP8, the loss keeps log-softmax's fp32 output exact, and the RoPE tables are saved.
``"selective"`` recomputes the attention core, which fused attention does not store anyway, so it equals
``"none"`` here. Pipeline: under 1F1B stage i holds min(PP - i, micro-batches) micro-batches in flight;
interleaved (virtual chunks of v layers, m = L / (PP v) chunks) stage i holds min(2 (PP - i - 1) + (m - 1)
PP + 1, m x micro-batches) chunk-micro-batches.

Mixture of experts (``num_experts``: every MLP is megatron-core's ``MoELayer``, fp8lm's linears as experts). Parameters:
the router (E x h, plus E biases with ``add_bias_linear``; high precision, replicated over TP), this rank's E / EP
routed experts, each an MLP of ``moe_ffn_hidden_size`` split by TP (expert-TP = TP; expert linears have no collective
of their own, so no reduce-scatter state), the shared expert (an MLP of ``moe_shared_expert_intermediate_size`` split
by TP; with ``moe_grouped_gemm`` also each tensorwise FP8 projection's two delayed-scaling states, which
``FP8GroupedMLP`` casts all local experts' rows with). With EP > 1 the routed experts' model state is planned over their own group, the expert-data-parallel group
of DP / EP ranks (gradient reduction, O3 ownership by ``whole_tensor_partition``, the O3 weight all-gather, the
accumulation window; one rank in the group: the sum over micro-batches is the step's gradient), the rest over DP;
data-parallel rank d is expert-data-parallel rank d // EP. Activations per MoE layer (megatron-core 0.16 without
fusions, uniform routing): on the T / SP tokens this rank holds, the router's fp32 input, top-k indices (int64) and
probabilities (fp32), the permutation's row indices (int64 per routed row), the routing map (bool) and the
probabilities' masked_select source (fp32, E per token), with a load-balancing loss the fp32 scores over all experts;
the router weight's fp32 copy with 16-bit weights; at the experts, topk x TP / SP rows per token (the all-to-all
keeps each rank's count, the expert-TP all-gather multiplies it by TP), each: fc1's input (hp, or E4M3 with the
recipe's scales), the activation's saves (GELU: its input; SwiGLU: the fc1 output, silu's output and the up half
plus ``glu_linear_offset``), the activation output and the row's fp32 probability (the probability multiply),
fc2's input; the shared expert as a dense MLP with the same activation saves. Measured on CPU (megatron-core GPT,
gloo; tests/training/test_memory_plan_moe.py): model state byte-exact at TP2 + SP, DP2 EP2 and DP4 EP2 (O3 sharded over
expert-DP); activations within 0.01% where every rank routes the same tokens, each rank within 5% under EP (the
router does not route uniformly). The expert-parallel all-to-all (``moe_token_dispatcher_type="alltoall"``, EP > 1):
per MoE layer and micro-batch each rank sends (EP - 1) / EP of its T / SP x topk rows in the dispatch, the combine
and both backwards (:func:`all_to_all_bytes`), a row ``hidden`` bytes + a 4-byte scale with ``moe_fp8_dispatch``,
else ``hidden`` values in hp, plus one fp32 probability per row in the dispatch and its backward; its send and
receive buffers of one layer are communication buffers. Not counted: the all-gather dispatcher's token all-gather
over the tensor x expert-parallel group, the expert-TP all-gather's bytes, the per-expert token counts.

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

``total_bytes`` = weights + master weights + gradients + optimizer states + FP8 scaling metadata + weight
transposes + max(activations + communication buffers + gradient accumulation, optimizer-step transients). Not counted: CUDA context and
library workspaces (~0.5-1 GiB), allocator fragmentation (the Figure 1 mode keeps 10% headroom).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from ..config_rules import GEMM_BACKENDS, OPT_LEVELS, check_config, normalize_opt_level

__all__ = ["PlannerConfig", "plan_memory", "format_plan", "format_moe", "all_to_all_bytes", "routed_rows_per_token",
           "CATEGORIES", "STATE_CATEGORIES", "OPT_LEVELS", "whole_tensor_partition", "GEMM_DEVICES", "GEMM_BACKENDS",
           "holds_weight_transposes",
           "default_min_fp8_dim", "GRAD_ACCUMULATION", "NORMALIZATIONS", "POSITION_EMBEDDINGS",
           "RECOMPUTE_GRANULARITIES", "MOE_DISPATCHERS", "MOE_LOAD_BALANCING"]

CATEGORIES = (
    "weights", "master_weights", "gradients", "optimizer_states", "fp8_scaling_metadata", "weight_transposes",
    "activations", "communication_buffers", "gradient_accumulation", "step_transients",
)
"""Keys of ``plan_memory(...)["bytes"]``."""

STATE_CATEGORIES = CATEGORIES[:6]
"""The categories held for the whole run (model state: ``fp8.memory_report``'s categories, ``weight_transposes``
its ``"weight transposes"``); the others are the peak's (activations and what is held with them) or the optimizer
step's (transients)."""

GEMM_DEVICES = ("cuda", "cpu")
"""``PlannerConfig.gemm_device``: the device whose FP8 GEMMs the plan assumes (module docstring)."""

_IMPLEMENTATIONS = ("megatron-core", "transformers")
MOE_DISPATCHERS = ("allgather", "alltoall")  # pretrain_gpt.py's --moe-token-dispatcher-type
MOE_LOAD_BALANCING = ("aux_loss", "seq_aux_loss", "sinkhorn", "none")  # --moe-router-load-balancing-type
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDINGS = ("learned_absolute", "rope")
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")
GRAD_ACCUMULATION = ("fp16", "fp32", "fp8")  # fp8.linear.GRAD_ACCUMULATION (planning imports no torch)
SUM_BYTES = {"fp16": 2, "fp32": 4}  # bytes per element of an FP8 weight's gradient sum before the DP reduction
_RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4")  # fp8.recipes.RECIPES
_TILE = 128  # fp8.recipes.BLOCKWISE_TILE, fp8.activations' tile width
_BLOCKS = {"blockwise": _TILE, "mxfp8": 32, "nvfp4": 32}  # fp8.recipes.Recipe.tile: the recipes scaled in K blocks
_SCALE_BLOCK = {"blockwise": _TILE, "mxfp8": 32, "nvfp4": 16}  # edge of a weight's square scale blocks
_GEMM_MULTIPLE = 16  # fp8.eligibility.GEMM_MULTIPLE: the FP8 GEMM's K multiple (tokens padded to it)
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
    ``num_experts`` (None: dense MLPs) makes every MLP a mixture of experts (``moe_*`` and
    ``expert_model_parallel_size`` as pretrain_gpt.py's MoE flags; ``moe_ffn_hidden_size`` defaults to
    ``ffn_hidden_size``), checked as pretrain_gpt.py checks them.
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
    fp8_recipe: str = "tensorwise"  # scale granularity (fp8.recipes): tensorwise | rowwise | blockwise | mxfp8 | nvfp4
    fp8_activations: bool = False  # tensors saved for backward stored as E4M3 in 1x128 tiles (fp8.activations)
    implementation: str = "megatron-core"  # whose layers save the activations: megatron-core | transformers (Llama)
    num_experts: int | None = None  # every MLP a megatron-core MoELayer of this many routed experts (None: dense MLPs)
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # an expert's FFN size (default ffn_hidden_size)
    moe_shared_expert_intermediate_size: int | None = None  # FFN size of a shared expert every token runs through
    expert_model_parallel_size: int = 1  # ranks (of the data-parallel group) the routed experts are spread over
    moe_token_dispatcher_type: str = "allgather"  # allgather | alltoall
    moe_fp8_dispatch: bool = False  # the expert-parallel all-to-all in FP8 rows (E4M3 + an fp32 scale per row)
    moe_aux_loss_coeff: float = 0.0
    moe_router_load_balancing_type: str = "aux_loss"  # aux_loss | seq_aux_loss | sinkhorn | none
    moe_grouped_gemm: bool = False  # a rank's experts as one grouped GEMM per projection (FP8GroupedMLP)
    fp8_gemm_backend: str = "auto"  # --fp8-gemm-backend: auto | scaled_mm | emulated
    gemm_device: str = "cuda"  # the device whose GEMMs are planned: cuda (a GPU, the default) | cpu
    # --fp8-high-precision-from-iteration with --fp8-high-precision-mode: "linear" saves each FP8 linear's input in
    # high precision (hp bytes) from that iteration on, the plan's peak; "forward" (or "none") saves what FP8 saves
    fp8_high_precision_mode: str = "none"

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.num_experts is not None and self.moe_ffn_hidden_size is None:
            object.__setattr__(self, "moe_ffn_hidden_size", self.ffn_hidden_size)
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
        for flag, value, choices in (("--fp8-high-precision-mode", self.fp8_high_precision_mode,
                                      ("none", "forward", "linear")),
                                     ("--fp8-recipe", self.fp8_recipe, _RECIPES),
                                     ("--fp8-grad-accumulation", self.grad_accumulation, GRAD_ACCUMULATION),
                                     ("--fp8-gemm-backend", self.fp8_gemm_backend, GEMM_BACKENDS),
                                     ("gemm_device", self.gemm_device, GEMM_DEVICES),
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
        self._check_moe()

    def _check_moe(self) -> None:
        """The mixture-of-experts fields: consistent with each other and the layout (pretrain_gpt.py's rules)."""
        ep, tp = self.expert_model_parallel_size, self.tensor_model_parallel_size
        if self.num_experts is None:
            moe_only = [flag for flag, value in (("--expert-model-parallel-size", ep != 1),
                                                 ("--moe-fp8-dispatch", self.moe_fp8_dispatch),
                                                 ("--moe-grouped-gemm", self.moe_grouped_gemm),
                                                 ("--moe-ffn-hidden-size", self.moe_ffn_hidden_size is not None),
                                                 ("--moe-shared-expert-intermediate-size",
                                                  self.moe_shared_expert_intermediate_size is not None)) if value]
            if moe_only:
                raise ValueError(f"{', '.join(moe_only)} need(s) --num-experts (the model has dense MLPs)")
            return
        for name in ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "expert_model_parallel_size"):
            _positive(name, getattr(self, name))
        if self.moe_shared_expert_intermediate_size is not None:
            _positive("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size)
        _one_of("--moe-token-dispatcher-type", self.moe_token_dispatcher_type, MOE_DISPATCHERS)
        _one_of("--moe-router-load-balancing-type", self.moe_router_load_balancing_type, MOE_LOAD_BALANCING)
        if not self.moe_aux_loss_coeff >= 0:
            raise ValueError(f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff!r}")
        if self.implementation != "megatron-core":
            raise ValueError("num_experts plans megatron-core's MoE layer: use implementation='megatron-core'")
        if self.moe_router_topk > self.num_experts:
            raise ValueError(f"--moe-router-topk {self.moe_router_topk} must be in [1, --num-experts "
                             f"{self.num_experts}]")
        if self.num_experts % ep:
            raise ValueError(f"--expert-model-parallel-size {ep} must divide --num-experts {self.num_experts}")
        if self.data_parallel_size % ep:
            raise ValueError(f"--expert-model-parallel-size {ep} must divide the data-parallel size "
                             f"{self.data_parallel_size} (experts are spread over data-parallel ranks): raise the "
                             f"data-parallel size to a multiple of {ep} or lower --expert-model-parallel-size")
        if self.moe_fp8_dispatch and (not self.fp8 or self.moe_token_dispatcher_type != "alltoall"):
            raise ValueError("--moe-fp8-dispatch dispatches tokens in FP8 over the expert-parallel all-to-all: it "
                             "needs --fp8-opt-level O1/O2/O3 and --moe-token-dispatcher-type alltoall")
        if self.moe_grouped_gemm and tp > 1:
            raise ValueError(f"--moe-grouped-gemm runs each expert unsplit (expert tensor-parallel size 1), but "
                             f"--tensor-model-parallel-size {tp} splits the experts: use --tensor-model-parallel-size 1 "
                             f"(spread the experts with --expert-model-parallel-size instead), or drop --moe-grouped-gemm")
        if tp > 1 and self.add_bias_linear:
            raise ValueError("experts split by tensor parallelism take no bias (megatron-core): add "
                             "--disable-bias-linear (add_bias_linear=False), or use --tensor-model-parallel-size 1")
        if self.moe_shared_expert_intermediate_size is not None and self.add_bias_linear:
            raise ValueError("megatron-core's shared expert takes no bias: add --disable-bias-linear "
                             "(add_bias_linear=False) with --moe-shared-expert-intermediate-size")
        for flag, size in (("--moe-ffn-hidden-size", self.moe_ffn_hidden_size),
                           ("--moe-shared-expert-intermediate-size", self.moe_shared_expert_intermediate_size)):
            if size is not None and size % tp:
                raise ValueError(f"{flag} {size} is not divisible by --tensor-model-parallel-size {tp}: use a "
                                 f"multiple of {tp}")

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
    def expert_data_parallel_size(self) -> int:
        """DP / EP: the ranks holding the same routed experts (their gradients are reduced, and at O3 their
        optimizer state sharded, over this expert-data-parallel group)."""
        return self.data_parallel_size // self.expert_model_parallel_size

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
    def from_run_config(cls, cfg, **overrides) -> PlannerConfig:
        """The plan of a ``pretrain_gpt.py`` run (:class:`megatron.training.config.RunConfig`): its fields by their
        flags' names, through :meth:`from_args`'s one mapping of flags to planner fields."""
        return cls.from_args(argparse.Namespace(**cfg.flat()), **overrides)

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
            # included: FP32 main gradients at level none (megatron/training/optimizer.py), stepped by
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
            num_experts=get("num_experts"), moe_router_topk=get("moe_router_topk", 2),
            moe_ffn_hidden_size=get("moe_ffn_hidden_size") if get("num_experts") is not None else None,
            moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size"),
            expert_model_parallel_size=get("expert_model_parallel_size", 1),
            moe_token_dispatcher_type=get("moe_token_dispatcher_type", "allgather"),
            moe_fp8_dispatch=bool(get("moe_fp8_dispatch", False)),
            moe_aux_loss_coeff=float(get("moe_aux_loss_coeff", 0.0)),
            moe_router_load_balancing_type=get("moe_router_load_balancing_type", "aux_loss"),
            moe_grouped_gemm=bool(get("moe_grouped_gemm", False)),
            fp8_gemm_backend=get("fp8_gemm_backend", "auto"),
            fp8_high_precision_mode="none" if get("fp8_high_precision_from_iteration") is None
            else get("fp8_high_precision_mode", "forward"),
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
    expert: bool = False  # a routed expert's parameter (megatron-core's MoE layer)


def fp8_linear_planned(n_in: int, n_out: int, min_fp8_dim: int) -> bool:
    """Whether a linear whose per-rank weight is ``n_out x n_in`` runs in FP8: :func:`fp8.eligibility.fp8_linear_problem`
    (the engine's one rule) as Megatron's layer specs apply it: kept in high precision only when too small (a shape
    FP8 GEMMs cannot take is refused at start-up, not planned). Mirrored here because planning imports no torch;
    ``tests/training/test_eligibility.py`` holds the two equal."""
    return min(n_in, n_out) >= min_fp8_dim


def default_min_fp8_dim() -> int:
    """pretrain_gpt.py's default ``--fp8-min-dim``: 2048 on CUDA (``fp8.convert.CUDA_MIN_FP8_DIM``), else 0."""
    import torch

    return 2048 if torch.cuda.is_available() else 0


def _stage_tensors(cfg: PlannerConfig, stage: int) -> list[_Tensor]:
    """The parameters one GPU of pipeline stage ``stage`` holds (any TP rank: all hold the same sizes)."""
    h, f, tp, pp = cfg.hidden_size, cfg.ffn_hidden_size, cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    bias = cfg.add_bias_linear
    tensors: list[_Tensor] = []

    def norm(prefix: str) -> None:
        tensors.append(_Tensor(f"{prefix}.weight", h, False))
        if cfg.normalization == "LayerNorm":
            tensors.append(_Tensor(f"{prefix}.bias", h, False))

    def linear(prefix: str, n_out: int, n_in: int, bias_numel: int, expert: bool = False) -> None:
        tensors.append(_Tensor(f"{prefix}.weight", n_out * n_in, cfg.fp8 and fp8_linear_planned(n_in, n_out,
                                                                                                cfg.min_fp8_dim),
                               n_out, n_in, expert))
        if bias:
            tensors.append(_Tensor(f"{prefix}.bias", bias_numel, False, expert=expert))

    def mlp(prefix: str, ffn: int, expert: bool = False) -> None:
        out = 2 * ffn if cfg.swiglu else ffn
        linear(f"{prefix}.linear_fc1", out // tp, h, out // tp, expert)
        linear(f"{prefix}.linear_fc2", h, ffn // tp, h, expert)

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
        if cfg.num_experts is None:
            mlp(f"{p}.mlp", f)
        else:  # megatron-core's MoELayer: the router (experts x h, replicated over TP), this rank's routed experts
            # (each an MLP of moe_ffn_hidden_size split by TP: expert-TP = TP), the shared expert (an MLP split by TP)
            tensors.append(_Tensor(f"{p}.mlp.router.weight", cfg.num_experts * h, False))
            if bias:
                tensors.append(_Tensor(f"{p}.mlp.router.bias", cfg.num_experts, False))
            first = len(tensors)
            for e in range(cfg.num_experts // cfg.expert_model_parallel_size):
                mlp(f"{p}.mlp.experts.local_experts.{e}", cfg.moe_ffn_hidden_size, expert=True)
            if cfg.moe_grouped_gemm:  # FP8GroupedMLP's own delayed-scaling states of a tensorwise FP8 projection
                for fc in ("linear_fc1", "linear_fc2"):
                    w = next((t for t in tensors[first:] if t.name.endswith(f"{fc}.weight")), None)
                    if w is not None and w.fp8 and _recipe(cfg, w.rows, w.cols) == "tensorwise":
                        tensors.append(_Tensor(f"{p}.mlp.experts.{fc}{_GROUPED_STATES}", 0, False, expert=True))
            if cfg.moe_shared_expert_intermediate_size is not None:
                mlp(f"{p}.mlp.shared_experts", cfg.moe_shared_expert_intermediate_size)
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
                                 make_vocab_size_divisible_by=1, fp8_opt_level="none", moe_fp8_dispatch=False,
                                 expert_model_parallel_size=1)
    return sum(t.numel for t in _stage_tensors(one_tp, 0))


# -- model state --------------------------------------------------------------------------------------
def _recipe(cfg: PlannerConfig, n_out: int, n_in: int) -> str:
    """The recipe a linear of this rank's shape runs: blockwise/mxfp8 fall back to tensorwise where they cannot tile."""
    tile = _BLOCKS.get(cfg.fp8_recipe)
    if tile and (n_out % tile or n_in % tile):
        return "tensorwise"
    return cfg.fp8_recipe


def _weight_scale_bytes(cfg: PlannerConfig, t: _Tensor) -> int:
    """Bytes of an FP8 weight's scale(s): one per tensor, per output channel, per 128 x 128 block (blockwise) or per
    32 x 32 block (mxfp8), fp32."""
    recipe = _recipe(cfg, t.rows, t.cols)
    if recipe == "rowwise":
        return 4 * t.rows
    if recipe in _SCALE_BLOCK:
        return 4 * -(-t.rows // _SCALE_BLOCK[recipe]) * -(-t.cols // _SCALE_BLOCK[recipe])
    return 4


def holds_weight_transposes(cfg: PlannerConfig, recipe: str) -> bool:
    """Whether an FP8 weight of this ``recipe`` (the layer's, after the blockwise fallback) keeps the transposed
    operand of its input-gradient GEMM (:attr:`fp8.Float8Tensor.transpose_cache`): where that GEMM runs
    ``torch._scaled_mm`` (tensorwise and rowwise scales; blockwise runs the Triton block GEMM on the weight as it
    is), that is with ``fp8_gemm_backend="scaled_mm"``, or ``"auto"`` on a GPU (``gemm_device="cuda"``); the
    emulated GEMM (``"emulated"``, ``"auto"`` on the CPU) keeps none."""
    if recipe == "blockwise" or cfg.fp8_gemm_backend == "emulated":
        return False
    return cfg.fp8_gemm_backend == "scaled_mm" or cfg.gemm_device == "cuda"


def _swizzled(rows: int, k_blocks: int) -> int:
    """Bytes of one E8M0 scale per row and K block in cuBLAS's swizzled layout (fp8.microscaling.swizzled_numel)."""
    return -(-rows // 128) * 128 * (-(-k_blocks // 4) * 4)


def _weight_transpose_bytes(cfg: PlannerConfig, t: _Tensor) -> int:
    """Bytes an FP8 weight keeps for its GEMMs between optimizer steps (:mod:`fp8.quantizers`' weight quantizers; made
    at the first use after a step and refreshed in place at the end of each step, so one set is held for the whole
    run): tensorwise, where its GEMMs run ``torch._scaled_mm``: the payload transposed (1 byte per element) and its
    fp32 ``scale_inv`` (4 bytes); rowwise, there: the weight re-quantized per input channel (1 byte per element), its
    fp32 scales (4 bytes per input channel) and the forward GEMM's per-output-channel ``scale_inv`` (4 bytes each);
    blockwise, always: the ``scale_inv`` grid (4 bytes per 128 x 128 block; the block GEMM reads the weight as it
    is). Experts of ``moe_grouped_gemm`` keep theirs as the per-expert linears do; on a CUDA GPU under tensorwise the
    grouped forward GEMM (``torch._scaled_grouped_mm``) also keeps the experts' payloads stacked with per-column
    ``scale_inv`` (1 byte per element + 4 per output channel)."""
    recipe = _recipe(cfg, t.rows, t.cols)
    if recipe == "blockwise":
        return 4 * -(-t.rows // _TILE) * -(-t.cols // _TILE)
    if recipe == "nvfp4":  # on every device: both packed E2M1 copies, their fp32 grids, swizzled E4M3 scales and 0-d
        # global scales (fp8.nvfp4)
        return (t.numel + 2 * 4 * -(-t.rows // 16) * -(-t.cols // 16) + _swizzled(t.rows, -(-t.cols // 16))
                + _swizzled(t.cols, -(-t.rows // 16)) + 2 * 4)
    if not holds_weight_transposes(cfg, recipe):
        return 0
    if recipe == "mxfp8":  # the transpose, the scale_inv grid and both GEMMs' swizzled E8M0 scales (fp8.mxfp8)
        return (t.numel + 4 * -(-t.rows // 32) * -(-t.cols // 32) + _swizzled(t.rows, t.cols // 32)
                + _swizzled(t.cols, t.rows // 32))
    if recipe == "rowwise":
        return t.numel + 4 * t.cols + 4 * t.rows
    stacked = t.numel + 4 * t.rows if (t.expert and cfg.moe_grouped_gemm and cfg.gemm_device == "cuda") else 0
    return t.numel + 4 + stacked


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


_GROUPED_STATES = ".grouped_scaling_states"
"""Name suffix of the no-element entry standing for a grouped projection's two scaling states (``moe_grouped_gemm``:
:class:`megatron.training.moe_grouped.FP8GroupedMLP` casts all local experts' rows with one state per projection)."""

_SCATTER_STATE_BYTES = 4 * 16 + 4 + 1
"""A sequence-parallel FP8 reduce-scatter's current-scaling state (fp8.parallel's ``_scatter_scaling``:
amax history of the default 16 fp32 + scale + flag), one per FP8 linear with SP and TP > 1."""


def _group_state(cfg: PlannerConfig, tensors: list[_Tensor], dp: int
                 ) -> tuple[dict[str, int], list[dict[str, int]], list[int]]:
    """One gradient-reduction group's tensors over its ``dp`` ranks (the data-parallel group; routed experts under
    expert parallelism: the expert-data-parallel group): (bytes per category every rank holds, bytes per category
    by owner (one entry unless sharded at O3), each tensor's owner)."""
    hp, level = cfg.hp_bytes, cfg.fp8_opt_level
    sp_scatter = cfg.sequence_parallel and cfg.tensor_model_parallel_size > 1
    hp_master = 4 if hp == 2 else 0  # FP32 parameters are their own master
    grad_hp = 4 if cfg.fp32_grads else hp
    sharded = level == "O3" and dp > 1
    owners = whole_tensor_partition([t.numel for t in tensors], dp)[0] if sharded else [0] * len(tensors)
    out = dict.fromkeys(STATE_CATEGORIES, 0)  # held by every rank
    owned = [dict.fromkeys(STATE_CATEGORIES, 0) for _ in range(dp if sharded else 1)]  # O2/O3: by the owner
    for t, owner in zip(tensors, owners):
        n, mine = t.numel, owned[owner]
        if t.name.endswith(_GROUPED_STATES):  # input and output-gradient scaling states, on every rank
            out["fp8_scaling_metadata"] += 2 * (4 * cfg.fp8_amax_history_len + 4 + 1)
            continue
        if t.fp8:
            out["weights"] += n
            scales = _weight_scale_bytes(cfg, t)
            out["fp8_scaling_metadata"] += scales + 2 * (4 * cfg.fp8_amax_history_len + 4 + 1)  # weight scales, states
            # (an expert's linear has no collective of its own: no reduce-scatter state)
            if sp_scatter and not t.name.endswith("output_layer.weight") and not t.expert:
                out["fp8_scaling_metadata"] += _SCATTER_STATE_BYTES
            out["weight_transposes"] += _weight_transpose_bytes(cfg, t)  # every rank (O3 gathers every FP8 weight)
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
    return out, owned, owners


def _model_state(cfg: PlannerConfig, tensors: list[_Tensor]) -> tuple[dict[str, int], dict[str, int], list[dict[str, int]]]:
    """(bytes per category of the worst DP rank, step transients, bytes per category of every DP rank)
    for one stage's tensors.

    Under expert parallelism (EP > 1) the routed experts' tensors form their own group, reduced (and at O3 sharded)
    over the expert-data-parallel group of DP / EP ranks (``fp8.optim.ShardedFP8Optimizer``'s ``expert_params``),
    data-parallel rank d being expert-data-parallel rank d // EP (megatron-core's order: tp, ep, then dp); the
    other tensors over the data-parallel group. With EP = 1 the experts are data-parallel like any parameter."""
    hp, level, ep = cfg.hp_bytes, cfg.fp8_opt_level, cfg.expert_model_parallel_size
    # (tensors, ranks of the group, data-parallel ranks per group rank)
    groups = [([t for t in tensors if not (t.expert and ep > 1)], cfg.data_parallel_size, 1),
              ([t for t in tensors if t.expert and ep > 1], cfg.expert_data_parallel_size, ep)]
    groups = [(ts, size, stride, *_group_state(cfg, ts, size)) for ts, size, stride in groups if ts]
    n_ranks = cfg.data_parallel_size if level == "O3" and cfg.data_parallel_size > 1 else 1

    def group_rank(d: int, owned: list, stride: int) -> int:
        return d // stride if len(owned) > 1 else 0  # 0 when not sharded: every owner is 0

    per_rank = [{k: sum(out[k] + owned[group_rank(d, owned, stride)][k] for _, _, stride, out, owned, _ in groups)
                 for k in STATE_CATEGORIES} for d in range(n_ranks)]
    worst = max(per_rank, key=lambda d: sum(d.values()))  # first of the most loaded ranks
    worst_rank = per_rank.index(worst)
    largest = max(t.numel for t in tensors)
    transient = 0 if level == "O1" else 16 * largest
    window = 0
    for ts, size, stride, _, owned, owners in groups:
        fp8_numel = sum(t.numel for t in ts if t.fp8)
        if level == "O1":
            # FP8 gradients are dequantized into fp32 master gradients; an fp32 sum not reduced to FP8 (one rank in
            # the group) is the master gradient itself.
            held_in_fp32 = cfg.grad_accumulation == "fp32" and size == 1
            transient += 0 if held_in_fp32 else 4 * fp8_numel
        if level == "O3" and size > 1:
            for is_fp8, elem in ((True, 1), (False, hp)):
                loads = [0] * size
                for t, owner in zip(ts, owners):
                    if t.fp8 == is_fp8:
                        loads[owner] += t.numel
                transient += (size + 1) * max(loads) * elem
        if cfg.grad_accumulation in SUM_BYTES and size > 1:
            # FP16 (+ scale) or fp32 sums on every rank until the reduction; beyond the step's E4M3 gradients
            # (payload + scale) of the worst rank (O3: only those it owns).
            rank = group_rank(worst_rank, owned, stride)
            held = [t.numel for t, owner in zip(ts, owners) if t.fp8 and owner == rank]
            sum_scales = 4 * sum(t.fp8 for t in ts) if cfg.grad_accumulation == "fp16" else 0
            window += SUM_BYTES[cfg.grad_accumulation] * fp8_numel + sum_scales - sum(held) - 4 * len(held)
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


def _fp8_input(cfg: PlannerConfig, width: int, n_out: int, tokens: float | None = None,
               expected_pad: bool = False) -> float:
    """Bytes per token of an FP8 linear's saved input of ``width`` features (``fp8.linear``'s core). An all-gathered
    input (``tokens`` None: the column-parallel linears under sequence parallelism) is saved as its row-wise operand:
    E4M3 plus the recipe's scales (one per token rowwise, one per 1 x 128 tile blockwise, one per tensor tensorwise).
    Otherwise the weight-gradient GEMM's column-wise operand is made from the same read and saved instead: E4M3 with
    the ``tokens`` padded to the GEMM's multiple (16; 128 blockwise) and the column scales (one per feature rowwise,
    one per 128 x 1 tile blockwise). ``expected_pad``: ``tokens`` is a routed expert's mean count, its padding the
    mean over counts (half the multiple less one). Under ``fp8_high_precision_mode="linear"`` (the whole linear in
    high precision, :attr:`fp8.Float8LinearConfig.high_precision`) the input itself, ``hp`` bytes per feature."""
    if cfg.fp8_high_precision_mode == "linear":
        return cfg.hp_bytes * width
    recipe = _recipe(cfg, n_out, width)
    tile, scale_block = _BLOCKS.get(recipe), _SCALE_BLOCK.get(recipe)
    elem = 0.5 if recipe == "nvfp4" else 1  # E2M1: two values per byte (nvfp4 also saves a 0-d fp32 global scale)
    if tokens is None:
        if recipe == "rowwise":
            return width + 4
        if recipe in ("nvfp4", "mxfp8"):  # also the GEMM's swizzled scales: a byte per K block, padded to 4
            return elem * width + 4 * math.ceil(width / scale_block) + 4 * math.ceil(width / scale_block / 4)
        if tile:
            return elem * width + 4 * math.ceil(width / scale_block)
        return width
    multiple = max(tile or 0, _GEMM_MULTIPLE)
    pad = (multiple - 1) / 2 if expected_pad else math.ceil(tokens / multiple) * multiple - tokens
    payload = elem * width * (tokens + pad) / tokens
    if recipe == "rowwise":
        return payload + 4 * width / tokens
    if recipe in ("nvfp4", "mxfp8"):  # also the GEMM's swizzled scales (E4M3 / E8M0): rows to 128, K blocks to 4
        k_blocks = math.ceil((tokens + pad) / scale_block)
        return (payload + 4 * width * k_blocks / tokens
                + math.ceil(width / 128) * 128 * math.ceil(k_blocks / 4) * 4 / tokens)
    if tile:
        return payload + 4 * width * math.ceil((tokens + pad) / scale_block) / tokens
    return payload


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
        whole = None if sp > 1 else tokens  # gathered under SP; else each rank's linears read all the tokens
        gathered = _fp8_input(cfg, h, cfg.qkv_size // tp, whole) + _fp8_input(cfg, h, fc1_out // tp, whole)
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
        proj_in = _fp8_input(cfg, h // tp, h, tokens)
    elif hf:  # a view of the attention output of another shape: compressed apart from it
        proj_in = _stored(cfg, h, hp, tokens) if cfg.fp8_activations else 0
    else:
        proj_in = hp * h // tp if cfg.fp8_activations else 0
    if cfg.num_experts is not None:  # the MLP is megatron-core's MoE layer
        qkv_in = _fp8_input(cfg, h, cfg.qkv_size // tp, None if sp > 1 else tokens) if cfg.fp8 else hp * h
        return seq_shard / sp + qkv_in + qkv + attn_out + 4 * a / tp + proj_in + _moe_bytes_per_token(cfg)
    act = _stored(cfg, act_in // tp, hp, tokens)
    if hf:  # act(gate) * up keeps act(gate) as well as gate and up
        act = 3 * _stored(cfg, f, hp, tokens)
    fc2_in = _fp8_input(cfg, f // tp, h, tokens) if cfg.fp8 else (_stored(cfg, f, hp, tokens) if hf else hp * f // tp)
    sharded = qkv + attn_out + 4 * a / tp + proj_in + act + fc2_in
    return seq_shard / sp + gathered + sharded


def _mlp_saved(cfg: PlannerConfig, ffn: int, tokens: float) -> float:
    """Bytes per row that megatron-core's (unfused) MLP activation saves for an FFN of ``ffn`` features on this TP
    rank: GELU its input; SwiGLU (``glu``) the fc1 output (2 ffn, silu's input), silu's output and the up half plus
    ``glu_linear_offset`` (a new tensor)."""
    hp = cfg.hp_bytes
    if cfg.swiglu:
        return _stored(cfg, 2 * ffn, hp, tokens) + 2 * _stored(cfg, ffn, hp, tokens)
    return _stored(cfg, ffn, hp, tokens)


def routed_rows_per_token(cfg: PlannerConfig) -> float:
    """Rows one GPU's routed experts process per token of a micro-batch (uniform routing): each of the T / SP
    tokens this rank routes goes to ``moe_router_topk`` experts, the rows are exchanged evenly over the
    expert-parallel ranks and gathered over the (expert-)tensor-parallel group (megatron-core's dispatcher): topk x
    TP / SP (topk with sequence parallelism)."""
    sp = cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1
    return cfg.moe_router_topk * cfg.tensor_model_parallel_size / sp


def _moe_bytes_per_token(cfg: PlannerConfig) -> float:
    """Bytes one MoE layer (router, token dispatch, this rank's routed experts, shared expert; megatron-core 0.16 with
    fp8lm's linears, no fusions) keeps for backward per token of one micro-batch, in place of a dense MLP's."""
    h, hp, tp = cfg.hidden_size, cfg.hp_bytes, cfg.tensor_model_parallel_size
    sp = tp if cfg.sequence_parallel else 1
    e, k = cfg.num_experts, cfg.moe_router_topk
    tokens = cfg.seq_length * cfg.micro_batch_size
    # Router and routing, on the T / SP tokens this rank holds: the gating GEMM's fp32 input (FP32Router), top-k
    # indices (int64) and their softmax (fp32), the permutation's row indices (int64, k per token), the routing map
    # (bool, E per token) and the probabilities' masked_select source (fp32, E per token); with a load-balancing loss
    # also the softmax scores over all experts (fp32). The router weight's fp32 copy: once.
    routing = _stored(cfg, h, 4, tokens / sp) + 8 * k + 4 * k + 8 * k + e + 4 * e
    if cfg.moe_aux_loss_coeff > 0 and cfg.moe_router_load_balancing_type != "none":
        routing += 4 * e
    routing = routing / sp + (4 * e * h / tokens if hp != 4 else 0)
    # Each routed row at an expert: fc1's input (the dispatched rows, or their E4M3 copy), the activation's saves,
    # the activation output and the row's fp32 probability (the probability multiply), fc2's input.
    f = cfg.moe_ffn_hidden_size // tp
    fc1_out = 2 * f if cfg.swiglu else f
    rows = tokens * routed_rows_per_token(cfg)
    # each expert's tokens padded to the GEMM's multiple in its weight-gradient operand (the mean padding: routing
    # decides the counts); tensorwise grouped experts save their rows (one cast of all tokens)
    per_expert = rows / (e // cfg.expert_model_parallel_size)
    routed = None if cfg.moe_grouped_gemm and cfg.fp8_recipe == "tensorwise" else per_expert
    fc1_in = _fp8_input(cfg, h, fc1_out, routed, expected_pad=True) if cfg.fp8 else hp * h
    fc2_in = _fp8_input(cfg, f, h, routed, expected_pad=True) if cfg.fp8 else hp * f
    per_row = fc1_in + _mlp_saved(cfg, f, rows) + _stored(cfg, f, hp, rows) + 4 + fc2_in
    experts = routed_rows_per_token(cfg) * per_row
    shared = 0.0  # the shared expert: a dense MLP (sequence-parallel linears) on every token
    if cfg.moe_shared_expert_intermediate_size is not None:
        fs = cfg.moe_shared_expert_intermediate_size // tp
        fs1 = 2 * fs if cfg.swiglu else fs
        if cfg.fp8:
            fc1_in = _fp8_input(cfg, h, fs1, None if sp > 1 else tokens)
        else:  # the norm's output (no gather at TP 1), in an FP32 model the router's saved input itself
            fc1_in = 0 if hp == 4 and tp == 1 else hp * h
        shared = fc1_in + _mlp_saved(cfg, fs, tokens) + (_fp8_input(cfg, fs, h, tokens) if cfg.fp8 else hp * fs)
    return routing + experts + shared


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
        out_in = _fp8_input(cfg, h, cfg.padded_vocab_size, tokens) if cfg.fp8_output else _stored(cfg, h, hp, local)
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
    if _has_all_to_all(cfg):  # the expert-parallel all-to-all's send and receive buffers of one layer's rows
        sp = tp if cfg.sequence_parallel else 1
        rows = cfg.seq_length * cfg.micro_batch_size * cfg.moe_router_topk // sp
        total += 2 * rows * _row_bytes(cfg, cfg.moe_fp8_dispatch)
    return total


# -- mixture of experts: token all-to-all ---------------------------------------------------------------
def _has_all_to_all(cfg: PlannerConfig) -> bool:
    """Whether routed tokens cross ranks through megatron-core's expert-parallel all-to-all."""
    return (cfg.num_experts is not None and cfg.expert_model_parallel_size > 1
            and cfg.moe_token_dispatcher_type == "alltoall")


def _row_bytes(cfg: PlannerConfig, fp8: bool) -> int:
    """Bytes of one routed token on the wire: ``hidden`` FP8 bytes plus its fp32 scale, else ``hidden`` values in
    the activations' dtype."""
    return cfg.hidden_size + 4 if fp8 else cfg.hidden_size * cfg.hp_bytes


def all_to_all_bytes(cfg: PlannerConfig, fp8: bool | None = None) -> dict[str, float]:
    """Bytes one GPU sends to other expert-parallel ranks per MoE layer and micro-batch (uniform routing: the
    fraction (EP - 1) / EP of its T / SP x topk routed rows leaves the rank), by direction: ``dispatch`` (the rows,
    plus one fp32 routing probability each), ``combine`` (the expert outputs back), ``dispatch_grad`` and
    ``combine_grad`` (their backwards: the rows' gradients, and the probabilities' for the dispatch), ``total``.
    ``fp8``: rows as FP8 with a scale each (dispatch in E4M3, the rest in the recipe's gradient format), else in the
    activations' dtype; default ``moe_fp8_dispatch``. Zero without an expert-parallel all-to-all."""
    fp8 = cfg.moe_fp8_dispatch if fp8 is None else fp8
    if not _has_all_to_all(cfg):
        return dict.fromkeys(("dispatch", "combine", "dispatch_grad", "combine_grad", "total"), 0.0)
    ep = cfg.expert_model_parallel_size
    sp = cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1
    leaving = cfg.seq_length * cfg.micro_batch_size / sp * cfg.moe_router_topk * (ep - 1) / ep
    row, prob = _row_bytes(cfg, fp8), 4
    out = {"dispatch": leaving * (row + prob), "combine": leaving * row, "dispatch_grad": leaving * (row + prob),
           "combine_grad": leaving * row}
    out["total"] = sum(out.values())
    return out


def _moe_summary(cfg: PlannerConfig, tensors: list[_Tensor]) -> dict:
    """``plan_memory(...)["moe"]`` for the stage holding ``tensors`` (the largest)."""
    layers = cfg.num_layers // cfg.pipeline_model_parallel_size
    nmb = cfg.num_microbatches
    expert_params = sum(t.numel for t in tensors if t.expert)
    per_layer = {"fp8" if fp8 else "high_precision": all_to_all_bytes(cfg, fp8)["total"] for fp8 in (True, False)}
    mine = all_to_all_bytes(cfg)
    return {
        "num_experts": cfg.num_experts, "experts_per_gpu": cfg.num_experts // cfg.expert_model_parallel_size,
        "expert_model_parallel_size": cfg.expert_model_parallel_size,
        "expert_data_parallel_size": cfg.expert_data_parallel_size, "moe_router_topk": cfg.moe_router_topk,
        "token_dispatcher": cfg.moe_token_dispatcher_type, "fp8_dispatch": cfg.moe_fp8_dispatch,
        "expert_params_per_gpu": expert_params,
        "dense_params_per_gpu": sum(t.numel for t in tensors) - expert_params,
        "routed_rows_per_microbatch": cfg.seq_length * cfg.micro_batch_size * routed_rows_per_token(cfg),
        "all_to_all_bytes_per_layer_microbatch": mine,
        "all_to_all_bytes_per_step": None if nmb is None else {k: v * layers * nmb for k, v in mine.items()},
        "all_to_all_total_bytes_per_step": None if nmb is None else {k: v * layers * nmb for k, v in per_layer.items()},
    }


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
    - ``layout``: ``{"tp", "pp", "dp", "vpp", "world_size", "sequence_parallel", "num_microbatches", "ep"}``;
      ``config``: the config as a dict;
    - ``moe`` (None for dense MLPs): ``num_experts``, ``experts_per_gpu``, ``expert_model_parallel_size``,
      ``expert_data_parallel_size``, ``moe_router_topk``, ``token_dispatcher``, ``fp8_dispatch``;
      ``expert_params_per_gpu`` and ``dense_params_per_gpu`` (the routed experts' and the other parameters of the
      largest stage's GPU); ``routed_rows_per_microbatch`` (rows at a GPU's experts per MoE layer);
      ``all_to_all_bytes_per_layer_microbatch`` and ``all_to_all_bytes_per_step`` (bytes one GPU sends, by
      direction, :func:`all_to_all_bytes`; per step: x the stage's layers x micro-batches, None without
      ``global_batch_size``); ``all_to_all_total_bytes_per_step`` (``{"fp8", "high_precision"}``: the step's total
      with and without FP8 dispatch).
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
    moe = None if cfg.num_experts is None else _moe_summary(cfg, _stage_tensors(cfg, biggest["stage"]))
    state_bytes = sum(worst["bytes"][c] for c in STATE_CATEGORIES)
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
                   "num_microbatches": cfg.num_microbatches, "ep": cfg.expert_model_parallel_size},
        "moe": moe,
        "config": dataclasses.asdict(cfg),
    }


def format_plan(plan: dict) -> str:
    """A human-readable summary of :func:`plan_memory`'s result (what ``--dry-run`` prints)."""
    lay, cfg = plan["layout"], plan["config"]
    lines = [
        f"layout: TP={lay['tp']} PP={lay['pp']} DP={lay['dp']}"
        + (f" EP={lay['ep']}" if plan["moe"] is not None else "") + f" (world size {lay['world_size']})"
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
    return "\n".join(lines + format_moe(plan))


def format_moe(plan: dict) -> list[str]:
    """Lines on :func:`plan_memory`'s mixture-of-experts figures (none for dense MLPs)."""
    moe, cfg = plan["moe"], plan["config"]
    if moe is None:
        return []
    lines = [
        f"mixture of experts: {moe['num_experts']} experts, top-{moe['moe_router_topk']}, expert parallel "
        f"{moe['expert_model_parallel_size']} ({moe['experts_per_gpu']} expert(s) per GPU, expert-data-parallel "
        f"{moe['expert_data_parallel_size']}), {moe['token_dispatcher']} dispatcher"
        + (", FP8 dispatch" if moe["fp8_dispatch"] else ""),
        f"  parameters per GPU (largest stage): {moe['expert_params_per_gpu']:,} in routed experts, "
        f"{moe['dense_params_per_gpu']:,} other; {moe['routed_rows_per_microbatch']:,.0f} routed rows per MoE "
        f"layer and micro-batch",
    ]
    per_mb = moe["all_to_all_bytes_per_layer_microbatch"]
    if not per_mb["total"]:
        lines.append("  expert-parallel all-to-all: none (expert parallel 1 or the allgather dispatcher)")
        return lines
    wire = "FP8 rows + fp32 scale" if moe["fp8_dispatch"] else ("bf16" if cfg["bf16"] else "fp32") + " rows"
    lines.append(f"  all-to-all sent per GPU ({wire}): {per_mb['total'] / _MiB:.2f} MiB per MoE layer and "
                 f"micro-batch (dispatch {per_mb['dispatch'] / _MiB:.2f}, combine {per_mb['combine'] / _MiB:.2f}, "
                 f"backward {(per_mb['dispatch_grad'] + per_mb['combine_grad']) / _MiB:.2f})")
    step = moe["all_to_all_total_bytes_per_step"]
    if step is not None:
        hp = "bf16" if cfg["bf16"] else "fp32"
        lines.append(f"  all-to-all sent per GPU per step ({plan['layout']['num_microbatches']} micro-batches x "
                     f"{cfg['num_layers'] // plan['layout']['pp']} MoE layers): {step['fp8'] / GiB:.2f} GiB with "
                     f"FP8 dispatch, {step['high_precision'] / GiB:.2f} GiB in {hp}")
    return lines
