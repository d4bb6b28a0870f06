"""One source of configuration rules (megatron/training/config_rules.py): pretrain_gpt.py's validate_args and
the memory planner's PlannerConfig accept and reject the same layouts, with the same message naming the fix;
one vocabulary of opt levels (``none``, ``O0`` its alias) across fp8.initialize, the flags and the planner."""

from __future__ import annotations

import pytest
import torch

import fp8
from megatron.training.arguments import ConfigurationError, parse_args, validate_args
from megatron.training.config_rules import OPT_LEVEL_ALIASES, OPT_LEVELS, check_config, normalize_opt_level
from megatron.training.planning.memory_plan import PlannerConfig

BASE = dict(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=64, micro_batch_size=2,
            tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=1, fp8_opt_level="none")


def _flags(cfg: dict) -> list[str]:
    flags = ["--mock-data", "--vocab-size", "256", "--dry-run"]
    for key, value in cfg.items():
        if key == "data_parallel_size":
            flags += ["--data-parallel-size", str(value)]
        elif value is True:
            flags.append("--" + key.replace("_", "-"))
        elif value is not None and value is not False:
            flags += ["--" + key.replace("_", "-"), str(value)]
    return flags


def _pretrain(cfg: dict):
    """validate_args on the equivalent pretrain_gpt.py flags (dry run: the layout without processes)."""
    return validate_args(parse_args(_flags(cfg)), world_size=1)


def _planner(cfg: dict) -> PlannerConfig:
    return PlannerConfig(vocab_size=256, bf16=False, **cfg)


CASES = [
    # (changes to BASE, None if accepted else the fix named in the message)
    (dict(), None),
    (dict(fp8_opt_level="O2"), None),
    (dict(fp8_opt_level="O0"), None),
    (dict(num_query_groups=2, tensor_model_parallel_size=2), None),
    # GQA: fewer query groups than TP ranks cannot be split (megatron-core: groups % TP == 0)
    (dict(num_query_groups=1, tensor_model_parallel_size=2), "--num-query-groups 1 must divide"),
    (dict(num_query_groups=2, tensor_model_parallel_size=4), "a TP size that divides 2"),
    (dict(num_query_groups=3), "--num-query-groups 3"),
    (dict(tensor_model_parallel_size=3), "TP size that divides the number of heads"),
    (dict(pipeline_model_parallel_size=3), "PP size that divides the number of layers"),
    (dict(hidden_size=260), "--num-attention-heads 8: change one of them"),
    (dict(ffn_hidden_size=1001, tensor_model_parallel_size=2), "--ffn-hidden-size 1001 is not divisible"),
    (dict(hidden_size=200, fp8_opt_level="O1"), "multiple of 16 x TP"),
    (dict(hidden_size=200), None),  # no FP8 GEMM at none
    (dict(seq_length=36, micro_batch_size=1, fp8_opt_level="O2"), "tokens must be a multiple of 16"),
    (dict(sequence_parallel=True, tensor_model_parallel_size=2, seq_length=33), "divisible by TP"),
    (dict(num_layers_per_virtual_pipeline_stage=1), "--pipeline-model-parallel-size > 1"),
    (dict(num_layers_per_virtual_pipeline_stage=3, pipeline_model_parallel_size=2), "layers per pipeline stage"),
    (dict(global_batch_size=6, micro_batch_size=4), "multiple of micro batch"),
    (dict(use_distributed_optimizer=True, fp8_opt_level="O2"), "--fp8-opt-level O3"),
    (dict(fp8_opt_level="O4"), "none|O1|O2|O3"),
]


@pytest.mark.parametrize("change,fix", CASES)
def test_pretrain_and_planner_agree(change, fix):
    cfg = {**BASE, **change}
    if fix is None:
        assert _pretrain(cfg).fp8_opt_level == _planner(cfg).fp8_opt_level == normalize_opt_level(cfg["fp8_opt_level"])
        return
    with pytest.raises(ValueError, match=fix):
        _planner(cfg)
    if cfg.get("fp8_opt_level") == "O4":  # argparse refuses it before validate_args
        with pytest.raises(SystemExit):
            _pretrain(cfg)
        return
    with pytest.raises(ConfigurationError, match=fix):
        _pretrain(cfg)


def test_check_config_is_the_one_rule_book():
    kwargs = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=1, ffn_hidden_size=256,
                  seq_length=16, micro_batch_size=1, global_batch_size=None, tensor_model_parallel_size=2,
                  pipeline_model_parallel_size=1, data_parallel_size=1, num_layers_per_virtual_pipeline_stage=None,
                  sequence_parallel=False, fp8_opt_level="none", use_distributed_optimizer=False)
    with pytest.raises(ConfigurationError, match="megatron-core splits the query groups over TP"):
        check_config(**kwargs)
    check_config(**{**kwargs, "num_query_groups": 2})
    assert issubclass(ConfigurationError, ValueError)


def test_one_vocabulary_of_opt_levels():
    assert fp8.OPT_LEVELS == OPT_LEVELS == ("none", "O1", "O2", "O3")
    assert fp8.OPT_LEVEL_ALIASES == OPT_LEVEL_ALIASES == {"O0": "none"}
    for level in (*OPT_LEVELS, "O0"):
        assert fp8.normalize_opt_level(level) == normalize_opt_level(level)
    assert normalize_opt_level("O0") == "none"
    with pytest.raises(ValueError, match="O0"):
        fp8.normalize_opt_level("O5")


def test_o0_is_none_everywhere():
    model = torch.nn.Linear(16, 16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for level in ("O0", "none"):
        assert fp8.initialize(model, optimizer, opt_level=level) == (model, optimizer)
    args = validate_args(parse_args(["--mock-data", "--fp8-opt-level", "O0", "--compare", "O0,O2"]), world_size=1)
    assert args.fp8_opt_level == "none" and args.compare_levels == ["O2"]
    assert PlannerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16,
                         fp8_opt_level="O0").fp8_opt_level == "none"
