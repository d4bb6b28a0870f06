"""The demo task and the demo base model: prompt/response pairs from the Shakespeare corpus, and a small Llama pretrained on it (built once and cached)."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import time
from pathlib import Path

import torch

from .runtime import Runtime

__all__ = ['DEMO_BASE_VERSION', 'DEMO_HELDOUT_PLAYS', 'demo_plays', 'demo_pairs', 'demo_rows', 'demo_base_config', 'DEMO_PRETRAIN', 'demo_base_dir', 'demo_base_model', 'resolve_model']


DEMO_BASE_VERSION = 1  # bump when the demo base model's recipe changes (the cached directory is keyed by it)


DEMO_HELDOUT_PLAYS = 2  # the last plays (sorted paths) are held out of pretraining and of the demo train split


_NAME = re.compile(r"^[A-Z][A-Z0-9'’ ,.&-]*[A-Z.]$")


def _speeches(text: str) -> list[tuple[str, list[str]]]:
    """(speaker, lines) of a play's cleaned text: blocks after a blank line whose first line is an
    upper-case name (stage directions and headings are skipped)."""
    out = []
    for block in text.split("\n\n"):
        lines = [line for line in block.strip().split("\n") if line.strip()]
        if len(lines) >= 2 and _NAME.match(lines[0]) and len(lines[0]) <= 40:
            out.append((lines[0], lines[1:]))
    return out


def demo_plays() -> list[list[tuple[str, list[str]]]]:
    """Speeches of each play of the demo corpus (sorted paths)."""
    from megatron.training.data import corpus

    return [_speeches(corpus.clean_markdown(p.read_text(encoding="utf-8"))) for p in corpus.play_paths()]


def demo_pairs(plays, context_lines: int = 4, response_lines: int = 2):
    """(prompt, response, play index) for consecutive speeches: the previous speaker and the last lines of
    their speech, then the next speaker's name; the response is the start of the next speech."""
    out = []
    for k, play in enumerate(plays):
        for (prev, prev_lines), (who, lines) in zip(play, play[1:]):
            prompt = f"{prev}\n" + "\n".join(prev_lines[-context_lines:]) + f"\n\n{who}\n"
            out.append((prompt, "\n".join(lines[:response_lines]), k))
    return out


def demo_rows(task: str, n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """The demo task: train rows from all plays but the last :data:`DEMO_HELDOUT_PLAYS` (which the demo base
    model was not pretrained on either), held-out rows from those. SFT: ``prompt``/``response``; DPO:
    ``prompt``/``chosen`` (the true next speech's first lines)/``rejected`` (as many lines from elsewhere: the
    middle of a speech of another play)."""
    plays = demo_plays()
    pairs = demo_pairs(plays)
    g = random.Random(seed)
    cut = len(plays) - DEMO_HELDOUT_PLAYS
    train = [x for x in pairs if x[2] < cut]
    held = [x for x in pairs if x[2] >= cut]
    g.shuffle(train)
    g.shuffle(held)
    train, held = train[:n_train], held[:n_eval]
    if task == "sft":
        return ([{"prompt": p, "response": r} for p, r, _ in train], [{"prompt": p, "response": r} for p, r, _ in held])
    long_speeches = [(k, lines) for k, play in enumerate(plays) for _, lines in play if len(lines) >= 5]

    def with_rejected(rows):
        out = []
        for p, r, k in rows:
            n = r.count("\n") + 1
            while True:
                j, lines = long_speeches[g.randrange(len(long_speeches))]
                if j != k:
                    break
            start = g.randrange(2, len(lines) - n + 1)
            out.append({"prompt": p, "chosen": r, "rejected": "\n".join(lines[start:start + n])})
        return out

    return with_rejected(train), with_rejected(held)


def demo_base_config():
    from transformers import LlamaConfig

    from megatron.training.data.datasets import DEFAULT_CORPUS_VOCAB_SIZE

    # Dimensions are multiples of 16 so every linear (lm_head included: untied) converts to FP8.
    return LlamaConfig(vocab_size=DEFAULT_CORPUS_VOCAB_SIZE, hidden_size=128, intermediate_size=352,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                       max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                       pad_token_id=3)


DEMO_PRETRAIN = {"steps": 200, "batch": 16, "seq": 96, "lr": 3e-3, "seed": 1234}


def demo_base_dir() -> Path:
    from megatron.training.data import corpus

    return corpus.cache_dir() / f"finetune-demo-base-v{DEMO_BASE_VERSION}"


def demo_base_model(log=print) -> Path:
    """The demo base model's directory, built on first use (cached by :data:`DEMO_BASE_VERSION`): a small
    Llama (:func:`demo_base_config`, 2 layers, d=128) with the demo corpus tokenizer (2048 BPE pieces),
    pretrained in fp32 for ``DEMO_PRETRAIN["steps"]`` steps on the demo corpus minus the held-out plays.
    Ranks and concurrent runs are serialized by a file lock; the directory appears complete or not at all."""
    import shutil
    import tempfile

    from megatron.training.data import corpus
    from megatron.training.data.datasets import exclusive_lock, prepare_default_corpus
    from megatron.training.checkpointing.hf_export import write_tokenizer

    directory = demo_base_dir()
    if (directory / "done").is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(directory.parent / f".{directory.name}.lock"):
        if (directory / "done").is_file():
            return directory
        from transformers import LlamaForCausalLM

        started = time.perf_counter()
        _, spm_model = prepare_default_corpus(log=None)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-build-", dir=directory.parent))
        try:
            problem = write_tokenizer(spm_model, staging)
            if problem:
                raise RuntimeError(f"demo base model: could not write tokenizer.json: {problem}")
            from megatron.training.data.tokenizer import load_sentencepiece_model

            sp = load_sentencepiece_model(spm_model)
            paths = corpus.play_paths()[:-DEMO_HELDOUT_PLAYS]
            text = "\n\n".join(corpus.clean_markdown(p.read_text(encoding="utf-8")) for p in paths)
            tokens = torch.tensor(sp.encode(text), dtype=torch.long)
            cfg = DEMO_PRETRAIN
            torch.manual_seed(cfg["seed"])
            g = torch.Generator().manual_seed(cfg["seed"])
            model = LlamaForCausalLM(demo_base_config())
            opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01, betas=(0.9, 0.95))
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt, lambda s: min(1.0, (s + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / cfg["steps"]))))
            if log:
                log(f"demo base model: pretraining {cfg['steps']} steps on {len(tokens)} tokens "
                    f"(once; cached in {directory})")
            for step in range(cfg["steps"]):
                starts = torch.randint(0, len(tokens) - cfg["seq"] - 1, (cfg["batch"],), generator=g)
                x = torch.stack([tokens[s:s + cfg["seq"]] for s in starts])
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                if log and (step % 25 == 0 or step == cfg["steps"] - 1):
                    log(f"  pretrain step {step:4d} loss {loss.item():.3f}")
            model.save_pretrained(str(staging))
            (staging / "done").write_text(json.dumps({"version": DEMO_BASE_VERSION, **cfg,
                                                      "final_loss": loss.item(),
                                                      "seconds": round(time.perf_counter() - started, 1)}) + "\n")
            if directory.exists():
                shutil.rmtree(directory)
            os.replace(staging, directory)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return directory


def resolve_model(args: argparse.Namespace, rt: Runtime) -> Path:
    """``--model`` or the demo base model (built by rank 0 first, the others waiting on the lock)."""
    if args.model is not None:
        return args.model
    return demo_base_model(log=print if rt.main else None)
