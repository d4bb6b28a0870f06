"""The docs' figures that are cheap to compute, regenerated from the code: bytes per parameter and planned memory.

    python benchmarks/doc_figures.py            # check: print every block that differs from the code, exit 1
    python benchmarks/doc_figures.py --write    # rewrite the blocks

A generated block sits in a Markdown file between ``<!-- doc-figures: NAME -->`` and ``<!-- /doc-figures: NAME -->``;
everything between the markers is this script's output for NAME (:data:`FIGURES`), so a changed default that moves
a figure fails ``tests/e2e/test_doc_figures.py`` until the docs are regenerated. Figures that take minutes (loss
tables, timings) are not generated: the docs label them with the command, settings and date that produced them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

__all__ = ["FIGURES", "BLOCKS", "render", "blocks_in", "stale_blocks", "write", "main"]

GIB = 2**30


# -- the figures ------------------------------------------------------------------------------------------------------
GPT3_SCRIPTS = (("pretrain_gpt3_7B.sh", "6.7B", {}), ("pretrain_gpt3_13B.sh", "12.9B", {}),
                ("pretrain_gpt3_175B.sh", "174.6B", {"NNODES": "16"}))
GPT3_LEVELS = (("none", {"FP8_OPT_LEVEL": "none"}), ("none + distributed optimizer",
                                                       {"FP8_OPT_LEVEL": "none", "DISTRIBUTED_OPTIMIZER": "1"}),
               ("O1", {"FP8_OPT_LEVEL": "O1"}), ("O2", {"FP8_OPT_LEVEL": "O2"}), ("O3", {"FP8_OPT_LEVEL": "O3"}))


def _script_plan(script: str, env: dict[str, str]) -> dict:
    """``PLAN_ONLY=1 PLAN_JSON=1 examples/gpt3/<script>``: the planner on the script's own arguments."""
    full = {**os.environ, "PLAN_ONLY": "1", "PLAN_JSON": "1", "MOCK_DATA": "1", "PYTHON": sys.executable, **env}
    out = subprocess.run(["bash", str(ROOT / "examples" / "gpt3" / script)], cwd=ROOT, env=full, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout)


def gpt3_plans() -> str:
    """Planned GiB per GPU of each GPT-3 launch script at every level, with the script's defaults."""
    lines = ["| script | model | layout (TP x PP x DP) | " + " | ".join(name for name, _ in GPT3_LEVELS) + " |",
             "| --- | --- | --- |" + " ---: |" * len(GPT3_LEVELS)]
    for script, size, base in GPT3_SCRIPTS:
        plans = [_script_plan(script, {**base, **env}) for _, env in GPT3_LEVELS]
        layout = plans[0]["layout"]
        env_text = " ".join(f"{k}={v}" for k, v in base.items())
        cells = [f"{p['total_bytes'] / GIB:.1f}" for p in plans]
        lines.append(f"| `{(env_text + ' ') if env_text else ''}{script}` | {size} | TP{layout['tp']} x PP{layout['pp']} "
                     f"x DP{layout['dp']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _quickstart_bytes(level: str) -> tuple[int, float]:
    """(parameters, model-state bytes per parameter) of ``examples/quickstart.py``'s model at ``level`` after
    its last step (one step here: the bytes do not depend on the number of steps)."""
    import torch

    import runpy
    from types import SimpleNamespace

    from fp8.testing import GPTConfig, TinyGPT
    from megatron.training.data.corpus import get_batch, load_corpus

    # the engine quickstart's functions: its script run as a module of its own (nothing imports the examples)
    quickstart = SimpleNamespace(**runpy.run_path(str(ROOT / "examples" / "quickstart.py"), run_name="quickstart_script"))
    args = quickstart.parse_args(["--steps", "1", "--eval-batches", "1", "--sample", "0"])
    cfg = GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head)
    params = sum(p.numel() for p in TinyGPT(cfg).parameters())
    train_data, val_data = load_corpus()
    eval_batches = [get_batch(val_data, args.batch_size, args.seq_len, torch.Generator().manual_seed(1))]
    result = quickstart.train_level(level, cfg, args, train_data, eval_batches)
    return params, result.memory["total"] / params


def engine_bytes() -> str:
    """Model-state bytes per parameter of the engine quickstart's model (``examples/quickstart.py``)."""
    rows = [(level, *_quickstart_bytes(level)) for level in ("none", "O1", "O2")]
    lines = ["| level | model-state bytes / parameter |", "| --- | ---: |"]
    lines += [f"| {level} | {bpp:.2f} |" for level, _, bpp in rows]
    return f"{rows[0][1]:,} parameters; `fp8.memory_report` after an optimizer step, gradients held:\n\n" + "\n".join(lines)


def _main_job_bytes(level: str, tmp: Path) -> float:
    from megatron.training.arguments import DEMO_DEFAULTS

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in DEMO_DEFAULTS.items()
             if k not in ("train_iters", "compare", "eval_interval", "fp8_opt_level")]
    log = tmp / f"{level}.jsonl"
    subprocess.run([sys.executable, "pretrain_gpt.py", *flags, "--mock-data", "--vocab-size", "2048", "--train-iters",
                    "1", "--eval-interval", "0", "--fp8-opt-level", level, "--no-progress", "--log-json", str(log)],
                   cwd=ROOT, capture_output=True, text=True, check=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    summary = json.loads(log.read_text().splitlines()[-1])["summary"][-1]
    return summary["model_state_bytes_per_param"]


def main_job_bytes() -> str:
    """Model-state bytes per parameter of the main job's model (``python pretrain_gpt.py``'s demo shape: 4 layers,
    hidden 128, a 2,048-piece vocabulary) at none and O2 after one iteration."""
    with tempfile.TemporaryDirectory() as tmp:
        values = {level: _main_job_bytes(level, Path(tmp)) for level in ("none", "O2")}
    return "| level | model-state bytes / parameter |\n| --- | ---: |\n" + "\n".join(
        f"| {level} | {bpp:.2f} |" for level, bpp in values.items())


def memory_benchmark() -> str:
    """``benchmarks/memory.py``'s single-process GPT table (its default GPT): model-state bytes per parameter per
    variant."""
    from benchmarks import memory

    rows = [memory.measure(variant, *memory.gpt_case(256, 6)) for variant in memory.VARIANTS]
    lines = ["| variant | model-state bytes / parameter |", "| --- | ---: |"]
    lines += [f"| {row['variant']} | {row['bytes_per_param']['total']:.2f} |" for row in rows]
    return (f"`benchmarks/memory.py` (GPT d_model 256, 6 layers, {rows[0]['params']:,} parameters; `fp8.memory_report` "
            f"at the peak of a step):\n\n" + "\n".join(lines))


FIGURES: dict[str, Callable[[], str]] = {
    "memory-benchmark": memory_benchmark,
    "gpt3-plans": gpt3_plans,
    "engine-bytes": engine_bytes,
    "main-job-bytes": main_job_bytes,
}
"""Every generated figure by name: a function returning its Markdown."""

BLOCKS: dict[str, tuple[str, ...]] = {
    "memory-benchmark": ("README.md",),
    "gpt3-plans": ("examples/gpt3/README.md",),
    "engine-bytes": ("README.md",),
    "main-job-bytes": ("README.md",),
}
"""Where each figure's block stands (a figure may stand in several files)."""


# -- the blocks -------------------------------------------------------------------------------------------------------
def _pattern(name: str) -> re.Pattern:
    return re.compile(rf"(<!-- doc-figures: {re.escape(name)} -->\n)(.*?)\n?(<!-- /doc-figures: {re.escape(name)} -->)",
                      re.S)


def blocks_in(text: str, name: str) -> list[str]:
    """The contents of every block called ``name`` in ``text``."""
    return [m.group(2) for m in _pattern(name).finditer(text)]


def render(names=None) -> dict[str, str]:
    """Each figure's Markdown, computed now."""
    return {name: FIGURES[name]() for name in (names or FIGURES)}


def stale_blocks(rendered: dict[str, str], root: Path = ROOT, blocks: dict[str, tuple[str, ...]] = BLOCKS) -> list[str]:
    """``file: block NAME`` for every block whose text differs from ``rendered`` (or is missing)."""
    stale = []
    for name, text in rendered.items():
        for file in blocks[name]:
            found = blocks_in((root / file).read_text(encoding="utf-8"), name)
            if not found:
                stale.append(f"{file}: no block {name} (add the markers <!-- doc-figures: {name} --> ... "
                             f"<!-- /doc-figures: {name} -->)")
            stale += [f"{file}: block {name} differs from the code" for block in found if block != text]
    return stale


def write(rendered: dict[str, str], root: Path = ROOT, blocks: dict[str, tuple[str, ...]] = BLOCKS) -> None:
    """Replace each block of ``rendered`` in its files."""
    for name, text in rendered.items():
        for file in blocks[name]:
            path = root / file
            path.write_text(_pattern(name).sub(lambda m: m.group(1) + text + "\n" + m.group(3), path.read_text()),
                            encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help="rewrite the blocks (default: check them)")
    p.add_argument("--only", default=None, help="comma-separated figure names (default: all)")
    args = p.parse_args(argv)
    rendered = render(args.only.split(",") if args.only else None)
    if args.write:
        write(rendered)
        print("rewrote: " + ", ".join(f"{n} in {', '.join(BLOCKS[n])}" for n in rendered))
        return 0
    stale = stale_blocks(rendered)
    for line in stale:
        print(line)
    if stale:
        print("regenerate them: python benchmarks/doc_figures.py --write")
        return 1
    print(f"{len(rendered)} figure(s) match the code")
    return 0


if __name__ == "__main__":
    sys.exit(main())
