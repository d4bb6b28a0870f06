"""Export an fp8lm checkpoint as a plain ``state_dict`` in safetensors, for inference or other frameworks:
a ``pretrain_gpt.py --save`` directory (its latest checkpoint, or ``--iteration N``; any TP/PP/DP layout:
megatron-core ``GPTModel`` names, shards merged, read with
``megatron.training.checkpointing.read_checkpoint``), or an engine checkpoint
(``fp8.checkpoint.save_checkpoint``, any world size).

    python tools/convert_checkpoint.py CHECKPOINT_DIR OUT.safetensors [--dtype bf16|fp32] [--source master|fp8]
        [--iteration N]

Keys are the model's own parameter and buffer names (``fp8.initialize`` keeps them), so the file loads
into the unconverted model with ``load_state_dict(safetensors.torch.load_file(...))``. Values:

- FP8 weights: ``--source master`` (default) decodes the optimizer's master copy (FP16 + scale, the
  most precise value); ``--source fp8`` dequantizes the FP8 weight the model computed with.
- Other parameters and buffers: as stored. FP8 scaling states, optimizer moments and mu are dropped.

Runs in one process, without torch.distributed initialized.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8.checkpoint import _resolve  # noqa: E402
from fp8.optim.precision import decode  # noqa: E402

__all__ = ["load_flat", "export_state_dict", "main"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def load_flat(path: str | Path) -> dict[str, object]:
    """Every entry of the checkpoint at ``path`` (flat DCP keys), read in this process."""
    flat: dict[str, object] = {}
    # As torch.distributed.checkpoint.format_utils.dcp_to_torch_save reads a whole checkpoint.
    _load_state_dict(flat, storage_reader=dcp.FileSystemReader(str(_resolve(Path(path)))),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return flat


def _meta(flat: dict) -> dict:
    value = flat["meta"]
    raw = value.getvalue() if isinstance(value, io.BytesIO) else value
    return json.loads(raw.decode() if isinstance(raw, bytes) else raw)


def export_state_dict(path: str | Path, dtype: torch.dtype = torch.float32, source: str = "master") -> dict[str, torch.Tensor]:
    """The plain ``state_dict`` (name -> ``dtype`` tensor; integer buffers keep their dtype) of the
    model saved at ``path``; ``source`` picks master or FP8 values for FP8 weights (module docstring)."""
    if source not in ("master", "fp8"):
        raise ValueError(f"source must be 'master' or 'fp8', got {source!r}")
    flat = load_flat(path)
    dtypes = _meta(flat).get("fp8_dtypes", {})
    out: dict[str, torch.Tensor] = {}
    for key, value in flat.items():
        if key.startswith("model/") and key.endswith("/payload"):
            name = key[len("model/") : -len("/payload")]
            master = flat.get(f"optim/{name}/master")
            if source == "master" and master is not None:
                value = decode(master, flat[f"optim/{name}/master_scale"])
            else:
                payload = value.view(getattr(torch, dtypes.get(name, "float8_e4m3fn")))
                value = decode(payload, flat[f"model/{name}/scale"])
            out[name] = value.to(dtype)
        elif key.startswith("model/") and not key.endswith("/scale"):
            out[key[len("model/") :]] = value.to(dtype)
        elif key.startswith("buffers/"):
            out[key[len("buffers/") :]] = value.to(dtype) if value.is_floating_point() else value
    return {k: v.contiguous() for k, v in sorted(out.items())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("output", help="the .safetensors file to write")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--source", choices=("master", "fp8"), default="master")
    parser.add_argument("--iteration", type=int, default=None,
                        help="pretrain_gpt.py --save directories: this iteration instead of the latest")
    args = parser.parse_args(argv)
    from safetensors.torch import save_file

    from megatron.training.checkpointing import is_megatron_checkpoint, read_checkpoint

    if is_megatron_checkpoint(args.checkpoint):
        _, state = read_checkpoint(args.checkpoint, args.iteration, source=args.source)
        state = {k: v.to(DTYPES[args.dtype]).contiguous() for k, v in sorted(state.items())}
    elif args.iteration is not None:
        sys.exit(f"--iteration: {args.checkpoint} is an engine checkpoint (one iteration), not a --save directory")
    else:
        state = export_state_dict(args.checkpoint, DTYPES[args.dtype], args.source)
    save_file(state, args.output, metadata={"format": "pt", "source": f"fp8lm {args.source}"})
    n = sum(t.numel() for t in state.values())
    print(f"wrote {args.output}: {len(state)} tensors, {n:,} elements, {args.dtype}")


if __name__ == "__main__":
    main()
