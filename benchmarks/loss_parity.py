"""Loss parity of FP8 O1/O2/O3 vs the baseline on the demo GPT over a longer run.

Runs ``pretrain_gpt.py`` under ``torchrun`` with ``--nproc`` data-parallel ranks (default 2, so O3 really
shards its optimizer and gradients travel through the FP8 all-reduce; the demo's model and data: 4 layers,
hidden 128, Shakespeare with a 2,048-piece sentencepiece vocabulary, 16 x 128 tokens per iteration) for
``--iters`` iterations at each level, same seed and data, and writes ``benchmarks/results/loss_parity.json`` (per-level summaries and
loss curves) and ``benchmarks/results/loss_parity.png``::

    python benchmarks/loss_parity.py --iters 600      # ~15 min on 2 idle cores

With gradient accumulation (64 micro-batches of one sequence per rank per step, so FP8 weight gradients are
summed over 64 backward passes before the FP8 all-reduce; results in ``loss_parity_accum.json``)::

    python benchmarks/loss_parity.py --accumulate 64 --iters 80

Scaling recipes (``--recipes``): O2 with each recipe (tensorwise, rowwise, blockwise, mxfp8), each with and without
``--fp8-activations``, O1 with mxfp8, and NVFP4 (``--fp4-format e2m1 --fp4-recipe nvfp4``) at O1 and at O2 with its
defaults, without the random Hadamard transform, without stochastic rounding and without both, with every layer in
NVFP4 and with the forward in high precision for the last 20% of the iterations, against the baseline
(``none``), one single-process run each on the same
data and seed; final train loss (mean of the last 10 logged iterations) and final validation loss, their relative
difference to the baseline; results in ``loss_parity_recipes.json`` (``--recipe-names``: only those recipes and the
baseline)::

    python benchmarks/loss_parity.py --recipes --iters 300
    python benchmarks/loss_parity.py --recipes --recipe-names mxfp8 --iters 300
    python benchmarks/loss_parity.py --recipes --recipe-names nvfp4 --iters 300
    python benchmarks/loss_parity.py --recipes --recipe-variants nvfp4 "nvfp4 BF16 forward last 20%" --iters 300 \
        --out benchmarks/results/loss_parity_nvfp4_fused

Mixture of experts (``--moe``): the demo GPT with each MLP a megatron-core MoE layer of 8 experts (each the demo's
FFN, 128 -> 512 -> 128), top-2 routing, load-balancing loss 0.01, experts replicated over the data-parallel ranks
(expert-parallel size 1); results in ``loss_parity_moe.json``. ``--expert-parallel 2``: the experts split over the 2
ranks (4 each), tokens exchanged by the all-to-all dispatcher, with ``--moe-fp8-dispatch`` in FP8 at the FP8 levels
(the baseline dispatches in its own dtype); results in ``loss_parity_moe_ep2.json``::

    python benchmarks/loss_parity.py --moe --iters 300
    python benchmarks/loss_parity.py --moe --expert-parallel 2 --moe-fp8-dispatch --iters 300

Dispatch bytes (``--dispatch-bytes``): the same MoE GPT at EP2 in BF16 (``--bf16``), ``--iters`` iterations at
level none (tokens in BF16) and at O2 with ``--moe-fp8-dispatch`` (E4M3 and a scale per token), the expert-parallel
all-to-all bytes each rank sent per iteration (dispatch, combine and their backwards, counted by the run) and per
token row; results in ``moe_dispatch_bytes.json``::

    python benchmarks/loss_parity.py --dispatch-bytes --iters 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=600)
    p.add_argument("--nproc", type=int, default=2, help="data-parallel ranks (16 must be divisible by it)")
    p.add_argument("--eval-interval", type=int, default=100)
    p.add_argument("--accumulate", type=int, default=0,
                   help="micro-batches of one sequence per rank per step (global batch = this x nproc); "
                        "0: the demo's batch of 16 split over the ranks in one micro-batch each")
    p.add_argument("--out", default=None, help="path stem (default: benchmarks/results/loss_parity[_accum])")
    p.add_argument("--recipes", action="store_true", help="O2 per scaling recipe, with and without --fp8-activations")
    p.add_argument("--recipe-names", nargs="+", default=None,
                   help="with --recipes: only these recipes (and the baseline), e.g. --recipe-names mxfp8")
    p.add_argument("--recipe-variants", nargs="+", default=None,
                   help="with --recipes: only these variants, by their full names (O2; LEVEL:NAME for another "
                        "level) and the baseline, e.g. --recipe-variants nvfp4 'nvfp4 BF16 forward last 20%%' O1:nvfp4")
    p.add_argument("--moe", action="store_true", help="each MLP a mixture of 8 experts, top-2")
    p.add_argument("--expert-parallel", type=int, default=1, help="with --moe: expert-parallel size (all-to-all)")
    p.add_argument("--moe-fp8-dispatch", action="store_true", help="with --expert-parallel: tokens in FP8")
    p.add_argument("--dispatch-bytes", action="store_true", help="EP2 all-to-all bytes, BF16 vs FP8 dispatch")
    a = p.parse_args()
    if a.recipes:
        recipes(a)
        return
    if a.dispatch_bytes:
        dispatch_bytes(a)
        return
    if a.expert_parallel > 1 and not a.moe:
        p.error("--expert-parallel needs --moe")
    default = ("loss_parity" + ("_accum" if a.accumulate else "") + ("_moe" if a.moe else "")
               + (f"_ep{a.expert_parallel}" if a.expert_parallel > 1 else ""))
    out = Path(a.out or ROOT / "benchmarks" / "results" / default)
    micro, global_batch = (1, a.accumulate * a.nproc) if a.accumulate else (16 // a.nproc, 16)
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".jsonl")
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc), "--master_port", str(port),
           "pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4",
           "--seq-length", "128", "--micro-batch-size", str(micro), "--global-batch-size", str(global_batch),
           "--train-iters", str(a.iters),
           "--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", str(max(1, a.iters // 10)),
           "--eval-interval", str(a.eval_interval), "--eval-iters", "8", "--fp8-opt-level", "O2",
           "--compare", "none,O1,O3", "--no-progress", "--log-interval", "50", "--log-json", str(log),
           "--plot", str(out.with_suffix(".png"))]
    if a.moe:
        cmd += MOE_FLAGS
    if a.expert_parallel > 1:
        cmd += ["--moe-token-dispatcher-type", "alltoall", "--expert-model-parallel-size", str(a.expert_parallel)]
        cmd += ["--moe-fp8-dispatch"] if a.moe_fp8_dispatch else []
    subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    curves: dict[str, dict] = {}
    summaries = []
    with open(log) as f:
        for line in f:
            r = json.loads(line)
            if "summary" in r:
                summaries = r["summary"]
                continue
            c = curves.setdefault(r["level"], {"iteration": [], "loss": [], "val_iteration": [], "val_loss": []})
            c["iteration"].append(r["iteration"])
            c["loss"].append(r["loss"])
            if "val_loss" in r:
                c["val_iteration"].append(r["iteration"])
                c["val_loss"].append(r["val_loss"])
    for s in summaries:
        s.pop("memory", None)
    result = {"command": cmd[1:], "iters": a.iters, "moe": a.moe, "expert_parallel": a.expert_parallel,
              "moe_fp8_dispatch": a.moe_fp8_dispatch, "data_parallel": a.nproc, "micro_batch_size": micro,
              "global_batch_size": global_batch, "micro_batches_per_rank": global_batch // (micro * a.nproc),
              "summaries": summaries, "curves": curves}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


MOE_FLAGS = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
DISPATCH_TAGS = ("moe dispatch", "moe combine", "moe dispatch grad", "moe combine grad")


def dispatch_bytes(a) -> None:
    """EP2 all-to-all bytes per iteration and per token row, BF16 dispatch (level none) vs FP8 dispatch (O2)."""
    import socket
    import tempfile

    hidden = 128
    rows = []
    for level, extra, row_bytes in (("none", [], 2 * hidden), ("O2", ["--moe-fp8-dispatch"], hidden + 4)):
        with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            sock.close()
            log = Path(tmp) / "log.jsonl"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
                   "pretrain_gpt.py", "--num-layers", "4", "--hidden-size", str(hidden), "--num-attention-heads", "4",
                   "--seq-length", "128", "--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters",
                   str(a.iters), "--eval-interval", "0", "--bf16", "--fp8-opt-level", level, "--no-progress",
                   "--log-interval", str(a.iters), "--log-json", str(log), *MOE_FLAGS, "--moe-token-dispatcher-type",
                   "alltoall", "--expert-model-parallel-size", "2", *extra]
            subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True,
                           env={**os.environ, "PYTHONWARNINGS": "ignore"})
            summary = json.loads(log.read_text().splitlines()[-1])["summary"][0]
        per_iter = summary["comm_bytes_per_iteration"]
        by_tag = {t: per_iter.get(t, 0.0) for t in DISPATCH_TAGS}
        total = sum(by_tag.values())
        rows.append({"level": level, "dispatch": "FP8 (E4M3 + scale per token)" if extra else "BF16",
                     "bytes_per_iteration": by_tag, "total_per_iteration": total, "bytes_per_row": row_bytes,
                     "rows_per_iteration": total / row_bytes, "command": cmd[1:]})
    base, fp8 = rows
    ratio = fp8["total_per_iteration"] / base["total_per_iteration"]
    print(f"EP2 all-to-all bytes per iteration and rank (rank 0), {a.iters} iterations, hidden {hidden}, 8 experts top-2")
    print(f"{'dispatch':<30} {'dispatch':>10} {'combine':>10} {'backward':>10} {'total':>10} {'B/row':>6}")
    for r in rows:
        b = r["bytes_per_iteration"]
        print(f"{r['dispatch']:<30} {b['moe dispatch']:>10.0f} {b['moe combine']:>10.0f} "
              f"{b['moe dispatch grad'] + b['moe combine grad']:>10.0f} {r['total_per_iteration']:>10.0f} "
              f"{r['bytes_per_row']:>6}")
    print(f"FP8 / BF16: {ratio:.3f} of the bytes ({fp8['bytes_per_row'] / base['bytes_per_row']:.3f} per row)")
    out = ROOT / "benchmarks" / "results" / "moe_dispatch_bytes.json"
    out.write_text(json.dumps({"iters": a.iters, "rows": rows, "ratio": ratio}, indent=1) + "\n")
    print(f"wrote {out}")


RECIPE_VARIANTS = [("none", "tensorwise", False)] + [
    ("O2", recipe, act) for recipe in ("tensorwise", "rowwise", "blockwise", "mxfp8") for act in (False, True)] + [
    ("O1", "mxfp8", False), ("O2", "nvfp4", False), ("O1", "nvfp4", False), ("O2", "nvfp4 no RHT", False),
    ("O2", "nvfp4 no SR", False), ("O2", "nvfp4 no RHT no SR", False), ("O2", "nvfp4 all layers", False),
    ("O2", "nvfp4 BF16 forward last 20%", False)]
NVFP4_FLAGS = {"nvfp4": [], "nvfp4 no RHT": ["--no-fp4-hadamard"], "nvfp4 no SR": ["--no-fp4-stochastic-rounding"],
               "nvfp4 no RHT no SR": ["--no-fp4-hadamard", "--no-fp4-stochastic-rounding"],
               "nvfp4 all layers": ["--num-layers-at-end-in-bf16", "0"],
               "nvfp4 BF16 forward last 20%": ["--fp4-bf16-forward-from-iteration", "{last20}"]}
"""NVFP4 (``--fp4-format e2m1 --fp4-recipe nvfp4``) with its defaults (random Hadamard transform of the
weight-gradient operands, stochastic rounding of output gradients, the last layer in high precision), without each,
with every layer in NVFP4, and with the forward GEMMs in high precision for the last 20% of the iterations
(``--fp4-bf16-forward-from-iteration``)."""


def recipes(a) -> None:
    """One run per (level, recipe, --fp8-activations) of :data:`RECIPE_VARIANTS` on the demo GPT; a table and JSON."""
    out = Path(a.out or ROOT / "benchmarks" / "results" / "loss_parity_recipes")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    variants = [v for v in RECIPE_VARIANTS
                if v[0] == "none" or (not a.recipe_names and not a.recipe_variants)
                or (a.recipe_names and v[1].split(" ")[0] in a.recipe_names)
                or (a.recipe_variants and ((v[1] in a.recipe_variants and v[0] == "O2")
                                           or f"{v[0]}:{v[1]}" in a.recipe_variants))]
    for level, recipe, act in variants:
        log = out.parent / f"{out.name}_{level}_{recipe.replace(' ', '_')}{'_act' if act else ''}.jsonl"
        log.unlink(missing_ok=True)
        cmd = [sys.executable, "pretrain_gpt.py", "--num-layers", "4", "--hidden-size", "128", "--num-attention-heads",
               "4", "--seq-length", "128", "--micro-batch-size", "16", "--global-batch-size", "16",
               "--train-iters", str(a.iters), "--lr", "1e-3", "--min-lr", "1e-4",
               "--lr-warmup-iters", str(max(1, a.iters // 10)), "--eval-interval", str(a.iters), "--eval-iters", "8",
               "--fp8-opt-level", level, "--no-progress", "--log-interval", "10",
               "--log-json", str(log)] + (["--fp8-activations"] if act else [])
        if level != "none" and recipe in NVFP4_FLAGS:
            last20 = str(a.iters - a.iters // 5 + 1)
            cmd += ["--fp4-format", "e2m1", "--fp4-recipe", "nvfp4",
                    *(f.replace("{last20}", last20) for f in NVFP4_FLAGS[recipe])]
        elif level != "none":  # an FP8 flag at the baseline is refused (it would have no effect)
            cmd += ["--fp8-recipe", recipe]
        subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        summary = next(json.loads(line)["summary"][0] for line in log.read_text().splitlines() if "summary" in line)
        rows.append({"level": level, "recipe": recipe, "fp8_activations": act,
                     "final_train_loss": summary["final_train_loss"], "final_val_loss": summary["final_val_loss"],
                     "tokens_per_s": summary["tokens_per_s"]})
    base = rows[0]
    print(f"demo GPT (4 layers, hidden 128, 16 x 128 tokens per iteration), {a.iters} iterations, one process")
    print(f"{'level':<6}{'recipe':<30}{'FP8 act':>8}{'train loss':>12}{'vs none':>9}{'val loss':>10}{'vs none':>9}")
    for r in rows:
        r["train_vs_none"] = r["final_train_loss"] / base["final_train_loss"] - 1
        r["val_vs_none"] = r["final_val_loss"] / base["final_val_loss"] - 1
        print(f"{r['level']:<6}{r['recipe']:<30}{'yes' if r['fp8_activations'] else 'no':>8}"
              f"{r['final_train_loss']:>12.4f}{r['train_vs_none']:>+9.2%}{r['final_val_loss']:>10.4f}"
              f"{r['val_vs_none']:>+9.2%}")
    out.with_suffix(".json").write_text(json.dumps({"iters": a.iters, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
