"""Benchmark one linear layer, forward + backward: high precision vs fp8.Float8Linear (both GEMM backends).

Prints a table and writes JSON. On CPU it measures correctness-path cost, not FP8 speed (CPU has no
FP8 units); on a CUDA GPU it times with CUDA events. Usage:

    python benchmarks/linear.py [--shapes 4096x1024x1024,...] [--iters 10] [--json benchmarks/results/linear.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp8  # noqa: E402


def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn, iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / iters
    else:
        def run(fn, iters):
            begin = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - begin) * 1e3 / iters
    return run


def bench_shape(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, iters: int) -> list[dict]:
    """Rows of {variant, ms, tflops, rel_err} for one (M, K, N) linear, forward + backward."""
    torch.manual_seed(0)
    base = torch.nn.Linear(k, n, bias=False, device=device, dtype=dtype)
    x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(m, n, device=device, dtype=dtype)
    reference = (x.double() @ base.weight.double().t())
    variants = {"high precision": base}
    for backend in ("scaled_mm", "emulated"):
        variants[f"fp8 ({backend})"] = fp8.Float8Linear.from_linear(base, fp8.Float8LinearConfig(gemm_backend=backend))
    timer = _timer(device)
    rows = []
    for name, layer in variants.items():
        def step():
            x.grad = None
            layer.weight.grad = None
            layer(x).backward(g)
        step()  # warm-up
        ms = timer(step, iters)
        with torch.no_grad():
            err = ((layer(x).double() - reference).norm() / reference.norm()).item()
        rows.append({"M": m, "K": k, "N": n, "variant": name, "ms": ms, "tflops": 6 * m * k * n / ms / 1e9,
                     "forward_rel_err": err})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="2048x512x512,2048x512x2048,2048x2048x512", help="MxKxN, comma separated")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/linear.json")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for shape in args.shapes.split(","):
        m, k, n = (int(v) for v in shape.split("x"))
        rows += bench_shape(m, k, n, dtype, device, args.iters)
    print(f"device={device} dtype={dtype} torch={torch.__version__} threads={torch.get_num_threads()}")
    print(f"{'M x K x N':>18} {'variant':>18} {'ms':>9} {'TFLOP/s':>8} {'fwd rel err':>12}")
    for r in rows:
        print(f"{r['M']:>6}x{r['K']:>5}x{r['N']:>5} {r['variant']:>18} {r['ms']:>9.2f} {r['tflops']:>8.3f} {r['forward_rel_err']:>12.4f}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"device": str(device), "dtype": str(dtype), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
