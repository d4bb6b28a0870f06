"""Device launches and full-size passes of the FP8 path, counted on the CPU, beside BF16.

Every dispatched op that is not a view or a pure allocation is one launch on a GPU (0-d scale math included), and
each of fp8's fused kernels is one ``torch.library`` custom op (:mod:`fp8.ops`): so the op sequence a CPU run
dispatches is the GPU's launch sequence (:class:`fp8.launches.LaunchCounter`). GEMMs are forced to the hardware path
(``gemm_backend="scaled_mm"``: ``torch._scaled_mm``, and :func:`fp8.ops.block_mm` for block scales), the model is
bf16, linears 256 x 256 without bias, 256 tokens, steady state (3 training steps first).

- ``linear``: per FP8 linear, forward and backward launches and full-size passes (an op reading or writing a tensor
  of 256 x 256 elements or more), per recipe (tensorwise with delayed and with current scaling, rowwise, blockwise,
  mxfp8 and nvfp4: their Blackwell sequences, the GEMM as :func:`fp8.ops.mx_mm` / :func:`fp8.fp4.nvfp4_mm`, the
  calls' CPU references)
  and opt level; each figure is the slope between models of 2 and 8 linears, so the loss and the model's ends cancel.
  BF16 ``nn.Linear`` beside.
- ``megatron`` (``--megatron``): ``pretrain_gpt.py``'s GPT per rank, a transformer layer (slope between 2 and 4
  layers: forward, backward and the rest, optimizer step) and its tensor-parallel linears alone, at TP1 and at TP2
  with sequence parallelism, FP8 O2 beside BF16 (:mod:`benchmarks.kernels_megatron`; collectives count as launches).
- ``optimizer``: ``optimizer.step(); optimizer.zero_grad()`` launches with 2 and 8 linears and their slope per
  linear, per opt level and recipe (O1 wraps ``torch.optim.AdamW``, built with ``foreach=True`` as GPUs default to,
  and with ``fused=True``; BF16 beside with both). ``foreach=True`` reads each parameter's step count on the host
  (``aten._local_scalar_dense``, 2 per parameter: torch keeps those counts in CPU tensors on a GPU, so there they are
  no device launch; counted here all the same). O3 runs in a one-rank gloo group.

Counts are deterministic. ``python benchmarks/kernels.py [--megatron] [--json benchmarks/results/kernels.json]``
prints the tables and writes the JSON; ``tests/fp8/test_kernel_launches.py`` holds the targets.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import fp8  # noqa: E402
from fp8.launches import LaunchCounter  # noqa: E402

WIDTH, TOKENS, SMALL, LARGE, WARMUP = 256, 256, 2, 8, 3
FULL_SIZE = WIDTH * TOKENS
RECIPES = {  # name -> (recipe, scaling kind)
    "tensorwise delayed": ("tensorwise", "delayed"),
    "tensorwise current": ("tensorwise", "current"),
    "rowwise": ("rowwise", "delayed"),
    "blockwise": ("blockwise", "delayed"),
    "mxfp8": ("mxfp8", "delayed"),
    "nvfp4": ("nvfp4", "delayed"),
}
LEVELS = ("O1", "O2", "O3")


def _config(recipe: str, kind: str, grad_accumulation: str = "fp16") -> fp8.Float8LinearConfig:
    return fp8.Float8LinearConfig(gemm_backend="scaled_mm", recipe=recipe, input=fp8.ScalingConfig("e4m3", kind),
                                  grad_output=fp8.ScalingConfig("e5m2", kind), grad_accumulation=grad_accumulation)


def _model(level: str, n_linears: int, recipe: str = "tensorwise", kind: str = "delayed", adamw: dict | None = None,
           grad_accumulation: str = "fp16"):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(n_linears)]).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, **(adamw or {"foreach": True}))
    if level != "bf16":
        model, optimizer = fp8.initialize(model, optimizer, level,
                                          config=_config(recipe, kind, grad_accumulation))
    return model, optimizer


def _count(fn) -> tuple[int, int, dict]:
    counter = LaunchCounter(FULL_SIZE)
    with counter:
        fn()
    return counter.launches, counter.full_size_passes, dict(counter.by_op)


def measure(level: str, n_linears: int, recipe: str = "tensorwise", kind: str = "delayed",
            adamw: dict | None = None, grad_accumulation: str = "fp16") -> dict:
    """Launches and passes of one training step's forward, backward and optimizer step of a chain of
    ``n_linears`` linears (module docstring), after :data:`WARMUP` steps."""
    model, optimizer = _model(level, n_linears, recipe, kind, adamw, grad_accumulation)
    x = torch.randn(TOKENS, WIDTH, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(TOKENS, WIDTH, dtype=torch.bfloat16)
    for _ in range(WARMUP):
        model(x).backward(grad)
        optimizer.step()
        optimizer.zero_grad()
    out = {}
    holder = {}
    out["forward"] = _count(lambda: holder.setdefault("y", model(x)))
    out["backward"] = _count(lambda: holder["y"].backward(grad))

    def step():
        optimizer.step()
        optimizer.zero_grad()

    out["step"] = _count(step)
    return out


def slope(small: dict, large: dict, part: str) -> dict:
    d = LARGE - SMALL
    ops = {op: (large[part][2].get(op, 0) - small[part][2].get(op, 0)) / d
           for op in set(large[part][2]) | set(small[part][2])}
    return {"launches": (large[part][0] - small[part][0]) / d, "full_size_passes": (large[part][1] - small[part][1]) / d,
            "by_op": {k: v for k, v in sorted(ops.items(), key=lambda kv: -kv[1]) if v}}


def linear_table(levels=("O1", "O2")) -> list[dict]:
    """Per-linear forward/backward launches and passes: BF16, then every recipe at every level."""
    rows = []
    small, large = measure("bf16", SMALL), measure("bf16", LARGE)
    rows.append({"variant": "BF16 nn.Linear", "level": "bf16", "recipe": None,
                 "forward": slope(small, large, "forward"), "backward": slope(small, large, "backward")})
    for level in levels:
        for name, (recipe, kind) in RECIPES.items():
            small, large = measure(level, SMALL, recipe, kind), measure(level, LARGE, recipe, kind)
            rows.append({"variant": f"{level} {name}", "level": level, "recipe": name,
                         "forward": slope(small, large, "forward"), "backward": slope(small, large, "backward")})
    for name, (recipe, kind) in RECIPES.items():  # the weight gradient in fp32, as Transformer Engine's main_grad
        if recipe != "tensorwise":
            continue
        small = measure("O1", SMALL, recipe, kind, grad_accumulation="fp32")
        large = measure("O1", LARGE, recipe, kind, grad_accumulation="fp32")
        rows.append({"variant": f"O1 {name}, fp32 wgrad", "level": "O1", "recipe": name, "grad_accumulation": "fp32",
                     "forward": slope(small, large, "forward"), "backward": slope(small, large, "backward")})
    for row in rows:
        row["total"] = {k: row["forward"][k] + row["backward"][k] for k in ("launches", "full_size_passes")}
    return rows


def optimizer_table(levels=LEVELS) -> list[dict]:
    """Optimizer-step launches with 2 and 8 linears and the slope per linear."""
    rows = []
    variants = [("BF16 AdamW(foreach=True)", "bf16", {"foreach": True}, "tensorwise"),
                ("BF16 AdamW(fused=True)", "bf16", {"fused": True}, "tensorwise")]
    variants += [(f"{level} (AdamW foreach=True)", level, {"foreach": True}, "tensorwise") for level in levels]
    variants += [(f"{level} {recipe} (AdamW foreach=True)", level, {"foreach": True}, recipe)
                 for level in levels for recipe in ("rowwise", "blockwise")]
    if "O1" in levels:  # O1 steps torch's optimizer on its masters: its fused AdamW reads no step count on the host
        variants += [(f"O1 {recipe} (AdamW fused=True)".replace(" tensorwise", ""), "O1", {"fused": True}, recipe)
                     for recipe in ("tensorwise", "rowwise", "blockwise")]
    for name, level, adamw, recipe in variants:
        small, large = measure(level, SMALL, recipe, adamw=adamw), measure(level, LARGE, recipe, adamw=adamw)
        rows.append({"variant": name, "level": level, "recipe": recipe, f"launches_{SMALL}": small["step"][0],
                     f"launches_{LARGE}": large["step"][0], "per_linear": slope(small, large, "step")})
    return rows


def _one_rank_group() -> None:
    """O3 needs a process group: one rank of gloo on loopback."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _print_linear(rows: list[dict]) -> None:
    print(f"\nPer linear (slope {SMALL} -> {LARGE} linears of {WIDTH}x{WIDTH}, {TOKENS} tokens, bf16, GEMMs forced "
          f"to the hardware path)")
    print(f"{'variant':34} {'forward':>8} {'backward':>9} {'total':>6} {'full-size passes':>17}")
    for r in rows:
        print(f"{r['variant']:34} {r['forward']['launches']:8.0f} {r['backward']['launches']:9.0f} "
              f"{r['total']['launches']:6.0f} {r['total']['full_size_passes']:17.0f}")


def _print_optimizer(rows: list[dict]) -> None:
    print("\nOptimizer step (step + zero_grad)")
    print(f"{'variant':34} {f'{SMALL} linears':>10} {f'{LARGE} linears':>10} {'per linear':>11}")
    for r in rows:
        print(f"{r['variant']:34} {r[f'launches_{SMALL}']:10d} {r[f'launches_{LARGE}']:10d} "
              f"{r['per_linear']['launches']:11.1f}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "kernels.json"))
    parser.add_argument("--megatron", action="store_true", help="also the Megatron TP linears and layers (2 processes)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "0")
    _one_rank_group()
    result = {"setup": {"width": WIDTH, "tokens": TOKENS, "linears": [SMALL, LARGE], "warmup_steps": WARMUP,
                        "dtype": "bfloat16", "gemm_backend": "scaled_mm", "torch": torch.__version__},
              "linear": linear_table(), "optimizer": optimizer_table()}
    _print_linear(result["linear"])
    _print_optimizer(result["optimizer"])
    if args.megatron:
        from benchmarks import kernels_megatron

        result["megatron"] = kernels_megatron.run()
        kernels_megatron.print_table(result["megatron"])
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
