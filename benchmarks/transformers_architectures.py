"""``fp8.initialize`` on tiny random configurations of transformers architectures: the FP8 fraction of the decoder
blocks' weights and the loss after a few O2 steps against ``opt_level="none"``.

    python benchmarks/transformers_architectures.py [--steps 4] [--arch mixtral qwen2_moe ...] [--json out.json]

FP8 fraction: elements of the blocks' matrices (parameters with >= 2 dims in the model's decoder-layer list) held as
FP8 after ``fp8.initialize``, over all of them. ``old rule``: the fraction the converter reached before MoE experts and
``nn.Linear`` subclasses were converted (exact ``nn.Linear`` layers with dimensions multiples of 16), counted on the
unconverted model. Both runs start from the same weights and fit the same random token batch, one AdamW step
(lr 1e-3) per step.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging

import torch
from torch import nn

import fp8


def _configs() -> dict[str, tuple[str, dict]]:
    """name -> (transformers config class, keyword arguments): tiny, dimensions multiples of 16."""
    common = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    return {
        "mixtral": ("MixtralConfig", dict(common, num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
                                          num_experts_per_tok=2)),
        "qwen2_moe": ("Qwen2MoeConfig", dict(common, num_key_value_heads=2, intermediate_size=64,
                                             moe_intermediate_size=32, shared_expert_intermediate_size=64,
                                             num_experts=4, num_experts_per_tok=2)),
        "qwen3_moe": ("Qwen3MoeConfig", dict(common, num_key_value_heads=2, head_dim=16, intermediate_size=64,
                                             moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
        "falcon": ("FalconConfig", dict(common, new_decoder_architecture=False, multi_query=True, parallel_attn=True,
                                        bias=False, alibi=False)),
    }


ARCHITECTURES = tuple(_configs())


def tiny_model(arch: str, seed: int = 0) -> nn.Module:
    """A tiny random ``AutoModelForCausalLM`` of ``arch`` (:data:`ARCHITECTURES`) in float32, eager attention."""
    import transformers

    class_name, kwargs = _configs()[arch]
    config = getattr(transformers, class_name)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def decoder_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's decoder-layer list (its largest ``nn.ModuleList``)."""
    return max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=lambda m: len(list(m.parameters())))


def fp8_fraction(model: nn.Module) -> float:
    """FP8 elements of the decoder blocks' matrices over all of them."""
    weights = [p for p in decoder_blocks(model).parameters() if p.dim() >= 2]
    return sum(p.numel() for p in weights if isinstance(p, fp8.Float8Tensor)) / sum(p.numel() for p in weights)


def old_rule_fraction(model: nn.Module) -> float:
    """On an unconverted model: the fraction the converter reached with exact ``nn.Linear`` layers only."""
    blocks = decoder_blocks(model)
    weights = [p for p in blocks.parameters() if p.dim() >= 2]
    linear = [m.weight for m in blocks.modules() if type(m) is nn.Linear
              and not (m.in_features % 16 or m.out_features % 16)]
    return sum(p.numel() for p in linear) / sum(p.numel() for p in weights)


def train(model: nn.Module, opt_level: str, batches: list[torch.Tensor], lr: float = 1e-3) -> tuple[nn.Module, list[float]]:
    """``fp8.initialize`` at ``opt_level``, then one AdamW step per batch; the losses before each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model, optimizer = fp8.initialize(model, optimizer, opt_level)
    losses = []
    for tokens in batches:
        loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return model, losses


def measure(arch: str, steps: int = 4, opt_level: str = "O2", seed: int = 0, batch: int = 4, seq: int = 32) -> dict:
    """One architecture: FP8 fractions and the loss of ``opt_level`` against ``none``."""
    base = tiny_model(arch, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    batches = [torch.randint(0, base.config.vocab_size, (batch, seq), generator=generator)] * steps  # one batch, fitted
    before = old_rule_fraction(base)
    reference, ref_losses = train(copy.deepcopy(base), "none", batches)
    model, losses = train(base, opt_level, batches)
    return {"arch": arch, "opt_level": opt_level, "fp8_fraction_old_rule": before, "fp8_fraction": fp8_fraction(model),
            "loss_none": ref_losses, f"loss_{opt_level}": losses,
            "final_loss_rel_diff": abs(losses[-1] - ref_losses[-1]) / ref_losses[-1]}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=list(ARCHITECTURES), choices=ARCHITECTURES)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--opt-level", default="O2")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    results = [measure(arch, args.steps, args.opt_level) for arch in args.arch]
    print(f"{'architecture':<12} {'FP8 (old rule)':>14} {'FP8 now':>8} {'loss none':>10} {'loss ' + args.opt_level:>9} {'rel':>7}")
    for r in results:
        print(f"{r['arch']:<12} {r['fp8_fraction_old_rule']:>14.1%} {r['fp8_fraction']:>8.1%} {r['loss_none'][-1]:>10.4f} "
              f"{r['loss_' + args.opt_level][-1]:>9.4f} {r['final_loss_rel_diff']:>7.2%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
