"""Validate tools/memory_planner.py against memory actually held, on small GPTs run here on CPU.

    python benchmarks/planner_validation.py [--json benchmarks/results/planner_validation.json] [--dp-worlds 2]

For each case (a model builder plus its ``PlannerConfig``) and opt level:

- model state: ``fp8.memory_report`` right after the second step's backward (what the optimizer step
  sees), per category, against the planner's weights / master weights / gradients / optimizer states /
  FP8 scaling metadata; O3 on ``--dp-worlds`` gloo processes, after the FP8 reduce-to-owner (worst rank);
- activations: bytes of the tensors autograd saves for backward during one forward
  (``torch.autograd.graph.saved_tensors_hooks``, each storage counted once, parameters excluded),
  against the planner's activation figure. With full recomputation (each block under a reentrant
  ``torch.utils.checkpoint``) the measure is the peak over forward and backward (every saved storage
  counted once while autograd holds it: the layer inputs plus one block recomputed, or the head).

Megatron GPT (the product model, :data:`MEGATRON_CASES`): megatron-core's ``GPTModel`` built by fp8lm and
trained by ``megatron.training.training.TrainingRun`` as ``pretrain_gpt.py`` does, one ``torchrun`` launch (gloo)
per world size (2 and 4) looping over layouts (TP=2, TP=2+SP, PP=2, DP=2, TP=2 x PP=2 + SP, DP=2 x TP=2 +
SP, DP=2 x PP=2), levels none/O1/O2 (and O3 where DP > 1), with and without ``--recompute-activations``;
every rank compares the planner (``PlannerConfig.from_args`` on the run's own argparse namespace; its
pipeline stage and, at O3, its data-parallel shard) with ``fp8.memory_report`` before the optimizer step of
the second iteration and with the peak of saved-activation bytes over that iteration's whole pipeline
schedule (1F1B: the first stage holds PP micro-batches at once; the planner's per-stage figure counts
them). See benchmarks/planner_validation_megatron.py (the worker).

Prints a table (case, layout, level, rank, category, planned, measured, error = (planned - measured) /
measured) and writes JSON with a ``summary`` (max |error| per model and category).

Plugging another single-process model in: append a :class:`Case` to the list returned by a factory
registered with :func:`register_cases`; ``measure_state``/``measure_activations`` accept any ``nn.Module``
whose loss a ``loss_fn(model)`` returns.
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
from fp8.cast import payload_and_scale  # noqa: E402
from fp8.comm import Collectives  # noqa: E402
from fp8.testing import GPTConfig, TinyGPT  # noqa: E402
from megatron.training.planning.memory_plan import PlannerConfig, plan_memory  # noqa: E402

STATE_KEYS = {  # planner category -> fp8.memory_report category (absent from a report: 0 bytes held)
    "weights": "weights", "master_weights": "master weights", "gradients": "weight gradients",
    "optimizer_states": "optimizer states", "fp8_scaling_metadata": "FP8 scaling metadata",
    "weight_transposes": "weight transposes",
}
LEVELS = ("none", "none-bf16", "O1", "O2")
SCALED_MM = "O2 scaled_mm"
"""A level of :func:`validate_case` besides :data:`LEVELS`: O2 with ``gemm_backend="scaled_mm"`` (CPU ``torch._scaled_mm``,
a slow reference loop: small cases only), whose FP8 weights keep their transposes (``weight_transposes``)."""


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
    """fp8.testing's TinyGPT (untied LM head converted to FP8 too, no dropout, FP32 on CPU)."""
    cfg = GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=n_layer, d_model=d_model, n_head=n_head)
    idx = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(idx, -1, dims=1)

    def loss_fn(model: nn.Module) -> torch.Tensor:
        return model(idx, targets)[1].float()

    planner = PlannerConfig(
        num_layers=n_layer, hidden_size=d_model, num_attention_heads=n_head, seq_length=seq, vocab_size=vocab,
        make_vocab_size_divisible_by=1, untie_embeddings_and_output_weights=True, micro_batch_size=batch,
        hidden_dropout=0.0, fp8_output_layer=True, bf16=False, gemm_device="cpu",
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
    if level == SCALED_MM:
        model, optimizer = fp8.initialize(model, optimizer, opt_level="O2",
                                          config=fp8.Float8LinearConfig(gemm_backend="scaled_mm"))
        return model, optimizer, replace(case.planner, fp8_opt_level="O2", fp8_gemm_backend="scaled_mm")
    model, optimizer = fp8.initialize(model, optimizer, opt_level=level)
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


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The storages behind ``t``: a scaled tensor's (Float8Tensor, ScaledFloat16Tensor) payload and scale, else ``t``."""
    parts = payload_and_scale(t)
    return list(parts) if parts is not None else [t]


class _Held:
    """What :class:`SavedBytesTracker`'s pack hook hands autograd: the saved tensor; it takes its storages
    off the tally when autograd drops it (after the backward that used it)."""

    __slots__ = ("tensor", "keys", "tracker")

    def __init__(self, tensor: torch.Tensor, keys: list, tracker: SavedBytesTracker) -> None:
        self.tensor, self.keys, self.tracker = tensor, keys, tracker

    def __del__(self) -> None:
        self.tracker.release(self.keys)


class SavedBytesTracker:
    """Bytes of the tensors autograd holds saved for backward: ``live`` now and ``peak`` so far, each storage
    counted once while any saved reference to it is alive (a held reference keeps the storage, so its
    address cannot be reused meanwhile); ``excluded`` storages (parameters, buffers) are not counted. A
    context manager (``torch.autograd.graph.saved_tensors_hooks``) to put around forward and backward;
    with activation recomputation the tensors saved while recomputing in backward count too."""

    def __init__(self, excluded: set, compressor=None) -> None:
        self.excluded = excluded
        self.refs: dict[tuple[int, int], int] = {}
        self.live = 0
        self.peak = 0
        self.compressor = compressor
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def unpack(self, held: _Held) -> torch.Tensor:
        return held.tensor if self.compressor is None else self.compressor.unpack(held.tensor)

    def pack(self, t: torch.Tensor) -> _Held:
        """Count what is held: ``t``, or with a ``compressor`` (``fp8.activations.ActivationCompressor``, taken
        off the model) what it stores for ``t`` (an FP8 payload and its scales, or ``t`` left alone)."""
        keys = []
        if self.compressor is not None:
            t = self.compressor.pack(t)
        stored = [t.payload, t.scales] if hasattr(t, "scales") else plain_tensors(t)
        for x in stored:
            key = storage_key(x)
            if key[0] == 0 or key in self.excluded:
                continue
            n = self.refs.get(key, 0)
            if n == 0:
                self.live += key[1]
                self.peak = max(self.peak, self.live)
            self.refs[key] = n + 1
            keys.append(key)
        return _Held(t, keys, self)

    def release(self, keys: list) -> None:
        for key in keys:
            n = self.refs[key] - 1
            if n:
                self.refs[key] = n
            else:
                del self.refs[key]
                self.live -= key[1]

    def __enter__(self) -> SavedBytesTracker:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def measure_activations(model: nn.Module, loss_fn, n_layers: int | None = None) -> dict[str, int]:
    """Bytes of tensors autograd holds saved for backward over one forward and backward (storage-deduplicated,
    parameters and buffers excluded, :class:`SavedBytesTracker`). Keys ``forward`` (held at the end of the
    forward) and ``total`` (the peak over forward and backward: with full recomputation, the layer inputs
    plus the larger of the head's tensors and one layer recomputed). ``n_layers`` is accepted for
    compatibility and unused."""
    excluded = {storage_key(x) for p in [*model.parameters(), *model.buffers()] for x in plain_tensors(p.data)}
    with SavedBytesTracker(excluded) as tracker:
        loss = loss_fn(model)
        forward = tracker.live
        loss.backward()
        del loss
    model.zero_grad(set_to_none=True)
    return {"forward": forward, "total": tracker.peak}


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
                         "planned": plan["bytes"][key], "measured": report.get(category, 0)})
        planned_state = sum(plan["bytes"][k] for k in STATE_KEYS)
        rows.append({"case": case.name, "level": level, "dp": 1, "what": "model state",
                     "planned": planned_state, "measured": report["total"]})
        if level in ("none-bf16", SCALED_MM):
            continue  # BF16 on CPU is slow; activations are validated in FP32 (hp = 4) and FP8 (the GEMM changes none)
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
    report = measure_state(model, optimizer, case.loss_fn, wrapped=fd.DistributedDataParallel(model, o3_optimizer=optimizer))
    torch.save(report, os.path.join(out, f"rank{rank}.pt"))
    Collectives().barrier("benchmark")
    dist.destroy_process_group()


def validate_o3(case_index: int, world: int, factory: str = "benchmarks.planner_validation:all_cases") -> list[dict]:
    """O3 over ``world`` gloo processes: worst rank's model state vs the planner at DP=world, for case
    ``case_index`` of ``factory`` ("module:function" returning cases, importable in the spawned processes)."""
    from benchmarks.launch import spawn

    case = _load_factory(factory)()[case_index]
    with tempfile.TemporaryDirectory() as out, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        spawn(_dp_worker, (world, port, factory, case_index, out), world)
        reports = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]
    worst = max(reports, key=lambda r: r["total"])
    plan = plan_memory(replace(case.planner, fp8_opt_level="O3", data_parallel_size=world))
    rows = [{"case": case.name, "level": "O3", "dp": world, "what": key, "planned": plan["bytes"][key],
             "measured": worst.get(category, 0)} for key, category in STATE_KEYS.items()]
    rows.append({"case": case.name, "level": "O3", "dp": world, "what": "model state",
                 "planned": sum(plan["bytes"][k] for k in STATE_KEYS), "measured": worst["total"]})
    for row in rows:
        row["error"] = _error(row["planned"], row["measured"])
    return rows


_TP2, _PP2, _SP = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"], ["--sequence-parallel"]
_FULL = ["none", "O1", "O2"]
MEGATRON_CASES: dict[int, list[dict]] = {
    2: [
        {"name": "tp2", "layout": "TP=2", "flags": _TP2, "levels": _FULL, "recompute": [False, True]},
        {"name": "tp2sp", "layout": "TP=2+SP", "flags": _TP2 + _SP, "levels": _FULL, "recompute": [False, True]},
        {"name": "pp2", "layout": "PP=2", "flags": _PP2, "levels": _FULL, "recompute": [False, True]},
        {"name": "dp2", "layout": "DP=2", "flags": [], "levels": [*_FULL, "O3"], "recompute": [False, True]},
        {"name": "dp2zero", "layout": "DP=2 ZeRO-1", "flags": ["--use-distributed-optimizer"], "levels": ["none"],
         "recompute": [False]},
        {"name": "tp2bf16", "layout": "TP=2 --bf16", "flags": _TP2 + ["--bf16"], "levels": ["none", "O2"],
         "recompute": [False]},
    ],
    4: [
        {"name": "tp2pp2sp", "layout": "TP=2 x PP=2+SP", "flags": _TP2 + _PP2 + _SP, "levels": _FULL,
         "recompute": [False, True]},
        {"name": "dp2tp2sp", "layout": "DP=2 x TP=2+SP", "flags": _TP2 + _SP, "levels": [*_FULL, "O3"],
         "recompute": [False, True]},
        {"name": "dp2pp2", "layout": "DP=2 x PP=2 untied", "flags": _PP2 + ["--untie-embeddings-and-output-weights"],
         "levels": ["none", "O2", "O3"], "recompute": [False, True]},
    ],
}
"""Megatron layouts per world size. The model (benchmarks/planner_validation_megatron.py ``MODEL``): 4 layers,
hidden 64, 4 heads, ffn 256, seq 64, micro-batch 4, vocabulary 512, FP32 on CPU, two micro-batches per
step. ``dp2zero`` (the BF16 baseline's ``--use-distributed-optimizer``) and ``tp2bf16`` (``--bf16``: FP32
parameters under autocast) show known modelling gaps (docs/scale.md) and are summarised apart."""
GAP_CASES = ("dp2zero", "tp2bf16")


def validate_megatron(world: int, cases: list[dict], timeout: float = 1800) -> list[dict]:
    """Run ``cases`` (``MEGATRON_CASES``-style dicts) in one ``torchrun`` launch of ``world`` gloo processes;
    rows of every rank (``model`` "Megatron GPT", ``case``, ``layout``, ``level``, ``recompute``, ``rank``,
    ``tp_rank``, ``pp_rank``, ``dp_rank``, ``what``, ``planned``, ``measured``, ``error``)."""
    import subprocess

    with tempfile.TemporaryDirectory() as out, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
               str(port), str(ROOT / "benchmarks" / "planner_validation_megatron.py"), "--out", out,
               "--cases", json.dumps(cases)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"Megatron validation on {world} processes failed:\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-6000:]}")
        rows = [r for rank in range(world) for r in json.loads(Path(out, f"rank{rank}.json").read_text())]
    for row in rows:
        row.update(model="Megatron GPT", dp=None, error=_error(row["planned"], row["measured"]))
    return rows


def all_cases() -> list[Case]:
    """Every registered case, in registration order."""
    return [case for factory in _FACTORIES for case in factory()]


def format_table(rows: list[dict]) -> str:
    """The rows as a text table: case, layout, level, rank, category, planned, measured, error."""
    lines = [f"{'case':<30} {'layout':<20} {'level':<9} {'rank':>5}  {'category':<30} {'planned':>12} "
             f"{'measured':>12} {'error':>9}"]
    for r in rows:
        err = "-" if r["error"] is None else f"{100 * r['error']:+.3f}%"
        case = r["case"] if r.get("model") != "Megatron GPT" else f"Megatron {r['case']}"
        what = r["what"]
        lines.append(f"{case:<30} {r.get('layout', ''):<20} {r['level']:<9} {str(r.get('rank', '')):>5}  {what:<30} "
                     f"{r['planned']:>12,} {r['measured']:>12,} {err:>9}")
    return "\n".join(lines)


def summarize(rows: list[dict]) -> dict[str, float]:
    """Max |error| of model state (the total of the five categories) and of activations: over every row
    (``max_abs_error_model_state``, ``max_abs_error_activations``; the known gaps excluded), per model
    (``tinygpt_*``, ``megatron_*``), the largest per-category model-state error of the Megatron cases, the
    peak gradients in backward, and the known gaps apart (``megatron_gap_<case>_*``)."""
    def worst(select) -> float:
        return max((abs(r["error"]) for r in rows if r["error"] is not None and select(r)), default=0.0)

    def state(r):
        return r["what"] == "model state"

    def act(r):
        return r["what"].startswith("activations")

    def tiny(r):
        return r.get("model", "TinyGPT") == "TinyGPT"

    def mega(r):
        return r.get("model") == "Megatron GPT" and r["case"] not in GAP_CASES

    summary = {
        "max_abs_error_model_state": worst(lambda r: state(r) and (tiny(r) or mega(r))),
        "max_abs_error_activations": worst(lambda r: act(r) and (tiny(r) or mega(r))),
        "tinygpt_max_abs_error_model_state": worst(lambda r: tiny(r) and state(r)),
        "tinygpt_max_abs_error_activations": worst(lambda r: tiny(r) and act(r)),
        "megatron_max_abs_error_model_state": worst(lambda r: mega(r) and state(r)),
        "megatron_max_abs_error_state_categories": worst(lambda r: mega(r) and r["what"] in STATE_KEYS),
        "megatron_max_abs_error_activations": worst(lambda r: mega(r) and act(r)),
        "megatron_max_abs_error_gradients_peak": worst(lambda r: mega(r) and r["what"] == "gradients, peak in backward"),
    }
    for gap in GAP_CASES:
        if any(r.get("model") == "Megatron GPT" and r["case"] == gap for r in rows):
            for name, select in (("model_state", state), ("activations", act)):
                summary[f"megatron_gap_{gap}_{name}"] = worst(lambda r, s=select: r.get("model") == "Megatron GPT"
                                                               and r["case"] == gap and s(r))
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="benchmarks/results/planner_validation.json")
    parser.add_argument("--dp-worlds", default="2", help="O3 data-parallel sizes ('' skips)")
    parser.add_argument("--megatron-worlds", default="2,4", help="Megatron GPT world sizes ('' skips)")
    parser.add_argument("--skip-tiny", action="store_true", help="only the Megatron GPT cases")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = []
    for index, case in enumerate([] if args.skip_tiny else all_cases()):
        for row in validate_case(case):
            rows.append({**row, "model": "TinyGPT", "layout": "single process", "rank": 0})
        for world in [int(w) for w in args.dp_worlds.split(",") if w]:
            rows += [{**row, "model": "TinyGPT", "layout": f"DP={world}", "rank": "worst"}
                     for row in validate_o3(index, world)]
    for world in [int(w) for w in args.megatron_worlds.split(",") if w]:
        rows += validate_megatron(world, MEGATRON_CASES[world])
    print(format_table(rows))
    summary = summarize(rows)
    print("max |error|: " + ", ".join(f"{k} {100 * v:.3f}%" for k, v in summary.items()))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
