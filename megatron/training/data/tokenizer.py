"""A SentencePiece tokenizer usable by megatron-core's ``GPTDataset`` (a ``MegatronTokenizerBase``)."""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from collections.abc import Sequence

import numpy
import sentencepiece
import torch
from megatron.core.tokenizers import MegatronTokenizerBase


def load_sentencepiece_model(model_path: str | os.PathLike) -> sentencepiece.SentencePieceProcessor:
    """Load a sentencepiece ``.model`` file, raising a ``ValueError`` that names the fix on failure."""
    path = os.fspath(model_path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"sentencepiece model {path!r} does not exist: pass the PREFIX.model written by "
            "tools/preprocess_data.py (or run it without --tokenizer-model to train one)"
        )
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.Load(path)
    except (OSError, RuntimeError) as error:
        raise ValueError(
            f"cannot load sentencepiece model {path!r} ({error}): it is not a sentencepiece .model file; "
            "pass the PREFIX.model written by tools/preprocess_data.py (or rerun it to rebuild the model)"
        ) from error
    return processor


class SentencePieceTokenizer(MegatronTokenizerBase):
    """Text <-> token ids through a sentencepiece model, with the attributes megatron-core's datasets use.

    ``eod`` is the model's ``</s>`` (EOS) id; ``pad`` is its ``<pad>`` id, or ``None`` when the model has
    none (megatron-core then pads with -1, an id never present in the data). ``unique_identifiers`` (the
    model file's name and SHA-256) feeds megatron-core's dataset cache keys.
    """

    def __init__(self, model_path: str | os.PathLike) -> None:
        path = os.path.abspath(os.fspath(model_path))
        processor = load_sentencepiece_model(path)
        super().__init__(path, {})
        self._processor = processor
        if processor.eos_id() < 0:
            raise ValueError(
                f"sentencepiece model {path!r} has no </s> piece to serve as the end-of-document token: "
                "train it with eos_id >= 0 (tools/preprocess_data.py does)"
            )
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        self.unique_identifiers = OrderedDict(
            [
                ("class", type(self).__name__),
                ("tokenizer_model", os.path.basename(path)),
                ("sha256", digest),
            ]
        )

    # -- pickling (DataLoader workers): keep the serialized model, not the C++ object ---------------------
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_processor"] = self._processor.serialized_model_proto()
        return state

    def __setstate__(self, state: dict) -> None:
        proto = state.pop("_processor")
        self.__dict__.update(state)
        self._processor = sentencepiece.SentencePieceProcessor(model_proto=proto)

    # -- ids --------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of pieces in the model (token ids are in ``[0, vocab_size)``)."""
        return self._processor.get_piece_size()

    @property
    def eod(self) -> int:
        """End-of-document token id (the model's ``</s>``), appended after every document."""
        return self._processor.eos_id()

    @property
    def eos(self) -> int:
        """Alias of :attr:`eod`."""
        return self.eod

    @property
    def bos(self) -> int | None:
        """The ``<s>`` id, or ``None`` when the model has none."""
        value = self._processor.bos_id()
        return value if value >= 0 else None

    @property
    def pad(self) -> int | None:
        """The ``<pad>`` id, or ``None`` when the model has none."""
        value = self._processor.pad_id()
        return value if value >= 0 else None

    @property
    def unk(self) -> int | None:
        """The ``<unk>`` id, or ``None`` when the model has none."""
        value = self._processor.unk_id()
        return value if value >= 0 else None

    @property
    def vocab(self) -> dict[str, int]:
        """Piece -> id."""
        return {self._processor.id_to_piece(i): i for i in range(self.vocab_size)}

    @property
    def inv_vocab(self) -> dict[int, str]:
        """Id -> piece."""
        return {i: self._processor.id_to_piece(i) for i in range(self.vocab_size)}

    @property
    def model_path(self) -> str:
        """Absolute path of the loaded ``.model`` file."""
        return self.path

    # -- text -------------------------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """Encode ``text`` to ids (no BOS/EOD added). Models trained by tools/preprocess_data.py round-trip
        any text exactly: identity normalization, whitespace kept, byte fallback for unseen characters."""
        return self._processor.encode(text)

    def tokenize_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """:meth:`tokenize` of each text, on ``num_threads`` sentencepiece threads (order kept)."""
        return self._processor.encode(list(texts), num_threads=num_threads)

    def detokenize(self, ids: Sequence[int] | numpy.ndarray | torch.Tensor) -> str:
        """Decode ids to text; control ids (EOD, pad, BOS) decode to nothing."""
        if isinstance(ids, torch.Tensor):
            ids = ids.flatten().tolist()
        elif isinstance(ids, numpy.ndarray):
            ids = ids.reshape(-1).tolist()
        else:
            ids = [int(i) for i in ids]
        return self._processor.decode(ids)

    def apply_chat_template(self, *args, **kwargs):
        """Not supported: these are plain pretraining tokenizers without a chat template."""
        raise NotImplementedError(f"{type(self).__name__} has no chat template")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"
