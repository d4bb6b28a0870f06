"""Data side of GPT pretraining: tools/preprocess_data.py, the sentencepiece tokenizer, megatron-core
GPTDatasets and micro-batches, the clear errors, and the cached default corpus (on a small stand-in text)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy
import pytest
import sentencepiece
import torch

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex).*")

from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: E402
from megatron.training.data.datasets import (  # noqa: E402
    build_gpt_datasets,
    check_data_files,
    gpt_batch_iterator,
    prepare_default_corpus,
)
from megatron.training.data.tokenizer import SentencePieceTokenizer, load_sentencepiece_model  # noqa: E402
from tests.spawn import free_port, spawn  # noqa: E402
from megatron.training.data import preprocess_data  # noqa: E402
from tools.preprocess_data import preprocess, split_text_documents  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
VOCAB = 400  # small vocabularies keep sentencepiece training well under a second
_EXTRA = ["é", "ß", "日本", "🙂", "\t", "  ", "—", "ø"]


def random_text(rng: random.Random, paragraphs: int = 120) -> str:
    """Paragraphs of multi-line pseudo-words (a few non-ASCII characters and odd spacing among them)."""
    syllables = ["ka", "lo", "mi", "ra", "sen", "tu", "ve", "qua", "dor", "ix", "pe", "gha"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(300)]
    out = []
    for _ in range(paragraphs):
        lines = []
        for _ in range(rng.randint(1, 4)):
            line = " ".join(rng.choices(words, k=rng.randint(3, 12)))
            if rng.random() < 0.3:
                line += rng.choice(_EXTRA) + rng.choice(words)
            lines.append(line.capitalize() + rng.choice([".", ",", ";", "!", ""]))
        out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


def read_documents(prefix: str) -> list[list[int]]:
    """All documents of an indexed dataset as lists of ids."""
    dataset = IndexedDataset(prefix)
    return [dataset[i].tolist() for i in range(len(dataset))]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """One trained tokenizer and text dataset shared by the dataset tests: ``(prefix, model, text, result)``."""
    rng = random.Random(20261130)
    root = tmp_path_factory.mktemp("corpus")
    text = random_text(rng, paragraphs=400)
    (root / "input.txt").write_text(text, encoding="utf-8")
    result = preprocess(root / "input.txt", root / "out", vocab_size=VOCAB, document_chars=200, log=None)
    return result.data_prefixes["text"], result.tokenizer_model, text, result


# -- preprocessing ----------------------------------------------------------------------------------------
def test_split_text_documents_concatenate_back(seed):
    text = random_text(random.Random(seed), paragraphs=30).replace("\n\n", "\n \n\n", 3)  # odd blank lines
    for chars in (0, 1, 150, 10**9):
        documents = split_text_documents(text, chars)
        assert "".join(documents) == text
        assert all(len(d) >= chars for d in documents[:-1])
        assert all(d.strip() for d in documents)
    assert len(split_text_documents(text, 0)) == 30  # one per paragraph
    assert len(split_text_documents(text, 10**9)) == 1
    assert split_text_documents(" \n\n\t\n", 0) == []
    assert split_text_documents("a\r\n \r\nb\n\n", 0) == ["a\r\n \r\n", "b\n\n"]


def test_text_round_trip_with_trained_tokenizer(tmp_path, seed):
    text = random_text(random.Random(seed), paragraphs=300)
    (tmp_path / "input.txt").write_text(text, encoding="utf-8")
    result = preprocess(tmp_path / "input.txt", tmp_path / "out", vocab_size=VOCAB, document_chars=200, log=None)
    prefix, model = result.data_prefixes["text"], result.tokenizer_model
    tokenizer = SentencePieceTokenizer(model)
    assert result.trained_tokenizer and Path(model).is_file() and Path(model).with_suffix(".vocab").is_file()
    assert Path(prefix).name == "out_text_document"
    assert tokenizer.vocab_size == result.vocab_size <= VOCAB
    assert (tokenizer.eod, tokenizer.pad) == (2, 3)

    expected = split_text_documents(text, 200)
    documents = read_documents(prefix)
    assert len(documents) == result.documents == len(expected)
    assert sum(map(len, documents)) == result.tokens
    for ids, doc in zip(documents, expected):
        assert ids[-1] == tokenizer.eod and tokenizer.eod not in ids[:-1]
        assert ids[:-1] == tokenizer.tokenize(doc)
        assert tokenizer.detokenize(ids[:-1]) == doc
    assert "".join(tokenizer.detokenize(ids) for ids in documents) == text  # EOD decodes to nothing
    assert tokenizer.detokenize(torch.tensor(documents[0])) == expected[0]


def test_jsonl_directory_with_given_tokenizer(tmp_path, seed, corpus):
    """A directory of JSONL and text (recursive, sorted, hidden files skipped), with an existing model."""
    rng = random.Random(seed)
    records = [random_text(rng, paragraphs=rng.randint(1, 3)) for _ in range(12)]
    records[3] = "unseen: ∮ ⊕ 𝔉 \u0000 \u2028 \r\n"  # byte fallback round-trips what training never saw
    (tmp_path / "in" / "b").mkdir(parents=True)
    with open(tmp_path / "in" / "a.jsonl", "w", encoding="utf-8") as f:
        for i, record in enumerate(records[:8]):
            f.write(json.dumps({"id": i, "text": record}, ensure_ascii=False) + "\n")
        f.write(json.dumps({"text": "   "}) + "\n\n")  # empty documents are skipped
    (tmp_path / "in" / "b" / "c.json").write_text(
        "".join(json.dumps({"text": r}) + "\n" for r in records[8:10]), encoding="utf-8"
    )
    (tmp_path / "in" / "d.txt").write_bytes((records[10] + "\r\n\r\n" + records[11]).encode())  # CRLF kept
    (tmp_path / "in" / ".hidden.txt").write_text("never read", encoding="utf-8")
    _, model, _, _ = corpus

    result = preprocess(tmp_path / "in", tmp_path / "out" / "ds", tokenizer_model=model, document_chars=10**9, log=None)
    assert not result.trained_tokenizer and not (tmp_path / "out" / "ds.model").exists()
    assert result.files == 3
    tokenizer = SentencePieceTokenizer(model)
    expected = records[:10] + [records[10] + "\r\n\r\n" + records[11]]
    documents = read_documents(result.data_prefixes["text"])
    assert [tokenizer.detokenize(ids[:-1]) for ids in documents] == expected
    assert [ids[:-1] for ids in documents] == [tokenizer.tokenize(doc) for doc in expected]

    result = preprocess(
        tmp_path / "in" / "a.jsonl", tmp_path / "noeod", tokenizer_model=model, append_eod=False, log=None
    )
    assert [tokenizer.detokenize(ids) for ids in read_documents(result.data_prefixes["text"])] == records[:8]


def test_preprocessing_is_deterministic(tmp_path, corpus):
    prefix, model, _, _ = corpus
    source = Path(model).parent / "input.txt"
    result = preprocess(source, tmp_path / "again", vocab_size=VOCAB, document_chars=200, log=None)
    assert Path(result.tokenizer_model).read_bytes() == Path(model).read_bytes()
    for ext in ("bin", "idx"):
        assert Path(f"{result.data_prefixes['text']}.{ext}").read_bytes() == Path(f"{prefix}.{ext}").read_bytes()


# -- datasets ---------------------------------------------------------------------------------------------
def _expected_window(dataset, idx: int) -> numpy.ndarray:
    """Sample ``idx`` recomputed from the dataset's document/sample/shuffle indices."""
    lengths = dataset.dataset.sequence_lengths
    order = numpy.asarray(dataset.document_index)
    stream = numpy.concatenate([dataset.dataset[int(d)] for d in order]).astype(numpy.int64)
    starts = numpy.concatenate([[0], numpy.cumsum(lengths[order])])
    doc, offset = dataset.sample_index[dataset.shuffle_index[idx]]
    start = starts[doc] + offset
    return stream[start : start + dataset.config.sequence_length + 1]


def test_gpt_dataset_samples(corpus, seed, tmp_path):
    prefix, model, _, result = corpus
    tokenizer = SentencePieceTokenizer(model)
    seq = 32
    train, valid, test = build_gpt_datasets(prefix, tokenizer, seq, "90,10,0", (50, 10, 0), seed, tmp_path / "c1")
    assert test is None and len(train) >= 50 and len(valid) >= 10
    for idx in range(4):
        sample = train[idx]
        assert set(sample) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert sample["tokens"].shape == sample["labels"].shape == (seq,)
        window = _expected_window(train, idx)
        assert torch.equal(sample["tokens"], torch.from_numpy(window[:-1]))
        assert torch.equal(sample["labels"], torch.from_numpy(window[1:]))
        assert torch.equal(sample["position_ids"], torch.arange(seq))
        assert torch.equal(sample["loss_mask"], torch.ones(seq))
        assert int(sample["tokens"].max()) < tokenizer.vocab_size
    # the validation documents come after the training ones (megatron splits by document, in file order)
    assert train.indices.max() < valid.indices.min()

    again, _, _ = build_gpt_datasets(prefix, model, seq, [0.9, 0.1, 0.0], (50, 10, 0), seed, tmp_path / "c2")
    other, _, _ = build_gpt_datasets(prefix, tokenizer, seq, "90,10,0", (50, 10, 0), seed + 1, tmp_path / "c1")
    first = [train[i]["tokens"] for i in range(8)]
    assert all(torch.equal(a, again[i]["tokens"]) for i, a in enumerate(first))
    assert not all(torch.equal(a, other[i]["tokens"]) for i, a in enumerate(first))
    assert len(list((tmp_path / "c1").iterdir())) == 1  # one fingerprint folder for one dataset


def test_batch_iterator(corpus, seed, tmp_path):
    prefix, model, _, _ = corpus
    train, _, _ = build_gpt_datasets(prefix, model, 16, "1", (40, None, None), seed, tmp_path)
    batches = list(gpt_batch_iterator(train, 4))
    assert len(batches) == len(train) // 4
    assert {k: tuple(v.shape) for k, v in batches[0].items()} == {
        "tokens": (4, 16), "labels": (4, 16), "loss_mask": (4, 16), "position_ids": (4, 16),
    }
    assert batches[0]["tokens"].dtype == torch.long and batches[0]["loss_mask"].dtype == torch.float32
    assert torch.equal(batches[1]["tokens"], torch.stack([train[i]["tokens"] for i in range(4, 8)]))
    rank1 = next(gpt_batch_iterator(train, 2, data_parallel_rank=1, data_parallel_size=2))
    assert torch.equal(rank1["tokens"], batches[0]["tokens"][2:])
    resumed = next(gpt_batch_iterator(train, 4, consumed_samples=8))
    assert torch.equal(resumed["labels"], batches[2]["labels"])
    cycled = list(zip(range(len(batches) + 3), gpt_batch_iterator(train, 4, cycle=True)))
    assert len(cycled) == len(batches) + 3


def test_tokenizer_without_pad(tmp_path, corpus, seed):
    """A model trained elsewhere (no <pad>) works; the dataset then pads with -1, never a real id."""
    _, _, text, _ = corpus
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(text.splitlines()), model_prefix=str(tmp_path / "plain"), vocab_size=VOCAB,
        pad_id=-1, byte_fallback=True, minloglevel=2, hard_vocab_limit=False,
    )
    tokenizer = SentencePieceTokenizer(tmp_path / "plain.model")
    assert tokenizer.pad is None and tokenizer.eod == 2
    (tmp_path / "input.txt").write_text(text, encoding="utf-8")
    prefix = preprocess(tmp_path / "input.txt", tmp_path / "plain_data", tokenizer_model=tmp_path / "plain.model",
                        log=None).data_prefixes["text"]
    train, _, _ = build_gpt_datasets(prefix, tokenizer, 16, "1", (8, None, None), seed, tmp_path)
    assert torch.equal(train[0]["loss_mask"], torch.ones(16))


def test_tokenizer_pickles(corpus):
    import pickle

    tokenizer = SentencePieceTokenizer(corpus[1])
    clone = pickle.loads(pickle.dumps(tokenizer))
    assert clone.tokenize("Kalo mira!\n") == tokenizer.tokenize("Kalo mira!\n")
    assert clone.unique_identifiers == tokenizer.unique_identifiers


# -- errors ---------------------------------------------------------------------------------------------
def test_clear_errors(tmp_path, corpus):
    prefix, model, _, _ = corpus
    with pytest.raises(FileNotFoundError, match=r"tools/preprocess_data.py --input .* --output-prefix .*/nothing"):
        check_data_files(tmp_path / "nothing_text_document", model)
    with pytest.raises(FileNotFoundError, match="did you mean the data prefix"):
        check_data_files(prefix[: -len("_text_document")])
    with pytest.raises(ValueError, match="without the extension"):
        check_data_files(prefix + ".bin")
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a sentencepiece .model"):
        check_data_files(prefix, tmp_path / "bad.model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        SentencePieceTokenizer(tmp_path / "missing.model")

    broken = tmp_path / "broken_text_document"
    (tmp_path / "broken_text_document.idx").write_bytes(Path(prefix + ".idx").read_bytes())
    (tmp_path / "broken_text_document.bin").write_bytes(Path(prefix + ".bin").read_bytes()[:-6])
    with pytest.raises(ValueError, match="rebuild it with"):
        check_data_files(broken)

    with pytest.raises(ValueError, match="not both"):
        preprocess(tmp_path, tmp_path / "x", tokenizer_model=model, vocab_size=VOCAB, log=None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        preprocess(tmp_path / "absent.txt", tmp_path / "x", log=None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty directory"):
        preprocess(tmp_path / "empty", tmp_path / "x", log=None)
    (tmp_path / "empty" / "blank.txt").write_text(" \n\n \n")
    with pytest.raises(ValueError, match="holds no text"):
        preprocess(tmp_path / "empty", tmp_path / "x", log=None)
    (tmp_path / "j.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ValueError, match=r"j.jsonl:1 has no 'text' field .* --json-keys"):
        preprocess(tmp_path / "j.jsonl", tmp_path / "x", log=None)
    with pytest.raises(ValueError, match="--vocab-size 100 is too small"):
        preprocess(Path(model).parent / "input.txt", tmp_path / "x", vocab_size=100, log=None)
    with pytest.raises(ValueError, match="not a sentencepiece .model"):
        preprocess(Path(model).parent / "input.txt", tmp_path / "x", tokenizer_model=tmp_path / "bad.model", log=None)
    tiny = tmp_path / "tiny"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(["ab ba", "a b"]), model_prefix=str(tiny), vocab_size=8, minloglevel=2,
        hard_vocab_limit=False,
    )
    with pytest.raises(ValueError, match="made with another tokenizer"):
        build_gpt_datasets(prefix, f"{tiny}.model", 16, "1", (4, None, None), 1, tmp_path / "c")
    # A tokenizer with more pieces than the data's: every id is in range, the record tells them apart.
    larger = tmp_path / "larger"
    sentencepiece.SentencePieceTrainer.train(
        input=str(Path(model).parent / "input.txt"), model_prefix=str(larger), minloglevel=2, hard_vocab_limit=False,
        vocab_size=load_sentencepiece_model(model).get_piece_size() + 64, byte_fallback=True,
    )
    with pytest.raises(ValueError, match=r"made with another tokenizer than .*larger.model"):
        build_gpt_datasets(prefix, f"{larger}.model", 16, "1", (4, None, None), 1, tmp_path / "c")
    with pytest.raises(ValueError, match="the valid split .* fewer than one sample"):
        build_gpt_datasets(prefix, model, 64, "999999,1,0", (10, 1, 0), 1, tmp_path / "c")


# -- command line -----------------------------------------------------------------------------------------
def test_cli(tmp_path, seed):
    (tmp_path / "in.txt").write_text(random_text(random.Random(seed), paragraphs=60), encoding="utf-8")
    run = lambda *args: subprocess.run(  # noqa: E731
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), *args],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
    )
    done = run(
        "--input", "in.txt", "--output-prefix", "out/p", "--vocab-size", str(VOCAB), "--document-chars", "0",
        "--model-type", "unigram",
    )
    assert done.returncode == 0, done.stderr
    assert "documents" in done.stdout and "out/p_text_document" in done.stdout
    assert "Transformer Engine" not in done.stderr and "Traceback" not in done.stderr  # import warnings silenced
    for name in ("p.model", "p.vocab", "p_text_document.bin", "p_text_document.idx"):
        assert (tmp_path / "out" / name).is_file()
    assert len(IndexedDataset(str(tmp_path / "out" / "p_text_document"))) == 60

    refused = run(
        "--input", "in.txt", "--output-prefix", "q", "--vocab-size", "500", "--tokenizer-model", "out/p.model"
    )
    assert refused.returncode == 2
    assert "not both" in refused.stderr and "Traceback" not in refused.stderr


# -- the default corpus (a small stand-in for Shakespeare) -------------------------------------------------
def test_default_corpus_cached_rebuilt_and_locked(tmp_path, monkeypatch, seed):
    from megatron.training.data import corpus as corpus_module

    text = random_text(random.Random(seed), paragraphs=150)
    monkeypatch.setattr(corpus_module, "shakespeare_text", lambda: text)
    builds = []
    real_preprocess = preprocess_data.preprocess
    monkeypatch.setattr(preprocess_data, "preprocess", lambda *a, **k: builds.append(1) or real_preprocess(*a, **k))
    where = tmp_path / "cache" / "default"

    results = []
    threads = [
        threading.Thread(target=lambda: results.append(prepare_default_corpus(where, vocab_size=VOCAB, log=None)))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3 and len(set(results)) == 1 and len(builds) == 1  # the lock serialized them
    prefix, model = results[0]
    check_data_files(prefix, model)
    tokenizer = SentencePieceTokenizer(model)
    assert "".join(tokenizer.detokenize(ids) for ids in read_documents(prefix)) == text
    manifest = json.loads((where / "manifest.json").read_text())
    assert manifest["vocab_size"] == tokenizer.vocab_size
    assert manifest["tokens"] == sum(map(len, read_documents(prefix)))
    assert sorted(os.listdir(tmp_path / "cache")) == [".default.lock", "default"]  # no staging left behind

    assert prepare_default_corpus(where, vocab_size=VOCAB, log=None) == results[0] and len(builds) == 1
    with open(prefix + ".bin", "r+b") as f:  # corrupt it: the next call rebuilds
        f.seek(10)
        f.write(b"\xff\xff\xff")
    assert prepare_default_corpus(where, vocab_size=VOCAB, log=None) == results[0] and len(builds) == 2
    check_data_files(prefix, model)
    assert "".join(tokenizer.detokenize(ids) for ids in read_documents(prefix)) == text


# -- torch.distributed (gloo): rank 0 builds the indices, the others load them ---------------------------
_INPUTS_ENV = "FP8LM_TEST_DATA_TOOLS_INPUTS"


def _distributed_worker(rank: int, world: int, port: int, seed: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        inputs = json.loads(os.environ[_INPUTS_ENV])
        cache = Path(out_dir) / "cache"
        train, valid, _ = build_gpt_datasets(inputs["prefix"], inputs["model"], 16, "80,20,0", (24, 8, 0), seed, cache)
        batch = next(gpt_batch_iterator(train, 2, data_parallel_rank=rank, data_parallel_size=world))
        torch.save(
            {"batch": batch, "valid0": valid[0]["tokens"], "cache": sorted(p.name for p in cache.rglob("*"))},
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        torch.distributed.destroy_process_group()


def test_distributed_build(corpus, seed, tmp_path, monkeypatch):
    prefix, model, _, _ = corpus
    monkeypatch.setenv(_INPUTS_ENV, json.dumps({"prefix": prefix, "model": model}))
    out = tmp_path / "ranks"
    out.mkdir()
    spawn(_distributed_worker, (2, free_port(), seed, str(out)), 2)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    train, valid, _ = build_gpt_datasets(prefix, model, 16, "80,20,0", (24, 8, 0), seed, tmp_path / "single")
    reference = next(gpt_batch_iterator(train, 4))
    for rank, result in enumerate(results):
        for key, value in result["batch"].items():
            assert torch.equal(value, reference[key][2 * rank : 2 * rank + 2]), (rank, key)
        assert torch.equal(result["valid0"], valid[0]["tokens"])
        assert result["cache"] == results[0]["cache"] and any(n.endswith("shuffle_index.npy") for n in result["cache"])
