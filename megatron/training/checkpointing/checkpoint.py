"""``--save`` / ``--load``: one reshardable checkpoint format for every opt level, through
``torch.distributed.checkpoint`` (DCP) and the engine's atomic writer (:mod:`fp8.checkpoint`).

Layout::

    DIR/iter_0000100/                     one DCP checkpoint (written by every rank, atomically, with
                                          checksums: fp8.checkpoint.write_atomically)
    DIR/latest_checkpointed_iteration.txt the iteration of the newest complete checkpoint, written last
    DIR/progress.txt                      "iteration N of TRAIN_ITERS" (for launchers deciding to requeue)

Flat keys of each checkpoint (names are megatron-core ``GPTModel`` names with *global* layer numbers,
so they do not depend on the pipeline split; tensor-parallel shards are stored per shard):

- ``model/<name>`` (replicated parameters) or ``model/<name>/tp<r>`` (shard ``r`` of a tensor-parallel
  parameter), in the parameter's dtype; FP8 weights as ``.../payload`` (``uint8`` bytes) and ``.../scale``.
- ``optim/<name>[/tp<r>]/<key>``: the optimizer state of the parameter (every level: torch's AdamW/SGD
  states, O1's FP32 master as ``master``, O2/O3's compressed states with their ``*_scale``), written by
  the state's owner (O3, ``--use-distributed-optimizer``) or once.
- ``scaling/dp<d>/<module>.<buffer>``: delayed-scaling states (amax histories, scales) of data-parallel
  rank ``d`` (a rank beyond the saved data-parallel size takes rank ``d % saved``'s);
  ``buffers/<name>``: other persistent buffers; ``mu/stage<p>.<v>/tp<t>/<name>``: the FP8 DDP wrapper's mu.
- ``rng/rank<r>``: CPU and CUDA generator states and the model-parallel RNG tracker of rank ``r``.
- ``meta``: JSON: iteration, consumed samples, skipped steps, the run's arguments, layout and, for every
  parameter, its tensor-parallel partitioning (dimension, stride) and FP8 format.

Same layout: restored bit for bit. Another data-parallel, tensor- or pipeline-parallel size: tensor
shards are decoded to fp32, merged (strided partitions included) and re-split; compressed optimizer
states are re-encoded at the new shard's scale; FP8 weights are re-quantized from the restored masters;
RNG streams restart from ``--seed`` (only dropout uses them). Another model shape, opt level or
optimizer stops with a message naming each difference; corrupted files are found by their checksums.

:func:`read_checkpoint` reads a saved model back in one process (merged, fp32), for tools.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from fp8.checkpoint import (CheckpointCorruptedError, CheckpointMismatchError, CheckpointNotFoundError, resolve_checkpoint,
                            verify_checksums, write_atomically)
from fp8.formats import byte_view
from fp8.optim.base import FP8Optimizer
from fp8.optim.master_weights import MasterWeightOptimizer
from fp8.optim.precision import STORAGE_FORMATS, decode, encode
from fp8.scaling import ScalingState
from fp8.blocks import dequantize_blocks, expand_scales
from fp8.tensor import Float8Tensor, to_float8

from ..config import RESUME_MATCH, RESUME_SCHEDULE, RunConfig

__all__ = ["save_checkpoint", "load_checkpoint", "read_checkpoint", "read_checkpoint_fp8", "is_megatron_checkpoint", "checkpoint_dir", "latest_iteration",
           "check_step", "describe_no_checkpoint", "CheckpointMismatchError", "CheckpointNotFoundError", "FORMAT",
           "LATEST"]

FORMAT = "fp8lm-megatron/1"
"""The format tag written in ``meta``."""

LATEST = "latest_checkpointed_iteration.txt"
PROGRESS = "progress.txt"

_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
_LOCAL_EXPERT = re.compile(r"^(\.mlp\.experts\.local_experts\.)(\d+)(\..*)$")

# What a checkpoint loads only into a run with the same values of (the model's shapes and kinds, the precision of
# its states; the parallel layout may differ) is declared on the fields of megatron.training.config: RESUME_MATCH,
# and RESUME_SCHEDULE for the schedule that --override-opt-param-scheduler lets differ.
# --fp8-precision-config's rules as validate_args read them: compared by content (a moved file is the same rules).
_PRECISION_RULES = "fp8_precision_rules"
# Parameters whose first dimension is the (padded) vocabulary: the padding depends on the TP size, and
# resharding pads or cuts the rows beyond the vocabulary (never read: token ids are below it).
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


# -- paths ----------------------------------------------------------------------------------------
def checkpoint_dir(directory: str | os.PathLike, iteration: int) -> Path:
    """``DIR/iter_XXXXXXX``: the checkpoint of ``iteration``."""
    return Path(directory) / f"iter_{iteration:07d}"


def latest_iteration(directory: str | os.PathLike) -> int | None:
    """The iteration named by ``DIR/latest_checkpointed_iteration.txt`` (None when there is none)."""
    marker = Path(directory) / LATEST
    if not marker.exists():
        return None
    text = marker.read_text().strip()
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{marker} holds {text!r}, not an iteration number; delete it or write the iteration "
                         f"of a complete checkpoint into it") from None


def _write_small(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_latest(directory: Path, iteration: int, train_iters: int) -> None:
    # _write_small replaces any ``.tmp`` a killed save left; the load of this directory removes them too.
    _write_small(directory / LATEST, f"{iteration}\n")
    # For launchers (the Slurm script requeues while the run is unfinished), no Python needed to read it.
    _write_small(directory / PROGRESS, f"iteration {iteration} of {train_iters}\n")


# -- the run's tensors under global names ---------------------------------------------------------
def _ranks() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(), "ep": ps.get_expert_model_parallel_rank(),
            "ep_size": ps.get_expert_model_parallel_world_size(), "tp_size": ps.get_tensor_model_parallel_world_size(),
            "pp_size": ps.get_pipeline_model_parallel_world_size(), "dp_size": ps.get_data_parallel_world_size()}


def _global_namer(chunk: torch.nn.Module, tied_copy: bool):
    """name in ``chunk`` -> global name (decoder layers renumbered by their global layer number, routed experts by
    their global expert index under expert parallelism; the last stage's copy of tied embeddings named as the
    embedding it copies)."""
    layers = chunk.decoder.layers if hasattr(chunk, "decoder") else []

    def name_of(name: str) -> str:
        m = _LAYER.match(name)
        if m:
            layer = layers[int(m.group(2))]
            rest = m.group(3)
            e = _LOCAL_EXPERT.match(rest)
            if e:  # megatron-core's MoELayer: local expert i is global expert local_expert_indices[i]
                rest = f"{e.group(1)}{layer.mlp.local_expert_indices[int(e.group(2))]}{e.group(3)}"
            return f"{m.group(1)}{layer.layer_number - 1}{rest}"
        if tied_copy and name == "output_layer.weight":
            return "embedding.word_embeddings.weight"
        return name

    return name_of


class _Entry:
    """One model parameter of this rank: its global name, its tensor-parallel partitioning and the
    tensor its optimizer steps (O1: the FP32 master; else the parameter)."""

    def __init__(self, name: str, param: torch.Tensor, opt_param: torch.Tensor, tp_rank: int) -> None:
        self.name, self.param, self.opt_param = name, param, opt_param
        self.sharded = bool(getattr(param, "tensor_model_parallel", False))
        self.dim = int(getattr(param, "partition_dim", 0)) if self.sharded else -1
        self.stride = int(getattr(param, "partition_stride", 1)) if self.sharded else 1
        self.key = f"{name}/tp{tp_rank}" if self.sharded else name

    def info(self) -> dict:
        fmt = str(self.param.payload.dtype).removeprefix("torch.") if isinstance(self.param, Float8Tensor) else None
        return {"sharded": self.sharded, "dim": self.dim, "stride": self.stride, "fp8": fmt,
                "dtype": str(self.param.dtype).removeprefix("torch.")}


def _entries(run) -> list[_Entry]:
    ranks = _ranks()
    masters = run.optimizer.masters
    tied = not run.cfg.model.untie_embeddings_and_output_weights
    out, seen = [], set()
    for chunk in run.bare_chunks:
        namer = _global_namer(chunk, tied and getattr(chunk, "post_process", False)
                              and not getattr(chunk, "pre_process", False))
        for name, p in chunk.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            out.append(_Entry(namer(name), p, masters.get(id(p), p), ranks["tp"]))
    return out


def _buffers(run) -> list[tuple[str, torch.Tensor, bool]]:
    """(global name, buffer, is a scaling state) of every persistent buffer of this rank's chunks."""
    out = []
    for chunk in run.bare_chunks:
        namer = _global_namer(chunk, False)
        for mod_name, mod in chunk.named_modules():
            skip = getattr(mod, "_non_persistent_buffers_set", set())
            for buf_name, buf in mod.named_buffers(recurse=False):
                if buf is None or buf_name in skip:
                    continue
                fqn = namer(f"{mod_name}.{buf_name}" if mod_name else buf_name)
                out.append((fqn, buf, isinstance(mod, ScalingState)))
    return out


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return repr(value)


def _run_args(cfg: RunConfig) -> dict:
    """Every field of ``cfg`` by its flag's name, as JSON holds it (tuples as lists, dtypes by name): what the
    checkpoint records and what a resumed run is compared by."""
    return json.loads(json.dumps(cfg.flat(), default=_jsonable))


# -- save -----------------------------------------------------------------------------------------
def save_checkpoint(directory: str | os.PathLike, run, iteration: int, consumed_samples: int | None = None) -> Path:
    """Save the whole run at ``iteration`` into ``DIR/iter_XXXXXXX`` (every rank calls it), then point
    ``DIR/latest_checkpointed_iteration.txt`` at it. An interrupted save leaves the previous checkpoint
    the latest one. Returns the checkpoint's directory."""
    directory = Path(directory)
    cfg = run.cfg
    ranks = _ranks()
    optimizer = run.optimizer
    state: dict[str, Any] = {}
    entries = _entries(run)
    for e in entries:
        p = e.param
        if isinstance(p, Float8Tensor):
            state[f"model/{e.key}/payload"] = byte_view(p.payload)
            state[f"model/{e.key}/scale"] = p.scale
        else:
            state[f"model/{e.key}"] = p.detach()
        if not (e.opt_param.requires_grad and optimizer.owns(e.opt_param)):
            continue
        for key, value in optimizer.state.get(e.opt_param, {}).items():
            if isinstance(value, torch.Tensor):
                state[f"optim/{e.key}/{key}"] = byte_view(value)
        if e.opt_param is not e.param:  # O1: the FP32 master parameter
            state[f"optim/{e.key}/master"] = e.opt_param.detach()
    for fqn, buf, scaling in _buffers(run):
        state[f"scaling/dp{ranks['dp']}/{fqn}" if scaling else f"buffers/{fqn}"] = buf
    for v, chunk in enumerate(run.chunks):
        mu = getattr(chunk, "grad_scaling", None)
        if mu is not None:
            for name, buf in mu.named_buffers():
                state[f"mu/stage{ranks['pp']}.{v}/tp{ranks['tp']}/{name}"] = buf
    for v, ddp in enumerate(run.expert_ddps):  # the experts' reduction over expert data parallelism
        for name, buf in ddp.grad_scaling.named_buffers():
            state[f"mu_experts/stage{ranks['pp']}.{v}/tp{ranks['tp']}/ep{ranks['ep']}/{name}"] = buf
    state[f"rng/rank{dist.get_rank()}"] = io.BytesIO(_rng_bytes())
    # Meta must be identical on every rank (DCP writes it once): the parameter table is gathered.
    infos = run.world.all_gather_object({e.name: e.info() for e in entries}, "checkpoint")
    params = {}
    for part in infos:
        params.update(part)
    skipped_opt = optimizer.skipped_steps
    meta = {
        "format": FORMAT, "iteration": iteration,
        "consumed_samples": run.state.consumed_samples if consumed_samples is None else consumed_samples,
        "skipped_steps": run.skipped_steps, "optimizer_skipped_steps": skipped_opt,
        "layout": {"tp": ranks["tp_size"], "pp": ranks["pp_size"], "dp": ranks["dp_size"], "ep": ranks["ep_size"],
                   "vp": cfg.parallel.virtual_pipeline_model_parallel_size, "world": dist.get_world_size()},
        "vocab_size": run.vocab_size, "raw_vocab_size": _raw_vocab(cfg), "args": _run_args(cfg), "params": dict(sorted(params.items())),
        "fp8_numerics": run.numerics.state() if getattr(run, "numerics", None) is not None else None,
    }
    state["meta"] = io.BytesIO(json.dumps(meta, default=_jsonable).encode())
    path = checkpoint_dir(directory, iteration)
    write_atomically(path, state, counter=run.counter)
    if dist.get_rank() == 0:
        _write_latest(directory, iteration, cfg.training.train_iters)
    run.world.barrier("checkpoint")
    return path


def _rng_bytes() -> bytes:
    from megatron.core.tensor_parallel import random as mrandom

    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    tracker = mrandom.get_cuda_rng_tracker()
    states["tracker"] = {k: v.clone() for k, v in tracker.get_states().items()}
    buf = io.BytesIO()
    torch.save(states, buf)
    return buf.getvalue()


def _set_rng(raw: bytes) -> None:
    from megatron.core.tensor_parallel import random as mrandom

    states = torch.load(io.BytesIO(raw), weights_only=True)
    torch.set_rng_state(states["cpu"])
    if torch.cuda.is_available() and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
    mrandom.get_cuda_rng_tracker().set_states(states["tracker"])


# -- load -----------------------------------------------------------------------------------------
def _read_meta(path: Path, distributed: bool) -> dict:
    holder: dict[str, Any] = {"meta": io.BytesIO()}
    dcp.load(holder, storage_reader=dcp.FileSystemReader(str(path)), no_dist=not distributed)
    meta = json.loads(holder["meta"].getvalue().decode())
    if meta.get("format") != FORMAT:
        raise CheckpointMismatchError(f"{path}: format {meta.get('format')!r}, this version reads {FORMAT!r}")
    return meta


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _difference(key: str, saved: dict, this: dict) -> str:
    """One refused difference, naming the flag and both values."""
    if key == _PRECISION_RULES:
        def rules(values: dict) -> str:
            if not values.get(key):
                return "none (no --fp8-precision-config)"
            return f"{values[key]!r} from {values.get('fp8_precision_config')}"

        return (f"--fp8-precision-config rules {rules(saved)} (checkpoint) vs {rules(this)} (this run): each "
                f"linear's precision follows them")
    return f"{_flag(key)} {saved.get(key)!r} (checkpoint) vs {this.get(key)!r} (this run)"


def _raw_vocab(cfg: RunConfig) -> int | None:
    """The vocabulary before padding: ``--vocab-size`` (mock data) or the tokenizer's."""
    if cfg.data.mock_data or not cfg.data.tokenizer_model:
        return cfg.model.vocab_size
    from ..data.tokenizer import SentencePieceTokenizer

    return SentencePieceTokenizer(cfg.data.tokenizer_model).vocab_size


def _check_compatible(path: Path, meta: dict, cfg: RunConfig, vocab_size: int) -> None:
    saved = meta["args"]
    this = _run_args(cfg)
    # A flag absent from an older checkpoint's arguments is not compared (it did not exist when it was saved).
    diffs = [_difference(k, saved, this) for k in RESUME_MATCH if k in saved and saved[k] != this.get(k)]
    raw = _raw_vocab(cfg)
    if meta.get("raw_vocab_size") != raw:
        diffs.append(f"vocabulary {meta.get('raw_vocab_size')} (checkpoint) vs {raw} (this run: --vocab-size or the "
                     f"tokenizer's)")
    elif meta["layout"]["tp"] == cfg.parallel.tensor_model_parallel_size and meta["vocab_size"] != vocab_size:
        diffs.append(f"padded vocabulary {meta['vocab_size']} (checkpoint) vs {vocab_size} (this run)")
    if diffs:
        raise CheckpointMismatchError(
            f"checkpoint {path} does not fit this run: " + "; ".join(diffs)
            + ". Load it with the model flags, --fp8-opt-level and optimizer it was saved with (the parallel "
              "layout may differ)")
    if not cfg.checkpoint.override_opt_param_scheduler:
        sched = [f"{_flag(k)} {saved.get(k)!r} (checkpoint) vs {this.get(k)!r} (this run)"
                 for k in RESUME_SCHEDULE if k in saved and saved[k] != this.get(k)]
        if sched:
            raise CheckpointMismatchError(
                f"checkpoint {path} was trained with another learning-rate schedule, batch or optimizer "
                f"hyper-parameters: " + "; ".join(sched)
                + ". Pass the checkpoint's values, or --override-opt-param-scheduler to continue with this run's")


def _merge(shards: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The full tensor from tensor-parallel shards 0..T-1 (shard ``r`` holds blocks ``r, r+T, ...`` of
    ``T * stride`` blocks along ``dim``: megatron-core's strided partitioning)."""
    world = len(shards)
    blocks: list = [None] * (world * stride)
    for r, shard in enumerate(shards):
        for j, block in enumerate(torch.chunk(shard, stride, dim=dim)):
            blocks[j * world + r] = block
    return torch.cat(blocks, dim=dim)


def _split(full: torch.Tensor, dim: int, rank: int, world: int, stride: int) -> torch.Tensor:
    blocks = torch.chunk(full, world * stride, dim=dim)
    return torch.cat(blocks[rank::world], dim=dim).contiguous()


def _fmt_of(dtype: torch.dtype):
    for fmt in STORAGE_FORMATS.values():
        if fmt.dtype == dtype:
            return fmt
    raise ValueError(f"no storage format stores {dtype}")


def _empty(md) -> torch.Tensor:
    return torch.empty(tuple(md.size), dtype=md.properties.dtype)


def _earlier_good_checkpoint(directory: Path, iteration: int, run, error: Exception, announce: bool) -> tuple[Path, int]:
    """``--load-fallback``: the newest checkpoint of ``directory`` before ``iteration`` whose files verify."""
    earlier = sorted((int(m.group(1)) for p in directory.iterdir()
                      if (m := re.fullmatch(r"iter_(\d{7})", p.name)) and int(m.group(1)) < iteration), reverse=True)
    for candidate in earlier:
        path = checkpoint_dir(directory, candidate)
        try:
            verify_checksums(path, counter=run.counter)
        except CheckpointCorruptedError:
            continue
        if announce:
            print(f"warning: --load {directory}: iteration {iteration} is corrupted ({error}); --load-fallback loads "
                  f"iteration {candidate}", file=sys.stderr, flush=True)
        return path, candidate
    raise CheckpointCorruptedError(f"{error}; --load-fallback found no earlier iteration of {directory} that verifies")


_ITER_DIR = re.compile(r"iter_(\d{7})(?:\.old)?")


def check_step(path: str | os.PathLike, iteration: int | None, flag: str) -> int | None:
    """The iteration to read from ``path`` given ``flag`` (``--ckpt-step``, ``--iteration``) = ``iteration``:
    None (the latest, or the one checkpoint ``path`` is) or ``iteration``; :class:`CheckpointNotFoundError`
    with the fix when ``path`` is the checkpoint of another iteration."""
    single, named = _single_checkpoint(Path(path))
    if not single or iteration is None:
        return iteration
    if named is not None and iteration != named:
        raise CheckpointNotFoundError(
            f"{path} is the checkpoint of iteration {named}, {flag} asks for {iteration}: pass its --save directory "
            f"{Path(path).parent} with {flag} {iteration}, or leave {flag} out")
    return None


def _single_checkpoint(directory: Path) -> tuple[bool, int | None]:
    """Whether ``directory`` is one checkpoint (``DIR/iter_XXXXXXX``, its interrupted-save ``.old`` copy,
    or any directory holding DCP ``.metadata``) rather than a ``--save`` directory, and the iteration its
    name gives (None when the name gives none)."""
    m = _ITER_DIR.fullmatch(directory.name)
    if (directory / LATEST).exists():
        return False, None
    if (directory / ".metadata").exists():
        return True, int(m.group(1)) if m else None
    if m and not directory.exists() and directory.with_name(directory.name + ".old").exists():
        return True, int(m.group(1))
    return False, None


def _saved_iterations(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("iter_*") if p.is_dir()) if directory.is_dir() else []


def describe_no_checkpoint(directory: str | os.PathLike) -> str:
    """Why ``directory`` (a ``--load`` without ``latest_checkpointed_iteration.txt``) holds no checkpoint to
    load, as a predicate ("does not exist: ...", "is empty: ...", "holds ..."): what is there, and the fix."""
    directory = Path(directory)
    if not directory.exists():
        what = "does not exist"
    elif not directory.is_dir():
        what = "is a file, not a checkpoint directory"
    else:
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
        saved = _saved_iterations(directory)
        if saved:
            return (f"holds {', '.join(saved)} but no {LATEST} (a save interrupted before naming it): pass "
                    f"--load {directory / saved[-1]} (one checkpoint), or --ckpt-step N")
        what = ("is empty" if not names else
                f"holds no checkpoint (no {LATEST}, no iter_XXXXXXX directory; found: "
                f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''})")
    return (f"{what}: pass a pretrain_gpt.py --save directory or one of its iter_XXXXXXX directories (a run that starts "
            f"fresh and resumes later uses the same directory for --save and --load)")


def _remove_stale_tmp(directory: Path) -> None:
    """Remove ``latest_checkpointed_iteration.txt.tmp`` / ``progress.txt.tmp`` left in this run's own
    ``--save`` directory by a save killed while writing them (the files they would have replaced are
    intact: they are replaced by a rename). Rank 0, before it writes them again or loads."""
    for name in (LATEST, PROGRESS):
        try:
            (directory / (name + ".tmp")).unlink()
        except OSError:  # none there (the usual case), or not ours to remove
            pass


def load_checkpoint(directory: str | os.PathLike, run, iteration: int | None = None) -> int:
    """Restore the run from the latest checkpoint in ``directory`` (or ``iteration``'s), at this run's
    parallel layout (every rank calls it); returns its iteration. ``directory`` may also be one checkpoint
    (``DIR/iter_XXXXXXX``). Without a checkpoint there: 0 (start from scratch) when ``directory`` is also
    ``--save`` (a requeued job), else :class:`CheckpointNotFoundError` naming what is there.
    Restores ``run.state`` (:class:`~megatron.training.training.TrainState`: iteration, data position, skipped steps).

    Four steps: :func:`_resolve` (which checkpoint: verified, or the newest earlier good one with
    ``--load-fallback``), :func:`_plan` (what to read for every tensor this rank holds, and what is missing),
    :func:`_read` (refuse what is missing on any rank, then one ``dcp.load``), :func:`_apply` (reshard into the
    model, the optimizer states, the counters and the random streams)."""
    distributed = dist.is_initialized()
    resolved = _resolve(Path(directory), run, iteration)
    if resolved is None:
        return 0
    path = resolved
    meta = _read_meta(path, distributed)
    _check_compatible(path, meta, run.cfg, run.vocab_size)
    _restore_fallback(meta, run, path)
    plan = _plan(path, meta, run)
    _read(plan, run, distributed)
    _apply(plan, run, meta, path)
    if distributed:
        run.world.barrier("checkpoint")
    return int(meta["iteration"])


def _restore_fallback(meta: dict, run, path: Path) -> None:
    """The FP8 statistics monitor's state (the spike alarm's loss window, ``--fp8-auto-fallback``'s controller) and
    the linears the fallback had moved, put back at their settings before anything is read (their weights' scale
    layouts follow the settings); without the flag in this run the layers still take the saved settings (their FP8
    weights were trained so), said once."""
    state = meta.get("fp8_numerics") or {}
    numerics = getattr(run, "numerics", None)
    if numerics is not None:
        numerics.load_state(state)
    saved = state.get("fallback")
    if not saved or not saved.get("settings") or (numerics is not None and numerics.fallback is not None):
        return
    from fp8.fallback import apply_settings, fallback_linears

    from ..gpt_layer_specs import global_module_names

    linears = {}
    for chunk in run.bare_chunks:
        name = global_module_names(chunk)
        linears.update({name(n): m for n, m in fallback_linears(chunk).items()})
    apply_settings(linears, saved["settings"], saved.get("recipes", {}))
    if dist.get_rank() == 0:
        print(f"--load {path}: the checkpoint's run had moved {len(saved['settings'])} linear(s) with "
              f"--fp8-auto-fallback ({', '.join(f'{k}: {v}' for k, v in sorted(saved['settings'].items()))}); they "
              f"keep those settings (add --fp8-auto-fallback to let them move on)", flush=True)


def _resolve(directory: Path, run, iteration: int | None) -> Path | None:
    """The checkpoint to load, verified (``--load-fallback``: the newest earlier one that verifies), or None: no
    checkpoint yet in the run's own ``--save`` directory (a requeued job starts from scratch)."""
    rank0 = dist.get_rank() == 0
    save = run.cfg.checkpoint.save
    own_save = save is not None and Path(save).resolve() == directory.resolve()
    if rank0 and own_save:
        _remove_stale_tmp(directory)
    single, named = _single_checkpoint(directory)
    if single:  # --load DIR/iter_XXXXXXX: that checkpoint
        check_step(directory, iteration, "--ckpt-step")
        path = resolve_checkpoint(directory)
        directory = directory.parent  # --load-fallback looks for earlier iterations beside it
        iteration = named
    else:
        if iteration is None:
            iteration = latest_iteration(directory)
            if iteration is None:
                if own_save:
                    if rank0:  # the documented requeue case: --save and --load the same directory
                        print(f"--load {directory}: no checkpoint there yet (it is also --save), starting from "
                              f"scratch", flush=True)
                    return None
                raise CheckpointNotFoundError(f"--load {directory} {describe_no_checkpoint(directory)}")
            named_by = f"{directory / LATEST} names iteration {iteration}"
        else:
            named_by = f"--ckpt-step {iteration} asks for it"
        path = checkpoint_dir(directory, iteration)
        if not path.exists() and not path.with_name(path.name + ".old").exists():
            raise CheckpointNotFoundError(f"{path} does not exist although {named_by} (saved: "
                                          f"{', '.join(_saved_iterations(directory)) or 'none'})")
        path = resolve_checkpoint(path)
    try:
        verify_checksums(path, counter=run.counter)
    except CheckpointCorruptedError as error:
        if iteration is None:  # a checkpoint directory outside a --save directory: nothing earlier to fall back to
            raise
        if not run.cfg.checkpoint.load_fallback:
            raise CheckpointCorruptedError(f"{error}; or pass --load-fallback to load the newest earlier iteration "
                                           f"that verifies") from error
        path, iteration = _earlier_good_checkpoint(directory, iteration, run, error, rank0)
    return path


@dataclasses.dataclass
class _LoadPlan:
    """What one rank reads from a checkpoint (:func:`_plan`): the ``request`` for ``dcp.load`` (live tensors loaded in
    place, or buffers to reshard), per parameter entry its buffers, the keys it lacks, the layouts."""

    path: Path
    reader: Any
    metadata: dict
    ranks: dict
    same_layout: bool
    reshard_tp: bool
    request: dict = dataclasses.field(default_factory=dict)
    missing: list = dataclasses.field(default_factory=list)
    entries: list = dataclasses.field(default_factory=list)  # (entry, model buffers or None, {state key: buffers})
    rng_key: str | None = None

    def need(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """A buffer for stored tensor ``key`` (loaded as stored: FP8 as uint8 bytes, used as ``dtype``), or None and
        ``key`` recorded as missing."""
        if key not in self.metadata:
            self.missing.append(key)
            return None
        self.request[key] = _empty(self.metadata[key])
        buf = self.request[key]
        return buf.view(dtype) if dtype is not None and dtype != buf.dtype else buf

    def take(self, candidates: list[str], buf) -> bool:
        """Load the first stored key of ``candidates`` into ``buf`` in place; whether one was stored."""
        key = next((k for k in candidates if k in self.metadata), None)
        if key is not None:
            self.request[key] = buf
        return key is not None


def _plan(path: Path, meta: dict, run) -> _LoadPlan:
    """What this rank reads, for every parameter, optimizer state, buffer, scaling state, data-parallel scaling
    factor and random stream it holds, at the checkpoint's layout or resharded to this run's."""
    ranks = _ranks()
    saved = meta["layout"]
    same_layout = (saved["tp"], saved["pp"], saved["dp"], saved.get("vp"), saved.get("ep", 1)) == (
        ranks["tp_size"], ranks["pp_size"], ranks["dp_size"], run.cfg.parallel.virtual_pipeline_model_parallel_size,
        ranks["ep_size"])
    reader = dcp.FileSystemReader(str(path))
    saved_tp = int(saved["tp"])
    plan = _LoadPlan(path, reader, reader.read_metadata().state_dict_metadata, ranks, same_layout,
                     saved_tp != ranks["tp_size"])
    md, request, missing, optimizer = plan.metadata, plan.request, plan.missing, run.optimizer
    for e in _entries(run):
        p = e.param
        fp8_dtype = p.payload.dtype if isinstance(p, Float8Tensor) else None
        # Resharded tensor-parallel parameters are read shard by shard and re-split, even when the
        # checkpoint's only shard ``tp0`` has this rank's own key (TP1 -> TP2: rank 0 holds half of it).
        in_place = not (e.sharded and plan.reshard_tp)
        keys = [e.key] if in_place else [f"{e.name}/tp{i}" for i in range(saved_tp)]
        model_bufs = None
        if in_place:
            if fp8_dtype is not None:
                for suffix, live in (("payload", byte_view(p.payload)), ("scale", p.scale)):
                    if f"model/{e.key}/{suffix}" in md:
                        request[f"model/{e.key}/{suffix}"] = live
                    else:
                        missing.append(f"model/{e.key}/{suffix}")
            elif f"model/{e.key}" in md:
                request[f"model/{e.key}"] = p.data
            else:
                missing.append(f"model/{e.key}")
        elif fp8_dtype is not None:
            model_bufs = [(plan.need(f"model/{k}/payload", fp8_dtype), plan.need(f"model/{k}/scale")) for k in keys]
        else:
            model_bufs = [(plan.need(f"model/{k}"), None) for k in keys]
        optim_bufs: dict[str, list] = {}
        if e.opt_param.requires_grad and optimizer.owns(e.opt_param):
            live = optimizer.state.get(e.opt_param, {})
            prefix = f"optim/{keys[0]}/"
            for full in (k for k in md if k.startswith(prefix)):
                skey = full[len(prefix):]
                dtype = live[skey].dtype if isinstance(live.get(skey), torch.Tensor) else None
                optim_bufs[skey] = [plan.need(f"optim/{k}/{skey}", dtype) for k in keys]
            if not optim_bufs and meta["iteration"] > 0 and live:
                missing.append(f"{prefix}*")
        plan.entries.append((e, model_bufs, optim_bufs))
    saved_dp = int(saved["dp"])
    for fqn, buf, scaling in _buffers(run):
        # a scaling state from the same data-parallel rank's, else from the rank that held it (an expert's under
        # another expert-parallel split)
        keys = ([f"scaling/dp{i}/{fqn}" for i in [ranks["dp"] % saved_dp, *range(saved_dp)]] if scaling
                else [f"buffers/{fqn}"])
        if not plan.take(keys, buf):
            missing.append(keys[0])
    for v, chunk in enumerate(run.chunks):
        mu = getattr(chunk, "grad_scaling", None)
        for name, buf in (mu.named_buffers() if mu is not None else ()):
            plan.take([f"mu/stage{ranks['pp']}.{v}/tp{ranks['tp']}/{name}"] + sorted(
                k for k in md if k.startswith("mu/") and k.endswith(f"/{name}")), buf)
    for v, ddp in enumerate(run.expert_ddps):
        for name, buf in ddp.grad_scaling.named_buffers():
            plan.take([f"mu_experts/stage{ranks['pp']}.{v}/tp{ranks['tp']}/ep{ranks['ep']}/{name}"] + sorted(
                k for k in md if k.startswith("mu_experts/") and k.endswith(f"/{name}")), buf)
    rng_key = f"rng/rank{dist.get_rank()}"
    if same_layout and rng_key in md:
        plan.rng_key = rng_key
        request[rng_key] = io.BytesIO()
    return plan


def _read(plan: _LoadPlan, run, distributed: bool) -> None:
    """Refuse a checkpoint that lacks what any rank needs (every rank raises the same error), then read it."""
    problems = sorted(set(_gather(plan.missing[:5], run.world if distributed else None)))
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {plan.path} lacks entries this run needs (e.g. {', '.join(problems[:6])}): it was saved from "
            f"another model or opt level")
    dcp.load(plan.request, storage_reader=plan.reader, no_dist=not distributed)


def _apply(plan: _LoadPlan, run, meta: dict, path: Path) -> None:
    """What was read, put in place: resharded parameters, the optimizer's states and masters, the run's counters, and
    the random streams at the same layout (restarted from ``--seed`` at another, said once)."""
    optimizer, ranks = run.optimizer, plan.ranks
    state_by_param: dict[int, dict[str, torch.Tensor]] = {}
    masters: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for e, model_bufs, optim_bufs in plan.entries:
            if model_bufs is not None:
                _reshard_model(e, model_bufs, ranks)
            state = _optimizer_state(e, optim_bufs, optimizer, ranks, plan.reshard_tp)
            if e.opt_param is not e.param and "master" in state:
                masters[id(e.opt_param)] = state.pop("master")
            if state:
                state_by_param[id(e.opt_param)] = state
        _load_optimizer(optimizer.inner, state_by_param, masters, meta)
    run.state.iteration = int(meta["iteration"])
    run.state.consumed_samples = int(meta["consumed_samples"])
    run.state.skipped.fill_(int(meta["skipped_steps"]))
    if plan.rng_key is not None:
        _set_rng(plan.request[plan.rng_key].getvalue())
    elif dist.get_rank() == 0:
        saved = meta["layout"]
        print(f"--load {path}: saved at TP{saved['tp']} PP{saved['pp']} DP{saved['dp']} EP{saved.get('ep', 1)}, "
              f"resharded to TP{ranks['tp_size']} PP{ranks['pp_size']} DP{ranks['dp_size']} EP{ranks['ep_size']}; "
              f"random streams restart from --seed", flush=True)


def _gather(obj, world) -> list:
    """Every rank's list ``obj``, concatenated (``world``: the job's collectives, None in one process)."""
    if world is None:
        return list(obj)
    return [x for part in world.all_gather_object(obj, "checkpoint") for x in part]


def _reshard_model(e: _Entry, bufs: list, ranks: dict) -> None:
    p = e.param
    if isinstance(p, Float8Tensor):
        values = [fp8_value(payload, scale) for payload, scale in bufs]
    else:
        values = [b for b, _ in bufs]
    full = _fit_vocab(e, _merge(values, e.dim, e.stride), ranks)
    mine = _split(full, e.dim, ranks["tp"], ranks["tp_size"], e.stride)
    if mine.shape != p.shape:
        raise CheckpointMismatchError(f"{e.name}: the checkpoint's tensor {tuple(full.shape)} does not split into this "
                                      f"rank's {tuple(p.shape)}")
    if isinstance(p, Float8Tensor):
        q = to_float8(mine.to(p.device), p.format, block=p.block)
        p.payload.copy_(q.payload)
        p.scale.copy_(q.scale)
    else:
        p.data.copy_(mine)


def fp8_value(payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 value of a saved FP8 weight: its payload over its tensor-wise scale, or over the scale of its block
    (a grid of scales: the rowwise and blockwise recipes; the block follows from the grid's shape)."""
    if scale.dim() < 2:
        return payload.to(torch.float32) / scale
    (rows, cols), (grid_rows, grid_cols) = payload.shape, scale.shape
    return dequantize_blocks(payload, scale, (-(-rows // grid_rows), -(-cols // grid_cols)))


def fp8_scales(payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 scale of every element of a saved FP8 weight (:func:`fp8_value`'s layouts)."""
    if scale.dim() < 2:
        return scale.to(torch.float32).reshape(()).expand(payload.shape).contiguous()
    (rows, cols), (grid_rows, grid_cols) = payload.shape, scale.shape
    return expand_scales(scale, (-(-rows // grid_rows), -(-cols // grid_cols)), (rows, cols)).contiguous()


def _fit_vocab(e: _Entry, full: torch.Tensor, ranks: dict) -> torch.Tensor:
    """``full`` with as many vocabulary rows as this layout pads to (zero rows added, padding rows cut)."""
    if e.name not in _VOCAB_PARAMS or full.dim() == 0 or e.dim != 0:
        return full
    rows = e.param.shape[0] * ranks["tp_size"]
    if full.shape[0] > rows:
        return full[:rows]
    if full.shape[0] < rows:
        return torch.cat([full, full.new_zeros((rows - full.shape[0], *full.shape[1:]))])
    return full


def _optimizer_state(e: _Entry, bufs: dict[str, list], optimizer, ranks: dict, reshard: bool) -> dict:
    """This parameter's optimizer state from the loaded buffers (one per saved shard when resharding)."""
    if not bufs:
        return {}
    if not (e.sharded and reshard):
        return {k: v[0] for k, v in bufs.items()}
    live = optimizer.state.get(e.opt_param, {})
    out = {}
    for key, shards in bufs.items():
        if key.endswith("_scale") and key[: -len("_scale")] in bufs:
            continue
        if f"{key}_scale" in bufs:  # compressed: payload / scale (a power of two), re-encoded at the new scale
            values = [decode(payload, scale) for payload, scale in zip(shards, bufs[f"{key}_scale"])]
            full = _fit_vocab(e, _merge(values, e.dim, e.stride), ranks)
            mine = _split(full, e.dim, ranks["tp"], ranks["tp_size"], e.stride)
            dtype = live[key].dtype if isinstance(live.get(key), torch.Tensor) else shards[0].dtype
            out[key], out[f"{key}_scale"] = encode(mine, _fmt_of(dtype))
        elif shards[0].dim() == e.param.dim() and shards[0].dim() > 0:
            full = _fit_vocab(e, _merge(list(shards), e.dim, e.stride), ranks)
            out[key] = _split(full, e.dim, ranks["tp"], ranks["tp_size"], e.stride)
        elif key.endswith("_amax"):
            out[key] = torch.stack([s.reshape(()) for s in shards]).max()
        else:  # step and other per-parameter scalars: the same on every shard
            out[key] = shards[0]
    return out


def _groups_with_indices(param_groups) -> tuple[list[dict], dict[int, int]]:
    index: dict[int, int] = {}
    groups = []
    for group in param_groups:
        ids = []
        for p in group["params"]:
            ids.append(index.setdefault(id(p), len(index)))
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    return groups, index


def _load_optimizer(optimizer, states: dict[int, dict], masters: dict[int, torch.Tensor], meta: dict) -> None:
    """Hand the loaded states to the optimizer's own ``load_state_dict`` (it restores dtypes and devices,
    re-quantizes FP8 weights from their masters and, at O3, re-gathers the weights)."""
    skipped = meta.get("optimizer_skipped_steps") or 0
    if isinstance(optimizer, MasterWeightOptimizer):
        groups, index = _groups_with_indices(optimizer.optimizer.param_groups)
        base = {"state": {index[pid]: st for pid, st in states.items()}, "param_groups": groups}
        saved_masters = [masters.get(id(m), m.detach()) for m, _ in optimizer.pairs]
        optimizer.load_state_dict({"optimizer": base, "master_weights": saved_masters, "skipped_steps": skipped})
        return
    groups, index = _groups_with_indices(optimizer.param_groups)
    sd = {"state": {index[pid]: st for pid, st in states.items()}, "param_groups": groups}
    if isinstance(optimizer, FP8Optimizer):
        sd["skipped_steps"] = skipped
    optimizer.load_state_dict(sd)


# -- reading for tools ----------------------------------------------------------------------------
def is_megatron_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a ``pretrain_gpt.py --save`` directory or one of its ``iter_XXXXXXX`` checkpoints."""
    path = Path(path)
    if (path / LATEST).exists():
        return True
    if not (path / ".metadata").exists():
        return False
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            return _read_meta(path, distributed=False).get("format") == FORMAT
    except CheckpointMismatchError:
        return False


def _load_saved(path: str | os.PathLike, iteration: int | None, source: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(meta, tensors)`` of a ``pretrain_gpt.py`` checkpoint read in this process (:func:`read_checkpoint`): every
    ``model/`` entry, and the masters with ``source="master"``."""
    path = Path(path)
    if (path / LATEST).exists() or iteration is not None:
        iteration = latest_iteration(path) if iteration is None else iteration
        path = checkpoint_dir(path, iteration)
    elif not (path / ".metadata").exists() and not path.with_name(path.name + ".old").exists():
        raise FileNotFoundError(f"{path} is neither a --save directory (no {LATEST}) nor a checkpoint directory")
    path = resolve_checkpoint(path)
    verify_checksums(path)
    with warnings.catch_warnings():  # DCP notes that it reads in one process: that is the intent
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        meta = _read_meta(path, distributed=False)
        reader = dcp.FileSystemReader(str(path))
        md = reader.read_metadata().state_dict_metadata
        wanted = ("model/",) + (("optim/",) if source == "master" else ())
        request = {k: _empty(v) for k, v in md.items() if k.startswith(wanted) and not isinstance(v, BytesStorageMetadata)
                   and (k.startswith("model/") or k.endswith(("/master", "/master_scale")))}
        dcp.load(request, storage_reader=reader, no_dist=True)
    return meta, request


def read_checkpoint(path: str | os.PathLike, iteration: int | None = None,
                    source: str = "fp8") -> tuple[dict, dict[str, torch.Tensor]]:
    """``(args, state)`` of a ``pretrain_gpt.py --save`` checkpoint, read in this process (no
    ``torch.distributed`` needed): ``path`` is the ``--save`` directory (its latest checkpoint, or
    ``iteration``'s) or one ``iter_XXXXXXX`` directory. ``args``: the saved run's arguments; ``state``:
    the whole model in megatron-core ``GPTModel`` names (global layer numbers, tensor-parallel shards
    merged; tied output weights appear once, as ``embedding.word_embeddings.weight``), every tensor fp32.
    FP8 weights: dequantized (``source="fp8"``, the weights the model computed with) or their optimizer
    master copies decoded (``source="master"``, O1-O3: the more precise value)."""
    if source not in ("fp8", "master"):
        raise ValueError(f"source must be 'fp8' or 'master', got {source!r}")
    meta, request = _load_saved(path, iteration, source)
    tp = int(meta["layout"]["tp"])
    state: dict[str, torch.Tensor] = {}
    for name, info in meta["params"].items():
        keys = [f"{name}/tp{i}" for i in range(tp)] if info["sharded"] else [name]
        if info["fp8"] and source == "master" and all(f"optim/{k}/master" in request for k in keys):
            values = [request[f"optim/{k}/master"].to(torch.float32) for k in keys]
            if all(f"optim/{k}/master_scale" in request for k in keys):  # O2/O3: payload / power-of-two scale
                values = [v / request[f"optim/{k}/master_scale"] for v, k in zip(values, keys)]
        elif info["fp8"]:
            fp8 = getattr(torch, info["fp8"])
            values = [fp8_value(request[f"model/{k}/payload"].view(fp8), request[f"model/{k}/scale"]) for k in keys]
        else:
            values = [request[f"model/{k}"].to(torch.float32) for k in keys]
        state[name] = _merge(values, info["dim"], info["stride"]) if info["sharded"] else values[0]
    return meta["args"], state


def read_checkpoint_fp8(path: str | os.PathLike, iteration: int | None = None
                        ) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(args, state, scales)`` of a ``pretrain_gpt.py`` checkpoint as :func:`read_checkpoint` reads it, except that
    each FP8 weight is its E4M3/E5M2 payload as trained (tensor-parallel shards merged), not a value: ``state[name]``
    holds the payload and ``scales[name]`` the fp32 scale of every element (``value = payload / scale``: each shard's
    tensor-wise scale, or the scale of its block, spread over the elements it covers: 4 bytes per element, for the
    conversion only). Other tensors as :func:`read_checkpoint`'s (fp32)."""
    meta, request = _load_saved(path, iteration, "fp8")
    tp = int(meta["layout"]["tp"])
    state: dict[str, torch.Tensor] = {}
    scales: dict[str, torch.Tensor] = {}
    for name, info in meta["params"].items():
        keys = [f"{name}/tp{i}" for i in range(tp)] if info["sharded"] else [name]
        if info["fp8"]:
            fp8 = getattr(torch, info["fp8"])
            payloads = [request[f"model/{k}/payload"].view(fp8) for k in keys]
            spread = [fp8_scales(p, request[f"model/{k}/scale"]) for p, k in zip(payloads, keys)]
            merged = [_merge(t, info["dim"], info["stride"]) if info["sharded"] else t[0] for t in
                      ([p.view(torch.uint8) for p in payloads], spread)]
            state[name], scales[name] = merged[0].view(fp8), merged[1]
        else:
            values = [request[f"model/{k}"].to(torch.float32) for k in keys]
            state[name] = _merge(values, info["dim"], info["stride"]) if info["sharded"] else values[0]
    return meta["args"], state, scales
