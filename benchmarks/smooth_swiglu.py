"""Smooth-SwiGLU (:mod:`fp8.smooth_swiglu`) against the plain tensor-wise FP8 down projection, measured on the CPU.

- ``down_projection``: a down projection (``ffn`` 512 -> ``hidden`` 128, 256 tokens) fed SwiGLU's gated product of
  random data with 8 outlier channels scaled by 2^0 ... 2^12, over ``--seeds`` seeds. Per variant: the fraction of the
  input cast's values that saturate (all, and on the outlier channels), and the relative error (Frobenius) of the
  output and of both gradients against float64 ``h @ W^T`` with the layer's own FP8 weight ``W`` (its function).
  Variants: ``delayed`` (the tensor-wise recipe's default: the scale from a previous step's amax, here a step
  without outliers), ``current`` (the scale from this tensor's amax), ``smoothed``. Also the fraction of ``W / s``
  elements the smoothed weight operand keeps exactly (:func:`fp8.smooth_swiglu.weight_operand_exact`).
- ``training``: a tiny transformers Llama (2 layers, hidden 64, intermediate 128, vocabulary 128), ``--steps`` AdamW
  steps on a fixed batch, ``--train-seeds`` seeds, at ``none`` (the fp32 reference), O2, and O2 with Smooth-SwiGLU:
  (a) as is, (b) with
  outlier channels planted in every down projection's input from step ``--outliers-from``, growing 2x per step to
  2^8 (a forward pre-hook, the same in all three runs: the function changes alike), the FP8 runs' saturation of
  the down projections' inputs per step (:class:`fp8.stats.FP8Statistics`) and their losses' distance to the
  reference.
- ``launches``: per linear forward and backward launches and full-size passes on the hardware GEMM path
  (:class:`fp8.launches.LaunchCounter`, bf16, 256 x 256, 256 tokens).

``python benchmarks/smooth_swiglu.py [--seeds 50] [--steps 30] [--train-seeds 3] [--json
benchmarks/results/smooth_swiglu.json]`` (about 10 minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import fp8  # noqa: E402
from fp8.launches import LaunchCounter  # noqa: E402
from fp8.smooth_swiglu import SmoothSwiGLULinear, smooth_swiglu, smoothing_scales, weight_operand_exact  # noqa: E402
from fp8.stats import FP8Statistics, flush_and_saturation_counts  # noqa: E402

TOKENS, HIDDEN, FFN, OUTLIERS = 256, 128, 512, 8
MAGNITUDES = (0, 4, 8, 12)  # log2 of the outlier channels' factor
VARIANTS = ("delayed", "current", "smoothed")


def gated(gen: torch.Generator, log2: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SwiGLU's gated product ``silu(x W1^T) * (x W2^T)`` of random data, ``OUTLIERS`` channels times ``2**log2``."""
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    w1, w2 = (torch.randn(FFN, HIDDEN, generator=gen) / HIDDEN ** 0.5 for _ in range(2))
    h = F.silu(x @ w1.t()) * (x @ w2.t())
    channels = torch.randperm(FFN, generator=gen)[:OUTLIERS]
    h[:, channels] *= 2.0 ** log2
    return h, channels


def _layer(gen: torch.Generator, variant: str):
    linear = torch.nn.Linear(FFN, HIDDEN, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(HIDDEN, FFN, generator=gen) / FFN ** 0.5)
    kind = "current" if variant == "current" else "delayed"
    config = fp8.Float8LinearConfig(input=fp8.ScalingConfig("e4m3", kind), grad_accumulation="fp32")
    layer = fp8.Float8Linear.from_linear(linear, config)
    return SmoothSwiGLULinear.from_float8_linear(layer) if variant == "smoothed" else layer


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def down_projection(seeds: int) -> list[dict]:
    rows = []
    for log2 in MAGNITUDES:
        acc = {v: {"saturated": [], "saturated_outlier_channels": [], "output_error": [], "dh_error": [],
                   "dw_error": []} for v in VARIANTS}
        kept = []
        for seed in range(seeds):
            gen = torch.Generator().manual_seed(seed)
            quiet, _ = gated(gen, 0)
            h, channels = gated(gen, log2)
            g = torch.randn(TOKENS, HIDDEN, generator=gen) * 1e-3
            layer_seed = int(torch.randint(0, 2**31, (), generator=gen))
            for variant in VARIANTS:
                layer = _layer(torch.Generator().manual_seed(layer_seed), variant)
                layer(quiet.clone().requires_grad_(True)).sum().backward()  # a step without outliers: the history
                fp8.update_scales(layer)
                layer.weight.grad = None
                stats = FP8Statistics(layer, interval=1)
                stats.begin_step(1)
                hin = h.clone().requires_grad_(True)
                y = layer(hin)
                y.backward(g)
                saturated = stats.read()[""]["input"]["saturated"]
                w64 = layer.weight.dequantize(torch.float64)
                h64, g64 = h.double(), g.double()
                if variant == "smoothed":
                    scale = smoothing_scales(h)
                elif variant == "current":
                    scale = fp8.compute_scale(h.abs().amax(), "e4m3")
                else:
                    scale = layer.input_scaling.scale  # the delayed scale it cast with (before this step closes)
                counts = flush_and_saturation_counts(h[:, channels], scale[:, channels] if scale.dim() else scale,
                                                     fp8.E4M3)
                out = acc[variant]
                out["saturated"].append(saturated)
                out["saturated_outlier_channels"].append((counts[1] / counts[2]).item())
                out["output_error"].append(_rel(y.detach(), h64 @ w64.t()))
                out["dh_error"].append(_rel(hin.grad, g64 @ w64))
                out["dw_error"].append(_rel(layer.weight.grad, g64.t() @ h64))
                if variant == "smoothed":
                    kept.append(weight_operand_exact(w64, scale).double().mean().item())
        row = {"outlier_factor_log2": log2, "weight_operand_exact": _range(kept)}
        for variant in VARIANTS:
            row[variant] = {k: _range(v) for k, v in acc[variant].items()}
        rows.append(row)
    return rows


def _range(values: list[float]) -> dict:
    t = torch.tensor(values, dtype=torch.float64)
    return {"mean": t.mean().item(), "min": t.min().item(), "max": t.max().item()}


def _llama(seed: int):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _train(variant: str, steps: int, outliers_from: int | None, seed: int) -> dict:
    level = "none" if variant == "reference" else "O2"
    model = _llama(seed)
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), level, min_fp8_dim=0)
    if variant == "smoothed":
        smooth_swiglu(model)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (4, 32), generator=gen)
    channels = torch.randperm(128, generator=gen)[:4]
    state = {"step": 0}

    def plant(module, inputs):  # outlier channels of the gated product, growing 2x per step to 2^8
        if outliers_from is None or state["step"] < outliers_from:
            return None
        factor = torch.ones(inputs[0].shape[-1])
        factor[channels] = 2.0 ** min(8, 1 + state["step"] - outliers_from)
        return (inputs[0] * factor.to(inputs[0].dtype), *inputs[1:])

    downs = [layer.mlp.down_proj for layer in model.model.layers]
    for down in downs:
        down.register_forward_pre_hook(plant)
    stats = FP8Statistics(model, interval=1) if level != "none" else None
    losses, saturated = [], []
    for step in range(steps):
        state["step"] = step
        if stats is not None:
            stats.begin_step(step + 1)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if stats is not None:
            read = stats.read()
            saturated.append(max(read[name]["input"]["saturated"] for name in read if name.endswith("mlp.down_proj")))
    return {"losses": losses, "down_proj_input_saturated": saturated or None}


def training(steps: int, outliers_from: int, seeds: int) -> dict:
    out = {}
    for case, start in (("as_is", None), ("planted_outliers", outliers_from)):
        per_seed = []
        for seed in range(seeds):
            runs = {variant: _train(variant, steps, start, seed) for variant in ("reference", "plain", "smoothed")}
            ref = torch.tensor(runs["reference"]["losses"])
            for variant in ("plain", "smoothed"):
                distance = (torch.tensor(runs[variant]["losses"]) - ref).abs()
                runs[variant]["max_loss_distance_to_reference"] = distance.max().item()
                runs[variant]["mean_loss_distance_to_reference"] = distance.mean().item()
            per_seed.append({"seed": seed, **runs})
        summary = {variant: {key: _range([r[variant][key] for r in per_seed])
                             for key in ("max_loss_distance_to_reference", "mean_loss_distance_to_reference")}
                   for variant in ("plain", "smoothed")}
        for variant in ("plain", "smoothed"):
            summary[variant]["down_proj_input_saturated_max"] = max(max(r[variant]["down_proj_input_saturated"])
                                                                    for r in per_seed)
        out[case] = {"outliers_from_step": start, "summary": summary, "runs": per_seed}
    return out


def launches(width: int = 256, tokens: int = 256) -> dict:
    """Launches and full-size passes of one linear's forward and backward, plain (the tensor-wise delayed recipe) and
    smoothed, on the hardware GEMM path (counted on the CPU: :class:`fp8.launches.LaunchCounter`), after two steps (the
    delayed histories started and confirmed: the steady state)."""
    out = {}
    for variant in ("plain", "smoothed"):
        torch.manual_seed(0)
        layer = fp8.Float8Linear.from_linear(torch.nn.Linear(width, width, bias=False).to(torch.bfloat16),
                                             fp8.Float8LinearConfig(gemm_backend="scaled_mm"))
        if variant == "smoothed":
            layer = SmoothSwiGLULinear.from_float8_linear(layer)
        x = torch.randn(tokens, width, dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(tokens, width, dtype=torch.bfloat16)
        for _ in range(2):
            layer(x).backward(g)
            fp8.update_scales(layer)
        x.grad = layer.weight.grad = None
        forward, backward = LaunchCounter(width * tokens), LaunchCounter(width * tokens)
        with forward:
            y = layer(x)
        with backward:
            y.backward(g)
        out[variant] = {part: {"launches": c.launches, "full_size_passes": c.full_size_passes, "by_op": dict(c.by_op)}
                        for part, c in (("forward", forward), ("backward", backward))}
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--outliers-from", type=int, default=10)
    parser.add_argument("--train-seeds", type=int, default=3)
    parser.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "smooth_swiglu.json"))
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    start = time.time()
    result = {
        "command": " ".join(["python benchmarks/smooth_swiglu.py", *(argv if argv is not None else sys.argv[1:])]),
        "setup": {"tokens": TOKENS, "hidden": HIDDEN, "ffn": FFN, "outlier_channels": OUTLIERS, "seeds": args.seeds,
                  "torch": torch.__version__, "device": "cpu", "gemm": "emulated (bit-identical to torch._scaled_mm)"},
        "down_projection": down_projection(args.seeds),
        "training": training(args.steps, args.outliers_from, args.train_seeds),
        "launches": launches(),
    }
    result["seconds"] = round(time.time() - start, 1)
    print(f"{'outliers':>8} {'variant':>9} {'saturated':>10} {'sat. outl.':>10} {'out err':>8} {'dh err':>7} {'dW err':>7}")
    for row in result["down_projection"]:
        for variant in VARIANTS:
            r = row[variant]
            print(f"{'2^' + str(row['outlier_factor_log2']):>8} {variant:>9} {r['saturated']['mean']:>10.4f} "
                  f"{r['saturated_outlier_channels']['mean']:>10.4f} {r['output_error']['mean']:>8.4f} "
                  f"{r['dh_error']['mean']:>7.4f} {r['dw_error']['mean']:>7.4f}")
        print(f"{'':>8} W/s kept exactly: {row['weight_operand_exact']['mean']:.4f} (min "
              f"{row['weight_operand_exact']['min']:.4f})")
    for case, runs in result["training"].items():
        print(f"\ntraining, {case} ({args.train_seeds} seeds), |loss - fp32 reference| per step:")
        for v in ("plain", "smoothed"):
            r = runs["summary"][v]
            print(f"  {v:>8}: mean {r['mean_loss_distance_to_reference']['mean']:.4f}, max "
                  f"{r['max_loss_distance_to_reference']['max']:.4f}; down_proj input saturated (max over steps) "
                  f"{r['down_proj_input_saturated_max']:.4f}")
    for variant, parts in result["launches"].items():
        print(f"launches {variant}: forward {parts['forward']['launches']} backward {parts['backward']['launches']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.json} ({result['seconds']} s)")
    return result


if __name__ == "__main__":
    main()
