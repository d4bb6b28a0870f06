"""Bytes held for backward after the forward pass of a Hugging Face Llama, with and without FP8 activation
compression (``fp8.activations``): pure BF16, pure BF16 + compression, FP32, FP32 + compression.

    python benchmarks/activation_memory.py [--json benchmarks/results/activation_memory.json]
        [--hidden 512] [--layers 2] [--batch 2] [--seq 1024] [--vocab 1000]

Method (CPU, exact, no allocator needed): every tensor the forward saves for backward goes through a
saved-tensor pack hook. The hook here is an :class:`fp8.activations.ActivationCompressor` whose ``pack``
also records the storage of each tensor it returns as is (unique storages, by pointer: the graph keeps
them alive, so a pointer cannot be reused during the forward); parameters are counted apart (the model
holds them anyway). Bytes held for backward = those storages' bytes + the compressor's ``stored_bytes``
(FP8 payloads and tile scales, each tensor once). The uncompressed runs use the same hook with compression
off (``dtypes=()``: everything is left alone), so both sides are counted the same way. The hook is entered
around the forward only, exactly what :func:`fp8.activations.compress_activations` does with its forward
pre-hook and forward hook. The loss (``labels=``) is computed in the forward, as in training; a
backward pass then checks the graph is usable and every compressed payload is freed.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from fp8.activations import ActivationCompressor  # noqa: E402

VARIANTS = (("BF16", torch.bfloat16, True), ("BF16 + FP8 activations", torch.bfloat16, False),
            ("FP32", torch.float32, True), ("FP32 + FP8 activations", torch.float32, False))
"""(name, model dtype, uncompressed)."""


class CountingCompressor(ActivationCompressor):
    """The compressor, also recording the unique storages of the tensors it leaves alone."""

    def __init__(self, **options):
        super().__init__(**options)
        self.kept: dict[int, int] = {}
        self.param_bytes: dict[int, int] = {}

    def pack(self, t):
        out = super().pack(t)
        if isinstance(out, torch.Tensor):
            storage = t.untyped_storage()
            target = self.param_bytes if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad) else self.kept
            target[storage.data_ptr()] = storage.nbytes()
        return out


def build(args, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
                         max_position_embeddings=args.seq, attn_implementation=args.attn)
    return LlamaForCausalLM(config).to(dtype)


def measure(args, name: str, dtype: torch.dtype, uncompressed: bool) -> dict:
    model = build(args, dtype)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    counter = CountingCompressor(dtypes=()) if uncompressed else CountingCompressor()
    start = time.perf_counter()
    with counter:
        loss = model(input_ids=ids, labels=ids).loss
    forward_s = time.perf_counter() - start
    kept = sum(counter.kept.values())
    held = kept + counter.stats.stored_bytes
    loss.backward()
    assert counter.stats.held_bytes == 0, "compressed payloads outlived the backward"
    return {"variant": name, "dtype": str(dtype).replace("torch.", ""), "held_bytes": held,
            "held_MiB": held / 2**20, "kept_bytes": kept, "fp8_stored_bytes": counter.stats.stored_bytes,
            "param_bytes_referenced": sum(counter.param_bytes.values()), "compressor": counter.stats.as_dict(),
            "forward_s": forward_s, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--json", default="benchmarks/results/activation_memory.json")
    args = parser.parse_args()
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))

    rows = [measure(args, *variant) for variant in VARIANTS]
    base = {row["dtype"]: row["held_bytes"] for row in rows if row["compressor"]["tensors"] == 0}
    bf16 = base["bfloat16"]
    print(f"bytes held for backward after the forward: Llama hidden {args.hidden}, {args.layers} layers, "
          f"{args.batch} x {args.seq} tokens, vocab {args.vocab}, {args.attn} attention (parameters not counted)")
    print(f"{'variant':<24}{'held MiB':>10}{'vs BF16':>9}{'vs own dtype':>13}{'FP8 MiB':>9}{'kept MiB':>10}"
          f"{'compressed':>11}{'stored/saved':>13}")
    for row in rows:
        row["vs_bf16"] = row["held_bytes"] / bf16
        row["vs_uncompressed"] = row["held_bytes"] / base[row["dtype"]]
        c = row["compressor"]
        print(f"{row['variant']:<24}{row['held_MiB']:>10.1f}{row['vs_bf16']:>9.3f}{row['vs_uncompressed']:>13.3f}"
              f"{row['fp8_stored_bytes'] / 2**20:>9.1f}{row['kept_bytes'] / 2**20:>10.1f}{c['tensors']:>11}"
              f"{c['ratio']:>13.3f}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"config": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
