"""Accuracy of FP8 weight-gradient accumulation over micro-batches: which mechanism keeps the sum exact.

One ``fp8.Float8Linear(256, 256)`` receives N micro-batches whose inputs and output gradients are
correlated (``x_k = sqrt(c) X0 + sqrt(1-c) noise_k``, the same for ``dY_k``, c = 0.5), so the weight
gradient grows like a real accumulated gradient. For N in 1, 32, 128, 512, 1536 it prints the relative
error ``||G - G_exact||_F / ||G_exact||_F`` of the accumulated gradient against the exact fp64 sum of
``dY_k^T x_k`` (unquantized operands), for:

- the layer with ``grad_accumulation="fp8"``: E4M3 gradient re-rounded after every micro-batch (1 B/elem);
- the layer with ``grad_accumulation="fp16"`` (the default): a scaled FP16 buffer (2 B/elem), and that sum
  quantized once to E4M3 (what the FP8 data-parallel reduction sends and leaves behind);
- the layer with ``grad_accumulation="fp32"``: fp32 ``.grad`` (4 B/elem), and that sum quantized once to E4M3;
- candidate mechanisms applied to the same per-micro-batch fp32 GEMM outputs: a BF16 or FP16 buffer
  (2 B/elem), E4M3 with an E4M3 compensation term (Kahan, 2 B/elem) or a BF16 one (3 B/elem).

Profiles (``--profiles``): ``correlated`` (as above), ``growing`` / ``shrinking`` (micro-batch k's output gradient
multiplied by ``100**(k/(N-1))`` / ``100**(-k/(N-1))``: the gradient's magnitude moves 100x across the window),
``zeros`` (the first micro-batch and every fourth one after it have a zero output gradient; at N = 1 the one
micro-batch is kept). A micro-batch with a non-finite gradient makes the sum non-finite in every 2- and 4-byte
mode, so the optimizer skips the step; :func:`nonfinite_check` reports it (and that the next window is exact).

Usage: ``python benchmarks/grad_accumulation.py [--counts 1,32,128,512,1536] [--seeds 3]
[--profiles correlated,growing,shrinking,zeros] [--json benchmarks/results/grad_accumulation.json]``. The
functions here are also the tests' harness.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fp8  # noqa: E402
from fp8.cast import quantize  # noqa: E402
from fp8.scaling import amax_of, compute_scale  # noqa: E402

COUNTS = (1, 32, 128, 512, 1536)
PROFILES = ("correlated", "growing", "shrinking", "zeros")
BYTES_PER_ELEMENT = {
    "fp8 (E4M3, re-rounded)": 1, "fp16 (scaled)": 2, "fp16, then E4M3 once": 2, "fp32": 4, "fp32, then E4M3 once": 4,
    "bf16 buffer": 2, "fp16 buffer": 2, "E4M3 + E4M3 compensation": 2, "E4M3 + bf16 compensation": 3,
}


def correlated_microbatches(n: int, in_features: int = 256, out_features: int = 256, tokens: int = 32,
                            seed: int = 0, correlation: float = 0.5) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``n`` pairs ``(x_k, dy_k)`` (fp32) sharing a common component with weight ``correlation``."""
    gen = torch.Generator().manual_seed(seed)
    common_x = torch.randn(tokens, in_features, generator=gen)
    common_dy = torch.randn(tokens, out_features, generator=gen)
    a, b = math.sqrt(correlation), math.sqrt(1.0 - correlation)
    for _ in range(n):
        x = a * common_x + b * torch.randn(tokens, in_features, generator=gen)
        dy = a * common_dy + b * torch.randn(tokens, out_features, generator=gen)
        yield x, dy


def profiled_microbatches(n: int, profile: str = "correlated", seed: int = 0,
                          **kwargs) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`correlated_microbatches` with the output gradients shaped by ``profile`` (module docstring)."""
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    for k, (x, dy) in enumerate(correlated_microbatches(n, seed=seed, **kwargs)):
        if profile in ("growing", "shrinking") and n > 1:
            dy = dy * 100.0 ** ((k if profile == "growing" else -k) / (n - 1))
        elif profile == "zeros" and n > 1 and k % 4 == 0:
            dy = torch.zeros_like(dy)
        yield x, dy


def relative_error(grad: torch.Tensor, exact: torch.Tensor) -> float:
    """``||grad - exact||_F / ||exact||_F`` in fp64 (scaled gradients dequantized)."""
    value = grad.dequantize(torch.float64) if hasattr(grad, "payload") else grad.to(torch.float64)
    return float(torch.linalg.vector_norm(value - exact) / torch.linalg.vector_norm(exact))


def e4m3_once(grad: torch.Tensor) -> fp8.Float8Tensor:
    """``grad`` quantized once to E4M3 with its current power-of-two scale."""
    return fp8.to_float8(grad.to(torch.float32), "e4m3")


def _quantized(value: torch.Tensor) -> torch.Tensor:
    fmt = fp8.get_format("e4m3")
    scale = compute_scale(amax_of(value), fmt)
    return quantize(value, scale, fmt).to(torch.float32) / scale


class _Candidate:
    """A mechanism simulated on the per-micro-batch fp32 GEMM outputs."""

    def __init__(self, add: Callable[[torch.Tensor | None, torch.Tensor | None, torch.Tensor], tuple]) -> None:
        self._add, self.state, self.comp = add, None, None

    def add(self, contribution: torch.Tensor) -> None:
        self.state, self.comp = self._add(self.state, self.comp, contribution)


def _buffer(dtype: torch.dtype):
    def add(state, comp, c):
        total = c if state is None else state.to(torch.float32) + c
        return total.to(dtype), None
    return add


def _compensated(comp_round: Callable[[torch.Tensor], torch.Tensor]):
    def add(state, comp, c):
        total = c if state is None else state + (c + comp)
        rounded = _quantized(total)
        return rounded, comp_round(total - rounded)
    return add


def candidates() -> dict[str, _Candidate]:
    return {
        "bf16 buffer": _Candidate(_buffer(torch.bfloat16)),
        "fp16 buffer": _Candidate(_buffer(torch.float16)),
        "E4M3 + E4M3 compensation": _Candidate(_compensated(_quantized)),
        "E4M3 + bf16 compensation": _Candidate(_compensated(lambda r: r.to(torch.bfloat16).to(torch.float32))),
    }


def measure(n: int, seed: int, with_candidates: bool = True, profile: str = "correlated") -> dict[str, float]:
    """Relative errors of every mechanism after ``n`` micro-batches of ``profile`` on one seed."""
    torch.manual_seed(seed)
    base = torch.nn.Linear(256, 256, bias=False)
    layers = {mode: fp8.Float8Linear.from_linear(base, fp8.Float8LinearConfig(grad_accumulation=mode))
              for mode in ("fp8", "fp16", "fp32")}
    sims = candidates() if with_candidates else {}
    # A third layer whose gradient is taken and cleared every micro-batch: the micro-batch's own fp32 GEMM
    # output (its scaling states see the same inputs as the others', so they evolve identically).
    probe = fp8.Float8Linear.from_linear(base, fp8.Float8LinearConfig(grad_accumulation="fp32")) if sims else None
    exact = torch.zeros(256, 256, dtype=torch.float64)
    for x, dy in profiled_microbatches(n, profile, seed=seed):
        exact += dy.double().t() @ x.double()
        for layer in layers.values():
            layer(x).backward(dy)
        if probe is not None:
            probe.weight.grad = None
            probe(x).backward(dy)
            for sim in sims.values():
                sim.add(probe.weight.grad)
    errors = {
        "fp8 (E4M3, re-rounded)": relative_error(layers["fp8"].weight.grad, exact),
        "fp16 (scaled)": relative_error(layers["fp16"].weight.grad, exact),
        "fp16, then E4M3 once": relative_error(e4m3_once(layers["fp16"].weight.grad.dequantize()), exact),
        "fp32": relative_error(layers["fp32"].weight.grad, exact),
        "fp32, then E4M3 once": relative_error(e4m3_once(layers["fp32"].weight.grad), exact),
    }
    errors.update({name: relative_error(sim.state, exact) for name, sim in sims.items()})
    return errors


def nonfinite_check(n: int, seed: int, mode: str) -> dict[str, bool | float]:
    """``n`` micro-batches into a ``Float8Linear`` with ``grad_accumulation=mode``, the middle one's output gradient
    NaN: ``skipped`` (the optimizer's finite check, :func:`fp8.optim.base.grads_finite_flag`, fails),
    ``scale_finite`` (the buffer's scale is still a finite power of two), then ``zero_grad(set_to_none=False)`` and
    ``n`` clean micro-batches into the same buffer: ``error_after`` against their exact sum."""
    from fp8.optim.base import grads_finite_flag

    torch.manual_seed(seed)
    layer = fp8.Float8Linear(256, 256, bias=False, config=fp8.Float8LinearConfig(grad_accumulation=mode))
    for k, (x, dy) in enumerate(correlated_microbatches(n, seed=seed)):
        if k == n // 2:
            dy = torch.full_like(dy, float("nan"))
        layer(x).backward(dy)
    grad = layer.weight.grad
    scale = getattr(grad, "scale", torch.ones(()))
    out = {"skipped": not bool(grads_finite_flag([layer.weight])), "scale_finite": bool(torch.isfinite(scale).all())}
    grad.zero_()
    exact = torch.zeros(256, 256, dtype=torch.float64)
    for x, dy in correlated_microbatches(n, seed=seed + 1):
        layer(x).backward(dy)
        exact += dy.double().t() @ x.double()
    out["error_after"] = relative_error(layer.weight.grad, exact)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--counts", default=",".join(map(str, COUNTS)))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--profiles", default=",".join(PROFILES))
    parser.add_argument("--json", default="benchmarks/results/grad_accumulation.json")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.counts.split(",")]
    profiles = args.profiles.split(",")
    by_profile: dict[str, dict[str, dict[str, float]]] = {}
    for profile in profiles:
        results: dict[str, dict[str, float]] = {}
        for n in counts:
            runs = [measure(n, seed, with_candidates=profile == "correlated", profile=profile)
                    for seed in range(args.seeds)]
            results[str(n)] = {name: max(run[name] for run in runs) for name in runs[0]}
        by_profile[profile] = results
        names = list(results[str(counts[0])])
        reference = results[str(counts[0])]["fp8 (E4M3, re-rounded)"] if counts[0] == 1 else None
        print(f"\n[{profile}] relative error of the accumulated weight gradient vs the exact fp64 sum "
              f"(worst of {args.seeds} seeds)")
        print(f"{'mechanism':<28} {'B/elem':>6} " + " ".join(f"{'N=' + str(n):>9}" for n in counts)
              + ("  worst / FP8 at N=1" if reference else ""))
        for name in names:
            row = [results[str(n)][name] for n in counts]
            ratio = f"  {max(row[1:] or row) / reference:>6.2f}x" if reference else ""
            print(f"{name:<28} {BYTES_PER_ELEMENT[name]:>6} " + " ".join(f"{e:>9.4f}" for e in row) + ratio)
    nonfinite = {mode: nonfinite_check(32, 0, mode) for mode in ("fp8", "fp16", "fp32")}
    print("\nA NaN micro-batch in the middle of 32, then zero_grad(set_to_none=False) and 32 clean ones:")
    for mode, row in nonfinite.items():
        print(f"  {mode}: step skipped {row['skipped']}, scale finite {row['scale_finite']}, "
              f"error of the next window {row['error_after']:.4f}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"counts": counts, "seeds": args.seeds, "bytes_per_element": BYTES_PER_ELEMENT,
                               "relative_error": by_profile["correlated"] if "correlated" in by_profile else {},
                               "relative_error_by_profile": by_profile, "nonfinite": nonfinite}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
