"""Regenerate ``docs/results.md``: FP8-LM's claims beside what this repository measures.

Every number in the report comes from a JSON file written by a script in ``benchmarks/`` (or, for the
planner's predictions, from ``tools/memory_planner.py`` evaluated here). ``--run`` first (re)runs the
benchmarks whose results are missing (``--rerun`` all of them); without it the report is built from the
results on disk. A table whose results file is missing keeps the text the report already has (between its
``<!-- report block: ... -->`` markers), so a fresh clone, which has no ``benchmarks/results/``, never erases
measured tables; the command lists what it kept and the command that measures each::

    python benchmarks/report.py --run          # run what is missing, then write docs/results.md
    python benchmarks/report.py                # rebuild the report from benchmarks/results/*.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"
FIGURES = DOCS / "figures"
sys.path.insert(0, str(ROOT))


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _torchrun(n: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_port", _port(), *args]


# result file -> command producing it (``python`` for ``sys.executable`` where it is shown to a user)
BENCHMARKS = {
    "memory.json": [sys.executable, "benchmarks/memory.py"],
    "comm_2.json": _torchrun(2, "benchmarks/comm.py"),
    "comm_o3_4.json": _torchrun(4, "benchmarks/comm.py"),
    "megatron_comm.json": [sys.executable, "benchmarks/megatron_comm.py"],
    "loss_parity.json": [sys.executable, "benchmarks/loss_parity.py"],
    "grad_accumulation.json": [sys.executable, "benchmarks/grad_accumulation.py"],
    "loss_parity_accum.json": [sys.executable, "benchmarks/loss_parity.py", "--accumulate", "64", "--iters", "80",
                               "--eval-interval", "40"],
    "planner_validation.json": [sys.executable, "benchmarks/planner_validation.py"],
    "figure1.json": [sys.executable, "benchmarks/figure1.py", "--output", "benchmarks/results/figure1"],
}


def command_text(name: str) -> str:
    """The command that writes results file ``name``, as a user types it."""
    cmd = BENCHMARKS[name]
    if cmd[1:3] == ["-m", "torch.distributed.run"]:
        return f"torchrun --nproc_per_node {cmd[4]} " + " ".join(cmd[7:])
    return "python " + " ".join(cmd[1:])


def run_missing(rerun: bool) -> None:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for name, cmd in BENCHMARKS.items():
        if rerun or not (RESULTS / name).exists():
            print(f"running {' '.join(cmd[1:])} -> {name}", flush=True)
            subprocess.run(cmd, cwd=ROOT, check=True, env=env)


def _load(name: str):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


_BLOCK = re.compile(r"<!-- report block: (?P<id>[\w-]+) -->\n(?P<text>.*?)<!-- end of report block: (?P=id) -->\n",
                    re.S)
_previous: dict[str, str] = {}  # block id -> its text in the report being rewritten
kept: list[tuple[str, list[str]]] = []  # (block id, missing results files) of the blocks kept from it
not_measured: list[tuple[str, list[str]]] = []  # the same, for blocks the report did not have either


def _missing(name: str) -> str:
    return f"_Not measured yet: run `{command_text(name)}` (or `python benchmarks/report.py --run`)._\n"


def block(block_id: str, files: list[str], render, fallback: str | None = None) -> str:
    """The text ``render()`` makes from results ``files``, between markers; where one of the files is missing,
    the text the report already has for this block, or, if it has none, ``fallback`` (default: the commands that
    measure the missing files)."""
    missing = [f for f in files if not (RESULTS / f).exists()]
    if not missing:
        text = render()
    elif block_id in _previous:
        text = _previous[block_id]
        kept.append((block_id, missing))
    else:
        text = fallback if fallback is not None else "".join(_missing(f) for f in missing)
        not_measured.append((block_id, missing))
    text = text if text.endswith("\n") else text + "\n"
    return f"<!-- report block: {block_id} -->\n{text}<!-- end of report block: {block_id} -->\n"


def _pct(new: float, old: float, digits: int = 1) -> str:
    return f"{(new / old - 1) * 100:+.{digits}f}%" if old else "n/a"


def section_memory() -> str:
    out = ["## Model-state memory per parameter\n",
           "FP8-LM: BF16 mixed precision holds 16 bytes per parameter (BF16 weight and gradient, FP32 master weight "
           "and Adam moments); its precision-decoupled optimizer keeps FP16 master weights, an FP8 first moment and "
           "an FP16 second moment, with FP8 weights and gradients, and reports 39% less real memory than BF16 for "
           "GPT-175B on H100 (O3, with its FP8 distributed optimizer).\n",
           "Measured here (`benchmarks/memory.py`, `fp8.memory_report` at the peak of a step, bytes actually held):\n"]
    out.append(block("memory", ["memory.json"], _memory_table))
    out.append(block("memory-demo-gpt", ["loss_parity.json"], _memory_demo_table))
    return "\n".join(out)


def _memory_table() -> str:
    mem = _load("memory.json")
    out = ["| variant | whole GPT | FP8 layers only |\n| --- | ---: | ---: |"]
    whole = {r["variant"]: r["bytes_per_param"]["total"] for r in mem["rows"] if r.get("model") == "GPT"}
    layers = {r["variant"]: r["bytes_per_param"]["total"] for r in mem["rows"] if r.get("model") != "GPT"}
    for variant in whole:
        out.append(f"| {variant} | {whole[variant]:.2f} | {layers.get(variant, float('nan')):.2f} |")
    params = next((r["params"] for r in mem["rows"]), 0)
    out.append(f"\n({params:,}-parameter GPT; embeddings, norms and biases stay in high precision at every level, "
               f"which is why the whole model sits above the FP8 layers.)\n")
    dp = mem.get("data_parallel") or []
    if dp:
        out.append("O3 shards master weights and moments over data parallel (worst rank, bytes/parameter):\n")
        out.append("| data-parallel ranks | variant | worst rank |\n| ---: | --- | ---: |")
        for r in dp:
            out.append(f"| {r['world_size']} | {r['variant']} | {r['max_rank']['total']:.2f} |")
        out.append("")
    return "\n".join(out)


def _memory_demo_table() -> str:
    parity = _load("loss_parity.json")
    params = parity["summaries"][0].get("params_on_rank", 0)
    out = [f"The Megatron demo GPT (`benchmarks/loss_parity.py`, {params:,} parameters, data-parallel rank 0; "
           f"its embeddings, norms and biases stay in high precision):\n",
           "| level | model state bytes/parameter |\n| --- | ---: |"]
    for s in parity["summaries"]:
        out.append(f"| {s['level']} | {s['model_state_bytes_per_param']:.2f} |")
    out.append("")
    return "\n".join(out)


def section_comm() -> str:
    out = ["## Communication per training step\n",
           "FP8-LM: FP8 gradients and collectives cut communication by 63-65% against BF16 (data parallel), "
           "with automatic scaling of the FP8 all-reduce.\n"]
    out.append(block("comm-data-parallel", ["comm_2.json", "comm_o3_4.json"], _comm_dp_table))
    out.append(block("comm-megatron", ["megatron_comm.json"], _comm_megatron_table))
    return "\n".join(out)


def _comm_dp_table() -> str:
    out = []
    dp = _load("comm_2.json")
    out.append("Data parallel, bytes sent per rank and step (`benchmarks/comm.py`, "
               f"{dp['bytes']['torch DDP FP32']['elements'] / 1e6:.1f}M-parameter GPT):\n")
    out.append("| ranks | torch DDP FP32 | torch DDP BF16 grads | fp8 DDP (O1/O2) | vs FP32 | vs BF16 | fp8 O3 |")
    out.append("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in ("comm_2.json", "comm_o3_4.json", "comm_4.json"):
        d = _load(name)
        if d is None or (name == "comm_4.json" and _load("comm_o3_4.json")):
            continue
        b = d["bytes"]
        o3 = b.get("fp8 O3 (ours)", {}).get("bytes_per_step")
        out.append(
            f"| {d['world_size']} | {b['torch DDP FP32']['bytes_per_step'] / 1e6:.1f} MB | "
            f"{b['torch DDP BF16 grads']['bytes_per_step'] / 1e6:.1f} MB | {b['fp8 DDP (ours)']['bytes_per_step'] / 1e6:.1f} MB | "
            f"{_pct(b['fp8 DDP (ours)']['bytes_per_step'], b['torch DDP FP32']['bytes_per_step'])} | "
            f"{_pct(b['fp8 DDP (ours)']['bytes_per_step'], b['torch DDP BF16 grads']['bytes_per_step'])} | "
            + (f"{o3 / 1e6:.1f} MB |" if o3 else "- |"))
    out.append("")
    return "\n".join(out)


def _comm_megatron_table() -> str:
    out = []
    mc = _load("megatron_comm.json")
    out.append("Megatron GPT, bytes sent per iteration by all ranks together (`benchmarks/megatron_comm.py`; "
               "4 layers, hidden 256, seq 128, global batch 16; baseline in FP32 on CPU, so FP8 payloads are a "
               "quarter of it, and half of a BF16 baseline's):\n")
    out.append("| layout | traffic | baseline | O1 | O2 | O3 | O2 vs baseline |\n| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for layout, by_level in mc["results"].items():
        groups = by_level["none"]["groups"].keys()
        for g in list(groups) + ["total"]:
            vals = [by_level[l]["total"] if g == "total" else by_level[l]["groups"][g] for l in ("none", "O1", "O2", "O3")]
            if not any(vals):
                continue
            out.append(f"| {layout} | {g} | " + " | ".join(f"{v / 2**20:.2f} MiB" for v in vals)
                       + f" | {_pct(vals[2], vals[0]) if vals[0] else 'n/a'} |")
    out.append("\nSequence-parallel all-gathers/reduce-scatters and pipeline messages move 1-byte values (plus one "
               "4-byte scale per pipeline message); the tied-embedding gradient all-reduce between the first and "
               "last pipeline stage stays in high precision; O3 adds the all-gather of updated weights (FP8 payloads "
               "for FP8 weights, high precision for the embedding) in exchange for sharded optimizer state.\n")
    return "\n".join(out)


def _parity_table(parity: dict) -> str:
    """Final losses per level of a ``benchmarks/loss_parity.py`` result, against the baseline."""
    base = next(s for s in parity["summaries"] if s["level"] == "none")
    rows = ["| level | final train loss (last 10 it.) | final val loss | vs baseline | skipped steps |",
            "| --- | ---: | ---: | ---: | ---: |"]
    for s in parity["summaries"]:
        rows.append(f"| {s['level']} | {s['final_train_loss']:.4f} | {s['final_val_loss']:.4f} | "
                    f"{_pct(s['final_val_loss'], base['final_val_loss'], 2)} | {s['skipped_steps']} |")
    return "\n".join(rows)


def section_loss() -> str:
    out = ["## Loss parity on the demo GPT\n",
           "FP8-LM: FP8 training matches BF16 loss curves without changing hyper-parameters.\n"]
    out.append(block("loss-parity", ["loss_parity.json"], _loss_parity_block))
    return "\n".join(out)


def _loss_parity_block() -> str:
    out = []
    parity = _load("loss_parity.json")
    out.append(f"`benchmarks/loss_parity.py`: megatron-core GPT (4 layers, hidden 128) on Shakespeare, "
               f"{parity['iters']} iterations of 16 x 128 tokens over {parity.get('data_parallel', 1)} data-parallel "
               f"ranks (FP8 levels: FP8 gradient all-reduce; O3: sharded optimizer), same seed and data per level, "
               f"CPU (baseline FP32):\n")
    out.append(_parity_table(parity))
    from megatron.training.monitoring.log import plot_loss_curves

    histories = [{"level": level, "train": [{"iteration": i, "loss": l} for i, l in zip(c["iteration"], c["loss"])],
                  "valid": [{"iteration": i, "val_loss": l} for i, l in zip(c["val_iteration"], c["val_loss"])]}
                 for level, c in parity["curves"].items()]
    FIGURES.mkdir(parents=True, exist_ok=True)
    plot_loss_curves(histories, str(FIGURES / "loss_parity.png"),
                     f"Demo GPT, {parity['iters']} iterations: FP8 levels vs baseline")
    out.append("\n![loss curves](figures/loss_parity.png)\n")
    return "\n".join(out)


def grad_accumulation_table(data: dict) -> str:
    """The error table of ``benchmarks/grad_accumulation.py`` as markdown."""
    counts = data["counts"]
    rows = ["| mechanism | bytes/element | " + " | ".join(f"N = {n:,}" for n in counts) + " |",
            "| --- | ---: |" + " ---: |" * len(counts)]
    for name, size in data["bytes_per_element"].items():
        errors = [data["relative_error"][str(n)][name] for n in counts]
        rows.append(f"| {name} | {size} | " + " | ".join(f"{e:.4f}" for e in errors) + " |")
    return "\n".join(rows)


def section_grad_accumulation() -> str:
    out = ["## Gradient accumulation over micro-batches\n",
           "FP8-LM keeps weight gradients in FP8. Summed over many micro-batches in FP8, each contribution below half "
           "an E4M3 step of the running sum is lost; fp8lm sums them in a scaled FP16 buffer by default "
           "(`Float8LinearConfig(grad_accumulation=\"fp16\")`, 2 bytes per element while held; `\"fp32\"`: 4 bytes) and "
           "quantizes the sum once for the FP8 all-reduce. See [precision.md](precision.md).\n"]
    out.append(block("grad-accumulation", ["grad_accumulation.json"], _grad_accumulation_block))
    out.append(block("loss-parity-accumulation", ["loss_parity_accum.json"], _loss_parity_accum_block))
    return "\n".join(out)


def _grad_accumulation_block() -> str:
    out = []
    data = _load("grad_accumulation.json")
    out.append(f"`benchmarks/grad_accumulation.py`: one `Float8Linear(256, 256)`, N correlated micro-batches of "
               f"32 tokens, relative error of the accumulated weight gradient against the exact fp64 sum (worst of "
               f"{data['seeds']} seeds):\n")
    out.append(grad_accumulation_table(data) + "\n")
    return "\n".join(out)


def _loss_parity_accum_block() -> str:
    out = []
    parity = _load("loss_parity_accum.json")
    out.append(f"Loss parity with accumulation (`benchmarks/loss_parity.py --accumulate "
               f"{parity['micro_batches_per_rank']}`): the demo GPT, {parity['iters']} iterations, global batch "
               f"{parity['global_batch_size']} sequences of 128 tokens over {parity['data_parallel']} data-parallel ranks "
               f"in micro-batches of {parity['micro_batch_size']}, i.e. {parity['micro_batches_per_rank']} micro-batches "
               f"per rank per step before the gradient reduction (FP8 levels: FP8 all-reduce; O3: owner-reduce):\n")
    out.append(_parity_table(parity) + "\n")
    return "\n".join(out)


def section_planner() -> str:
    from megatron.training.planning.memory_plan import plan_memory

    out = ["## Planned memory for GPT-3 7B, 13B and 175B (FP8-LM's layouts)\n",
           "`tools/memory_planner.py`, per GPU (worst rank), BF16 activations, sequence length 2048, micro-batch 1, "
           "sequence parallelism where TP > 1, full recomputation for 175B; BF16 (`none`) with FP32 main gradients "
           "(Megatron's `--bf16`), FP8 levels with scaled FP16 gradient sums (`--fp8-grad-accumulation fp16`, the default), both summing "
           "micro-batches accurately:\n"]
    models = {
        "7B": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, tensor_model_parallel_size=1,
                   pipeline_model_parallel_size=1, data_parallel_size=32),
        "13B": dict(num_layers=40, hidden_size=5120, num_attention_heads=40, tensor_model_parallel_size=2,
                    pipeline_model_parallel_size=1, data_parallel_size=16),
        "175B": dict(num_layers=96, hidden_size=12288, num_attention_heads=96, tensor_model_parallel_size=8,
                     pipeline_model_parallel_size=4, data_parallel_size=8, recompute_granularity="full"),
    }
    levels = ("none", "O1", "O2", "O3")
    out.append("| model | layout | " + " | ".join(f"{l} (GiB)" for l in levels) + " | O3 vs none |")
    out.append("| --- | --- |" + " ---: |" * (len(levels) + 1))
    for name, kw in models.items():
        totals = []
        for level in levels:
            cfg = _planner_config(kw, level)
            totals.append(plan_memory(cfg)["total_gib"])
        layout = f"TP{kw['tensor_model_parallel_size']} PP{kw['pipeline_model_parallel_size']} DP{kw['data_parallel_size']}"
        out.append(f"| {name} | {layout} | " + " | ".join(f"{t:.1f}" for t in totals) + f" | {_pct(totals[3], totals[0])} |")
    out.append("")
    out.append(block("figure1", ["figure1.json"], _figure1_block))
    out.append(block("planner-validation", ["planner_validation.json"], _planner_validation_block))
    return "\n".join(out)


def _figure1_block() -> str:
    out = []
    md = RESULTS / "figure1.md"
    out.append("FP8-LM's Figure 1 question, the largest GPT that fits N x 80 GB GPUs "
               "(`python benchmarks/figure1.py`):\n")
    if md.exists():
        out.append(md.read_text())
    png = RESULTS / "figure1.png"
    if png.exists():
        FIGURES.mkdir(parents=True, exist_ok=True)
        shutil.copy(png, FIGURES / "figure1.png")
        out.append("![largest GPT per GPU count](figures/figure1.png)\n")
    return "\n".join(out)


def _planner_validation_block() -> str:
    out = []
    val = _load("planner_validation.json")
    s = val["summary"]
    out.append("The planner against memory measured here (`benchmarks/planner_validation.py`: `fp8.memory_report` "
               "after a step and the peak bytes autograd holds for backward, on TinyGPT and on the megatron-core GPT "
               "at TP, TP+SP, PP, TP x PP, DP x TP, DP x PP, levels none/O1/O2/O3, with and without recomputation; "
               "details and the known gaps in [scale.md](scale.md)):\n")
    out.append("| quantity | error |\n| --- | ---: |")
    for key, value in s.items():
        if isinstance(value, (int, float)):
            out.append(f"| {key.replace('_', ' ')} | {value:.4%} |")
    out.append("")
    return "\n".join(out)


def _planner_config(kw: dict, level: str):
    from megatron.training.planning.memory_plan import PlannerConfig

    # BF16 as Megatron's --bf16 (FP32 main gradients), FP8 levels with their default FP16 gradient sums.
    return PlannerConfig(seq_length=2048, vocab_size=50257, micro_batch_size=1, fp32_grads=level == "none",
                         sequence_parallel=kw["tensor_model_parallel_size"] > 1, fp8_opt_level=level, bf16=True, **kw)


def section_gpu() -> str:
    out = ["## GPU speed\n", "FP8-LM: GPT-175B trains 75% faster than BF16 (Megatron-LM) on H100.\n"]
    out.append(block("gpu-step", ["gpu_step.json"], _gpu_step_block, fallback=_NO_GPU))
    return "\n".join(out)


def _gpu_step_block() -> str:
    full = _load("gpu_step.json")
    return "```\n" + json.dumps(full.get("summary", full), indent=1)[:4000] + "\n```\n"


_NO_GPU = ("No GPU was lent to the sessions that produced this report: `benchmarks/gpu_step.py` has only run in its CPU "
           "smoke mode (`benchmarks/results/gpu_step_smoke.json`), which checks the code paths, not speed. See "
           "[gpu.md](gpu.md).\n")


def main(argv: list[str] | None = None) -> int:
    global RESULTS, FIGURES
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", action="store_true", help="run the benchmarks whose results are missing first")
    p.add_argument("--rerun", action="store_true", help="run every benchmark first")
    p.add_argument("--out", default=str(DOCS / "results.md"),
                   help="the report to rewrite (its figures go to figures/ beside it)")
    p.add_argument("--results", default=str(RESULTS), help="the folder of the benchmarks' JSON results")
    a = p.parse_args(argv)
    if (a.run or a.rerun) and Path(a.results).resolve() != RESULTS.resolve():
        p.error(f"--run writes the benchmarks' results to {RESULTS}; drop --results or --run")
    RESULTS, FIGURES = Path(a.results), Path(a.out).parent / "figures"
    if a.run or a.rerun:
        run_missing(a.rerun)
    out = Path(a.out)
    previous = out.read_text() if out.exists() else ""
    _previous.clear(), kept.clear(), not_measured.clear()
    _previous.update({m["id"]: m["text"] for m in _BLOCK.finditer(previous)})
    parts = [
        "# Results: FP8-LM's claims beside ours\n",
        "Generated by `python benchmarks/report.py` from the JSON written by the scripts in `benchmarks/`; do not "
        "edit by hand. Measured on a 2-core CPU machine (torch 2.13.0 CPU, gloo): memory and bytes on the wire do "
        "not depend on the device; times measured on CPU say nothing about GPUs.\n",
        section_memory(), section_comm(), section_loss(), section_grad_accumulation(), section_planner(),
        section_gpu(),
    ]
    measured = [(b, m) for b, m in not_measured if b != "gpu-step"]
    if measured and previous.strip() and not _previous:
        # A report without block markers (written by an older report.py): its tables cannot be told apart, so
        # rewriting it would erase the ones whose results are not on disk.
        names = sorted({f for _, m in measured for f in m if f in BENCHMARKS})
        print(f"report.py: {out} has measured tables but no report-block markers, and these results are missing "
              f"from {RESULTS}: {', '.join(names)}; rewriting it would erase those tables. Measure them first:\n"
              + "\n".join(f"  {command_text(n)}" for n in names)
              + "\nor all at once: python benchmarks/report.py --run", file=sys.stderr)
        return 2
    out.write_text("\n".join(parts))
    print(f"wrote {out}")
    for block_id, missing in kept:
        print(f"  kept the table '{block_id}' as it was: missing "
              + ", ".join(f"{RESULTS / f} (`{command_text(f)}`)" if f in BENCHMARKS else str(RESULTS / f) for f in missing))
    for block_id, missing in measured:
        print(f"  not measured yet: '{block_id}': run " + ", ".join(f"`{command_text(f)}`" for f in missing))
    return 0


if __name__ == "__main__":
    sys.exit(main())
