"""Export an fp8lm checkpoint as a plain ``state_dict`` in safetensors, for inference or other frameworks:
a ``pretrain_gpt.py --save`` directory (its latest checkpoint, or ``--iteration N``; any TP/PP/DP layout:
megatron-core ``GPTModel`` names, shards merged, read with
``megatron.training.checkpointing.checkpoint.read_checkpoint``), or an engine checkpoint
(``fp8.checkpoint.save_checkpoint``, any world size).

    python tools/convert_checkpoint.py CHECKPOINT_DIR OUT.safetensors [--dtype bf16|fp32] [--source master|fp8]
        [--iteration N]
    python tools/convert_checkpoint.py --format hf SAVE_DIR OUTDIR [--dtype bfloat16|float32] [...]
    python tools/convert_checkpoint.py --quantization fp8 SAVE_DIR OUTDIR [--fp8-format compressed-tensors|fp8-block]

``--format hf`` (``pretrain_gpt.py`` checkpoints): a transformers directory (``config.json``,
``model.safetensors``, the tokenizer when the run had one): ``LlamaForCausalLM`` or ``GPT2LMHeadModel``,
mapped by ``megatron.training.checkpointing.hf_export`` (its docstring lists the mapping).

``--quantization fp8`` (``pretrain_gpt.py`` checkpoints of Llama-style runs; implies ``--format hf``): the same
directory with the FP8 weights as trained, not dequantized, in a serving format vLLM, SGLang and transformers load
(``--fp8-format``: ``compressed-tensors``, the default, or ``fp8-block``, DeepSeek-V3's 128x128 blocks; docs/serving.md):
E4M3 payloads bit for bit, their scales as dequantization multipliers, embeddings, norms and high-precision layers in
``--dtype``. What a format cannot hold exactly (for example row-parallel shards with different tensor-wise scales in one
per-channel scale) is re-quantized from the exact values and reported with its error.

Keys are the model's own parameter and buffer names (``fp8.initialize`` keeps them), so the file loads
into the unconverted model with ``load_state_dict(safetensors.torch.load_file(...))``. Values:

- FP8 weights: ``--source master`` (default) decodes the optimizer's master copy (FP16 + scale, the
  most precise value); ``--source fp8`` dequantizes the FP8 weight the model computed with.
- Other parameters and buffers: as stored. FP8 scaling states, optimizer moments and mu are dropped.

Runs in one process, without torch.distributed initialized. The output's missing parent directories are
created; the file appears atomically (a temporary file renamed). Errors (a missing or unreadable checkpoint,
an output path through a file or onto a directory) are one line naming the path and the fix, exit status 2.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp8.checkpoint import resolve_checkpoint  # noqa: E402
from fp8.export import atomic_write  # noqa: E402
from fp8.optim.precision import decode  # noqa: E402

__all__ = ["load_flat", "export_state_dict", "main"]

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "bfloat16": torch.bfloat16, "float32": torch.float32}


def load_flat(path: str | Path) -> dict[str, object]:
    """Every entry of the checkpoint at ``path`` (flat DCP keys), read in this process."""
    # torch's public reader of a whole DCP checkpoint writes one torch.save file: read it back, then drop it.
    with tempfile.TemporaryDirectory(prefix="fp8lm-convert-") as tmp:
        single = Path(tmp) / "checkpoint.pt"
        dcp_to_torch_save(resolve_checkpoint(Path(path)), single)
        return torch.load(single, map_location="cpu", weights_only=False)


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


def _check_output(output: str) -> Path:
    """``output`` as a ``Path`` once it can be written: not a directory, no file among its parents (missing
    parents are created later); ``ValueError`` naming the fix otherwise."""
    path = Path(output)
    if output.endswith(("/", os.sep)) or path.is_dir():
        raise ValueError(f"output {output!r} is a directory: name the file to write, e.g. "
                         f"{str(path / 'model.safetensors')!r}")
    for ancestor in path.parents:
        if ancestor.is_dir():
            break
        if ancestor.exists() or ancestor.is_symlink():
            raise ValueError(f"output {output!r}: {str(ancestor)!r} is a file, not a directory: choose an output "
                             "path in a directory (missing directories are created)")
    return path


def _check_checkpoint(checkpoint: str) -> None:
    """``ValueError`` naming the fix unless ``checkpoint`` (or its interrupted-save ``.old`` copy) exists."""
    path = Path(checkpoint)
    if not path.exists() and not path.with_name(path.name + ".old").exists():
        raise ValueError(f"checkpoint {checkpoint!r} does not exist: pass a pretrain_gpt.py --save directory, "
                         "one of its iter_XXXXXXX directories, or an engine checkpoint directory")
    if not path.is_dir() and path.exists():
        raise ValueError(f"checkpoint {checkpoint!r} is a file: pass the checkpoint's directory (a pretrain_gpt.py "
                         "--save directory, one of its iter_XXXXXXX directories, or an engine checkpoint)")


def _save(state: dict[str, torch.Tensor], output: Path, metadata: dict[str, str]) -> None:
    """Write ``output`` atomically, creating its missing parent directories."""
    from safetensors.torch import save_file

    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(output, lambda tmp: save_file(state, str(tmp), metadata=metadata))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="convert_checkpoint.py", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("output", help="the .safetensors file to write (--format hf: the directory to write)")
    parser.add_argument("--format", choices=("safetensors", "hf"), default=None,
                        help="hf: a transformers model directory (pretrain_gpt.py checkpoints); default safetensors, "
                             "hf with --quantization fp8")
    parser.add_argument("--quantization", choices=("none", "fp8"), default="none",
                        help="fp8: the FP8 weights as trained, in a serving format (--fp8-format), not dequantized")
    parser.add_argument("--fp8-format", choices=("compressed-tensors", "fp8-block"), default="compressed-tensors",
                        help="the serving format of --quantization fp8 (docs/serving.md)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--source", choices=("master", "fp8"), default="master")
    parser.add_argument("--iteration", type=int, default=None,
                        help="pretrain_gpt.py --save directories: this iteration instead of the latest")
    args = parser.parse_args(argv)
    if args.quantization == "fp8":
        if args.format == "safetensors":
            parser.error("--quantization fp8 writes a transformers directory: drop --format safetensors (or pass "
                         "--format hf)")
        if args.source != "master":
            parser.error("--quantization fp8 writes the FP8 weights the model computed with (their payloads): drop "
                         "--source")
        args.format = "hf"
    elif args.fp8_format != "compressed-tensors":
        parser.error("--fp8-format applies to --quantization fp8: add --quantization fp8")
    args.format = args.format or "safetensors"
    if args.format == "hf":
        return _main_hf(parser, args)
    try:
        output = _check_output(args.output)
        _check_checkpoint(args.checkpoint)
        from megatron.training.checkpointing.checkpoint import (check_step, checkpoint_dir, is_megatron_checkpoint,
                                                                read_checkpoint)

        if is_megatron_checkpoint(args.checkpoint):
            args.iteration = check_step(args.checkpoint, args.iteration, "--iteration")  # as pretrain_gpt.py --load
            wanted = None if args.iteration is None else checkpoint_dir(args.checkpoint, args.iteration)
            if wanted is not None and not wanted.exists() and not wanted.with_name(wanted.name + ".old").exists():
                saved = sorted(p.name for p in Path(args.checkpoint).glob("iter_*") if p.is_dir())
                raise ValueError(f"--iteration {args.iteration}: {wanted} does not exist (saved: "
                                 f"{', '.join(saved) or 'none'}): pass a saved iteration, or leave --iteration "
                                 "out for the latest")
            _, state = read_checkpoint(args.checkpoint, args.iteration, source=args.source)
            state = {k: v.to(DTYPES[args.dtype]).contiguous() for k, v in sorted(state.items())}
        elif args.iteration is not None:
            raise ValueError(f"--iteration: {args.checkpoint} is an engine checkpoint (one iteration), not a "
                             "--save directory: leave --iteration out")
        else:
            resolved = resolve_checkpoint(Path(args.checkpoint))
            if not (resolved / ".metadata").is_file():
                raise ValueError(f"checkpoint {args.checkpoint!r} is not a checkpoint (no .metadata, no "
                                 "latest_checkpointed_iteration.txt): pass a pretrain_gpt.py --save directory, one "
                                 "of its iter_XXXXXXX directories, or an engine checkpoint directory")
            state = export_state_dict(args.checkpoint, DTYPES[args.dtype], args.source)
        _save(state, output, metadata={"format": "pt", "source": f"fp8lm {args.source}"})
    except (ValueError, OSError) as error:  # FileNotFoundError, PermissionError, a full disk...
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    n = sum(t.numel() for t in state.values())
    print(f"wrote {args.output}: {len(state)} tensors, {n:,} elements, {args.dtype}")


def _main_hf(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    try:
        _check_checkpoint(args.checkpoint)
        if Path(args.output).exists() and not Path(args.output).is_dir():
            raise ValueError(f"output {args.output!r} is a file: --format hf writes a directory (config.json, "
                             "model.safetensors, tokenizer): name a directory")
        from megatron.training.monitoring.output_paths import check_output_path

        check_output_path(args.output, "--format hf output", directory=True)  # writable, before reading anything
        from megatron.training.checkpointing.checkpoint import check_step, is_megatron_checkpoint
        from megatron.training.checkpointing.hf_export import export_hf

        if not is_megatron_checkpoint(args.checkpoint):
            raise ValueError(f"--format hf: {args.checkpoint!r} is not a pretrain_gpt.py checkpoint (no "
                             "latest_checkpointed_iteration.txt, no megatron meta): pass a --save directory or one "
                             "of its iter_XXXXXXX directories")
        args.iteration = check_step(args.checkpoint, args.iteration, "--iteration")  # as pretrain_gpt.py --load
        if args.quantization == "fp8":
            from megatron.training.checkpointing.hf_export import export_hf_fp8

            report, summary = export_hf_fp8(args.checkpoint, args.output, args.fp8_format, DTYPES[args.dtype],
                                            args.iteration)
        else:
            summary = export_hf(args.checkpoint, args.output, DTYPES[args.dtype], args.iteration, args.source)
    except (ValueError, OSError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    tokenizer = (f"tokenizer {summary['tokenizer']}" if summary["tokenizer"] else
                 "no tokenizer (the run had none: --mock-data/--vocab-size)")
    if args.quantization == "fp8":
        requantized = summary["requantized"]
        exactness = ("every FP8 payload as trained" if not requantized else
                     f"{len(requantized)} weight(s) re-quantized (largest error "
                     f"{max(e for e, _ in requantized.values()):.3g} of the weight's amax): "
                     + ", ".join(sorted(requantized)[:4]))
        print(f"wrote {args.output}: {summary['architecture']}, {args.fp8_format} ({summary['strategy']} scales), "
              f"{len(report.fp8_weights)} FP8 linears, {report.bytes_on_disk:,} bytes on disk for "
              f"{summary['elements']:,} parameters ({report.bytes_per_parameter:.3f} B/param), others {args.dtype}; "
              f"{exactness}; vocabulary {summary['vocab']}; {tokenizer}")
        return
    print(f"wrote {args.output}: {summary['architecture']}, {summary['tensors']} tensors, "
          f"{summary['elements']:,} elements, {args.dtype}, vocabulary {summary['vocab']}; {tokenizer}")


if __name__ == "__main__":
    main()
