"""Sharded, resumable checkpoints of FP8 training (opt levels O2 and O3) through
``torch.distributed.checkpoint`` (DCP), written atomically.

Layout (flat DCP keys; every tensor is stored under its parameter's FQN, so a checkpoint written at
one data-parallel size loads at another):

- ``model/<fqn>``: high-precision parameters; ``model/<fqn>/payload`` (``uint8`` bytes of the FP8
  payload) and ``model/<fqn>/scale`` for FP8 weights; ``buffers/<fqn>``: other module buffers.
  Identical on every rank: DCP writes them once.
- ``optim/<fqn>/<key>``: the optimizer state of each parameter (``master``, ``exp_avg``,
  ``exp_avg_sq``, ``momentum_buffer`` payloads, FP8 ones as ``uint8``, their ``*_scale``, ``step``),
  written by its owner only (O3), or once (O2).
- ``scaling/rank<r>/<fqn>``: each rank's delayed-scaling state (amax histories and scales are each
  rank's own statistics); a rank beyond the saved world size takes rank ``r % saved_world``'s.
- ``mu/<name>``: the DDP wrapper's :class:`~fp8.distributed.AutoScaleState` (mu, counts).
- ``meta`` (JSON bytes): format version, world size, hyper-parameters of the param groups, skipped steps, dtypes.

Atomicity: every rank writes into ``<path>.partial``; only after all ranks finished does rank 0 move
the previous checkpoint aside (``<path>.old``), rename ``.partial`` to ``<path>`` and delete the old
one. A write that fails on any rank (DCP raises on every rank) leaves ``<path>`` untouched; if the
process dies between the two renames, :func:`load_checkpoint` falls back to ``<path>.old``. Ranks must
share the filesystem. Before the rename, the ranks hash the written files (SHA-256, each rank a share of
them) into ``checksums.sha256``; every load verifies them first and names any corrupted or missing file.
:func:`write_atomically` and :func:`verify_checksums` are the same machinery for other flat state dicts
(``pretrain_gpt.py --save`` uses them).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from .comm import Collectives, CommBytesCounter
from .distributed.sharding import is_dtensor, local, rows_as_dtensor
from .fallback import FallbackHooks
from .formats import byte_view
from .optim.base import FP8Optimizer
from .optim.levels import OptLevelMismatchError, level_name
from .optim.precision import OptimizerPrecision
from .optim.sharded import ShardedFP8Optimizer
from .scaling import ScalingState
from .schedule import PrecisionSchedule
from .tensor import Float8Tensor

__all__ = ["save_checkpoint", "load_checkpoint", "write_atomically", "verify_checksums", "resolve_checkpoint",
           "file_sha256", "CheckpointError", "CheckpointCorruptedError", "CheckpointMismatchError",
           "CheckpointNotFoundError", "CHECKPOINT_VERSION", "CHECKSUMS"]

CHECKPOINT_VERSION = 1
"""Layout version written in ``meta``."""

_PARTIAL, _OLD = ".partial", ".old"


def _split(model: nn.Module):
    """(bare module, mu state or None) for a bare model or an ``fp8.distributed.DistributedDataParallel``."""
    from .distributed.ddp import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        return model.module, model.grad_scaling
    return model, None


def _group_info(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _rows_of(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``t`` (this rank's rows of a tensor shaped like ``param``, or a whole tensor) as DCP should see it: under FSDP2
    (``param`` a ``Shard(0)`` DTensor) a DTensor of those rows in the parameter's global shape, sharing ``t``'s storage,
    so DCP writes each rank's rows and reads them back at any world size, or into one process's whole tensors; else
    ``t`` itself (0-d scales and steps, agreed over the shard group, stay whole)."""
    if not is_dtensor(param) or t.dim() == 0 or tuple(t.shape[1:]) != tuple(param.shape[1:]) \
            or t.shape[0] != local(param).shape[0]:
        return t
    return rows_as_dtensor(t, param)


def _reshard(module: nn.Module) -> None:
    """Put FSDP2's sharded parameters back in the modules (its root stays unsharded after a forward without a
    backward, e.g. an evaluation), as FSDP2's own ``state_dict`` does."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return
    for m in module.modules():
        if isinstance(m, fsdp.FSDPModule):
            m.reshard()


def _state(model: nn.Module, optimizer: FP8Optimizer, group: dist.ProcessGroup | None,
           scaling_rank: int) -> dict[str, Any]:
    """The flat state dict of this rank; its tensors share storage with the live ones (in-place load). A model
    sharded by FSDP2 contributes each rank's rows as DTensors (:func:`_rows_of`)."""
    module, mu = _split(model)
    if not isinstance(optimizer, FP8Optimizer):
        raise TypeError(
            f"fp8.checkpoint saves the FP8 optimizers of opt levels O2 and O3, got {type(optimizer).__name__}; "
            f"use torch.distributed.checkpoint with get_state_dict for other optimizers"
        )
    _reshard(module)
    optimizer.follow_sharding()  # FSDP2 sharded the model since the optimizer's last call: take the shards over
    out: dict[str, Any] = {}
    names = {}
    for name, p in module.named_parameters():
        names[id(p)] = name
        shard = local(p)
        if isinstance(shard, Float8Tensor):
            out[f"model/{name}/payload"] = _rows_of(byte_view(shard.payload), p)
            out[f"model/{name}/scale"] = shard.scale
        else:
            out[f"model/{name}"] = _rows_of(shard.detach(), p)
    for mod_name, mod in module.named_modules():
        for buf_name, buf in mod.named_buffers(recurse=False):
            if buf is None:
                continue
            fqn = f"{mod_name}.{buf_name}" if mod_name else buf_name
            prefix = f"scaling/rank{scaling_rank}" if isinstance(mod, ScalingState) else "buffers"
            out[f"{prefix}/{fqn}"] = buf
    owns = optimizer.owns if isinstance(optimizer, ShardedFP8Optimizer) else (lambda p: True)
    for group_ in optimizer.param_groups:
        for p in group_["params"]:
            if id(p) not in names:
                raise ValueError("the optimizer holds a parameter that is not in the model; checkpoint the model it trains")
            if not p.requires_grad or not owns(p):
                continue
            state = optimizer.state[p]
            if not state:
                optimizer._init_state(p, group_)
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"optim/{names[id(p)]}/{key}"] = _rows_of(byte_view(value), p)
    if mu is not None:
        for name, buf in mu.named_buffers():
            out[f"mu/{name}"] = buf
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item()
    raise TypeError(f"param group value {value!r} cannot be stored in the checkpoint's meta")


def _meta(module: nn.Module, optimizer: FP8Optimizer, world: int) -> dict[str, Any]:
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    params = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    fp8_dtypes = {n: str(p.payload.dtype).removeprefix("torch.") for n, p in module.named_parameters()
                  if isinstance(p, Float8Tensor) and id(p) in params}
    return {"version": CHECKPOINT_VERSION, "world_size": world, "param_groups": groups,
            "skipped_steps": optimizer.skipped_steps, "fp8_dtypes": fp8_dtypes, "config": _config(module, optimizer),
            "opt_level": optimizer.opt_level, "extensions": _extension_state(optimizer)}


def _extensions(optimizer) -> list:
    """The optimizer's automatic-fallback and scheduled-precision hooks (:func:`fp8.fallback.attach`,
    :func:`fp8.schedule.attach`), whose state ``optimizer.state_dict()`` carries; this checkpoint, which builds its own
    flat state, keeps it in its meta."""
    hooks = list(optimizer._optimizer_state_dict_post_hooks.values())
    return [h.__self__ for h in hooks if isinstance(getattr(h, "__self__", None), (FallbackHooks, PrecisionSchedule))]


def _extension_state(optimizer) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for owner in _extensions(optimizer):
        owner.save_state(optimizer, out)
    return out


def _load_extensions(optimizer, saved: dict[str, Any]) -> None:
    """Before the tensors are read: the schedule first, then the fallback (its linears at their saved settings, so
    their weights' scale layouts match the checkpoint's)."""
    owners = sorted(_extensions(optimizer), key=lambda o: not isinstance(o, PrecisionSchedule))
    for owner in owners:
        if owner.KEY in saved:
            owner.load_state(optimizer, {owner.KEY: saved[owner.KEY]})
    for owner in owners:  # as after optimizer.load_state_dict: the schedule's switch once more, after the fallback
        if isinstance(owner, PrecisionSchedule):
            owner.after_load(optimizer)


def _saved_level(meta: dict[str, Any]) -> str | None:
    """The opt level a checkpoint was written at: recorded, or told from its optimizer class and precision
    (checkpoints written before the level was recorded); None when neither is known."""
    if meta.get("opt_level"):
        return str(meta["opt_level"])
    config = meta.get("config")
    if not config:
        return None
    try:
        precision = OptimizerPrecision(**config["precision"])
    except (TypeError, ValueError):
        return None
    return level_name("O3" if str(config["optimizer"]).startswith("Sharded") else "O2", precision)


def _check_level(path: Path, meta: dict[str, Any], optimizer: Any) -> None:
    """Refuse a checkpoint of another opt level (or an optimizer fp8.checkpoint does not hold) naming both."""
    saved = _saved_level(meta)
    mine = getattr(optimizer, "opt_level", None) or f"none ({type(optimizer).__name__})"
    # The level itself (O2, O3) here; a precision difference within it is named by _check_config.
    if isinstance(optimizer, FP8Optimizer) and (saved is None or saved.split()[0] == mine.split()[0]):
        return
    raise OptLevelMismatchError(
        f"checkpoint {path} holds opt level {saved or 'O2/O3'} optimizer state and cannot be loaded into an opt level "
        f"{mine} optimizer ({type(optimizer).__name__}): fp8.checkpoint reshards across data-parallel sizes but does "
        f"not convert between opt levels (O1: FP32 master weights, O2: FP8/FP16 moments and masters, O3: O2's "
        f"sharded). Load it at opt level {saved or 'O2/O3'}")


def _config(module: nn.Module, optimizer: FP8Optimizer) -> dict[str, Any]:
    """What a load must match: the optimizer's class and storage precision, every parameter's name, shape
    and storage dtype."""
    return {
        "optimizer": type(optimizer).__name__,
        "precision": dataclasses.asdict(optimizer.precision),
        "params": {n: [list(p.shape), str(local(p).payload.dtype if isinstance(local(p), Float8Tensor) else p.dtype)]
                   for n, p in module.named_parameters()},  # global shapes, storage dtypes (FSDP2: the shards')
    }


class CheckpointError(Exception):
    """Base of every checkpoint error of fp8lm (fp8's checkpoints and ``pretrain_gpt.py``'s): the message names what
    is wrong and the fix."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint saved with another model shape, optimizer or precision (``pretrain_gpt.py``: another flag, named
    with both values); the message names each difference."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint where one is asked for (``--load``, an iteration); the message says what is there and the fix."""


def _check_config(path: Path, saved: dict[str, Any] | None, module: nn.Module, optimizer: FP8Optimizer) -> None:
    if saved is None:
        return  # written before the configuration was recorded
    mine = _config(module, optimizer)
    diffs = []
    if saved["optimizer"] != mine["optimizer"]:
        diffs.append(f"optimizer {saved['optimizer']} (checkpoint) vs {mine['optimizer']} (this run)")
    # the rounding mode is not a storage layout: a run may switch it at a resume
    diffs += [f"precision {k} {v!r} (checkpoint) vs {mine['precision'].get(k)!r} (this run)"
              for k, v in saved["precision"].items() if mine["precision"].get(k) != v and k != "exp_avg_rounding"]
    for name in sorted(set(saved["params"]) | set(mine["params"])):
        a, b = saved["params"].get(name), mine["params"].get(name)
        if a != b:
            diffs.append(f"parameter {name} {a or 'absent'} (checkpoint) vs {b or 'absent'} (this run)")
    if diffs:
        shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
        raise CheckpointMismatchError(
            f"checkpoint {path} does not fit this model and optimizer: {shown}. Build them as they were when it "
            f"was saved (model, optimizer class, OptimizerPrecision / opt level)")


class CheckpointCorruptedError(CheckpointError, ValueError):
    """A checkpoint file does not match its checksum, or is missing; the message names the files."""


CHECKSUMS = "checksums.sha256"
"""File in every checkpoint directory: ``<sha256>  <file name>`` per file, written before the
directory is renamed into place and verified by every load."""


def file_sha256(path: Path) -> str:
    """The SHA-256 hex digest of the file at ``path``, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _my_files(directory: Path, rank: int, world: int) -> list[Path]:
    """The files of ``directory`` this rank hashes (every ``world``-th, by name): the work is shared."""
    files = sorted(f for f in directory.iterdir() if f.is_file() and f.name != CHECKSUMS)
    return files[rank::world]


def _gather(obj: Any, comm: Collectives | None) -> list[Any]:
    return [obj] if comm is None else comm.all_gather_object(obj, "checkpoint")


def _coordination(group: dist.ProcessGroup | None, distributed: bool,
                  counter: CommBytesCounter | None) -> Collectives | None:
    """The collectives that coordinate the ranks of a save or load (None in a single process)."""
    return Collectives(group, counter) if distributed else None


def write_atomically(path: str | os.PathLike, state: dict[str, Any], *,
                     process_group: dist.ProcessGroup | None = None, counter: CommBytesCounter | None = None) -> None:
    """Write the flat DCP ``state`` to the directory ``path`` with checksums, atomically (module
    docstring): call on every rank of ``process_group``. A failure on any rank raises ``RuntimeError``
    on every rank and keeps the previous checkpoint at ``path``. ``counter`` counts the coordination's
    bytes (tag ``"checkpoint"``)."""
    path = Path(path)
    rank, world = _group_info(process_group)
    partial, old = path.with_name(path.name + _PARTIAL), path.with_name(path.name + _OLD)
    distributed = world > 1 or (dist.is_available() and dist.is_initialized())
    comm = _coordination(process_group, distributed, counter)
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        path.parent.mkdir(parents=True, exist_ok=True)
    if comm is not None:
        comm.barrier("checkpoint")
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(partial)), process_group=process_group,
                 no_dist=not distributed)
    except BaseException as error:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        if isinstance(error, CheckpointException):  # a BaseException raised on every rank by DCP
            causes = {r: e[0] if isinstance(e, tuple) else e for r, e in error.failures.items()}
            failures = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in causes.items())
            raise RuntimeError(f"checkpoint write to {path} failed ({failures}); the previous checkpoint is "
                               f"kept") from error
        raise
    if comm is not None:
        comm.barrier("checkpoint")  # every rank's files are complete
    sums = {f.name: file_sha256(f) for f in _my_files(partial, rank, world)}
    all_sums = _gather(sums, comm)
    if rank == 0:
        merged = dict(sorted(kv for part in all_sums for kv in part.items()))
        tmp = partial / (CHECKSUMS + ".tmp")
        with open(tmp, "w") as f:
            f.writelines(f"{digest}  {name}\n" for name, digest in merged.items())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, partial / CHECKSUMS)
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(partial, path)
        shutil.rmtree(old, ignore_errors=True)
    if comm is not None:
        comm.barrier("checkpoint")


def verify_checksums(path: str | os.PathLike, *, process_group: dist.ProcessGroup | None = None,
                     counter: CommBytesCounter | None = None) -> None:
    """Check every file of the checkpoint directory ``path`` against its ``checksums.sha256`` (the
    ranks of ``process_group`` share the files); raise ``ValueError`` on every rank naming the files
    that differ or are missing. Call on every rank of the group."""
    path = Path(path)
    rank, world = _group_info(process_group)
    distributed = dist.is_available() and dist.is_initialized()
    problems: list[str] = []
    listing = path / CHECKSUMS
    if not listing.exists():
        problems.append(f"{CHECKSUMS} is missing (not written by a complete save)")
        expected: dict[str, str] = {}
    else:
        expected = {}
        for line in listing.read_text().splitlines():
            digest, _, name = line.partition("  ")
            expected[name] = digest
    if expected:
        names = sorted(expected)[rank::world]
        for name in names:
            f = path / name
            if not f.exists():
                problems.append(f"{name} is missing")
            elif file_sha256(f) != expected[name]:
                problems.append(f"{name} does not match its checksum")
    comm = _coordination(process_group, distributed, counter)
    messages = sorted({m for part in _gather(problems, comm) for m in part})
    if messages:
        raise CheckpointCorruptedError(f"checkpoint {path} is corrupted: {'; '.join(messages[:8])}"
                         f"{' ...' if len(messages) > 8 else ''}; restore the files or load another checkpoint")


def save_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: FP8Optimizer, *,
    process_group: dist.ProcessGroup | None = None, counter: CommBytesCounter | None = None,
) -> None:
    """Write ``model`` (bare, or its ``fp8.distributed.DistributedDataParallel`` wrapper: mu included)
    and ``optimizer`` (O2 or O3) to the directory ``path``, atomically (module docstring). Call on
    every rank of ``process_group`` (the data-parallel group; None: the default group). A failure on
    any rank raises ``RuntimeError`` on every rank and keeps the previous checkpoint."""
    rank, world = _group_info(process_group)
    state = _state(model, optimizer, process_group, rank)
    state["meta"] = io.BytesIO(json.dumps(_meta(_split(model)[0], optimizer, world), default=_jsonable).encode())
    write_atomically(path, state, process_group=process_group, counter=counter)


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """The directory to read for the checkpoint written at ``path`` (``path``, or its ``.old`` copy when a
    save was interrupted between its two renames)."""
    path = Path(path)
    if path.exists():
        return path
    old = path.with_name(path.name + _OLD)
    if old.exists():  # interrupted between the two renames of save_checkpoint
        return old
    raise FileNotFoundError(f"no checkpoint at {path}")


def _read(path: Path, state: dict[str, Any], reader, process_group, distributed: bool) -> None:
    """``dcp.load`` into ``state``; DCP's ``CheckpointException`` (a ``BaseException``) is raised as the
    :class:`CheckpointCorruptedError` it is."""
    try:
        dcp.load(state, storage_reader=reader, process_group=process_group, no_dist=not distributed)
    except CheckpointException as error:
        raise CheckpointCorruptedError(f"checkpoint {path} could not be read ({error}); restore the files or load "
                                       f"another checkpoint") from error


def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, optimizer: FP8Optimizer, *,
    process_group: dist.ProcessGroup | None = None, counter: CommBytesCounter | None = None,
) -> dict[str, Any]:
    """Restore ``model`` (bare or DDP-wrapped) and ``optimizer`` from ``path`` in place, bit for bit,
    at any data-parallel size: each rank reads the states of the parameters it owns now. Build them as
    for training (``fp8.initialize``, the wrapper) first; the precision must match the saved one.
    Returns the checkpoint's ``meta`` (world size it was written at, hyper-parameters)."""
    path = resolve_checkpoint(path)
    rank, world = _group_info(process_group)
    distributed = dist.is_available() and dist.is_initialized()
    verify_checksums(path, process_group=process_group, counter=counter)
    reader = dcp.FileSystemReader(str(path))
    meta_holder: dict[str, Any] = {"meta": io.BytesIO()}
    _read(path, meta_holder, reader, process_group, distributed)
    meta = json.loads(meta_holder["meta"].getvalue().decode())
    if meta.get("version") != CHECKPOINT_VERSION:
        raise ValueError(f"{path}: checkpoint layout version {meta.get('version')}, expected {CHECKPOINT_VERSION}")
    _check_level(path, meta, optimizer)
    _check_config(path, meta.get("config"), _split(model)[0], optimizer)
    saved_world = int(meta["world_size"])
    _load_extensions(optimizer, meta.get("extensions", {}))
    state = _state(model, optimizer, process_group, rank % saved_world)
    loaded = {k: v for k, v in state.items() if not k.startswith("scaling/")}
    loaded.update({k: v for k, v in state.items() if k.startswith("scaling/")})
    _read(path, loaded, dcp.FileSystemReader(str(path)), process_group, distributed)
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise ValueError(f"{path}: {len(meta['param_groups'])} param groups saved, the optimizer has "
                         f"{len(optimizer.param_groups)}")
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        group.update({k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    optimizer.skipped_steps = int(meta["skipped_steps"])
    return meta

