"""pretrain_gpt.py: configuration errors that name the fix, the dry run, checkpoint resume, the layer spec
used directly with GPTModel, and the CPU compatibility layer."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron.training.arguments import ConfigurationError, config_from_args, parse_args, validate_args

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--mock-data", "--vocab-size", "256", "--no-progress"]


def _validate(flags, world=1):
    args = parse_args(flags)
    return validate_args(args, world_size=world)


@pytest.mark.parametrize("flags,world,fix", [
    (["--num-attention-heads", "6", "--tensor-model-parallel-size", "4", "--hidden-size", "96"], 4,
     "TP size that divides the number of heads"),
    (["--num-layers", "6", "--pipeline-model-parallel-size", "4"], 4, "PP size that divides the number of layers"),
    (["--hidden-size", "72", "--num-attention-heads", "4"], 1, "multiple of 16"),
    (["--tensor-model-parallel-size", "2"], 3, "launch a multiple of 2 processes"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, "multiple of micro batch"),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "33"], 2, "divisible by TP"),
])
def test_bad_configurations_name_the_fix(flags, world, fix):
    with pytest.raises(ConfigurationError, match=fix):
        _validate(flags, world)


def test_fp8_on_a_gpu_without_fp8_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ConfigurationError, match="compute capability >= 8.9.*--fp8-opt-level none"):
        _validate(["--fp8-opt-level", "O1"])
    assert _validate(["--fp8-opt-level", "none"]).fp8_opt_level == "none"


def test_no_arguments_is_the_demo():
    args = validate_args(parse_args([]))
    assert args.demo and args.fp8_opt_level == "O2" and args.compare_levels == ["none"]
    assert args.data_path is None and not args.mock_data


def _run(args, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_missing_data_files_stop_with_the_command_to_make_them(tmp_path):
    proc = _run(["pretrain_gpt.py", "--data-path", str(tmp_path / "nope_text_document"), "--tokenizer-model",
                 str(tmp_path / "nope.model"), "--train-iters", "1"])
    assert proc.returncode == 2
    assert "preprocess_data.py" in proc.stderr


def test_dry_run_prints_parameters_per_rank_without_allocating():
    proc = _run(["pretrain_gpt.py", "--dry-run", "--num-layers", "8", "--hidden-size", "256", "--num-attention-heads",
                 "8", "--seq-length", "128", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                 "--sequence-parallel", "--data-parallel-size", "4", "--micro-batch-size", "2", "--vocab-size", "1000",
                 "--fp8-opt-level", "O3", "--untie-embeddings-and-output-weights"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("dry run json: "))
    result = json.loads(line[len("dry run json: "):])
    h, layers_per_stage, vocab = 256, 4, 1024  # 1000 padded to a multiple of 128 x TP
    # Column-parallel weights/biases and row-parallel weights are sharded; row biases and norms are not.
    per_layer = (3 * h * h + 3 * h + h * h + 4 * h * h + 4 * h + 4 * h * h) // 2 + 2 * h + 4 * h
    first = layers_per_stage * per_layer + vocab * h // 2 + 128 * h
    last = layers_per_stage * per_layer + 2 * h + vocab * h // 2
    assert result["params_per_rank"] == {"stage_0": first, "stage_1": last}
    assert result["layout"]["world_size"] == 16


_IN_PROCESS = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, ".")
    import torch
    from megatron.training.arguments import parse_config
    from megatron.training import training
    flags = json.loads(sys.argv[1])
    out = {}
    def run(extra):
        return [r["loss"] for r in training.pretrain(parse_config(flags + extra))[-1]["train"]]
    out["full"] = run(["--train-iters", "4"])
    out["first"] = run(["--train-iters", "2", "--save", sys.argv[2]])
    out["resumed"] = run(["--train-iters", "4", "--load", sys.argv[2]])

    # The spec used directly, as a user would: GPTModel with get_gpt_layer_fp8_spec.
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training.gpt_layer_specs import get_gpt_layer_fp8_spec
    from fp8 import Float8Tensor
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               bias_activation_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
                               bias_dropout_fusion=False, gradient_accumulation_fusion=False)
    model = GPTModel(config, get_gpt_layer_fp8_spec(), vocab_size=256, max_sequence_length=32)
    tokens = torch.randint(0, 256, (2, 32))
    loss = model(tokens, torch.arange(32).expand(2, 32), None, labels=tokens).mean()
    loss.backward()
    out["spec_fp8_weights"] = sum(isinstance(p, Float8Tensor) for p in model.parameters())
    out["spec_loss"] = float(loss)
    out["spec_grads"] = all(p.grad is not None for p in model.parameters())
    print("RESULT " + json.dumps(out))
""")


def test_resume_continues_bit_exactly_and_spec_works_with_gpt_model(tmp_path):
    flags = SMALL + ["--global-batch-size", "4", "--fp8-opt-level", "O2", "--eval-interval", "0", "--seed", "11",
                     "--lr-decay-iters", "4"]
    proc = _run(["-c", _IN_PROCESS, json.dumps(flags), str(tmp_path / "ckpt")])
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[7:])
    assert out["first"] == out["full"][:2]
    assert out["resumed"] == out["full"][2:]
    assert out["spec_fp8_weights"] == 8 and out["spec_grads"]
    assert 5.0 < out["spec_loss"] < 6.5  # ~ln(256) at initialisation


def test_cpu_compat_rebinds_only_megatron_core(monkeypatch):
    from megatron.training.compat import cpu as cpu_compat

    current_device = torch.cuda.current_device
    assert cpu_compat.enable() is True and cpu_compat.enabled()
    assert torch.cuda.current_device is current_device  # torch itself untouched
    from megatron.core.pipeline_parallel import schedules

    assert schedules.torch.cuda.current_device() == torch.device("cpu")
    assert schedules.torch.zeros(2, device="cuda").device.type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_compat.enable() is False  # nothing to do where CUDA exists


@pytest.mark.parametrize("flag,expected", [([], "fp16"), (["--fp8-grad-accumulation", "fp8"], "fp8"),
                                           (["--fp8-grad-accumulation", "fp32"], "fp32")])
def test_fp8_grad_accumulation_flag_reaches_the_linear_recipe(flag, expected):
    from megatron.training.model import fp8_recipe_from_args

    config = config_from_args(_validate(["--fp8-opt-level", "O2", *flag]))
    assert fp8_recipe_from_args(config).grad_accumulation == expected
    with pytest.raises(SystemExit):
        parse_args(["--fp8-grad-accumulation", "bf16"])


def _summary(level, val_loss):
    return {"level": level, "final_train_loss": val_loss, "final_val_loss": val_loss, "tokens_per_s": 100.0,
            "model_state_bytes_per_param": 10.0, "comm_bytes_per_iteration": {}, "skipped_steps": 0}


def test_summary_compares_only_with_a_baseline_that_was_trained():
    from megatron.training.monitoring.log import format_summary

    with_base = format_summary([_summary("none", 4.0), _summary("O2", 4.2)])
    assert "+5.00%" in with_base and "no baseline" not in with_base
    without = format_summary([_summary("O2", 4.2), _summary("O1", 4.0)])
    assert "%" not in without and "--compare none" in without
    rows = [line.split() for line in without.splitlines()[1:3]]
    assert [row[3] for row in rows] == ["-", "-"]


def test_a_run_without_baseline_prints_no_comparison():
    proc = _run(["pretrain_gpt.py", *SMALL, "--global-batch-size", "2", "--train-iters", "2", "--eval-interval", "2",
                 "--eval-iters", "1", "--fp8-opt-level", "O2"], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = proc.stdout[proc.stdout.index("level  train loss"):]
    assert "+0.00%" not in summary and "no baseline was trained" in summary
    o2 = next(line for line in summary.splitlines() if line.startswith("O2 "))
    assert o2.split()[3] == "-"


def test_a_level_stopped_before_evaluating_shows_no_nan_and_says_why(capsys):
    """After a SIGTERM (or --exit-interval) before the first evaluation: no 'nan' nor '+nan%' in the summary, and the
    note names the stop, not --eval-interval."""
    from megatron.training.config import LoggingConfig, RunConfig
    from megatron.training.monitoring.log import TrainingLogger, format_summary

    stopped = [{**_summary(level, 4.0), "final_val_loss": float("nan")} for level in ("none", "O2")]
    table = format_summary(stopped)
    assert "nan" not in table.lower()
    logger = TrainingLogger(RunConfig(logging=LoggingConfig(no_progress=True)), rank=0, is_logging_rank=True)
    history = {"summary": stopped[1],
               "stopped": {"iteration": 3, "reason": "SIGTERM", "saved": False}}
    logger.finish([history])
    out = capsys.readouterr().out
    assert "nan" not in out.lower()
    assert "stopped after iteration 3 (SIGTERM) before an evaluation" in out and "--eval-interval" not in out
