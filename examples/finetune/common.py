"""Shared parts of ``examples/finetune/sft.py`` and ``dpo.py``: flags, JSONL loading, tokenization and
collation (loss on response tokens only), the demo base model and demo tasks, data-parallel set-up,
FP8 initialization and BF16 export.

Nothing here runs on import.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MAX_LENGTH = 256
DEMO_BASE_VERSION = 1  # bump when the demo base model's recipe changes (the cached directory is keyed by it)
DEMO_HELDOUT_PLAYS = 2  # the last plays (sorted paths) are held out of pretraining and of the demo train split
IGNORE_INDEX = -100


class DataError(ValueError):
    """Bad input data; the scripts print it on one line and exit with status 2."""


# --------------------------------------------------------------------------------------------------- flags


def build_parser(description: str, *, task: str) -> argparse.ArgumentParser:
    """The flags both scripts share (``task``: ``"sft"`` or ``"dpo"``, for the help texts)."""
    keys = "prompt/response" if task == "sft" else "prompt/chosen/rejected"
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help="a transformers causal-LM directory with its tokenizer (default: the demo base model, "
                        "a small Llama pretrained on the demo corpus, built and cached on first use)")
    p.add_argument("--data", type=Path, default=None, metavar="FILE.jsonl",
                   help=f"JSONL, one object per line with string fields {keys} (default: the demo task)")
    p.add_argument("--fp8-opt-level", default="none", choices=["none", "O1", "O2", "O3"],
                   help="fp8.initialize opt level (none: the high-precision baseline)")
    p.add_argument("--recipe", default="tensorwise", choices=["tensorwise", "rowwise", "blockwise"],
                   help="granularity of the FP8 scales (fp8.initialize(..., recipe=))")
    p.add_argument("--fp8-grad-accumulation", default="fp16", choices=["fp16", "fp32", "fp8"],
                   help="how FP8 weights' gradients are held (Float8LinearConfig.grad_accumulation): fp16 (a scaled "
                        "FP16 buffer, 2 bytes/element, default), fp32 (4 bytes) or fp8 (1 byte; fine with one "
                        "micro-batch per step)")
    p.add_argument("--fp8-embeddings", action=argparse.BooleanOptionalAction, default=True,
                   help="at the FP8 levels, untied embedding tables in FP8 too (E4M3 rows, trained like FP8 weights: "
                        "fp8.initialize(..., fp8_embeddings=True)); --no-fp8-embeddings keeps them in high precision")
    p.add_argument("--fp8-min-dim", type=int, default=None,
                   help="linears with min(in, out) below it stay in high precision (fp8.initialize/fp8.freeze "
                        "min_fp8_dim; default: 2048 on CUDA, where smaller GEMMs gain nothing from FP8, 0 on CPU)")
    p.add_argument("--max-steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW; linear warm-up then cosine)")
    p.add_argument("--warmup-steps", type=int, default=5)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip-grad", type=float, default=1.0, help="gradient-norm clip (0: off)")
    p.add_argument("--batch-size", type=int, default=8, help="examples per step (global, split over ranks)")
    p.add_argument("--max-length", type=int, default=DEFAULT_MAX_LENGTH,
                   help="tokens per example (prompt + response); longer ones are truncated and counted")
    p.add_argument("--eval-examples", type=int, default=64,
                   help="held-out examples evaluated at the end (with --data: the file's last lines, at most a "
                        "fifth of it; 0: no evaluation)")
    p.add_argument("--demo-examples", type=int, default=2000, help="demo task: training examples built")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None, metavar="DIR",
                   help="write the fine-tuned model (BF16, from the master weights) and tokenizer here")
    p.add_argument("--log-json", type=Path, default=None, metavar="FILE",
                   help="JSON lines: one object per step, then the evaluation and summary objects")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    return p


def check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    for name in ("max_steps", "batch_size", "max_length"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.max_length < 8:
        parser.error(f"--max-length must be at least 8 tokens, got {args.max_length}")
    if not args.lr > 0:
        parser.error(f"--lr must be positive, got {args.lr}")
    if args.eval_examples < 0:
        parser.error(f"--eval-examples must be >= 0, got {args.eval_examples}")
    if args.model is not None and not (args.model / "config.json").is_file():
        parser.error(f"--model {args.model}: no config.json there; pass a transformers model directory "
                     f"(save_pretrained output with its tokenizer)")
    if args.data is not None and not args.data.is_file():
        parser.error(f"--data {args.data}: no such file")
    from megatron.training.output_paths import output_path_problem  # the check pretrain_gpt.py makes

    for flag, path, is_dir in (("--output", args.output, True), ("--log-json", args.log_json, False)):
        if (problem := output_path_problem(path, directory=is_dir)) is not None:
            parser.error(f"{flag} {path}: {problem}")


# ----------------------------------------------------------------------------------------------- data


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


# ----------------------------------------------------------------------------------------------- runtime


@dataclass
class Runtime:
    rank: int
    world: int
    device: torch.device
    distributed: bool

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_runtime(args: argparse.Namespace) -> Runtime:
    """Threads, seed, device, and under torchrun (``WORLD_SIZE`` > 1) the process group (NCCL on CUDA,
    gloo on CPU). O3 on one process gets a one-rank gloo group (the sharded optimizer needs one)."""
    import torch.distributed as dist

    if args.threads:
        torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world > 1:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        rt = Runtime(dist.get_rank(), world, device, True)
    else:
        if args.fp8_opt_level == "O3":
            import tempfile

            store = tempfile.NamedTemporaryFile(prefix="fp8lm-finetune-pg-", delete=False).name
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        rt = Runtime(0, 1, torch.device("cuda" if cuda else "cpu"), False)
    if args.batch_size % rt.world:
        raise DataError(f"--batch-size {args.batch_size} must be a multiple of the number of ranks ({rt.world})")
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    return rt


def teardown(rt: Runtime) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def load_model(path: Path, device: torch.device):
    """The model (fp32, train mode) and its tokenizer (pad = EOS when missing)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(str(path)))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)
    model.config.use_cache = False
    return model, tokenizer


def fp8_setup(model, optimizer, args: argparse.Namespace, rt: Runtime):
    """``fp8.initialize`` at ``--fp8-opt-level``/``--recipe``, then, with several ranks,
    ``fp8.distributed.DistributedDataParallel`` (O3: reducing each gradient to its owner). Returns
    ``(train_model, model, optimizer)``: ``train_model`` is the (wrapped) module to call, ``model`` the
    unwrapped one."""
    import fp8

    config = fp8.Float8LinearConfig(grad_accumulation=args.fp8_grad_accumulation)
    model, optimizer = fp8.initialize(model, optimizer, args.fp8_opt_level, recipe=args.recipe, config=config,
                                      fp8_embeddings=args.fp8_embeddings and args.fp8_opt_level != "none",
                                      min_fp8_dim=args.fp8_min_dim)
    train_model = model
    if rt.distributed:
        train_model = fp8.distributed.DistributedDataParallel(
            model, o3_optimizer=optimizer if args.fp8_opt_level == "O3" else None)
    return train_model, model, optimizer


def lr_lambda(args: argparse.Namespace):
    def f(step: int) -> float:
        if step < args.warmup_steps:
            return (step + 1) / (args.warmup_steps + 1)
        progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def clip(model, optimizer, max_norm: float) -> float | None:
    import fp8

    if max_norm <= 0:
        return None
    if hasattr(optimizer, "clip_grad_norm_"):  # the sharded (O3) optimizer clips over all ranks' shards
        return float(optimizer.clip_grad_norm_(max_norm))
    return float(fp8.clip_grad_norm_(model.parameters(), max_norm))


def batches(n: int, batch_size: int, rt: Runtime, seed: int, steps: int):
    """Per step, this rank's example indices: a shuffled pass over ``n`` examples (reshuffled each epoch), the
    global batch of ``batch_size`` split over the ranks."""
    g = random.Random(seed)
    order: list[int] = []
    per_rank = batch_size // rt.world
    for _ in range(steps):
        while len(order) < batch_size:
            perm = list(range(n))
            g.shuffle(perm)
            order += perm
        batch, order = order[:batch_size], order[batch_size:]
        yield batch[rt.rank * per_rank:(rt.rank + 1) * per_rank]


def all_mean(values: list[float], rt: Runtime) -> list[float]:
    """The mean of ``values`` over the ranks (as is with one rank)."""
    if not rt.distributed:
        return values
    from fp8.comm import Collectives

    t = torch.tensor(values, dtype=torch.float64, device=rt.device)
    Collectives().all_reduce(t, tag="finetune metrics").wait()
    return (t / rt.world).tolist()


def global_sum(t: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """``t`` summed over the ranks (a copy; ``t`` itself with one rank), on the device it lives on (no host read)."""
    if not rt.distributed:
        return t
    from fp8.comm import Collectives

    t = t.detach().clone()
    Collectives().all_reduce(t, tag="finetune token count").wait()
    return t


def weights_checksums(model, rt: Runtime) -> list[float]:
    """Per rank, a checksum of the model's weights (FP8 weights dequantized): equal values = equal weights."""
    import fp8

    total = torch.zeros((), dtype=torch.float64, device=rt.device)  # on the device: no host read per parameter
    for i, p in enumerate(model.parameters()):
        v = p.dequantize(torch.float32) if isinstance(p, fp8.Float8Tensor) else p.detach()
        v = v.double().flatten()
        total += (v * torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device).remainder(97)).sum() * (i + 1)
    if not rt.distributed:
        return [total.item()]
    from fp8.comm import Collectives

    out = torch.zeros(rt.world, dtype=torch.float64, device=rt.device)
    Collectives().all_gather(out, total.reshape(1), tag="finetune checksum").wait()
    return out.tolist()


class JsonLog:
    """Writes JSON lines (rank 0 only); prints a short line per step."""

    def __init__(self, path: Path | None, rt: Runtime) -> None:
        self.file = open(path, "w", encoding="utf-8") if (path and rt.main) else None
        self.main = rt.main

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def print(self, *a) -> None:
        if self.main:
            print(*a, flush=True)

    def close(self) -> None:
        if self.file:
            self.file.close()


# ----------------------------------------------------------------------------------------------- export


def master_state(model, optimizer, level: str, rt: Runtime) -> dict[str, torch.Tensor]:
    """fp32 values of ``model``'s parameters by name, from the optimizer's master weights where it keeps them
    (O1: the wrapped optimizer's high-precision masters; O2/O3: ``master_value``, O3 broadcast from each
    tensor's owner); FP8 weights without a master are dequantized."""
    import fp8

    names = {id(p): n for n, p in model.named_parameters()}
    values: dict[str, torch.Tensor] = {}
    masters: dict[int, torch.Tensor] = {}
    if level == "O1":
        masters = {id(w): m for m, w in optimizer.pairs}
    for name, p in model.named_parameters():
        if level in ("O2", "O3") and hasattr(optimizer, "master_value"):
            if level == "O3" and rt.distributed:
                from fp8.comm import Collectives

                owner = optimizer.owner(p)
                v = (optimizer.master_value(p).detach().clone() if rt.rank == owner
                     else torch.empty(p.shape, dtype=torch.float32, device=p.device))
                Collectives().broadcast(v, tag="finetune export masters", src=owner).wait()
            else:
                v = optimizer.master_value(p)
        elif id(p) in masters:
            v = masters[id(p)]
        elif isinstance(p, fp8.Float8Tensor):
            v = p.dequantize(torch.float32)
        else:
            v = p
        values[name] = v.detach().to(torch.float32).cpu()
    assert len(values) == len(names)
    return values


def save_bf16(model, optimizer, tokenizer, out: Path, level: str, rt: Runtime) -> None:
    """Write ``out``: a transformers directory of ``model``'s architecture in BF16 holding the trained values
    (:func:`master_state`; transformers ``Conv1D`` weights transposed back), plus the tokenizer."""
    from transformers import AutoModelForCausalLM

    state = master_state(model, optimizer, level, rt)
    if not rt.main:
        return
    import fp8
    from fp8.convert import is_conv1d

    fresh = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    target = dict(fresh.named_parameters())
    # transformers Conv1D weights are stored (in, out); the masters of the ones converted to FP8 are (out, in)
    trained = dict(model.named_modules())
    conv1d = {f"{name}.weight" for name, module in fresh.named_modules()
              if is_conv1d(module) and isinstance(trained.get(name), fp8.Float8Linear)}
    load = {}
    for name, v in state.items():
        if name not in target:
            raise RuntimeError(f"export: parameter {name!r} of the trained model is not in a fresh "
                               f"{type(fresh).__name__}; the model's structure changed")
        load[name] = v.t() if name in conv1d else v
    fresh.load_state_dict(load, strict=False)
    # Parameters not loaded must be tied to loaded ones (e.g. lm_head.weight sharing the embedding table).
    loaded_storage = {target[n].data_ptr() for n in load}
    untouched = [n for n, t in target.items() if n not in load and t.data_ptr() not in loaded_storage]
    if untouched:
        raise RuntimeError(f"export: no trained value for {untouched[:4]}")
    fresh = fresh.to(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


# ----------------------------------------------------------------------------------------------- demo


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


def _demo_pairs(plays, context_lines: int = 4, response_lines: int = 2):
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
    pairs = _demo_pairs(plays)
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


def die(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# -- the scripts' shared skeleton ----------------------------------------------------------------------------------
def run_main(args: argparse.Namespace, run) -> int:
    """``run(args, rt)`` on the runtime ``args`` ask for; bad data or flags found on the way: one line, exit 2."""
    from megatron.training.data.corpus import MissingCorpusError

    try:
        rt = setup_runtime(args)
        return run(args, rt)
    except DataError as e:
        die(str(e))
    except MissingCorpusError as e:  # the demo task and the demo base model are built from the corpus
        die(str(e.with_alternative("pass --data FILE.jsonl (your examples) and --model DIR (a transformers "
                                   "causal-LM directory with its tokenizer) to fine-tune without the demo corpus")))
    return 0


def load_task(args: argparse.Namespace, rt: Runtime, task: str, keys: Sequence[str]):
    """``(train_rows, eval_rows, model_dir, model, tokenizer)``: ``--data`` (its held-out tail) or the demo task of
    ``task``, and ``--model`` (or the demo base model) loaded on ``rt.device``."""
    if args.data is not None:
        train_rows, eval_rows = split_heldout(load_jsonl(args.data, keys), args.eval_examples)
    else:
        train_rows, eval_rows = demo_rows(task, args.demo_examples, args.eval_examples, args.seed)
    model_dir = resolve_model(args, rt)
    model, tokenizer = load_model(model_dir, rt.device)
    return train_rows, eval_rows, model_dir, model, tokenizer


def training_setup(model, args: argparse.Namespace, rt: Runtime):
    """AdamW on ``model`` through :func:`fp8_setup`, and the warm-up + cosine scheduler on the optimizer it returns:
    ``(train_model, model, optimizer, scheduler)``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    train_model, model, optimizer = fp8_setup(model, optimizer, args, rt)
    inner = getattr(optimizer, "optimizer", optimizer)
    return train_model, model, optimizer, torch.optim.lr_scheduler.LambdaLR(inner, lr_lambda(args))


def optimizer_step(model, optimizer, scheduler, args: argparse.Namespace, memory: dict | None):
    """Clip, step, schedule, then ``zero_grad``; ``(grad_norm, memory)`` where ``memory`` is ``fp8.memory_report`` taken
    at the first step (after the step, before ``zero_grad``: every state exists), or the one given."""
    import fp8

    grad_norm = clip(model, optimizer, args.clip_grad)
    optimizer.step()
    scheduler.step()
    if memory is None:
        memory = fp8.memory_report(model, optimizer)
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, memory


def nonfinite(loss_value: float, step: int, log: "JsonLog") -> bool:
    """Whether the loss left the finite range (said in the log, which is closed: the script then exits 1)."""
    if math.isfinite(loss_value):
        return False
    log.print(f"error: loss is {loss_value} at step {step}; lower --lr or use --fp8-opt-level none")
    log.close()
    return True


def finish(model, optimizer, tokenizer, args: argparse.Namespace, rt: Runtime, log: "JsonLog") -> int:
    """``--output`` (BF16, from the masters), then the log closed and the process group torn down."""
    if args.output is not None:
        save_bf16(model, optimizer, tokenizer, args.output, args.fp8_opt_level, rt)
        log.print(f"wrote {args.output} (BF16, transformers)")
    log.close()
    teardown(rt)
    return 0
