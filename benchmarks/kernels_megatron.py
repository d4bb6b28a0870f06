"""Device launches of pretrain_gpt.py's GPT per rank: a transformer layer and its tensor-parallel linears, at TP1 and
at TP2 with sequence parallelism, FP8 O2 beside BF16 (``python benchmarks/kernels.py --megatron`` runs it, or
``python benchmarks/kernels_megatron.py`` alone; collectives count as launches).

Each configuration builds ``pretrain_gpt.py``'s training run (``megatron.training.training.TrainingRun``: megatron-core's
``GPTModel`` with fp8lm's layer specs, mock data, ``--bf16``, GEMMs forced to the hardware path with
``--fp8-gemm-backend scaled_mm``), trains 3 iterations, then counts one iteration's launches per rank
(:class:`fp8.launches.LaunchCounter`): the forward (the schedule's forward step: model and loss), the optimizer step,
and the rest of the iteration (backward, gradient reductions, norm and clipping). Each figure per layer is the slope
between 2 and 4 layers. The tensor-parallel linears are counted alone too: one ``FP8ColumnParallelLinear`` (QKV-like,
``hidden -> 3 hidden``) and one ``FP8RowParallelLinear`` (``hidden -> hidden``), forward and backward, per rank,
steady state (their delayed-scaling steps closed 3 times first), beside the high-precision parallel linears.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HIDDEN, HEADS, FFN, SEQ, MBS, VOCAB = 256, 4, 1024, 256, 1, 512
LAYERS = (2, 4)
MODEL = ["--hidden-size", str(HIDDEN), "--num-attention-heads", str(HEADS), "--ffn-hidden-size", str(FFN),
         "--seq-length", str(SEQ), "--micro-batch-size", str(MBS), "--global-batch-size", str(MBS), "--mock-data",
         "--vocab-size", str(VOCAB), "--train-iters", "10", "--eval-interval", "0", "--no-progress", "--bf16",
         "--lr", "1e-3", "--lr-warmup-iters", "0", "--fp8-gemm-backend", "scaled_mm"]
LEVELS = ("none", "O2")


def _count(fn):
    from fp8.launches import LaunchCounter

    counter = LaunchCounter(SEQ * HIDDEN // 2)
    with counter:
        out = fn()
    return out, counter


def _run_counts(tp: int, level: str, layers: int) -> dict:
    """One training iteration of the GPT, counted (module docstring)."""
    from megatron.core import parallel_state
    from megatron.training import training
    from megatron.training.arguments import baseline_argv, parse_config

    flags = MODEL + ["--num-layers", str(layers), "--fp8-opt-level", level, "--tensor-model-parallel-size", str(tp)]
    if tp > 1:
        flags.append("--sequence-parallel")
    cfg = parse_config(baseline_argv(flags) if level == "none" else flags)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    training.initialize_distributed(cfg)
    datasets = training.Datasets(cfg)
    run = training.TrainingRun(cfg, datasets)
    iterator = run.data_iterators(datasets.train)
    for it in range(3):
        run.train_step(iterator, it)
    counts = {"forward": 0, "optimizer step": 0}
    forward_step, optimizer_step = run.forward_step, run.optimizer.step

    def counted_forward(data_iterator, model):
        out, c = _count(lambda: forward_step(data_iterator, model))
        counts["forward"] += c.launches
        return out

    def counted_step(*a, **k):
        out, c = _count(lambda: optimizer_step(*a, **k))
        counts["optimizer step"] += c.launches
        return out

    run.forward_step, run.optimizer.step = counted_forward, counted_step
    _, whole = _count(lambda: run.train_step(iterator, 3))
    counts["backward and the rest"] = whole.launches - counts["forward"] - counts["optimizer step"]
    counts["iteration"] = whole.launches
    return counts


def _linear_counts(tp: int, fp8: bool) -> dict:
    """The column- and row-parallel linears alone, forward and backward per rank (module docstring)."""
    import torch
    from megatron.core import parallel_state

    from fp8.linear import Float8LinearConfig
    from fp8.parallel.linear import ColumnParallelLinear, RowParallelLinear
    from fp8.scaling import update_scales

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    group = parallel_state.get_tensor_model_parallel_group()

    class Config:
        sequence_parallel = tp > 1
        params_dtype = torch.bfloat16
        perform_initialization = True

    config = Float8LinearConfig(gemm_backend="scaled_mm") if fp8 else None
    out = {}
    for name, cls, in_size, out_size in (("column-parallel (h -> 3h)", ColumnParallelLinear, HIDDEN, 3 * HIDDEN),
                                         ("row-parallel (h -> h)", RowParallelLinear, HIDDEN, HIDDEN)):
        kwargs = {"input_is_parallel": True} if cls is RowParallelLinear else {}
        layer = cls(in_size, out_size, config=Config(), init_method=torch.nn.init.normal_, bias=False, tp_group=group,
                    fp8=config, **kwargs)
        tokens = SEQ // tp if (tp > 1 and cls is ColumnParallelLinear) else SEQ
        width = in_size // tp if cls is RowParallelLinear else in_size
        x = torch.randn(tokens, 1, width, dtype=torch.bfloat16, requires_grad=True)
        for _ in range(4):
            y, _ = layer(x)
            y.backward(torch.ones_like(y))
            layer.zero_grad(set_to_none=True)
            x.grad = None
            if fp8:
                update_scales(layer)
        (y, _), fwd = _count(lambda: layer(x))
        _, bwd = _count(lambda: y.backward(torch.ones_like(y)))
        out[name] = {"forward": fwd.launches, "backward": bwd.launches, "total": fwd.launches + bwd.launches}
    return out


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import logging

    logging.disable(logging.WARNING)
    result = {"layer": {}, "linears": {}}
    for level in LEVELS:
        per_layers = {n: _run_counts(world, level, n) for n in LAYERS}
        small, large = per_layers[LAYERS[0]], per_layers[LAYERS[1]]
        result["layer"][level] = {
            "counts": {str(n): c for n, c in per_layers.items()},
            "per_layer": {k: (large[k] - small[k]) / (LAYERS[1] - LAYERS[0]) for k in small},
        }
    for fp8 in (False, True):
        result["linears"]["fp8" if fp8 else "high precision"] = _linear_counts(world, fp8)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def run() -> dict:
    """Both layouts (TP1 on one process, TP2+SP on two), rank 0's counts."""
    import socket

    from benchmarks.launch import spawn

    results = {}
    for tp in (1, 2):
        with tempfile.TemporaryDirectory() as out_dir, socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            spawn(_worker, (tp, port, out_dir), nprocs=tp)
            results["TP1" if tp == 1 else "TP2+SP"] = json.loads(Path(out_dir, "rank0.json").read_text())
    return {"setup": {"hidden": HIDDEN, "heads": HEADS, "ffn": FFN, "seq": SEQ, "micro_batch": MBS,
                      "layers": list(LAYERS), "dtype": "bf16", "gemm_backend": "scaled_mm"}, **results}


def print_table(result: dict) -> None:
    print(f"\nMegatron GPT, per rank (hidden {HIDDEN}, FFN {FFN}, {SEQ} tokens, bf16; per layer: slope "
          f"{LAYERS[0]} -> {LAYERS[1]} layers)")
    print(f"{'layout':8} {'level':6} {'forward':>8} {'backward+rest':>14} {'optimizer':>10} {'iteration':>10}")
    for layout in ("TP1", "TP2+SP"):
        for level in LEVELS:
            p = result[layout]["layer"][level]["per_layer"]
            print(f"{layout:8} {level:6} {p['forward']:8.1f} {p['backward and the rest']:14.1f} "
                  f"{p['optimizer step']:10.1f} {p['iteration']:10.1f}")
    print(f"\n{'layout':8} {'linear':28} {'precision':15} {'forward':>8} {'backward':>9} {'total':>6}")
    for layout in ("TP1", "TP2+SP"):
        for precision, linears in result[layout]["linears"].items():
            for name, c in linears.items():
                print(f"{layout:8} {name:28} {precision:15} {c['forward']:8d} {c['backward']:9d} {c['total']:6d}")


if __name__ == "__main__":
    res = run()
    print_table(res)
