"""``fp8.initialize`` on tiny random configurations of transformers architectures: the FP8 fraction of the decoder
blocks' weights and the loss of O2 steps against ``opt_level="none"``.

    python benchmarks/transformers_architectures.py [--steps 4] [--arch mixtral qwen2_moe ...] [--json out.json]
    python benchmarks/transformers_architectures.py --steps 100 --batches 3 --seeds 3 --lr 2e-3 --noise-control
    python benchmarks/transformers_architectures.py --steps 100 --batches 3 --seeds 3 --lr 2e-3 \
        --controls bf16 O1 O2-exp-avg-fp16 O2-exp-avg-fp32
    python benchmarks/transformers_architectures.py --data shakespeare --batch 8 --seq 64 --steps 300 --seeds 3 \
        --lr 2e-3 --schedule cosine --warmup 10 --noise-control --controls bf16

With ``--batches N`` the runs cycle N distinct random batches (default 1: one batch, fitted); ``--seeds`` repeats each
architecture per seed. ``--data shakespeare`` draws a fresh batch every step instead: ``--batch`` windows of ``--seq``
bytes from the training split of the byte-level Shakespeare corpus (``megatron.training.data.corpus``; the vocabulary
is 256 bytes, as the configurations'), seeded per seed, so the runs learn a text distribution instead of memorizing
random tokens. ``--schedule cosine`` multiplies a cosine from ``--lr`` at the first step to a tenth of it at the
last by a linear warm-up ramp over the first ``--warmup`` steps (default ``constant``). Reported per run: the last
loss's relative difference, the mean of the last 10 losses' (``last 10``) and the mean over every step's (``curve``);
with ``--noise-control`` also the same figures for a high-precision run whose initial weights are multiplied by
``1 + 1e-4 * N(0, 1)``: how far a run moves from a perturbation far below FP8's rounding, the floor any precision
comparison on these tiny runs stands on. ``--controls`` adds runs that
separate the sources of a gap (:data:`CONTROLS`): BF16 autocast, O1 (FP8 GEMMs, fp32 optimizer), and O2 with its
first moment in FP16 or FP32.

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
import math

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


CONTROLS = {
    "bf16": ("none", {}, True),
    "O1": ("O1", {}, False),
    "O2-exp-avg-fp16": ("O2", {"optimizer_precision": fp8.optim.OptimizerPrecision(exp_avg="fp16")}, False),
    "O2-exp-avg-fp32": ("O2", {"optimizer_precision": fp8.optim.OptimizerPrecision(exp_avg="fp32")}, False),
    "O2-exp-avg-stochastic": ("O2", {"optimizer_precision": fp8.optim.OptimizerPrecision(
        exp_avg_rounding="stochastic")}, False),
}
"""``--controls``: name -> (opt level, ``fp8.initialize`` keywords, bf16 autocast). ``bf16``: the high-precision
model under ``torch.autocast(dtype=torch.bfloat16)`` (BF16 GEMMs, fp32 weights and optimizer); ``O1``: FP8 GEMMs and
weights with torch's fp32 AdamW; ``O2-exp-avg-fp16/fp32``: O2 with its first moment stored in FP16 or FP32 instead of
E4M3; ``O2-exp-avg-stochastic``: O2's E4M3 first moment rounded stochastically."""


SCHEDULES = ("constant", "cosine")


def lr_factor(step: int, steps: int, schedule: str = "constant", warmup: int = 0) -> float:
    """The learning rate of ``step`` (0-based) over ``lr``: 1 for ``constant``; for ``cosine``, a linear warm-up over
    ``warmup`` steps times a cosine from 1 at step 0 to 0.1 at step ``steps - 1``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}: use one of {SCHEDULES}")
    if warmup < 0 or (warmup and schedule == "constant"):
        raise ValueError(f"warmup={warmup}: use warmup >= 0, and only with schedule='cosine'")
    if schedule == "constant":
        return 1.0
    ramp = min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
    return ramp * (0.1 + 0.45 * (1 + math.cos(math.pi * step / max(1, steps - 1))))


def train(model: nn.Module, opt_level: str, batches: list[torch.Tensor], lr: float = 1e-3, bf16: bool = False,
          schedule: str = "constant", warmup: int = 0, **initialize_kwargs) -> tuple[nn.Module, list[float]]:
    """``fp8.initialize`` at ``opt_level``, then one AdamW step per batch at ``lr`` times :func:`lr_factor`; the losses
    before each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model, optimizer = fp8.initialize(model, optimizer, opt_level, **initialize_kwargs)
    losses = []
    for step, tokens in enumerate(batches):
        step_lr = lr * lr_factor(step, len(batches), schedule, warmup)
        for group in optimizer.param_groups:
            group["lr"] = step_lr
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return model, losses


def gaps(losses: list[float], reference: list[float]) -> dict[str, float]:
    """Relative differences of ``losses`` from ``reference``: the last loss, the mean of the last 10, the whole curve."""
    last10 = min(10, len(losses))
    return {"last": losses[-1] / reference[-1] - 1,
            "last10": sum(losses[-last10:]) / sum(reference[-last10:]) - 1,
            "curve": sum(losses) / sum(reference) - 1}


DATA = ("random", "shakespeare")


def token_batches(data: str, steps: int, seed: int, batch: int = 4, seq: int = 32, n_batches: int = 1,
                  vocab_size: int = 256, max_positions: int = 64) -> list[torch.Tensor]:
    """The ``[batch, seq]`` token batch of every step. ``random``: ``n_batches`` distinct uniformly random batches,
    cycled; ``shakespeare``: a fresh batch of byte windows from the corpus's training split every step. Seeded by
    ``seed``."""
    if data not in DATA:
        raise ValueError(f"data={data!r}: use one of {DATA}")
    if seq > max_positions:
        raise ValueError(f"seq={seq} is longer than the configurations' {max_positions} positions: use seq <= "
                         f"{max_positions}")
    generator = torch.Generator().manual_seed(seed + 1)
    if data == "random":
        distinct = [torch.randint(0, vocab_size, (batch, seq), generator=generator) for _ in range(n_batches)]
        return [distinct[i % n_batches] for i in range(steps)]
    if n_batches != 1:
        raise ValueError("data='shakespeare' draws a fresh batch every step: leave --batches out")
    if vocab_size != 256:
        raise ValueError(f"data='shakespeare' is byte-level (256 tokens); the model's vocabulary is {vocab_size}")
    from megatron.training.data.corpus import get_batch, load_corpus

    corpus, _ = load_corpus()
    return [get_batch(corpus, batch, seq, generator)[0] for _ in range(steps)]


def measure(arch: str, steps: int = 4, opt_level: str = "O2", seed: int = 0, batch: int = 4, seq: int = 32,
            n_batches: int = 1, lr: float = 1e-3, noise_control: bool = False, controls: tuple[str, ...] = (),
            data: str = "random", schedule: str = "constant", warmup: int = 0) -> dict:
    """One architecture: FP8 fractions and the loss of ``opt_level`` against ``none`` (module docstring)."""
    lr_factor(0, steps, schedule, warmup)  # refuse a bad schedule before any run
    base = tiny_model(arch, seed)
    batches = token_batches(data, steps, seed, batch, seq, n_batches, base.config.vocab_size,
                            base.config.max_position_embeddings)
    before = old_rule_fraction(base)
    perturbed = copy.deepcopy(base) if noise_control else None
    run = dict(lr=lr, schedule=schedule, warmup=warmup)
    reference, ref_losses = train(copy.deepcopy(base), "none", batches, **run)
    control_gaps = {}
    for name in controls:
        level, kwargs, bf16 = CONTROLS[name]
        control_gaps[name] = gaps(train(copy.deepcopy(base), level, batches, bf16=bf16, **run, **kwargs)[1],
                                  ref_losses)
    model, losses = train(base, opt_level, batches, **run)
    out = {"arch": arch, "opt_level": opt_level, "seed": seed, "fp8_fraction_old_rule": before,
           "fp8_fraction": fp8_fraction(model), "loss_none": ref_losses, f"loss_{opt_level}": losses,
           "final_loss_rel_diff": abs(losses[-1] - ref_losses[-1]) / ref_losses[-1], "gaps": gaps(losses, ref_losses)}
    if controls:
        out["control_gaps"] = control_gaps
    if noise_control:
        g = torch.Generator().manual_seed(seed + 2)
        with torch.no_grad():
            for p in perturbed.parameters():
                p.mul_(1 + 1e-4 * torch.randn(p.shape, generator=g))
        _, noisy = train(perturbed, "none", batches, **run)
        out["noise_gaps"] = gaps(noisy, ref_losses)
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", nargs="+", default=list(ARCHITECTURES), choices=ARCHITECTURES)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--opt-level", default="O2")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--batches", type=int, default=1, help="distinct random batches, cycled (1: one, fitted)")
    parser.add_argument("--data", default="random", choices=DATA,
                        help="random: --batches random batches, cycled; shakespeare: a fresh corpus batch every step")
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch")
    parser.add_argument("--seq", type=int, default=32, help="tokens per sequence (at most 64)")
    parser.add_argument("--schedule", default="constant", choices=SCHEDULES,
                        help="cosine: a cosine from lr down to lr / 10 at the last step, times a linear ramp "
                             "over --warmup steps")
    parser.add_argument("--warmup", type=int, default=0, help="warm-up steps (with --schedule cosine)")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--noise-control", action="store_true",
                        help="also a high-precision run from weights perturbed by 1e-4 relative")
    parser.add_argument("--controls", nargs="+", default=[], choices=list(CONTROLS),
                        help="also these runs against none (last 10 and curve): " + ", ".join(CONTROLS))
    args = parser.parse_args(argv)
    try:  # refuse a bad schedule before any model is built
        lr_factor(0, args.steps, args.schedule, args.warmup)
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    results = [measure(arch, args.steps, args.opt_level, seed, args.batch, args.seq, n_batches=args.batches,
                       lr=args.lr, noise_control=args.noise_control, controls=tuple(args.controls), data=args.data,
                       schedule=args.schedule, warmup=args.warmup)
               for arch in args.arch for seed in range(args.seeds)]
    print(f"{'architecture':<12} {'seed':>4} {'FP8 (old rule)':>14} {'FP8 now':>8} {'loss none':>10} "
          f"{'loss ' + args.opt_level:>9} {'last':>7} {'last 10':>8} {'curve':>7}"
          + (f" {'noise: last 10':>15} {'curve':>7}" if args.noise_control else "")
          + "".join(f" {name + ': last 10':>25} {'curve':>7}" for name in args.controls))
    for r in results:
        g = r["gaps"]
        line = (f"{r['arch']:<12} {r['seed']:>4} {r['fp8_fraction_old_rule']:>14.1%} {r['fp8_fraction']:>8.1%} "
                f"{r['loss_none'][-1]:>10.4f} {r['loss_' + args.opt_level][-1]:>9.4f} {g['last']:>+7.2%} "
                f"{g['last10']:>+8.2%} {g['curve']:>+7.2%}")
        if args.noise_control:
            line += f" {r['noise_gaps']['last10']:>+15.2%} {r['noise_gaps']['curve']:>+7.2%}"
        for name in args.controls:
            line += f" {r['control_gaps'][name]['last10']:>+25.2%} {r['control_gaps'][name]['curve']:>+7.2%}"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
