"""Find the first bad FP8 layer of a checkpoint: one batch through the FP8 model beside a float64 shadow of the same
weights, the linears ranked by forward-output error, input-gradient error, saturation and underflow
(:func:`fp8.debug.find_first_bad_layer`; docs/precision.md, "Finding the first bad layer").

    python tools/fp8_debug.py CHECKPOINT [--iteration N] [--batch-size 2] [--seq-length L] [--seed 0]
        [--threshold 0.35] [--recipe tensorwise|rowwise|blockwise] [--top K] [--json OUT.json]

``CHECKPOINT``: a ``pretrain_gpt.py --save`` directory (its latest checkpoint, or ``--iteration N``; any TP/PP/DP
layout, Llama-style runs) or an FP8 serving export (``fp8.export_fp8``, ``tools/convert_checkpoint.py --quantization
fp8``, or another tool's compressed-tensors / fp8 block checkpoint). A ``pretrain_gpt.py`` checkpoint goes through the
single-process conversion first (``--quantization fp8``: its FP8 weights as trained, shards merged), then either is
built as a transformers model, made FP8 (``fp8.initialize``, the run's ``--fp8-recipe`` or ``--recipe``) and given
the checkpoint's E4M3 weights as stored (``fp8.import_fp8``); the layers it holds in high precision (its ignore list)
stay so, other settings of the run (formats, margin, amax history) are the engine's defaults. It runs on ``--device``
(CUDA when available: its FP8 GEMMs; the CPU emulates them). The batch: ``--batch-size`` sequences of
``--seq-length`` tokens drawn uniformly from the vocabulary with ``--seed`` (the debugger compares FP8 with float64
on the same operands, so any batch exercises every layer); activation scales are current (the checkpoint's amax
histories are not used). Exit status 0 when no layer passes ``--threshold``, 1 when one does (its name printed),
2 on bad input (one line naming the fix).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":  # run as a script from a checkout: the repository root holds fp8 and megatron/training
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

__all__ = ["load_fp8_model", "main"]


def load_fp8_model(checkpoint: Path, iteration: int | None, recipe: str | None, workdir: Path,
                   device: str = "cpu"):
    """``(model, seq_length)``: the FP8 transformers model of ``checkpoint`` (module docstring)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import fp8
    from megatron.training.checkpointing.checkpoint import check_step, is_megatron_checkpoint, read_checkpoint_fp8

    seq_length = None
    if is_megatron_checkpoint(checkpoint):
        from megatron.training.checkpointing.hf_export import export_hf_fp8

        iteration = check_step(checkpoint, iteration, "--iteration")
        args, _, _ = read_checkpoint_fp8(checkpoint, iteration)
        recipe = recipe or args.get("fp8_recipe", "tensorwise")
        seq_length = args.get("seq_length")
        export_hf_fp8(checkpoint, workdir, "compressed-tensors", torch.float32, iteration)
        served = workdir
    elif (checkpoint / "config.json").is_file():
        if iteration is not None:
            raise ValueError(f"--iteration: {checkpoint} is a serving export (one set of weights): leave it out")
        qc = json.loads((checkpoint / "config.json").read_text()).get("quantization_config") or {}
        if qc.get("quant_method") not in ("compressed-tensors", "fp8"):
            raise ValueError(f"{checkpoint}: config.json has no FP8 quantization_config: pass a pretrain_gpt.py --save "
                             "directory or an FP8 serving export (fp8.export_fp8, convert_checkpoint.py "
                             "--quantization fp8)")
        served = checkpoint
    else:
        raise ValueError(f"{checkpoint}: neither a pretrain_gpt.py checkpoint nor a serving export (no config.json): "
                         "pass a --save directory or an fp8.export_fp8 directory")
    config = AutoConfig.from_pretrained(str(served))
    qc = config.quantization_config if isinstance(config.quantization_config, dict) else \
        config.quantization_config.to_dict()
    # the layers the checkpoint holds in high precision stay so: the debugger ranks what trained in FP8
    kept = set(qc.get("ignore") or qc.get("modules_to_not_convert") or [])
    del config.quantization_config  # built in high precision, then made FP8: its weights come from the file
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model, _ = fp8.initialize(model, None, "O1", recipe=recipe or "tensorwise", min_fp8_dim=0,
                              module_filter_fn=lambda module, name: name not in kept)
    fp8.import_fp8(model, served)
    return model.to(device), seq_length or getattr(config, "max_position_embeddings", 128)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fp8_debug.py", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--iteration", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-length", type=int, default=None, help="default: the run's --seq-length (exports: the "
                        "model's max_position_embeddings), at most 128")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where the model runs (default: cuda when available: its FP8 GEMMs; the CPU emulates them)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threshold", type=float, default=None, help="relative error of a bad layer (default "
                        "fp8.debug.DEFAULT_THRESHOLD)")
    parser.add_argument("--recipe", choices=("tensorwise", "rowwise", "blockwise"), default=None,
                        help="the FP8 recipe to rebuild the model with (default: the run's --fp8-recipe; exports: "
                             "tensorwise)")
    parser.add_argument("--top", type=int, default=10, help="rows of the ranking printed")
    parser.add_argument("--json", type=Path, default=None, help="write the whole report here")
    args = parser.parse_args(argv)
    from fp8.debug import DEFAULT_THRESHOLD, find_first_bad_layer

    threshold = DEFAULT_THRESHOLD if args.threshold is None else args.threshold
    try:
        if args.batch_size < 1 or (args.seq_length is not None and args.seq_length < 2) or not threshold > 0:
            raise ValueError("--batch-size must be >= 1, --seq-length >= 2 and --threshold > 0")
        if not args.checkpoint.exists():
            raise ValueError(f"{args.checkpoint} does not exist: pass a pretrain_gpt.py --save directory or an FP8 "
                             "serving export")
        with tempfile.TemporaryDirectory(prefix="fp8-debug-") as tmp:
            model, seq_length = load_fp8_model(args.checkpoint, args.iteration, args.recipe, Path(tmp), args.device)
    except (ValueError, OSError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    seq_length = args.seq_length or min(seq_length, 128)
    g = torch.Generator().manual_seed(args.seed)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch_size, seq_length), generator=g).to(args.device)
    report = find_first_bad_layer(model, lambda m: m(input_ids=tokens, labels=tokens).loss, threshold)
    print(report.table(args.top))
    if args.json is not None:
        args.json.write_text(json.dumps(report.as_dict(), indent=2) + "\n")
    if report.first_bad is None:
        print(f"no layer's error passes {threshold} ({len(report.layers)} FP8 linears)")
        return 0
    print(f"first bad layer (forward order): {report.first_bad}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
