"""The training loop of ``pretrain_gpt.py``: megatron-core's schedules around fp8lm's FP8 layers.

One call of :func:`pretrain` sets up the process groups (``torch.distributed`` + megatron-core's
``parallel_state``; gloo on CPU, NCCL on GPU), then trains the requested opt level (and any
``--compare`` levels) at the same seed and on the same data, and returns their histories.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import socket
import time
from functools import partial

import torch
import torch.distributed as dist

from fp8.comm import Collectives, CommBytesCounter
from fp8.comm_trace import CollectiveTrace
from fp8.schedule import switch as switch_precision
from fp8.distributed import DistributedDataParallel
from fp8.memory import memory_report
from fp8.tensor import Float8Tensor
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.process_groups_config import ProcessGroupCollection

from .config import OptimizerConfig, ParallelConfig, RunConfig
from .config_rules import ConfigurationError
from .compat import cpu as cpu_compat
from .distributed.core_collective_bytes import record_core_collectives, record_core_construction
from .compat.core_trace import check_trace_directory, trace_megatron_core
from .distributed.grads import (clip_and_poison_, finalize_model_grads, global_grad_norm, model_grads, scale_grads_,
                                unique_parameters,
                                reduce_tied_embedding_grads, tied_embedding_weights)
from .compat.pipeline_p2p import FP8P2PCommunicator
from .monitoring.fp8_numerics import NumericsMonitor
from .gpt_layer_specs import global_module_names
from .moe import is_routed_expert_param
from .monitoring.health import SkipMonitor
from .monitoring.log import TrainingLogger
from .model import announce_layer_selection, build_model, padded_vocab_size, transformer_config_from_args
from .optimizer import build_optimizer, cast_to_bf16_

__all__ = ["pretrain", "initialize_distributed", "initialize_model_parallel", "train_level", "RunHistory", "TrainingRun",
           "Datasets", "TrainState", "traced", "train_iterations", "gpt_forward_step", "loss_func", "PendingRecords", "BytesSince"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def initialize_distributed(cfg: RunConfig) -> None:
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
        initialize_model_parallel(cfg.parallel)


def initialize_model_parallel(parallel: ParallelConfig, **kwargs) -> None:
    """megatron-core's model-parallel groups for the layout ``parallel`` (``kwargs`` go to
    ``parallel_state.initialize_model_parallel``); on machines without CUDA, the CPU compatibility layer first."""
    if not torch.cuda.is_available():
        cpu_compat.enable()
    kwargs.setdefault("expert_model_parallel_size", parallel.expert_model_parallel_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        **kwargs,
    )


@dataclasses.dataclass
class TrainState:
    """What one level's training has done so far, besides the model and optimizer: what a checkpoint saves with them
    and a resume restores. ``iteration``: finished training iterations; ``consumed_samples``: the data position (the
    samples the finished iterations read); ``skipped``: the steps skipped for non-finite gradients, a 0-d int64 counter
    on the run's device (read only at log and save points)."""

    iteration: int
    consumed_samples: int
    skipped: torch.Tensor


class RunHistory(dict):
    """Per-iteration records of one level's run (``"train"``: list of dicts, ``"valid"``: list of dicts,
    ``"summary"``: dict)."""


def _lr_at(opt: OptimizerConfig, it: int) -> float:
    if opt.lr_warmup_iters and it < opt.lr_warmup_iters:
        return opt.lr * (it + 1) / opt.lr_warmup_iters
    if opt.lr_decay_style == "constant":
        return opt.lr
    span = max(1, opt.lr_decay_iters - opt.lr_warmup_iters)
    progress = min(1.0, (it - opt.lr_warmup_iters) / span)
    if opt.lr_decay_style == "linear":
        return opt.min_lr + (opt.lr - opt.min_lr) * (1 - progress)
    return opt.min_lr + (opt.lr - opt.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))


def gpt_forward_step(data_iterator, model):
    """One micro-batch through ``model`` (a pipeline chunk): ``(output, loss function)``."""
    batch = next(data_iterator)
    device = next(model.parameters()).device
    # The data pipeline builds micro-batches on the host; copy them to the model's device from pinned memory,
    # asynchronously (no host read, no device synchronisation).
    batch = {k: _to_device_async(v, device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def _to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: a host tensor pinned, then copied without blocking (on one device, ``t`` itself)."""
    if device.type == "cuda" and t.device.type == "cpu":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    losses = output_tensor.float()
    mask = loss_mask.to(losses.dtype)
    loss = (losses * mask).sum() / mask.sum().clamp(min=1)
    # A copy: megatron-core divides the returned loss by the number of micro-batches in place.
    return loss, {"lm loss": loss.detach().clone()}


class Datasets:
    """Train/valid datasets of the run (real data through megatron-core, or mock). ``data``: ``cfg.data`` with the
    default corpus's paths filled in when it is used (the run's config is then ``cfg.replace(data=...)``)."""

    def __init__(self, cfg: RunConfig, counter: CommBytesCounter | None = None) -> None:
        needed = cfg.training.train_iters * cfg.training.global_batch_size
        # No evaluation asked for: no validation samples needed (a corpus too small for a validation split trains).
        eval_samples = cfg.training.eval_iters * cfg.training.global_batch_size if cfg.training.eval_interval else 0
        if cfg.data.mock_data:
            from .data.mock_data import MockGPTDataset

            self.vocab_size = cfg.model.vocab_size
            self.train = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, needed, cfg.training.seed)
            self.valid = MockGPTDataset(cfg.model.vocab_size, cfg.model.seq_length, max(eval_samples, cfg.training.global_batch_size),
                                        cfg.training.seed + 1)
            self.tokenizer = None
            self.data = cfg.data
            return
        from .data.datasets import build_gpt_datasets, check_data_files, prepare_default_corpus
        from .data.tokenizer import SentencePieceTokenizer

        data = cfg.data
        if data.data_path is None:
            paths = prepare_default_corpus(log=print) if dist.get_rank() == 0 else None
            paths = Collectives(counter=counter).broadcast_object(list(paths or (None, None)), "start-up")
            data = dataclasses.replace(data, data_path=paths[0], tokenizer_model=paths[1])
        if data.tokenizer_model is None:
            raise ValueError("--data-path needs --tokenizer-model (the PREFIX.model written by tools/preprocess_data.py)")
        check_data_files(data.data_path, data.tokenizer_model)
        self.data = data
        self.tokenizer = SentencePieceTokenizer(data.tokenizer_model)
        self.vocab_size = self.tokenizer.vocab_size
        self.train, self.valid, _ = build_gpt_datasets(
            data.data_path, self.tokenizer, cfg.model.seq_length, data.split, (needed, eval_samples, 0),
            cfg.training.seed,
        )


def _batches(dataset, cfg, dp_rank: int, dp_size: int, consumed: int = 0, cycle: bool = True):
    from .data.datasets import gpt_batch_iterator

    return gpt_batch_iterator(dataset, cfg.training.micro_batch_size, consumed_samples=consumed, data_parallel_rank=dp_rank,
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


class TrainingRun:
    """Everything one level's training needs on this rank."""

    def __init__(self, cfg: RunConfig, datasets: Datasets, counter: CommBytesCounter | None = None) -> None:
        """Built in order: the model chunks on this rank's device (:meth:`_build_model`), the optimizer of the opt
        level (:meth:`_build_optimizer`), the data-parallel wrappers (:meth:`_wrap_data_parallel`), the collectives
        of the step (:meth:`_build_collectives`), the pipeline schedule (:meth:`_build_schedule`) and the FP8
        statistics (:meth:`_build_monitoring`)."""
        self.cfg = cfg
        self.counter = counter if counter is not None else CommBytesCounter()
        cpu_compat.seed(cfg.training.seed, parallel_state.get_tensor_model_parallel_rank(),
                        parallel_state.get_pipeline_model_parallel_rank())
        chunks = self._build_model(datasets)
        self._build_optimizer(chunks)
        self._wrap_data_parallel(chunks)
        self._build_collectives(chunks)
        self._build_schedule()
        self._build_monitoring(chunks)

    def _build_model(self, datasets: Datasets) -> list[torch.nn.Module]:
        """This rank's model chunks on its device (BF16 with --bf16), the data-parallel group, and the FP8 layer
        selection announced once per pipeline stage (its first tensor- and data-parallel rank)."""
        cfg = self.cfg
        # --bf16 is Megatron's: BF16 parameters (so BF16 activations, no autocast), FP32 main gradients and
        # masters in the optimizer (megatron/training/optimizer.py).
        self.autocast = False
        pipeline_dtype = torch.bfloat16 if cfg.precision.bf16 else torch.float32
        self.config = transformer_config_from_args(cfg, pipeline_dtype)
        self.vocab_size = padded_vocab_size(datasets.vocab_size, cfg)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.device = device
        chunks = build_model(cfg, self.config, self.vocab_size, counter=self.counter)
        if cfg.precision.bf16:
            cast_to_bf16_(chunks)
        chunks = [_to_device(c, device) for c in chunks]
        self.dp_group = parallel_state.get_data_parallel_group()
        self.dp_size = dist.get_world_size(self.dp_group)
        self.dp_rank = dist.get_rank(self.dp_group)
        self.fp8_selection = announce_layer_selection(
            cfg, chunks, log=self.dp_rank == 0 and parallel_state.get_tensor_model_parallel_rank() == 0)
        self.bare_chunks = chunks
        self.params = sum(p.numel() for c in chunks for p in c.parameters())
        return chunks

    def _build_optimizer(self, chunks: list[torch.nn.Module]) -> None:
        """The optimizer of the opt level over ``chunks``; under expert parallelism the experts' gradients are reduced
        (and at O3 owned) over the expert-data-parallel group, the rest over data parallelism."""
        cfg = self.cfg
        self.ep_size = parallel_state.get_expert_model_parallel_world_size()
        self.expert_params = ([p for p in unique_parameters(chunks) if is_routed_expert_param(p)]
                              if self.ep_size > 1 else [])
        self.expert_dp_group = parallel_state.get_expert_data_parallel_group() if self.expert_params else None
        self.optimizer = build_optimizer(cfg, chunks, self.dp_group, self.expert_params, self.expert_dp_group,
                                         counter=self.counter)  # O3: its weight all-gather and agreement counted
        self.main_grads = self.optimizer.main_grads  # --bf16 baseline: FP32 main gradients (else None)
        # A sharded optimizer (O3, --use-distributed-optimizer) with pipeline and data parallelism: the two copies of
        # tied embeddings may have different owners on their stages, so their gradients are summed over the
        # embedding group before the data-parallel reduction (megatron-core's order), outside DDP's buckets.
        self.sharded = cfg.precision.fp8_opt_level == "O3" or cfg.optimizer.use_distributed_optimizer
        pp_world = parallel_state.get_pipeline_model_parallel_world_size()
        tie_first = (self.sharded and self.dp_size > 1 and pp_world > 1
                     and not cfg.model.untie_embeddings_and_output_weights)
        self.tied_weights = tied_embedding_weights(chunks) if tie_first else []

    def _wrap_data_parallel(self, chunks: list[torch.nn.Module]) -> None:
        """fp8lm's data-parallel wrappers (the O3 owners' reduction; the experts' own over expert data parallelism),
        or the bare chunks (one data-parallel rank, or the --bf16 baseline's main gradients)."""
        self.tied_owner = None
        self.expert_ddps: list[DistributedDataParallel] = []  # the experts' wrappers over expert data parallelism
        if not (self.dp_size > 1 and self.main_grads is None):
            self.chunks = chunks
            return
        owners = self.optimizer.owner
        self.tied_owner = owners.owner if owners is not None else None
        experts = {id(p) for p in self.expert_params}
        self.chunks = [DistributedDataParallel(c, process_group=self.dp_group, counter=self.counter, o3_optimizer=owners,
                                               exclude=self.tied_weights + [p for p in c.parameters()
                                                                            if id(p) in experts])
                       for c in chunks]
        no_sync = [c.no_sync for c in self.chunks]
        if self.expert_params and dist.get_world_size(self.expert_dp_group) > 1:
            # the experts' wrappers (hooks only: forward runs through the data-parallel wrappers above)
            expert_owners = owners.expert_owners() if owners is not None else None
            expert_ddps = [DistributedDataParallel(c, process_group=self.expert_dp_group, counter=self.counter,
                                                   o3_optimizer=expert_owners,
                                                   exclude=[p for p in c.parameters() if id(p) not in experts])
                           for c in chunks]
            no_sync = [_joint_no_sync(a.no_sync, b.no_sync) for a, b in zip(self.chunks, expert_ddps)]
            self.expert_ddps = expert_ddps
        self.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync

    def _build_collectives(self, chunks: list[torch.nn.Module]) -> None:
        """The groups of the step and one ``Collectives`` per group, built once: the step's gradient sums and norm go
        through these; megatron-core's construction-time collectives recorded in the byte counter."""
        cfg = self.cfg
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.pp_size = dist.get_world_size(self.pp_group)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = dist.get_world_size(self.tp_group)
        self.first_stage = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
        self.last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.embd_group = parallel_state.get_embedding_group(check_initialized=False)
        self.tied = not cfg.model.untie_embeddings_and_output_weights
        record_core_construction(self.counter, chunks,
                                 dist.get_world_size(self.embd_group) if self.embd_group is not None else 1)
        norm_group = parallel_state.get_model_parallel_group()
        self.norm_group = dist.group.WORLD if self.sharded and self.dp_size > 1 else norm_group
        self.tp_comm = Collectives(self.tp_group, self.counter)
        self.norm_comm = Collectives(self.norm_group, self.counter)
        in_embd = self.embd_group is not None and dist.get_rank(self.embd_group) >= 0
        self.embd_comm = Collectives(self.embd_group, self.counter) if in_embd else None
        self.dp_comm = Collectives(self.dp_group, self.counter)
        # unsharded, the experts' squared gradient norms are summed over the expert-parallel group first (sharded,
        # the norm's group is every rank, each expert counted on its owner)
        self.expert_norm_comm = (Collectives(parallel_state.get_expert_model_parallel_group(), self.counter)
                                 if self.expert_params and self.norm_group is not dist.group.WORLD else None)
        if self.tied_weights and self.embd_comm is None:
            raise RuntimeError("tied embeddings on a rank outside megatron-core's embedding group")
        self.world = Collectives(dist.group.WORLD, self.counter)

    def _build_schedule(self) -> None:
        """megatron-core's forward-backward schedule; with pipeline parallelism its communicator, FP8 messages at FP8
        levels (``--fp8-pipeline``)."""
        cfg = self.cfg
        fp8_pipeline = cfg.precision.fp8_pipeline == "on" or (cfg.precision.fp8_pipeline == "auto" and cfg.precision.fp8_opt_level != "none")
        self.schedule_kwargs = {}
        if self.pp_size > 1:
            p2p = FP8P2PCommunicator(self.pp_group, self.config, fp8=fp8_pipeline, device=self.device,
                                     counter=self.counter,
                                     recipe=cfg.precision.fp8_recipe if cfg.precision.fp8_opt_level != "none" else "tensorwise")
            pgs = ProcessGroupCollection()
            pgs.tp, pgs.cp, pgs.pp = self.tp_group, parallel_state.get_context_parallel_group(), self.pp_group
            pgs.embd = self.embd_group
            pgs.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
            pgs.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
            self.schedule_kwargs = {"p2p_communicator": p2p, "pg_collection": pgs}
        self.forward_backward = get_forward_backward_func()
        self.state = TrainState(0, 0, torch.zeros((), dtype=torch.int64, device=self.device))

    def _build_monitoring(self, chunks: list[torch.nn.Module]) -> None:
        """--fp8-stats-interval: FP8 numerics statistics, read at the log points (megatron/training/monitoring/fp8_numerics.py)."""
        cfg = self.cfg
        self.numerics = None
        if cfg.stats.fp8_stats_interval and cfg.precision.fp8_opt_level != "none":
            self.numerics = NumericsMonitor(cfg.stats, chunks, self.world, [global_module_names(c) for c in chunks],
                                            log=_is_logging_rank())

    def forward_step(self, data_iterator, model):
        """The schedule's forward step: :func:`gpt_forward_step`, and the micro-batch's megatron-core collectives
        (embedding, output layer, loss) recorded in the byte counter."""
        out = gpt_forward_step(data_iterator, model)
        cfg = self.cfg
        record_core_collectives(
            self.counter, getattr(model, "module", model), tp_size=self.tp_size,
            sequence_parallel=cfg.parallel.sequence_parallel, tokens=cfg.model.seq_length * cfg.training.micro_batch_size,
            hidden_size=cfg.model.hidden_size, activation_bytes=self.config.pipeline_dtype.itemsize,
            backward=torch.is_grad_enabled())
        return out

    def _model_arg(self):
        return self.chunks if len(self.chunks) > 1 else self.chunks[0]

    def data_iterators(self, dataset, consumed: int = 0):
        """The schedule's data iterator(s): with virtual pipeline stages, one identical iterator per model
        chunk (each chunk's forward step reads the micro-batch it is working on)."""
        its = [_batches(dataset, self.cfg, self.dp_rank, self.dp_size, consumed=consumed) for _ in self.chunks]
        return its if len(its) > 1 else its[0]

    def loss_sum_count(self, losses: list[dict]) -> torch.Tensor:
        """``[sum of lm loss, number of micro-batches]`` over this step's micro-batches and every rank
        (fp32, on the run's device: the all-reduce's tensor lives on the group's device, CUDA for NCCL;
        nothing is read to the host). Ranks off the last pipeline stage contribute zeros."""
        if losses:
            vals = torch.stack([d["lm loss"].detach().float().reshape(()) for d in losses]).to(self.device)
            t = torch.stack([vals.sum(), torch.full((), float(len(losses)), device=self.device)])
        else:
            t = torch.zeros(2, dtype=torch.float32, device=self.device)
        self.world.all_reduce(t, tag="loss").wait()
        return t

    @staticmethod
    def _mean(sum_count: torch.Tensor) -> torch.Tensor:
        return torch.where(sum_count[1] > 0, sum_count[0] / sum_count[1].clamp(min=1),
                           torch.full_like(sum_count[0], float("nan")))

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (reads the device counter: call at log/save time only)."""
        return int(self.state.skipped)

    def _context(self):
        if self.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, data_iterator, it: int) -> dict:
        cfg = self.cfg
        lr = _lr_at(cfg.optimizer, it)
        self.optimizer.set_lr(lr)
        self.optimizer.zero_grad()
        with self._context():
            losses = self.forward_backward(
                forward_step_func=self.forward_step, data_iterator=data_iterator,
                model=self._model_arg(), num_microbatches=cfg.training.num_microbatches, seq_length=cfg.model.seq_length,
                micro_batch_size=cfg.training.micro_batch_size, forward_only=False, **self.schedule_kwargs,
            )
        self._reduce_grads()
        norm = global_grad_norm(self.bare_chunks, self.tp_rank, self.norm_comm, self.first_stage, self.device,
                                self.expert_norm_comm)
        # Clipping, and the skip decision on device: a non-finite global norm turns every gradient into NaN,
        # and every opt level's optimizer skips a step with non-finite gradients on device (no host read).
        finite = clip_and_poison_(model_grads(self.bare_chunks), norm, cfg.optimizer.clip_grad)
        self.optimizer.step(finite)
        self.state.skipped += (~finite).to(torch.int64)
        self.state.iteration = it + 1
        self.state.consumed_samples += cfg.training.global_batch_size
        return {"loss": self._mean(self.loss_sum_count(losses)), "lr": lr, "grad_norm": norm,
                "skipped": ~finite}

    def _reduce_grads(self) -> None:
        """The step's gradients made whole: tied embeddings summed over the embedding group (outside DDP's buckets),
        the --bf16 baseline's FP32 main gradients reduced, the experts' averaged over expert parallelism, and
        megatron-core's own finalisation (sequence-parallel norms, tied embeddings across pipeline stages)."""
        if self.tied_weights and self.main_grads is not None:
            # --bf16 with --use-distributed-optimizer: the tied copies' FP32 main gradients summed over the embedding
            # group before the data-parallel reduction (which then frees the ones this rank does not own).
            for weight in self.tied_weights:
                if weight.main_grad is None:
                    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                self.embd_comm.all_reduce(weight.main_grad, tag="tied embedding grads").wait()
        elif self.tied_weights:
            # Kept out of DDP's buckets: summed over the embedding group, then reduced over data parallel to the owner.
            reduce_tied_embedding_grads(self.tied_weights, self.embd_comm, self.dp_comm, self.tied_owner)
        if self.main_grads is not None:
            self.main_grads.finish()  # --bf16: FP32 main gradients reduced over data parallel
        elif self.expert_params:
            # averaged over the expert-data-parallel group (or alone on a rank): each expert saw the tokens of all
            # expert-parallel ranks, so its gradient is the sum over the data-parallel ranks' losses / EP
            scale_grads_([p.grad for p in self.expert_params if p.grad is not None], 1.0 / self.ep_size)
        finalize_model_grads(self.bare_chunks, self.tp_comm, self.embd_comm,
                             self.tied and self.pp_size > 1 and not self.tied_weights)

    @torch.no_grad()
    def evaluate(self, dataset) -> float:
        cfg = self.cfg
        it = self.data_iterators(dataset)
        losses = []
        for chunk in self.chunks:
            chunk.eval()
        with self._context():
            for _ in range(cfg.training.eval_iters):
                losses += self.forward_backward(
                    forward_step_func=self.forward_step, data_iterator=it, model=self._model_arg(),
                    num_microbatches=cfg.training.num_microbatches, seq_length=cfg.model.seq_length,
                    micro_batch_size=cfg.training.micro_batch_size, forward_only=True, **self.schedule_kwargs,
                )
        for chunk in self.chunks:
            chunk.train()
        return float(self._mean(self.loss_sum_count(losses)))  # one host read per evaluation

    def mu(self) -> torch.Tensor | None:
        """The data-parallel gradient scaling factor mu after this step (a device value, or None)."""
        if self.dp_size > 1 and self.cfg.precision.fp8_opt_level != "none" and hasattr(self.chunks[0], "grad_scaling"):
            mu = self.chunks[0].grad_scaling.mu
            return mu.detach().clone() if isinstance(mu, torch.Tensor) else torch.tensor(float(mu))
        return None


def train_level(cfg: RunConfig, datasets: Datasets, logger: TrainingLogger,
                counter: CommBytesCounter | None = None) -> RunHistory:
    """Train ``cfg.precision.fp8_opt_level`` for ``cfg.training.train_iters`` iterations; returns its history. ``counter``
    (default: a new one) counts every byte this rank sends, start-up and evaluation included."""
    from .checkpointing.checkpoint import load_checkpoint
    from .exit import ExitPolicy

    run = TrainingRun(cfg, datasets, counter)
    start = 0
    if cfg.checkpoint.load:
        start = load_checkpoint(cfg.checkpoint.load, run, cfg.checkpoint.ckpt_step)  # restores run.state
        if start >= cfg.training.train_iters:
            raise ConfigurationError(
                f"--load {cfg.checkpoint.load} holds iteration {start}, at or past --train-iters {cfg.training.train_iters}: raise "
                f"--train-iters to train on (nothing was trained or saved)")
    exit_policy = ExitPolicy(cfg.checkpoint, run.device, run.world)
    try:
        history = train_iterations(cfg, datasets, logger, run, start, exit_policy)
    finally:
        exit_policy.close()
    history["summary"] = _summary(history, run)
    logger.end_level(history["summary"])
    return history


def train_iterations(cfg: RunConfig, datasets: Datasets, logger: TrainingLogger, run: TrainingRun, start: int,
                     exit_policy) -> RunHistory:
    from .checkpointing.checkpoint import save_checkpoint

    health = SkipMonitor(cfg.training.max_skipped_steps, cfg.training.skipped_steps_window, announce=dist.get_rank() == 0)
    history = RunHistory(level=cfg.precision.fp8_opt_level, train=[], valid=[], params_on_rank=run.params)
    data = run.data_iterators(datasets.train, consumed=run.state.consumed_samples)
    logger.start_level(cfg.precision.fp8_opt_level, cfg.training.train_iters, start)
    pending = PendingRecords(cfg, run)
    sent = BytesSince(run.counter)
    for it in range(start, cfg.training.train_iters):
        if run.numerics is not None:
            run.numerics.begin_step(it + 1)
        _scheduled_precision(cfg, run, it + 1)
        step = run.train_step(data, it)
        pending.add(it + 1, step, *sent.take(), run.mu())
        evaluate = bool(cfg.training.eval_interval) and ((it + 1) % cfg.training.eval_interval == 0 or it + 1 == cfg.training.train_iters)
        stop = exit_policy.reason(it + 1)
        save = bool(cfg.checkpoint.save) and (stop is not None or it + 1 == cfg.training.train_iters
                                    or bool(cfg.checkpoint.save_interval and (it + 1) % cfg.checkpoint.save_interval == 0))
        if (evaluate or save or stop or (it + 1) % max(1, cfg.training.log_interval) == 0
                or it + 1 == cfg.training.train_iters):
            records = pending.flush()  # the one host read of the interval (every rank at the same iterations)
            if run.numerics is not None:
                run.numerics.read(records)  # FP8 statistics into the last record; alarms (every rank the same)
            if evaluate:
                records[-1]["val_loss"] = run.evaluate(datasets.valid)
                history["valid"].append({"iteration": it + 1, "val_loss": records[-1]["val_loss"]})
            for record in records:
                history["train"].append(record)
                logger.log_iteration(record)
            health.observe(records)  # before any save: a run that is not training stops here
        if save:
            save_checkpoint(cfg.checkpoint.save, run, it + 1)
        if stop:
            history["stopped"] = {"iteration": it + 1, "reason": stop, "saved": bool(cfg.checkpoint.save)}
            if dist.get_rank() == 0:
                print(f"stopping after iteration {it + 1} ({stop})"
                      + (f"; checkpoint saved in {cfg.checkpoint.save}" if cfg.checkpoint.save else ""), flush=True)
            break
    return history


def _scheduled_precision(cfg: RunConfig, run: TrainingRun, iteration: int) -> None:
    """``--fp8-high-precision-from-iteration N`` (``--fp8-high-precision-mode forward | linear``) and
    ``--fp4-bf16-forward-from-iteration N`` (NVFP4, forward): from iteration ``N`` on, every FP8 linear runs its
    forward GEMM, or all its GEMMs, in high precision (:func:`fp8.schedule.switch`; weights stay FP8 at rest). Decided
    from the iteration number at every iteration (idempotent), so a run resumed past ``N`` switches at its first
    iteration: no checkpoint state."""
    p = cfg.precision
    switch, mode, flag = p.fp8_high_precision_from_iteration, p.fp8_high_precision_mode, "--fp8-high-precision-from-iteration"
    if p.fp4_bf16_forward_from_iteration is not None:
        switch, mode, flag = p.fp4_bf16_forward_from_iteration, "forward", "--fp4-bf16-forward-from-iteration"
    if switch is None or iteration < switch:
        return
    changed = sum(switch_precision(chunk, mode) for chunk in run.bare_chunks)
    if changed and _is_logging_rank():
        what = "forward GEMMs" if mode == "forward" else "GEMMs (forward and backward)"
        kept = "; their backward stays in FP8" if mode == "forward" else "; their weights stay FP8 at rest"
        print(f"iteration {iteration}: the {what} of {changed} FP8 linear(s) run in high precision (BF16 with --bf16) "
              f"from now on ({flag} {switch}){kept}", flush=True)


class PendingRecords:
    """Per-iteration values kept on device until the next log point, then read to the host in one
    batch (:meth:`flush`): loss, gradient norm, skip flag, skipped-steps counter, mu.

    Wall time is measured between log points (a GPU runs asynchronously, so only a point where the host
    waits for the device gives true times): each record of an interval gets the interval's mean
    iteration time. The bytes each rank sent (host-side counters) are summed over ranks at the flush.
    """

    _KEYS = ("loss", "grad_norm", "skipped", "skipped_steps", "mu")

    def __init__(self, cfg: RunConfig, run: TrainingRun) -> None:
        self.cfg, self.run = cfg, run
        self.items: list[dict] = []
        self.t_last = time.perf_counter()

    def add(self, iteration: int, step: dict, comm_bytes: dict, comm_total: float, mu) -> None:
        values = {"loss": step["loss"], "grad_norm": step["grad_norm"], "skipped": step["skipped"],
                  "skipped_steps": self.run.state.skipped.clone(), "mu": mu}
        self.items.append({"iteration": iteration, "lr": step["lr"], "values": values, "comm_bytes": comm_bytes,
                           "comm_bytes_total": comm_total})

    def flush(self) -> list[dict]:
        if not self.items:
            return []
        run, cfg = self.run, self.cfg
        device_values = [item["values"][k] for item in self.items for k in self._KEYS if item["values"][k] is not None]
        host = torch.stack([v.detach().reshape(()).to(run.device, torch.float64) for v in device_values]).tolist()
        now = time.perf_counter()
        per_iteration = (now - self.t_last) / len(self.items)
        self.t_last = now
        all_ranks = _sum_over_ranks_per_iteration(run.world, [item["comm_bytes"] for item in self.items])
        tokens = cfg.training.global_batch_size * cfg.model.seq_length
        records = []
        cursor = 0
        for item, summed in zip(self.items, all_ranks):
            values = {}
            for key in self._KEYS:
                if item["values"][key] is None:
                    values[key] = None
                else:
                    values[key] = host[cursor]
                    cursor += 1
            records.append({
                "level": cfg.precision.fp8_opt_level, "iteration": item["iteration"], "loss": values["loss"], "lr": item["lr"],
                "grad_norm": values["grad_norm"], "skipped": bool(values["skipped"]),
                "iteration_time_s": per_iteration, "tokens_per_s": tokens / max(per_iteration, 1e-12),
                "skipped_steps": int(values["skipped_steps"]), "mu": values["mu"], "comm_bytes": item["comm_bytes"],
                "comm_bytes_total": item["comm_bytes_total"], "comm_bytes_all_ranks": summed,
            })
        memory = memory_report(run.bare_chunks[0] if len(run.bare_chunks) == 1 else
                               torch.nn.ModuleList(run.bare_chunks), run.optimizer.inner)
        main = run.optimizer.main_grad_bytes()  # --bf16's FP32 main gradients, held across the step
        memory["weight gradients"] += main
        memory["total"] += main
        records[-1]["memory"] = memory
        self.items = []
        return records


class BytesSince:
    """The bytes this rank sent since the previous record, by tag and in total: an iteration's record holds
    its step's collectives and those after the previous record (its evaluation, the log gathering)."""

    def __init__(self, counter: CommBytesCounter) -> None:
        self.counter = counter
        self.seen = dict(counter.by_tag)

    def take(self) -> tuple[dict[str, float], float]:
        now = dict(self.counter.by_tag)
        delta = {tag: b - self.seen.get(tag, 0.0) for tag, b in now.items() if b != self.seen.get(tag, 0.0)}
        self.seen = now
        return delta, float(sum(delta.values()))


def _sum_over_ranks_per_iteration(world: Collectives, per_iteration: list[dict[str, float]]) -> list[dict[str, float]]:
    """Bytes sent per tag and iteration, summed over every rank of the job (one object all-gather for
    the whole interval)."""
    gathered = world.all_gather_object(list(per_iteration), "log")
    out = []
    for i in range(len(per_iteration)):
        total: dict[str, float] = {}
        for part in gathered:
            for tag, value in part[i].items():
                total[tag] = total.get(tag, 0.0) + value
        out.append(total)
    return out


def _summary(history: RunHistory, run: TrainingRun) -> dict:
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
        "fp8_linears": run.fp8_selection[0],  # this rank's linears in FP8, and those kept out (names)
        "high_precision_linears": [name for name, _ in run.fp8_selection[1]],
    }


def pretrain(cfg: RunConfig) -> list[RunHistory]:
    """Train ``--fp8-opt-level`` and every ``--compare`` level (baseline first) at the same seed and data; with
    ``--compare``, ``--save DIR``/``--load DIR`` use ``DIR/<level>`` for each level. With ``--collective-trace DIR``
    every rank's collectives are recorded and checked against NCCL's rules at the end (:func:`traced`)."""
    initialize_distributed(cfg)
    with traced(cfg.logging.collective_trace) as trace:
        logger = TrainingLogger(cfg, rank=dist.get_rank(), is_logging_rank=_is_logging_rank())
        datasets = Datasets(cfg, CommBytesCounter(trace=trace))
        cfg = cfg.replace(data=vars(datasets.data))  # the default corpus's paths, as checkpoints record them
        logger.banner(datasets, dist.get_world_size())
        levels = list(cfg.precision.trained_levels)
        levels.sort(key=lambda lvl: ("none", "O1", "O2", "O3").index(lvl))
        histories = []
        for level in levels:
            # each level's own config (``cfg`` is never changed): with --compare, its checkpoints in its own subdirectory
            subdir = len(levels) > 1
            save, load = cfg.checkpoint.save, cfg.checkpoint.load
            level_cfg = cfg.replace(precision={"fp8_opt_level": level}, checkpoint={
                "save": os.path.join(save, level) if subdir and save is not None else save,
                "load": os.path.join(load, level) if subdir and load is not None else load})
            histories.append(train_level(level_cfg, datasets, logger, CommBytesCounter(trace=trace)))
    logger.finish(histories)
    return histories


@contextlib.contextmanager
def traced(directory: str | None):
    """``--collective-trace``: yields this rank's :class:`fp8.comm_trace.CollectiveTrace` (None without a
    directory), with megatron-core's own calls recorded too; on the way out (also after an error) the trace is
    written to ``directory/rank<R>.jsonl``; after a normal end rank 0 checks every rank's trace and raises
    :class:`~megatron.training.compat.core_trace.CollectiveTraceError` on a violation of NCCL's rules."""
    if directory is None:
        yield None
        return
    trace = CollectiveTrace(dist.get_rank())
    core = trace_megatron_core(trace)
    try:
        yield trace
    finally:
        core.close()
        trace.save(os.path.join(directory, f"rank{dist.get_rank()}.jsonl"))
    Collectives().barrier("collective trace written")  # untraced: every file is complete before rank 0 reads
    if dist.get_rank() == 0:
        check_trace_directory(directory, dist.get_world_size(), log=print)


def _joint_no_sync(*no_syncs):
    """One ``no_sync`` context (megatron-core's ``config.no_sync_func``) entering each of ``no_syncs``."""

    @contextlib.contextmanager
    def no_sync():
        with contextlib.ExitStack() as stack:
            for enter in no_syncs:
                stack.enter_context(enter())
            yield

    return no_sync


def _is_logging_rank() -> bool:
    """The last pipeline stage's first rank (it sees the loss first); rank 0 if there is one stage."""
    return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0
            and parallel_state.get_data_parallel_rank() == 0)
