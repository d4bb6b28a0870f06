"""Bad input to tools/preprocess_data.py and tools/convert_checkpoint.py: exit status 2 and one line naming
the path and the fix, never a traceback (run as a user runs them: subprocesses); outputs get the umask's
mode, all alike."""

from __future__ import annotations

import json
import os
import random
import re
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

from megatron.training.data.preprocess_data import preprocess, train_tokenizer  # noqa: E402
from tests.e2e.test_data_tools import random_text  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
VOCAB = 400


def tool(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / name), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def assert_user_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    """Exit status 2, one line on stderr holding every fragment, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for fragment in fragments:
        assert fragment in proc.stderr, (fragment, proc.stderr)


def _text(paragraphs: int, seed: int = 16) -> str:
    return random_text(random.Random(seed), paragraphs=paragraphs)


# -- tools/preprocess_data.py -------------------------------------------------------------------------------
def _bad_jsonl(root: Path) -> str:
    """A malformed line 31: read before any training (it used to surface as a sentencepiece failure)."""
    rng = random.Random(1)
    lines = [json.dumps({"text": random_text(rng, paragraphs=2)}) for _ in range(30)] + ['{"text": "x"']
    (root / "bad.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return "bad.jsonl"


def _nul_in_second_file(root: Path) -> str:
    (root / "in").mkdir()
    (root / "in" / "a.txt").write_text(_text(20), encoding="utf-8")
    (root / "in" / "b.txt").write_bytes(b"first line\nsecond \x00 line\n")
    return "in"


@pytest.mark.parametrize("make_input,prefix,fragments", [
    (_bad_jsonl, "out/p", ["bad.jsonl:31 is not valid JSON", "one JSON object per line"]),
    (_nul_in_second_file, "out/p", [os.path.join("in", "b.txt") + ":2 looks binary", "remove the NUL bytes"]),
    (None, "afile/p", ["--output-prefix 'afile/p': 'afile' is a file, not a directory",
                       "choose a prefix in a directory"]),
    (None, "afile/sub/p", ["'afile' is a file, not a directory"]),
    (None, "out/", ["--output-prefix 'out/' is not a file-name stem", "e.g. 'out/corpus'"]),
], ids=["malformed-jsonl-line", "nul-byte", "parent-is-a-file", "ancestor-is-a-file", "trailing-slash"])
def test_preprocess_refuses_bad_input_before_any_work(tmp_path, make_input, prefix, fragments):
    (tmp_path / "afile").write_text("not a directory\n")
    (tmp_path / "out").mkdir()
    source = make_input(tmp_path) if make_input else "in.txt"
    if make_input is None:
        (tmp_path / source).write_text(_text(30), encoding="utf-8")
    proc = tool("preprocess_data.py", "--input", source, "--output-prefix", prefix, "--vocab-size", str(VOCAB),
                cwd=tmp_path)
    assert_user_error(proc, *fragments)
    assert "sentencepiece" not in proc.stderr
    assert list((tmp_path / "out").iterdir()) == []  # nothing written (no tokenizer trained)
    assert not list(tmp_path.glob("out.*")) and not list(tmp_path.glob("out_*"))


def test_preprocess_vocab_size_larger_than_the_input_supports(tmp_path):
    (tmp_path / "in.txt").write_text(_text(30), encoding="utf-8")
    proc = tool("preprocess_data.py", "--input", "in.txt", "--output-prefix", "out/p", "--vocab-size", "30000",
                cwd=tmp_path)
    assert_user_error(proc, "--vocab-size 30000 is more than this input supports", "or give more input text")
    largest = int(re.search(r"training stopped at (\d+) pieces; pass --vocab-size (\d+) or less", proc.stderr)[1])
    assert VOCAB < largest < 30000
    assert not list((tmp_path / "out").glob("p*"))  # no model written

    # The number named is right: that many pieces train (one more does not).
    sentences = [line for line in _text(30).splitlines() if line.strip()]
    model = train_tokenizer(iter(sentences), tmp_path / "ok", vocab_size=largest)
    import sentencepiece

    assert sentencepiece.SentencePieceProcessor(model_file=str(model)).get_piece_size() == largest
    with pytest.raises(ValueError, match=f"--vocab-size {largest + 1} is more than this input supports"):
        train_tokenizer(iter(sentences), tmp_path / "over", vocab_size=largest + 1)


def test_preprocess_outputs_share_the_umask_mode(tmp_path):
    (tmp_path / "in.txt").write_text(_text(60), encoding="utf-8")
    old = os.umask(0o027)
    try:
        result = preprocess(tmp_path / "in.txt", tmp_path / "out" / "p", vocab_size=VOCAB, log=None)
    finally:
        os.umask(old)
    outputs = sorted((tmp_path / "out").iterdir())
    assert [p.name for p in outputs] == ["p.model", "p.vocab", "p_text_document.bin", "p_text_document.idx",
                                           "p_text_document.tokenizer.json"]
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in outputs} == {p.name: 0o640 for p in outputs}
    assert result.vocab_size == VOCAB


# -- tools/convert_checkpoint.py ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_checkpoint(tmp_path_factory) -> Path:
    """A one-process engine checkpoint of a very small model (fp8.checkpoint.save_checkpoint, O2)."""
    import torch

    import fp8
    from fp8.testing import GPTConfig, TinyGPT
    from fp8.checkpoint import save_checkpoint

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=64, seq_len=16, n_layer=1, d_model=32, n_head=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fp8.initialize(model, optimizer, "O2")
    path = tmp_path_factory.mktemp("engine") / "ckpt"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        save_checkpoint(path, model, optimizer)
    return path


def test_convert_creates_missing_output_directories(tmp_path, engine_checkpoint):
    proc = tool("convert_checkpoint.py", str(engine_checkpoint), "new/sub/model.safetensors", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "new" / "sub" / "model.safetensors"
    assert out.is_file() and "wrote new/sub/model.safetensors: " in proc.stdout
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask  # like any new file, not 0600
    assert [p.name for p in out.parent.iterdir()] == ["model.safetensors"]  # no temporary file left

    from safetensors.torch import load_file

    assert load_file(str(out))  # a whole safetensors file


def test_convert_names_the_path_and_the_fix(tmp_path, engine_checkpoint):
    (tmp_path / "afile").write_text("not a directory\n")
    (tmp_path / "empty").mkdir()
    ckpt = str(engine_checkpoint)
    cases = [
        (["missing", "m.safetensors"],
         ["checkpoint 'missing' does not exist", "pass a pretrain_gpt.py --save directory"]),
        (["afile", "m.safetensors"], ["checkpoint 'afile' is a file", "pass the checkpoint's directory"]),
        (["empty", "m.safetensors"], ["checkpoint 'empty' is not a checkpoint (no .metadata"]),
        ([ckpt, "afile/m.safetensors"], ["output 'afile/m.safetensors': 'afile' is a file, not a directory"]),
        ([ckpt, "empty"], ["output 'empty' is a directory", "e.g. 'empty/model.safetensors'"]),
        ([ckpt, "m.safetensors", "--iteration", "3"], ["is an engine checkpoint", "leave --iteration out"]),
    ]
    for args, fragments in cases:
        assert_user_error(tool("convert_checkpoint.py", *args, cwd=tmp_path), *fragments)
    assert not (tmp_path / "m.safetensors").exists() and list((tmp_path / "empty").iterdir()) == []


@pytest.fixture(scope="module")
def save_directory(tmp_path_factory) -> Path:
    """A pretrain_gpt.py --save directory of one iteration (tiny GPT, mock data, O2)."""
    save = tmp_path_factory.mktemp("megatron") / "save"
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "256",
             "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "4", "--mock-data",
             "--vocab-size", "512", "--eval-interval", "1000", "--eval-iters", "1", "--no-progress", "--lr", "3e-3",
             "--lr-warmup-iters", "0", "--lr-decay-iters", "8", "--train-iters", "1", "--fp8-opt-level", "O2",
             "--save", str(save), "--save-interval", "1"]
    proc = subprocess.run([sys.executable, str(REPO / "pretrain_gpt.py"), *flags], capture_output=True, text=True,
                          cwd=save.parent, env={**os.environ, "OMP_NUM_THREADS": "2"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return save


def test_convert_save_directory_iterations(tmp_path, save_directory):
    done = tool("convert_checkpoint.py", str(save_directory), "out/dir/it1.safetensors", "--iteration", "1",
                cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "dir" / "it1.safetensors").is_file()
    assert_user_error(tool("convert_checkpoint.py", str(save_directory), "x.safetensors", "--iteration", "7",
                           cwd=tmp_path),
                      "--iteration 7: ", "iter_0000007 does not exist (saved: iter_0000001)",
                      "pass a saved iteration, or leave --iteration out for the latest")
    assert not (tmp_path / "x.safetensors").exists()
