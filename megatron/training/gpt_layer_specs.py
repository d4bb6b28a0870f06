"""``get_gpt_layer_fp8_spec``: megatron-core GPT layers with fp8lm's FP8 tensor/sequence-parallel linears.

The spec plugs into megatron-core's ``GPTModel`` through its public ``ModuleSpec`` mechanism:

- ``linear_qkv``/``linear_fc1``: :class:`fp8.parallel.ColumnParallelLinear`, ``linear_proj``/``linear_fc2``:
  :class:`fp8.parallel.RowParallelLinear`, in FP8 (``fp8=Float8LinearConfig(...)``) or in high precision
  (``fp8=None``: the baseline, same collectives, counted the same way);
- core attention: :class:`SDPAttention` (``F.scaled_dot_product_attention``, causal);
- norms: :class:`Norm` (LayerNorm or RMSNorm) whose parameters carry ``sequence_parallel`` so their
  gradients are summed over the tensor-parallel group (megatron-core's torch fallback refuses sequence
  parallelism);
- layers: :class:`SeededTransformerLayer`, which (given ``init_seed``) seeds the default generator from
  the global layer number before building its weights, so any pipeline split initialises every layer
  exactly as the single-process model does (weights are initialised full-size on the CPU and sharded,
  see :func:`fp8.parallel.initialize_sharded_weight`, so any tensor-parallel size does too).

Use :func:`get_gpt_block_fp8_spec` (layers plus the final norm) as ``GPTModel``'s
``transformer_layer_spec``: given a bare layer spec, ``GPTModel`` picks its own final norm, which refuses
sequence parallelism.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fp8.comm import CommBytesCounter
from fp8.eligibility import fp8_linear_problem
from fp8.linear import Float8LinearConfig
from fp8.parallel import ColumnParallelLinear, RowParallelLinear
from fp8.parallel.linear import compute_dtype
from fp8.smooth_swiglu import smooth_config
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset

from .moe import SeededSequentialMLP, install_counted_dispatcher
from .moe_grouped import FP8GroupedMLP

__all__ = ["get_gpt_layer_fp8_spec", "global_module_names", "get_gpt_block_fp8_spec", "SDPAttention", "Norm", "SeededTransformerLayer",
           "FP32Router", "LINEAR_PLACES",
           "layer_init_seed", "SelectiveColumnParallelLinear", "SelectiveRowParallelLinear", "fp8_layer_selection"]


class Norm(nn.Module):
    """LayerNorm or RMSNorm (``config.normalization``) whose parameters carry megatron-core's
    ``sequence_parallel`` attribute (``config.sequence_parallel``). megatron-core's norm signature."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused) -> None:
        super().__init__()
        self.kind = getattr(config, "normalization", "LayerNorm")
        if self.kind not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {self.kind!r}")
        self.eps = eps
        self.hidden_size = hidden_size
        dtype = getattr(config, "params_dtype", torch.float32)
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype)) if self.kind == "LayerNorm" else None
        for p in self.parameters():
            p.sequence_parallel = bool(getattr(config, "sequence_parallel", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "LayerNorm":
            out = F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)
        else:
            out = F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
        # Normalised in fp32 under autocast (its rule), handed on in the autocast dtype: the next GEMM's input, and
        # the dtype megatron-core's output layer allocates its sequence-parallel buffers in.
        return out.to(compute_dtype(out))


class SDPAttention(nn.Module):
    """Core attention through ``F.scaled_dot_product_attention`` (megatron-core's core-attention contract:
    ``query`` ``[sq, b, np, hn]``, ``key``/``value`` ``[sk, b, ng, hn]``, returns ``[sq, b, np * hn]``).

    Causal masking by default; a boolean ``attention_mask`` (True = masked out, megatron's convention)
    is honoured. Grouped-query attention repeats key/value heads. Dropout runs under the tensor-parallel
    RNG tracker so each tensor-parallel rank drops different heads' entries.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None, **unused) -> None:
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SDPAttention supports neither packed sequences nor attention bias")
        sq, b, heads, head_dim = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != heads:
            repeat = heads // k.shape[1]
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = mask_type == AttnMaskType.causal and attention_mask is None
        mask = None if attention_mask is None else ~attention_mask
        dropout = self.dropout if self.training else 0.0
        if dropout > 0:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal,
                                                     scale=self.softmax_scale)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)


class FP32Router(TopKRouter):
    """megatron-core's top-k router with its gating GEMM in FP32 by ``torch`` on the device the weight is on
    (megatron-core 0.16.1's own gating calls Transformer Engine's GEMM by a name it only imports with Transformer
    Engine installed, and moves a CPU weight to ``torch.cuda.current_device()``). Routing, load balancing and the
    auxiliary loss are megatron-core's."""

    def gating(self, input: torch.Tensor) -> torch.Tensor:
        dtype = torch.float64 if self.config.moe_router_dtype == "fp64" else torch.float32
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(input.to(dtype), self.weight.to(dtype), bias)


def layer_init_seed(init_seed: int, layer_number: int) -> int:
    """The generator seed for building global layer ``layer_number`` (0: the embeddings), the same in
    every process (no salted hashing)."""
    return (int(init_seed) * 1_000_003 + int(layer_number) * 7_919 + 17) % (2**63)


class SeededTransformerLayer(TransformerLayer):
    """megatron-core's ``TransformerLayer``; with ``init_seed`` it seeds the default generator from
    ``(init_seed, global layer number)`` before building, so its initial weights do not depend on the
    pipeline split. ``moe_dispatch`` (a mixture-of-experts layer: ``counter``, ``fmt``, ``grad_fmt``): its
    all-to-all token dispatcher becomes :class:`megatron.training.moe.CountedAlltoAllTokenDispatcher`."""

    def __init__(self, config, submodules, layer_number: int = 1, *args, init_seed: int | None = None,
                 moe_dispatch: dict | None = None, **kwargs):
        if init_seed is not None:
            pg_collection = kwargs.get("pg_collection")
            pp_rank = pg_collection.pp.rank() if pg_collection is not None and pg_collection.pp is not None else None
            if pp_rank is None:
                from megatron.core import parallel_state

                pp_rank = parallel_state.get_pipeline_model_parallel_rank()
            offset = get_transformer_layer_offset(config, kwargs.get("vp_stage"), pp_rank)
            torch.manual_seed(layer_init_seed(init_seed, layer_number + offset))
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        if moe_dispatch is not None and self.is_moe_layer:
            install_counted_dispatcher(self.mlp, self.pg_collection, **moe_dispatch)


def _select_fp8(partition_dim: int, input_size: int, output_size: int, fp8: Float8LinearConfig | None,
                min_fp8_dim: int, config, tp_group, kept_reason: str | None = None
                ) -> tuple[Float8LinearConfig | None, str | None]:
    """FP8 or high precision for one parallel linear: high precision when ``kept_reason`` is given (the layer is
    kept out of FP8, e.g. by ``--first-last-layers-bf16``) or when the GEMM this rank runs (the local weight shard)
    has ``min(in, out) < min_fp8_dim`` (too small to gain from FP8, see :data:`fp8.convert.CUDA_MIN_FP8_DIM`).
    Returns ``(fp8 config or None, reason kept or None)``."""
    if kept_reason is not None:
        return None, kept_reason
    if fp8 is None:
        return None, "baseline (--fp8-opt-level none)"
    tp = tp_group.size() if tp_group is not None else int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    local_in, local_out = (input_size, output_size // tp) if partition_dim == 0 else (input_size // tp, output_size)
    problem = fp8_linear_problem(local_in, local_out, min_fp8_dim, " (per tensor-parallel rank)",
                                 "--fp8-min-dim 0 converts it")
    if problem is not None and problem.too_small:
        return None, problem.reason
    return fp8, None  # a shape FP8 GEMMs cannot take: the parallel linear refuses it, naming the sizes


class SelectiveColumnParallelLinear(ColumnParallelLinear):
    """:class:`fp8.parallel.ColumnParallelLinear` that stays in high precision below ``min_fp8_dim``
    (``fp8_kept_reason`` says why)."""

    def __init__(self, input_size: int, output_size: int, *, fp8: Float8LinearConfig | None = None,
                 min_fp8_dim: int = 0, kept_reason: str | None = None, **kwargs) -> None:
        fp8, reason = _select_fp8(0, input_size, output_size, fp8, min_fp8_dim, kwargs.get("config"),
                                  kwargs.get("tp_group"), kept_reason)
        super().__init__(input_size, output_size, fp8=fp8, **kwargs)
        self.fp8_kept_reason = reason


class SelectiveRowParallelLinear(RowParallelLinear):
    """:class:`fp8.parallel.RowParallelLinear` that stays in high precision below ``min_fp8_dim``."""

    def __init__(self, input_size: int, output_size: int, *, fp8: Float8LinearConfig | None = None,
                 min_fp8_dim: int = 0, kept_reason: str | None = None, **kwargs) -> None:
        fp8, reason = _select_fp8(1, input_size, output_size, fp8, min_fp8_dim, kwargs.get("config"),
                                  kwargs.get("tp_group"), kept_reason)
        super().__init__(input_size, output_size, fp8=fp8, **kwargs)
        self.fp8_kept_reason = reason


def fp8_layer_selection(chunks: list[nn.Module]) -> tuple[int, list[tuple[str, str]]]:
    """``(number of linears running in FP8, [(name, reason kept in high precision), ...])`` over this
    rank's model chunks: fp8lm's parallel linears, and megatron-core's own linears (the output layer). Names are the
    single-process model's (``decoder.layers.<global index>...``, as ``--fp8-precision-config``'s rules match them),
    whatever the pipeline stage or virtual chunk."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear as CoreColumn
    from megatron.core.tensor_parallel.layers import RowParallelLinear as CoreRow

    n_fp8, kept = 0, []
    for chunk in chunks:
        global_name = global_module_names(chunk)
        for name, module in chunk.named_modules():
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                if module.fp8 is not None:
                    n_fp8 += 1
                else:
                    kept.append((global_name(name), getattr(module, "fp8_kept_reason", None) or "built without FP8"))
            elif isinstance(module, (CoreColumn, CoreRow)):
                kept.append((name, "vocabulary projection (output layer: high precision, as in Transformer Engine)"))
    return n_fp8, kept


def global_module_names(chunk: nn.Module) -> Callable[[str], str]:
    """A module name of ``chunk`` (one pipeline stage's or virtual chunk's model) -> its name in the single-process
    model: ``decoder.layers.<local index>`` becomes ``decoder.layers.<global index>`` (megatron-core's 1-based
    ``layer_number`` less one); other names are the same."""
    layers = {}
    for name, module in chunk.named_modules():
        local = _LOCAL_LAYER.fullmatch(name)
        if local is not None and isinstance(getattr(module, "layer_number", None), int):
            layers[name] = f"{local.group(1)}{module.layer_number - 1}"

    def global_name(name: str) -> str:
        local = _LOCAL_LAYER.match(name)
        return name if local is None else layers.get(local.group(0), local.group(0)) + name[local.end():]

    return global_name


_LOCAL_LAYER = re.compile(r"(decoder\.layers\.)(\d+)")


def get_gpt_layer_fp8_spec(
    fp8: Float8LinearConfig | None = None,
    *,
    high_precision: bool = False,
    counter: CommBytesCounter | None = None,
    init_seed: int | None = None,
    qk_layernorm: bool = False,
    min_fp8_dim: int = 0,
    num_experts: int | None = None,
    kept_reason: str | None = None,
    per_linear: dict[str, dict] | None = None,
    moe_fp8_dispatch: bool = False,
    moe_grouped_gemm: bool = False,
    swiglu_smooth: bool = False,
) -> ModuleSpec:
    """A GPT ``TransformerLayer`` spec whose four linears are fp8lm's parallel linears.

    ``fp8``: the FP8 recipe (default ``Float8LinearConfig()``: E4M3 weights/activations, E5M2 output
    gradients, delayed scaling); ``high_precision=True`` builds the same layer without FP8 (the
    baseline). ``counter`` counts every tensor-parallel byte the linears send; ``init_seed`` makes
    initialisation independent of the pipeline split (see :class:`SeededTransformerLayer`);
    ``min_fp8_dim``: linears whose per-rank GEMM has ``min(in, out)`` below it stay in high precision
    (:class:`SelectiveColumnParallelLinear`; 0 converts every linear). ``num_experts``: the MLP is megatron-core's
    mixture-of-experts layer (router in FP32, token dispatcher, ``SequentialMLP`` experts and the optional shared
    expert), each expert's two linears fp8lm's parallel linears (``is_expert=True``: the dispatcher does their
    communication). ``kept_reason``: every linear of the layer stays in high precision, and records why (the
    start-up summary's reason, e.g. ``--first-last-layers-bf16``). ``per_linear``: constructor arguments of single
    linears by their place in the layer (:data:`LINEAR_PLACES`: ``"self_attention.linear_qkv"``, ...,
    ``"mlp.experts.linear_fc1"`` for every expert), e.g. ``{"fp8": None, "kept_reason": ...}`` or another ``fp8``
    configuration (``--fp8-precision-config``). ``moe_fp8_dispatch``: an FP8 layer's expert-parallel all-to-all sends
    tokens in E4M3 with a scale per token, the combine and the backwards in the recipe's gradient format
    (:class:`megatron.training.moe.CountedAlltoAllTokenDispatcher`; otherwise in the activations' dtype, counted the
    same way). ``moe_grouped_gemm``: a rank's experts are :class:`megatron.training.moe_grouped.FP8GroupedMLP` (the
    same experts, each projection of all of them one grouped GEMM) instead of ``SequentialMLP``. ``swiglu_smooth``
    (``--swiglu-smooth``): the MLP's ``linear_fc2``, where it runs in FP8, smooths its input (the gated product under
    ``--swiglu``) per channel before its cast, the inverse scales folded into its weight operand: the same function,
    no saturation on outlier channels (:mod:`fp8.smooth_swiglu`; tensorwise recipe; dense MLPs).
    """
    if high_precision and fp8 is not None:
        raise ValueError("pass either fp8=... or high_precision=True, not both")
    if swiglu_smooth and num_experts is not None:
        raise ValueError("swiglu_smooth (--swiglu-smooth) smooths dense MLPs' linear_fc2; mixture-of-experts layers "
                         "(--num-experts) have no smoothed experts yet: drop --swiglu-smooth or --num-experts")
    recipe = None if high_precision else (fp8 or Float8LinearConfig())
    linear_params = {"fp8": recipe, "counter": counter, "min_fp8_dim": min_fp8_dim, "kept_reason": kept_reason}
    spec = get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, num_experts=num_experts, moe_grouped_gemm=False)
    spec.module = SeededTransformerLayer
    spec.params = {**spec.params, "init_seed": init_seed}
    layer = spec.submodules
    layer.input_layernorm = Norm
    layer.pre_mlp_layernorm = Norm
    per_linear = per_linear or {}
    unknown = set(per_linear) - set(LINEAR_PLACES)
    if unknown:
        raise ValueError(f"per_linear: unknown place(s) {sorted(unknown)}; places are {LINEAR_PLACES}")

    def linear(cls, place: str) -> ModuleSpec:
        params = {**linear_params, **per_linear.get(place, {})}
        if swiglu_smooth and place == "mlp.linear_fc2" and params["fp8"] is not None:
            params["fp8"] = smooth_config(params["fp8"])  # a ValueError naming the fix for another recipe
        return ModuleSpec(module=cls, params=params)

    attention = layer.self_attention.submodules
    attention.linear_qkv = linear(SelectiveColumnParallelLinear, "self_attention.linear_qkv")
    attention.linear_proj = linear(SelectiveRowParallelLinear, "self_attention.linear_proj")
    attention.core_attention = SDPAttention
    if qk_layernorm:
        attention.q_layernorm = Norm
        attention.k_layernorm = Norm
    if num_experts is None:
        mlps = {"mlp": layer.mlp.submodules}
    else:  # the router in FP32; the experts' MLP and the shared expert's
        dispatch = recipe is not None and moe_fp8_dispatch
        grad_fmt = None
        if dispatch:  # the recipe's gradient format (tensorwise: the configured output-gradient format)
            grad_fmt = recipe.recipe_spec.grad_format(recipe.grad_output.fmt)
        spec.params = {**spec.params, "moe_dispatch": {"counter": counter, "fmt": "e4m3" if dispatch else None,
                                                       "grad_fmt": grad_fmt}}
        if moe_grouped_gemm:  # the same experts, each projection of all of them one grouped GEMM
            layer.mlp.submodules.experts.module = FP8GroupedMLP
        elif layer.mlp.submodules.experts.module is SequentialMLP:
            layer.mlp.submodules.experts.module = SeededSequentialMLP
        layer.mlp.submodules.router = FP32Router
        mlps = {"mlp.experts": layer.mlp.submodules.experts.submodules,
                "mlp.shared_experts": layer.mlp.submodules.shared_experts.submodules}
    for place, mlp in mlps.items():
        mlp.linear_fc1 = linear(SelectiveColumnParallelLinear, f"{place}.linear_fc1")
        mlp.linear_fc2 = linear(SelectiveRowParallelLinear, f"{place}.linear_fc2")
    return spec


LINEAR_PLACES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2",
                 "mlp.experts.linear_fc1", "mlp.experts.linear_fc2", "mlp.shared_experts.linear_fc1",
                 "mlp.shared_experts.linear_fc2")
"""The places of a layer's linears in :func:`get_gpt_layer_fp8_spec` (``per_linear``'s keys)."""


def get_gpt_block_fp8_spec(config, layer_spec: ModuleSpec, vp_stage: int | None = None,
                           pp_rank: int | None = None, spec_for_layer=None) -> TransformerBlockSubmodules:
    """The block spec for ``GPTModel``: this pipeline stage's layers and a final :class:`Norm` that supports sequence
    parallelism. Each layer is ``layer_spec``, or ``spec_for_layer(global layer number)`` (1-based, whatever the
    pipeline split) when given."""
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if spec_for_layer is None:
        return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=Norm)
    offset = get_transformer_layer_offset(config, vp_stage, pp_rank)
    return TransformerBlockSubmodules(layer_specs=[spec_for_layer(offset + i + 1) for i in range(num_layers)],
                                      layer_norm=Norm)
