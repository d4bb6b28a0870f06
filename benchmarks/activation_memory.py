"""Bytes held for backward after the forward pass of a Hugging Face Llama: pure BF16, BF16 at O2 (FP8 linears,
tensorwise and blockwise recipes), each with and without FP8 activation compression (``fp8.activations``), and
FP32; beside each, the memory planner's figure for the same model (megatron/training/planning/memory_plan.py).

    python benchmarks/activation_memory.py [--json benchmarks/results/activation_memory.json]
        [--hidden 512] [--layers 2] [--batch 2] [--seq 1024] [--vocab 1000]

Method (CPU, exact: the engine's ledger): every tensor the forward saves for backward goes through the pack hook
of an :class:`fp8.activations.ActivationCompressor` entered around the forward (what
``fp8.initialize(..., fp8_activations=True)`` installs with its forward hooks); for the uncompressed variants a
compressor that compresses nothing (``dtypes=()``) only counts. Right after the forward,
:meth:`~fp8.activations.ActivationCompressor.held_bytes` is the bytes held for backward: the FP8 copies plus
the storages of the tensors saved as is, each once, parameters excluded (``fp8.memory_report`` reports the same
figure as ``"activations"``). The loss (``labels=``) is computed in the forward, as in training; a backward pass
then checks every compressed payload is freed. Prints a table and writes JSON.
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
import fp8  # noqa: E402
from fp8.activations import ActivationCompressor  # noqa: E402
from fp8.memory import memory_report  # noqa: E402
from megatron.training.planning.memory_plan import PlannerConfig, plan_memory  # noqa: E402

VARIANTS = (
    ("BF16", torch.bfloat16, "none", "tensorwise", False),
    ("BF16 + FP8 activations", torch.bfloat16, "none", "tensorwise", True),
    ("O2 tensorwise", torch.bfloat16, "O2", "tensorwise", False),
    ("O2 tensorwise + FP8 activations", torch.bfloat16, "O2", "tensorwise", True),
    ("O2 blockwise", torch.bfloat16, "O2", "blockwise", False),
    ("O2 blockwise + FP8 activations", torch.bfloat16, "O2", "blockwise", True),
    ("FP32", torch.float32, "none", "tensorwise", False),
    ("FP32 + FP8 activations", torch.float32, "none", "tensorwise", True),
)
"""(name, model dtype, opt level, recipe, FP8 activations)."""


def build(args, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.heads, vocab_size=args.vocab,
                         max_position_embeddings=args.seq, attn_implementation=args.attn)
    return LlamaForCausalLM(config).to(dtype)


def planned(args, dtype: torch.dtype, level: str, recipe: str, compressed: bool) -> int:
    """The planner's activations for this Llama (``implementation="transformers"``: RMSNorm, SwiGLU, RoPE, no biases,
    untied, and what transformers' layers save)."""
    cfg = PlannerConfig(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.intermediate,
                        num_attention_heads=args.heads, seq_length=args.seq, vocab_size=args.vocab,
                        make_vocab_size_divisible_by=1, swiglu=True, normalization="RMSNorm",
                        position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                        add_bias_linear=False, micro_batch_size=args.batch, global_batch_size=args.batch,
                        bf16=dtype == torch.bfloat16, fp8_opt_level=level, fp8_recipe=recipe,
                        fp8_activations=compressed, implementation="transformers")
    return plan_memory(cfg)["stages"][0]["bytes"]["activations"]


def measure(args, name: str, dtype: torch.dtype, level: str, recipe: str, compressed: bool) -> dict:
    model = build(args, dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fp8.initialize(model, optimizer, level, recipe=recipe)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    ledger = ActivationCompressor() if compressed else ActivationCompressor(dtypes=())
    start = time.perf_counter()
    with ledger:
        loss = model(input_ids=ids, labels=ids).loss
    forward_s = time.perf_counter() - start
    held = memory_report(model, optimizer, activations=ledger)["activations"]
    loss.backward()
    assert ledger.stats.held_bytes == 0, "compressed payloads outlived the backward"
    plan = planned(args, dtype, level, recipe, compressed)
    return {"variant": name, "dtype": str(dtype).replace("torch.", ""), "level": level, "recipe": recipe,
            "fp8_activations": compressed, "held_bytes": held, "held_MiB": held / 2**20,
            "fp8_stored_bytes": ledger.stats.stored_bytes, "compressor": ledger.stats.as_dict(),
            "planned_bytes": plan, "planned_vs_measured": plan / held - 1, "forward_s": forward_s,
            "loss": loss.item()}


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
    bf16 = rows[0]["held_bytes"]
    print(f"bytes held for backward after the forward: Llama hidden {args.hidden}, {args.layers} layers, "
          f"{args.batch} x {args.seq} tokens, vocab {args.vocab}, {args.attn} attention (parameters not counted)")
    print(f"{'variant':<34}{'held MiB':>10}{'vs BF16':>9}{'FP8 MiB':>9}{'stored/saved':>13}{'planned MiB':>13}"
          f"{'planned err':>12}")
    for row in rows:
        row["vs_bf16"] = row["held_bytes"] / bf16
        c = row["compressor"]
        print(f"{row['variant']:<34}{row['held_MiB']:>10.1f}{row['vs_bf16']:>9.3f}{row['fp8_stored_bytes'] / 2**20:>9.1f}"
              f"{c['ratio']:>13.3f}{row['planned_bytes'] / 2**20:>13.1f}{row['planned_vs_measured']:>+12.1%}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"config": vars(args), "rows": rows}, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
