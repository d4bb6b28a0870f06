"""``pretrain_gpt.py --dry-run``: build the model of each pipeline stage on the meta device, for the
given layout, with no allocation and no GPU, and print parameters per rank beside the planned memory (with
``--num-experts``, also the mixture-of-experts figures: parameters in routed experts, the expert-parallel
all-to-all's bytes per step).

The layout's process groups are stood up in this one process with torch's ``fake`` backend (collectives
do nothing), so megatron-core and fp8lm build exactly the modules a real rank builds.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from ..config import RunConfig
from .memory_plan import PlannerConfig, format_moe, plan_memory

__all__ = ["dry_run"]


def _count_stage(cfg: RunConfig, world: int, rank: int, vocab_size: int) -> tuple[int, int]:
    """(parameters, of those in routed experts) that global rank ``rank`` builds."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..model import build_model, transformer_config_from_args
    from ..training import initialize_model_parallel

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        initialize_model_parallel(cfg.parallel, create_gloo_process_groups=False)
        config = transformer_config_from_args(cfg, torch.bfloat16 if cfg.precision.bf16 else torch.float32)
        with torch.device("meta"):
            chunks = build_model(cfg, config, vocab_size)
        named = [(name, p) for c in chunks for name, p in c.named_parameters()]
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    return sum(p.numel() for _, p in named), sum(p.numel() for name, p in named if ".mlp.experts." in name)


def dry_run(cfg: RunConfig) -> dict:
    """Validate ``cfg`` for its layout, build each distinct pipeline stage on the meta device and print
    (and return) parameters per rank with the memory planner's figures."""
    from ..model import padded_vocab_size

    par = cfg.parallel
    tp, pp, dp = par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.data_parallel_size
    world = tp * pp * dp
    if cfg.model.vocab_size is None and cfg.data.tokenizer_model:
        from ..data.tokenizer import SentencePieceTokenizer

        cfg = cfg.replace(model={"vocab_size": SentencePieceTokenizer(cfg.data.tokenizer_model).vocab_size})
    vocab = padded_vocab_size(cfg.model.vocab_size or 50257, cfg)
    stages = sorted({0, pp - 1})
    # Global rank of (tp 0, dp 0) on pipeline stage s, in megatron-core's default order tp-cp-ep-dp-pp.
    counted = {s: _count_stage(cfg, world, s * tp * dp, vocab) for s in stages}
    per_stage = {s: n for s, (n, _) in counted.items()}
    for s in range(1, pp - 1):
        per_stage[s] = per_stage.get(s, None)
    # The planner gives every transformer layer the run's FP8 selection (per-layer choices: a stated caveat) and
    # routes tokens uniformly over the experts (mixture of experts).
    plan = plan_memory(PlannerConfig.from_run_config(cfg))
    caveats = []
    if cfg.precision.first_last_layers_bf16 or cfg.precision.fp8_precision_config:
        caveats.append("planned with every transformer layer in FP8: --first-last-layers-bf16 / --fp8-precision-config "
                       "choices are not modelled")
    ep = cfg.parallel.expert_model_parallel_size or 1
    if plan["moe"] is not None:
        caveats.append("mixture of experts planned with uniform routing (every expert receives topk / experts of the "
                       "routed tokens); a router that favours some experts raises their ranks' activations and traffic")
        if cfg.moe.moe_grouped_gemm:
            caveats.append("--moe-grouped-gemm: activations planned as megatron-core's SequentialMLP's (a rank's experts "
                           "one after the other; the grouped GEMM's saved tensors and token padding are not modelled)")
        if ep > 1 and cfg.moe.moe_token_dispatcher_type != "alltoall":
            caveats.append("--moe-token-dispatcher-type allgather: its all-gather of the tokens over the tensor x "
                           "expert-parallel group is not counted (no all-to-all bytes)")
    caveat = "; ".join(caveats) or None
    total = sum(v for v in per_stage.values() if v is not None)
    result = {
        "layout": {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "world_size": world,
                   "sequence_parallel": cfg.parallel.sequence_parallel},
        "fp8_opt_level": cfg.precision.fp8_opt_level,
        "padded_vocab_size": vocab,
        "params_per_rank": {f"stage_{s}": n for s, n in sorted(per_stage.items()) if n is not None},
        "max_params_per_rank": max(v for v in per_stage.values() if v is not None),
        "expert_params_per_rank": ({f"stage_{s}": e for s, (_, e) in sorted(counted.items())}
                                   if plan["moe"] is not None else None),
        "plan": plan,
        "plan_caveat": caveat,
    }
    m = cfg.model
    print(f"dry run: GPT {m.num_layers} layers x hidden {m.hidden_size}, {m.num_attention_heads} heads, "
          f"seq {m.seq_length}, vocab {vocab}; TP {tp} x PP {pp} x DP {dp} = {world} ranks"
          f"{' + SP' if cfg.parallel.sequence_parallel else ''}{f', EP {ep}' if ep > 1 else ''}; "
          f"--fp8-opt-level {cfg.precision.fp8_opt_level}")
    for s, n in sorted(per_stage.items()):
        if n is not None:
            experts = f" ({counted[s][1]:,} in routed experts)" if plan["moe"] is not None else ""
            print(f"  pipeline stage {s}: {n:,} parameters per rank{experts}")
            if n != plan["stages"][s]["params"]:
                print(f"  note: the memory planner counts {plan['stages'][s]['params']:,} parameters on stage {s}")
    if pp > 2:
        print(f"  (stages 1..{pp - 2} hold the same layers as the first stage without its embeddings)")
    if plan["moe"] is not None:  # the expert-parallel ranks hold different experts: the planner's total
        print(f"  model total (planner, every expert once): {plan['params_total']:,}")
    elif total and pp <= 2:
        print(f"  model total (one replica, summed over TP): {total * tp:,}")
    if caveat:
        print(f"  note: {caveat}")
    print(f"  planned memory per GPU (worst: pipeline stage {plan['worst_stage']}):")
    for key, value in plan["bytes"].items():
        print(f"    {key:<24} {value / 2**30:9.2f} GiB")
    print(f"    {'total':<24} {plan['total_gib']:9.2f} GiB")
    for line in format_moe(plan):
        print(f"  {line}")
    print("dry run json: " + json.dumps(result, default=str))
    return result
