"""Training output: a progress display (or plain lines) on the terminal, one JSON object per iteration
in ``--log-json``, the same as scalars for TensorBoard / W&B (``--tensorboard-dir``, ``--wandb-project``), and the
side-by-side summary and loss-curve PNG of the levels trained."""

from __future__ import annotations

import json
import math
import os
import sys
import time

from ..config import RunConfig
from .scalar_writers import scalar_writers

__all__ = ["TrainingLogger", "plot_loss_curves", "format_summary"]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


def format_summary(summaries: list[dict]) -> str:
    """The side-by-side table of the levels' final losses, speed, state memory and traffic.

    The ``vs base`` column compares each level's validation loss with the baseline's (level ``none``) only
    when the baseline was trained in this run; otherwise it reads ``-`` and a line says how to train it."""
    base = next((s for s in summaries if s["level"] == "none"), None)
    lines = [
        f"{'level':<6} {'train loss':>10} {'val loss':>9} {'vs base':>8} {'tokens/s':>9} {'state B/param':>13} "
        f"{'comm/iter':>10} {'skipped':>7}",
    ]
    for s in summaries:
        evaluated = base is not None and _number(base["final_val_loss"]) and _number(s["final_val_loss"])
        if evaluated and base["final_val_loss"]:
            vs_base = f"{(s['final_val_loss'] / base['final_val_loss'] - 1) * 100:>+7.2f}%"
        else:
            vs_base = f"{'-':>8}"
        val = f"{s['final_val_loss']:>9.4f}" if _number(s["final_val_loss"]) else f"{'-':>9}"
        comm = sum(s["comm_bytes_per_iteration"].values())
        lines.append(
            f"{s['level']:<6} {s['final_train_loss']:>10.4f} {val} {vs_base} "
            f"{s['tokens_per_s']:>9.0f} {s['model_state_bytes_per_param']:>13.2f} {_fmt_bytes(comm):>10} "
            f"{s['skipped_steps']:>7}"
        )
    tags = sorted({t for s in summaries for t, b in s["comm_bytes_per_iteration"].items() if b > 0})
    if tags:
        lines.append("bytes sent per iteration by this rank, by what travelled:")
        for tag in tags:
            row = "  ".join(f"{s['level']}={_fmt_bytes(s['comm_bytes_per_iteration'].get(tag, 0.0))}" for s in summaries)
            lines.append(f"  {tag:<22} {row}")
    if base is None:
        lines.append("vs base: no baseline was trained in this run (add --compare none to train one beside it)")
    return "\n".join(lines)


def _number(value) -> bool:
    """A loss that was measured (a level stopped or run without evaluation has NaN)."""
    return value is not None and not math.isnan(value)


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_loss_curves(histories: list[dict], path: str, title: str = "") -> str:
    """Write a PNG of train (smoothed) and validation loss per level, and (with a ``none`` baseline) each
    level's smoothed train loss relative to the baseline's; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = next((h for h in histories if h["level"] == "none"), None)
    rows = 2 if base is not None and len(histories) > 1 else 1
    fig, axes = plt.subplots(rows, 1, figsize=(8, 5 if rows == 1 else 7.5), sharex=True,
                             gridspec_kw={"height_ratios": [3, 2]} if rows == 2 else None, squeeze=False)
    ax = axes[0][0]
    window = max(1, max(len(h["train"]) for h in histories) // 30)
    smoothed, colors = {}, {}
    for h in histories:
        its = [r["iteration"] for r in h["train"]]
        smoothed[h["level"]] = (its, _smooth([r["loss"] for r in h["train"]], window))
        (line,) = ax.plot(*smoothed[h["level"]], label=f"{h['level']} train")
        colors[h["level"]] = line.get_color()
        if h["valid"]:
            ax.plot([v["iteration"] for v in h["valid"]], [v["val_loss"] for v in h["valid"]], "o--",
                    color=line.get_color(), label=f"{h['level']} valid")
    ax.set_ylabel("loss")
    ax.set_title(title or ("GPT loss: FP8 levels vs baseline" if base is not None else "GPT loss by level"))
    ax.grid(alpha=0.3)
    ax.legend()
    if rows == 2:
        diff_ax = axes[1][0]
        base_its, base_loss = smoothed["none"]
        ref = dict(zip(base_its, base_loss))
        for h in histories:
            if h["level"] == "none":
                continue
            its, loss = smoothed[h["level"]]
            pts = [(i, (v / ref[i] - 1) * 100) for i, v in zip(its, loss) if i in ref and i > window]
            diff_ax.plot([p[0] for p in pts], [p[1] for p in pts], label=h["level"], color=colors[h["level"]])
        diff_ax.axhline(0, color="black", linewidth=0.8)
        diff_ax.set_ylabel(f"train loss vs none (%), {window}-it. mean")
        diff_ax.grid(alpha=0.3)
        diff_ax.legend()
    axes[-1][0].set_xlabel("iteration")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


class TrainingLogger:
    """Terminal and JSON output of a run; only the logging rank writes (the last stage's first rank)."""

    def __init__(self, cfg: RunConfig, rank: int, is_logging_rank: bool) -> None:
        self.cfg = cfg
        self.active = is_logging_rank
        self.tty = sys.stdout.isatty() and not cfg.logging.no_progress
        self.json = None
        if self.active and cfg.logging.log_json:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.logging.log_json)), exist_ok=True)
            self.json = open(cfg.logging.log_json, "w", encoding="utf-8")
        self.level = None
        self.total = 0
        self.t_start = time.perf_counter()
        # --tensorboard-dir / --wandb-project: the same records as scalars (megatron/training/monitoring/scalar_writers.py)
        self.writers = (scalar_writers(cfg.logging.tensorboard_dir, cfg.logging.wandb_project)
                        if self.active else [])

    def _print(self, text: str) -> None:
        if self.active:
            print(text, flush=True)

    def banner(self, datasets, world_size: int) -> None:
        m, par, t, data = self.cfg.model, self.cfg.parallel, self.cfg.training, datasets.data
        self._print(
            f"fp8lm pretrain_gpt: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, seq "
            f"{m.seq_length}, vocab {datasets.vocab_size}; world {world_size} = TP {par.tensor_model_parallel_size} x PP "
            f"{par.pipeline_model_parallel_size} x DP {par.data_parallel_size}"
            f"{' + SP' if par.sequence_parallel else ''}; global batch {t.global_batch_size} "
            f"({t.num_microbatches} micro-batches of {t.micro_batch_size}); data: "
            f"{'mock' if data.mock_data else data.data_path}"
        )

    def start_level(self, level: str, total: int, start: int) -> None:
        self.level, self.total = level, total
        self.t_level = time.perf_counter()
        self._print(f"-- opt level {level}: training iterations {start + 1}..{total}")

    def log_iteration(self, record: dict) -> None:
        if not self.active:
            return
        if self.json is not None:
            self.json.write(json.dumps(record, default=float) + "\n")
            self.json.flush()
        for writer in self.writers:
            writer.add(self.level, record)
        it = record["iteration"]
        line = (f"[{self.level}] iter {it}/{self.total} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                f"grad-norm {record['grad_norm']:.3f} {record['tokens_per_s']:.0f} tok/s "
                f"comm {_fmt_bytes(record['comm_bytes_total'])}")
        if record.get("mu") is not None:
            line += f" mu {record['mu']:.3g}"
        if record["skipped_steps"]:
            line += f" skipped {record['skipped_steps']}"
        if "val_loss" in record:
            line += f" | val loss {record['val_loss']:.4f}"
        if self.tty:
            width = 24
            done = int(width * it / max(1, self.total))
            bar = "#" * done + "." * (width - done)
            end = "\n" if "val_loss" in record or it == self.total else ""
            sys.stdout.write(f"\r[{bar}] {line}\x1b[K{end}")
            sys.stdout.flush()
        elif it % self.cfg.training.log_interval == 0 or "val_loss" in record or it == self.total:
            print(line, flush=True)

    def end_level(self, summary: dict) -> None:
        val = f"{summary['final_val_loss']:.4f}" if _number(summary["final_val_loss"]) else "- (not evaluated)"
        self._print(
            f"-- opt level {summary['level']} done in {time.perf_counter() - self.t_level:.1f} s: final val loss "
            f"{val}, model state {summary['model_state_bytes_per_param']:.2f} B/param"
        )

    def finish(self, histories: list[dict]) -> None:
        if not self.active:
            return
        summaries = [h["summary"] for h in histories]
        self._print("\n" + format_summary(summaries))
        if self.json is not None:
            self.json.write(json.dumps({"summary": summaries}, default=float) + "\n")
            self.json.close()
        for writer in self.writers:
            writer.close()
        if self.cfg.logging.tensorboard_dir:
            self._print(f"TensorBoard: tensorboard --logdir {self.cfg.logging.tensorboard_dir}")
        if len(histories) > 1 or self.cfg.logging.plot:
            log = self.cfg.logging
            path = log.plot or (os.path.join(os.path.dirname(os.path.abspath(log.log_json)), "loss_curves.png")
                                if log.log_json else os.path.join("runs", "loss_curves.png"))
            plot_loss_curves(histories, path)
            self._print(f"loss curves: {path}")
        self._print(f"total time {time.perf_counter() - self.t_start:.1f} s")
        for history in histories:
            if _number(history["summary"]["final_val_loss"]):
                continue
            stopped = history.get("stopped")
            if stopped is not None:
                why = f"it stopped after iteration {stopped['iteration']} ({stopped['reason']}) before an evaluation"
            elif not self.cfg.training.eval_interval:
                why = "--eval-interval is 0 (no evaluation asked for)"
            else:
                why = "no evaluation ran"
            self._print(f"note: level {history['summary']['level']} has no validation loss: {why}")
