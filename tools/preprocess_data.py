"""Tokenize raw text or JSONL into a megatron-core indexed dataset (command line).

    python tools/preprocess_data.py --input FILE_OR_DIR --output-prefix PREFIX \
        [--tokenizer-model MODEL | --vocab-size N]

What it reads and writes (documents, tokenizer, ``PREFIX_<key>_document.bin/.idx``) is described in the
docstring of the library, the packaged module ``megatron.training.data.preprocess_data`` (``preprocess``,
``split_text_documents``, ...), whose names are re-exported here.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

if __name__ == "__main__":  # run as a script from a checkout: the repository root holds megatron/training
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.training.data.preprocess_data import (  # noqa: E402  (re-exported)
    DEFAULT_DOCUMENT_CHARS,
    DEFAULT_MAX_TRAINING_SENTENCES,
    DEFAULT_VOCAB_SIZE,
    JSONL_SUFFIXES,
    PreprocessResult,
    data_prefix_for,
    iter_documents,
    check_output_prefix,
    list_input_files,
    preprocess,
    split_text_documents,
    train_tokenizer,
)

__all__ = ["DEFAULT_DOCUMENT_CHARS", "DEFAULT_MAX_TRAINING_SENTENCES", "DEFAULT_VOCAB_SIZE", "JSONL_SUFFIXES",
           "PreprocessResult", "check_output_prefix", "data_prefix_for", "iter_documents", "list_input_files",
           "preprocess", "split_text_documents", "train_tokenizer", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(
        prog="preprocess_data.py",
        description="Tokenize text/JSONL into a megatron-core indexed dataset (PREFIX_text_document.bin/.idx).",
    )
    parser.add_argument("--input", required=True, help="a text/JSONL file, or a directory read recursively")
    parser.add_argument(
        "--output-prefix", required=True, help="writes PREFIX_<key>_document.bin/.idx (and PREFIX.model)"
    )
    tok = parser.add_argument_group("tokenizer (one of)")
    tok.add_argument("--tokenizer-model", default=None, help="an existing sentencepiece .model to use")
    tok.add_argument(
        "--vocab-size", type=int, default=None,
        help=f"train a sentencepiece model of this many pieces into PREFIX.model (default {DEFAULT_VOCAB_SIZE})",
    )
    parser.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe",
                        help="sentencepiece model type to train (default: %(default)s; bpe trains ~10x faster)")
    parser.add_argument("--json-keys", nargs="+", default=["text"],
                        help="JSONL fields to tokenize, one dataset PREFIX_<key>_document each (default: text)")
    parser.add_argument("--input-format", choices=("auto", "text", "jsonl"), default="auto",
                        help="auto (default): .jsonl/.json files are JSONL, anything else plain text")
    parser.add_argument("--document-chars", type=int, default=DEFAULT_DOCUMENT_CHARS,
                        help="plain text: pack paragraphs into documents of at least this many characters "
                        "(default: %(default)s; 0: one document per paragraph)")
    parser.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                        help="append the end-of-document token </s> to every document (default: on)")
    parser.add_argument("--max-training-sentences", type=int, default=DEFAULT_MAX_TRAINING_SENTENCES,
                        help="at most this many lines (a seeded sample) train the tokenizer (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1234, help="seed of that sample (default: %(default)s)")
    parser.add_argument("--workers", type=int, default=1,
                        help="threads for tokenizer training and encoding (default: %(default)s)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; errors are reported as one line naming the fix (exit status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|apex).*")
    try:
        preprocess(
            args.input,
            args.output_prefix,
            tokenizer_model=args.tokenizer_model,
            vocab_size=args.vocab_size,
            json_keys=args.json_keys,
            append_eod=args.append_eod,
            document_chars=args.document_chars,
            input_format=args.input_format,
            model_type=args.model_type,
            max_training_sentences=args.max_training_sentences,
            seed=args.seed,
            workers=args.workers,
        )
    except (ValueError, OSError) as error:  # OSError: unreadable input, full disk... (FileNotFoundError too)
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
