"""Model-state memory per parameter, measured with ``fp8.memory_report``: FP32, BF16 mixed precision,
O1 and O2 on a GPT of a few million parameters (and on its FP8 layers alone), plus the FP8-LM
ablation of the second moment in E4M3 vs FP16 on the quickstart model.

    python benchmarks/memory.py [--json benchmarks/results/memory.json] [--ablation-steps 300]

Memory is read at the peak of a step: after backward (gradients held) with optimizer states
allocated. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import fp8  # noqa: E402
from examples import quickstart  # noqa: E402
from examples.tiny_gpt import GPTConfig, TinyGPT  # noqa: E402

VARIANTS = ("FP32", "BF16 mixed precision", "O1", "O2")


def build(variant: str, model: torch.nn.Module):
    """Model and optimizer for ``variant``; BF16 mixed precision = BF16 weights and gradients, FP32
    master weights and AdamW states (Megatron's default), realised with fp8.optim's O1 precision."""
    if variant == "BF16 mixed precision":
        model = model.to(torch.bfloat16)
        return model, fp8.optim.AdamW(model.parameters(), lr=1e-4, precision="O1")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    level = {"FP32": "O0", "O1": "O1", "O2": "O2"}[variant]
    return fp8.initialize(model, optimizer, opt_level=level)


def measure(variant: str, make_model, make_loss) -> dict:
    """Bytes per category at the peak of the second training step, and bytes per parameter."""
    torch.manual_seed(0)
    model = make_model()
    n_params = sum(p.numel() for p in model.parameters())
    model, optimizer = build(variant, model)
    for step in range(2):
        make_loss(model).backward()
        if step == 1:
            report = fp8.memory_report(model, optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"variant": variant, "params": n_params, "bytes": report,
            "bytes_per_param": {k: v / n_params for k, v in report.items()}}


def gpt_case(d_model: int, n_layer: int):
    cfg = GPTConfig(vocab_size=256, seq_len=128, n_layer=n_layer, d_model=d_model, n_head=8)
    idx = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))

    def loss(model):
        return model(idx, idx)[1].float()

    return (lambda: TinyGPT(cfg)), loss


def linears_case(d_model: int, n_layer: int):
    x = torch.randn(64, d_model, generator=torch.Generator().manual_seed(0))

    def make():
        layers = []
        for _ in range(n_layer):
            layers += [torch.nn.Linear(d_model, 4 * d_model, bias=False), torch.nn.Linear(4 * d_model, d_model, bias=False)]
        return torch.nn.Sequential(*layers)

    def loss(model):
        dtype = next(model.parameters()).dtype
        return model(x.to(dtype)).float().pow(2).mean()

    return make, loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--n-layer", type=int, default=6)
    parser.add_argument("--ablation-steps", type=int, default=300, help="0 skips the ablation")
    parser.add_argument("--json", default="benchmarks/results/memory.json")
    args = parser.parse_args()

    rows = []
    for case_name, case in (("GPT", gpt_case), ("FP8 layers only", linears_case)):
        make, loss = case(args.d_model, args.n_layer)
        for variant in VARIANTS:
            row = measure(variant, make, loss)
            row["model"] = case_name
            rows.append(row)

    categories = (*fp8.MEMORY_CATEGORIES, "total")
    print(f"model-state bytes per parameter (fp8.memory_report, at the peak of a step); "
          f"GPT d_model={args.d_model} n_layer={args.n_layer}: {rows[0]['params']:,} parameters")
    header = f"{'model':<16} {'variant':<21}" + "".join(f"{c[:12]:>13}" for c in categories)
    print(header)
    for row in rows:
        print(f"{row['model']:<16} {row['variant']:<21}" + "".join(f"{row['bytes_per_param'][c]:>13.3f}" for c in categories))

    ablation = None
    if args.ablation_steps:
        out = Path(args.json).with_name("ablation_second_moment.json")
        os.makedirs(out.parent, exist_ok=True)
        quickstart.main(["--levels", "O0,O2,O2:exp_avg_sq=e4m3", "--steps", str(args.ablation_steps),
                         "--json", str(out)])
        ablation = json.loads(out.read_text())

    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "ablation_second_moment": ablation}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
