"""The figures of docs/fsdp.md's "Measured" section: fp8.initialize models under FSDP2 against one process (the worker
of tests/fp8/test_fsdp.py, seed 1717), at 2, 3 and 4 gloo ranks: the final loss gaps and, at 4 ranks, the bytes each
rank sends per step by tag.

    python benchmarks/fsdp_parity.py [--worlds 2 3 4] [--seed 1717] [--json benchmarks/results/fsdp_parity.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

ROWS = [("Llama", "llama", "O1", "fsdp", "single"), ("Llama", "llama", "O2", "fsdp", "single"),
        ("Llama, embedding gradients fp32 (`embeddings=\"high\"`)", "llama", "O2", "fsdp-embeddings-high", "single"),
        ("Llama, 2 micro-batches per step", "llama", "O1", "fsdp-accum", "single-accum"),
        ("Llama, 2 micro-batches per step", "llama", "O2", "fsdp-accum", "single-accum"),
        ("MLP", "mlp", "O1", "fsdp", "single"), ("MLP", "mlp", "O2", "fsdp", "single"),
        ("MLP, FSDP2's own fp32 reduce-scatter", "mlp", "O2", "fsdp-high", "single")]


def main() -> None:
    from tests.fsdp_worker import worker
    from tests.spawn import free_port, spawn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--seed", type=int, default=1717)
    parser.add_argument("--json", default="benchmarks/results/fsdp_parity.json")
    args = parser.parse_args()
    results = {}
    for world in args.worlds:
        out_dir = tempfile.mkdtemp()
        spawn(worker, (world, free_port(), args.seed, out_dir), world)
        results[world] = torch.load(os.path.join(out_dir, "rank0.pt"), weights_only=False)
    table = []
    print("| model | level | final loss, one process (per world) | " + " | ".join(f"gap, {w} ranks" for w in args.worlds)
          + " |")
    print("| --- | --- | ---: |" + " ---: |" * len(args.worlds))
    for label, kind, level, mode, ref in ROWS:
        finals, gaps = [], []
        for world in args.worlds:
            want = results[world][(kind, level, ref)]["losses"][-1]
            got = results[world][(kind, level, mode)]["losses"][-1]
            finals.append(want)
            gaps.append(abs(got - want) / abs(want))
        table.append({"model": label, "level": level, "finals": finals, "gaps": gaps})
        print(f"| {label} | {level} | {' / '.join(f'{f:.4f}' for f in finals)} | "
              + " | ".join(f"{g:.1e}" for g in gaps) + " |")
    last = args.worlds[-1]
    wire = {}
    print(f"\nBytes each rank sends per step ({last} ranks, the last of 20 steps, rank 0):")
    for kind, level in (("mlp", "O1"), ("mlp", "O2"), ("llama", "O1"), ("llama", "O2")):
        by_tag = results[last][(kind, level, "fsdp")]["step_bytes"][-1]
        wire[f"{kind} {level}"] = by_tag
        print(f"- {kind} {level}: " + ", ".join(f"{tag} {value:,.0f}" for tag, value in sorted(by_tag.items())))
    for kind, level, mode in (("mlp", "O2", "fsdp-high"), ("llama", "O2", "fsdp-embeddings-high")):
        by_tag = results[last][(kind, level, mode)]["step_bytes"][-1]
        wire[f"{kind} {level} {mode}"] = by_tag
        print(f"- {kind} {level} {mode}: " + ", ".join(f"{tag} {value:,.0f}" for tag, value in sorted(by_tag.items())))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"seed": args.seed, "worlds": args.worlds, "parity": table, "wire": wire}, f, indent=1)


if __name__ == "__main__":
    main()
