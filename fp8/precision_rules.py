"""Per-module precision rules: ordered glob patterns over module names, each mapping the linears it matches to high
precision or to FP8 with a recipe and formats; the first matching rule wins.

The same rules serve ``fp8.initialize(..., precision=RULES)`` (a dict or a list, names as ``model.named_modules()``
gives them) and ``pretrain_gpt.py --fp8-precision-config FILE`` (JSON, or YAML when PyYAML is installed; names of
the single-process model: ``decoder.layers.<global index>.self_attention.linear_qkv``, ...)::

    {"rules": [
        {"pattern": "decoder.layers.0.*", "precision": "bf16"},
        {"pattern": "*.mlp.linear_fc2", "precision": "fp8", "recipe": "rowwise"},
        {"pattern": "*", "precision": "fp8"}
    ]}

``precision``: ``"fp8"``, or ``"bf16"`` / ``"high"`` (the model's high precision: BF16 where it trains in BF16, FP32
on CPU). An FP8 rule may set ``recipe`` (``tensorwise``/``rowwise``/``blockwise``), ``input_fmt``,
``grad_output_fmt`` and ``weight_fmt`` (``e4m3``/``e5m2``) over the run's configuration. A linear no rule matches
keeps the run's default selection. Every pattern must match some linear (:meth:`PrecisionPlan.check`: an error
naming the ones that match nothing); :meth:`PrecisionPlan.summary` lists each rule's matches.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections.abc import Iterable
from pathlib import Path

from .linear import Float8LinearConfig
from .recipes import RECIPES

__all__ = ["PrecisionRule", "PrecisionPlan", "parse_precision_rules", "load_precision_file", "HIGH_PRECISION"]

HIGH_PRECISION = ("bf16", "high")
_FORMATS = ("e4m3", "e5m2")
_KEYS = {"pattern", "precision", "recipe", "input_fmt", "grad_output_fmt", "weight_fmt"}


@dataclasses.dataclass(frozen=True)
class PrecisionRule:
    """One rule: ``pattern`` (``fnmatch`` glob over the full module name), ``precision`` (``"fp8"`` or high), and
    for FP8 the overrides of the run's :class:`fp8.Float8LinearConfig`."""

    pattern: str
    precision: str
    overrides: tuple[tuple[str, str], ...] = ()
    """``(key, value)`` pairs over the run's configuration: ``recipe`` (``tensorwise``/``rowwise``/``blockwise``),
    ``input_fmt``, ``grad_output_fmt``, ``weight_fmt`` (``e4m3``/``e5m2``)."""

    @property
    def high_precision(self) -> bool:
        return self.precision in HIGH_PRECISION

    def config(self, base: Float8LinearConfig) -> Float8LinearConfig | None:
        """The FP8 configuration of a linear this rule matches (``base`` with the overrides), or None (high)."""
        if self.high_precision:
            return None
        changes: dict = {}
        for key, value in self.overrides:
            if key in ("recipe", "weight_fmt"):
                changes[key] = value
            else:  # input_fmt / grad_output_fmt: the format of that role's scaling configuration
                role = key.removesuffix("_fmt")
                changes[role] = dataclasses.replace(getattr(base, role), fmt=value)
        return dataclasses.replace(base, **changes) if changes else base

    def describe(self) -> str:
        if self.high_precision:
            return "high precision"
        extra = [f"{k}={v}" for k, v in self.overrides]
        return "fp8" + (f" ({', '.join(extra)})" if extra else "")


def parse_precision_rules(rules, source: str = "precision rules") -> tuple[PrecisionRule, ...]:
    """Rules from ``{"rules": [...]}`` or a list of ``{"pattern": ..., "precision": ..., ...}`` dicts (or
    :class:`PrecisionRule`); errors name the rule and the fix."""
    if isinstance(rules, dict):
        if set(rules) != {"rules"}:
            raise ValueError(f"{source}: expected {{\"rules\": [...]}}, got keys {sorted(rules)}")
        rules = rules["rules"]
    if not isinstance(rules, (list, tuple)) or not rules:
        raise ValueError(f"{source}: expected a non-empty list of rules, got {rules!r}")
    out = []
    for i, rule in enumerate(rules):
        if isinstance(rule, PrecisionRule):
            out.append(rule)
            continue
        where = f"{source}, rule {i + 1}"
        if not isinstance(rule, dict) or "pattern" not in rule or "precision" not in rule:
            raise ValueError(f"{where}: each rule is a mapping with 'pattern' and 'precision', got {rule!r}")
        unknown = set(rule) - _KEYS
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; a rule takes {sorted(_KEYS)}")
        precision = str(rule["precision"]).lower()
        if precision not in ("fp8", *HIGH_PRECISION):
            raise ValueError(f"{where}: precision must be 'fp8', 'bf16' or 'high', got {rule['precision']!r}")
        if precision != "fp8" and set(rule) - {"pattern", "precision"}:
            raise ValueError(f"{where}: recipe and formats apply to precision 'fp8' only")
        if rule.get("recipe") is not None and rule["recipe"] not in RECIPES:
            raise ValueError(f"{where}: recipe must be one of {'|'.join(RECIPES)}, got {rule['recipe']!r}")
        for key in ("input_fmt", "grad_output_fmt", "weight_fmt"):
            if rule.get(key) is not None and rule[key] not in _FORMATS:
                raise ValueError(f"{where}: {key} must be 'e4m3' or 'e5m2', got {rule[key]!r}")
        overrides = tuple((k, str(rule[k])) for k in ("recipe", "input_fmt", "grad_output_fmt", "weight_fmt")
                          if rule.get(k) is not None)
        out.append(PrecisionRule(pattern=str(rule["pattern"]), precision=precision, overrides=overrides))
    return tuple(out)


def load_precision_file(path: str | Path) -> tuple[PrecisionRule, ...]:
    """Rules from a JSON file (``.json``) or a YAML file (``.yaml``/``.yml``, needs PyYAML)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"precision file {path} is a directory: give the .json/.yaml file of the rules")
    if not path.is_file():
        raise FileNotFoundError(f"precision file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as error:
            raise ValueError(f"{path}: reading YAML needs PyYAML (pip install pyyaml), or write the rules as JSON") from error
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            mark = getattr(error, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(error, "problem", None) or str(error).splitlines()[0]
            raise ValueError(f"{path}: not valid YAML{where} ({problem})") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}: not valid JSON ({error})") from None
    else:
        raise ValueError(f"{path}: a precision file is .json, .yaml or .yml")
    return parse_precision_rules(data, source=str(path))


class PrecisionPlan:
    """``rules`` applied to module names: :meth:`rule_for` (first match), the matches recorded per rule."""

    def __init__(self, rules: Iterable[PrecisionRule]) -> None:
        self.rules = tuple(rules)
        self.matches: dict[int, list[str]] = {i: [] for i in range(len(self.rules))}
        self.seen: list[str] = []  # every name asked about

    def rule_for(self, name: str) -> PrecisionRule | None:
        """The first rule whose pattern matches ``name`` (recorded), or None."""
        self.seen.append(name)
        for i, rule in enumerate(self.rules):
            if fnmatch.fnmatchcase(name, rule.pattern):
                self.matches[i].append(name)
                return rule
        return None

    def unmatched(self, also_matched: Iterable[str] = ()) -> list[str]:
        """Patterns that matched no name (``also_matched``: patterns other ranks matched)."""
        others = set(also_matched)
        return [r.pattern for i, r in enumerate(self.rules) if not self.matches[i] and r.pattern not in others]

    def check(self, also_matched: Iterable[str] = ()) -> None:
        """Raise ValueError naming every pattern that matched nothing."""
        missing = self.unmatched(also_matched)
        if missing:
            raise ValueError(f"precision rule pattern(s) {missing} match no linear layer; module names look like "
                             f"{self._examples()}")

    def _examples(self) -> list[str]:
        return self.seen[:3]

    def summary(self, max_names: int = 4) -> str:
        """One line per rule: its pattern, what it selects and how many linears (a few names) it matched."""
        lines = []
        for i, rule in enumerate(self.rules):
            names = self.matches[i]
            shown = ", ".join(names[:max_names]) + (f", ... ({len(names) - max_names} more)"
                                                    if len(names) > max_names else "")
            lines.append(f"rule {i + 1} {rule.pattern!r} -> {rule.describe()}: {len(names)} linear(s)"
                         + (f" ({shown})" if names else ""))
        return "\n".join(lines)
