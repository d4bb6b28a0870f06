"""Inputs refused up front, each with exit status 2 and one line naming the path or value and the fix (no
traceback), and the --load rules:

- every output path (pretrain_gpt.py ``--save``, ``--log-json``, ``--plot``, ``--collective-trace``;
  ``tools/convert_checkpoint.py --format hf OUTDIR``; the fine-tuning scripts' ``--output`` and ``--log-json``)
  is checked for writability before any training (one helper: megatron/training/monitoring/output_paths.py);
- ``--split``: up to three non-negative numbers with a positive sum;
- ``--load`` of a directory without a checkpoint is an error naming what is there (unless it is also
  ``--save``: a fresh job that resumes itself later); an ``iter_XXXXXXX`` directory is loaded, or refused
  with the fix when ``--ckpt-step``/``--iteration`` names another iteration, by pretrain_gpt.py and the
  converter alike; ``--ckpt-step N`` of a missing iteration says so (and lists the saved ones);
- a ``latest_checkpointed_iteration.txt.tmp`` left by a save killed before naming its checkpoint is removed
  when the directory is loaded again;
- a one-document corpus (no documents for the validation split) exits 2 with one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--mock-data", "--vocab-size", "256", "--no-progress", "--eval-iters", "1",
         "--fp8-opt-level", "none"]


def _run(args, cwd=ROOT):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600, env=env)


def _refused(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    for fragment in fragments:
        assert fragment in last, (fragment, last)
    return last


def _main_refuses(argv, capsys) -> str:
    """pretrain_gpt.main in this process: exit status 2 at validation (before torch.distributed, the model or any
    training), one line on stderr."""
    import pretrain_gpt

    assert pretrain_gpt.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def afile(tmp_path):
    path = tmp_path / "afile"
    path.write_text("not a directory\n")
    return path


# -- output paths ---------------------------------------------------------------------------------------------------
def test_output_paths_are_checked_before_training(tmp_path, afile, capsys):
    e = "pretrain_gpt.py: configuration error: "
    cases = [
        (["--save", f"{afile}/ck"], f"{e}--save {afile}/ck: cannot be created: {afile} is a file, not a directory: "
                                    f"choose a path in a directory"),
        (["--save", str(afile)], f"{e}--save {afile}: is a file, not a directory: name a directory (or remove the file)"),
        (["--log-json", f"{afile}/sub/log.jsonl"], f"{e}--log-json {afile}/sub/log.jsonl: cannot be created: {afile} "
                                                   f"is a file, not a directory"),
        (["--log-json", str(tmp_path)], f"{e}--log-json {tmp_path}: is a directory: name a file in it"),
        (["--plot", f"{afile}/curves.png"], f"{e}--plot {afile}/curves.png: cannot be created: {afile} is a file"),
        (["--collective-trace", str(afile)], f"{e}--collective-trace {afile}: is a file, not a directory"),
        # a directory this user cannot create entries in (/proc refuses even root)
        (["--save", "/proc/fp8lm-ckpt"], f"{e}--save /proc/fp8lm-ckpt: cannot be created: /proc is not writable by "
                                         f"this user: choose a path in a writable directory"),
    ]
    for flags, message in cases:
        assert _main_refuses(SMALL + flags, capsys).startswith(message), (flags, message)
    assert not any(p.name != "afile" for p in tmp_path.iterdir())  # nothing created, no probe left behind


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only-mode directories")
def test_an_unwritable_directory_is_refused(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    err = _main_refuses(SMALL + ["--save", str(locked / "ck")], capsys)
    assert f"--save {locked}/ck: cannot be created: {locked} is not writable by this user" in err
    err = _main_refuses(SMALL + ["--save", str(locked)], capsys)
    assert f"--save {locked}: is not writable by this user" in err


def test_converter_hf_output_is_checked_first(tmp_path, afile, capsys):
    from tools.convert_checkpoint import main as convert

    (tmp_path / "ck").mkdir()  # not even read: the output is checked before the checkpoint is
    for outdir, message in ((f"{afile}/hf", f"--format hf output {afile}/hf: cannot be created: {afile} is a file"),
                            ("/proc/fp8lm-hf", "--format hf output /proc/fp8lm-hf: cannot be created: /proc is not "
                                               "writable by this user")):
        with pytest.raises(SystemExit) as exit_:
            convert(["--format", "hf", str(tmp_path / "ck"), outdir])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("script", ["sft", "dpo"])
def test_finetune_outputs_are_checked_first(script, tmp_path, afile, capsys):
    import runpy

    # the script's functions, run as a module of its own (nothing imports the examples)
    main = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "finetune" / f"{script}.py"),
                          run_name=f"{script}_script")["main"]
    for flags, message in ((["--output", f"{afile}/out"], f"--output {afile}/out: cannot be created: {afile} is a file"),
                           (["--log-json", str(tmp_path)], f"--log-json {tmp_path}: is a directory")):
        with pytest.raises(SystemExit) as exit_:
            main(flags)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


# -- --split --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("split,message", [
    ("-1,2,0", "--split '-1,2,0' has a negative or non-finite weight"),
    ("a,b", "--split 'a,b': not numbers"),
    ("0,0,0", "--split '0,0,0' sums to 0 (no data for any split)"),
    ("1,2,3,4", "--split '1,2,3,4' has 4 parts"),
    ("nan,1,0", "--split 'nan,1,0' has a negative or non-finite weight"),
])
def test_bad_split_is_refused(split, message, capsys):
    err = _main_refuses(SMALL + [f"--split={split}"], capsys)
    assert err.startswith(f"pretrain_gpt.py: configuration error: {message}"), err
    assert err.endswith("give up to three non-negative weights with a positive sum, e.g. --split 949,50,1")


def test_split_in_any_notation_reaches_megatron_core_as_written():
    """megatron-core reads only digits and dots: 1e-3 would be two numbers; the weights are passed fixed-point."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.data.datasets import split_string

    validate_args(parse_args(SMALL + ["--split", "1e-3,1,0"]), world_size=1)
    assert parse_and_normalize_split(split_string("1e-3,1,0")) == pytest.approx([1e-3 / 1.001, 1 / 1.001, 0.0])
    assert parse_and_normalize_split(split_string("99,1")) == pytest.approx([0.99, 0.01, 0.0])


# -- --load ---------------------------------------------------------------------------------------------------------
def test_describe_no_checkpoint(tmp_path, afile):
    from megatron.training.checkpointing.checkpoint import describe_no_checkpoint

    assert describe_no_checkpoint(tmp_path / "typo").startswith("does not exist: pass a pretrain_gpt.py --save "
                                                                "directory or one of its iter_XXXXXXX directories")
    assert describe_no_checkpoint(afile).startswith("is a file, not a checkpoint directory")
    (tmp_path / "empty").mkdir()
    assert describe_no_checkpoint(tmp_path / "empty").startswith("is empty: ")
    (tmp_path / "run" / "iter_0000005").mkdir(parents=True)
    assert describe_no_checkpoint(tmp_path / "run") == (
        f"holds iter_0000005 but no latest_checkpointed_iteration.txt (a save interrupted before naming it): pass "
        f"--load {tmp_path}/run/iter_0000005 (one checkpoint), or --ckpt-step N")


def test_load_rules(tmp_path, capsys):
    ck = tmp_path / "ck"
    proc = _run(SMALL + ["--train-iters", "2", "--save", str(ck), "--save-interval", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("x")
    _refused(_run(SMALL + ["--train-iters", "2", "--load", str(junk)]),
             f"pretrain_gpt.py: --load {junk} holds no checkpoint (no latest_checkpointed_iteration.txt, no "
             f"iter_XXXXXXX directory; found: notes.txt): pass a pretrain_gpt.py --save directory")

    # An iter_XXXXXXX directory is that checkpoint: loaded (resumes at iteration 2).
    log = tmp_path / "log.jsonl"
    proc = _run(SMALL + ["--train-iters", "2", "--load", str(ck / "iter_0000001"), "--log-json", str(log)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    iterations = [r["iteration"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]
    assert iterations == [2], iterations
    _refused(_run(SMALL + ["--train-iters", "3", "--load", str(ck / "iter_0000001"), "--ckpt-step", "2"]),
             f"{ck}/iter_0000001 is the checkpoint of iteration 1, --ckpt-step asks for 2: pass its --save directory "
             f"{ck} with --ckpt-step 2, or leave --ckpt-step out")
    _refused(_run(SMALL + ["--train-iters", "4", "--load", str(ck), "--ckpt-step", "3"]),
             f"{ck}/iter_0000003 does not exist although --ckpt-step 3 asks for it (saved: iter_0000001, iter_0000002)")

    # The converter reads an iter_XXXXXXX directory the same way.
    from tools.convert_checkpoint import main as convert

    with pytest.raises(SystemExit) as exit_:
        convert([str(ck / "iter_0000001"), str(tmp_path / "m.safetensors"), "--iteration", "2"])
    assert exit_.value.code == 2
    assert (f"{ck}/iter_0000001 is the checkpoint of iteration 1, --iteration asks for 2" in capsys.readouterr().err)
    convert([str(ck / "iter_0000001"), str(tmp_path / "m.safetensors"), "--iteration", "1"])
    assert (tmp_path / "m.safetensors").is_file()

    # A save killed between renaming its directory and naming it leaves *.tmp: removed at the next load.
    for name in ("latest_checkpointed_iteration.txt.tmp", "progress.txt.tmp"):
        (ck / name).write_text("3\n")
    _refused(_run(SMALL + ["--train-iters", "2", "--load", str(ck), "--save", str(ck)]),
             "holds iteration 2, at or past --train-iters 2")
    assert sorted(p.name for p in ck.iterdir()) == ["iter_0000001", "iter_0000002",
                                                    "latest_checkpointed_iteration.txt", "progress.txt"]


def test_one_document_corpus_is_refused(tmp_path):
    import random

    from megatron.training.data.preprocess_data import preprocess
    from tests.e2e.test_data_tools import random_text

    rng = random.Random(1)
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": " ".join(random_text(rng, paragraphs=3)
                                                                      for _ in range(30))}) + "\n")
    result = preprocess(tmp_path / "docs.jsonl", tmp_path / "one", vocab_size=400, log=None)
    assert result.documents == 1
    _refused(_run(["--data-path", result.data_prefixes["text"], "--tokenizer-model", result.tokenizer_model,
                   "--train-iters", "2", "--no-progress", "--num-layers", "1", "--hidden-size", "64",
                   "--seq-length", "32", "--micro-batch-size", "2"], cwd=tmp_path),
             "pretrain_gpt.py: the valid split of", "gets documents [1, 1) of 1", "split='949,50,1'")
