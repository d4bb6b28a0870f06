"""Swap eligible ``nn.Linear`` modules of any model for :class:`Float8Linear`.

transformers' ``Conv1D`` (GPT-2 and relatives: a linear layer whose weight is stored transposed, shape
``(in_features, out_features)``, ``y = x @ weight + bias``) converts too, detected by duck typing
(:func:`is_conv1d`; transformers is not imported). Its FP8 weight is quantized from ``weight.t()``, and its
master weight is a new ``(out_features, in_features)`` copy (:attr:`ConvertedLinear.transposed_from`).

``nn.Linear`` subclasses convert when their forward is known to be a plain linear (:data:`PLAIN_LINEAR_FORWARDS`,
e.g. Falcon's ``FalconLinear``); any other subclass (its own forward, or a parent reading its weight directly, as
``nn.MultiheadAttention`` does its ``out_proj``'s) stays in high precision, reported with the reason. transformers MoE
experts (fused 3-D ``gate_up_proj``/``down_proj``) become :class:`fp8.moe.Float8Experts` (FP8 expert weights, FP8
grouped GEMM)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch
from torch import nn

from .embedding import Float8Embedding, embedding_problem
from .eligibility import fp8_linear_problem
from .linear import Float8Linear, Float8LinearConfig, InputCasts
from .moe import Float8Experts, experts_problem, is_fused_experts
from .precision_rules import PrecisionPlan, parse_precision_rules

__all__ = ["ConvertedLinear", "high_precision_forward", "layer_precisions", "convert_to_float8_linear", "convert_embeddings_to_float8", "is_conv1d", "float8_linear_from_conv1d", "CUDA_MIN_FP8_DIM", "default_min_fp8_dim",
           "module_paths", "set_submodule",
           "announce_fp8_selection", "fp8_selection_message", "ModuleFilter", "PLAIN_LINEAR_FORWARDS",
           "linear_subclass_problem", "set_high_precision_forward", "set_high_precision", "fp8_config_attribute"]

logger = logging.getLogger(__name__)

ModuleFilter = Callable[[nn.Module, str], bool]

CUDA_MIN_FP8_DIM = 2048
"""Default smallest ``min(in_features, out_features)`` converted to FP8 on CUDA. Measured crossover
(H200, torch.compile, one linear fwd+bwd at 16384 tokens, ../shared/anchors/h200-2026-11-30.json):
1024x1024 runs at 0.73x BF16 (slower), 4096x4096 at 1.44x; 2048 is the geometric midpoint of the two.
Re-measure with ``benchmarks/gpu_step.py`` (its linear section) and pass ``min_fp8_dim`` to override."""


def default_min_fp8_dim(model: nn.Module) -> int:
    """The default ``min_fp8_dim`` for ``model``: :data:`CUDA_MIN_FP8_DIM` when its parameters are on
    CUDA, 0 elsewhere (CPU has no FP8 units, and small test layers stay convertible)."""
    return CUDA_MIN_FP8_DIM if any(p.is_cuda for p in model.parameters()) else 0


PLAIN_LINEAR_FORWARDS = (("transformers.models.falcon.modeling_falcon", "FalconLinear.forward"),)
"""``(module, qualified name)`` of ``nn.Linear`` subclasses' forwards known to compute ``x @ weight.T + bias`` exactly as
``nn.Linear`` does (read from their source); such subclasses convert to FP8. Checked by identity of the forward's
defining module and name, never by running it."""


def linear_subclass_problem(module: nn.Linear) -> str | None:
    """Why an ``nn.Linear`` subclass must stay in high precision, or None if its forward is a plain linear
    (:data:`PLAIN_LINEAR_FORWARDS`)."""
    forward = type(module).forward
    if (getattr(forward, "__module__", None), getattr(forward, "__qualname__", None)) in PLAIN_LINEAR_FORWARDS:
        return None
    return (f"{type(module).__name__} subclasses nn.Linear but is not known to be a plain linear (its forward, or a "
            f"parent reading its weight directly, may differ); it stays in high precision")


def module_paths(model: nn.Module) -> dict[int, list[str]]:
    """``id(module) -> every name it is registered under`` in ``model`` (a module shared by several parents, e.g.
    T5's embedding table, has several)."""
    paths: dict[int, list[str]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        paths.setdefault(id(module), []).append(fqn)
    return paths


def set_submodule(model: nn.Module, fqn: str, module: nn.Module) -> None:
    """Register ``module`` as ``model``'s submodule ``fqn`` (dotted; not the root)."""
    parent_name, _, child_name = fqn.rpartition(".")
    setattr(model.get_submodule(parent_name), child_name, module)


@dataclass(frozen=True)
class ConvertedLinear:
    """One swap: the module's qualified name, the original high-precision weight (the master, shaped like the FP8
    weight: ``(out_features, in_features)`` for a linear), the new module (a :class:`Float8Linear`, or a
    :class:`~fp8.embedding.Float8Embedding` from :func:`convert_embeddings_to_float8`).

    ``transposed_from`` is None for an ``nn.Linear`` (its own weight is the master). For a transformers
    ``Conv1D`` it is the module's own ``(in_features, out_features)`` weight, which the user's optimizer
    holds: ``original_weight`` is then a new Parameter holding its transpose, and the optimizer must swap
    ``transposed_from`` for it (O1) or for the FP8 weight (O2/O3).

    ``split_from`` is set for one expert projection of a transformers MoE experts module (:class:`fp8.moe.Float8Experts`):
    the fused 3-D parameter the user's optimizer holds, of which ``original_weight`` (a new Parameter) is one expert's
    slice; ``fp8.initialize`` swaps the fused parameter for the experts' masters in the optimizer before anything
    else, so ``optimizer_param`` is the master. ``module`` is then a :class:`fp8.moe.ExpertWeight`.
    """

    fqn: str
    original_weight: nn.Parameter
    module: Float8Linear | Float8Embedding | nn.Module
    transposed_from: nn.Parameter | None = None
    split_from: nn.Parameter | None = None

    @property
    def optimizer_param(self) -> nn.Parameter:
        """The parameter the user's optimizer holds for this layer (before ``fp8.initialize``)."""
        return self.original_weight if self.transposed_from is None else self.transposed_from


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers ``Conv1D`` (weight stored ``(in_features, out_features)``,
    ``nf`` = out features), by duck typing: transformers is an optional dependency, never imported here."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ == "Conv1D" and hasattr(module, "nf") and isinstance(weight, nn.Parameter)
            and weight.dim() == 2 and weight.shape[1] == module.nf)


def _linear_view(module: nn.Module) -> SimpleNamespace | nn.Linear:
    """``module`` as ``Float8Linear.from_linear`` reads it (``in_features``, ``out_features``, ``weight``
    of shape (out, in), ``bias``): an ``nn.Linear`` itself; for a ``Conv1D`` its dims and its own (in, out)
    weight, not yet transposed (the eligibility checks read only the dims, dtype and tied-ness)."""
    if isinstance(module, nn.Linear):
        return module
    in_features, out_features = module.weight.shape
    return SimpleNamespace(in_features=in_features, out_features=out_features, weight=module.weight,
                           bias=module.bias)


def float8_linear_from_conv1d(conv: nn.Module, config: Float8LinearConfig | None = None,
                              input_casts: InputCasts | None = None) -> tuple[Float8Linear, nn.Parameter]:
    """``(Float8Linear, master)`` for a transformers ``Conv1D``: in_features = ``weight.shape[0]``,
    out_features = ``weight.shape[1]``, the FP8 weight quantized from ``weight.t()``, the bias the same
    ``Parameter``. ``master`` is a new ``(out_features, in_features)`` Parameter holding ``weight.t()``
    (the high-precision copy the optimizer steps at O1/O2)."""
    if not is_conv1d(conv):
        raise TypeError(f"float8_linear_from_conv1d: expected a transformers Conv1D, got {type(conv).__name__}")
    weight = conv.weight
    master = nn.Parameter(weight.detach().t().contiguous(), requires_grad=weight.requires_grad)
    in_features, out_features = weight.shape
    view = SimpleNamespace(in_features=in_features, out_features=out_features, weight=master, bias=conv.bias)
    linear = Float8Linear.from_linear(view, config, input_casts)
    linear.stored_transposed = True  # its model stores this weight (in, out): no FP8 serving format loads it so
    return linear, master


def _experts_skip_reason(fqn: str, module: nn.Module, filter_fn: ModuleFilter | None, use_count: Counter,
                         min_fp8_dim: int, config: Float8LinearConfig) -> str | None:
    if filter_fn is not None and not filter_fn(module, fqn):
        return "excluded by module_filter_fn"
    problem = experts_problem(module)
    if problem:
        return problem
    e, two_i, h = module.gate_up_proj.shape
    if min(h, two_i // 2) < min_fp8_dim:
        return (f"experts hidden_dim={h}, intermediate_dim={two_i // 2} below min_fp8_dim={min_fp8_dim} (too small to "
                f"gain from FP8 at the measured crossover; pass min_fp8_dim=0 to convert them)")
    if any(use_count[id(p)] > 1 for p in (module.gate_up_proj, module.down_proj)):
        return "expert weights are shared with another module (tied); FP8 would untie them"
    if not config.recipe_spec.tensorwise:
        return f"the FP8 grouped GEMM runs the tensorwise recipe only, not {config.recipe!r}"
    return None


def _skip_reason(fqn: str, linear, filter_fn: ModuleFilter | None, use_count: Counter,
                 min_fp8_dim: int = 0, module: nn.Module | None = None) -> str | None:
    if filter_fn is not None and not filter_fn(module if module is not None else linear, fqn):
        return "excluded by module_filter_fn"
    problem = fp8_linear_problem(linear.in_features, linear.out_features, min_fp8_dim)
    if problem is not None and problem.too_small:
        return problem.reason
    if not linear.weight.is_floating_point():
        return f"weight dtype {linear.weight.dtype} is not floating point"
    if use_count[id(linear.weight)] > 1:
        return "weight is shared with another module (tied); FP8 would untie it"
    return problem.reason if problem is not None else None


def convert_to_float8_linear(
    model: nn.Module,
    config: Float8LinearConfig | None = None,
    module_filter_fn: ModuleFilter | None = None,
    min_fp8_dim: int | None = None,
    *,
    require_fp8: bool = False,
    precision_rules=None,
) -> tuple[nn.Module, list[ConvertedLinear]]:
    """Replace every eligible ``nn.Linear`` and transformers ``Conv1D`` in ``model`` (in place) by a
    :class:`Float8Linear` (a ``Conv1D``'s FP8 weight is quantized from its ``weight.t()``; see
    :class:`ConvertedLinear` for its master).

    transformers MoE experts modules (fused 3-D ``gate_up_proj``/``down_proj``; :mod:`fp8.moe`) become
    :class:`fp8.moe.Float8Experts`, one :class:`ConvertedLinear` per expert projection (``split_from`` set); kept ones
    are reported with their reason (an experts class fp8 does not know, ``min(hidden, intermediate) < min_fp8_dim``,
    tied weights, a recipe other than tensorwise).

    ``module_filter_fn(module, fqn)`` returning False keeps a layer in high precision (it also sees the experts
    modules: a filter reading ``in_features`` must check the type first). Layers whose
    dimensions are not multiples of 16, or whose weight is tied to another module, are kept too;
    every skipped layer is logged with its reason. Layers with ``min(in_features, out_features) <
    min_fp8_dim`` stay in high precision (too small to gain from FP8); None picks
    :func:`default_min_fp8_dim` (2048 on CUDA, 0 on CPU). Returns the (possibly new, if ``model`` itself
    is a linear) model and the list of swaps.

    A conversion that makes no layer FP8 (no ``nn.Linear``, or none eligible) logs so at WARNING, with the
    reasons; ``require_fp8=True`` raises a ``ValueError`` instead (the model is then left unchanged).

    ``precision_rules`` (:mod:`fp8.precision_rules`: a ``{"rules": [...]}`` dict, a list of rules, or parsed
    :class:`~fp8.precision_rules.PrecisionRule` s) chooses per layer by its name: the first matching rule keeps it in
    high precision or converts it with the rule's recipe/formats over ``config`` (the eligibility rules above still
    apply); a pattern that matches no linear, ``Conv1D`` or experts module raises ``ValueError`` before anything is
    changed, and the matches of each rule are logged at WARNING.
    """
    config = config or Float8LinearConfig()
    plan = None
    if precision_rules is not None:
        plan = PrecisionPlan(parse_precision_rules(precision_rules))
        for fqn, module in model.named_modules():
            if is_fused_experts(module) or is_conv1d(module) or isinstance(module, nn.Linear):
                plan.rule_for(fqn or "<root>")
        plan.check()
        logger.warning("fp8: precision rules:\n%s", plan.summary())
        decided = {name: rule for i, rule in enumerate(plan.rules) for name in plan.matches[i]}
        rule_number = {id(rule): i + 1 for i, rule in enumerate(plan.rules)}
    if min_fp8_dim is None:
        min_fp8_dim = default_min_fp8_dim(model)
    if min_fp8_dim < 0:
        raise ValueError(f"min_fp8_dim must be >= 0 (0 converts every eligible layer), got {min_fp8_dim}")
    use_count = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    casts = InputCasts()  # the linears of this model share the FP8 casts of the inputs they read alike
    converted: list[ConvertedLinear] = []
    kept: list[tuple[str, str]] = []
    experts: list[tuple[str, str | None]] = []  # (name, reason kept or None)
    base_config = config
    for fqn, module in list(model.named_modules()):
        rule = decided.get(fqn or "<root>") if plan is not None else None
        config = base_config if rule is None or rule.high_precision else rule.config(base_config)
        by_rule = (f"precision rule {rule_number[id(rule)]} {rule.pattern!r}" if rule is not None and rule.high_precision
                   else None)
        if is_fused_experts(module):
            reason = by_rule or _experts_skip_reason(fqn, module, module_filter_fn, use_count, min_fp8_dim, config)
            experts.append((fqn or "<root>", reason))
            if reason:
                logger.info("fp8: kept experts %s in high precision: %s", fqn or "<root>", reason)
            else:
                new, masters = Float8Experts.from_experts(module, config)
                fused = [module.gate_up_proj] * new.num_experts + [module.down_proj] * new.num_experts
                names = [f"gate_up.{e}" for e in range(new.num_experts)] + [f"down.{e}" for e in range(new.num_experts)]
                sub = list(new.gate_up) + list(new.down)
                converted += [ConvertedLinear(f"{fqn}.{n}" if fqn else n, m, w, split_from=f)
                              for n, m, w, f in zip(names, masters, sub, fused)]
                if fqn:
                    set_submodule(model, fqn, new)
                else:
                    model = new
            continue
        conv1d = is_conv1d(module)
        if not isinstance(module, nn.Linear) and not conv1d:
            continue
        subclass = isinstance(module, nn.Linear) and type(module) is not nn.Linear
        reason = by_rule or ((linear_subclass_problem(module) if subclass else None)
                             or _skip_reason(fqn, _linear_view(module), module_filter_fn, use_count, min_fp8_dim, module))
        if reason:
            logger.info("fp8: kept %s in high precision: %s", fqn or "<root>", reason)
            kept.append((fqn or "<root>", reason))
            continue
        if conv1d:
            new, master = float8_linear_from_conv1d(module, config, casts)
            converted.append(ConvertedLinear(fqn, master, new, transposed_from=module.weight))
        else:
            new = Float8Linear.from_linear(module, config, casts)
            converted.append(ConvertedLinear(fqn, module.weight, new))
        if not fqn:
            model = new
            continue
        set_submodule(model, fqn, new)
    n_linear = sum(c.split_from is None for c in converted)
    if require_fp8 and not converted:  # nothing was swapped: the model is unchanged
        raise ValueError(
            f"{fp8_selection_message(0, kept, min_fp8_dim, experts=experts)}, and require_fp8=True asks for at least one FP8 "
            f"layer: give the linears in/out features that are multiples of 16, lower min_fp8_dim (0 converts "
            f"every eligible layer), loosen module_filter_fn, or pass require_fp8=False to train in high precision"
        )
    announce_fp8_selection(n_linear, kept, min_fp8_dim, experts=experts)
    return model, converted


def _reason_kind(reason: str, min_fp8_dim: int) -> str:
    """The reason without the layer's own sizes, so layers kept for the same cause group together."""
    if "below min_fp8_dim" in reason:
        return f"smaller than min_fp8_dim={min_fp8_dim} (too small to gain from FP8; pass min_fp8_dim=0 / --fp8-min-dim 0)"
    if "multiples of 16" in reason:
        return "dimensions not multiples of 16 (FP8 GEMMs need them)"
    return reason


def fp8_selection_message(n_fp8: int, kept: list[tuple[str, str]], min_fp8_dim: int, max_names: int = 6,
                          experts: list[tuple[str, str | None]] = ()) -> str:
    """How many linear layers (and MoE experts modules: ``experts``, ``(name, reason kept or None)``) run in FP8 and
    which stay in high precision, grouped by reason."""
    groups: dict[str, list[str]] = {}
    for name, reason in kept:
        groups.setdefault(_reason_kind(reason, min_fp8_dim), []).append(name)
    kept_experts = [(name, reason) for name, reason in experts if reason]
    for name, reason in kept_experts:
        groups.setdefault(_reason_kind(reason, min_fp8_dim), []).append(f"{name} (experts)")
    total = n_fp8 + len(kept)
    message = f"fp8: {n_fp8} of {total} linear layer(s) run in FP8"
    if experts:
        message += (f", {len(experts) - len(kept_experts)} of {len(experts)} MoE experts module(s) through the FP8 "
                    f"grouped GEMM (one E4M3 weight and scale per expert projection)")
    kept = kept + kept_experts
    total += len(experts)
    if not total:
        return message + " (the model has no torch.nn.Linear; only nn.Linear modules are converted) -- no FP8 GEMM will run"
    if kept:
        parts = []
        for kind, names in groups.items():
            shown = ", ".join(names[:max_names]) + (f", ... ({len(names) - max_names} more)" if len(names) > max_names else "")
            parts.append(f"{len(names)} {kind}: {shown}")
        message += f"; {len(kept)} stay in high precision: " + "; ".join(parts)
    if n_fp8 == 0 and len(kept_experts) == len(experts) and total:
        message += " -- no FP8 GEMM will run"
    return message


def announce_fp8_selection(n_fp8: int, kept: list[tuple[str, str]], min_fp8_dim: int,
                           log: logging.Logger | None = None, experts: list[tuple[str, str | None]] = ()) -> str:
    """Log :func:`fp8_selection_message` at WARNING (a model with no linear, or whose linears all stay in
    high precision, runs no FP8 GEMM: that must not pass unnoticed). Returns the message."""
    message = fp8_selection_message(n_fp8, kept, min_fp8_dim, experts=experts)
    (log or logger).warning(message)
    return message


def convert_embeddings_to_float8(model: nn.Module, config: Float8LinearConfig | None = None,
                                 module_filter_fn: ModuleFilter | None = None) -> tuple[nn.Module, list[ConvertedLinear]]:
    """Replace every eligible ``nn.Embedding`` of ``model`` (in place) by a :class:`~fp8.embedding.Float8Embedding`
    (E4M3 rows, one scale per row; ``config``'s weight format and gradient accumulation), at every name it is
    registered under. Kept in high precision, each logged with its reason: tables excluded by
    ``module_filter_fn(module, fqn)`` (the same filter as the linears': it sees ``nn.Embedding`` modules too, so a filter
    reading ``in_features`` must check the type first), tables whose weight is shared
    with another module (a tied output layer), and tables using ``max_norm``/``sparse``/``scale_grad_by_freq``.
    Returns the model and the swaps (each swap's ``original_weight`` is the master)."""
    # modules holding each parameter, each module once (one registered under several names is not a tie)
    use_count = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    paths = module_paths(model)  # a table registered under several names (T5's shared one) is swapped at every one
    converted: list[ConvertedLinear] = []
    for fqn, module in list(model.named_modules()):
        if type(module) is not nn.Embedding or not fqn:
            continue
        if module_filter_fn is not None and not module_filter_fn(module, fqn):
            reason = "excluded by module_filter_fn"
        elif use_count[id(module.weight)] > 1:
            reason = "weight is shared with another module (tied); FP8 would untie it"
        else:
            reason = embedding_problem(module)
        if reason:
            logger.info("fp8: kept embedding %s in high precision: %s", fqn, reason)
            continue
        new = Float8Embedding.from_embedding(module, config)
        converted.append(ConvertedLinear(fqn, module.weight, new))
        for path in paths[id(module)]:
            set_submodule(model, path, new)
    if converted:
        logger.info("fp8: %d embedding table(s) in FP8 (E4M3, one scale per row)", len(converted))
    return model, converted


def set_high_precision_forward(model: nn.Module, enabled: bool = True) -> int:
    """Switch every FP8 linear of ``model`` (each module attribute holding a :class:`Float8LinearConfig`:
    :class:`Float8Linear`, fp8's parallel linears, MoE experts) to running its forward GEMM in high precision
    (``enabled``; the backward GEMMs stay in the recipe's formats: :attr:`Float8LinearConfig.high_precision_forward`)
    or back. Returns how many configs changed. Idempotent, so a loop may call it at every iteration from the one it
    switches at (a resumed run switches again at its first iteration: nothing to save in checkpoints)."""
    return _set_flag(model, "high_precision_forward", enabled)


def fp8_config_attribute(module: nn.Module) -> str | None:
    """The name of ``module``'s attribute holding its :class:`Float8LinearConfig` (``config`` on
    :class:`Float8Linear` and :class:`Float8Experts`, ``fp8`` on fp8's parallel linears), or None."""
    for name, value in vars(module).items():
        if isinstance(value, Float8LinearConfig):
            return name
    return None


def set_high_precision(model: nn.Module, enabled: bool = True) -> int:
    """Switch every FP8 linear of ``model`` (as :func:`set_high_precision_forward` finds them) to running all three
    GEMMs in high precision on its weight's values (:attr:`Float8LinearConfig.high_precision`; the weight stays FP8 at
    rest, its optimizer unchanged) or back. Returns how many configs changed; idempotent (a loop may call it at every
    iteration from the one it switches at)."""
    return _set_flag(model, "high_precision", enabled)


def _set_flag(model: nn.Module, field: str, enabled: bool) -> int:
    """``field`` of every :class:`Float8LinearConfig` held by a module of ``model`` set to ``enabled``; how many
    changed."""
    changed = 0
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, Float8LinearConfig) and getattr(value, field) != enabled:
                setattr(module, name, replace(value, **{field: enabled}))
                changed += 1
    return changed


@contextmanager
def high_precision_forward(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, every FP8 linear of ``model`` runs its forward GEMM in high precision on its weight's values
    (:func:`set_high_precision_forward`): the FP8 model's weights without its activation casts, e.g. to compare a
    served or shadow model with it. Each config is put back as it was at the end."""
    held = [(module, name, value) for module in model.modules() for name, value in list(vars(module).items())
            if isinstance(value, Float8LinearConfig)]
    set_high_precision_forward(model, True)
    try:
        yield model
    finally:
        for module, name, value in held:
            setattr(module, name, value)


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16", torch.float64: "fp64"}


def layer_precisions(model: nn.Module) -> dict[str, str]:
    """Each linear of ``model`` by module name with its current setting: ``"fp8:<recipe>"`` for an FP8 linear
    (:class:`fp8.Float8Linear`, fp8's parallel linears, :class:`fp8.Float8Experts`; ``"fp8:<recipe>:high-precision-
    forward"`` while its forward GEMM runs in high precision, :func:`set_high_precision_forward`; ``"fp8:<recipe>:high-
    precision"`` while all its GEMMs do, :func:`set_high_precision` or automatic fallback's last rung, its weight still
    FP8 at rest), else the dtype its
    weight computes in (``"bf16"``, ``"fp32"``, ``"fp16"``) for a high-precision linear (``nn.Linear`` and other modules
    named ``*Linear`` holding a 2-D weight, transformers' ``Conv1D``), in ``named_modules()`` order."""
    out = {}
    for name, module in model.named_modules():
        attribute = fp8_config_attribute(module)
        config = getattr(module, attribute) if attribute else None
        if config is not None and (isinstance(module, (Float8Linear, Float8Experts))
                                   or type(module).__name__.endswith("Linear")):
            out[name] = f"fp8:{config.recipe}" + (":high-precision" if config.high_precision else
                                                  ":high-precision-forward" if config.high_precision_forward else "")
            continue
        weight = getattr(module, "weight", None)
        linear = isinstance(module, nn.Linear) or is_conv1d(module) or type(module).__name__.endswith("Linear")
        if linear and isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.is_floating_point():
            out[name] = _DTYPE_NAMES.get(weight.dtype, str(weight.dtype).removeprefix("torch."))
    return out
