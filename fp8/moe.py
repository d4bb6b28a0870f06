"""transformers mixture-of-experts experts in FP8: :class:`Float8Experts`.

transformers (5.x) stores a MoE layer's experts fused: one module (``MixtralExperts``, ``Qwen2MoeExperts``,
``Qwen3MoeExperts``) holding ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I) as 3-D parameters, its forward
``(hidden_states (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)`` running each hit expert's SwiGLU-style
MLP on its tokens and summing the results weighted by the router. :class:`Float8Experts` replaces such a module: each
expert projection becomes its own 2-D E4M3 :class:`fp8.Float8Tensor` parameter (one current power-of-two scale per
expert and projection), so every opt level, gradient accumulation and checkpoint handles them as any FP8 weight; the
tokens are sorted by expert and go through the FP8 grouped GEMM (:class:`fp8.grouped_gemm.GroupedLinearFunction`)
once per projection. The router (the MoE block's ``gate``), the routing weights and the combine stay in the model's
precision. Its ``state_dict`` is transformers' layout: ``gate_up_proj`` and ``down_proj`` fused, dequantized to the
model's dtype (loading one re-quantizes), so checkpoints load into the unconverted model.

transformers is not imported: the experts are recognised by class name (:data:`KNOWN_EXPERTS`, whose forward this
module reproduces) and checked by shape (:func:`experts_problem`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .grouped_gemm import GroupedLinearFunction
from .linear import Float8LinearConfig, fp8_dims_problem
from .scaling import ScalingState
from .tensor import Float8Tensor

__all__ = ["Float8Experts", "ExpertWeight", "KNOWN_EXPERTS", "is_fused_experts", "experts_problem"]

KNOWN_EXPERTS = ("MixtralExperts", "Qwen2MoeExperts", "Qwen3MoeExperts")
"""transformers experts classes whose forward :meth:`Float8Experts.forward` reproduces (transformers 5.x: top-k
routing, ``act_fn(gate) * up``, ``down``, weighted by the routing weights, summed per token; index ``num_experts``
is a dropped slot)."""

FUSED = ("gate_up_proj", "down_proj")


def is_fused_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds fused 3-D expert weights (a ``gate_up_proj`` 3-D Parameter): a transformers MoE
    experts module, known to fp8 or not."""
    weight = getattr(module, "gate_up_proj", None)
    return isinstance(weight, nn.Parameter) and weight.dim() == 3


def experts_problem(module: nn.Module) -> str | None:
    """Why ``module`` (:func:`is_fused_experts`) cannot become a :class:`Float8Experts`, or None if it can."""
    name = type(module).__name__
    if name not in KNOWN_EXPERTS:
        return (f"experts module {name} is not one whose forward fp8 reproduces ({', '.join(KNOWN_EXPERTS)}); "
                f"its fused 3-D expert weights stay in high precision")
    own = {n for n, _ in module.named_parameters(recurse=False)}
    if own != set(FUSED) or getattr(module, "is_transposed", False) or getattr(module, "has_bias", False):
        return f"experts module {name} holds {sorted(own)} (biases or a transposed layout), not {list(FUSED)}"
    e, two_i, h = module.gate_up_proj.shape
    if module.down_proj.shape != (e, h, two_i // 2) or two_i % 2 or e != getattr(module, "num_experts", e):
        return (f"experts module {name}: gate_up_proj {tuple(module.gate_up_proj.shape)} and down_proj "
                f"{tuple(module.down_proj.shape)} are not (E, 2I, H) and (E, H, I)")
    if not module.gate_up_proj.is_floating_point():
        return f"expert weight dtype {module.gate_up_proj.dtype} is not floating point"
    return fp8_dims_problem(h, two_i) or fp8_dims_problem(two_i // 2, h)


class ExpertWeight(nn.Module):
    """One expert's projection: ``weight``, an FP8 (out x in) parameter (a module, so the weight has a name and a
    place in the converted model like a :class:`fp8.Float8Linear`'s)."""

    def __init__(self, weight: Float8Tensor, requires_grad: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=requires_grad)


def _projection_states(config: Float8LinearConfig, device) -> tuple[ScalingState, ScalingState]:
    return ScalingState(config.input, device=device), ScalingState(config.grad_output, device=device)


class Float8Experts(nn.Module):
    """Drop-in for a transformers experts module (:data:`KNOWN_EXPERTS`) with FP8 expert weights and FP8 grouped GEMMs
    (module docstring). Build it with :meth:`from_experts`."""

    def __init__(self, source: nn.Module, config: Float8LinearConfig, gate_up: list[torch.Tensor],
                 down: list[torch.Tensor], requires_grad: bool = True) -> None:
        super().__init__()
        self.source_type = type(source).__name__
        self.num_experts, self.hidden_dim, self.intermediate_dim = len(gate_up), source.hidden_dim, source.intermediate_dim
        self.act_fn = source.act_fn
        self.config = config
        self.model_dtype = source.gate_up_proj.dtype
        self.gate_up = nn.ModuleList(ExpertWeight(config.quantize_weight(w), requires_grad) for w in gate_up)
        self.down = nn.ModuleList(ExpertWeight(config.quantize_weight(w), requires_grad) for w in down)
        device = source.gate_up_proj.device
        self.gate_up_input_scaling, self.gate_up_grad_output_scaling = _projection_states(config, device)
        self.down_input_scaling, self.down_grad_output_scaling = _projection_states(config, device)
        self.register_state_dict_post_hook(_fused_state_dict)
        self.register_load_state_dict_pre_hook(_split_fused_state)

    @classmethod
    def from_experts(cls, experts: nn.Module, config: Float8LinearConfig | None = None
                     ) -> tuple["Float8Experts", list[nn.Parameter]]:
        """``(Float8Experts, masters)`` for a transformers experts module: ``masters`` are new high-precision
        Parameters, one per expert projection (all ``gate_up`` then all ``down``, each (out x in), copies of the
        fused slices), which the optimizer steps in place of the fused 3-D parameters."""
        problem = experts_problem(experts)
        if problem:
            raise ValueError(f"Float8Experts.from_experts: {problem}")
        config = config or Float8LinearConfig()
        if not config.recipe_spec.tensorwise:
            raise ValueError(f"Float8Experts: the FP8 grouped GEMM runs the tensorwise recipe, not {config.recipe!r}")
        requires_grad = experts.gate_up_proj.requires_grad
        masters = [nn.Parameter(w.detach().clone(), requires_grad=requires_grad)
                   for fused in (experts.gate_up_proj, experts.down_proj) for w in fused.unbind(0)]
        e = experts.gate_up_proj.shape[0]
        new = cls(experts, config, masters[:e], masters[e:], requires_grad)
        return new, masters

    def expert_weights(self) -> list[nn.Parameter]:
        """The FP8 parameters in the order of :meth:`from_experts`' masters."""
        return [m.weight for m in self.gate_up] + [m.weight for m in self.down]

    def fused_weights(self, value_of: Callable[[nn.Parameter], torch.Tensor] | None = None,
                      dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """``{"gate_up_proj": (E, 2I, H), "down_proj": (E, H, I)}`` in ``dtype`` (default: the model's), transformers'
        layout; each expert's values from ``value_of(fp8_param)`` (e.g. its master), else its dequantized weight."""
        def value(p: nn.Parameter) -> torch.Tensor:
            v = value_of(p) if value_of is not None else None
            return (p.dequantize(torch.float32) if v is None else v).detach()

        dtype = dtype or self.model_dtype
        return {name: torch.stack([value(m.weight) for m in modules]).to(dtype)
                for name, modules in (("gate_up_proj", self.gate_up), ("down_proj", self.down))}

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        n_experts, top_k = self.num_experts, top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots sorted by expert; dropped slots (index E) last
        counts = torch.bincount(flat, minlength=n_experts + 1)[:n_experts]
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        # The one host read of this layer: the per-expert token counts, to slice the groups (module docstring of
        # fp8.grouped_gemm); every GEMM of the forward and backward reuses them.
        sizes = counts.tolist()
        order = order[:sum(sizes)]
        token_idx, slot = order // top_k, order % top_k
        record = torch.is_grad_enabled()
        dtype = hidden_states.dtype
        x = hidden_states[token_idx]
        h = GroupedLinearFunction.apply(x, offsets, sizes, self.gate_up_input_scaling, self.gate_up_grad_output_scaling,
                                        self.config, record, dtype, *(m.weight for m in self.gate_up))
        gate, up = h.chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        y = GroupedLinearFunction.apply(h, offsets, sizes, self.down_input_scaling, self.down_grad_output_scaling,
                                        self.config, record, dtype, *(m.weight for m in self.down))
        y = y * top_k_weights[token_idx, slot, None]
        return torch.zeros_like(hidden_states).index_add_(0, token_idx, y.to(dtype))

    def extra_repr(self) -> str:
        return (f"{self.source_type}: num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, "
                f"intermediate_dim={self.intermediate_dim}, weight={self.config.weight_fmt} (one scale per expert), "
                f"grouped GEMM")


def _fused_state_dict(module: Float8Experts, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict post-hook: the per-expert FP8 weights written as transformers' fused ``gate_up_proj``/``down_proj``."""
    for name in ("gate_up.", "down."):
        for key in [k for k in state_dict if k.startswith(prefix + name)]:
            del state_dict[key]
    for name, value in module.fused_weights().items():
        state_dict[prefix + name] = value


def _split_fused_state(module: Float8Experts, state_dict: dict, prefix: str, local_metadata, strict, missing_keys,
                       unexpected_keys, error_msgs) -> None:
    """Load pre-hook: fused ``gate_up_proj``/``down_proj`` split into the per-expert weights (re-quantized on copy)."""
    for name, modules in (("gate_up_proj", module.gate_up), ("down_proj", module.down)):
        fused = state_dict.pop(prefix + name, None)
        if fused is None:
            continue
        if fused.shape[0] != len(modules):
            error_msgs.append(f"{prefix}{name}: {fused.shape[0]} experts in the checkpoint, {len(modules)} in the model")
            continue
        short = "gate_up" if name == "gate_up_proj" else "down"
        for e, value in enumerate(fused.unbind(0)):
            state_dict[f"{prefix}{short}.{e}.weight"] = value
