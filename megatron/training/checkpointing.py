"""``--save`` / ``--load``: one file per rank (model chunks, optimizer, scaling states, iteration).

Layout: ``DIR/iter_0000100/rank_TT_PPP_DDD.pt`` (tensor, pipeline, data-parallel rank) plus
``DIR/latest_checkpointed_iteration.txt``. FP8 weights are saved as FP8 payloads with their scales;
optimizer states in their stored formats. Loading needs the same parallel layout and opt level (it is
checked, with a message naming the mismatch). Writes go to a temporary file renamed into place, so a
crash never leaves a partial checkpoint behind as "latest".
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fp8.serialization import safe_globals
from megatron.core import parallel_state

__all__ = ["save_checkpoint", "load_checkpoint"]

_LATEST = "latest_checkpointed_iteration.txt"


def _rank_file(directory: str, iteration: int) -> str:
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    dp = parallel_state.get_data_parallel_rank()
    return os.path.join(directory, f"iter_{iteration:07d}", f"rank_{tp:02d}_{pp:03d}_{dp:03d}.pt")


def _layout(args) -> dict:
    return {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
            "dp": args.data_parallel_size, "level": args.fp8_opt_level, "num_layers": args.num_layers,
            "hidden_size": args.hidden_size}


def save_checkpoint(directory: str, run, iteration: int) -> str:
    """Save this rank's part of the run at ``iteration``; rank 0 updates the ``latest`` marker."""
    path = _rank_file(directory, iteration)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {
        "iteration": iteration,
        "layout": _layout(run.args),
        "model": [chunk.state_dict() for chunk in run.chunks],
        "optimizer": run.optimizer.state_dict(),
        "skipped_steps": run.skipped_steps,
        "rng": torch.get_rng_state(),
    }
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)
    dist.barrier()
    if dist.get_rank() == 0:
        marker = os.path.join(directory, _LATEST)
        with open(marker + ".tmp", "w") as f:
            f.write(str(iteration))
        os.replace(marker + ".tmp", marker)
    dist.barrier()
    return path


def load_checkpoint(directory: str, run) -> int:
    """Load this rank's part of the latest checkpoint in ``directory``; returns its iteration (0 if none)."""
    marker = os.path.join(directory, _LATEST)
    if not os.path.exists(marker):
        if dist.get_rank() == 0:
            print(f"--load {directory}: no checkpoint there yet, starting from scratch", flush=True)
        return 0
    with open(marker) as f:
        iteration = int(f.read().strip())
    path = _rank_file(directory, iteration)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing: checkpoints load with the parallel layout they were saved with")
    with torch.serialization.safe_globals(safe_globals()):
        state = torch.load(path, map_location="cpu", weights_only=True)
    if state["layout"] != _layout(run.args):
        raise ValueError(
            f"checkpoint {path} was saved with {state['layout']}, this run is {_layout(run.args)}: use the same "
            f"parallel layout, model and --fp8-opt-level to resume"
        )
    for chunk, chunk_state in zip(run.chunks, state["model"]):
        chunk.load_state_dict(chunk_state)
    run.optimizer.load_state_dict(state["optimizer"])
    run.skipped_steps = state["skipped_steps"]
    torch.set_rng_state(state["rng"])
    return iteration
