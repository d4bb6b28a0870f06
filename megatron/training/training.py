"""The training loop of ``pretrain_gpt.py``: megatron-core's schedules around fp8lm's FP8 layers.

One call of :func:`pretrain` sets up the process groups (``torch.distributed`` + megatron-core's
``parallel_state``; gloo on CPU, NCCL on GPU), then trains the requested opt level (and any
``--compare`` levels) at the same seed and on the same data, and returns their histories.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import socket
import time
from functools import partial

import torch
import torch.distributed as dist

from fp8.distributed import CommBytesCounter, DistributedDataParallel
from fp8.memory import memory_report
from fp8.optim.clip import scale_grads_to_norm_
from fp8.parallel.linear import _ParallelLinearBase
from fp8.scaling import discard_step_amaxes
from fp8.tensor import Float8Tensor
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection

from . import cpu_compat
from .grads import finalize_model_grads, global_grad_norm
from .log import TrainingLogger
from .model import build_model, padded_vocab_size, transformer_config_from_args
from .optimizer import build_optimizer
from .p2p import FP8P2PCommunicator

__all__ = ["pretrain", "initialize_distributed", "initialize_model_parallel", "train_level", "RunHistory"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_distributed(args: argparse.Namespace) -> None:
    """``torch.distributed`` (from torchrun's environment, or a 1-process group) and megatron-core's
    model-parallel groups; on machines without CUDA, the CPU compatibility layer."""
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        if "RANK" in os.environ:
            if cuda:
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl" if cuda else "gloo")
        else:
            dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1)
    if not cuda:
        cpu_compat.enable()  # also when the groups were set up by the caller
    if not parallel_state.model_parallel_is_initialized():
        initialize_model_parallel(args)


def initialize_model_parallel(args: argparse.Namespace, **kwargs) -> None:
    """megatron-core's model-parallel groups for ``args``'s layout (``kwargs`` go to
    ``parallel_state.initialize_model_parallel``); on machines without CUDA, the CPU compatibility layer first."""
    if not torch.cuda.is_available():
        cpu_compat.enable()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        **kwargs,
    )


class RunHistory(dict):
    """Per-iteration records of one level's run (``"train"``: list of dicts, ``"valid"``: list of dicts,
    ``"summary"``: dict)."""


def _lr_at(args: argparse.Namespace, it: int) -> float:
    if args.lr_warmup_iters and it < args.lr_warmup_iters:
        return args.lr * (it + 1) / args.lr_warmup_iters
    if args.lr_decay_style == "constant":
        return args.lr
    span = max(1, args.lr_decay_iters - args.lr_warmup_iters)
    progress = min(1.0, (it - args.lr_warmup_iters) / span)
    if args.lr_decay_style == "linear":
        return args.min_lr + (args.lr - args.min_lr) * (1 - progress)
    return args.min_lr + (args.lr - args.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float()
    mask = loss_mask.to(losses.dtype)
    loss = (losses * mask).sum() / mask.sum().clamp(min=1)
    # A copy: megatron-core divides the returned loss by the number of micro-batches in place.
    return loss, {"lm loss": loss.detach().clone()}


class _Datasets:
    """Train/valid datasets of the run (real data through megatron-core, or mock)."""

    def __init__(self, args: argparse.Namespace) -> None:
        needed = args.train_iters * args.global_batch_size
        # No evaluation asked for: no validation samples needed (a corpus too small for a validation split trains).
        eval_samples = args.eval_iters * args.global_batch_size if args.eval_interval else 0
        if args.mock_data:
            from .mock_data import MockGPTDataset

            self.vocab_size = args.vocab_size
            self.train = MockGPTDataset(args.vocab_size, args.seq_length, needed, args.seed)
            self.valid = MockGPTDataset(args.vocab_size, args.seq_length, max(eval_samples, args.global_batch_size),
                                        args.seed + 1)
            self.tokenizer = None
            return
        from .data import build_gpt_datasets, check_data_files, prepare_default_corpus
        from .tokenizer import SentencePieceTokenizer

        if args.data_path is None:
            rank0 = dist.get_rank() == 0
            if rank0:
                args.data_path, args.tokenizer_model = prepare_default_corpus(log=print)
            paths = [args.data_path, args.tokenizer_model]
            dist.broadcast_object_list(paths, src=0)
            args.data_path, args.tokenizer_model = paths
        if args.tokenizer_model is None:
            raise ValueError("--data-path needs --tokenizer-model (the PREFIX.model written by tools/preprocess_data.py)")
        check_data_files(args.data_path, args.tokenizer_model)
        self.tokenizer = SentencePieceTokenizer(args.tokenizer_model)
        self.vocab_size = self.tokenizer.vocab_size
        self.train, self.valid, _ = build_gpt_datasets(
            args.data_path, self.tokenizer, args.seq_length, args.split, (needed, eval_samples, 0), args.seed,
        )


def _batches(dataset, args, dp_rank: int, dp_size: int, consumed: int = 0, cycle: bool = True):
    from .data import gpt_batch_iterator

    return gpt_batch_iterator(dataset, args.micro_batch_size, consumed_samples=consumed, data_parallel_rank=dp_rank,
                              data_parallel_size=dp_size, cycle=cycle)


_PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "shared",
                     "shared_embedding", "allreduce", "is_embedding_or_output_parameter")


def _to_device(chunk: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Move ``chunk`` to ``device`` keeping megatron's attributes on its parameters (moving a module can
    replace tensor-subclass parameters, e.g. FP8 weights, by new objects)."""
    params = list(chunk.parameters())
    if all(p.device == device for p in params):
        return chunk
    saved = {name: {a: getattr(p, a) for a in _PARAM_ATTRIBUTES if hasattr(p, a)}
             for name, p in chunk.named_parameters()}
    chunk = chunk.to(device)
    for name, p in chunk.named_parameters():
        for attr, value in saved.get(name, {}).items():
            setattr(p, attr, value)
    return chunk


class _Run:
    """Everything one level's training needs on this rank."""

    def __init__(self, args: argparse.Namespace, datasets: _Datasets) -> None:
        self.args = args
        self.counter = CommBytesCounter()
        cpu_compat.seed(args.seed, parallel_state.get_tensor_model_parallel_rank(),
                        parallel_state.get_pipeline_model_parallel_rank())
        self.autocast = args.bf16
        pipeline_dtype = torch.bfloat16 if args.bf16 else torch.float32
        self.config = transformer_config_from_args(args, pipeline_dtype)
        self.vocab_size = padded_vocab_size(datasets.vocab_size, args)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = device
        chunks = build_model(args, self.config, self.vocab_size)
        chunks = [_to_device(c, device) for c in chunks]
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, _ParallelLinearBase):
                    module.set_counter(self.counter)
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_size = dist.get_world_size(self.dp_group)
        self.dp_rank = dist.get_rank(self.dp_group)
        self.bare_chunks = chunks
        self.optimizer = build_optimizer(args, chunks, self.dp_group)
        if hasattr(self.optimizer, "counter"):  # O3: its weight all-gather and agreement collectives
            self.optimizer.counter = self.counter
        if self.dp_size > 1:
            self.chunks = [DistributedDataParallel(c, process_group=self.dp_group, counter=self.counter) for c in chunks]
            self.config.no_sync_func = self.chunks[0].no_sync if len(self.chunks) == 1 else [c.no_sync for c in self.chunks]
        else:
            self.chunks = chunks
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_size = dist.get_world_size(self.pp_group)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.first_stage = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        self.last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.embd_group = parallel_state.get_embedding_group(check_initialized=False)
        self.tied = not args.untie_embeddings_and_output_weights
        norm_group = parallel_state.get_model_parallel_group()
        sharded = args.fp8_opt_level == "O3" or args.use_distributed_optimizer
        self.norm_group = dist.group.WORLD if sharded and self.dp_size > 1 else norm_group
        fp8_pipeline = args.fp8_pipeline == "on" or (args.fp8_pipeline == "auto" and args.fp8_opt_level != "none")
        self.schedule_kwargs = {}
        if self.pp_size > 1:
            p2p = FP8P2PCommunicator(self.pp_group, self.config, fp8=fp8_pipeline, device=device, counter=self.counter)
            pgs = ProcessGroupCollection()
            pgs.tp, pgs.cp, pgs.pp = self.tp_group, parallel_state.get_context_parallel_group(), self.pp_group
            pgs.embd = self.embd_group
            pgs.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
            pgs.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
            self.schedule_kwargs = {"p2p_communicator": p2p, "pg_collection": pgs}
        self.forward_backward = get_forward_backward_func()
        self.skipped_steps = 0
        self.params = sum(p.numel() for c in chunks for p in c.parameters())

    def _model_arg(self):
        return self.chunks if len(self.chunks) > 1 else self.chunks[0]

    def data_iterators(self, dataset, consumed: int = 0):
        """The schedule's data iterator(s): with virtual pipeline stages, one identical iterator per model
        chunk (each chunk's forward step reads the micro-batch it is working on)."""
        its = [_batches(dataset, self.args, self.dp_rank, self.dp_size, consumed=consumed) for _ in self.chunks]
        return its if len(its) > 1 else its[0]

    def _average_loss(self, losses: list[dict]) -> float:
        """Mean ``lm loss`` over micro-batches and data-parallel ranks, known on every rank."""
        if losses:
            vals = torch.stack([d["lm loss"].float().reshape(()) for d in losses])
            t = torch.tensor([vals.sum().item(), float(len(losses))], dtype=torch.float64)
        else:
            t = torch.zeros(2, dtype=torch.float64)
        dist.all_reduce(t)
        return float(t[0] / t[1]) if t[1] > 0 else float("nan")

    def _context(self):
        if self.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, data_iterator, it: int) -> dict:
        args = self.args
        lr = _lr_at(args, it)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        with self._context():
            losses = self.forward_backward(
                forward_step_func=_forward_step, data_iterator=data_iterator,
                model=self._model_arg(), num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size, forward_only=False, **self.schedule_kwargs,
            )
        finalize_model_grads(self.bare_chunks, self.tp_group, self.embd_group, self.tied and self.pp_size > 1,
                             self.counter)
        norm = global_grad_norm(self.bare_chunks, self.tp_rank, self.norm_group, self.first_stage)
        finite = bool(torch.isfinite(norm))
        if finite:
            if args.clip_grad > 0:
                grads = [p.grad for c in self.bare_chunks for p in c.parameters() if p.grad is not None]
                scale_grads_to_norm_(grads, norm, args.clip_grad)
            self.optimizer.step()
        else:
            self.skipped_steps += 1
            for chunk in self.bare_chunks:
                discard_step_amaxes(chunk)
        return {"loss": self._average_loss(losses), "lr": lr, "grad_norm": float(norm), "skipped": not finite}

    @torch.no_grad()
    def evaluate(self, dataset) -> float:
        args = self.args
        it = self.data_iterators(dataset)
        losses = []
        for chunk in self.chunks:
            chunk.eval()
        with self._context():
            for _ in range(args.eval_iters):
                losses += self.forward_backward(
                    forward_step_func=_forward_step, data_iterator=it, model=self._model_arg(),
                    num_microbatches=args.num_microbatches, seq_length=args.seq_length,
                    micro_batch_size=args.micro_batch_size, forward_only=True, **self.schedule_kwargs,
                )
        for chunk in self.chunks:
            chunk.train()
        return self._average_loss(losses)

    def mu(self) -> float | None:
        if self.dp_size > 1 and self.args.fp8_opt_level != "none" and hasattr(self.chunks[0], "grad_scaling"):
            return float(self.chunks[0].grad_scaling.mu)
        return None


def _sum_over_ranks(by_tag: dict[str, float]) -> dict[str, float]:
    """Bytes sent per tag, summed over every rank of the job."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(by_tag))
    total: dict[str, float] = {}
    for part in gathered:
        for tag, value in part.items():
            total[tag] = total.get(tag, 0.0) + value
    return total


def train_level(args: argparse.Namespace, datasets: _Datasets, logger: TrainingLogger) -> RunHistory:
    """Train ``args.fp8_opt_level`` for ``args.train_iters`` iterations; returns its history."""
    from .checkpointing import load_checkpoint, save_checkpoint
    from .exit import ExitPolicy

    run = _Run(args, datasets)
    start = 0
    run.consumed_samples = 0
    if args.load:
        start = load_checkpoint(args.load, run, getattr(args, "ckpt_step", None))
    exit_policy = ExitPolicy(args, run.device)
    history = RunHistory(level=args.fp8_opt_level, train=[], valid=[], params_on_rank=run.params)
    data = run.data_iterators(datasets.train, consumed=run.consumed_samples)
    tokens_per_iter = args.global_batch_size * args.seq_length
    logger.start_level(args.fp8_opt_level, args.train_iters, start)
    for it in range(start, args.train_iters):
        run.counter.reset()
        t0 = time.perf_counter()
        step = run.train_step(data, it)
        elapsed = time.perf_counter() - t0
        record = {
            "level": args.fp8_opt_level, "iteration": it + 1, **step, "iteration_time_s": elapsed,
            "tokens_per_s": tokens_per_iter / elapsed, "skipped_steps": run.skipped_steps,
            "mu": run.mu(), "comm_bytes": dict(run.counter.by_tag),
            "comm_bytes_total": run.counter.total, "comm_bytes_all_ranks": _sum_over_ranks(run.counter.by_tag),
        }
        record["memory"] = memory_report(run.bare_chunks[0] if len(run.bare_chunks) == 1 else
                                         torch.nn.ModuleList(run.bare_chunks), run.optimizer)
        if args.eval_interval and ((it + 1) % args.eval_interval == 0 or it + 1 == args.train_iters):
            record["val_loss"] = run.evaluate(datasets.valid)
            history["valid"].append({"iteration": it + 1, "val_loss": record["val_loss"]})
        history["train"].append(record)
        logger.log_iteration(record)
        stop = exit_policy.reason(it + 1)
        if args.save and (stop or (args.save_interval and (it + 1) % args.save_interval == 0)
                          or it + 1 == args.train_iters):
            save_checkpoint(args.save, run, it + 1)
        if stop:
            history["stopped"] = {"iteration": it + 1, "reason": stop, "saved": bool(args.save)}
            if dist.get_rank() == 0:
                print(f"stopping after iteration {it + 1} ({stop})"
                      + (f"; checkpoint saved in {args.save}" if args.save else ""), flush=True)
            break
    exit_policy.close()
    history["summary"] = _summary(history, run)
    logger.end_level(history["summary"])
    return history


def _summary(history: RunHistory, run: _Run) -> dict:
    train = history["train"]
    tail = train[-10:] if train else []
    memory = next((r["memory"] for r in reversed(train) if "memory" in r), {})
    params = run.params
    bytes_per_iter = {}
    for r in train[1:] or train:
        for tag, b in r["comm_bytes"].items():
            bytes_per_iter[tag] = bytes_per_iter.get(tag, 0.0) + b
    n = max(1, len(train[1:] or train))
    return {
        "level": history["level"],
        "final_train_loss": sum(r["loss"] for r in tail) / max(1, len(tail)) if tail else float("nan"),
        "final_val_loss": history["valid"][-1]["val_loss"] if history["valid"] else float("nan"),
        # Tokens over time, after the first iteration (warm-up: lazy allocations, first-step scaling).
        "tokens_per_s": (sum(r["tokens_per_s"] * r["iteration_time_s"] for r in train[1:])
                         / max(1e-9, sum(r["iteration_time_s"] for r in train[1:]))) if len(train) > 1 else
        (train[0]["tokens_per_s"] if train else 0.0),
        "model_state_bytes_per_param": memory.get("total", 0) / max(1, params),
        "memory": memory,
        "params_on_rank": params,
        "comm_bytes_per_iteration": {k: v / n for k, v in bytes_per_iter.items()},
        "skipped_steps": run.skipped_steps,
        "fp8_weights": sum(1 for c in run.bare_chunks for p in c.parameters() if isinstance(p, Float8Tensor)),
    }


def pretrain(args: argparse.Namespace) -> list[RunHistory]:
    """Train ``--fp8-opt-level`` and every ``--compare`` level (baseline first) at the same seed and data."""
    initialize_distributed(args)
    logger = TrainingLogger(args, rank=dist.get_rank(), is_logging_rank=_is_logging_rank())
    datasets = _Datasets(args)
    logger.banner(datasets, dist.get_world_size())
    levels = list(args.compare_levels) + [args.fp8_opt_level]
    levels.sort(key=lambda lvl: ("none", "O1", "O2", "O3").index(lvl))
    histories = []
    main_level = args.fp8_opt_level
    for level in levels:
        args.fp8_opt_level = level
        histories.append(train_level(args, datasets, logger))
    args.fp8_opt_level = main_level
    logger.finish(histories)
    return histories


def _is_logging_rank() -> bool:
    """The last pipeline stage's first rank (it sees the loss first); rank 0 if there is one stage."""
    return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0)
