"""``pretrain_gpt.py --dry-run``: build the model of each pipeline stage on the meta device, for the
given layout, with no allocation and no GPU, and print parameters per rank beside the planned memory.

The layout's process groups are stood up in this one process with torch's ``fake`` backend (collectives
do nothing), so megatron-core and fp8lm build exactly the modules a real rank builds.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from .memory_plan import PlannerConfig, plan_memory

__all__ = ["dry_run"]


def _count_stage(args: argparse.Namespace, world: int, rank: int, vocab_size: int) -> int:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..model import build_model, transformer_config_from_args
    from ..training import initialize_model_parallel

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        initialize_model_parallel(args, create_gloo_process_groups=False)
        config = transformer_config_from_args(args, torch.bfloat16 if args.bf16 else torch.float32)
        with torch.device("meta"):
            chunks = build_model(args, config, vocab_size)
        params = sum(p.numel() for c in chunks for p in c.parameters())
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return params


def dry_run(args: argparse.Namespace) -> dict:
    """Validate ``args`` for its layout, build each distinct pipeline stage on the meta device and print
    (and return) parameters per rank with the memory planner's figures."""
    from ..model import padded_vocab_size

    tp, pp, dp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.data_parallel_size
    world = tp * pp * dp
    if args.vocab_size is None and args.tokenizer_model:
        from ..data.tokenizer import SentencePieceTokenizer

        args.vocab_size = SentencePieceTokenizer(args.tokenizer_model).vocab_size
    vocab = padded_vocab_size(args.vocab_size or 50257, args)
    stages = sorted({0, pp - 1})
    # Global rank of (tp 0, dp 0) on pipeline stage s, in megatron-core's default order tp-cp-ep-dp-pp.
    per_stage = {s: _count_stage(args, world, s * tp * dp, vocab) for s in stages}
    for s in range(1, pp - 1):
        per_stage[s] = per_stage.get(s, None)
    # The planner models dense GPT layers, every one with the run's FP8 selection: a mixture-of-experts model gets no
    # plan (its parameters per rank above are counted from the built model), per-layer choices a stated caveat.
    not_modelled = "--num-experts (mixture of experts)" if getattr(args, "num_experts", None) else None
    plan = None if not_modelled else plan_memory(PlannerConfig.from_args(args))
    caveat = ("planned with every transformer layer in FP8: --first-last-layers-bf16 / --fp8-precision-config "
              "choices are not modelled" if (getattr(args, "first_last_layers_bf16", False)
                                             or getattr(args, "fp8_precision_config", None)) else None)
    total = sum(v for v in per_stage.values() if v is not None)
    result = {
        "layout": {"tp": tp, "pp": pp, "dp": dp, "world_size": world, "sequence_parallel": args.sequence_parallel},
        "fp8_opt_level": args.fp8_opt_level,
        "padded_vocab_size": vocab,
        "params_per_rank": {f"stage_{s}": n for s, n in sorted(per_stage.items()) if n is not None},
        "max_params_per_rank": max(v for v in per_stage.values() if v is not None),
        "plan": plan,
        "plan_not_modelled": not_modelled,
        "plan_caveat": caveat,
    }
    print(f"dry run: GPT {args.num_layers} layers x hidden {args.hidden_size}, {args.num_attention_heads} heads, "
          f"seq {args.seq_length}, vocab {vocab}; TP {tp} x PP {pp} x DP {dp} = {world} ranks"
          f"{' + SP' if args.sequence_parallel else ''}; --fp8-opt-level {args.fp8_opt_level}")
    for s, n in sorted(per_stage.items()):
        if n is not None:
            print(f"  pipeline stage {s}: {n:,} parameters per rank")
    if pp > 2:
        print(f"  (stages 1..{pp - 2} hold the same layers as the first stage without its embeddings)")
    if total and pp <= 2:
        print(f"  model total (one replica, summed over TP): {total * tp:,}")
    if not_modelled:
        print(f"  planned memory per GPU: not modelled for {not_modelled} yet")
    if caveat:
        print(f"  note: {caveat}")
    if plan is not None:
        print("  planned memory per GPU:")
        for key, value in plan.get("bytes", {}).items():
            print(f"    {key:<24} {value / 2**30:9.2f} GiB")
        if "total" in plan:
            print(f"    {'total':<24} {plan['total'] / 2**30:9.2f} GiB")
    print("dry run json: " + json.dumps(result, default=str))
    return result
