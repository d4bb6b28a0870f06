"""``fp8.initialize``: turn any PyTorch / Hugging Face model and its optimizer into FP8 ones."""

from __future__ import annotations

import dataclasses
import inspect
import logging

import torch
from torch import nn

from .activations import compress_activations
from .distributed.fsdp import FSDPConfig, follow_fsdp
from .distributed.sharding import is_dtensor
from .convert import ModuleFilter, convert_embeddings_to_float8, convert_to_float8_linear, is_conv1d
from .moe import is_fused_experts
from .gemm import GemmTarget, scaled_mm_supported
from .fallback import FallbackConfig, attach as attach_fallback
from .linear import Float8Linear, Float8LinearConfig
from .optim.base import FP8Optimizer
from .optim.convert import check_convertible
from .optim.master_weights import MasterWeightOptimizer
from .optim.precision import OptimizerPrecision
from .optim.wrap import FP8Weight, wrap_for_level
from .precision_rules import parse_precision_rules
from .recipes import get_recipe
from .schedule import MODES, attach as attach_schedule
from .smooth_swiglu import smooth_swiglu as apply_smooth_swiglu
from .tensor import Float8Tensor

__all__ = ["initialize", "OPT_LEVELS", "OPT_LEVEL_ALIASES", "normalize_opt_level"]

logger = logging.getLogger(__name__)

OPT_LEVELS = ("none", "O1", "O2", "O3")
"""Implemented opt levels: ``none`` (unchanged, the high-precision baseline), ``O1``, ``O2`` and ``O3``."""

OPT_LEVEL_ALIASES = {"O0": "none"}
"""Accepted spellings of a level, normalised to its name in :data:`OPT_LEVELS` (``O0``: Apex's name of the baseline)."""


def normalize_opt_level(opt_level: str) -> str:
    """``opt_level`` as named in :data:`OPT_LEVELS` (``"O0"`` -> ``"none"``); a ``ValueError`` names the choices."""
    level = OPT_LEVEL_ALIASES.get(opt_level, opt_level)
    if level not in OPT_LEVELS:
        raise ValueError(f"opt_level must be one of {OPT_LEVELS} (or 'O0', an alias of 'none'), got {opt_level!r}")
    return level



def _names(names: list[str], max_names: int = 4, quote: bool = True) -> str:
    shown = ", ".join(repr(n) if quote else n for n in names[:max_names])
    return shown + (f", ... ({len(names) - max_names} more)" if len(names) > max_names else "")


def _check_not_initialized(model: nn.Module) -> None:
    """Refuse a model that already holds FP8 layers or weights: a second ``initialize`` would give the
    optimizer no master weights (it would step the FP8 weights themselves, losing most updates)."""
    layers = [fqn or "<root>" for fqn, m in model.named_modules() if isinstance(m, Float8Linear)]
    weights = [fqn for fqn, p in model.named_parameters() if isinstance(p, Float8Tensor)]
    if layers or weights:
        found = (f"{len(layers)} Float8Linear module(s): {_names(layers)}" if layers
                 else f"{len(weights)} Float8Tensor parameter(s): {_names(weights)}")
        raise ValueError(
            f"model is already initialized for FP8 (it holds {found}); call fp8.initialize once, on the original "
            f"model and optimizer, and train with the (model, optimizer) it returns"
        )


def _check_not_sharded(model: nn.Module) -> None:
    """Refuse a model FSDP2 already sharded (DTensor parameters): its linears would be converted from this rank's rows
    only, and the optimizer could not find its parameters' full masters."""
    sharded = [fqn for fqn, p in model.named_parameters() if is_dtensor(p)]
    if sharded:
        raise ValueError(
            f"model is already sharded ({len(sharded)} DTensor parameter(s), e.g. {_names(sharded, 2)}: "
            f"fully_shard, or another DTensor parallelism, ran before fp8.initialize); call "
            f"`model, optimizer = fp8.initialize(model, optimizer, level)` on the unsharded model first, then "
            f"fully_shard each block and the root (docs/fsdp.md)")


def _check_optimizer_params(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer holding parameters that are not ``model``'s (built on another model or a copy):
    it would step tensors the model never uses."""
    own = {id(p) for p in model.parameters()}
    foreign = [
        f"param_groups[{g}]['params'][{i}] (shape {list(p.shape)})"
        for g, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"]) if id(p) not in own
    ]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} parameter(s) that are not parameters of this model: "
            f"{_names(foreign, quote=False)}; build the optimizer on this model's parameters (e.g. "
            f"torch.optim.AdamW(model.parameters())) and pass that model and optimizer to fp8.initialize"
        )


def _check_materialized(model: nn.Module) -> None:
    """Refuse parameters on the meta device: converting quantizes the weights, which needs their values."""
    meta = [fqn for fqn, p in model.named_parameters() if p.device.type == "meta"]
    if meta:
        raise ValueError(
            f"model has {len(meta)} parameter(s) on the meta device ({_names(meta)}), which hold no values to "
            f"quantize; build the model on a real device (or call model.to_empty(device=...) and initialize the "
            f"weights) before fp8.initialize"
        )


def _check_no_closure_required(optimizer: torch.optim.Optimizer) -> None:
    """Refuse, at O1, an optimizer whose ``step`` needs a closure (e.g. ``torch.optim.LBFGS``): it
    re-evaluates the model inside one step, and O1 steps the master weights once, after the backward."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):  # no signature to read: nothing to refuse
        return
    if closure is not None and closure.default is inspect.Parameter.empty:
        name = type(optimizer).__name__
        raise TypeError(
            f"{name}.step(closure) re-evaluates the model within one step, which opt_level 'O1' does not "
            f"support (it steps the master weights once per step, after the backward, and re-quantizes the FP8 "
            f"weights after it); use a first-order optimizer (e.g. torch.optim.AdamW or SGD) at O1, or "
            f"opt_level='none' to train with {name} in high precision"
        )


def _check_no_conv1d_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse, at O1, an optimizer that already holds state for a transformers ``Conv1D`` weight: its master
    becomes a new, transposed Parameter, and optimizer state cannot be carried over to it in general."""
    stepped = [fqn or "<root>" for fqn, m in model.named_modules()
               if is_conv1d(m) and optimizer.state.get(m.weight)]
    if stepped:
        raise ValueError(
            f"the optimizer already holds state for {len(stepped)} transformers Conv1D weight(s) ({_names(stepped)}); "
            f"their FP8 master weights are new (transposed) Parameters: call fp8.initialize before the first "
            f"optimizer step"
        )


def _check_no_fused_expert_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that already holds state for fused MoE expert weights: each expert projection gets its
    own master Parameter, and the fused tensor's optimizer state cannot be carried over to them."""
    stepped = [fqn for fqn, m in model.named_modules() if is_fused_experts(m)
               and any(optimizer.state.get(p) for p in m.parameters(recurse=False))]
    if stepped:
        raise ValueError(
            f"the optimizer already holds state for the fused expert weights of {len(stepped)} MoE experts module(s) "
            f"({_names(stepped)}); FP8 gives each expert projection its own master Parameter: call fp8.initialize "
            f"before the first optimizer step"
        )


def _swap_expert_masters(optimizer: torch.optim.Optimizer, converted: list) -> None:
    """In ``optimizer``'s param groups, replace each fused MoE expert parameter by its experts' masters (in order;
    ``ConvertedLinear.split_from``), so every later step treats each expert projection as one weight."""
    split: dict[int, list[nn.Parameter]] = {}
    for c in converted:
        if c.split_from is not None:
            split.setdefault(id(c.split_from), []).append(c.original_weight)
    if not split:
        return
    for group in optimizer.param_groups:
        group["params"] = [q for p in group["params"] for q in split.get(id(p), [p])]


def _swap_conv1d_masters(optimizer: torch.optim.Optimizer, converted: list) -> None:
    """O1: in ``optimizer``'s param groups, replace each converted ``Conv1D``'s own (in, out) weight by its
    (out, in) master (``ConvertedLinear.original_weight``), which the wrapper steps and re-quantizes from."""
    swap = {id(c.transposed_from): c.original_weight for c in converted if c.transposed_from is not None}
    if not swap:
        return
    for group in optimizer.param_groups:
        group["params"] = [swap.get(id(p), p) for p in group["params"]]


def _check_hardware(model: nn.Module, config: Float8LinearConfig) -> None:
    devices = {p.device for p in model.parameters()}
    for device in devices:
        problem = config.recipe_spec.hardware_problem(GemmTarget.of(device), config.gemm_backend)
        if problem is not None:  # e.g. mxfp8 on a Hopper GPU: refused, not emulated silently
            raise RuntimeError(f"fp8.initialize(recipe={config.recipe!r}): {problem}")
        if scaled_mm_supported(device):
            continue
        message = (
            f"{device} has no FP8 GEMM support (torch._scaled_mm needs a CPU or a CUDA GPU of compute "
            f"capability >= 8.9, e.g. H100/H200/L40/RTX 4090)"
        )
        if config.gemm_backend == "scaled_mm":
            raise RuntimeError(f"{message}; use gemm_backend='auto' or 'emulated' to emulate FP8 GEMMs")
        logger.warning("fp8: %s; FP8 GEMMs will be emulated (correct numerics, no speed-up)", message)


def _with_activations(model: nn.Module, fp8_activations: bool) -> nn.Module:
    if fp8_activations:
        model.fp8_activation_compressor = compress_activations(model)
    return model


def initialize(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    opt_level: str = "O1",
    *,
    config: Float8LinearConfig | None = None,
    module_filter_fn: ModuleFilter | None = None,
    precision=None,
    optimizer_precision: OptimizerPrecision | str | None = None,
    process_group=None,
    min_fp8_dim: int | None = None,
    require_fp8: bool = False,
    recipe: str | None = None,
    fp8_activations: bool = False,
    fp8_embeddings: bool = False,
    fsdp: FSDPConfig | None = None,
    auto_fallback: bool | FallbackConfig = False,
    high_precision_from_step: int | None = None,
    high_precision_mode: str = "forward",
    smooth_swiglu: bool = False,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Convert ``model`` (in place) and wrap ``optimizer`` for FP8 training at ``opt_level``.

    - ``"none"`` (alias ``"O0"``): returns both unchanged (the high-precision baseline).
    - ``"O1"``: every eligible ``nn.Linear`` and transformers ``Conv1D`` (GPT-2's transposed linear; its
      master weight is a transposed copy) becomes a :class:`fp8.Float8Linear` (FP8 E4M3 weights
      with their scales, FP8 GEMMs; weight gradients summed over micro-batches in a scaled FP16 buffer, or
      per ``config.grad_accumulation``: in fp32 with ``"fp32"``, in E4M3 with ``"fp8"``); ``module_filter_fn(module, fqn)`` returning
      False keeps a layer in high precision, and layers with dimensions not multiple of 16 or tied
      weights are kept with a logged reason. ``nn.Linear`` subclasses convert only when their forward is known
      to be a plain linear (Falcon's ``FalconLinear``; :data:`fp8.convert.PLAIN_LINEAR_FORWARDS`), others are kept,
      reported. transformers MoE experts (Mixtral, Qwen2-MoE, Qwen3-MoE: fused 3-D ``gate_up_proj``/``down_proj``)
      become :class:`fp8.Float8Experts`: one FP8 weight and scale per expert projection, FP8 grouped GEMMs; the
      optimizer's fused parameter is replaced by one master per expert projection (docs/moe.md). The optimizer is
      wrapped in a
      :class:`fp8.optim.MasterWeightOptimizer`: it keeps the original high-precision weights as masters,
      steps them on the dequantized FP8 gradients and refreshes the FP8 copies after each step.
    - ``"O2"``: O1's model, and the given ``torch.optim.Adam``/``AdamW``/``SGD`` is replaced by its
      :mod:`fp8.optim` counterpart (hyper-parameters and param groups carried over) storing the first
      moment in E4M3, the second moment in FP16 and the master weights in FP16, each with a per-tensor
      scale; ``optimizer_precision=fp8.optim.OptimizerPrecision(...)`` (or a preset name such as ``"O2"``)
      overrides that (ablations). Other
      optimizers are refused with a clear error.
    - ``"O3"``: O2 sharded over the data-parallel ``process_group`` (None: the default group; needs an
      initialized process group): each rank owns whole tensors and keeps their master weights and
      moments only (:class:`fp8.optim.sharded.ShardedFP8Optimizer`); wrapping the model in
      :class:`fp8.distributed.DistributedDataParallel` afterwards, given this optimizer
      (``DistributedDataParallel(model, o3_optimizer=optimizer)``), reduces each gradient to its owner,
      and the step all-gathers the updated FP8 weights with their scales. With one rank it is O2.

    ``precision``: the per-layer precision of the model, as rules (:mod:`fp8.precision_rules`: a
    ``{"rules": [{"pattern": ..., "precision": "bf16" | "fp8", "recipe": ..., ...}]}`` dict or a list of rules):
    ordered glob patterns over ``model.named_modules()`` names, first match wins, a rule keeping a layer in high
    precision or converting it with its recipe/formats; a pattern that matches no linear is a ``ValueError`` before
    anything changes, and each rule's matches are logged (at any FP8 level). The optimizer's storage precision is
    ``optimizer_precision`` (an ``OptimizerPrecision`` given as ``precision`` is refused, naming it).

    ``min_fp8_dim``: linears with ``min(in_features, out_features)`` below it stay in high precision,
    logged (None: 2048 on CUDA, the measured crossover, and 0 on CPU; see :data:`fp8.convert.CUDA_MIN_FP8_DIM`).
    A model where no linear becomes FP8 is announced at WARNING; ``require_fp8=True`` raises a ``ValueError``
    instead, before the model or optimizer is touched.

    Refused up front (the model and optimizer untouched), each error naming the fix: a model already
    initialized (holding ``Float8Linear`` modules or ``Float8Tensor`` weights; call it once), an optimizer
    holding parameters that are not the model's, a model with parameters on the meta device (at the FP8
    levels), and at O1 an optimizer whose ``step`` needs a closure (``torch.optim.LBFGS``).

    ``recipe`` (``"tensorwise"``, the default, ``"rowwise"`` or ``"blockwise"``; :mod:`fp8.recipes`) sets the
    granularity of the FP8 scales (``config.recipe``); layers that cannot tile ``blockwise`` (dimensions not
    multiples of 128) run ``tensorwise``, logged.

    ``fp8_activations=True`` stores the tensors the model's non-linear ops save for backward (norms, activation
    functions, gated products, attention inputs, residual branches) as E4M3 in 1x128 tiles
    (:func:`fp8.activations.compress_activations`, at every level, ``"none"`` included); the compressor, with
    its byte ledger (``.stats``, ``.held_bytes()``; ``fp8.memory_report(model, optimizer,
    activations=model.fp8_activation_compressor)``), is ``model.fp8_activation_compressor``.

    ``fp8_embeddings=True`` (FP8 levels) also turns every untied ``nn.Embedding`` into an
    :class:`fp8.embedding.Float8Embedding`: an E4M3 table with one scale per row, trained like an FP8 weight (its
    master in the optimizer, its gradient per ``config.grad_accumulation``); tied tables stay in high precision, logged.
    ``module_filter_fn`` then also sees the ``nn.Embedding`` modules (False keeps a table in high precision).

    Call it after moving the model to its device and dtype, before wrapping it for data
    parallelism. Returns ``(model, optimizer)``; ``optimizer`` may be None (inference, frozen).

    FSDP2 (docs/fsdp.md): ``fully_shard`` the returned model (each block, then the root) at O1, O2 or O3; the returned
    optimizer takes over the sharded parameters at its next call, FP8 weights stay sharded in FP8 and are all-gathered
    in FP8, gradients are reduce-scattered as ``fsdp`` (a :class:`fp8.distributed.fsdp.FSDPConfig`; default FP8 on the
    wire). A model already sharded is refused (initialize first).

    ``auto_fallback`` (True, or a :class:`fp8.fallback.FallbackConfig`; FP8 levels, with an optimizer): FP8 statistics
    every ``interval`` (10) optimizer steps, and a linear whose input or output gradient keeps saturating, flushing to
    zero or turning non-finite for ``patience`` (3) consecutive checks steps one rung safer (tensorwise -> rowwise ->
    blockwise -> high precision), decided alike on every rank (statistics merged over the world), logged as a WARNING,
    kept in ``optimizer.state_dict()`` (:mod:`fp8.fallback`). ``fp8.layer_precisions(model)`` shows each linear's
    setting.

    ``high_precision_from_step=N`` (FP8 levels, with an optimizer): from the N-th optimizer step on, every FP8 linear
    runs its forward GEMM (``high_precision_mode="forward"``) or all its GEMMs (``"linear"``) in high precision
    (:mod:`fp8.schedule`); the step count travels in ``optimizer.state_dict()``.

    ``smooth_swiglu=True`` (FP8 levels, tensorwise recipe): the down projection of every transformers gated MLP
    (Llama, Mistral, Qwen2, Qwen3: ``gate_proj``/``up_proj``/``down_proj``/``act_fn``) scales its input per channel by a
    power of two before its FP8 cast, the inverse folded into its weight operand: the same function, no saturation on
    outlier channels (Smooth-SwiGLU, :mod:`fp8.smooth_swiglu`).
    """
    opt_level = normalize_opt_level(opt_level)
    if auto_fallback is True:
        auto_fallback = FallbackConfig()
    if auto_fallback is not False and not isinstance(auto_fallback, FallbackConfig):
        raise TypeError(f"auto_fallback= takes True, False or an fp8.fallback.FallbackConfig, got "
                        f"{type(auto_fallback).__name__}")
    if (auto_fallback or high_precision_from_step is not None) and (opt_level == "none" or optimizer is None):
        raise ValueError("auto_fallback and high_precision_from_step act after optimizer steps of an FP8 model: pass an "
                         "FP8 opt_level (O1, O2 or O3) and the optimizer")
    if high_precision_from_step is not None and (high_precision_from_step < 1 or high_precision_mode not in MODES):
        raise ValueError(f"high_precision_from_step={high_precision_from_step} counts optimizer steps from 1, and "
                         f"high_precision_mode must be one of {MODES}; got mode {high_precision_mode!r}")
    if smooth_swiglu and opt_level == "none":
        raise ValueError("smooth_swiglu=True smooths the FP8 cast of gated MLPs' down projections: pass an FP8 "
                         "opt_level (O1, O2 or O3)")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, (MasterWeightOptimizer, FP8Optimizer)):
        raise ValueError("this optimizer is already FP8-initialized; call fp8.initialize once per model")
    if recipe is not None:
        get_recipe(recipe)  # a bad name fails at every level
    _check_not_initialized(model)
    _check_not_sharded(model)
    if fsdp is not None and not isinstance(fsdp, FSDPConfig):
        raise TypeError(f"fsdp= takes an fp8.distributed.fsdp.FSDPConfig, got {type(fsdp).__name__}")
    fsdp = fsdp or FSDPConfig()
    if optimizer is not None:
        _check_optimizer_params(model, optimizer)
    if isinstance(precision, (OptimizerPrecision, str)):
        raise TypeError(f"precision= takes per-layer precision rules (a dict or a list, fp8.precision_rules); the "
                        f"optimizer's storage precision {precision!r} is optimizer_precision=")
    layer_rules = None if precision is None else parse_precision_rules(precision, source="precision=")
    if optimizer_precision is not None and opt_level not in ("O2", "O3"):
        raise ValueError(f"optimizer_precision= applies to opt_levels 'O2' and 'O3', not {opt_level!r}")
    if process_group is not None and opt_level != "O3":
        raise ValueError(f"process_group= applies to opt_level 'O3' (the sharded optimizer), not {opt_level!r}")
    if opt_level == "O3":
        from .comm import require_process_group

        require_process_group("opt_level 'O3' (the FP8 distributed optimizer)")
    if opt_level == "none":
        if fp8_embeddings:
            raise ValueError("fp8_embeddings=True needs an FP8 opt_level (O1, O2 or O3); at 'none' the model stays in "
                             "high precision")
        return _with_activations(model, fp8_activations), optimizer
    _check_materialized(model)
    if opt_level == "O1" and optimizer is not None:
        _check_no_closure_required(optimizer)
        _check_no_conv1d_state(model, optimizer)
    if recipe is not None:
        if config is not None and config.recipe not in ("tensorwise", recipe):
            raise ValueError(f"recipe={recipe!r} contradicts config.recipe={config.recipe!r}; pass one of them")
        config = dataclasses.replace(config or Float8LinearConfig(), recipe=recipe)
    config = config or Float8LinearConfig()
    _check_hardware(model, config)
    if opt_level in ("O2", "O3") and optimizer is not None:
        check_convertible(optimizer)  # before the model is touched
    if optimizer is not None:
        _check_no_fused_expert_state(model, optimizer)
    model, converted = convert_to_float8_linear(model, config, module_filter_fn, min_fp8_dim, require_fp8=require_fp8,
                                                precision_rules=layer_rules)
    if fp8_embeddings:
        model, tables = convert_embeddings_to_float8(model, config, module_filter_fn)
        converted = converted + tables
    if smooth_swiglu:
        apply_smooth_swiglu(model)
    model = _with_activations(model, fp8_activations)
    follow_fsdp(model, fsdp)
    if optimizer is None:
        return model, None
    _swap_expert_masters(optimizer, converted)
    if opt_level == "O1":
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        converted = [c for c in converted if id(c.optimizer_param) in in_optimizer]
        _swap_conv1d_masters(optimizer, converted)
        weights = [FP8Weight(c.original_weight, c.module.weight, c.original_weight) for c in converted]
    else:
        weights = [FP8Weight(c.optimizer_param, c.module.weight, c.original_weight) for c in converted]
    optimizer = wrap_for_level(opt_level, optimizer, weights, scaling_module=model, precision=optimizer_precision,
                               process_group=process_group,
                               **({"counter": fsdp.counter} if opt_level == "O3" else {"comm_counter": fsdp.counter}))
    if auto_fallback:  # before the schedule: its step hook runs after the fallback's (module docstrings)
        attach_fallback(model, optimizer, auto_fallback, process_group)
    if high_precision_from_step is not None:
        attach_schedule(model, optimizer, high_precision_from_step, high_precision_mode)
    return model, optimizer
