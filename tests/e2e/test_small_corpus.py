"""A new user's corpus: 300 documents, preprocessed with tools/preprocess_data.py, trains with
pretrain_gpt.py's default flags (Megatron's --split 949,50,1 leaves the test split without documents:
it is dropped with a warning since no test evaluation is asked for). Splits that are needed still fail
clearly; bad preprocessing input (empty, binary, malformed JSONL) gets a clear error."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.e2e.test_data_tools import random_text  # noqa: E402
from megatron.training.data.preprocess_data import preprocess  # noqa: E402


@pytest.fixture(scope="module")
def corpus300(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus300")
    rng = random.Random(300)
    with open(root / "docs.jsonl", "w", encoding="utf-8") as f:
        for _ in range(300):
            f.write(json.dumps({"text": random_text(rng, paragraphs=3)}) + "\n")
    result = preprocess(root / "docs.jsonl", root / "small", vocab_size=400, log=None)
    assert result.documents == 300
    return result.data_prefixes["text"], result.tokenizer_model


def test_300_documents_train_with_default_flags(corpus300, tmp_path):
    prefix, model = corpus300
    cmd = [sys.executable, str(ROOT / "pretrain_gpt.py"), "--data-path", prefix, "--tokenizer-model", model,
           "--train-iters", "2", "--no-progress", "--log-json", str(tmp_path / "log.jsonl")]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "the test split" in output and "dropped" in output, output[-3000:]
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 2 and all(loss == loss and loss > 0 for loss in losses)
    assert any("val_loss" in r for r in records)  # the validation split (15 documents) evaluated


def test_needed_split_without_documents_still_fails(corpus300, tmp_path):
    from megatron.training.data.datasets import build_gpt_datasets

    prefix, model = corpus300
    with pytest.raises(ValueError, match="the valid split .* fewer than one sample"):
        build_gpt_datasets(prefix, model, 64, "999999,1,0", (10, 1, 0), 1, tmp_path / "c")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train, valid, test = build_gpt_datasets(prefix, model, 64, "999999,1,0", (10, 0, 0), 1, tmp_path / "c")
    assert train is not None and valid is None and test is None
    assert any("the valid split" in str(w.message) and "dropped" in str(w.message) for w in caught)


@pytest.mark.parametrize("name,content,message", [
    ("empty.txt", b"", "holds no text"),
    ("image.txt", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "looks binary"),
    ("latin1.txt", "caf\u00e9 cr\u00e8me".encode("latin-1"), "is not UTF-8 text"),
    ("bad.jsonl", b'{"text": "one"}\n{"text": "two"\n', "bad.jsonl:2 is not valid JSON"),
    ("list.jsonl", b'["text"]\n', "is a JSON list, expected an object"),
])
def test_preprocess_names_bad_input(tmp_path, name, content, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        preprocess(tmp_path / name, tmp_path / "out", vocab_size=400, log=None)
    cli = subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(tmp_path / name),
                          "--output-prefix", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert cli.returncode != 0 and message.split(" .* ")[0].replace("\\", "") in cli.stderr and "Traceback" not in cli.stderr
