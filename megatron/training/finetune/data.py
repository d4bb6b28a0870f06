"""Fine-tuning data: JSONL rows, their held-out tail, tokenization and collation (the loss on response tokens only), and per-response log-probabilities."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ['IGNORE_INDEX', 'DataError', 'load_jsonl', 'split_heldout', 'prepare_tokenizer', 'Encoded', 'encode', 'collate', 'response_logprobs']


IGNORE_INDEX = -100


class DataError(ValueError):
    """Bad input data; the scripts print it on one line and exit with status 2."""


def load_jsonl(path: Path, keys: Sequence[str]) -> list[dict[str, str]]:
    """Rows of ``path``, each with the string fields ``keys``; a :class:`DataError` names the line and key
    of the first bad row (nothing is skipped silently; blank lines are allowed)."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one "
                                f"JSON object with keys {list(keys)}") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: expected a JSON object with keys {list(keys)}, got "
                                f"{type(row).__name__}")
            for key in keys:
                if key not in row:
                    raise DataError(f"{where}: missing key {key!r} (each line needs {list(keys)})")
                if not isinstance(row[key], str):
                    raise DataError(f"{where}: key {key!r} must be a string, got {type(row[key]).__name__}")
            if not row[keys[-1]]:
                raise DataError(f"{where}: key {keys[-1]!r} is empty; there would be nothing to learn from")
            rows.append({key: row[key] for key in keys})
    if not rows:
        raise DataError(f"{path}: no examples (expected JSON lines with keys {list(keys)})")
    return rows


def split_heldout(rows: list, eval_examples: int) -> tuple[list, list]:
    """(train, held-out): the last ``eval_examples`` rows are held out, at most a fifth of the file (the counts
    are printed)."""
    n = min(eval_examples, len(rows) // 5)
    return (rows[:len(rows) - n], rows[len(rows) - n:]) if n > 0 else (rows, [])


def prepare_tokenizer(tokenizer):
    """Use EOS as the pad token when the tokenizer has none; right padding."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token, which ends every response; set eos_token in the model's "
                        "tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


@dataclass
class Encoded:
    input_ids: list[int]
    labels: list[int]
    truncated: bool


def encode(tokenizer, prompt: str, response: str, max_length: int) -> Encoded:
    """Prompt (with the tokenizer's own special prefix, e.g. BOS) then response then EOS; labels are
    ``IGNORE_INDEX`` on the prompt. Longer than ``max_length``: the prompt loses tokens from its start (down to
    half the budget) and the response from its end."""
    eos = tokenizer.eos_token_id
    p = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if p and p[-1] == eos:  # tokenizers that append EOS themselves
        p = p[:-1]
    r = list(tokenizer(response, add_special_tokens=False)["input_ids"]) + [eos]
    truncated = len(p) + len(r) > max_length
    if truncated:
        keep_r = min(len(r), max(max_length - len(p), max_length // 2))
        keep_p = max_length - keep_r
        p = p[len(p) - keep_p:] if keep_p > 0 else []
        r = r[:keep_r]
    return Encoded(p + r, [IGNORE_INDEX] * len(p) + r, truncated)


def collate(examples: Sequence[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (``IGNORE_INDEX`` on prompt and padding)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        labels[i, :n] = torch.tensor(e.labels)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def response_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log-probabilities of the label tokens per sequence, number of label tokens per sequence);
    position t predicts token t+1."""
    logits = logits[:, :-1].float()
    target = labels[:, 1:]
    mask = target != IGNORE_INDEX
    logp = torch.log_softmax(logits, dim=-1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (logp * mask).sum(-1), mask.sum(-1)
