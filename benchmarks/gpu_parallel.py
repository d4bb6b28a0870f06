"""Two-GPU runs of ``make gpu-check``: ``pretrain_gpt.py`` under ``torchrun --nproc_per_node 2`` at PP2 and TP2+SP.

    python benchmarks/gpu_parallel.py                 # with >= 2 GPUs: both runs; with fewer: says why they are skipped
    python benchmarks/gpu_parallel.py --dry-run       # any machine: the commands, each configuration validated
                                                      # by pretrain_gpt.py --dry-run (CPU, no torchrun)
    make gpu-check                                    # runs this before benchmarks/gpu_step.py

Each run trains a small GPT on mock data at ``--fp8-opt-level O2`` (4 layers, hidden 2048, FFN 8192, 16 heads,
seq 1024, 4 micro-batches of 2; ``--fp8-min-dim 0``, so every linear is FP8 at its per-rank GEMM size, TP2's
halves included) for ``--iters`` iterations, once with ``--pipeline-model-parallel-size 2`` and once with
``--tensor-model-parallel-size 2 --sequence-parallel``, each with ``--log-json`` and ``--collective-trace``
under ``--out-dir``, killed (with its workers) after ``--timeout-s``. After each run
``tools/check_collective_trace.py`` checks the trace against NCCL's rules. Per run the JSON
(``--json``) holds the exit status, the final train loss, tokens/s, the number of FP8 weights, and the trace
check's status; the exit status is 1 when a run or a trace check failed, 0 otherwise (also when skipped).
GPUs are counted with ``nvidia-smi -L`` (``--gpus`` overrides).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODEL = ["--num-layers", "4", "--hidden-size", "2048", "--ffn-hidden-size", "8192", "--num-attention-heads", "16",
         "--seq-length", "1024", "--vocab-size", "32768", "--micro-batch-size", "2", "--global-batch-size", "8"]
RUNS = {
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
}
TIMEOUT_RC = 124  # as coreutils' timeout


def count_gpus() -> tuple[int, str]:
    """GPUs that ``nvidia-smi -L`` lists, and how that was found out (for the skip message)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0, "nvidia-smi is not installed"
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return 0, f"nvidia-smi -L failed ({error})"
    n = sum(1 for line in out.splitlines() if line.startswith("GPU "))
    return n, f"nvidia-smi -L lists {n} GPU{'s' if n != 1 else ''}"


def train_args(name: str, iters: int, run_dir: Path) -> list[str]:
    """``pretrain_gpt.py`` arguments of run ``name`` (a key of :data:`RUNS`), writing under ``run_dir``."""
    return [*MODEL, *RUNS[name], "--mock-data", "--fp8-opt-level", "O2", "--fp8-min-dim", "0", "--bf16",
            "--train-iters", str(iters), "--log-interval", str(max(1, iters // 4)), "--eval-interval", str(iters),
            "--eval-iters", "1", "--no-progress", "--log-json", str(run_dir / "log.jsonl"),
            "--collective-trace", str(run_dir / "trace")]


def torchrun_command(name: str, iters: int, run_dir: Path) -> list[str]:
    """``torchrun --standalone --nproc_per_node 2 pretrain_gpt.py ...`` (as ``python -m torch.distributed.run``:
    the same entry point, from this interpreter)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(ROOT / "pretrain_gpt.py"), *train_args(name, iters, run_dir)]


def display(cmd: list[str]) -> str:
    """``cmd`` as a person would type it (``torchrun``, paths relative to the repository)."""
    words = ["torchrun", *cmd[3:]] if cmd[1:3] == ["-m", "torch.distributed.run"] else cmd
    return " ".join(os.path.relpath(w, ROOT) if w.startswith(str(ROOT)) else w for w in words)


def run_with_timeout(cmd: list[str], timeout_s: float, log_path: Path) -> tuple[int, float]:
    """Run ``cmd`` (stdout and stderr to ``log_path``) in its own process group, killed with everything it
    started after ``timeout_s``: ``(exit status, seconds)``, status 124 on a timeout."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = TIMEOUT_RC
    return rc, time.perf_counter() - start


def summarize_log(path: Path) -> dict:
    """Final train loss, tokens/s (after the first iteration) and FP8 weights from a ``--log-json`` file; the
    last iteration's loss when the run ended before its summary line; ``{}`` without a file."""
    if not path.exists():
        return {}
    iterations, summary = [], None
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if "summary" in record:
            summary = record["summary"][-1]
        elif "iteration" in record:
            iterations.append(record)
    out = {"iterations": len(iterations)}
    if summary is not None:
        out.update(final_loss=summary.get("final_train_loss"), tokens_per_s=summary.get("tokens_per_s"),
                   fp8_weights=summary.get("fp8_weights"), skipped_steps=summary.get("skipped_steps"))
    elif iterations:
        out.update(final_loss=iterations[-1].get("loss"), tokens_per_s=iterations[-1].get("tokens_per_s"))
    for key in ("final_loss", "tokens_per_s"):
        if isinstance(out.get(key), float):
            out[key] = round(out[key], 4 if key == "final_loss" else 1)
    return out


def check_trace(trace_dir: Path) -> dict:
    """``tools/check_collective_trace.py trace_dir``: ``status`` ok / violation / no trace / checker missing,
    its exit status and the end of its output."""
    checker = ROOT / "tools" / "check_collective_trace.py"
    if not checker.exists():
        return {"status": "checker missing", "detail": f"{checker.relative_to(ROOT)} not found"}
    if not trace_dir.is_dir() or not any(trace_dir.glob("rank*.jsonl")):
        return {"status": "no trace", "detail": f"no rank*.jsonl in {trace_dir}"}
    proc = subprocess.run([sys.executable, str(checker), str(trace_dir)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    return {"status": "ok" if proc.returncode == 0 else "violation", "rc": proc.returncode,
            "detail": (proc.stdout + proc.stderr).strip()[-1500:]}


def run_ok(result: dict) -> bool:
    """A run passed: exit status 0, a finite final loss, and a clean (or, without the checker, absent) trace check."""
    loss = result.get("final_loss")
    return (result.get("rc") == 0 and isinstance(loss, (int, float)) and math.isfinite(loss)
            and result.get("trace_check", {}).get("status") in ("ok", "checker missing"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="benchmarks/results/gpu_check_parallel.json")
    parser.add_argument("--out-dir", default="benchmarks/results/gpu_parallel",
                        help="per run: NAME/log.jsonl, NAME/trace/rank<R>.jsonl, NAME/output.log")
    parser.add_argument("--timeout-s", type=float, default=90.0, help="per run; the run and its workers are killed after it")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--gpus", type=int, default=None, help="GPU count to assume (default: nvidia-smi -L)")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the commands and validate each configuration with pretrain_gpt.py --dry-run "
                             "(CPU, no torchrun, no GPU needed)")
    args = parser.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {list(RUNS)}")
    gpus, how = (args.gpus, f"--gpus {args.gpus}") if args.gpus is not None else count_gpus()
    out_dir = Path(args.out_dir)
    start = time.perf_counter()
    report: dict = {"mode": "dry-run" if args.dry_run else "run", "gpus": gpus, "timeout_s": args.timeout_s,
                    "iters": args.iters, "runs": []}
    status = 0
    if not args.dry_run and gpus < 2:
        report["skipped"] = f"the two-GPU runs (PP2, TP2+SP) need 2 GPUs: {how}"
        print(f"gpu-check: two-GPU runs skipped: {report['skipped']}")
    for name in names if "skipped" not in report else []:
        run_dir = out_dir / name
        cmd = torchrun_command(name, args.iters, run_dir)
        result: dict = {"run": name, "command": display(cmd)}
        if args.dry_run:  # validate the configuration as a 2-rank job, on the meta device
            proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *train_args(name, args.iters, run_dir),
                                   "--dry-run", "--data-parallel-size", "1"], cwd=ROOT, capture_output=True, text=True,
                                  timeout=300)
            first = next((line for line in proc.stdout.splitlines() if line.startswith("dry run:")), "")
            result.update(validate_rc=proc.returncode, validate=first)
            print(f"gpu-check (dry run) {name}: {result['command']}\n  pretrain_gpt.py --dry-run: exit {proc.returncode}: "
                  f"{first}")
            if proc.returncode != 0:
                result["validate_tail"] = (proc.stdout + proc.stderr).strip()[-1500:]
                print(result["validate_tail"])
            status |= proc.returncode != 0
            report["runs"].append(result)
            continue
        if run_dir.exists():
            shutil.rmtree(run_dir)  # no stale log or trace from an earlier run
        run_dir.mkdir(parents=True)
        print(f"gpu-check: {name}: {result['command']}", flush=True)
        rc, seconds = run_with_timeout(cmd, args.timeout_s, run_dir / "output.log")
        result.update(rc=rc, seconds=round(seconds, 1), output=str(run_dir / "output.log"),
                      **({"timed_out": True} if rc == TIMEOUT_RC else {}))
        result.update(summarize_log(run_dir / "log.jsonl"))
        result["trace_check"] = check_trace(run_dir / "trace")
        result["ok"] = run_ok(result)
        status |= not result["ok"]
        print(f"gpu-check: {name}: {'PASS' if result['ok'] else 'FAIL'} exit {rc}"
              f"{' (timed out)' if rc == TIMEOUT_RC else ''} in {seconds:.0f} s, final loss {result.get('final_loss')}, "
              f"{result.get('tokens_per_s')} tok/s, trace check: {result['trace_check']['status']}", flush=True)
        if rc != 0:
            tail = (run_dir / "output.log").read_text(errors="replace").strip().splitlines()[-15:]
            print("\n".join("    " + line for line in tail))
        report["runs"].append(result)
    report["ok"] = status == 0
    report["seconds"] = round(time.perf_counter() - start, 1)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.json}")
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
