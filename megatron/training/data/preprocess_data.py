"""Tokenize raw text or JSONL into a megatron-core indexed dataset (library; the command line is
``tools/preprocess_data.py``, the default corpus ``megatron.training.data.datasets.prepare_default_corpus`` uses
:func:`preprocess`).

Input is one file or a directory (read recursively, files in sorted relative-path order, hidden files
skipped). Files ending in ``.jsonl``/``.json`` hold one JSON object per line; each object's ``--json-keys``
field (default ``text``) is one document. Any other file is UTF-8 plain text, cut into documents after
blank lines: paragraphs are packed, in order, until a document holds at least ``--document-chars``
characters (default 4096; 0 makes every paragraph a document), and a file always ends a document. The
documents of a file concatenate back to the file exactly.

Without ``--tokenizer-model`` a sentencepiece model (BPE by default, ``--vocab-size`` pieces, byte
fallback, identity normalization, whitespace kept: any text round-trips exactly) is trained on the input
and written to ``PREFIX.model`` / ``PREFIX.vocab``. Each document is tokenized, the end-of-document token
(``</s>``) appended, and written with ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder`` to
``PREFIX_<key>_document.bin/.idx`` (``PREFIX_text_document`` for plain text), with
``PREFIX_<key>_document.tokenizer.json`` recording the tokenizer. Outputs appear atomically,
with the permissions the umask gives new files (all of them alike).

Bad input fails before any training or writing, with one message naming the file, line and fix: the whole
input is read and checked first (JSON syntax, fields, UTF-8, NUL bytes). ``PREFIX`` is a file-name stem
(``out/corpus``, not ``out/``); its directory is created when missing. A ``--vocab-size`` larger than the
input supports is an error naming the largest size it gave (never silently capped).
"""

from __future__ import annotations

import io
import json
import os
import re
import secrets
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_VOCAB_SIZE = 2048
DEFAULT_DOCUMENT_CHARS = 4096
DEFAULT_MAX_TRAINING_SENTENCES = 2_000_000
JSONL_SUFFIXES = (".jsonl", ".json")
# Special ids of trained models: <unk> 0, <s> 1, </s> 2 (end of document), <pad> 3.
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
_ENCODE_BATCH = 512
_MAX_SENTENCE_CHARS = 4096  # longer lines are cut for sentencepiece training (<= 16 KiB of UTF-8)
# A blank-line run: a newline followed by one or more whitespace-only lines.
_PARAGRAPH_BREAK = re.compile(r"\r?\n(?:[ \t\f\v]*\r?\n)+")
_NON_SPACE = re.compile(r"\S")


@dataclass
class PreprocessResult:
    """What :func:`preprocess` read and wrote."""

    files: int
    documents: int
    tokens: int  # including the appended EOD tokens
    input_bytes: int
    vocab_size: int
    tokenizer_model: str
    trained_tokenizer: bool
    data_prefixes: dict[str, str] = field(default_factory=dict)  # json key -> PREFIX_<key>_document
    seconds: float = 0.0


def split_text_documents(text: str, document_chars: int = DEFAULT_DOCUMENT_CHARS) -> list[str]:
    """Cut plain text into documents after blank lines, each at least ``document_chars`` characters long
    (except the last); ``"".join(result) == text`` unless ``text`` is only whitespace (then ``[]``)."""
    if document_chars < 0:
        raise ValueError(f"document_chars must be >= 0, got {document_chars}")
    if not text.strip():
        return []
    documents, start = [], 0
    for match in _PARAGRAPH_BREAK.finditer(text):
        end = match.end()
        if end - start >= document_chars and _NON_SPACE.search(text, end):
            documents.append(text[start:end])
            start = end
    documents.append(text[start:])
    return documents


def list_input_files(input_path: str | os.PathLike, exclude: Sequence[str | os.PathLike] = ()) -> list[Path]:
    """The input files: ``input_path`` itself, or every non-hidden file below it in sorted relative-path
    order. ``exclude`` paths (e.g. the outputs) are skipped."""
    root = Path(input_path)
    if not root.exists():
        raise FileNotFoundError(f"--input {str(root)!r} does not exist: pass a text/JSONL file or a directory of them")
    if root.is_file():
        return [root]
    skip = {Path(p).resolve() for p in exclude}
    files = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or not path.is_file() or path.resolve() in skip:
            continue
        files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    nul = raw.find(b"\x00")
    if nul >= 0:  # UTF-16 text, archives, images, compiled files...
        line = raw.count(b"\n", 0, nul) + 1
        raise ValueError(
            f"{path}:{line} looks binary (a NUL byte at offset {nul}): pass UTF-8 text or JSONL "
            "(decompress or convert it first, or remove the NUL bytes), or leave it out of --input"
        )
    try:
        return raw.decode("utf-8")  # exact: no newline translation
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{path} is not UTF-8 text ({error}): convert it to UTF-8 or leave it out of --input"
        ) from error


def _is_jsonl(path: Path, input_format: str) -> bool:
    if input_format == "auto":
        return path.suffix.lower() in JSONL_SUFFIXES
    return input_format == "jsonl"


def iter_documents(
    files: Sequence[Path],
    json_keys: Sequence[str] = ("text",),
    document_chars: int = DEFAULT_DOCUMENT_CHARS,
    input_format: str = "auto",
) -> Iterator[tuple[str, str]]:
    """Yield ``(key, document_text)`` in input order: one per JSONL line and key (empty texts skipped),
    blank-line-packed chunks for plain text (key ``json_keys[0]``; needs a single key)."""
    for path in files:
        text = _read_text(path)
        if not _is_jsonl(path, input_format):
            if len(json_keys) != 1:
                raise ValueError(
                    f"{path} is plain text, which has no keys, but --json-keys names {len(json_keys)} keys: "
                    "preprocess plain-text files and multi-key JSONL in separate runs"
                )
            for document in split_text_documents(text, document_chars):
                yield json_keys[0], document
            continue
        for line_number, line in enumerate(text.split("\n"), start=1):  # not splitlines: U+2028 is text
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path}:{line_number} is not valid JSON ({error}): JSONL needs one JSON object per line "
                    "(use another suffix than .jsonl/.json, or --input-format text, for plain text)"
                ) from error
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{line_number} is a JSON {type(record).__name__}, expected an object")
            for key in json_keys:
                if key not in record:
                    raise ValueError(
                        f"{path}:{line_number} has no {key!r} field (fields: {sorted(record)}): "
                        "name the text field with --json-keys"
                    )
                value = record[key]
                if not isinstance(value, str):
                    raise ValueError(
                        f"{path}:{line_number} field {key!r} is a {type(value).__name__}, expected a string"
                    )
                if value.strip():
                    yield key, value


def _training_sentences(documents: Iterator[tuple[str, str]]) -> Iterator[str]:
    """Non-empty lines of every document, long lines cut into pieces sentencepiece accepts."""
    for _, document in documents:
        for line in document.split("\n"):
            line = line.rstrip("\r")
            if not line.strip():
                continue
            for start in range(0, len(line), _MAX_SENTENCE_CHARS):
                yield line[start : start + _MAX_SENTENCE_CHARS]


def train_tokenizer(
    sentences: Iterator[str],
    model_prefix: str | os.PathLike,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    model_type: str = "bpe",
    max_training_sentences: int = DEFAULT_MAX_TRAINING_SENTENCES,
    seed: int = 1234,
    num_threads: int = 1,
) -> Path:
    """Train a sentencepiece model that round-trips any text (byte fallback, identity normalization,
    whitespace and newlines kept) and write ``model_prefix.model/.vocab`` atomically; return the .model path.

    Ids: ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2 (end of document), ``<pad>`` 3, then the 256 byte pieces. At most
    ``max_training_sentences`` lines are used (a seeded sample), so training time stays bounded.
    A ``vocab_size`` larger than the sentences support is a ``ValueError`` naming the largest size they
    gave; an error raised while reading ``sentences`` propagates as it is.
    """
    import sentencepiece

    if vocab_size < 300:
        raise ValueError(
            f"--vocab-size {vocab_size} is too small: 256 byte-fallback pieces and 4 special tokens come first; "
            "use at least 300 (2048 suits the small CPU models here, 32000 a real model)"
        )
    prefix = Path(model_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    input_errors: list[BaseException] = []

    def checked_sentences() -> Iterator[str]:  # sentencepiece rewraps errors of the iterator: keep them
        try:
            yield from sentences
        except BaseException as error:
            input_errors.append(error)
            raise

    sentencepiece.set_random_generator_seed(seed)
    model = io.BytesIO()  # in memory: a model_prefix would be recorded in the model (not reproducible)
    try:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=checked_sentences(), model_writer=model, vocab_size=vocab_size, model_type=model_type,
            # text kept as written (whitespace, digits one by one), every byte representable
            byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
            add_dummy_prefix=False, allow_whitespace_only_pieces=True, split_digits=True,
            character_coverage=0.9995, hard_vocab_limit=False,
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID,
            input_sentence_size=max_training_sentences, shuffle_input_sentence=True,
            max_sentence_length=4 * _MAX_SENTENCE_CHARS, num_threads=max(1, num_threads), minloglevel=2,
        )
    except RuntimeError as error:
        if input_errors:  # bad input, not a training problem: its own message
            raise input_errors[0] from None
        raise ValueError(
            f"sentencepiece training failed ({error}): give more input text or a different --vocab-size, "
            "or pass an existing model with --tokenizer-model"
        ) from error
    if input_errors:
        raise input_errors[0]
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    if processor.get_piece_size() < vocab_size:  # hard_vocab_limit=False stopped early: never cap silently
        raise ValueError(
            f"--vocab-size {vocab_size} is more than this input supports: training stopped at "
            f"{processor.get_piece_size()} pieces; pass --vocab-size {processor.get_piece_size()} or less, "
            "or give more input text"
        )
    pieces = range(processor.get_piece_size())
    vocab = "".join(f"{processor.id_to_piece(i)}\t{processor.get_score(i):g}\n" for i in pieces)
    _write_atomically(Path(f"{prefix}.vocab"), vocab.encode("utf-8"))
    _write_atomically(Path(f"{prefix}.model"), model.getvalue())
    return Path(f"{prefix}.model")


def _write_atomically(path: Path, payload: bytes) -> None:
    """``path`` holds ``payload`` or is untouched; created like any new file (mode 0666 less the umask, as
    the .bin/.idx outputs: not mkstemp's 0600)."""
    while True:
        tmp = path.parent / f".{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _encode_batches(
    tokenizer, documents: Iterator[tuple[str, str]], num_threads: int
) -> Iterator[tuple[str, list[int]]]:
    """``(key, ids)`` per document, encoded in batches (sentencepiece threads; order preserved)."""
    batch: list[tuple[str, str]] = []
    for item in documents:
        batch.append(item)
        if len(batch) >= _ENCODE_BATCH:
            yield from zip([k for k, _ in batch], tokenizer.tokenize_batch([t for _, t in batch], num_threads))
            batch = []
    if batch:
        yield from zip([k for k, _ in batch], tokenizer.tokenize_batch([t for _, t in batch], num_threads))


def data_prefix_for(output_prefix: str | os.PathLike, key: str = "text") -> str:
    """The indexed-dataset prefix written for ``key``: ``PREFIX_<key>_document``."""
    return f"{os.fspath(output_prefix)}_{key}_document"


def check_output_prefix(output_prefix: str | os.PathLike) -> Path:
    """``output_prefix`` as a ``Path``, after checking it names a file stem in a directory that exists or
    can be created (nothing is created here); ``ValueError`` naming the fix otherwise."""
    raw = os.fspath(output_prefix)
    prefix = Path(raw)
    if not raw or raw.endswith(("/", os.sep)) or prefix.name in ("", ".", ".."):
        raise ValueError(
            f"--output-prefix {raw!r} is not a file-name stem (outputs are PREFIX.model, "
            "PREFIX_text_document.bin, ...): name a file in the directory, e.g. "
            f"{str(Path(raw or '.') / 'corpus')!r}"
        )
    for ancestor in (prefix.parent, *prefix.parent.parents):
        if ancestor.is_dir():
            break
        if ancestor.exists() or ancestor.is_symlink():
            raise ValueError(
                f"--output-prefix {raw!r}: {str(ancestor)!r} is a file, not a directory: "
                "choose a prefix in a directory (it is created when missing)"
            )
    return prefix


TOKENIZER_RECORD = ".tokenizer.json"
"""Suffix of the record written beside each ``.bin``/``.idx``: which tokenizer made the ids (file name,
vocabulary size, sha256 of the ``.model``), checked by training against the tokenizer it is given."""


def preprocess(
    input_path: str | os.PathLike,
    output_prefix: str | os.PathLike,
    *,
    tokenizer_model: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    json_keys: Sequence[str] = ("text",),
    append_eod: bool = True,
    document_chars: int = DEFAULT_DOCUMENT_CHARS,
    input_format: str = "auto",
    model_type: str = "bpe",
    max_training_sentences: int = DEFAULT_MAX_TRAINING_SENTENCES,
    seed: int = 1234,
    workers: int = 1,
    log=print,
) -> PreprocessResult:
    """Preprocess ``input_path`` into ``PREFIX_<key>_document.bin/.idx`` (training ``PREFIX.model`` first
    when no ``tokenizer_model`` is given); see the module docstring. ``log=None`` prints nothing."""
    started = time.perf_counter()
    if tokenizer_model is not None and vocab_size is not None:
        raise ValueError(
            "--tokenizer-model and --vocab-size were both given: pass --tokenizer-model to use an existing "
            "model (its vocabulary is fixed), or --vocab-size to train a new one, not both"
        )
    if not json_keys or len(set(json_keys)) != len(json_keys):
        raise ValueError(f"--json-keys must name distinct keys, got {list(json_keys)}")
    if input_format not in ("auto", "text", "jsonl"):
        raise ValueError(f"input_format must be auto, text or jsonl, got {input_format!r}")
    output_prefix = check_output_prefix(output_prefix)
    data_prefixes = {key: data_prefix_for(output_prefix, key) for key in json_keys}
    outputs = [f"{output_prefix}.model", f"{output_prefix}.vocab"]
    outputs += [f"{p}.{ext}" for p in data_prefixes.values() for ext in ("bin", "idx")]
    for output in outputs[0 if tokenizer_model is None else 2 :]:
        if Path(output).is_dir():
            raise ValueError(f"output {output!r} is a directory: move it away or choose another --output-prefix")
    files = list_input_files(input_path, exclude=outputs)
    if not files:
        raise ValueError(f"--input {str(input_path)!r} is an empty directory: put text or JSONL files in it")
    input_bytes = sum(p.stat().st_size for p in files)

    def documents():
        return iter_documents(files, json_keys, document_chars, input_format)

    # One full pass first: bad input (a later file, line 10,000) fails here, before any training or writing.
    if sum(1 for _ in documents()) == 0:
        raise ValueError(
            f"--input {str(input_path)!r} holds no text ({len(files)} file(s), {input_bytes} bytes: empty or "
            f"whitespace, or JSONL whose {list(json_keys)} fields are): give it files with text"
        )
    # megatron-core takes seconds to import: only after the cheap checks above.
    import numpy
    import torch
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from megatron.training.data.tokenizer import SentencePieceTokenizer, load_sentencepiece_model

    if tokenizer_model is not None:
        load_sentencepiece_model(tokenizer_model)  # fail before any work on a bad model
    try:
        output_prefix.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(
            f"cannot create the output directory {str(output_prefix.parent)!r} ({error.strerror}): "
            "choose another --output-prefix"
        ) from error
    trained = tokenizer_model is None
    if trained:
        tokenizer_model = train_tokenizer(
            _training_sentences(documents()),
            output_prefix,
            vocab_size=DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size,
            model_type=model_type,
            max_training_sentences=max_training_sentences,
            seed=seed,
            num_threads=workers,
        )
    tokenizer = SentencePieceTokenizer(tokenizer_model)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)

    staging = {key: tempfile.mkstemp(prefix=".preprocess-", dir=output_prefix.parent) for key in json_keys}
    builders = {}
    n_documents = n_tokens = 0
    try:
        for key, (fd, tmp) in staging.items():
            os.close(fd)
            builders[key] = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
        for key, ids in _encode_batches(tokenizer, documents(), max(1, workers)):
            if append_eod:
                ids.append(tokenizer.eod)
            if not ids:
                continue
            builders[key].add_item(torch.from_numpy(numpy.asarray(ids, dtype=numpy.int64)))
            builders[key].end_document()
            n_documents += 1
            n_tokens += len(ids)
        for key, (_, tmp) in staging.items():
            builders[key].finalize(f"{tmp}.idx")
            os.replace(f"{tmp}.bin", f"{data_prefixes[key]}.bin")
            os.replace(f"{tmp}.idx", f"{data_prefixes[key]}.idx")
            _write_atomically(Path(f"{data_prefixes[key]}{TOKENIZER_RECORD}"), json.dumps(
                {"tokenizer_model": os.path.basename(str(tokenizer_model)), "vocab_size": tokenizer.vocab_size,
                 "sha256": tokenizer.unique_identifiers["sha256"]}).encode())
    finally:
        for key, (_, tmp) in staging.items():
            if key in builders:
                builders[key].data_file.close()
            for path in (tmp, f"{tmp}.bin", f"{tmp}.idx"):
                Path(path).unlink(missing_ok=True)

    result = PreprocessResult(
        files=len(files),
        documents=n_documents,
        tokens=n_tokens,
        input_bytes=input_bytes,
        vocab_size=tokenizer.vocab_size,
        tokenizer_model=str(tokenizer_model),
        trained_tokenizer=trained,
        data_prefixes=data_prefixes,
        seconds=time.perf_counter() - started,
    )
    if log is not None:
        _report(result, append_eod, log)
    return result


def _report(result: PreprocessResult, append_eod: bool, log) -> None:
    eod = f" (including {result.documents:,} EOD)" if append_eod else ""
    log(
        f"preprocess_data: {result.files:,} file(s), {result.input_bytes:,} bytes -> {result.documents:,} documents, "
        f"{result.tokens:,} tokens{eod} in {result.seconds:.1f} s"
    )
    how = "trained" if result.trained_tokenizer else "given"
    log(f"  tokenizer ({how}): {result.tokenizer_model} (vocab {result.vocab_size:,})")
    if result.trained_tokenizer:
        log(f"  wrote {result.tokenizer_model}, {result.tokenizer_model[: -len('.model')]}.vocab")
    for prefix in result.data_prefixes.values():
        log(f"  wrote {prefix}.bin, {prefix}.idx  (data prefix: {prefix})")
