"""pretrain_gpt.py refuses bad input before building the model (exit 2, one line, no traceback), guards
resumes, trains with RoPE on CPU, and stops a run whose steps keep being skipped (exit 1, nothing saved)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.training.arguments import ConfigurationError, parse_args, validate_args
from megatron.training.monitoring.health import RunHealthError, SkipMonitor

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--mock-data", "--vocab-size", "256", "--no-progress", "--eval-iters", "1"]


def _run(args, timeout=600):
    return subprocess.run([sys.executable, "pretrain_gpt.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("flags,message", [
    (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
    (["--seq-length", "64", "--max-position-embeddings", "32"],
     "--seq-length 64 is above --max-position-embeddings 32 (learned positions): raise --max-position-embeddings"),
    (["--min-lr", "1e-2", "--lr", "1e-3"], "--min-lr 0.01 is above --lr 0.001"),
    (["--lr", "-1"], "--lr -1.0 and --min-lr 0.0 must be >= 0"),
    (["--train-iters", "0"], "--train-iters must be >= 1, got 0"),
    (["--max-skipped-steps", "-1"], "--max-skipped-steps must be >= 0"),
    # a flag that would have no effect here is refused, naming it and why
    (["--fp8-opt-level", "none", "--fp8-grad-accumulation", "fp16"],
     "--fp8-grad-accumulation: no effect, no FP8 level trains (--fp8-opt-level none)"),
    (["--fp8-opt-level", "none", "--fp8-precision-config", "rules.json", "--fp8-recipe", "rowwise"],
     "--fp8-recipe, --fp8-precision-config: no effect, no FP8 level trains"),
    (["--num-layers-at-start-in-bf16", "1"], "--num-layers-at-start-in-bf16: no effect without --first-last-layers-bf16"),
    (["--fp8-stats-flush-alarm", "0.2"], "--fp8-stats-flush-alarm: no effect without --fp8-stats-interval N"),
    (["--data-path", "corpus_text_document"], "--mock-data trains on synthetic tokens, so --data-path would be ignored"),
    (["--tokenizer-model", "tok.model"], "--mock-data trains on synthetic tokens, so --tokenizer-model would be ignored"),
    (["--moe-ffn-hidden-size", "64"], "--moe-ffn-hidden-size need(s) --num-experts"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "0"], "--moe-ffn-hidden-size must be >= 1, got 0"),
    (["--num-experts", "4", "--moe-ffn-hidden-size", "40"],
     "--moe-ffn-hidden-size 40: FP8 expert GEMMs need it to be a multiple of 16 x TP = 16"),
])
def test_configuration_rules_before_the_model_is_built(flags, message):
    with pytest.raises(ConfigurationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_args(parse_args(SMALL + flags), world_size=1)


def test_flags_with_an_effect_elsewhere_are_accepted():
    """The same flags where they act: an FP8 level among --compare's, the counts with --first-last-layers-bf16, the
    alarms with --fp8-stats-interval, a baseline expert size that is not a multiple of 16."""
    for flags in (["--fp8-opt-level", "none", "--compare", "O2", "--fp8-grad-accumulation", "fp32"],
                  ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "0"],
                  ["--fp8-stats-interval", "2", "--fp8-stats-flush-alarm", "0.2"],
                  ["--fp8-opt-level", "none", "--num-experts", "4", "--moe-ffn-hidden-size", "40"]):
        validate_args(parse_args(SMALL + flags), world_size=1)


def test_baseline_argv_drops_exactly_the_fp8_only_flags():
    """A harness training one flag set at several levels: the baseline's argv is the same run less the FP8-only
    flags, with their values (both spellings), and validates at --fp8-opt-level none."""
    from megatron.training.arguments import FP8_ONLY_FLAGS, baseline_argv

    fp8_flags = ["--fp8-recipe", "rowwise", "--fp8-min-dim=0", "--first-last-layers-bf16", "--fp8-stats-stop",
                 "--num-layers-at-end-in-bf16", "0"]
    argv = SMALL + ["--fp8-opt-level", "none"] + fp8_flags + ["--train-iters", "2"]
    kept = baseline_argv(argv)
    assert kept == SMALL + ["--fp8-opt-level", "none", "--train-iters", "2"]
    assert not any(a.split("=", 1)[0] in FP8_ONLY_FLAGS for a in kept)
    validate_args(parse_args(kept), world_size=1)
    with pytest.raises(ConfigurationError, match="no effect, no FP8 level trains"):
        validate_args(parse_args(argv), world_size=1)


def test_precision_files_that_cannot_be_read_are_named(tmp_path):
    pytest.importorskip("yaml")
    bad = tmp_path / "rules.yaml"
    bad.write_text("rules: [\n")
    with pytest.raises(ConfigurationError, match=r"rules.yaml: not valid YAML at line 2, column 1"):
        validate_args(parse_args(SMALL + ["--fp8-precision-config", str(bad)]), world_size=1)
    with pytest.raises(ConfigurationError, match=r"is a directory: give the .json/.yaml file of the rules"):
        validate_args(parse_args(SMALL + ["--fp8-precision-config", str(tmp_path)]), world_size=1)


def test_a_configuration_error_is_one_line_with_exit_code_2():
    proc = _run(SMALL + ["--min-lr", "1e-2", "--lr", "1e-3"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("pretrain_gpt.py: configuration error: --min-lr 0.01")
    assert "Traceback" not in proc.stderr


def test_skip_monitor_warns_once_and_stops_past_the_limit(capsys):
    monitor = SkipMonitor(max_skipped=2, window=4)
    rec = lambda i, s: {"iteration": i, "skipped": s, "loss": 1.0, "grad_norm": float("inf") if s else 1.0}  # noqa: E731
    monitor.observe([rec(1, False), rec(2, True), rec(3, False), rec(4, True)])
    assert capsys.readouterr().err.count("warning: iteration 2 was skipped") == 1
    monitor.observe([rec(5, False), rec(6, False), rec(7, True)])  # window 4..7 holds 2 skipped: not more than 2
    with pytest.raises(RunHealthError, match="3 of the 4 iterations 6-9 were skipped"):
        monitor.observe([rec(8, True), rec(9, True)])
    assert "warning" not in capsys.readouterr().err  # warned once per run


def test_a_run_that_is_not_training_stops_with_exit_code_1_and_saves_nothing(tmp_path):
    save = tmp_path / "ckpt"
    proc = _run(SMALL + ["--train-iters", "25", "--lr", "1e4", "--clip-grad", "0", "--log-interval", "5",
                         "--save", str(save), "--fp8-opt-level", "O2"])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "warning: iteration" in proc.stderr and "was skipped" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("pretrain_gpt.py: ") and "were skipped for non-finite gradients" in last
    assert "lower --lr" in last and "Traceback" not in proc.stderr
    assert not save.exists() or not any(save.glob("iter_*"))


def test_resume_guards_and_rope_on_cpu(tmp_path):
    """A --load path that does not exist is an error (unless it is the --save directory: a fresh job that
    resumes later); a loaded iteration at or past --train-iters is refused and nothing is overwritten. The
    first run uses RoPE: it trains on CPU."""
    missing = tmp_path / "typo"
    proc = _run(SMALL + ["--train-iters", "2", "--load", str(missing)])
    assert proc.returncode == 2 and f"--load {missing} does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr
    ckpt = tmp_path / "ckpt"
    rope = ["--position-embedding-type", "rope"]
    proc = _run(SMALL + rope + ["--train-iters", "4", "--save", str(ckpt), "--load", str(ckpt)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    latest = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    proc = _run(SMALL + rope + ["--train-iters", "2", "--save", str(ckpt), "--load", str(ckpt),
                                "--override-opt-param-scheduler"])
    assert proc.returncode == 2
    assert "holds iteration 4, at or past --train-iters 2: raise --train-iters" in proc.stderr
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == latest == "4"
    assert not (ckpt / "iter_0000002").exists()
    # Another FP8 recipe flag or optimizer hyper-parameter: refused, each difference named.
    proc = _run(SMALL + rope + ["--train-iters", "6", "--load", str(ckpt), "--fp8-amax-history-len", "8",
                                "--weight-decay", "0.01"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--fp8-amax-history-len 16 (checkpoint) vs 8 (this run)" in proc.stderr
    # What decides the parameters and each linear's precision: named with both values
    proc = _run(SMALL + rope + ["--train-iters", "6", "--load", str(ckpt), "--num-experts", "4",
                                "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "0"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "--num-experts None (checkpoint) vs 4 (this run)" in proc.stderr
    assert "--first-last-layers-bf16 False (checkpoint) vs True (this run)" in proc.stderr
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps([{"pattern": "decoder.layers.0.*", "precision": "bf16"}]))
    proc = _run(SMALL + rope + ["--train-iters", "6", "--load", str(ckpt), "--fp8-precision-config", str(rules)])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (f"--fp8-precision-config rules none (no --fp8-precision-config) (checkpoint) vs "
            f"[['decoder.layers.0.*', 'bf16', []]] from {rules} (this run)") in proc.stderr


def test_compare_saves_each_level_in_its_own_subdirectory(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = _run(SMALL + ["--train-iters", "2", "--fp8-opt-level", "O1", "--compare", "none", "--save", str(ckpt)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for level in ("none", "O1"):
        assert (ckpt / level / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert not (ckpt / "latest_checkpointed_iteration.txt").exists()


def test_bad_data_files_are_one_line_with_exit_code_2(tmp_path):
    (tmp_path / "d_text_document.idx").write_bytes(b"garbage")
    (tmp_path / "d_text_document.bin").write_bytes(b"xx")
    (tmp_path / "d.model").write_bytes(b"zz")
    proc = _run(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                 "--micro-batch-size", "2", "--train-iters", "2", "--data-path", str(tmp_path / "d_text_document"),
                 "--tokenizer-model", str(tmp_path / "d.model")])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"pretrain_gpt.py: {tmp_path}/d_text_document.idx is not a megatron-core index (bad header): rebuild it "
        f"with `python tools/preprocess_data.py --input YOUR_TEXT_OR_JSONL --output-prefix {tmp_path}/d`")


def test_a_corrupted_checkpoint_is_refused_or_falls_back_to_the_previous_good_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = _run(SMALL + ["--train-iters", "4", "--save", str(ckpt), "--save-interval", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = next(p for p in sorted((ckpt / "iter_0000004").iterdir()) if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # one flipped byte
    data.write_bytes(bytes(raw))
    resume = SMALL + ["--train-iters", "6", "--save", str(ckpt), "--load", str(ckpt), "--override-opt-param-scheduler"]
    proc = _run(resume)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert f"{data.name} does not match its checksum" in proc.stderr and "--load-fallback" in proc.stderr
    proc = _run(resume + ["--load-fallback"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "iteration 4 is corrupted" in proc.stderr and "--load-fallback loads iteration 2" in proc.stderr
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


# Every documented flag of pretrain_gpt.py trains once on CPU (here, three single-process runs); the parallel
# layout flags (--tensor/--pipeline-model-parallel-size, --num-layers-per-virtual-pipeline-stage,
# --sequence-parallel, --use-distributed-optimizer) train in tests/training/test_megatron_parallel.py, --data-parallel-size
# and --dry-run in tests/e2e/test_pretrain_gpt.py, the MoE flags in tests/training/test_moe.py, --first-last-layers-bf16 and its
# counts in tests/training/test_precision_layers.py, --fp8-stats-* in tests/training/test_fp8_stats.py, --tensorboard-dir and
# --wandb-project in tests/e2e/test_scalar_writers.py.
FLAG_RUNS = {
    "model_and_adam": [
        "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96", "--num-attention-heads", "4",
        "--num-query-groups", "2", "--seq-length", "32", "--max-position-embeddings", "48", "--vocab-size", "200",
        "--make-vocab-size-divisible-by", "64", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--position-embedding-type", "rope", "--init-method-std", "0.01",
        "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--recompute-activations", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--optimizer", "adam", "--lr", "2e-3", "--min-lr", "1e-4",
        "--lr-decay-style", "linear", "--lr-warmup-iters", "1", "--lr-decay-iters", "3", "--weight-decay", "0.01",
        "--adam-beta1", "0.8", "--adam-beta2", "0.9", "--adam-eps", "1e-6", "--clip-grad", "0.5",
        "--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1",
        "--max-skipped-steps", "3", "--skipped-steps-window", "10", "--seed", "7", "--fp32", "--mock-data",
        "--fp8-opt-level", "O2", "--fp8-amax-history-len", "4", "--fp8-margin", "1", "--fp8-grad-accumulation", "fp8",
        "--fp8-min-dim", "16", "--exit-interval", "3", "--no-progress"],
    "sgd_bf16_compare": [
        *SMALL, "--optimizer", "sgd", "--lr-decay-style", "constant", "--bf16", "--fp8-opt-level", "O1",
        "--compare", "none", "--fp8-pipeline", "off", "--train-iters", "3", "--exit-duration-in-mins", "60",
        "--exit-signal-handler", "--fp8-recipe", "rowwise", "--fp8-activations"],
    "data_and_checkpoints": [  # --data-path, --tokenizer-model, --save, --save-interval added by the test
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--split", "90,10,0", "--eval-interval", "3", "--eval-iters", "1", "--no-progress",
        "--fp8-recipe", "rowwise"],
}


@pytest.mark.parametrize("name", sorted(FLAG_RUNS))
def test_every_documented_flag_trains_once(tmp_path, name):
    flags = list(FLAG_RUNS[name]) + ["--log-json", str(tmp_path / "log.jsonl")]
    if name == "sgd_bf16_compare":
        flags += ["--plot", str(tmp_path / "curve.png")]
    if name == "data_and_checkpoints":
        from megatron.training.data.preprocess_data import preprocess

        text = "\n\n".join(f"Line {i} of a small corpus, with words enough to train on. " * 4 for i in range(300))
        (tmp_path / "in.txt").write_text(text)
        result = preprocess(tmp_path / "in.txt", tmp_path / "data", vocab_size=300, log=None)
        flags += ["--data-path", str(result.data_prefixes["text"]), "--tokenizer-model", str(result.tokenizer_model),
                  "--save", str(tmp_path / "ckpt"), "--save-interval", "2"]
    proc = _run(flags + ["--train-iters", "3"] if name == "data_and_checkpoints" else flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r.get("loss") is not None]
    assert losses and all(math.isfinite(x) for x in losses)
    if name == "data_and_checkpoints":  # --load, --ckpt-step, --override-opt-param-scheduler
        resumed = _run(flags + ["--train-iters", "4", "--load", str(tmp_path / "ckpt"), "--ckpt-step", "2",
                                "--override-opt-param-scheduler"])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
