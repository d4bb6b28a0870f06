"""Validate tools/memory_planner.py against memory actually held, on small GPTs run here on CPU.

    python benchmarks/planner_validation.py [--json benchmarks/results/planner_validation.json] [--dp-worlds 2]

For each case (a model builder plus its ``PlannerConfig``) and opt level:

- model state: ``fp8.memory_report`` right after the second step's backward (what the optimizer step
  sees), per category, against the planner's weights / master weights / gradients / optimizer states /
  FP8 scaling metadata; O3 on ``--dp-worlds`` gloo processes, after the FP8 reduce-to-owner (worst rank);
- activations: bytes of the tensors autograd saves for backward during one forward
  (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once, parameters excluded),
  against the planner's activation figure. With full recomputation (each block under a reentrant
  ``torch.utils.checkpoint``) the measure is the forward's saved bytes plus one block's recomputed
  saved bytes (those saved during backward / layers).

Prints a table with the error (planner - measured) / measured and writes JSON.

Plugging another model in (e.g. Megatron GPTModel layouts with TP/PP): append a :class:`Case` to the
list returned by a factory registered with :func:`register_cases`; ``measure_state``/``measure_activations``
accept any ``nn.Module`` whose loss a ``loss_fn(model)`` returns. Distributed layouts measure on every rank
and report the worst, as :func:`_dp_worker` does for O3.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import fp8  # noqa: E402
from examples.tiny_gpt import GPTConfig, TinyGPT  # noqa: E402
from fp8.tensor import Float8Tensor  # noqa: E402
from tools.memory_planner import PlannerConfig, plan_memory  # noqa: E402

STATE_KEYS = {  # planner category -> fp8.memory_report category
    "weights": "weights", "master_weights": "master weights", "gradients": "weight gradients",
    "optimizer_states": "optimizer states", "fp8_scaling_metadata": "FP8 scaling metadata",
}
LEVELS = ("none", "none-bf16", "O1", "O2")


@dataclass(frozen=True)
class Case:
    """A model to validate: ``build()`` returns a fresh model (seeded by the caller), ``loss_fn(model)``
    one micro-batch's loss, ``planner`` the matching ``PlannerConfig`` (any level; replaced per run),
    ``recompute(model)`` returns the model with each layer under full recomputation (None: not supported)."""

    name: str
    build: Callable[[], nn.Module]
    loss_fn: Callable[[nn.Module], torch.Tensor]
    planner: PlannerConfig
    recompute: Callable[[nn.Module], nn.Module] | None = None


_FACTORIES: list[Callable[[], list[Case]]] = []


def register_cases(factory: Callable[[], list[Case]]) -> Callable[[], list[Case]]:
    """Register a factory of :class:`Case` objects (usable as a decorator)."""
    _FACTORIES.append(factory)
    return factory


class _Checkpointed(nn.Module):
    """Runs ``block`` under reentrant activation checkpointing (only its input is saved)."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=True)


def _recompute_tiny(model: nn.Module) -> nn.Module:
    model.blocks = nn.ModuleList(_Checkpointed(b) for b in model.blocks)
    return model


def tiny_case(d_model: int, n_layer: int, n_head: int, seq: int, batch: int, vocab: int = 256) -> Case:
    """examples/tiny_gpt.py's TinyGPT (untied LM head converted to FP8 too, no dropout, FP32 on CPU)."""
    cfg = GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=n_layer, d_model=d_model, n_head=n_head)
    idx = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(idx, -1, dims=1)

    def loss_fn(model: nn.Module) -> torch.Tensor:
        return model(idx, targets)[1].float()

    planner = PlannerConfig(
        num_layers=n_layer, hidden_size=d_model, num_attention_heads=n_head, seq_length=seq, vocab_size=vocab,
        make_vocab_size_divisible_by=1, untie_embeddings_and_output_weights=True, micro_batch_size=batch,
        hidden_dropout=0.0, fp8_output_layer=True, bf16=False,
    )
    return Case(f"TinyGPT L{n_layer} d{d_model} s{seq} b{batch}", lambda: TinyGPT(cfg), loss_fn, planner, _recompute_tiny)


@register_cases
def default_cases() -> list[Case]:
    """Two TinyGPT shapes (d_model 128 and 256)."""
    return [tiny_case(128, 4, 4, 128, 8), tiny_case(256, 6, 8, 256, 4)]


def _setup(case: Case, level: str) -> tuple[nn.Module, torch.optim.Optimizer, PlannerConfig]:
    model = case.build()
    if level == "none-bf16":  # BF16 mixed precision: BF16 weights and grads, FP32 master and AdamW states
        model = model.to(torch.bfloat16)
        return model, fp8.optim.AdamW(model.parameters(), lr=1e-4, precision="O1"), replace(case.planner, bf16=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = fp8.initialize(model, optimizer, opt_level="O0" if level == "none" else level)
    return model, optimizer, replace(case.planner, fp8_opt_level=level)


def measure_state(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, wrapped: nn.Module | None = None,
                  before_step: Callable[[], None] | None = None) -> dict[str, int]:
    """``fp8.memory_report`` right after the second step's backward."""
    for step in range(2):
        loss_fn(wrapped or model).backward()
        if step == 1:
            report = fp8.memory_report(model, optimizer)
        if before_step is not None:
            before_step()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return report


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def _tensors(t: torch.Tensor) -> list[torch.Tensor]:
    return [t.payload, t.scale] if isinstance(t, Float8Tensor) else [t]


def measure_activations(model: nn.Module, loss_fn, n_layers: int | None = None) -> dict[str, int]:
    """Bytes of tensors saved for backward during one forward (storage-deduplicated, parameters and
    buffers excluded); with ``n_layers``, also the bytes saved during backward / n_layers (one layer's
    recomputation under checkpointing). Keys ``forward``, ``recompute_per_layer``, ``total``."""
    excluded = {_storage_key(x) for p in [*model.parameters(), *model.buffers()] for x in _tensors(p.data)}
    seen: set[tuple[int, int]] = set()
    alive: list[torch.Tensor] = []  # keeps counted storages alive, so freed addresses are not reused
    counted = {"bytes": 0}

    def pack(t: torch.Tensor):
        for x in _tensors(t):
            key = _storage_key(x)
            if key not in excluded and key not in seen and key[0] != 0:
                seen.add(key)
                alive.append(x)
                counted["bytes"] += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model)
        forward = counted["bytes"]
        seen.clear()
        counted["bytes"] = 0
        loss.backward()
        recompute = counted["bytes"] // n_layers if n_layers else 0
        alive.clear()
    model.zero_grad(set_to_none=True)
    return {"forward": forward, "recompute_per_layer": recompute, "total": forward + recompute}


def _error(planned: float, measured: float) -> float | None:
    return None if measured == 0 else (planned - measured) / measured


def validate_case(case: Case, levels=LEVELS) -> list[dict]:
    """Rows of planner vs measured for one case: model state per level, activations per level and recompute."""
    rows = []
    for level in levels:
        torch.manual_seed(0)
        model, optimizer, planner = _setup(case, level)
        report = measure_state(model, optimizer, case.loss_fn)
        plan = plan_memory(planner)
        for key, category in STATE_KEYS.items():
            rows.append({"case": case.name, "level": level, "dp": 1, "what": key,
                         "planned": plan["bytes"][key], "measured": report[category]})
        planned_state = sum(plan["bytes"][k] for k in STATE_KEYS)
        rows.append({"case": case.name, "level": level, "dp": 1, "what": "model state",
                     "planned": planned_state, "measured": report["total"]})
        if level == "none-bf16":
            continue  # BF16 on CPU is slow; activations are validated in FP32 (hp = 4) and FP8
        for recompute in ("none", "full") if case.recompute else ("none",):
            torch.manual_seed(0)
            model, _, planner = _setup(case, level)
            if recompute == "full":
                model = case.recompute(model)
            measured = measure_activations(model, case.loss_fn, planner.num_layers if recompute == "full" else None)
            planned = plan_memory(replace(planner, recompute_granularity=recompute))["bytes"]["activations"]
            rows.append({"case": case.name, "level": level, "dp": 1, "what": f"activations (recompute {recompute})",
                         "planned": planned, "measured": measured["total"]})
    for row in rows:
        row["error"] = _error(row["planned"], row["measured"])
    return rows


def _load_factory(path: str) -> Callable[[], list[Case]]:
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def small_cases() -> list[Case]:
    """A 2-layer d_model 64 TinyGPT (the tests' case)."""
    return [tiny_case(64, 2, 4, 32, 2)]


def _dp_worker(rank: int, world: int, port: int, factory: str, case_index: int, out: str) -> None:
    import torch.distributed as dist

    import fp8.distributed as fd

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    case = _load_factory(factory)()[case_index]
    torch.manual_seed(0)
    model = case.build()
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-4), opt_level="O3")
    report = measure_state(model, optimizer, case.loss_fn, wrapped=fd.DistributedDataParallel(model))
    torch.save(report, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def validate_o3(case_index: int, world: int, factory: str = "benchmarks.planner_validation:all_cases") -> list[dict]:
    """O3 over ``world`` gloo processes: worst rank's model state vs the planner at DP=world, for case
    ``case_index`` of ``factory`` ("module:function" returning cases, importable in the spawned processes)."""
    import torch.multiprocessing as mp

    case = _load_factory(factory)()[case_index]
    with tempfile.TemporaryDirectory() as out, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        mp.spawn(_dp_worker, args=(world, port, factory, case_index, out), nprocs=world, join=True)
        reports = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]
    worst = max(reports, key=lambda r: r["total"])
    plan = plan_memory(replace(case.planner, fp8_opt_level="O3", data_parallel_size=world))
    rows = [{"case": case.name, "level": "O3", "dp": world, "what": key, "planned": plan["bytes"][key],
             "measured": worst[category]} for key, category in STATE_KEYS.items()]
    rows.append({"case": case.name, "level": "O3", "dp": world, "what": "model state",
                 "planned": sum(plan["bytes"][k] for k in STATE_KEYS), "measured": worst["total"]})
    for row in rows:
        row["error"] = _error(row["planned"], row["measured"])
    return rows


def all_cases() -> list[Case]:
    """Every registered case, in registration order."""
    return [case for factory in _FACTORIES for case in factory()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="benchmarks/results/planner_validation.json")
    parser.add_argument("--dp-worlds", default="2", help="O3 data-parallel sizes ('' skips)")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = []
    for index, case in enumerate(all_cases()):
        rows += validate_case(case)
        for world in [int(w) for w in args.dp_worlds.split(",") if w]:
            rows += validate_o3(index, world)
    print(f"{'case':<28} {'level':<10} {'dp':>2}  {'quantity':<30} {'planned':>13} {'measured':>13} {'error':>8}")
    for r in rows:
        err = "-" if r["error"] is None else f"{100 * r['error']:+.2f}%"
        print(f"{r['case']:<28} {r['level']:<10} {r['dp']:>2}  {r['what']:<30} {r['planned']:>13,} {r['measured']:>13,} {err:>8}")
    errors = [abs(r["error"]) for r in rows if r["error"] is not None and r["what"] == "model state"]
    act = [abs(r["error"]) for r in rows if r["error"] is not None and r["what"].startswith("activations")]
    summary = {"max_abs_error_model_state": max(errors, default=0.0), "max_abs_error_activations": max(act, default=0.0)}
    print(f"max |error|: model state {100 * summary['max_abs_error_model_state']:.2f}%, "
          f"activations {100 * summary['max_abs_error_activations']:.2f}%")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
