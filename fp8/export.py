"""FP8 weights from training to serving: export the E4M3 weights a model trained with in the formats serving engines
load (vLLM, SGLang, transformers), and import such checkpoints back into an FP8 model, without dequantizing.

Two formats (docs/serving.md):

- ``"compressed-tensors"``: the ``float-quantized`` format of Neural Magic's compressed-tensors (vLLM, SGLang,
  transformers with the ``compressed-tensors`` package): each FP8 linear's ``weight`` in E4M3 beside ``weight_scale``,
  the dequantization multiplier (``value = weight * weight_scale``), per tensor (``strategy: tensor``, shape ``(1,)``)
  from the ``tensorwise`` recipe, per output channel (``channel``, ``(out, 1)``) from ``rowwise``, per 128x128 block
  (``block``, the grid) from ``blockwise``; activations quantized dynamically at serving time (per token; per 1x128
  group beside block weights).
- ``"fp8-block"``: DeepSeek-V3's fine-grained format (transformers' ``FineGrainedFP8Config``, vLLM's ``fp8`` method
  with ``weight_block_size``): E4M3 ``weight`` and an fp32 ``weight_scale_inv`` per 128x128 block (``value = weight *
  weight_scale_inv`` of its block), ``quant_method: fp8``, ``weight_block_size: [128, 128]``, dynamic activations.

fp8lm holds ``payload = cast(value * scale)`` with power-of-two scales, so the serving multiplier ``1 / scale`` is
exact and the exported E4M3 bytes are the model's own wherever the format has the layout the weight is held in:
tensorwise and blockwise weights in both formats (a tensor-wise scale is written to every block of the grid), rowwise
weights in compressed-tensors. A rowwise weight in ``fp8-block`` takes one scale per 128x128 block: it is
re-quantized from its exact values (each block's power-of-two scale from its amax, a multiple of 2 of its rows'
scales, so only values that fall below E4M3's normal range in their new block lose bits); :class:`ExportReport`
lists every re-quantized weight with its measured error. Other weight layouts (``mxfp8``, ``nvfp4``, E5M2 weights) are
re-quantized the same way (per output channel in compressed-tensors, per block in ``fp8-block``).

Everything else (embeddings, norms, the output layer, linears kept in high precision by rules or by size) is written in
the model's dtype and listed as not quantized (``ignore`` / ``modules_to_not_convert``); FP8 embeddings are written
dequantized (exact in bf16). The FP8 scaling state (amax histories) is not written.

:func:`import_fp8` loads such a checkpoint (written by :func:`export_fp8` or another tool) into a model returned by
:func:`fp8.initialize` at O1/O2/O3: each FP8 weight takes the file's E4M3 payload and scales directly where its recipe
holds that layout (a tensor-wise scale serves a rowwise or blockwise weight too), and the optimizer's masters take the
exact values, so exporting again writes the same bytes. A scale that is not a power of two (other tools write
``amax / 448``) is kept as its fp32 reciprocal with the payload: each value within 3 fp32 roundings of the file's.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .blocks import BLOCK, ROWWISE, block_size, dequantize_blocks, expand_scales, grid_shape, is_tensorwise
from .blocks import quantize_to_blocks
from .distributed.sharding import is_dtensor, local
from .linear import Float8Linear
from .moe import Float8Experts, is_fused_experts
from .optim.base import FP8Optimizer
from .optim.master_weights import MasterWeightOptimizer
from .scaling import ScalingState
from .tensor import Float8Tensor

__all__ = ["FORMATS", "SERVING_BLOCK", "ServingWeight", "ExportReport", "ImportReport", "serving_weight",
           "quantization_config", "model_dtype", "atomic_write", "write_fp8_checkpoint", "export_problem", "export_fp8", "import_fp8", "read_fp8_checkpoint"]

FORMATS = ("compressed-tensors", "fp8-block")
"""The serving formats :func:`export_fp8` writes and :func:`import_fp8` reads."""

SERVING_BLOCK = 128
"""The block edge of the ``fp8-block`` format and of compressed-tensors' ``block`` strategy (DeepSeek-V3's)."""

EXPERT_LAYOUTS = {
    "MixtralExperts": ("block_sparse_moe", ("w1", "w3", "w2")),
    "Qwen2MoeExperts": (None, ("gate_proj", "up_proj", "down_proj")),
    "Qwen3MoeExperts": (None, ("gate_proj", "up_proj", "down_proj")),
}
"""The checkpoint layout serving engines read for each transformers experts class (the one transformers'
``save_pretrained`` writes): the MoE block's name in the checkpoint (Mixtral's ``block_sparse_moe``, where the model
says ``mlp``; None: unchanged) and each expert's gate, up and down projection names (``{experts}.{e}.{proj}.weight``)."""

_E4M3 = torch.float8_e4m3fn
_SAFETENSORS_FILE = "model.safetensors"
_INDEX_FILE = "model.safetensors.index.json"


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")


@dataclass(frozen=True)
class ServingWeight:
    """One linear's weight as a serving format holds it: the E4M3 ``payload`` ``(out, in)`` and ``scale_inv``, the fp32
    dequantization multipliers (``value = payload * scale_inv`` of its block) in ``strategy``'s layout: ``"tensor"``
    (shape ``(1,)``), ``"channel"`` (``(out, 1)``) or ``"block"`` (``(ceil(out / 128), ceil(in / 128))``).
    ``requantized``: False when the payload is the weight's own bytes; True when it was re-quantized into the strategy's
    blocks, then ``error`` is the largest absolute change of a value over the weight's largest magnitude and
    ``changed`` the number of values changed (0 when every value survived)."""

    payload: torch.Tensor
    scale_inv: torch.Tensor
    strategy: str
    requantized: bool = False
    error: float = 0.0
    changed: int = 0

    @property
    def exact(self) -> bool:
        """Whether every value is the weight's own (its bytes, or re-quantized without a change)."""
        return self.changed == 0


def _strategy_block(strategy: str) -> tuple[int, int] | None:
    return {"tensor": None, "channel": ROWWISE, "block": (SERVING_BLOCK, SERVING_BLOCK)}[strategy]


def _per_element(scale: torch.Tensor, held, shape: tuple[int, int]) -> torch.Tensor:
    """The scale of every element of a ``shape`` weight whose scales ``scale`` are held in blocks ``held``."""
    if is_tensorwise(held):
        return scale.reshape(1, 1).expand(shape)
    return expand_scales(scale, (int(held[0]), int(held[1])), shape)


def _grid_of(scale: torch.Tensor, held, shape: tuple[int, int], strategy: str) -> torch.Tensor | None:
    """``scale`` (a weight's scales, held in blocks ``held``) as ``strategy``'s grid when each block of the strategy
    has one scale in it (then the payload serves unchanged), else None."""
    if strategy == "tensor" or is_tensorwise(held):
        if not is_tensorwise(held) and not bool((scale == scale.reshape(-1)[:1]).all()):
            return None
        one = scale.reshape(-1)[:1].contiguous()
        return one if strategy == "tensor" else one.reshape(1, 1).expand(
            grid_shape(_strategy_block(strategy), shape)).contiguous()
    block = _strategy_block(strategy)
    per_element = _per_element(scale, held, shape)
    rows, cols = block_size(block, shape)
    firsts = per_element[::rows, ::cols]
    if torch.equal(expand_scales(firsts, block, shape), per_element):
        return firsts.contiguous()
    return None


def serving_weight(weight: Float8Tensor | torch.Tensor, strategy: str) -> ServingWeight:
    """``weight`` (an FP8 weight as a recipe holds it at rest) in a serving ``strategy`` (:class:`ServingWeight`):
    its own payload, the multipliers ``1 / scale`` (exact: power-of-two scales), where the strategy's blocks each have
    one of its scales; otherwise re-quantized to E4M3 with one power-of-two scale per block of the strategy from its
    exact values, the error measured."""
    if strategy not in ("tensor", "channel", "block"):
        raise ValueError(f"strategy must be 'tensor', 'channel' or 'block', got {strategy!r}")
    if weight.dim() != 2:
        raise ValueError(f"a serving weight is 2-D (out_features, in_features), got shape {tuple(weight.shape)}")
    shape = (int(weight.shape[0]), int(weight.shape[1]))
    if isinstance(weight, Float8Tensor) and weight.payload.dtype == _E4M3:
        grid = _grid_of(weight.scale, weight.block, shape, strategy)
        if grid is not None:
            scale_inv = grid.reciprocal()
            if torch.equal(scale_inv.reciprocal(), grid):  # power-of-two scales: the multipliers are exact
                return ServingWeight(weight.payload.contiguous(), scale_inv, strategy)
    value = weight.dequantize(torch.float32) if isinstance(weight, Float8Tensor) else weight.detach().float()
    block = _strategy_block(strategy) or (0, 0)
    payload, scale = quantize_to_blocks(value, block, "e4m3")
    scale_inv = scale.reciprocal()
    if strategy == "tensor":
        scale_inv = scale_inv.reshape(1)
    served = dequantize_blocks(payload, scale, block)
    diff = (served - value).abs()
    amax = value.abs().max() if value.numel() else torch.zeros(())
    error = float(diff.max() / amax) if value.numel() and float(amax) > 0 else 0.0
    changed = int((diff > 0).sum())
    return ServingWeight(payload, scale_inv, strategy, requantized=True, error=error, changed=changed)


def _format_strategy(format: str, weight: torch.Tensor) -> str:
    """The strategy ``format`` writes ``weight`` in: compressed-tensors follows the recipe's layout (tensor, channel,
    block; others per channel), ``fp8-block`` is always ``block``."""
    if format == "fp8-block":
        return "block"
    block = weight.block if isinstance(weight, Float8Tensor) else ROWWISE
    if is_tensorwise(block):
        return "tensor"
    if tuple(block) == BLOCK:
        return "block"
    return "channel"


@dataclass
class ExportReport:
    """What :func:`export_fp8` wrote: the ``directory``, its ``files``, ``bytes_on_disk`` (the safetensors files),
    the FP8 linears (``fp8_weights``: name -> strategy), ``payload_bytes`` and ``scale_bytes`` of their E4M3 weights
    and multipliers, ``high_precision`` (the other tensors' names, in ``dtype``) and their bytes, ``ignored`` (linears
    left in high precision, as the config lists them), ``requantized`` (the FP8 weights whose bytes are not the trained
    ones: name -> (largest change over the weight's amax, values changed)), ``dequantized`` (FP8 layers written in high
    precision with their exact values, as serving engines hold them: :func:`export_fp8`) and ``parameters`` (elements
    written)."""

    directory: Path
    format: str
    files: list[str] = field(default_factory=list)
    bytes_on_disk: int = 0
    fp8_weights: dict[str, str] = field(default_factory=dict)
    payload_bytes: int = 0
    scale_bytes: int = 0
    high_precision: list[str] = field(default_factory=list)
    high_precision_bytes: int = 0
    ignored: list[str] = field(default_factory=list)
    requantized: dict[str, tuple[float, int]] = field(default_factory=dict)
    dequantized: list[str] = field(default_factory=list)
    parameters: int = 0

    @property
    def bytes_per_parameter(self) -> float:
        """Bytes on disk over the parameters written."""
        return self.bytes_on_disk / max(self.parameters, 1)


def _linears(model: nn.Module) -> tuple[dict[str, Float8Linear], list[str]]:
    """``(FP8 linears by name, names of the high-precision nn.Linear modules)``; refuses what cannot be exported."""
    fp8, plain = {}, []
    for name, module in model.named_modules():
        if isinstance(module, Float8Experts) or is_fused_experts(module):
            kind = module.source_type if isinstance(module, Float8Experts) else type(module).__name__
            if kind not in EXPERT_LAYOUTS:
                raise ValueError(f"{name}: experts module {kind} has no known serving layout (known: "
                                 f"{', '.join(EXPERT_LAYOUTS)})")
            if is_dtensor(next(module.parameters())):
                raise ValueError(f"{name}: the model is sharded (FSDP2 DTensor weights); export from one process")
        if isinstance(module, Float8Linear):
            if is_dtensor(module.weight):
                raise ValueError(f"{name}: the model is sharded (FSDP2 DTensor weights); export from one process: "
                                 "save with fp8.checkpoint, load it into the unsharded model, then export")
            fp8[name] = module
        elif isinstance(module, nn.Linear):
            plain.append(name)
    if not fp8 and not any(isinstance(m, Float8Experts) for m in model.modules()):
        raise ValueError("the model holds no FP8 linear (fp8.Float8Linear): call fp8.initialize(model, optimizer, "
                         "'O1'|'O2'|'O3') first; a model trained in high precision is exported with save_pretrained")
    return fp8, plain


def export_problem(model: nn.Module) -> str | None:
    """Why :func:`export_fp8` would refuse ``model`` (no FP8 layer, Conv1D-converted linears, a sharded model, experts
    without a known layout), naming the fix, or None: for callers that check before training."""
    try:
        fp8_linears, _ = _linears(model)
    except ValueError as error:
        return str(error)
    conv = sorted(n for n, m in fp8_linears.items() if getattr(m, "stored_transposed", False))
    if conv:
        return (f"{conv[0]} (and {len(conv) - 1} more) were transformers Conv1D layers (GPT-2's (in, out) weights): no "
                "serving format loads them as FP8 linears; write the high-precision export for this architecture")
    return None


def quantization_config(format: str, strategies: dict[str, str], ignored: list[str]) -> dict:
    """``config.json``'s ``quantization_config`` for ``format``: ``strategies`` maps each FP8 linear's name to its
    strategy, ``ignored`` lists the linears left in high precision."""
    _check_format(format)
    if format == "fp8-block":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [SERVING_BLOCK, SERVING_BLOCK], "modules_to_not_convert": list(ignored),
                "ignored_layers": list(ignored)}
    groups: dict[str, list[str]] = {}
    for name, strategy in strategies.items():
        groups.setdefault(strategy, []).append(name)
    config_groups = {}
    for i, (strategy, names) in enumerate(sorted(groups.items())):
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
                   "group_size": None, "block_structure": [SERVING_BLOCK, SERVING_BLOCK] if strategy == "block" else None,
                   "actorder": None, "observer": "minmax", "observer_kwargs": {}}
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "observer": None,
                       "observer_kwargs": {}, "actorder": None, "block_structure": None,
                       "strategy": "group" if strategy == "block" else "token",
                       "group_size": SERVING_BLOCK if strategy == "block" else None}
        # One strategy: every Linear but the ignored ones; several: each group names its layers exactly.
        targets = ["Linear"] if len(groups) == 1 else [f"re:^{re.escape(n)}$" for n in names]
        config_groups[f"group_{i}"] = {"targets": targets, "weights": weights, "input_activations": activations,
                                       "output_activations": None, "format": "float-quantized"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": config_groups, "ignore": list(ignored), "kv_cache_scheme": None,
            "sparsity_config": {}, "transform_config": {}}


def model_dtype(model: nn.Module) -> torch.dtype:
    """The most common dtype of ``model``'s high-precision floating parameters (FP8 weights report fp32 whatever the
    model's dtype, so they are not counted; FSDP2 shards by their local tensors); float32 if there are none: the dtype
    high-precision tensors are written in by default (here and :func:`fp8.integrations.transformers.high_precision_state_dict`)."""
    counts = Counter(p.dtype for p in model.parameters()
                     if not isinstance(local(p), Float8Tensor) and p.is_floating_point())
    return counts.most_common(1)[0][0] if counts else torch.float32


def _config_dict(config) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return dict(config)
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(f"config must be a transformers PretrainedConfig, a dict or None, got {type(config).__name__}")


def atomic_write(path: Path, write) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, then renamed onto it (no half-written file is ever
    ``path``), with the permissions a new file gets under the umask (safetensors writes 0600)."""
    tmp = path.with_name(f".{path.name}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_safetensors(directory: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int,
                       metadata: dict[str, str]) -> list[str]:
    """``tensors`` in one ``model.safetensors`` or, above ``max_shard_bytes``, in ``model-0000i-of-0000n.safetensors``
    shards with transformers' ``model.safetensors.index.json``. Returns the files written."""
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    for stale in [directory / _INDEX_FILE, *directory.glob("model-*-of-*.safetensors"), directory / _SAFETENSORS_FILE]:
        stale.unlink(missing_ok=True)  # a previous export's files would shadow or mix with this one's
    if len(shards) == 1:
        atomic_write(directory / _SAFETENSORS_FILE, lambda p: save_file(shards[0], str(p), metadata=metadata))
        return [_SAFETENSORS_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        atomic_write(directory / name, lambda p, s=shard: save_file(s, str(p), metadata=metadata))
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write(directory / _INDEX_FILE, lambda p: p.write_text(json.dumps(index, indent=2) + "\n"))
    return names + [_INDEX_FILE]


def write_fp8_checkpoint(directory: str | os.PathLike, format: str, weights: dict[str, ServingWeight],
                         high_precision: dict[str, torch.Tensor], ignored: list[str], config: dict | None = None,
                         tokenizer=None, max_shard_bytes: int = 5 * 2**30) -> ExportReport:
    """Write a serving checkpoint: ``weights`` (linear name -> :class:`ServingWeight`: ``{name}.weight`` and its
    ``weight_scale`` / ``weight_scale_inv``), the ``high_precision`` tensors as given, ``config.json`` (``config`` with
    ``format``'s ``quantization_config``, ``ignored`` the linears left in high precision) and the ``tokenizer``
    (``save_pretrained``). :func:`export_fp8` and ``tools/convert_checkpoint.py --quantization fp8`` write through it."""
    _check_format(format)
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{str(directory)!r} is a file: an FP8 export is a directory (config.json, "
                         "model.safetensors): name a directory")
    scale_suffix = "_scale_inv" if format == "fp8-block" else "_scale"
    report = ExportReport(directory=directory, format=format, ignored=list(ignored))
    tensors: dict[str, torch.Tensor] = {}
    for name, served in weights.items():
        if format == "fp8-block" and served.strategy != "block":
            raise ValueError(f"{name}: the fp8-block format holds 128x128 block scales, got {served.strategy!r}")
        key = f"{name}.weight"
        tensors[key] = served.payload.contiguous()
        tensors[key + scale_suffix] = served.scale_inv.to(torch.float32).contiguous()
        report.fp8_weights[name] = served.strategy
        report.payload_bytes += served.payload.numel()
        report.scale_bytes += served.scale_inv.numel() * 4
        report.parameters += served.payload.numel()
        if served.requantized:
            report.requantized[name] = (served.error, served.changed)
    for key, value in high_precision.items():
        tensors[key] = value.contiguous()
        report.high_precision.append(key)
        report.high_precision_bytes += value.numel() * value.element_size()
        report.parameters += value.numel()
    config = dict(config or {})
    config["quantization_config"] = quantization_config(format, report.fp8_weights, report.ignored)
    directory.mkdir(parents=True, exist_ok=True)
    report.files = _write_safetensors(directory, tensors, max_shard_bytes,
                                      {"format": "pt", "producer": "fp8lm", "fp8lm_format": format})
    atomic_write(directory / "config.json",
                  lambda p: p.write_text(json.dumps(config, indent=2, sort_keys=True, default=str) + "\n"))
    report.files.append("config.json")
    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    report.bytes_on_disk = sum((directory / f).stat().st_size for f in report.files if f.endswith(".safetensors"))
    return report


FUSED_SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("w1", "w3"))
"""Linears serving engines fuse into one (vLLM's ``qkv_proj``, ``gate_up_proj``, Mixtral's ``w13``): siblings under one
parent module with these names must share one precision and one scale strategy."""


def _fused_groups(names) -> list[list[str]]:
    """The groups of :data:`FUSED_SIBLINGS` among module ``names`` (two members or more)."""
    groups: dict[tuple[str, int], list[str]] = {}
    for name in sorted(names):
        parent, _, leaf = name.rpartition(".")
        for i, siblings in enumerate(FUSED_SIBLINGS):
            if leaf in siblings:
                groups.setdefault((parent, i), []).append(name)
    return [g for g in groups.values() if len(g) > 1]


def _group_strategies(format: str, weights: dict[str, torch.Tensor], groups: list[list[str]]) -> dict[str, str]:
    """Each FP8 weight's strategy: its recipe's layout (:func:`_format_strategy`), made one per fused group: the one
    that re-quantizes the fewest of the group's weights (a tensor-wise scale written to every block or row of its
    group's finer layout is exact), the finer on a tie."""
    out = {name: _format_strategy(format, w) for name, w in weights.items()}
    for group in groups:
        members = [n for n in group if n in weights]
        if len({out[n] for n in members}) > 1:
            order = ("block", "channel", "tensor")
            best = min(order, key=lambda s: (sum(serving_weight(weights[n], s).requantized for n in members),
                                             order.index(s)))
            out.update({n: best for n in members})
    return out


def _output_layer(model: nn.Module) -> str | None:
    """The name of ``model``'s output layer (transformers' ``get_output_embeddings()``), or None."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return next((name for name, m in model.named_modules() if m is head), None) if head is not None else None


@torch.no_grad()
def export_fp8(model: nn.Module, directory: str | os.PathLike, format: str = "compressed-tensors", *, config=None,
               tokenizer=None, dtype: torch.dtype | None = None, conv1d: Iterable[str] = (),
               max_shard_bytes: int = 5 * 2**30) -> ExportReport:
    """Write ``model`` (returned by :func:`fp8.initialize`; trained) to ``directory`` in a serving ``format``
    (:data:`FORMATS`, module docstring): ``model.safetensors`` (or shards above ``max_shard_bytes`` with their
    index) holding each FP8 linear's E4M3 weight and scales as it trained with, every other parameter and persistent
    buffer in ``dtype`` (default: the model's), and ``config.json``: ``config`` (a transformers ``PretrainedConfig`` or
    a dict; default the model's ``config`` attribute, as transformers models have) with the ``quantization_config``
    serving engines read and ``dtype``. ``tokenizer``: saved beside it (``save_pretrained``). Returns an
    :class:`ExportReport` (bytes, strategies, what was re-quantized or dequantized).

    What serving engines hold in high precision is written so, with its exact values (``report.dequantized``): the
    output layer (vLLM's LM head is not a quantized linear), and the FP8 members of a fused group (q/k/v, gate/up:
    :data:`FUSED_SIBLINGS`) whose other members trained in high precision. Fused members in FP8 share one strategy.

    transformers models load the directory with ``AutoModelForCausalLM.from_pretrained`` (``compressed-tensors``
    needs the ``compressed-tensors`` package), vLLM and SGLang serve it. Refused, naming the fix: a model without FP8
    linears, a sharded (FSDP2) model, experts of a class without a known layout (:data:`EXPERT_LAYOUTS`), linears
    converted from transformers ``Conv1D`` (GPT-2's layout has no FP8 serving format; ``conv1d`` names more of them),
    an unknown format."""
    _check_format(format)
    fp8_linears, plain = _linears(model)
    conv = sorted((set(conv1d) & set(fp8_linears)) | {n for n, m in fp8_linears.items()
                                                       if getattr(m, "stored_transposed", False)})
    if conv:
        raise ValueError(f"{conv[0]} (and {len(conv) - 1} more) were transformers Conv1D layers (GPT-2's (in, out) "
                         "weights): no serving format loads them as FP8 linears; write the high-precision export "
                         "(save_model / high_precision_state_dict) for this architecture")
    config_dict = _config_dict(config if config is not None else getattr(model, "config", None))
    dtype = dtype or model_dtype(model)
    scaling = [name + "." for name, module in model.named_modules() if isinstance(module, ScalingState)]
    fp8_keys = {f"{name}.weight" for name in fp8_linears}
    candidates: dict[str, torch.Tensor] = {name: m.weight for name, m in fp8_linears.items()}
    high: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()
    experts = {name: m for name, m in model.named_modules() if isinstance(m, Float8Experts) or is_fused_experts(m)}
    fused_keys = {f"{name}.{p}" for name in experts for p in ("gate_up_proj", "down_proj")}
    expert_ignored: list[str] = []
    for name, module in experts.items():  # per expert, in the layout serving engines read
        fp8_parts, hp_parts = _expert_weights(name, module, dtype)
        candidates.update(fp8_parts)
        high.update(hp_parts)
        expert_ignored += [k.removesuffix(".weight") for k in hp_parts]
    for key, value in model.state_dict(keep_vars=True).items():
        if any(key.startswith(prefix) for prefix in scaling) or key in fused_keys or key in fp8_keys:
            continue
        if isinstance(value, Float8Tensor):  # FP8 embeddings: dequantized (E4M3 values are exact in bf16 and fp32)
            value = value.dequantize(dtype)
        tied = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if value.numel() and tied in seen:  # a tied weight (lm_head = embeddings): written once, as save_pretrained
            continue
        seen.add(tied)
        value = value.detach()
        high[key] = value.to(dtype) if value.is_floating_point() else value
    dequantized = []
    output = _output_layer(model)
    mixed = [n for g in _fused_groups(set(candidates) | set(plain)) if any(m not in candidates for m in g)
             for n in g if n in candidates]
    for name in ([output] if output in candidates else []) + mixed:  # served in high precision: exact values
        high[f"{name}.weight"] = candidates.pop(name).dequantize(dtype)
        dequantized.append(name)
    strategies = _group_strategies(format, candidates, _fused_groups(candidates))
    weights = {name: serving_weight(w, strategies[name]) for name, w in candidates.items()}
    ignored = [name for name in plain if f"{name}.weight" in high or _is_tied(model, f"{name}.weight")]
    routers = [f"{name.rsplit('.', 1)[0]}.gate" for name in experts if "." in name]
    ignored += dequantized + expert_ignored + [r for r in routers if f"{r}.weight" in high]  # routers: not nn.Linear
    renames = _block_renames(experts)
    if renames:
        weights = {_renamed(k, renames): v for k, v in weights.items()}
        high = {_renamed(k, renames): v for k, v in high.items()}
        ignored = [_renamed(k, renames) for k in ignored]
        dequantized = [_renamed(k, renames) for k in dequantized]
    if config_dict:
        config_dict["dtype"] = str(dtype).removeprefix("torch.")  # what the high-precision tensors are written in
        config_dict.pop("torch_dtype", None)
    report = write_fp8_checkpoint(directory, format, weights, high, ignored, config_dict, tokenizer, max_shard_bytes)
    report.dequantized = dequantized
    return report


def _expert_weights(name: str, module: nn.Module, dtype: torch.dtype
                    ) -> tuple[dict[str, Float8Tensor], dict[str, torch.Tensor]]:
    """One experts module's projections per expert (:data:`EXPERT_LAYOUTS`): ``{experts}.{e}.{proj}`` -> its FP8 weight
    (a :class:`fp8.Float8Experts`: each expert's gate and up rows keep their fused projection's tensor-wise scale, so
    both halves keep their bytes), or ``{experts}.{e}.{proj}.weight`` -> the high-precision weight in ``dtype``
    (experts left in high precision, listed as not quantized)."""
    kind = module.source_type if isinstance(module, Float8Experts) else type(module).__name__
    gate, up, down = EXPERT_LAYOUTS[kind][1]
    fp8_parts: dict[str, Float8Tensor] = {}
    hp_parts: dict[str, torch.Tensor] = {}
    if isinstance(module, Float8Experts):
        inter = module.intermediate_dim
        for e, (gate_up, down_weight) in enumerate(zip(module.gate_up, module.down)):
            w = gate_up.weight
            for proj, rows in ((gate, slice(0, inter)), (up, slice(inter, 2 * inter))):
                fp8_parts[f"{name}.{e}.{proj}"] = Float8Tensor(w.payload[rows].contiguous(), w.scale.clone(), w.dtype,
                                                               block=w.block)
            fp8_parts[f"{name}.{e}.{down}"] = down_weight.weight
        return fp8_parts, hp_parts
    inter = module.down_proj.shape[-1]
    for e, (gate_up, down_weight) in enumerate(zip(module.gate_up_proj.detach(), module.down_proj.detach())):
        hp_parts[f"{name}.{e}.{gate}.weight"] = gate_up[:inter].to(dtype).contiguous()
        hp_parts[f"{name}.{e}.{up}.weight"] = gate_up[inter:].to(dtype).contiguous()
        hp_parts[f"{name}.{e}.{down}.weight"] = down_weight.to(dtype).contiguous()
    return fp8_parts, hp_parts


def _block_renames(experts: dict[str, nn.Module]) -> list[tuple[str, str]]:
    """``(model prefix, checkpoint prefix)`` of each MoE block whose checkpoint name differs (Mixtral's
    ``...mlp.`` -> ``...block_sparse_moe.``)."""
    out = []
    for name, module in experts.items():
        kind = module.source_type if isinstance(module, Float8Experts) else type(module).__name__
        block_name = EXPERT_LAYOUTS[kind][0]
        if block_name and "." in name:
            block = name.rsplit(".", 1)[0]
            parent = block.rsplit(".", 1)[0] if "." in block else ""
            out.append((block + ".", (f"{parent}." if parent else "") + block_name + "."))
    return out


def _renamed(key: str, renames: list[tuple[str, str]]) -> str:
    for old, new in renames:
        if key.startswith(old) or key + "." == old:
            return new + key[len(old):]
    return key


# -- import ---------------------------------------------------------------------------------------------------------
def read_fp8_checkpoint(directory: str | os.PathLike) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(quantization_config, tensors)`` of a serving checkpoint directory (one ``model.safetensors`` or shards with
    their index); ``ValueError`` naming the fix for a directory without them or another quantization method."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{str(directory)!r} has no config.json: pass a directory written by fp8.export_fp8 or "
                         "another FP8 serving checkpoint (compressed-tensors float-quantized, or fp8 with "
                         "weight_block_size)")
    qc = json.loads(config_path.read_text()).get("quantization_config") or {}
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        if qc.get("format") not in ("float-quantized", "naive-quantized", None):
            raise ValueError(f"{config_path}: compressed-tensors format {qc.get('format')!r}; FP8 checkpoints are "
                             "'float-quantized'")
    elif method != "fp8":
        raise ValueError(f"{config_path}: quantization_config.quant_method is {method!r}; import_fp8 reads "
                         "'compressed-tensors' (float-quantized) and 'fp8' (block) checkpoints")
    index = directory / _INDEX_FILE
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / _SAFETENSORS_FILE).is_file():
        files = [_SAFETENSORS_FILE]
    else:
        raise ValueError(f"{str(directory)!r} has no {_SAFETENSORS_FILE} nor {_INDEX_FILE}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(directory / f)))
    return qc, tensors


def _file_weight(qc: dict, tensors: dict, key: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(payload, scale_inv, strategy)`` of the FP8 weight ``key`` in a read checkpoint."""
    payload = tensors[key]
    if payload.dtype != _E4M3:
        raise ValueError(f"{key}: stored as {payload.dtype}, not float8_e4m3fn")
    scale_key = key + ("_scale_inv" if qc.get("quant_method") == "fp8" else "_scale")
    if scale_key not in tensors:
        raise ValueError(f"{key}: no {scale_key} in the checkpoint")
    scale_inv = tensors[scale_key].to(torch.float32)
    out, inp = payload.shape
    if scale_inv.numel() == 1:
        return payload, scale_inv.reshape(1), "tensor"
    if tuple(scale_inv.shape) in ((out, 1), (out,)):
        return payload, scale_inv.reshape(out, 1), "channel"
    bs = qc.get("weight_block_size") or [SERVING_BLOCK, SERVING_BLOCK]
    if tuple(bs) != (SERVING_BLOCK, SERVING_BLOCK):
        raise ValueError(f"{key}: weight_block_size {bs}; import_fp8 reads 128x128 blocks")
    if tuple(scale_inv.shape) == grid_shape((SERVING_BLOCK, SERVING_BLOCK), (out, inp)):
        return payload, scale_inv, "block"
    raise ValueError(f"{scale_key}: shape {tuple(scale_inv.shape)} fits no layout of a {out}x{inp} weight "
                     "(per tensor, per output channel, 128x128 blocks)")


def _held_scale(scale_inv: torch.Tensor, strategy: str, held, shape: tuple[int, int]) -> torch.Tensor | None:
    """The weight's scale grid (blocks ``held``) from the file's multipliers when each held block has one of them in it,
    else None (the weight is then re-quantized)."""
    per_element = _multipliers(scale_inv, strategy, shape)
    if is_tensorwise(held):
        first = per_element[:1, :1].reshape(())
        return first.reciprocal() if bool((per_element == first).all()) else None
    rows, cols = block_size((int(held[0]), int(held[1])), shape)
    firsts = per_element[::rows, ::cols]
    if torch.equal(expand_scales(firsts, (rows, cols), shape), per_element):
        return firsts.reciprocal().contiguous()
    return None


@dataclass
class ImportReport:
    """What :func:`import_fp8` loaded: FP8 weights taken as stored (``exact``) or re-quantized into the recipe's
    layout (``requantized``: name -> reason), the high-precision tensors loaded (``high_precision``; among them
    ``dequantized``: FP8 in the file, exact values in a layer the model holds in high precision), and the masters
    set."""

    exact: list[str] = field(default_factory=list)
    requantized: dict[str, str] = field(default_factory=dict)
    high_precision: list[str] = field(default_factory=list)
    dequantized: list[str] = field(default_factory=list)
    masters: int = 0


def _set_masters(optimizer, model: nn.Module) -> int:
    """Every master of ``optimizer`` (O1's high-precision copies, O2/O3's FP16-with-scale masters) set to the exact
    value its model parameter holds now; returns how many."""
    inner = optimizer
    while inner is not None and not isinstance(inner, (MasterWeightOptimizer, FP8Optimizer)):
        inner = getattr(inner, "optimizer", None)
    if inner is None:
        raise TypeError(f"optimizer must be the one fp8.initialize returned (O1/O2/O3), got "
                        f"{type(optimizer).__name__}")
    count = 0
    if isinstance(inner, MasterWeightOptimizer):
        for master, weight in inner.pairs:
            master.copy_(weight.dequantize(master.dtype))
            count += 1
        return count
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state.get(p, {})
            if "master" in state:  # O3: the owner rank's parameters only
                inner.set_master(p, p.dequantize(torch.float32) if isinstance(p, Float8Tensor) else p.detach().float())
                count += 1
    return count


def _multipliers(scale_inv: torch.Tensor, strategy: str, shape: tuple[int, int]) -> torch.Tensor:
    """The multiplier of every element (``strategy`` ``"element"``: ``scale_inv`` already is)."""
    if strategy == "element":
        return scale_inv
    if strategy == "tensor":
        return scale_inv.reshape(()).expand(shape)
    return expand_scales(scale_inv, _strategy_block(strategy), shape)


def _exact_value(payload: torch.Tensor, scale_inv: torch.Tensor, strategy: str) -> torch.Tensor:
    """The fp32 value of a file's FP8 weight: payload times the multiplier of its block."""
    return payload.to(torch.float32) * _multipliers(scale_inv, strategy, tuple(payload.shape))


def _load_into(weight: Float8Tensor, payload: torch.Tensor, scale_inv: torch.Tensor, strategy: str) -> bool:
    """Write a file's FP8 weight (``payload``, multipliers ``scale_inv`` in ``strategy``'s layout) into ``weight``: its
    bytes and scales as stored when each block ``weight`` holds has one multiplier in it (True), else re-quantized from
    the exact values into ``weight``'s blocks (False)."""
    if tuple(payload.shape) != tuple(weight.shape):
        raise ValueError(f"shape {tuple(payload.shape)} in the checkpoint, {tuple(weight.shape)} in the model: build "
                         "the model with the checkpoint's config")
    scale_inv = scale_inv.to(weight.scale.device)
    scale = (_held_scale(scale_inv, strategy, weight.block, tuple(weight.shape))
             if weight.payload.dtype == _E4M3 else None)
    if scale is not None and tuple(scale.shape) == tuple(weight.scale.shape):
        weight.payload.copy_(payload)
        weight.scale.copy_(scale)
        return True
    weight.copy_(_exact_value(payload, scale_inv, strategy).to(weight.payload.device))  # re-quantized, current scales
    return False


def _stack_rows(parts: list[tuple[torch.Tensor, torch.Tensor, str]]) -> tuple[torch.Tensor, torch.Tensor, str]:
    """Gate and up projections of one expert, stacked into its fused ``gate_up`` rows, with the multiplier of every
    element (strategy ``"element"``): :func:`_load_into` keeps the bytes when one scale covers them all."""
    payload = torch.cat([p for p, _, _ in parts])
    return payload, torch.cat([_multipliers(inv, st, tuple(p.shape)) for p, inv, st in parts]), "element"


@torch.no_grad()
def import_fp8(model: nn.Module, directory: str | os.PathLike, optimizer=None, *, strict: bool = True) -> ImportReport:
    """Load a serving checkpoint (:func:`export_fp8`'s, or another tool's compressed-tensors ``float-quantized`` /
    ``fp8`` block checkpoint) into ``model``, returned by :func:`fp8.initialize`, without a dequantize/requantize
    round trip (module docstring): each FP8 linear's (and FP8 expert projection's) E4M3 payload and scales as stored
    where its recipe holds that layout, else re-quantized from the exact values into it (listed in the report); every
    other tensor of the model from the file (cast to its dtype; MoE experts read per expert in the checkpoint layout,
    :data:`EXPERT_LAYOUTS`). A layer the model holds in high precision (a high-precision model, e.g. the ``none``
    baseline or a model about to be frozen, or a layer kept out of FP8) takes the exact values of an FP8 weight
    (``report.dequantized``). ``optimizer`` (the one :func:`fp8.initialize` returned): its masters take the loaded values
    exactly (moments are left as they are: fresh for fine-tuning). ``strict``: a tensor of the model missing from the
    file, or one of the file's unused, is a ``ValueError`` naming them."""
    qc, tensors = read_fp8_checkpoint(directory)
    fp8_linears = {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}
    experts = {name: m for name, m in model.named_modules() if isinstance(m, Float8Experts) or is_fused_experts(m)}
    renames = _block_renames(experts)
    scaling = [name + "." for name, module in model.named_modules() if isinstance(module, ScalingState)]
    report = ImportReport()
    used: set[str] = set()
    missing: list[str] = []

    def fp8_weight(key: str) -> tuple[torch.Tensor, torch.Tensor, str] | None:
        if key not in tensors:
            missing.append(key)
            return None
        used.update({key, key + "_scale", key + "_scale_inv", key.removesuffix("weight") + "input_scale"})
        return _file_weight(qc, tensors, key)

    def value_of(key: str) -> torch.Tensor:
        """A high-precision target's value: the tensor, or an FP8 weight's exact values (``key`` in ``tensors``)."""
        if tensors[key].dtype != _E4M3:
            used.add(key)
            return tensors[key]
        report.dequantized.append(key)
        return _exact_value(*fp8_weight(key))

    fused_keys = set()
    for name, module in experts.items():
        kind = module.source_type if isinstance(module, Float8Experts) else type(module).__name__
        if kind not in EXPERT_LAYOUTS:
            raise ValueError(f"{name}: experts module {kind} has no known checkpoint layout (known: "
                             f"{', '.join(EXPERT_LAYOUTS)}); load this model with from_pretrained instead")
        gate, up, down = EXPERT_LAYOUTS[kind][1]
        fused_keys |= {f"{name}.gate_up_proj", f"{name}.down_proj"}
        n = module.num_experts if isinstance(module, Float8Experts) else module.gate_up_proj.shape[0]
        for e in range(n):
            keys = [_renamed(f"{name}.{e}.{proj}.weight", renames) for proj in (gate, up, down)]
            if not isinstance(module, Float8Experts):  # experts in high precision: values per expert
                if any(k not in tensors for k in keys):
                    missing += [k for k in keys if k not in tensors]
                    continue
                g, u, d = (value_of(k).to(module.gate_up_proj.dtype) for k in keys)
                module.gate_up_proj[e].copy_(torch.cat([g, u]))
                module.down_proj[e].copy_(d)
                report.high_precision += keys
                continue
            parts = [fp8_weight(k) for k in keys]
            if any(p is None for p in parts):
                continue
            try:
                exact_gate_up = _load_into(module.gate_up[e].weight, *_stack_rows(parts[:2]))
                exact_down = _load_into(module.down[e].weight, *parts[2])
            except ValueError as error:
                raise ValueError(f"{name}, expert {e}: {error}") from None
            for proj, exact in ((f"{name}.gate_up.{e}", exact_gate_up), (f"{name}.down.{e}", exact_down)):
                if exact:
                    report.exact.append(proj)
                else:
                    report.requantized[proj] = "the file's scales do not fit the fused tensor-wise expert weight"

    fp8_keys = {f"{name}.weight": name for name in fp8_linears}
    for key, value in model.state_dict(keep_vars=True).items():
        if any(key.startswith(prefix) for prefix in scaling) or key in fused_keys:
            continue
        file_key = _renamed(key, renames)
        if key in fp8_keys:
            if file_key in tensors and tensors[file_key].dtype != _E4M3:  # high precision in the file (a bf16 head)
                value.copy_(tensors[file_key].to(torch.float32))  # re-quantized into the recipe's blocks
                used.add(file_key)
                report.requantized[fp8_keys[key]] = "high precision in the file"
                continue
            stored = fp8_weight(file_key)
            if stored is None:
                continue
            try:
                exact = _load_into(value, *stored)
            except ValueError as error:
                raise ValueError(f"{key}: {error}") from None
            if exact:
                report.exact.append(fp8_keys[key])
            else:
                report.requantized[fp8_keys[key]] = (f"{stored[2]} scales in the file, "
                                                     f"{value.block or 'tensor-wise'} blocks held by the recipe")
            continue
        if file_key not in tensors:
            missing.append(file_key)
            continue
        source = value_of(file_key)
        if tuple(source.shape) != tuple(value.shape):
            raise ValueError(f"{key}: shape {tuple(source.shape)} in the checkpoint, {tuple(value.shape)} in the "
                             "model: build the model with the checkpoint's config")
        if isinstance(value, Float8Tensor):  # an FP8 embedding: re-quantized (exact: the file holds its values)
            value.copy_(source.to(torch.float32))
        else:
            value.copy_(source.to(value.dtype))
        report.high_precision.append(key)
    unused = sorted(k for k in tensors if k not in used)
    tied = [k for k in missing if k.endswith(".weight") and _is_tied(model, k)]
    missing = [k for k in missing if k not in tied]
    if strict and (missing or unused):
        raise ValueError(f"import_fp8: the checkpoint and the model differ: missing {missing[:4]}"
                         f"{' ...' if len(missing) > 4 else ''}, unused {unused[:4]}{' ...' if len(unused) > 4 else ''};"
                         " build the model with the checkpoint's config (or pass strict=False)")
    if optimizer is not None:
        report.masters = _set_masters(optimizer, model)
    return report


def _is_tied(model: nn.Module, key: str) -> bool:
    """Whether parameter ``key`` shares its tensor with another parameter of ``model`` (tied embeddings)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    p = params.get(key)
    return p is not None and any(q is p for k, q in params.items() if k != key)
