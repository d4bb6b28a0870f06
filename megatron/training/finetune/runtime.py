"""The run: data-parallel set-up and collectives over the ranks, the model loaded and put in FP8 (``fp8.initialize``), the schedule, clipping, batches, checksums, the JSON log and the master weights."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from .data import DataError, prepare_tokenizer

__all__ = ['Runtime', 'setup_runtime', 'teardown', 'serving_checkpoint', 'load_model', 'fp8_setup', 'lr_lambda', 'clip', 'batches', 'all_mean', 'global_sum', 'weights_checksums', 'JsonLog', 'master_state']


@dataclass
class Runtime:
    rank: int
    world: int
    device: torch.device
    distributed: bool

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_runtime(args: argparse.Namespace) -> Runtime:
    """Threads, seed, device, and under torchrun (``WORLD_SIZE`` > 1) the process group (NCCL on CUDA,
    gloo on CPU). O3 on one process gets a one-rank gloo group (the sharded optimizer needs one)."""
    import torch.distributed as dist

    if args.threads:
        torch.set_num_threads(args.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    if world > 1:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if cuda else "gloo")
        device = torch.device("cuda", local) if cuda else torch.device("cpu")
        rt = Runtime(dist.get_rank(), world, device, True)
    else:
        if args.fp8_opt_level == "O3":
            import tempfile

            store = tempfile.NamedTemporaryFile(prefix="fp8lm-finetune-pg-", delete=False).name
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
        rt = Runtime(0, 1, torch.device("cuda" if cuda else "cpu"), False)
    if args.batch_size % rt.world:
        raise DataError(f"--batch-size {args.batch_size} must be a multiple of the number of ranks ({rt.world})")
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    return rt


def teardown(rt: Runtime) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def serving_checkpoint(path: Path | None) -> bool:
    """Whether ``path`` is an FP8 serving checkpoint (``config.json``'s ``quantization_config`` names
    compressed-tensors or ``fp8``: :func:`fp8.export_fp8`'s formats, docs/serving.md)."""
    if path is None or not (Path(path) / "config.json").is_file():
        return False
    qc = json.loads((Path(path) / "config.json").read_text()).get("quantization_config") or {}
    return qc.get("quant_method") in ("compressed-tensors", "fp8")


def load_model(path: Path, device: torch.device):
    """The model (fp32, train mode) and its tokenizer (pad = EOS when missing). An FP8 serving checkpoint
    (:func:`serving_checkpoint`) is built from its config and takes its FP8 weights' exact values
    (:func:`fp8.import_fp8`; :func:`fp8_setup` then takes their bytes at the FP8 levels)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(str(path)))
    if serving_checkpoint(path):
        import fp8

        config = AutoConfig.from_pretrained(str(path))
        del config.quantization_config  # the model is built in high precision; the weights come from the file
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        fp8.import_fp8(model, path)
        model = model.to(device)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(device)
    model.config.use_cache = False
    return model, tokenizer


def fp8_setup(model, optimizer, args: argparse.Namespace, rt: Runtime, fp8_checkpoint: Path | None = None):
    """``fp8.initialize`` at ``--fp8-opt-level``/``--recipe``, then, with several ranks,
    ``fp8.distributed.DistributedDataParallel`` (O3: reducing each gradient to its owner). ``fp8_checkpoint``: the FP8
    serving checkpoint the model came from, whose E4M3 weights and scales the FP8 model then takes as stored, the
    masters set from them (:func:`fp8.import_fp8`: no round trip). Returns ``(train_model, model, optimizer)``:
    ``train_model`` is the (wrapped) module to call, ``model`` the unwrapped one."""
    import fp8

    config = fp8.Float8LinearConfig(grad_accumulation=args.fp8_grad_accumulation)
    model, optimizer = fp8.initialize(model, optimizer, args.fp8_opt_level, recipe=args.recipe, config=config,
                                      fp8_embeddings=args.fp8_embeddings and args.fp8_opt_level != "none",
                                      min_fp8_dim=args.fp8_min_dim)
    if fp8_checkpoint is not None and args.fp8_opt_level != "none":
        report = fp8.import_fp8(model, fp8_checkpoint, optimizer)
        if rt.main and (report.requantized or report.dequantized):  # said, not silent: not the file's bytes
            print(f"{fp8_checkpoint}: {len(report.exact)} FP8 weights taken as stored; re-quantized into this run's "
                  f"recipe: {', '.join(sorted(report.requantized)) or 'none'}; FP8 in the file, high precision here: "
                  f"{', '.join(report.dequantized) or 'none'}", flush=True)
    if getattr(args, "output_format", "bf16") != "bf16":  # refused now, not after training
        from fp8.export import export_problem

        problem = export_problem(model)
        if problem:
            raise DataError(f"--output-format {args.output_format}: {problem}")
    train_model = model
    if rt.distributed:
        train_model = fp8.distributed.DistributedDataParallel(
            model, o3_optimizer=optimizer if args.fp8_opt_level == "O3" else None)
    return train_model, model, optimizer


def lr_lambda(args: argparse.Namespace):
    def f(step: int) -> float:
        if step < args.warmup_steps:
            return (step + 1) / (args.warmup_steps + 1)
        progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


def clip(model, optimizer, max_norm: float) -> float | None:
    import fp8

    if max_norm <= 0:
        return None
    if hasattr(optimizer, "clip_grad_norm_"):  # the sharded (O3) optimizer clips over all ranks' shards
        return float(optimizer.clip_grad_norm_(max_norm))
    return float(fp8.clip_grad_norm_(model.parameters(), max_norm))


def batches(n: int, batch_size: int, rt: Runtime, seed: int, steps: int):
    """Per step, this rank's example indices: a shuffled pass over ``n`` examples (reshuffled each epoch), the
    global batch of ``batch_size`` split over the ranks."""
    g = random.Random(seed)
    order: list[int] = []
    per_rank = batch_size // rt.world
    for _ in range(steps):
        while len(order) < batch_size:
            perm = list(range(n))
            g.shuffle(perm)
            order += perm
        batch, order = order[:batch_size], order[batch_size:]
        yield batch[rt.rank * per_rank:(rt.rank + 1) * per_rank]


def all_mean(values: list[float], rt: Runtime) -> list[float]:
    """The mean of ``values`` over the ranks (as is with one rank)."""
    if not rt.distributed:
        return values
    from fp8.comm import Collectives

    t = torch.tensor(values, dtype=torch.float64, device=rt.device)
    Collectives().all_reduce(t, tag="finetune metrics").wait()
    return (t / rt.world).tolist()


def global_sum(t: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """``t`` summed over the ranks (a copy; ``t`` itself with one rank), on the device it lives on (no host read)."""
    if not rt.distributed:
        return t
    from fp8.comm import Collectives

    t = t.detach().clone()
    Collectives().all_reduce(t, tag="finetune token count").wait()
    return t


def weights_checksums(model, rt: Runtime) -> list[float]:
    """Per rank, a checksum of the model's weights (FP8 weights dequantized): equal values = equal weights."""
    import fp8

    total = torch.zeros((), dtype=torch.float64, device=rt.device)  # on the device: no host read per parameter
    for i, p in enumerate(model.parameters()):
        v = p.dequantize(torch.float32) if isinstance(p, fp8.Float8Tensor) else p.detach()
        v = v.double().flatten()
        total += (v * torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device).remainder(97)).sum() * (i + 1)
    if not rt.distributed:
        return [total.item()]
    from fp8.comm import Collectives

    out = torch.zeros(rt.world, dtype=torch.float64, device=rt.device)
    Collectives().all_gather(out, total.reshape(1), tag="finetune checksum").wait()
    return out.tolist()


class JsonLog:
    """Writes JSON lines (rank 0 only); prints a short line per step."""

    def __init__(self, path: Path | None, rt: Runtime) -> None:
        self.file = open(path, "w", encoding="utf-8") if (path and rt.main) else None
        self.main = rt.main

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def print(self, *a) -> None:
        if self.main:
            print(*a, flush=True)

    def close(self) -> None:
        if self.file:
            self.file.close()


def master_state(model, optimizer, level: str, rt: Runtime) -> dict[str, torch.Tensor]:
    """fp32 values of ``model``'s parameters by name, from the optimizer's master weights where it keeps them
    (O1: the wrapped optimizer's high-precision masters; O2/O3: ``master_value``, O3 broadcast from each
    tensor's owner); FP8 weights without a master are dequantized."""
    import fp8

    names = {id(p): n for n, p in model.named_parameters()}
    values: dict[str, torch.Tensor] = {}
    masters: dict[int, torch.Tensor] = {}
    if level == "O1":
        masters = {id(w): m for m, w in optimizer.pairs}
    for name, p in model.named_parameters():
        if level in ("O2", "O3") and hasattr(optimizer, "master_value"):
            if level == "O3" and rt.distributed:
                from fp8.comm import Collectives

                owner = optimizer.owner(p)
                v = (optimizer.master_value(p).detach().clone() if rt.rank == owner
                     else torch.empty(p.shape, dtype=torch.float32, device=p.device))
                Collectives().broadcast(v, tag="finetune export masters", src=owner).wait()
            else:
                v = optimizer.master_value(p)
        elif id(p) in masters:
            v = masters[id(p)]
        elif isinstance(p, fp8.Float8Tensor):
            v = p.dequantize(torch.float32)
        else:
            v = p
        values[name] = v.detach().to(torch.float32).cpu()
    assert len(values) == len(names)
    return values
