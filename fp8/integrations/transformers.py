"""FP8 training with ``transformers.Trainer`` in one line.

::

    from fp8.integrations.transformers import FP8Trainer

    trainer = FP8Trainer(model=model, args=training_args, train_dataset=ds, fp8_opt_level="O2")
    trainer.train()
    trainer.save_model("out")  # a plain transformers directory: AutoModelForCausalLM.from_pretrained("out")

A ``Trainer`` subclass of your own (e.g. trl's ``SFTTrainer``) gets the same with the mixin::

    class MyFP8Trainer(FP8TrainerMixin, SFTTrainer):
        pass

What the mixin changes in ``Trainer``, and nothing else:

- ``create_optimizer``: the optimizer ``Trainer`` builds (or the one passed in ``optimizers=(optimizer,
  None)``) goes through :func:`fp8.initialize` with the model, once; the model's eligible linears become
  :class:`fp8.Float8Linear` in place and ``trainer.optimizer`` is the returned FP8 optimizer, on which
  ``Trainer`` then builds its learning-rate scheduler.
- ``_clip_grad_norm`` / ``_get_grad_norm`` (``max_grad_norm``, the logged ``grad_norm``): through
  :func:`fp8.clip_grad_norm_` instead of ``accelerator.clip_grad_norm_``: it scales an FP8 (E4M3) gradient through
  its scale, exactly, where torch's ``clip_grad_norm_`` multiplies it in place and so rounds it to E4M3 again.
- ``_save`` (``save_model`` and checkpoints): the weights are written as plain tensors in the model's dtype,
  each FP8 weight replaced by its master (the optimizer's high-precision copy) and the FP8 scaling state left
  out (:func:`high_precision_state_dict`), so ``from_pretrained`` loads the directory without ``fp8``.

At ``fp8_opt_level="none"`` (alias ``"O0"``) every one of these is ``Trainer``'s own (``fp8_activations=True``
still compresses the saved activations). Gradient accumulation needs nothing more: FP8 weight gradients are
summed over micro-batches in a scaled FP16 buffer, 2 bytes per element (``Float8LinearConfig.grad_accumulation``,
through ``fp8_config``).

Under FSDP2 (``TrainingArguments(fsdp=True, fsdp_config={'version': 2, ...})``, docs/fsdp.md) at O2, Accelerate
shards the FP8 model and the optimizer follows the shards; ``_clip_grad_norm`` sums the shards' norms over the ranks,
and ``save_model`` gathers the whole high-precision weights on every rank and writes them from the main process.

Refused up front, each error naming the fix: an unknown level or recipe, ``fp16=True`` (FP8 scales replace the
loss scaler: use ``bf16=True`` or fp32), DeepSpeed and FSDP1 (they build or shard the optimizer themselves), more
than one process without FSDP2, O1 under FSDP2 (Accelerate maps the optimizer's parameters through the model's, and
O1's masters are not), ``"O3"``, and a scheduler passed in ``optimizers`` (it would keep stepping the replaced
optimizer).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch
import transformers
from torch import nn
from transformers.trainer import SCHEDULER_NAME

from ..checkpoint import load_checkpoint, save_checkpoint
from ..convert import is_conv1d
from ..export import model_dtype
from ..initialize import initialize, normalize_opt_level
from ..linear import Float8LinearConfig
from ..moe import Float8Experts
from ..optim.base import FP8Optimizer
from ..optim.clip import clip_grad_norm_
from ..optim.convert import check_convertible
from ..optim.master_weights import MasterWeightOptimizer
from ..optim.precision import OptimizerPrecision
from ..precision_rules import parse_precision_rules
from ..recipes import RECIPES, get_recipe
from ..stats import FP8Statistics
from ..scaling import ScalingState
from ..distributed.sharding import is_dtensor, local, rows_as_dtensor
from ..tensor import Float8Tensor

FSDP_CHECKPOINT = "fp8_checkpoint"
"""The sub-directory of a ``Trainer`` checkpoint holding the sharded FP8 model and optimizer under FSDP2."""

__all__ = ["FP8Trainer", "FP8TrainerMixin", "high_precision_state_dict", "fp8_optimizer_of", "conv1d_names"]


def _unwrapped(optimizer) -> list:
    """``optimizer`` and the optimizers it wraps (``.optimizer`` chains, e.g. accelerate's ``AcceleratedOptimizer``)."""
    chain = []
    while optimizer is not None and all(optimizer is not o for o in chain):
        chain.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return chain


def fp8_optimizer_of(optimizer) -> FP8Optimizer | MasterWeightOptimizer | None:
    """The FP8 optimizer inside ``optimizer`` (itself, or unwrapping ``.optimizer`` chains, e.g. accelerate's
    ``AcceleratedOptimizer``), or None when it holds none."""
    return next((o for o in _unwrapped(optimizer) if isinstance(o, (FP8Optimizer, MasterWeightOptimizer))), None)


def _master_values(optimizer) -> dict[int, torch.Tensor]:
    """``id(model parameter) -> its master value`` for the parameters ``optimizer`` keeps a master of."""
    inner = fp8_optimizer_of(optimizer)
    if inner is not None:
        inner.follow_sharding()  # FSDP2 sharded the model since the optimizer's last call: its shards' masters
    if isinstance(inner, MasterWeightOptimizer):  # O1: (master, FP8 weight) pairs
        return {id(fp8_weight): local(master.detach()) for master, fp8_weight in inner.pairs}
    if isinstance(inner, FP8Optimizer):  # O2: state["master"] (FP8 weights; 16-bit parameters)
        return {id(p): inner.master_value(p) for group in inner.param_groups for p in group["params"]
                if "master" in inner.state.get(p, {})}
    return {}


def high_precision_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                              dtype: torch.dtype | None = None, conv1d: Iterable[str] = (),
                              to_cpu: bool = False, keep: bool = True) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` as an unconverted model of the same architecture has it: plain tensors only.

    Each FP8 weight (a :class:`fp8.Float8Tensor`) is replaced by its master in ``optimizer`` (the returned
    optimizer of :func:`fp8.initialize`, or any wrapper of it: O1's high-precision weight, O2's stored master),
    or by its dequantized value where there is none; other parameters with a master (O2's 16-bit ones) take it
    too. The FP8 scaling state (:class:`fp8.scaling.ScalingState` buffers) is left out. Every tensor is cast to
    ``dtype``; None: FP8 weights to the model's dtype (that of its other floating parameters), others keep
    theirs. ``conv1d``: names of the modules that were transformers ``Conv1D`` before conversion (GPT-2's
    ``c_attn``, ...; :func:`conv1d_names` of the unconverted model): their weights are written back transposed,
    ``(in_features, out_features)``, as ``Conv1D`` stores them. MoE experts (:class:`fp8.moe.Float8Experts`) are written
    fused (``gate_up_proj``, ``down_proj``), each expert's slice from its master. For ``model.save_pretrained(dir,
    state_dict=high_precision_state_dict(model, optimizer))``.

    A model sharded by FSDP2 (docs/fsdp.md) gives the same whole tensors on every rank: each parameter's rows (its
    master's, or its dequantized FP8 rows) are all-gathered, one collective per parameter in the model's order, so
    call it on every rank (and write from one). ``to_cpu``: each tensor moved to host memory as soon as it is whole,
    so a sharded model is never held whole on the device (a copy per parameter: for saving, not for a training loop).
    ``keep=False`` (a rank that does not write): every collective is taken part in, nothing is kept (returns ``{}``).
    """
    masters = _master_values(optimizer)
    transposed = {f"{name}.weight" for name in conv1d}
    fp8_dtype = dtype or model_dtype(model)
    scaling = [name + "." for name, module in model.named_modules() if isinstance(module, ScalingState)]
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if any(key.startswith(prefix) for prefix in scaling):
            continue
        master = masters.get(id(value))
        sharded = value if is_dtensor(value) else None
        value = local(value)
        is_fp8 = isinstance(value, Float8Tensor)
        target = dtype or (fp8_dtype if is_fp8 else value.dtype)
        if master is not None:
            value = master
        elif is_fp8:
            value = value.dequantize(torch.float32)
        if not isinstance(value, Float8Tensor) and value.is_floating_point():
            value = value.detach().to(target)
        if sharded is not None:
            value = rows_as_dtensor(value.detach().contiguous(), sharded).full_tensor()  # one all-gather
        if key in transposed and is_fp8:
            value = value.t()
        if keep:
            out[key] = value.detach().contiguous().cpu() if to_cpu else value.detach().contiguous()
    for name, module in model.named_modules():  # MoE experts: fused, transformers' layout, from the masters
        if keep and isinstance(module, Float8Experts):
            prefix = f"{name}." if name else ""
            for key, value in module.fused_weights(lambda p: masters.get(id(p)), dtype or fp8_dtype).items():
                out[prefix + key] = value.contiguous().cpu() if to_cpu else value.contiguous()
    return out


def conv1d_names(model: nn.Module) -> list[str]:
    """Names of ``model``'s transformers ``Conv1D`` modules (before :func:`fp8.initialize` converts them)."""
    return [name for name, module in model.named_modules() if is_conv1d(module)]


def _check_choices(opt_level: str, recipe: str) -> str:
    try:
        level = normalize_opt_level(opt_level)
    except ValueError as e:
        raise ValueError(f"fp8_opt_level: {e}; pass e.g. fp8_opt_level='O2' (or 'none' to train in high "
                         f"precision)") from None
    try:
        get_recipe(recipe)
    except ValueError as e:
        raise ValueError(f"fp8_recipe: {e}; pass e.g. fp8_recipe='tensorwise'") from None
    if level == "O3":
        raise ValueError("fp8_opt_level='O3' shards the optimizer over data-parallel ranks, which FP8Trainer does "
                         "not run; use fp8_opt_level='O2' (the same optimizer: unsharded in one process, sharded "
                         "with the weights under FSDP2)")
    return level


class _FP8StatsSteps(transformers.TrainerCallback):
    """Marks each optimizer step observed or not for :class:`fp8.stats.FP8Statistics` (every N-th)."""

    def __init__(self, stats: FP8Statistics) -> None:
        self.stats = stats

    def on_step_begin(self, args, state, control, **kwargs):
        self.stats.begin_step(state.global_step + 1)


class FP8TrainerMixin:
    """Makes a ``transformers.Trainer`` (or any subclass of it, listed after this mixin) train in FP8.

    Keyword arguments, besides the ``Trainer``'s own:

    - ``fp8_opt_level``: ``"O2"`` (default: FP8 linears, FP8-aware Adam/AdamW/SGD with compressed moments and
      masters), ``"O1"`` (FP8 linears, the ``Trainer``'s own optimizer stepping high-precision masters),
      ``"none"``/``"O0"`` (the plain ``Trainer``). :data:`fp8.OPT_LEVELS`.
    - ``fp8_recipe``: scale granularity, one of :data:`fp8.recipes.RECIPES` (``"tensorwise"``, ``"rowwise"``,
      ``"blockwise"``).
    - ``fp8_activations``: store the tensors saved for backward as E4M3 tiles (:func:`fp8.initialize`).
    - ``fp8_embeddings``: untied embedding tables in FP8 too (E4M3 rows trained like FP8 weights; :func:`fp8.initialize`).
    - ``fp8_config``: a :class:`fp8.Float8LinearConfig` (formats, ``grad_accumulation``, GEMM backend).
    - ``fp8_min_dim``: linears with ``min(in, out)`` below it stay in high precision (None: 2048 on CUDA, 0 on
      CPU; :func:`fp8.initialize`'s ``min_fp8_dim``).
    - ``fp8_module_filter``: ``fn(module, fqn) -> bool``; False keeps that linear in high precision.
    - ``fp8_precision``: per-layer precision rules (:mod:`fp8.precision_rules`; :func:`fp8.initialize`'s
      ``precision=`` rules).
    - ``fp8_stats_interval``: FP8 numerics statistics (:class:`fp8.stats.FP8Statistics`) observed every N optimizer
      steps and added to each log (``fp8_stats/<layer>/<operand>/<statistic>``: what ``report_to`` integrations such as
      TensorBoard and W&B receive, and ``state.log_history``), read at ``logging_steps`` only; 0 (default): off.
    - ``fp8_auto_fallback``: True or a :class:`fp8.FallbackConfig`: linears whose FP8 statistics keep raising alarms
      step to a safer setting (:func:`fp8.initialize`'s ``auto_fallback``; :mod:`fp8.fallback`), kept in the
      optimizer's checkpoint; it reads the statistics itself, so it does not go with ``fp8_stats_interval``.
    - ``fp8_high_precision_from_step`` / ``fp8_high_precision_mode``: from that optimizer step on every FP8 linear runs
      its forward GEMM (``"forward"``) or all its GEMMs (``"linear"``) in high precision (:mod:`fp8.schedule`).
    - ``fp8_smooth_swiglu``: Smooth-SwiGLU on the gated MLPs' down projections (:func:`fp8.initialize`'s
      ``smooth_swiglu``; tensorwise recipe).
    - ``fp8_optimizer_precision``: the O2 optimizer's state formats, an :class:`fp8.optim.OptimizerPrecision` (for
      example ``OptimizerPrecision(exp_avg_rounding="stochastic")`` or ``OptimizerPrecision(exp_avg="fp16")``;
      :func:`fp8.initialize`'s ``optimizer_precision``); None: the O2 preset.

    The model is converted when the optimizer is created (the start of ``train()``), not before.
    """

    def __init__(self, *args, fp8_opt_level: str = "O2", fp8_recipe: str = "tensorwise",
                 fp8_activations: bool = False, fp8_embeddings: bool = False,
                 fp8_config: Float8LinearConfig | None = None,
                 fp8_min_dim: int | None = None, fp8_module_filter: Callable[[nn.Module, str], bool] | None = None,
                 fp8_precision=None, fp8_stats_interval: int = 0, fp8_auto_fallback=False,
                 fp8_high_precision_from_step: int | None = None, fp8_high_precision_mode: str = "forward",
                 fp8_smooth_swiglu: bool = False, fp8_optimizer_precision: OptimizerPrecision | None = None,
                 **kwargs) -> None:
        level = _check_choices(fp8_opt_level, fp8_recipe)
        if fp8_optimizer_precision is not None:
            if not isinstance(fp8_optimizer_precision, OptimizerPrecision):
                raise TypeError(f"fp8_optimizer_precision must be an fp8.optim.OptimizerPrecision or None, got "
                                f"{type(fp8_optimizer_precision).__name__}")
            if level != "O2":
                raise ValueError(f"fp8_optimizer_precision sets the O2 optimizer's state formats; with "
                                 f"fp8_opt_level={level!r} the Trainer's own optimizer steps: use fp8_opt_level='O2'")
        self.fp8_optimizer_precision = fp8_optimizer_precision
        if fp8_config is not None and not isinstance(fp8_config, Float8LinearConfig):
            raise TypeError(f"fp8_config must be an fp8.Float8LinearConfig or None, got {type(fp8_config).__name__}")
        if fp8_config is not None and fp8_config.recipe not in ("tensorwise", fp8_recipe):
            raise ValueError(f"fp8_recipe={fp8_recipe!r} contradicts fp8_config.recipe={fp8_config.recipe!r}; "
                             f"pass one of them (recipes: {RECIPES})")
        self.fp8_opt_level = level
        self.fp8_recipe = fp8_recipe
        self.fp8_activations = bool(fp8_activations)
        if fp8_embeddings and level == "none":
            raise ValueError("fp8_embeddings=True needs an FP8 fp8_opt_level ('O1' or 'O2'); at 'none' the model stays "
                             "in high precision")
        self.fp8_embeddings = bool(fp8_embeddings)
        self.fp8_config = fp8_config
        self.fp8_min_dim = fp8_min_dim
        self.fp8_module_filter = fp8_module_filter
        if fp8_precision is not None:
            parse_precision_rules(fp8_precision, source="fp8_precision")  # bad rules fail here, before training
        self.fp8_precision = fp8_precision
        if fp8_stats_interval < 0 or (fp8_stats_interval and level == "none"):
            raise ValueError(f"fp8_stats_interval={fp8_stats_interval} needs an FP8 fp8_opt_level and a value >= 0 "
                             f"(0: off)")
        self.fp8_stats_interval = int(fp8_stats_interval)
        if (fp8_auto_fallback or fp8_high_precision_from_step is not None) and level == "none":
            raise ValueError("fp8_auto_fallback and fp8_high_precision_from_step act on FP8 linears: they need an FP8 "
                             "fp8_opt_level ('O1' or 'O2')")
        if fp8_auto_fallback and fp8_stats_interval:
            raise ValueError("fp8_auto_fallback reads the FP8 statistics itself (every FallbackConfig.interval steps) "
                             "and logs its decisions: drop fp8_stats_interval, or the fallback")
        self.fp8_auto_fallback = fp8_auto_fallback
        self.fp8_high_precision_from_step = fp8_high_precision_from_step
        self.fp8_high_precision_mode = fp8_high_precision_mode
        if fp8_smooth_swiglu and level == "none":
            raise ValueError("fp8_smooth_swiglu=True smooths FP8 casts: it needs an FP8 fp8_opt_level ('O1' or 'O2')")
        self.fp8_smooth_swiglu = bool(fp8_smooth_swiglu)
        self.fp8_stats: FP8Statistics | None = None
        self._fp8_optimizer = None  # the optimizer fp8.initialize returned (identity: initialize once)
        self._fp8_conv1d: list[str] = []  # the model's transformers Conv1D modules, saved back transposed
        super().__init__(*args, **kwargs)
        if self.fp8_enabled:
            self._check_fp8_arguments()

    @property
    def fp8_enabled(self) -> bool:
        """Whether the model trains in FP8 (``fp8_opt_level`` is not ``"none"``)."""
        return self.fp8_opt_level != "none"

    @property
    def fp8_fsdp2(self) -> bool:
        """Whether Accelerate shards the model with FSDP2 (``fsdp_config={'version': 2}``): the FP8 weights are then
        sharded at rest and all-gathered in FP8, and the O2 optimizer follows the shards (docs/fsdp.md). Decided
        once, when the trainer is built, as ``Trainer.is_fsdp_enabled`` is."""
        if "_fp8_fsdp2" not in self.__dict__:
            plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
            self._fp8_fsdp2 = bool(self.is_fsdp_enabled and getattr(plugin, "fsdp_version", 1) == 2)
        return self._fp8_fsdp2

    def _check_fp8_arguments(self) -> None:
        level = self.fp8_opt_level
        if self.args.fp16:
            raise ValueError(f"fp8_opt_level={level!r} does not run with fp16=True (torch's loss scaler would scale "
                             f"FP8 gradients it cannot read; FP8 keeps its own scales): pass bf16=True or neither")
        fsdp2 = self.fp8_fsdp2
        if self.is_deepspeed_enabled or (self.is_fsdp_enabled and not fsdp2):
            raise ValueError(f"fp8_opt_level={level!r} does not run under DeepSpeed or FSDP1 (they build or shard the "
                             f"optimizer themselves); use FSDP2 (TrainingArguments(fsdp=True, "
                             f"fsdp_config={{'version': 2}})), drop those arguments, or train with "
                             f"fp8_opt_level='none'")
        if fsdp2 and level == "O1":
            raise ValueError("fp8_opt_level='O1' does not run under FSDP2 with the Trainer: Accelerate maps the "
                             "optimizer's parameters to their shards through the model's parameters, and O1's "
                             "optimizer steps fp32 masters that are not the model's; use fp8_opt_level='O2' (FP16 "
                             "masters with scales, sharded like the weights), or shard with fully_shard in your own "
                             "loop (docs/fsdp.md)")
        if fsdp2 and self.args.load_best_model_at_end:
            raise ValueError("load_best_model_at_end=True under FSDP2: Accelerate would look for its own FSDP model "
                             "files, and FP8Trainer's checkpoints hold the sharded FP8 model in fp8_checkpoint/; drop "
                             "load_best_model_at_end and load the best checkpoint's model.safetensors "
                             "(AutoModelForCausalLM.from_pretrained(checkpoint_dir))")
        if self.args.world_size > 1 and not fsdp2:
            raise ValueError(f"FP8Trainer runs one process (world_size={self.args.world_size}) or FSDP2 "
                             f"(TrainingArguments(fsdp=True, fsdp_config={{'version': 2}}), docs/fsdp.md); FP8 "
                             f"data parallelism is fp8.distributed.DistributedDataParallel in your own loop "
                             f"(docs/distributed.md), or train with fp8_opt_level='none'")
        if self.lr_scheduler is not None:
            raise ValueError("a scheduler passed in optimizers=(optimizer, scheduler) would keep stepping the optimizer "
                             "that fp8.initialize replaces; pass optimizers=(optimizer, None), and set the schedule "
                             "in TrainingArguments (lr_scheduler_type, warmup_steps), or build it in create_scheduler")

    # -- the optimizer: fp8.initialize ------------------------------------------------------------
    def create_optimizer(self, model=None):
        """``Trainer.create_optimizer``, then :func:`fp8.initialize` on the model and that optimizer (once):
        ``self.optimizer`` becomes the FP8 optimizer, the model's linears :class:`fp8.Float8Linear`."""
        optimizer = super().create_optimizer(model)
        done = self._fp8_optimizer is not None and any(o is self._fp8_optimizer for o in _unwrapped(optimizer))
        if done or (self.fp8_opt_level == "none" and not self.fp8_activations):  # a second train(): kept
            return optimizer
        target = self.model if model is None else model
        if self.fp8_opt_level == "O2":
            try:
                check_convertible(optimizer)
            except TypeError as e:
                raise TypeError(f"{e}. With FP8Trainer: TrainingArguments(optim='adamw_torch') (or 'adamw_torch_fused', "
                                f"'sgd') keeps fp8_opt_level='O2'; fp8_opt_level='O1' keeps optim="
                                f"{getattr(self.args.optim, 'value', self.args.optim)!r}") from None
        conv1d = conv1d_names(target)
        new_model, new_optimizer = initialize(
            target, optimizer, self.fp8_opt_level, config=self.fp8_config, recipe=self.fp8_recipe,
            fp8_activations=self.fp8_activations, fp8_embeddings=self.fp8_embeddings, min_fp8_dim=self.fp8_min_dim,
            module_filter_fn=self.fp8_module_filter, precision=self.fp8_precision,
            auto_fallback=self.fp8_auto_fallback, high_precision_from_step=self.fp8_high_precision_from_step,
            high_precision_mode=self.fp8_high_precision_mode, smooth_swiglu=self.fp8_smooth_swiglu,
            optimizer_precision=self.fp8_optimizer_precision)
        if new_model is not target:  # the model was a single linear, replaced (convert_to_float8_linear)
            if target is self.model:
                self.model = new_model
            if target is self.model_wrapped:
                self.model_wrapped = new_model
        self.optimizer = self._fp8_optimizer = new_optimizer
        self._fp8_conv1d = conv1d
        if self.fp8_stats_interval and self.fp8_stats is None:
            self.fp8_stats = FP8Statistics(new_model, self.fp8_stats_interval)
            self.add_callback(_FP8StatsSteps(self.fp8_stats))
        return new_optimizer

    def log(self, logs: dict, *args, **kwargs) -> None:
        """``Trainer.log`` with the FP8 statistics observed since the last log added (``fp8_stats_interval``)."""
        if self.fp8_stats is not None:
            for layer, operands in self.fp8_stats.read().items():
                for operand, stats in operands.items():
                    for stat, value in stats.items():
                        logs[f"fp8_stats/{layer}/{operand}/{stat}"] = value
        super().log(logs, *args, **kwargs)

    # -- gradient clipping: fp8.clip_grad_norm_ ---------------------------------------------------
    def _clip_grad_norm(self, model):
        """``max_grad_norm`` clipping through :func:`fp8.clip_grad_norm_` (FP8 gradients scaled through their
        scales); returns the norm before clipping, as ``Trainer`` does."""
        if not self.fp8_enabled:
            return super()._clip_grad_norm(model)
        return clip_grad_norm_(list(model.parameters()), self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if self.fp8_enabled and grad_norm is None:
            grad_norm = clip_grad_norm_(list(model.parameters()), float("inf"))  # the norm, nothing scaled
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # -- checkpoints under FSDP2: fp8.checkpoint ---------------------------------------------------
    def _fp8_sharded(self) -> bool:
        return self.fp8_enabled and self.fp8_fsdp2 and self._fp8_optimizer is not None

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Under FSDP2: the sharded FP8 model and optimizer through :func:`fp8.checkpoint.save_checkpoint` (every rank
        its rows, loadable at another world size) in ``output_dir/fp8_checkpoint``, and the scheduler; Accelerate's
        FSDP saving would gather the FP8 shards as plain tensors. Otherwise ``Trainer``'s own."""
        if not self._fp8_sharded():
            return super()._save_optimizer_and_scheduler(output_dir)
        save_checkpoint(os.path.join(output_dir, FSDP_CHECKPOINT), self.model, self._fp8_optimizer)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Under FSDP2 the model's shards are restored with the optimizer's (:meth:`_load_optimizer_and_scheduler`)."""
        if not self._fp8_sharded():
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if not os.path.isdir(os.path.join(resume_from_checkpoint, FSDP_CHECKPOINT)):
            raise ValueError(f"{resume_from_checkpoint} has no {FSDP_CHECKPOINT}/: FP8Trainer under FSDP2 resumes from "
                             f"the checkpoints it writes itself (fp8.checkpoint); start from the saved model instead "
                             f"(model=AutoModelForCausalLM.from_pretrained(...), no resume_from_checkpoint)")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._fp8_sharded():
            return super()._load_optimizer_and_scheduler(checkpoint)
        load_checkpoint(os.path.join(checkpoint, FSDP_CHECKPOINT), self.model, self._fp8_optimizer)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    # -- saving: high-precision weights -----------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model``; under FSDP2 every rank gathers :func:`high_precision_state_dict`'s whole weights
        (one all-gather per parameter, each tensor moved to host memory once whole) and the main process writes them,
        whatever ``fsdp_state_dict_type``: the directory is a plain transformers one, as without FSDP2."""
        if not self._fp8_sharded():
            return super().save_model(output_dir, _internal_call=_internal_call)
        state_dict = high_precision_state_dict(self.accelerator.unwrap_model(self.model), self.optimizer,
                                               conv1d=self._fp8_conv1d, to_cpu=True, keep=self.args.should_save)
        self._save(output_dir if output_dir is not None else self.args.output_dir, state_dict=state_dict)
        self.accelerator.wait_for_everyone()
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """``Trainer._save`` with :func:`high_precision_state_dict`'s weights: the masters in the model's
        dtype, no FP8 tensors or scaling state, so ``from_pretrained`` needs no ``fp8``."""
        if self.fp8_enabled and state_dict is None:
            state_dict = high_precision_state_dict(self.accelerator.unwrap_model(self.model), self.optimizer,
                                                   conv1d=self._fp8_conv1d)
        super()._save(output_dir, state_dict=state_dict)


    # -- serving: the FP8 weights as trained ----------------------------------------------------
    def export_fp8(self, output_dir: str, format: str = "compressed-tensors", **kwargs):
        """Write the trained model to ``output_dir`` in a serving format with its FP8 weights as trained
        (:func:`fp8.export.export_fp8`: ``"compressed-tensors"`` or ``"fp8-block"``; vLLM, SGLang and transformers load
        it), with the model's config and the trainer's tokenizer (``processing_class``). Returns the
        :class:`fp8.export.ExportReport` (None on processes that do not save). Call it after ``train()`` (the model is
        FP8 from then on)."""
        from ..export import export_fp8

        if not self.fp8_enabled:
            raise ValueError("export_fp8 writes FP8 weights: this trainer runs fp8_opt_level='none' (high precision); "
                             "use save_model, or train with fp8_opt_level='O1' or 'O2'")
        if self.fp8_fsdp2:  # refused on every rank (the export itself runs on one)
            raise ValueError("export_fp8 under FSDP2: the FP8 weights are sharded over the ranks; save_model writes the "
                             "whole high-precision weights, or export from a single-process model loaded from them "
                             "(fp8.initialize, then fp8.export.export_fp8)")
        if self._fp8_optimizer is None:
            raise ValueError("export_fp8: the model is not FP8 yet (fp8.initialize runs when train() creates the "
                             "optimizer): call trainer.train() first")
        kwargs.setdefault("tokenizer", self.processing_class)
        report = None
        if self.args.should_save:  # one process writes (the others would race on the same files)
            report = export_fp8(self.accelerator.unwrap_model(self.model), output_dir, format,
                                conv1d=self._fp8_conv1d, **kwargs)
        self.accelerator.wait_for_everyone()
        return report


class FP8Trainer(FP8TrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` training in FP8: ``FP8Trainer(..., fp8_opt_level="O2")``; the FP8 keywords are
    :class:`FP8TrainerMixin`'s, everything else is ``Trainer``'s."""
