"""The run's typed configuration (megatron/training/config.py): every flag has one home, the config is frozen, the
checkpoint's resume rules are read from its declarations, and no training component reads the argparse namespace."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from megatron.training.arguments import build_parser, parse_args, parse_config, validate_args
from megatron.training.config import (RESUME_MATCH, RESUME_SCHEDULE, SECTIONS, RunConfig, config_from_args)

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--mock-data", "--vocab-size", "256"]
# Modules that read a command line's namespace: pretrain_gpt.py's parser, and the separate command lines of the
# fine-tuning scripts and the memory planner (tools/memory_planner.py: PlannerConfig.from_args).
PARSERS = {"megatron/training/arguments.py", "megatron/training/config.py", "megatron/training/config_rules.py",
           "megatron/training/finetune/cli.py", "megatron/training/finetune/runtime.py",
           "megatron/training/finetune/loop.py", "megatron/training/finetune/demo.py",
           "megatron/training/planning/memory_plan.py"}


def _homes() -> dict[str, list[str]]:
    homes: dict[str, list[str]] = {}
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            homes.setdefault(f.name, []).append(name)
    return homes


def test_every_flag_has_exactly_one_section():
    homes = _homes()
    assert {name: where for name, where in homes.items() if len(where) > 1} == {}
    dests = {a.dest for a in build_parser()._actions if a.dest != "help"} - {"dry_run"}
    assert sorted(dests - set(homes)) == []
    # and the fields validate_args derives (sizes filled in, rules read) land in a section too
    args = validate_args(parse_args(SMALL), world_size=1)
    derived = set(vars(args)) - dests - {"explicit_flags", "demo", "dry_run"}
    assert derived and sorted(derived - set(homes)) == []


def test_a_destination_without_a_section_is_refused_naming_the_module():
    args = validate_args(parse_args(SMALL), world_size=1)
    args.brand_new_flag = 3
    with pytest.raises(TypeError, match="brand_new_flag.*megatron/training/config.py"):
        config_from_args(args)


def test_the_config_is_frozen_and_replace_makes_a_new_one():
    cfg = parse_config([*SMALL, "--compare", "none,O1"], world_size=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.precision.fp8_opt_level = "O1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model = None
    hash(cfg)  # no list, dict or set anywhere inside: nothing a component could change in place
    assert cfg.precision.compare_levels == ("none", "O1")
    assert cfg.precision.trained_levels == ("none", "O1", "O2")
    other = cfg.replace(precision={"fp8_opt_level": "O3"}, checkpoint={"save": "/tmp/x"})
    assert (other.precision.fp8_opt_level, other.checkpoint.save) == ("O3", "/tmp/x")
    assert (cfg.precision.fp8_opt_level, cfg.checkpoint.save) == ("O2", None)
    assert other.model is cfg.model
    with pytest.raises(TypeError, match="no section 'precison'"):
        cfg.replace(precison={"fp8_opt_level": "O1"})


def test_the_derived_sizes_are_in_the_config():
    cfg = parse_config([*SMALL, "--global-batch-size", "8"], world_size=1)
    assert (cfg.model.ffn_hidden_size, cfg.model.max_position_embeddings) == (256, 32)
    assert (cfg.parallel.data_parallel_size, cfg.training.num_microbatches, cfg.optimizer.lr_decay_iters) == (1, 4, 300)


def test_flat_is_every_field_by_its_flags_name():
    cfg = parse_config(SMALL, world_size=1)
    flat = cfg.flat()
    assert set(flat) == set(_homes()) | {"dry_run", "demo"}
    assert flat["num_layers"] == 2 and flat["fp8_opt_level"] == "O2"


def test_resume_rules_are_declared_on_the_fields():
    """What a checkpoint must match: the model's shapes and kinds, the precision of its states and the optimizer kind
    (a checkpoint with other values is refused naming the flag); the schedule unless --override-opt-param-scheduler."""
    assert set(RESUME_MATCH) == {
        "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
        "max_position_embeddings", "normalization", "swiglu", "disable_bias_linear",
        "untie_embeddings_and_output_weights", "position_embedding_type", "fp8_opt_level", "optimizer",
        "use_distributed_optimizer", "make_vocab_size_divisible_by", "fp8_amax_history_len", "fp8_margin",
        "fp8_grad_accumulation", "fp8_recipe", "num_experts", "moe_ffn_hidden_size",
        "moe_shared_expert_intermediate_size", "moe_router_topk", "first_last_layers_bf16",
        "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16", "fp8_precision_rules"}
    assert set(RESUME_SCHEDULE) == {"lr", "min_lr", "lr_decay_style", "lr_warmup_iters", "lr_decay_iters",
                                    "global_batch_size", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps"}
    assert not set(RESUME_MATCH) & set(RESUME_SCHEDULE)


def test_the_checkpoint_and_the_planner_read_the_config():
    """No second list of flags: the checkpoint compares RESUME_MATCH/RESUME_SCHEDULE, the planner plans a RunConfig."""
    from megatron.training.planning.memory_plan import PlannerConfig

    source = (ROOT / "megatron/training/checkpointing/checkpoint.py").read_text()
    assert "RESUME_MATCH" in source and "RESUME_SCHEDULE" in source
    assert "_MODEL_ARGS" not in source and "_SCHEDULE_ARGS" not in source
    cfg = parse_config([*SMALL, "--fp8-recipe", "rowwise", "--num-experts", "4", "--disable-bias-linear"],
                       world_size=1)
    planned = PlannerConfig.from_run_config(cfg)
    assert (planned.fp8_recipe, planned.num_experts, planned.hidden_size, planned.vocab_size) == ("rowwise", 4, 64, 256)


def test_no_component_reads_the_namespace():
    """Outside the command lines' own modules (PARSERS) nothing takes an argparse namespace or restates a flag's
    default with ``getattr(args, ...)``: components take the RunConfig or one of its sections."""
    offenders = []
    for path in sorted((ROOT / "megatron/training").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in PARSERS:
            continue
        text = path.read_text()
        for pattern in (r"getattr\((self\.)?args\b", r"argparse\.Namespace", r"\bimport argparse\b"):
            if re.search(pattern, text):
                offenders.append(f"{rel}: {pattern}")
    assert offenders == []
    assert "argparse" not in (ROOT / "pretrain_gpt.py").read_text()


def test_run_config_defaults_are_the_parsers():
    """A RunConfig() built in Python (tests, notebooks) has the command line's defaults, section by section."""
    parser = build_parser()
    default = RunConfig()
    for name, cls in SECTIONS.items():
        section = getattr(default, name)
        for f in dataclasses.fields(cls):
            if f.name in {a.dest for a in parser._actions}:
                assert getattr(section, f.name) == parser.get_default(f.name), (name, f.name)


@pytest.mark.parametrize("flags,inner", [
    (["--fp8-opt-level", "none"], "AdamW"), (["--fp8-opt-level", "none", "--bf16"], "BF16MasterOptimizer"),
    (["--fp8-opt-level", "O1"], "MasterWeightOptimizer"), (["--fp8-opt-level", "O2"], "AdamW"),
    (["--fp8-opt-level", "O2", "--optimizer", "sgd"], "SGD"),
])
def test_every_level_has_the_one_optimizer_interface(flags, inner):
    """build_optimizer returns a TrainingOptimizer at every level: the loop and the checkpoints call its methods,
    never the level's own types."""
    import torch

    from megatron.core import parallel_state
    from megatron.training.compat import cpu as cpu_compat
    from megatron.training.model import build_model, transformer_config_from_args
    from megatron.training.optimizer import TrainingOptimizer, build_optimizer
    from megatron.training.training import initialize_distributed

    cfg = parse_config([*SMALL, *flags], world_size=1)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    initialize_distributed(cfg)
    cpu_compat.seed(cfg.training.seed)
    chunks = build_model(cfg, transformer_config_from_args(cfg, torch.float32), 256)
    optimizer = build_optimizer(cfg, chunks, None)
    assert isinstance(optimizer, TrainingOptimizer) and type(optimizer.inner).__name__ == inner
    assert optimizer.owner is None and all(optimizer.owns(p) for c in chunks for p in c.parameters())
    assert (optimizer.main_grads is not None) == ("--bf16" in flags)
    fp8_masters = bool(optimizer.masters)
    assert fp8_masters == (flags[1] == "O1" or "--bf16" in flags)
    optimizer.set_lr(0.5)
    assert all(g["lr"] == 0.5 for g in optimizer.param_groups)
    optimizer.zero_grad()
    optimizer.step(torch.tensor(True))  # no gradient: a step that changes nothing, at every level
    skipped = optimizer.skipped_steps
    assert (skipped is None) == (flags[1] == "none" and "--bf16" not in flags)
    source = (ROOT / "megatron/training/training.py").read_text() + (
        ROOT / "megatron/training/checkpointing/checkpoint.py").read_text()
    assert 'getattr(optimizer, "' not in source and 'getattr(self.optimizer, "' not in source
