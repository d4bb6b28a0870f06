"""Quantization error of the scaling formats against float64, on the CPU (issue 33): E4M3 with one scale per tensor,
per row, per 1x128 tile (the existing recipes), MXFP8 (1x32 tiles, 32x32 weight blocks, E8M0 scales) and NVFP4 (E2M1
with an E4M3 scale per 1x16 or 16x16 block and a power-of-two per-tensor scale); NVFP4's weight-gradient GEMM with and
without the 16x16 random Hadamard transform; stochastic rounding's bias against round to nearest; and one FP8 linear
per recipe (forward, input gradient, weight gradient against float64 on the same master weights).

    python benchmarks/microscaling.py        # ~20 s; writes benchmarks/results/microscaling.json

Format errors are each row's relative error ``||q_r - x_r|| / ||x_r||`` averaged over the rows (every token counts
alike), GEMM and linear errors relative Frobenius norms ``||q - x|| / ||x||``; means over 5 seeds. Inputs (512 x 1024 unless said):
``gaussian`` (N(0, 1)), ``outlier channels`` (every 64th column x 10^4, as activations' outlier features),
``wide-range rows`` (each row x 2**k, k uniform in -24..24: tokens of very different magnitudes, as gradients have),
``heavy-tailed`` (N(0, 1) x exp(N(0, 1)): log-normal magnitudes), ``spikes`` (1% of the values x 30). Within E4M3's
normal range the relative rounding error does not depend on the scale, so the E4M3 granularities differ only where a
block's values span more than that range.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp8.blocks import dequantize_blocks, quantize_to_blocks  # noqa: E402
from fp8.fp4 import (dequantize_nvfp4, hadamard_transform, quantize_nvfp4, random_hadamard,  # noqa: E402
                       round_e2m1, unpack_e2m1, pack_e2m1)

SEEDS = range(5)
KINDS = ("gaussian", "outlier channels", "wide-range rows", "heavy-tailed", "spikes")


def _input(kind: str, seed: int, shape=(512, 1024)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    if kind == "outlier channels":
        x[:, ::64] *= 1e4
    elif kind == "wide-range rows":
        x = x * torch.exp2(torch.randint(-24, 25, (shape[0], 1), generator=g).float())
    elif kind == "heavy-tailed":
        x = x * torch.exp(torch.randn(*shape, generator=g))
    elif kind == "spikes":
        x = torch.where(torch.rand(*shape, generator=g) < 0.01, x * 30.0, x)
    return x


def _rel(q: torch.Tensor, x: torch.Tensor) -> float:
    return float((q.detach().double() - x.detach().double()).norm() / x.detach().double().norm())


def _e4m3(block):
    def run(x):
        data, scale = quantize_to_blocks(x, block, "e4m3")
        return dequantize_blocks(data, scale, block, torch.float64)
    return run


FORMATS = {
    "E4M3, one scale per tensor": _e4m3((0, 0)),
    "E4M3, one per row": _e4m3((1, 0)),
    "E4M3, 1x128 tiles (blockwise)": _e4m3((1, 128)),
    "MXFP8, 1x32 (activations)": _e4m3((1, 32)),
    "MXFP8, 32x32 (weights)": _e4m3((32, 32)),
    "NVFP4, 1x16 (activations)": lambda x: dequantize_nvfp4(quantize_nvfp4(x, (1, 16)), torch.float64),
    "NVFP4, 16x16 (weights)": lambda x: dequantize_nvfp4(quantize_nvfp4(x, (16, 16)), torch.float64),
}


def _row_rel(q: torch.Tensor, x: torch.Tensor) -> float:
    """Mean over rows of each row's relative error (every token counts alike, whatever its magnitude)."""
    x = x.double()
    return float(((q.double() - x).norm(dim=1) / x.norm(dim=1)).mean())


def format_errors() -> dict:
    out = {}
    for name, run in FORMATS.items():
        out[name] = {kind: sum(_row_rel(run(_input(kind, s)), _input(kind, s)) for s in SEEDS) / len(SEEDS)
                     for kind in KINDS}
    return out


def _wgrad(kind: str, seed: int, rht: bool) -> float:
    """NVFP4 weight-gradient GEMM ``dY^T x`` (256 tokens, 1024 in, 512 out): both operands quantized along the tokens
    (K) in 1x16 blocks of their transposes, optionally after the random Hadamard transform along the tokens."""
    g = torch.Generator().manual_seed(1000 + seed)
    x, dy = _input(kind, seed, (256, 1024)), torch.randn(256, 512, generator=g)
    ref = dy.double().t() @ x.double()
    if rht:
        h = random_hadamard(torch.randint(0, 2, (16,), generator=g) * 2 - 1)
        x, dy = hadamard_transform(x, h, 0), hadamard_transform(dy, h, 0)
    qa = dequantize_nvfp4(quantize_nvfp4(dy.t().contiguous()), torch.float64)
    qb = dequantize_nvfp4(quantize_nvfp4(x.t().contiguous()), torch.float64)
    return float((qa @ qb.t() - ref).norm() / ref.norm())


def hadamard_errors() -> dict:
    return {kind: {f"{'with' if rht else 'without'} RHT": sum(_wgrad(kind, s, rht) for s in SEEDS) / len(SEEDS)
                   for rht in (False, True)} for kind in KINDS}


def rounding_bias(draws: int = 400) -> dict:
    """Relative bias ``||mean(q) - x|| / ||x||`` of E2M1 rounding of 4,096 values spread over (0, 6): the mean of
    ``draws`` stochastic roundings (independent seeds) against round to nearest (one value, the same every time)."""
    x = torch.rand(1, 4096, generator=torch.Generator().manual_seed(0)) * 6
    nearest = unpack_e2m1(pack_e2m1(round_e2m1(x)))
    total = torch.zeros_like(x, dtype=torch.float64)
    for s in range(draws):
        total += unpack_e2m1(pack_e2m1(round_e2m1(x, True, torch.Generator().manual_seed(s)))).double()
    return {"round to nearest": _rel(nearest, x), f"stochastic, mean of {draws}": _rel(total / draws, x),
            "stochastic, one draw": _rel(unpack_e2m1(pack_e2m1(round_e2m1(x, True, torch.Generator().manual_seed(7)))),
                                         x)}


def linear_errors() -> dict:
    """One FP8 linear (64 tokens x 256 -> 384, fp32) per recipe: forward, input gradient and weight gradient against
    float64 on the same master weights (``tests/fp8/test_recipes.py``'s case), mean over the seeds."""
    import fp8
    from fp8.linear import Float8LinearConfig

    out = {}
    for recipe in ("tensorwise", "rowwise", "blockwise", "mxfp8", "nvfp4"):
        sums = [0.0, 0.0, 0.0]
        for seed in SEEDS:
            g = torch.Generator().manual_seed(seed)
            w = torch.randn(384, 256, generator=g, dtype=torch.float64) / 16
            x = torch.randn(64, 256, generator=g, dtype=torch.float64)
            gy = torch.randn(64, 384, generator=g, dtype=torch.float64)
            lin = torch.nn.Linear(256, 384, bias=False)
            with torch.no_grad():
                lin.weight.copy_(w)
            layer = fp8.Float8Linear.from_linear(lin, Float8LinearConfig(recipe=recipe, grad_accumulation="fp32"))
            xf = x.float().requires_grad_()
            y = layer(xf)
            y.backward(gy.float())
            for i, (got, want) in enumerate(((y, x @ w.t()), (xf.grad, gy @ w), (layer.weight.grad, gy.t() @ x))):
                sums[i] += _rel(got, want) / len(SEEDS)
        out[recipe] = dict(zip(("forward", "input gradient", "weight gradient"), sums))
    return out


def state_bytes() -> dict:
    """Model-state bytes per parameter of the FP8 linears' weights (a TinyGPT, d_model 256, 4 layers: its FP8
    linears only, ``fp8.memory_report`` of a model made of them after one step, gradients held) at O1 and O2 per
    recipe, on the CPU; plus, for MXFP8, what each weight keeps for the Blackwell GEMMs (the transposed payload and both
    GEMMs' swizzled E8M0 scales, built here for a simulated compute capability 10.0 GPU), per weight element. NVFP4's
    weights keep their two NVFP4 copies on every device: ``fp8.memory_report``'s ``"weight transposes"``."""
    import fp8
    from fp8.gemm import GemmTarget
    from fp8.mxfp8 import MXWeightQuantizer
    from fp8.testing import GPTConfig, TinyGPT

    out = {}
    for recipe in ("tensorwise", "mxfp8", "nvfp4"):
        for level in ("O1", "O2"):
            torch.manual_seed(0)
            gpt = TinyGPT(GPTConfig(d_model=256, n_layer=4, vocab_size=256, seq_len=64))
            linears = torch.nn.ModuleList([m for m in gpt.modules() if isinstance(m, torch.nn.Linear)
                                           and m.in_features % 32 == 0 and m.out_features % 32 == 0])
            n = sum(p.numel() for p in linears.parameters())
            opt = torch.optim.AdamW(linears.parameters(), lr=1e-3)
            linears, opt = fp8.initialize(linears, opt, level, recipe=recipe)
            for _ in range(2):
                loss = sum(lin(torch.randn(64, lin.in_features)).square().mean() for lin in linears)
                loss.backward()
                if _ == 0:
                    opt.step()
                    opt.zero_grad()
            report = fp8.memory_report(linears, opt)
            row = {k: v / n for k, v in report.items()}
            if recipe == "mxfp8":
                kept = 0
                for lin in linears:
                    w = lin.weight
                    q = MXWeightQuantizer()
                    fwd = q.forward_b(w.payload, w.scale, None, "auto", GemmTarget("cuda", (10, 0)))
                    a = type(fwd)(w.payload.new_empty((0, w.shape[0])), w.scale, (1, 32))
                    dgrad = q.dgrad_b(w.payload, w.scale, None, a, torch.bfloat16, "auto", GemmTarget("cuda", (10, 0)))
                    kept += sum(t.numel() * t.element_size() for t in (dgrad.data, fwd.scale_inv, fwd.hw_scale,
                                                                        dgrad.hw_scale))
                row["kept for the Blackwell GEMMs (per weight element)"] = kept / sum(lin.weight.numel()
                                                                                     for lin in linears)
            out[f"{level} {recipe}"] = row
    return out


def main() -> None:
    torch.manual_seed(0)
    results = {"format_errors": format_errors(), "nvfp4_wgrad_hadamard": hadamard_errors(),
               "e2m1_rounding_bias": rounding_bias(), "linear_errors": linear_errors(), "state_bytes": state_bytes(),
               "command": "python benchmarks/microscaling.py", "torch": torch.__version__}
    print("quantization error against float64: mean per-row relative error (mean of 5 seeds)")
    print(f"{'format':<32}" + "".join(f"{k:>17}" for k in KINDS))
    for name, row in results["format_errors"].items():
        print(f"{name:<32}" + "".join(f"{row[k]:>17.4f}" for k in KINDS))
    print("\nNVFP4 weight-gradient GEMM, relative error")
    for kind, row in results["nvfp4_wgrad_hadamard"].items():
        print(f"{kind:<20} without RHT {row['without RHT']:.4f}  with RHT {row['with RHT']:.4f}")
    print("\nE2M1 rounding, relative bias:", {k: round(v, 5) for k, v in results["e2m1_rounding_bias"].items()})
    print("\none FP8 linear per recipe (forward / input gradient / weight gradient):")
    for recipe, row in results["linear_errors"].items():
        print(f"{recipe:<12}" + " / ".join(f"{v:.4f}" for v in row.values()))
    print("\nbytes per parameter of the FP8 linears (CPU, after a step, gradients held):")
    for name, row in results["state_bytes"].items():
        print(f"{name:<16}" + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))
    out = ROOT / "benchmarks" / "results" / "microscaling.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
