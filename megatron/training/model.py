"""Build megatron-core's ``GPTModel`` for this rank's pipeline stage(s) with fp8lm's layer spec."""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fp8.activations import compress_activations
from fp8.comm import CommBytesCounter
from fp8.linear import Float8LinearConfig
from fp8.precision_rules import PrecisionPlan, PrecisionRule
from fp8.scaling import ScalingConfig
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from fp8.parallel.init import reinitialize_named_

from .config import RunConfig
from .config_rules import ConfigurationError, high_precision_layers
from .gpt_layer_specs import get_gpt_block_fp8_spec, get_gpt_layer_fp8_spec, layer_init_seed

__all__ = ["transformer_config_from_args", "fp8_recipe_from_args", "build_model", "padded_vocab_size",
           "resolved_min_fp8_dim", "kept_layers", "announce_layer_selection", "FP8LinearShape", "fp8_linear_shapes", "gemm_target",
           "gemm_backend_problems", "check_gemm_backend", "compile_layers", "check_compile_layers"]


def resolved_min_fp8_dim(cfg: RunConfig) -> int:
    """``--fp8-min-dim``, or its default: :data:`fp8.convert.CUDA_MIN_FP8_DIM` on CUDA (the measured
    crossover below which an FP8 GEMM is slower than BF16), 0 on CPU (no FP8 units: every eligible linear
    is converted, as in ``fp8.initialize``)."""
    from fp8.convert import CUDA_MIN_FP8_DIM

    value = cfg.precision.fp8_min_dim
    if value is None:
        return CUDA_MIN_FP8_DIM if torch.cuda.is_available() else 0
    return value


def padded_vocab_size(vocab_size: int, cfg: RunConfig) -> int:
    """``vocab_size`` padded to a multiple of ``--make-vocab-size-divisible-by`` x TP (Megatron's rule)."""
    multiple = cfg.model.make_vocab_size_divisible_by * cfg.parallel.tensor_model_parallel_size
    return -(-vocab_size // multiple) * multiple


def fp8_recipe_from_args(cfg: RunConfig) -> Float8LinearConfig | None:
    """The FP8 recipe of the linears (None for ``--fp8-opt-level none``)."""
    if cfg.precision.fp8_opt_level == "none":
        return None
    history, margin = cfg.precision.fp8_amax_history_len, cfg.precision.fp8_margin
    return Float8LinearConfig(
        input=ScalingConfig("e4m3", "delayed", history, margin),
        grad_output=ScalingConfig("e5m2", "delayed", history, margin),
        grad_accumulation=cfg.precision.fp8_grad_accumulation,
        recipe=cfg.precision.fp8_recipe,
        gemm_backend=cfg.precision.fp8_gemm_backend,
        fp4_hadamard=cfg.precision.fp4_hadamard,
        fp4_stochastic_rounding=cfg.precision.fp4_stochastic_rounding,
    )


_UNFUSED = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "persist_layer_norm",
            "apply_rope_fusion", "gradient_accumulation_fusion", "cross_entropy_loss_fusion", "batch_p2p_comm",
            "batch_p2p_sync")


def transformer_config_from_args(cfg: RunConfig, pipeline_dtype: torch.dtype) -> TransformerConfig:
    """megatron-core's ``TransformerConfig`` for ``cfg`` (CPU-friendly: no fusions, CPU initialisation)."""
    vp = cfg.parallel.virtual_pipeline_model_parallel_size
    recompute = {}
    if cfg.parallel.recompute_activations:
        recompute = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return TransformerConfig(
        num_layers=cfg.model.num_layers,
        hidden_size=cfg.model.hidden_size,
        ffn_hidden_size=cfg.model.ffn_hidden_size,
        num_attention_heads=cfg.model.num_attention_heads,
        num_query_groups=cfg.model.num_query_groups,
        tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vp,
        sequence_parallel=cfg.parallel.sequence_parallel,
        params_dtype=cfg.precision.params_dtype,
        pipeline_dtype=pipeline_dtype,
        use_cpu_initialization=True,
        perform_initialization=True,
        init_method_std=cfg.model.init_method_std,
        hidden_dropout=cfg.model.hidden_dropout,
        attention_dropout=cfg.model.attention_dropout,
        normalization=cfg.model.normalization,
        gated_linear_unit=cfg.model.swiglu,
        activation_func=F.silu if cfg.model.swiglu else F.gelu,
        add_bias_linear=not cfg.model.disable_bias_linear,
        # megatron-core's fused kernels (Apex/TE/CUDA) off, and its own batched P2P off (pipeline_p2p batches).
        **dict.fromkeys(_UNFUSED, False),
        # The interleaved schedule overlaps its pipeline sends/receives with compute (Megatron-LM's default
        # there); megatron.training.compat.pipeline_p2p hands it asynchronous requests.
        overlap_p2p_comm=vp is not None,
        **recompute,
        **moe_config_from_args(cfg),
    )


def moe_config_from_args(cfg: RunConfig) -> dict:
    """megatron-core's mixture-of-experts fields of ``TransformerConfig`` for ``cfg`` (none for dense MLPs). The
    router runs in FP32; a rank's experts are fp8lm's linears (``--moe-grouped-gemm``: one grouped FP8 GEMM, built
    by the layer spec, so megatron-core's own grouped GEMM stays off)."""
    if cfg.moe.num_experts is None:
        return {}
    return {"num_moe_experts": cfg.moe.num_experts, "moe_router_topk": cfg.moe.moe_router_topk,
            "moe_ffn_hidden_size": cfg.moe.moe_ffn_hidden_size, "expert_model_parallel_size":
            cfg.parallel.expert_model_parallel_size, "moe_token_dispatcher_type": cfg.moe.moe_token_dispatcher_type,
            "moe_aux_loss_coeff": cfg.moe.moe_aux_loss_coeff, "moe_router_load_balancing_type":
            cfg.moe.moe_router_load_balancing_type, "moe_shared_expert_intermediate_size":
            cfg.moe.moe_shared_expert_intermediate_size, "moe_router_dtype": "fp32", "moe_grouped_gemm": False,
            "moe_permute_fusion": False, "moe_router_fusion": False}


def _initialize_megatron_weights(model: GPTModel, cfg: RunConfig, config: TransformerConfig) -> None:
    """Embeddings and output layer (built by megatron-core, which initialises each shard from the
    rank's RNG) re-initialised by name, shard-wise: identical for every layout (fp8.parallel.init)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    params = {}
    if model.pre_process:
        params["embedding.word_embeddings.weight"] = model.embedding.word_embeddings.weight
        if getattr(model.embedding, "position_embeddings", None) is not None:
            params["embedding.position_embeddings.weight"] = model.embedding.position_embeddings.weight
    if model.post_process and model.output_layer.weight is not None:
        tied = model.share_embeddings_and_output_weights  # the last stage's copy of the embedding
        params["embedding.word_embeddings.weight" if tied else "output_layer.weight"] = model.output_layer.weight
    reinitialize_named_(params, cfg.training.seed, config.init_method_std, tp_rank, tp_size)


def build_model(cfg: RunConfig, config: TransformerConfig, vocab_size: int,
                counter: CommBytesCounter | None = None) -> list[GPTModel]:
    """This rank's model chunks (one per virtual pipeline stage), initialised independently of the layout,
    each rank generating only its shards (:mod:`fp8.parallel.init`) on its device: the current CUDA device
    when there is one, else the default device (the meta device inside ``with torch.device("meta")``).
    ``counter`` counts the bytes the layers' own collectives send (tensor-parallel linears, the MoE token dispatcher).

    Call after ``parallel_state.initialize_model_parallel`` and after seeding (``cpu_compat.seed``).
    """
    device = torch.get_default_device()
    if device.type == "cpu" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    # megatron-core allocates only this rank's shards of its own layers (on the meta device, its CPU path
    # allocates nothing), then they are re-initialised layout-independently (_initialize_megatron_weights).
    config.use_cpu_initialization = device.type == "meta"
    with torch.device(device):
        return _build_chunks(cfg, config, vocab_size, counter)


def _build_chunks(cfg: RunConfig, config: TransformerConfig, vocab_size: int,
                  counter: CommBytesCounter | None) -> list[GPTModel]:
    fp8 = fp8_recipe_from_args(cfg)
    common = {"init_seed": cfg.training.seed, "min_fp8_dim": resolved_min_fp8_dim(cfg), "counter": counter,
              "num_experts": cfg.moe.num_experts,
              "moe_fp8_dispatch": bool(cfg.moe.moe_fp8_dispatch),
              "moe_grouped_gemm": bool(cfg.moe.moe_grouped_gemm),
              "swiglu_smooth": bool(cfg.precision.swiglu_smooth)}
    layer_spec = get_gpt_layer_fp8_spec(fp8, high_precision=fp8 is None, **common)
    spec_for_layer = _spec_for_layer(cfg, fp8, common)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    vp_size = config.virtual_pipeline_model_parallel_size or 1
    chunks = []
    for vp_stage in range(vp_size):
        block = get_gpt_block_fp8_spec(config, layer_spec, vp_stage=vp_stage if vp_size > 1 else None, pp_rank=pp_rank,
                                       spec_for_layer=spec_for_layer)
        pre_process = pp_rank == 0 and vp_stage == 0
        post_process = pp_rank == pp_size - 1 and vp_stage == vp_size - 1
        # Embedding and output layer draw from the generator at the point the single-process model would.
        if pre_process:
            torch.manual_seed(layer_init_seed(cfg.training.seed, 0))
        model = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=vocab_size,
            max_sequence_length=cfg.model.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=not cfg.model.untie_embeddings_and_output_weights,
            position_embedding_type=cfg.model.position_embedding_type,
            vp_stage=vp_stage if vp_size > 1 else None,
        )
        _initialize_megatron_weights(model, cfg, config)
        if cfg.precision.fp8_activations:
            model.fp8_activation_compressor = compress_activations(model)
        if cfg.parallel.compile_layers:
            compile_layers(model)
        chunks.append(model)
    return chunks


def compile_layers(model: GPTModel) -> int:
    """``--compile-layers``: each transformer layer of ``model`` compiled in place (``nn.Module.compile``: its forward
    runs through ``torch.compile(fullgraph=True)``, compiled at its first call; module, parameter and state-dict names
    unchanged, so checkpoints, DDP and the optimizers see the same model). ``fullgraph`` refuses a graph break: the FP8
    linears are built to trace without one (tests/training/test_no_host_sync.py), so a layer that breaks fails loudly instead of
    running partly eager. Inductor fuses the non-GEMM ops of the layer (norms, activation, casts to FP8, bias and
    residual adds) around the GEMMs. Returns the number of layers compiled."""
    layers = list(model.decoder.layers) if getattr(model, "decoder", None) is not None else []
    for layer in layers:
        layer.compile(fullgraph=True, dynamic=False)
    return len(layers)


def _layer_linears(cfg: RunConfig, number: int) -> dict[str, list[str]]:
    """Global layer ``number``'s linears: place in the layer spec -> the module names (in the single-process model)
    of the linears built there (every expert for an expert's place)."""
    prefix = f"decoder.layers.{number - 1}."
    places = {p: [prefix + p] for p in ("self_attention.linear_qkv", "self_attention.linear_proj")}
    if cfg.moe.num_experts is None:
        places.update({p: [prefix + p] for p in ("mlp.linear_fc1", "mlp.linear_fc2")})
        return places
    for fc in ("linear_fc1", "linear_fc2"):
        places[f"mlp.experts.{fc}"] = [f"{prefix}mlp.experts.local_experts.{j}.{fc}" for j in range(cfg.moe.num_experts)]
        if cfg.moe.moe_shared_expert_intermediate_size:
            places[f"mlp.shared_experts.{fc}"] = [f"{prefix}mlp.shared_experts.{fc}"]
    return places


def precision_plan(cfg: RunConfig) -> tuple[PrecisionPlan, dict[tuple[int, str], PrecisionRule]] | None:
    """``--fp8-precision-config``'s rules applied to every linear of the model (global names, so every rank sees
    the same plan and checks the patterns without communicating): the plan (matches per rule) and the rule of each
    (global layer number, place). None without the flag. Patterns matching nothing, and rules telling experts of
    one layer apart, are refused."""
    path = cfg.precision.fp8_precision_config
    if not path:
        return None
    # the rules as validate_args read them (what checkpoints record), not the file read a second time
    plan = PrecisionPlan(tuple(PrecisionRule(pattern, precision, tuple(tuple(pair) for pair in overrides))
                               for pattern, precision, overrides in cfg.precision.fp8_precision_rules))
    decided: dict[tuple[int, str], PrecisionRule] = {}
    for number in range(1, cfg.model.num_layers + 1):
        for place, names in _layer_linears(cfg, number).items():
            rules = {plan.rule_for(name) for name in names}
            if len(rules) > 1:
                raise ConfigurationError(
                    f"--fp8-precision-config {path}: the experts of layer {number - 1} ({place}) match different rules; "
                    f"a layer's experts share one precision (write the pattern for all of them, e.g. "
                    f"'decoder.layers.{number - 1}.mlp.experts.*')")
            rule = rules.pop()
            if rule is not None:
                decided[(number, place)] = rule
    try:
        plan.check()
    except ValueError as error:
        raise ConfigurationError(f"--fp8-precision-config {path}: {error}") from None
    return plan, decided


def _spec_for_layer(cfg: RunConfig, fp8, common: dict):
    """The layer spec of each global layer number when some layers differ (``--first-last-layers-bf16``,
    ``--fp8-precision-config``), else None (one spec for every layer)."""
    if fp8 is None:
        return None
    kept = kept_layers(cfg)
    planned = precision_plan(cfg)
    if not kept and planned is None:
        return None
    kept_reason = (f"first {cfg.precision.num_layers_at_start_in_bf16} / last {cfg.precision.num_layers_at_end_in_bf16} layers kept out "
                   f"of FP8 (--first-last-layers-bf16)")
    if planned is not None:
        plan, decided = planned
        if not dist.is_initialized() or dist.get_rank() == 0:
            logging.getLogger("megatron.training").warning(
                "pretrain_gpt.py --fp8-precision-config %s:\n%s", cfg.precision.fp8_precision_config, plan.summary())
        rule_index = {rule: i + 1 for i, rule in enumerate(plan.rules)}
    else:
        decided, rule_index = {}, {}

    def spec_for(number: int):
        if number in kept:
            return get_gpt_layer_fp8_spec(high_precision=True, kept_reason=kept_reason, **common)
        per_linear = {}
        for (n, place), rule in decided.items():
            if n != number:
                continue
            if rule.high_precision:
                per_linear[place] = {"fp8": None, "kept_reason": f"precision rule {rule_index[rule]} "
                                                                 f"{rule.pattern!r} (--fp8-precision-config)"}
            else:
                per_linear[place] = {"fp8": rule.config(fp8)}
        return get_gpt_layer_fp8_spec(fp8, per_linear=per_linear, **common)

    return spec_for


def announce_layer_selection(cfg: RunConfig, chunks: list, log: bool = True) -> tuple[int, list]:
    """How many of this rank's linears run in FP8 and which stay in high precision, and why; logged at
    WARNING (by the caller's choice of rank) for the FP8 levels. Returns ``(n_fp8, kept)``."""
    import logging

    from fp8.convert import fp8_selection_message

    from .gpt_layer_specs import fp8_layer_selection

    n_fp8, kept = fp8_layer_selection(chunks)
    if log and cfg.precision.fp8_opt_level != "none":
        stage = parallel_state.get_pipeline_model_parallel_rank()
        logger = logging.getLogger("megatron.training")
        message = fp8_selection_message(n_fp8, kept, resolved_min_fp8_dim(cfg))
        logger.warning("pretrain_gpt.py --fp8-opt-level %s, pipeline stage %d: %s", cfg.precision.fp8_opt_level, stage,
                       message.removeprefix("fp8: "))
    return n_fp8, kept


# -- the FP8 GEMMs of a run, decided before anything is built (--fp8-gemm-backend) ---------------------------
@dataclasses.dataclass(frozen=True)
class FP8LinearShape:
    """One FP8 linear of the run as this rank's GEMMs see it: ``name`` in the single-process model (a layer's routed
    experts as one entry, ``...mlp.experts.local_experts.*.linear_fc1``: they share shape and precision), the local
    shard's ``in_features``/``out_features`` and the ``config`` it is built with (per-layer rules and the blockwise
    recipe's fallback applied)."""

    name: str
    in_features: int
    out_features: int
    config: Float8LinearConfig


def _place_shapes(cfg: RunConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of the GEMM one rank runs for each place of a layer (:data:`LINEAR_PLACES`): column-parallel linears
    split their output over TP, row-parallel ones their input; the experts over the expert tensor-parallel group
    (TP, megatron-core's default)."""
    h, f, tp = cfg.model.hidden_size, cfg.model.ffn_hidden_size, cfg.parallel.tensor_model_parallel_size
    heads = cfg.model.num_attention_heads
    groups = cfg.model.num_query_groups or heads
    gated = 2 if cfg.model.swiglu else 1
    shapes = {"self_attention.linear_qkv": (h, (h + 2 * groups * (h // heads)) // tp),
              "self_attention.linear_proj": (h // tp, h),
              "mlp.linear_fc1": (h, gated * f // tp), "mlp.linear_fc2": (f // tp, h)}
    for place, size in (("mlp.experts", cfg.moe.moe_ffn_hidden_size or f),
                        ("mlp.shared_experts", cfg.moe.moe_shared_expert_intermediate_size)):
        if size:
            shapes[f"{place}.linear_fc1"] = (h, gated * size // tp)
            shapes[f"{place}.linear_fc2"] = (size // tp, h)
    return shapes


def fp8_linear_shapes(cfg: RunConfig) -> list[FP8LinearShape]:
    """Every linear of the model that runs in FP8 (all global layers, whatever the pipeline split), with its
    per-rank shape and configuration, from ``cfg`` alone (validated): the selection the layer spec makes when the
    model is built (``--fp8-min-dim`` on the local shard, ``--first-last-layers-bf16``, ``--fp8-precision-config``,
    blockwise falling back to tensorwise where a shard does not tile in 128s). Empty at ``--fp8-opt-level none``."""
    fp8 = fp8_recipe_from_args(cfg)
    if fp8 is None:
        return []
    kept = kept_layers(cfg)
    planned = precision_plan(cfg)
    decided = planned[1] if planned is not None else {}
    min_dim = resolved_min_fp8_dim(cfg)
    shapes = _place_shapes(cfg)
    out = []
    for number in range(1, cfg.model.num_layers + 1):
        if number in kept:
            continue
        for place, names in _layer_linears(cfg, number).items():
            rule = decided.get((number, place))
            config = fp8 if rule is None else (None if rule.high_precision else rule.config(fp8))
            n_in, n_out = shapes[place]
            if config is None or min(n_in, n_out) < min_dim:
                continue
            name = names[0] if len(names) == 1 else names[0].replace(".local_experts.0.", ".local_experts.*.")
            out.append(FP8LinearShape(name, n_in, n_out, config.for_dims(n_in, n_out, name)))
    return out


def gemm_target():
    """The device this process's run decides its FP8 GEMMs for, as an :class:`fp8.gemm.GemmTarget`: the current CUDA
    GPU where there is one, else the CPU (``--dry-run`` included: it checks the run this machine would start)."""
    from fp8.gemm import GemmTarget

    if torch.cuda.is_available():
        return GemmTarget.of(torch.device("cuda", torch.cuda.current_device()))
    return GemmTarget.of("cpu")


def _linear_gemms(linear: FP8LinearShape, tokens: int, dtype: torch.dtype):
    """The three GEMMs of ``linear`` on ``tokens`` rows as ``(name, a, a_block, b, b_block, out_dtype)`` with ``a``/``b``
    ``meta`` FP8 tensors of the shapes :class:`fp8.linear.Float8LinearFunction` passes (M x K and K x N). The weight
    gradient's K, the tokens, is padded to the GEMM's multiple (16; the block GEMM's 128) as the FP8 core pads it."""
    from fp8.blocks import transpose_block
    from fp8.formats import get_format

    from .moe_grouped import PAD_MULTIPLE

    config, recipe = linear.config, linear.config.recipe_spec
    n_in, n_out = linear.in_features, linear.out_features
    x_fmt = config.input.fmt if recipe.tensorwise else "e4m3"
    g_fmt = config.grad_output.fmt if recipe.tensorwise else recipe.grad_fmt
    padded = -(-tokens // PAD_MULTIPLE[config.recipe]) * PAD_MULTIPLE[config.recipe]

    def meta(rows: int, cols: int, fmt: str) -> torch.Tensor:
        return torch.empty((rows, cols), dtype=get_format(fmt).dtype, device="meta")

    blocks = (lambda b: None) if recipe.tensorwise else (lambda b: b)
    return [
        ("forward y = x @ W^T", meta(tokens, n_in, x_fmt), blocks(recipe.input), meta(n_in, n_out, config.weight_fmt),
         blocks(transpose_block(recipe.weight)), dtype),
        ("input gradient dX = dY @ W", meta(tokens, n_out, g_fmt), blocks(recipe.grad_output),
         meta(n_out, n_in, config.weight_fmt), blocks(recipe.dgrad_weight), dtype),
        ("weight gradient dW = dY^T @ x", meta(n_out, padded, g_fmt), blocks(transpose_block(recipe.wgrad_grad_output)),
         meta(padded, n_in, x_fmt), blocks(recipe.wgrad_input), torch.float32),
    ]


def gemm_backend_problems(cfg: RunConfig, target=None, backend: str | None = None) -> list[str]:
    """Why the FP8 GEMMs of the run cannot run on the hardware GEMM with ``backend`` (default
    ``--fp8-gemm-backend``) on ``target`` (default :func:`gemm_target`): one line per place and GEMM that
    :func:`fp8.gemm.gemm_path` decides to emulate, naming the linear(s) (layers with the same shape and reason
    together), the shape (M x K x N), the scale blocks and the reason. Empty when every GEMM runs on the hardware."""
    from fp8.gemm import gemm_path

    backend = backend or cfg.precision.fp8_gemm_backend
    target = target or gemm_target()
    tokens = cfg.training.micro_batch_size * cfg.model.seq_length
    dtype = torch.bfloat16 if cfg.precision.bf16 else torch.float32
    found: dict[tuple, list[str]] = {}
    for linear in fp8_linear_shapes(cfg):
        for gemm, a, a_block, b, b_block, out_dtype in _linear_gemms(linear, tokens, dtype):
            choice = gemm_path(a, b, out_dtype, target, backend, a_block, b_block)
            if choice.hardware:
                continue
            m, k = a.shape
            blocks = "" if a_block is None and b_block is None else f", scale blocks {a_block} x {b_block}"
            place = linear.name.split(".", 3)[-1]  # the place in the layer, for grouping over layers
            key = (place, gemm, linear.in_features, linear.out_features, linear.config.recipe,
                   f"{m} x {k} x {b.shape[1]}{blocks}", choice.reason)
            found.setdefault(key, []).append(linear.name)
    lines = []
    for (_, gemm, n_in, n_out, recipe, shape, reason), names in found.items():
        who = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more layer(s) of that shape"
        lines.append(f"{who} (in_features={n_in}, out_features={n_out} per rank, {recipe} recipe): {gemm}, "
                     f"M x K x N = {shape}: {reason}")
    return lines


def check_gemm_backend(cfg: RunConfig, target=None) -> None:
    """``--fp8-gemm-backend scaled_mm``: raise :class:`ConfigurationError` at start-up (and in ``--dry-run``) when any
    FP8 GEMM of the run cannot run on the hardware GEMM, naming each linear, GEMM, shape and reason and the fix;
    nothing for ``auto``/``emulated`` or a run without FP8 levels."""
    if cfg.precision.fp8_gemm_backend != "scaled_mm":
        return
    levels = {cfg.precision.fp8_opt_level, *cfg.precision.compare_levels}
    fp8_levels = sorted(level for level in levels if level != "none")
    if not fp8_levels:
        return
    target = target or gemm_target()
    problems = gemm_backend_problems(_at_level(cfg, fp8_levels[0]), target, "scaled_mm")
    if problems:
        where = (f"a CUDA GPU of compute capability {target.capability}"
                 + ("" if target.triton else " without Triton") if target.kind == "cuda" else target.kind)
        raise ConfigurationError(
            f"--fp8-gemm-backend scaled_mm runs every FP8 GEMM on the hardware GEMM, but on this machine's device "
            f"({where}) these cannot:\n  " + "\n  ".join(problems)
            + "\nuse --fp8-gemm-backend auto (the hardware GEMM where it can run, the emulation elsewhere) or "
              "emulated, or change the recipe (--fp8-recipe) or the shapes named above")


def _at_level(cfg: RunConfig, level: str) -> RunConfig:
    """``cfg`` with ``--fp8-opt-level level`` (the linears' shapes and precision are the same at every FP8 level)."""
    return cfg.replace(precision={"fp8_opt_level": level})


def kept_layers(cfg: RunConfig) -> frozenset[int]:
    """The global layer numbers ``--first-last-layers-bf16`` keeps out of FP8 (empty without it)."""
    p = cfg.precision
    return high_precision_layers(p.first_last_layers_bf16, p.num_layers_at_start_in_bf16, p.num_layers_at_end_in_bf16,
                                 cfg.model.num_layers)


def check_compile_layers(cfg: RunConfig) -> None:
    """``--compile-layers``: raise :class:`ConfigurationError` at start-up, naming the fix, for what does not compile
    into one graph per layer (measured on CPU, torch 2.13): tensor parallelism (the FP8 layers' collectives, e.g. the
    asynchronous amax all-reduce of agreed scales, and the baseline's, do not trace), megatron-core's mixture-of-experts
    layer (data-dependent token routing: host reads of the per-expert counts), and a rowwise/blockwise FP8 weight
    holding its scaled FP16 gradient (``--fp8-grad-accumulation fp16``): torch.compile fails creating the fake of a
    block-scaled :class:`fp8.Float8Tensor` whose gradient's scale has another shape, at any recompilation after the
    first backward (evaluation included)."""
    if not cfg.parallel.compile_layers:
        return
    if cfg.parallel.tensor_model_parallel_size > 1:
        raise ConfigurationError(
            f"--compile-layers compiles each transformer layer into one graph, but the tensor-parallel collectives inside "
            f"the layers (--tensor-model-parallel-size {cfg.parallel.tensor_model_parallel_size}) do not trace: drop "
            f"--compile-layers, or use --tensor-model-parallel-size 1 (pipeline and data parallelism compile)")
    if cfg.moe.num_experts is not None:
        raise ConfigurationError(
            "--compile-layers compiles each transformer layer into one graph, but megatron-core's mixture-of-experts "
            "layer routes tokens by data-dependent counts read on the host (a graph break): drop --compile-layers with "
            "--num-experts")
    levels = {cfg.precision.fp8_opt_level, *cfg.precision.compare_levels} - {"none"}
    if levels and cfg.precision.fp8_grad_accumulation == "fp16":
        blocked = sorted({linear.config.recipe for linear in fp8_linear_shapes(_at_level(cfg, min(levels)))} - {
            "tensorwise"})
        if blocked:
            raise ConfigurationError(
                f"--compile-layers with the {'/'.join(blocked)} recipe and --fp8-grad-accumulation fp16: torch.compile "
                f"fails on a block-scaled FP8 weight holding its scaled FP16 gradient (recompiling after a backward, e.g. "
                f"for evaluation); use --fp8-grad-accumulation fp32 (or fp8), or --fp8-recipe tensorwise, or drop "
                f"--compile-layers")
