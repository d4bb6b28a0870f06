"""``--fp8-precision-config FILE`` (issue 27): ordered glob rules over the model's module names, first match wins,
each linear built in high precision or in FP8 with the rule's recipe/formats; patterns matching nothing refused.

The Megatron model is built (``TrainingRun``) in one process and at PP2 (2 processes): names are those of the
single-process model, so a rule for global layer 2 reaches the second stage's first layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp8.precision_rules import PrecisionPlan, load_precision_file, parse_precision_rules
from megatron.training.arguments import ConfigurationError, parse_config
from megatron.training.model import precision_plan
from benchmarks.launch import spawn
from tests.spawn import free_port

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--mock-data", "--vocab-size", "128", "--train-iters", "1", "--fp8-min-dim", "0"]
RULES = {"rules": [
    {"pattern": "decoder.layers.2.*", "precision": "bf16"},
    {"pattern": "*.mlp.linear_fc2", "precision": "fp8", "recipe": "rowwise"},
    {"pattern": "*.linear_qkv", "precision": "fp8", "grad_output_fmt": "e4m3"},
]}


def _inspect(rank: int, world: int, port: int, flags: list[str], out: str) -> None:
    from megatron.core import parallel_state
    from tests.spawn import init_gloo_worker, megatron_run

    from fp8.parallel import ColumnParallelLinear, RowParallelLinear

    init_gloo_worker(rank, world, port)
    args, run, _ = megatron_run(flags, world)
    offset = 2 * parallel_state.get_pipeline_model_parallel_rank() if world == 2 else 0
    linears = {}
    for name, module in run.bare_chunks[0].named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            layer, rest = name.removeprefix("decoder.layers.").split(".", 1)
            fp8 = module.fp8
            linears[f"decoder.layers.{int(layer) + offset}.{rest}"] = (
                None if fp8 is None else {"recipe": fp8.recipe, "grad_output": fp8.grad_output.fmt},
                getattr(module, "fp8_kept_reason", None))
    Path(out, f"rank{rank}.json").write_text(json.dumps(linears))
    Path(out, f"kept{rank}.json").write_text(json.dumps([name for name, _ in run.fp8_selection[1]]))


@pytest.mark.parametrize("world", [1, 2])
def test_rules_choose_each_linear_by_its_global_name(tmp_path, world):
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps(RULES))
    flags = BASE + ["--fp8-precision-config", str(rules)] + (["--pipeline-model-parallel-size", "2"] if world == 2 else [])
    spawn(_inspect, (world, free_port(), flags, str(tmp_path)), world)
    linears = {}
    for r in range(world):
        linears.update(json.loads((tmp_path / f"rank{r}.json").read_text()))
    assert len(linears) == 16
    for name, (fp8, reason) in linears.items():
        if name.startswith("decoder.layers.2."):
            assert fp8 is None and reason == "precision rule 1 'decoder.layers.2.*' (--fp8-precision-config)"
        elif name.endswith("mlp.linear_fc2"):
            assert fp8 == {"recipe": "rowwise", "grad_output": "e5m2"}, name
        elif name.endswith("linear_qkv"):
            assert fp8 == {"recipe": "tensorwise", "grad_output": "e4m3"}, name
        else:  # no rule: the run's default
            assert fp8 == {"recipe": "tensorwise", "grad_output": "e5m2"}, name
    # the start-up selection names the kept linears as the rules do, by global name, on every stage
    kept = [name for r in range(world) for name in json.loads((tmp_path / f"kept{r}.json").read_text())]
    assert sorted(n for n in kept if n.startswith("decoder.")) == sorted(
        n for n in linears if n.startswith("decoder.layers.2."))


def _args(tmp_path, rules, extra=()):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps(rules))
    return parse_config(BASE + ["--fp8-precision-config", str(path), *extra], world_size=1)


def test_patterns_that_match_nothing_and_experts_told_apart_are_refused(tmp_path):
    args = _args(tmp_path, {"rules": [{"pattern": "decoder.layers.9.*", "precision": "bf16"},
                                      {"pattern": "*", "precision": "fp8"}]})
    with pytest.raises(ConfigurationError, match=r"\['decoder.layers.9.\*'\] match no linear layer"):
        precision_plan(args)
    moe = _args(tmp_path, {"rules": [{"pattern": "decoder.layers.0.mlp.experts.local_experts.1.*", "precision": "bf16"}]},
                ["--num-experts", "4"])
    with pytest.raises(ConfigurationError, match="experts of layer 0 .* match different rules"):
        precision_plan(moe)
    plan, decided = precision_plan(_args(tmp_path, {"rules": [{"pattern": "*.mlp.experts.*", "precision": "bf16"}]},
                                         ["--num-experts", "4"]))
    assert sorted(place for (_, place) in decided) == ["mlp.experts.linear_fc1"] * 4 + ["mlp.experts.linear_fc2"] * 4
    assert len(plan.matches[0]) == 4 * 4 * 2  # every expert's two linears, in each of the 4 layers


@pytest.mark.parametrize("rules,needle", [
    ({"rules": [{"pattern": "*", "precision": "fp4"}]}, "precision must be 'fp8', 'bf16' or 'high'"),
    ({"rules": [{"pattern": "*", "precision": "fp8", "recipe": "mx"}]}, "recipe must be one of"),
    ({"rules": [{"pattern": "*", "precision": "bf16", "recipe": "rowwise"}]}, "apply to precision 'fp8' only"),
    ({"rules": [{"pattern": "*", "precision": "fp8", "scale": 2}]}, "unknown key(s) ['scale']"),
    ({"rules": []}, "non-empty list of rules"),
])
def test_bad_rules_are_refused_at_start_up(tmp_path, rules, needle):
    with pytest.raises(ConfigurationError) as error:
        _args(tmp_path, rules)
    assert needle in str(error.value)


def test_rule_files_and_the_first_match(tmp_path):
    yaml_file = tmp_path / "rules.yaml"
    yaml_file.write_text("rules:\n  - {pattern: 'a.*', precision: high}\n  - {pattern: '*', precision: fp8}\n")
    plan = PrecisionPlan(load_precision_file(yaml_file))
    assert plan.rule_for("a.b").high_precision and not plan.rule_for("a").high_precision
    assert plan.rule_for("c.d").pattern == "*"
    assert plan.unmatched() == []
    assert "rule 1 'a.*' -> high precision: 1 linear(s) (a.b)" in plan.summary()
    with pytest.raises(ValueError, match="a precision file is .json, .yaml or .yml"):
        (tmp_path / "rules.txt").write_text("{}")
        load_precision_file(tmp_path / "rules.txt")
    assert parse_precision_rules([{"pattern": "x", "precision": "BF16"}])[0].high_precision
