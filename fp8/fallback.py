"""Automatic fallback: FP8 linears that step to a safer setting where their statistics keep raising alarms.

Every ``interval`` steps the FP8 statistics (:class:`fp8.stats.FP8Statistics`: per FP8 linear the fractions of its
input's and output gradient's values that saturate, flush to zero, or are not finite) are read; a linear is *alarmed*
at a check when one of its two activation roles passes a threshold (saturated > ``saturation``, flushed to zero >
``flush``, any non-finite value), or when the run's loss spikes and that linear's operand amax grew the most since the
previous check (:meth:`AutoFallback.observe`'s ``spike``). After ``patience`` consecutive alarmed checks the linear
moves one rung down the ladder (default ``tensorwise -> rowwise -> blockwise -> high``: per-tensor scales, then
per-row (token / output channel) scales, then 1x128 / 128x128 blocks, then all three GEMMs in high precision on the
weight's values, :attr:`fp8.Float8LinearConfig.high_precision`); with ``restore_after`` M > 0 it moves one rung back
up after M consecutive clean checks.

The decisions come from statistics every rank holds alike (the Megatron path gathers and merges them over the world
before deciding; :func:`attach` all-gathers them over the data-parallel group), so every rank takes the same decision
at the same step and nothing about communication depends on rank-local values. Each decision is a
:class:`Decision` (the layer, the role and statistic that tripped, its value, the old and new setting), logged as a
WARNING; the controller's state (each layer's rung, its counters, the decisions) goes into checkpoints
(:meth:`AutoFallback.state_dict`) and is applied again on resume.

A rung a linear cannot take is skipped for that linear (the next one down is applied): ``blockwise`` needs both
dimensions multiples of 128, ``high`` runs on linears whose input is neither all-gathered (sequence parallelism) nor
routed to experts. Moving a weight from per-tensor to per-row or per-block scales re-quantizes its FP8 values exactly
(the new power-of-two scales are at least the old one); the optimizer re-quantizes it from its master at the next step
in the new layout. Statistics observe the tensor-wise recipe's casts: a linear moved to ``rowwise``/``blockwise`` (whose
scales follow each row's or tile's own amax: no saturation by construction) is then checked through the loss-spike
attribution only.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .blocks import is_tensorwise
from .comm import Collectives
from .convert import fp8_config_attribute
from .linear import Float8LinearConfig
from .recipes import get_recipe
from .stats import ALARM_STATS, FP8Statistics, merge_stats, operand_alarms
from .tensor import Float8Tensor, relayout_

__all__ = ["FallbackConfig", "AutoFallback", "Decision", "LADDER", "SETTINGS", "linear_setting", "set_linear_setting",
           "fallback_linears", "apply_settings", "allowed_settings", "attach", "FallbackHooks"]

_LOG = logging.getLogger("fp8.fallback")

SETTINGS = ("tensorwise", "rowwise", "blockwise", "high")
"""The settings a ladder may name: three FP8 recipes and ``high`` (all GEMMs in high precision)."""
LADDER = SETTINGS
"""The default ladder, safest last."""
ROLES = ("input", "grad_output")


@dataclass(frozen=True)
class FallbackConfig:
    """When and how far linears step back (module docstring). ``interval``: statistics every N steps (the Megatron
    path uses ``--fp8-stats-interval`` instead); ``patience``: consecutive alarmed checks before a step;
    ``ladder``: the settings from least to most safe; ``saturation`` / ``flush``: the alarm thresholds (fractions);
    ``restore_after``: consecutive clean checks before stepping one rung back (0: never)."""

    interval: int = 10
    patience: int = 3
    ladder: tuple[str, ...] = LADDER
    saturation: float = 1e-3
    flush: float = 0.5
    restore_after: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "ladder", tuple(self.ladder))
        if self.interval < 1 or self.patience < 1 or self.restore_after < 0:
            raise ValueError(f"auto fallback: interval and patience must be >= 1 and restore_after >= 0 (0: never); "
                             f"got interval={self.interval}, patience={self.patience}, "
                             f"restore_after={self.restore_after}")
        bad = [s for s in self.ladder if s not in SETTINGS]
        if bad or len(self.ladder) < 2 or len(set(self.ladder)) != len(self.ladder):
            raise ValueError(f"auto fallback ladder {','.join(self.ladder)!r}: two or more distinct settings from "
                             f"{SETTINGS}, least safe first (e.g. 'tensorwise,rowwise,blockwise,high' or "
                             f"'tensorwise,high')")
        if "high" in self.ladder[:-1]:
            raise ValueError(f"auto fallback ladder {','.join(self.ladder)!r}: 'high' is the safest setting and goes "
                             f"last")
        if not (0 < self.saturation < 1 and 0 < self.flush <= 1):
            raise ValueError(f"auto fallback thresholds are fractions: saturation in (0, 1), flush in (0, 1]; got "
                             f"{self.saturation}, {self.flush}")

    @classmethod
    def parse_ladder(cls, text: str) -> tuple[str, ...]:
        """``"tensorwise,rowwise,high"`` -> a ladder tuple (checked when the config is made)."""
        return tuple(s.strip() for s in text.split(",") if s.strip())


@dataclass(frozen=True)
class Decision:
    """One linear moved: at ``iteration`` (the step the statistics were read at), ``layer`` from ``old`` to ``new``
    because ``role`` (``input``, ``grad_output``, or ``loss`` for a restore) showed ``statistic`` (``saturated``,
    ``flush_to_zero``, ``non_finite``, ``loss_spike``, or ``clean`` for a step back up) at ``value`` for the last
    ``checks`` checks."""

    iteration: int
    layer: str
    role: str
    statistic: str
    value: float
    old: str
    new: str
    checks: int

    def message(self) -> str:
        if self.statistic == "clean":
            return (f"iteration {self.iteration}: {self.layer} back from {self.old} to {self.new} after {self.checks} "
                    f"clean checks")
        what = {"saturated": "of its values saturate", "flush_to_zero": "of its non-zero values flush to zero",
                "non_finite": "of its values are not finite",
                "loss_spike": "amax growth (x) at a loss spike"}[self.statistic]
        value = f"{self.value:.4g}" if self.statistic == "loss_spike" else f"{self.value:.2%}"
        change = f"{self.old} -> {self.new}" if self.new != self.old else \
            f"stays {self.old}, the safest setting on the ladder it can take"
        return (f"iteration {self.iteration}: {self.layer} {self.role}: {value} {what} at {self.checks} consecutive "
                f"checks: {change}")


def linear_setting(module: nn.Module) -> str | None:
    """An FP8 linear's setting on the :data:`SETTINGS` scale (``"high"`` when its GEMMs run in high precision, else its
    recipe), or None for a module that is not an FP8 linear the fallback can move."""
    attribute = fp8_config_attribute(module)
    weight = getattr(module, "weight", None)
    if attribute is None or not isinstance(weight, Float8Tensor) and not hasattr(weight, "to_local"):
        return None
    config = getattr(module, attribute)
    return "high" if config.high_precision else config.recipe


def fallback_linears(model: nn.Module, prefix: str = "") -> dict[str, nn.Module]:
    """The FP8 linears of ``model`` the fallback moves (those :class:`fp8.stats.FP8Statistics` observes: an FP8
    weight and input / output-gradient scaling states), by module name (``prefix`` prepended)."""
    return {prefix + name: m for name, m in model.named_modules()
            if linear_setting(m) is not None and getattr(m, "input_scaling", None) is not None
            and getattr(m, "grad_output_scaling", None) is not None}


def _setting_problem(module: nn.Module, setting: str) -> str | None:
    """Why ``module`` cannot take ``setting`` (None: it can)."""
    if setting == "high":
        if getattr(module, "sequence_parallel", False):
            return "its input is all-gathered (sequence parallelism)"
        return None
    weight = module.weight
    config = getattr(module, fp8_config_attribute(module))
    if type(config) is not Float8LinearConfig and setting != config.recipe:
        return f"its config is a {type(config).__name__} (e.g. Smooth-SwiGLU), whose quantizers are its own"
    if not isinstance(weight, Float8Tensor) and setting != config.recipe:
        return (f"its FP8 weight is sharded ({type(weight).__name__}, FSDP2), which keeps tensor-wise FP8 weights "
                f"only")
    return get_recipe(setting).dims_problem(weight.shape[1], weight.shape[0])


def allowed_settings(module: nn.Module, ladder: tuple[str, ...]) -> tuple[str, ...]:
    """The settings of ``ladder`` that ``module`` can take (its current one included)."""
    return tuple(s for s in ladder if s == linear_setting(module) or _setting_problem(module, s) is None)


@torch.no_grad()
def _set_recipe(module: nn.Module, recipe: str, high: bool) -> None:
    """``module`` at ``recipe`` (its weight re-laid out in that recipe's blocks where it changes), its GEMMs in high
    precision or not."""
    attribute = fp8_config_attribute(module)
    config: Float8LinearConfig = getattr(module, attribute)
    if recipe != config.recipe:
        problem = _setting_problem(module, recipe)
        if problem is not None:
            raise ValueError(f"{type(module).__name__} cannot run {recipe!r}: {problem}")
        relayout_(module.weight, get_recipe(recipe).weight)
        module.weight.grad = None
    if high and _setting_problem(module, "high") is not None:
        raise ValueError(f"{type(module).__name__} cannot run in high precision: {_setting_problem(module, 'high')}")
    if (recipe, high) != (config.recipe, config.high_precision):
        setattr(module, attribute, dataclasses.replace(config, recipe=recipe, high_precision=high))


def set_linear_setting(module: nn.Module, setting: str, recipe: str | None = None) -> None:
    """Move FP8 linear ``module`` to ``setting`` (:data:`SETTINGS`): a recipe sets it (all GEMMs in FP8) and re-lays
    the FP8 weight out in that recipe's blocks (module docstring: exact from per-tensor scales), dropping its derived
    GEMM operands and its gradient (call between an optimizer step and the next backward); ``"high"`` sets
    :attr:`Float8LinearConfig.high_precision`, the weight held in ``recipe``'s blocks (default: as it is). Raises
    ``ValueError`` naming why the module cannot take it."""
    if setting == "high":
        _set_recipe(module, recipe or getattr(module, fp8_config_attribute(module)).recipe, True)
    else:
        _set_recipe(module, setting, False)


def apply_settings(modules: Mapping[str, nn.Module], settings: Mapping[str, str], recipes: Mapping[str, str],
                   initial: Mapping[str, str] | None = None) -> None:
    """Put each linear of ``modules`` named in ``settings`` at that setting (``"high"``: its weight in ``recipes``'
    blocks, the recipe it had before; a controller only chooses settings a linear can take: :func:`allowed_settings`),
    and with ``initial`` every other one back at its initial setting; names this process does not hold (another
    pipeline stage's) are skipped."""
    for name, module in modules.items():
        setting = settings.get(name, None if initial is None else initial.get(name))
        if setting is not None:
            set_linear_setting(module, setting, recipes.get(name, initial.get(name) if initial else None))


class AutoFallback:
    """The decisions of automatic fallback (module docstring) from merged statistics; the same on every rank given
    the same inputs. ``initial``: each FP8 linear's setting at the start, by name (every rank's, merged: layers of
    other pipeline stages included); ``allowed``: the ladder's settings each can take (:func:`allowed_settings`;
    default: all), which the ladder steps through, skipping the others."""

    def __init__(self, config: FallbackConfig, initial: Mapping[str, str],
                 allowed: Mapping[str, tuple[str, ...]] | None = None) -> None:
        self.config = config
        self.initial = dict(initial)
        self.allowed = dict(allowed) if allowed is not None else {}
        self.settings: dict[str, str] = {}  # layers moved: their current rung's setting
        self.recipes: dict[str, str] = {}  # layers moved: the recipe their weight is held in (for "high": the last)
        self.strikes: dict[str, int] = {}
        self.clean: dict[str, int] = {}
        self.decisions: list[Decision] = []
        self.exhausted: set[str] = set()  # layers alarmed at the last setting they can take (said once)
        self._amax: dict[str, float] = {}  # the largest operand amax per layer at the previous check

    def _rungs(self, name: str) -> tuple[str, ...]:
        allowed = self.allowed.get(name)
        return tuple(s for s in self.config.ladder if allowed is None or s in allowed)

    def setting(self, name: str) -> str:
        return self.settings.get(name, self.initial.get(name, ""))

    def _alarm(self, operands: Mapping) -> tuple[str, str, float] | None:
        """The worst alarm of one layer's statistics (:func:`fp8.stats.operand_alarms`): non-finite, then
        saturation, then flush to zero."""
        found = [(ALARM_STATS.index(stat), role, stat, value) for role in ROLES if operands.get(role)
                 for stat, value in operand_alarms(operands[role], self.config.saturation, self.config.flush)]
        return min(found)[1:] if found else None

    def _spike_culprit(self, stats: Mapping) -> tuple[str, str, float] | None:
        """The layer (and role) whose operand amax grew the most since the previous check (by ratio, > 1)."""
        best = None
        for name in sorted(stats):
            for role in ROLES:
                values = stats[name].get(role)
                old = self._amax.get(f"{name}/{role}")
                if not values or not old or values["amax"] != values["amax"]:
                    continue
                ratio = values["amax"] / old
                if ratio > 1 and (best is None or ratio > best[2]):
                    best = (name, role, ratio)
        return best

    def observe(self, stats: Mapping, iteration: int, spike: bool = False) -> list[Decision]:
        """One check: ``stats`` the merged statistics read at ``iteration`` (``{layer: {operand: {statistic:
        value}}}``, :meth:`fp8.stats.FP8Statistics.read` or its merge over ranks); ``spike``: the run's loss spiked
        since the previous check. Returns the decisions taken (each layer moves at most one rung per check)."""
        cfg = self.config
        alarms = {name: a for name in stats if (a := self._alarm(stats[name])) is not None}
        if spike and (culprit := self._spike_culprit(stats)) is not None and culprit[0] not in alarms:
            alarms[culprit[0]] = (culprit[1], "loss_spike", culprit[2])
        out = []
        for name in sorted(stats):
            if name not in self.initial or self.initial[name] not in cfg.ladder:
                continue  # not a linear the ladder moves (another recipe, or unknown)
            if not any(stats[name].get(role) for role in ROLES) and name not in alarms and \
                    self.setting(name) != "high":
                continue  # nothing observed of its casts at this check: neither alarmed nor clean (at "high" there
                # are no casts to observe: a check without an alarm is clean, so restore_after can step it back)
            old = self.setting(name)
            rungs = self._rungs(name)
            here = rungs.index(old) if old in rungs else 0
            if name in alarms:
                self.strikes[name] = self.strikes.get(name, 0) + 1
                self.clean[name] = 0
                if self.strikes[name] >= cfg.patience:
                    role, statistic, value = alarms[name]
                    if here + 1 < len(rungs):
                        out.append(Decision(iteration, name, role, statistic, float(value), old, rungs[here + 1],
                                            self.strikes[name]))
                        self.strikes[name] = 0
                    elif name not in self.exhausted:
                        self.exhausted.add(name)
                        out.append(Decision(iteration, name, role, statistic, float(value), old, old,
                                            self.strikes[name]))
            else:
                self.strikes[name] = 0
                self.clean[name] = self.clean.get(name, 0) + 1
                start = rungs.index(self.initial[name]) if self.initial[name] in rungs else 0
                if cfg.restore_after and self.clean[name] >= cfg.restore_after and here > start:
                    out.append(Decision(iteration, name, "loss", "clean", 0.0, old, rungs[here - 1],
                                        self.clean[name]))
                    self.clean[name] = 0
                    self.exhausted.discard(name)
        for d in out:
            if d.new != d.old:
                self.settings[d.layer] = d.new
                if d.new != "high":
                    self.recipes[d.layer] = d.new
                else:
                    self.recipes.setdefault(d.layer, self.initial[d.layer])
        self.decisions += out
        for name, operands in stats.items():
            for role in ROLES:
                if operands.get(role) and operands[role]["amax"] == operands[role]["amax"]:
                    self._amax[f"{name}/{role}"] = operands[role]["amax"]
        return out

    def state_dict(self) -> dict:
        """Plain Python values (checkpoints): the moved layers' settings, counters and decisions."""
        return {"settings": dict(self.settings), "strikes": dict(self.strikes), "clean": dict(self.clean),
                "decisions": [dataclasses.asdict(d) for d in self.decisions], "amax": dict(self._amax),
                "exhausted": sorted(self.exhausted), "recipes": dict(self.recipes), "ladder": list(self.config.ladder)}

    def load_state_dict(self, state: Mapping) -> None:
        if tuple(state.get("ladder", self.config.ladder)) != self.config.ladder:
            raise ValueError(f"the checkpoint's auto-fallback ladder {','.join(state['ladder'])} differs from this "
                             f"run's {','.join(self.config.ladder)}; resume with the same ladder")
        unknown = [s for s in state["settings"].values() if s not in self.config.ladder]
        if unknown:
            raise ValueError(f"the checkpoint's auto-fallback settings {unknown} are not on this run's ladder")
        self.settings = dict(state["settings"])
        self.strikes, self.clean = dict(state["strikes"]), dict(state["clean"])
        self.decisions = [Decision(**d) for d in state["decisions"]]
        self._amax = dict(state.get("amax", {}))
        self.exhausted = set(state.get("exhausted", ()))
        self.recipes = dict(state.get("recipes", {}))


def _adopt_layout(module, state_dict, prefix, *args) -> None:
    """A model state dict saved after the fallback moved ``module`` holds its weight in the new recipe's blocks: the
    module's weight is re-laid out in those blocks first (its high-precision flag kept), so loading copies like for
    like (the optimizer's state dict then restores the controller)."""
    incoming = state_dict.get(prefix + "weight")
    if not isinstance(incoming, Float8Tensor) or not isinstance(module.weight, Float8Tensor) or \
            incoming.block == module.weight.block:
        return
    for recipe in SETTINGS[:-1]:
        block = get_recipe(recipe).weight
        if (None if is_tensorwise(block) else tuple(block)) == incoming.block:
            _set_recipe(module, recipe, getattr(module, fp8_config_attribute(module)).high_precision)
            return


class FallbackHooks:
    """:func:`attach`'s hooks on an optimizer: observe, read, decide and apply after the right steps; the
    controller's state in the optimizer's state dict."""

    KEY = "fp8_auto_fallback"

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, config: FallbackConfig, process_group,
                 log: Callable[[str], None]) -> None:
        self.model, self.config, self.group, self.log = model, config, process_group, log
        self.comm: Collectives | None = None  # the statistics' merge over the ranks (made at the first check)
        self.modules = fallback_linears(model)
        initial = {n: linear_setting(m) for n, m in self.modules.items()}
        if not any(s in config.ladder for s in initial.values()):
            raise ValueError(f"auto_fallback: no FP8 linear starts at a setting of the ladder {','.join(config.ladder)} "
                             f"(their recipes: {', '.join(sorted(set(initial.values()))) or 'no FP8 linear'}); start "
                             f"the ladder at the model's recipe")
        self.stats = FP8Statistics(model, config.interval)
        self.controller = AutoFallback(config, initial)
        self.step = 0
        self.stats.begin_step(1)
        for module in self.modules.values():
            module.register_load_state_dict_pre_hook(_adopt_layout)
        optimizer.register_step_post_hook(self._after_step)
        optimizer.register_state_dict_post_hook(self.save_state)
        optimizer.register_load_state_dict_pre_hook(self.load_state)

    def _after_step(self, optimizer, args, kwargs) -> None:
        self.step += 1
        if self.step % self.config.interval == 0:
            stats = self.stats.read()  # one host read per check
            if self.group is not None or (torch.distributed.is_initialized()
                                          and torch.distributed.get_world_size() > 1):
                if self.comm is None:
                    self.comm = Collectives(self.group)
                stats = merge_stats(self.comm.all_gather_object(stats, "fp8 fallback"))
            # what each linear can take now (FSDP2 shards tensor-wise weights only): the same modules on every rank
            self.controller.allowed = {n: allowed_settings(m, self.config.ladder) for n, m in self.modules.items()}
            for d in self.controller.observe(stats, self.step):
                self.log(f"FP8 auto fallback, {d.message()}")
            apply_settings(self.modules, self.controller.settings, self.controller.recipes)
        self.stats.begin_step(self.step + 1)

    def save_state(self, optimizer, state_dict: dict) -> dict:
        state_dict[self.KEY] = {**self.controller.state_dict(), "step": self.step}
        return state_dict

    def load_state(self, optimizer, state_dict: dict) -> dict:
        state_dict = dict(state_dict)
        saved = state_dict.pop(self.KEY, None)
        if saved is not None:
            self.controller.load_state_dict(saved)
            self.step = int(saved["step"])
            # every linear at the saved state's setting, those it had not moved back at their initial one
            apply_settings(self.modules, self.controller.settings, self.controller.recipes, self.controller.initial)
            self.stats.begin_step(self.step + 1)
        return state_dict


def attach(model: nn.Module, optimizer: torch.optim.Optimizer, config: FallbackConfig | None = None,
           process_group=None, log: Callable[[str], None] | None = None) -> AutoFallback:
    """Automatic fallback on an FP8 ``model`` trained with ``optimizer`` (what ``fp8.initialize(...,
    auto_fallback=...)`` does): statistics observed every ``config.interval`` optimizer steps and checked after that
    step (merged over ``process_group``, default the world when one is initialized: one ``all_gather_object`` per
    check, on every rank at the same step), decisions applied at once and logged (``log``, default a WARNING on the
    ``fp8.fallback`` logger); ``optimizer.state_dict()`` carries the controller's state under
    ``"fp8_auto_fallback"`` and ``optimizer.load_state_dict`` puts the layers back at their saved settings. Returns
    the controller (:attr:`AutoFallback.decisions`)."""
    attached = FallbackHooks(model, optimizer, config or FallbackConfig(), process_group, log or _LOG.warning)
    return attached.controller
