"""End-to-end GPU step benchmark: a Llama-style model and single linears, BF16 vs fp8lm vs torchao.

    python benchmarks/gpu_step.py              # full mode (needs CUDA; budget --budget-s, default 240 s)
    python benchmarks/gpu_step.py --smoke      # tiny shapes, same code paths (automatic without CUDA)
    make gpu-check                             # the CUDA tests, the two-GPU runs (benchmarks/gpu_parallel.py)
                                               # with two GPUs, then this, writing benchmarks/results/gpu_check.json

Model section: the 1.2B Llama-style model (hidden 4096, FFN 14336 SwiGLU, 32 heads, 4 layers, vocab 32000,
batch 4 x 2048 tokens; AdamW): tokens/s and peak memory for pure BF16 (BF16 weights and AdamW states),
BF16 AMP with FP32 masters (FP32 weights and AdamW states, BF16 autocast), fp8lm O1/O2/O3 (O3 on a
one-rank group; ``fp8.initialize``'s default selection: linears under ``min_fp8_dim`` stay BF16), O2 with the
``rowwise`` and ``blockwise`` recipes and O2 blockwise with ``fp8_activations`` (FP8 activation compression), torchao
float8 training (tensorwise, rowwise) when torchao is installed, and Transformer Engine (``te.Linear`` under
``fp8_autocast``, delayed scaling, eager) when it is installed; the other models run under torch.compile.
A variant that fails is recorded with its error and the others still run. Linear section: fwd+bwd time of
one linear at (tokens x in x out) 16384x4096x4096, 16384x4096x14336, 16384x14336x4096 and 16384x1024x1024
(the shapes of docs/gpu.md) for BF16, fp8lm (through ``fp8.convert.convert_to_float8_linear``, so a layer
under the default ``min_fp8_dim`` falls back to BF16, flagged ``fp8: false``) and torchao. Prints tables,
checks the issue's targets (full mode), writes JSON to benchmarks/results/gpu_step[_smoke].json (or --json).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fp8  # noqa: E402


@dataclass(frozen=True)
class ModelShape:
    """Llama-style model and batch shape."""

    hidden: int
    ffn: int
    heads: int
    layers: int
    vocab: int
    batch: int
    seq: int

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} must be a multiple of heads={self.heads}")


FULL = ModelShape(hidden=4096, ffn=14336, heads=32, layers=4, vocab=32000, batch=4, seq=2048)
SMOKE = ModelShape(hidden=64, ffn=224, heads=4, layers=2, vocab=256, batch=2, seq=32)
FULL_LINEARS = [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096), (16384, 1024, 1024)]
SMOKE_LINEARS = [(256, 64, 64), (256, 64, 224), (256, 224, 64), (256, 32, 32)]


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), eps=1e-5)


class Block(nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.heads = s.heads
        self.attn_norm, self.mlp_norm = RMSNorm(s.hidden), RMSNorm(s.hidden)
        self.qkv = nn.Linear(s.hidden, 3 * s.hidden, bias=False)
        self.proj = nn.Linear(s.hidden, s.hidden, bias=False)
        self.gate = nn.Linear(s.hidden, s.ffn, bias=False)
        self.up = nn.Linear(s.hidden, s.ffn, bias=False)
        self.down = nn.Linear(s.ffn, s.hidden, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Llama-style decoder (RMSNorm, causal SDPA attention, SwiGLU MLP, untied LM head)."""

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.hidden)
        self.blocks = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.norm = RMSNorm(s.hidden)
        self.head = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _reset_memory(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device):
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None


def _transformer_engine():
    """``(te, DelayedScaling, Format)`` when Transformer Engine's PyTorch API imports (it needs CUDA), else None."""
    try:
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling, Format
    except Exception:  # noqa: BLE001 - ImportError, or a CUDA/driver mismatch raised at import
        return None
    return te, DelayedScaling, Format


def _swap_te_linears(module: nn.Module, te) -> None:
    """Replace every ``nn.Linear`` of ``module`` by a BF16 ``te.Linear`` (weights copied)."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            new = te.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                            params_dtype=torch.bfloat16)
            with torch.no_grad():
                new.weight.copy_(child.weight)
                if child.bias is not None:
                    new.bias.copy_(child.bias)
            setattr(module, name, new)
        else:
            _swap_te_linears(child, te)


def _torchao():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return None
    return Float8LinearConfig, convert_to_float8_training


@contextlib.contextmanager
def _one_rank_group(device):
    """A one-rank process group for O3 (its sharded optimizer equals O2 at one rank)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


def build_variant(name: str, s: ModelShape, device, fp8_dtype, compile_model: bool):
    """``(step_fn, note)`` for one training set-up; ``step_fn`` runs one step on fixed random tokens."""
    torch.manual_seed(0)
    note = ""
    tokens = torch.randint(0, s.vocab, (s.batch, s.seq + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    context = contextlib.nullcontext  # a fresh context manager per step (TE's fp8_autocast is single-use)
    if name == "bf16":
        model = Llama(s).to(device, torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif name == "bf16_mixed":
        model = Llama(s).to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        context = partial(torch.autocast, device.type, dtype=torch.bfloat16)
    elif name in ("O1", "O2", "O3"):
        model = Llama(s).to(device, fp8_dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = fp8.initialize(model, optimizer, name)
        note = f"model dtype {str(fp8_dtype).replace('torch.', '')}"
    elif name.startswith("O2_"):  # O2_rowwise, O2_blockwise, O2_blockwise_act
        recipe = name.split("_")[1]
        model = Llama(s).to(device, fp8_dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = fp8.initialize(model, optimizer, "O2", recipe=recipe, fp8_activations=name.endswith("_act"))
        note = f"model dtype {str(fp8_dtype).replace('torch.', '')}, recipe {recipe}" + (
            ", FP8 activations (eager: saved-tensor hooks)" if name.endswith("_act") else "")
        if name.endswith("_act"):
            compile_model = False  # saved-tensor hooks run in eager mode
    elif name.startswith("torchao_"):
        config_cls, convert = _torchao()
        model = Llama(s).to(device, torch.bfloat16)
        convert(model, config=config_cls.from_recipe_name(name.split("_", 1)[1]),
                module_filter_fn=lambda m, fqn: m.in_features % 16 == 0 and m.out_features % 16 == 0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    elif name == "te_delayed":
        te, recipe_cls, fmt = _transformer_engine()
        model = Llama(s).to(device, torch.bfloat16)
        _swap_te_linears(model, te)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        recipe = recipe_cls(fp8_format=fmt.HYBRID, amax_history_len=16, amax_compute_algo="max")
        context = partial(te.fp8_autocast, enabled=True, fp8_recipe=recipe)
        compile_model = False  # Transformer Engine's modules run eagerly
        note = "eager, BF16 weights and AdamW states"
    else:
        raise ValueError(f"unknown variant {name!r}")
    run = torch.compile(model) if compile_model else model

    def step():
        with context():
            logits = run(inputs)
        loss = F.cross_entropy(logits.float().reshape(-1, s.vocab), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    params = sum(p.numel() for p in model.parameters())
    return step, params, note


def bench_model(s: ModelShape, device, variants, fp8_dtype, compile_model, warmup, iters, deadline):
    rows = []
    for name in variants:
        if time.perf_counter() > deadline:
            rows.append(dict(variant=name, skipped="time budget spent"))
            continue
        _reset_memory(device)
        context = _one_rank_group(device) if name == "O3" else contextlib.nullcontext()
        try:
            with context:
                start = time.perf_counter()
                step, params, note = build_variant(name, s, device, fp8_dtype, compile_model)
                step()  # compile / first step
                first_s = time.perf_counter() - start
                ms = _time_ms(step, device, warmup, iters)
                rows.append(dict(variant=name, params_M=round(params / 1e6, 1), ms=round(ms, 2),
                                 tok_per_s=round(s.batch * s.seq / ms * 1e3), peak_GiB=_peak_gib(device),
                                 first_step_s=round(first_s, 1), note=note))
                del step
        except Exception as error:  # noqa: BLE001 - one failing variant must not lose the others' figures
            rows.append(dict(variant=name, skipped=f"error: {type(error).__name__}: {str(error)[:300]}"))
        gc.collect()
    return rows


def _fp8lm_linear(layer: nn.Linear) -> tuple[nn.Module, bool]:
    """The layer as ``fp8.initialize`` would convert it: FP8 unless under the default ``min_fp8_dim``."""
    from fp8.convert import convert_to_float8_linear

    model, converted = convert_to_float8_linear(nn.Sequential(layer))
    return model, bool(converted)


def bench_linears(shapes, device, fp8_dtype, compile_model, warmup, iters, deadline):
    rows = []
    ao = _torchao()
    for m, k, n in shapes:
        variants = ["bf16", "fp8lm"] + (["torchao_tensorwise", "torchao_rowwise"] if ao else [])
        for name in variants:
            if time.perf_counter() > deadline:
                rows.append(dict(M=m, K=k, N=n, variant=name, skipped="time budget spent"))
                continue
            try:
                torch.manual_seed(0)
                dtype = fp8_dtype if name == "fp8lm" else torch.bfloat16
                layer = nn.Linear(k, n, bias=False).to(device, dtype)
                is_fp8 = name != "bf16"
                if name == "fp8lm":
                    layer, is_fp8 = _fp8lm_linear(layer)
                elif name.startswith("torchao_"):
                    config_cls, convert = ao
                    layer = nn.Sequential(layer)
                    convert(layer, config=config_cls.from_recipe_name(name.split("_", 1)[1]))
                run = torch.compile(layer) if compile_model else layer
                x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
                grad = torch.randn(m, n, device=device, dtype=dtype)

                def step():
                    run(x).backward(grad)
                    x.grad = None
                    for p in layer.parameters():
                        p.grad = None

                step()
                ms = _time_ms(step, device, warmup, iters)
                rows.append(dict(M=m, K=k, N=n, variant=name, fp8=is_fp8, ms=round(ms, 3),
                                 tflops=round(6 * m * k * n / ms / 1e9, 1)))
            except Exception as error:  # noqa: BLE001
                rows.append(dict(M=m, K=k, N=n, variant=name, skipped=f"error: {type(error).__name__}: {str(error)[:200]}"))
    for r in rows:  # speed-up over BF16 at the same shape
        base = next((b for b in rows if b["variant"] == "bf16" and (b["M"], b["K"], b["N"]) == (r["M"], r["K"], r["N"])
                     and "ms" in b), None)
        if base is not None and "ms" in r:
            r["speedup_vs_bf16"] = round(base["ms"] / r["ms"], 3)
    return rows


def check_targets(model_rows, linear_rows) -> list[str]:
    """The issue's targets, as PASS/FAIL lines (full mode): O2 tokens/s >= 1.45x pure BF16 and >= torchao
    tensorwise; O2 peak memory <= 0.6x BF16 AMP with FP32 masters; no listed linear slower than BF16 through
    fp8lm (layers under min_fp8_dim fall back to BF16)."""
    by = {r["variant"]: r for r in model_rows if "ms" in r}
    lines = []
    if "bf16" in by and "O2" in by:
        ratio = by["O2"]["tok_per_s"] / by["bf16"]["tok_per_s"]
        lines.append(f"{'PASS' if ratio >= 1.45 else 'FAIL'} O2 tokens/s vs pure BF16: {ratio:.2f}x (target >= 1.45x)")
    if "torchao_tensorwise" in by and "O2" in by:
        ratio = by["O2"]["tok_per_s"] / by["torchao_tensorwise"]["tok_per_s"]
        lines.append(f"{'PASS' if ratio >= 1.0 else 'FAIL'} O2 tokens/s vs torchao tensorwise: {ratio:.2f}x (target >= 1.00x)")
    if "bf16" in by and "O2_blockwise" in by:
        ratio = by["O2_blockwise"]["tok_per_s"] / by["bf16"]["tok_per_s"]
        lines.append(f"{'PASS' if ratio >= 1.3 else 'FAIL'} O2 blockwise tokens/s vs pure BF16: {ratio:.2f}x (target >= 1.30x)")
    if "O2_blockwise" in by and "O2_blockwise_act" in by and by["O2_blockwise"]["peak_GiB"]:
        memory = by["O2_blockwise_act"]["peak_GiB"] / by["O2_blockwise"]["peak_GiB"]
        speed = by["O2_blockwise_act"]["tok_per_s"] / by["O2_blockwise"]["tok_per_s"]
        ok = memory < 1.0 and speed >= 0.95
        lines.append(f"{'PASS' if ok else 'FAIL'} fp8_activations (O2 blockwise): peak memory {memory:.2f}x, tokens/s "
                     f"{speed:.2f}x (target: lower memory, tokens/s >= 0.95x)")
    if "bf16_mixed" in by and "O2" in by and by["O2"]["peak_GiB"]:
        ratio = by["O2"]["peak_GiB"] / by["bf16_mixed"]["peak_GiB"]
        lines.append(f"{'PASS' if ratio <= 0.6 else 'FAIL'} O2 peak memory vs BF16 AMP with FP32 masters: {ratio:.2f}x "
                     f"(target <= 0.60x)")
    for r in linear_rows:
        if r["variant"] == "fp8lm" and "speedup_vs_bf16" in r:
            how = "FP8" if r.get("fp8") else "BF16 fallback"
            lines.append(f"{'PASS' if r['speedup_vs_bf16'] >= 1.0 else 'FAIL'} linear {(r['M'], r['K'], r['N'])}: fp8lm "
                         f"({how}) {r['speedup_vs_bf16']:.2f}x BF16 (target >= 1.00x)")
    return lines


def _parallel_line(parallel: dict) -> str:
    """One line on the two-GPU runs of benchmarks/gpu_parallel.py (skipped, or PASS/FAIL per run)."""
    if "skipped" in parallel:
        return f"two-GPU runs skipped: {parallel['skipped']}"
    runs = [f"{r['run']} {'PASS' if r.get('ok') else 'FAIL'} (exit {r.get('rc')}, loss {r.get('final_loss')}, "
            f"{r.get('tokens_per_s')} tok/s, trace {r.get('trace_check', {}).get('status')})" for r in parallel["runs"]]
    return "two-GPU runs: " + ("; ".join(runs) or "none")


def _table(rows, columns) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns]
    lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines.append("-|-".join("-" * w for w in widths))
    for r in rows:
        cells = ["" if c not in r else "n/a" if r[c] is None else str(r[c]) for c in columns]
        lines.append(" | ".join(cell.ljust(w) for cell, w in zip(cells, widths)))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on any device (automatic without CUDA)")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="torch.compile the models and linears (auto: on in full mode, off in smoke mode, where "
                             "CPU compiles would take minutes)")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=240.0, help="skip the remaining cases after this many seconds")
    parser.add_argument("--json", default=None)
    parser.add_argument("--parallel-json", default=None,
                        help="the JSON of benchmarks/gpu_parallel.py (make gpu-check runs it first): merged into this "
                             "one's JSON as 'parallel', and its seconds are taken off --budget-s")
    args = parser.parse_args()
    parallel = None
    if args.parallel_json and os.path.exists(args.parallel_json):
        with open(args.parallel_json) as f:
            parallel = json.load(f)
        spent = float(parallel.get("seconds", 0.0))
        if spent > 1:
            args.budget_s = max(60.0, args.budget_s - spent)
            print(f"two-GPU runs took {spent:.0f} s: benchmark budget {args.budget_s:.0f} s")
    cuda = torch.cuda.is_available()
    smoke = args.smoke or not cuda
    if not cuda and not args.smoke:
        print("no CUDA device: running the CPU smoke mode (tiny shapes; timings say nothing about GPUs)")
    device = torch.device("cuda" if cuda else "cpu")
    shape = SMOKE if smoke else FULL
    fp8_dtype = torch.bfloat16 if cuda else torch.float32  # CPU: fp32 high precision (bf16 is slow there)
    warmup, iters = (1, args.iters or 3) if smoke else (3, args.iters or 10)
    compile_model = args.compile == "on" or (args.compile == "auto" and not smoke)
    deadline = time.perf_counter() + args.budget_s
    variants = ["bf16", "bf16_mixed", "O1", "O2", "O3", "O2_rowwise", "O2_blockwise", "O2_blockwise_act"]
    notes = []
    if _torchao():
        variants += ["torchao_tensorwise", "torchao_rowwise"]
    else:
        notes.append("torchao not installed: its float8 rows skipped (pip install torchao)")
    if cuda and _transformer_engine():
        variants.append("te_delayed")
    else:
        notes.append("Transformer Engine not installed (or no CUDA): its row skipped")
    start = time.perf_counter()
    model_rows = bench_model(shape, device, variants, fp8_dtype, compile_model, warmup, iters, deadline)
    linear_rows = bench_linears(SMOKE_LINEARS if smoke else FULL_LINEARS, device, fp8_dtype, compile_model,
                                warmup, iters, deadline)
    elapsed = time.perf_counter() - start
    title = f"{'smoke' if smoke else 'full'} mode, {'compiled' if compile_model else 'eager'}, on {torch.cuda.get_device_name() if cuda else platform.processor() or 'CPU'}"
    print(f"\n== model step ({title}; {asdict(shape)})")
    print(_table(model_rows, ["variant", "params_M", "ms", "tok_per_s", "peak_GiB", "first_step_s", "note", "skipped"]))
    print("\n== single linear fwd+bwd (tokens M x in K x out N)")
    print(_table(linear_rows, ["M", "K", "N", "variant", "fp8", "ms", "tflops", "speedup_vs_bf16", "skipped"]))
    targets = check_targets(model_rows, linear_rows) if not smoke else ["targets are checked in full mode on a GPU only"]
    for line in notes + targets:
        print(line)
    if parallel is not None:
        print(_parallel_line(parallel))
    print(f"total {elapsed:.0f} s")
    path = args.json or f"benchmarks/results/gpu_step{'_smoke' if smoke else ''}.json"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(mode="smoke" if smoke else "full", device=str(device), torch=torch.__version__,
                       gpu=torch.cuda.get_device_name() if cuda else None, model_shape=asdict(shape),
                       compile=compile_model, model=model_rows, linear=linear_rows, targets=targets, notes=notes,
                       seconds=round(elapsed, 1), **({} if parallel is None else {"parallel": parallel})), f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
