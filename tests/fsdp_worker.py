"""Worker of tests/fp8/test_fsdp.py: fp8.initialize models sharded by FSDP2 (fully_shard per block and at the root)
on ``world`` gloo ranks, against the same model and optimizer in one process on the whole batch.

For each case (a plain MLP and a tiny transformers Llama, at O1 and O2) every rank also runs the single-process
reference itself (same seed, the whole batch), so the comparison needs no exchange. Recorded per case: both loss
curves (the sharded one averaged over ranks), the bytes counted per tag, the FP8 weights' payload bytes, the scales
of every rank's shards, and the error raised by each misuse.
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

STEPS = 20


def batch_size(world: int) -> int:
    """The global batch: 8 sequences, 12 at 3 ranks (every rank the same share, so the mean of the ranks' losses is
    the whole batch's)."""
    return 12 if world % 3 == 0 else 8


def mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    block = lambda: torch.nn.Sequential(torch.nn.Linear(64, 160), torch.nn.GELU(), torch.nn.Linear(160, 64))  # noqa: E731
    return torch.nn.Sequential(torch.nn.Linear(32, 64), block(), block(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 16))


def mlp_blocks(model):
    return [model[1], model[2]]


def llama(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def llama_blocks(model):
    return list(model.model.layers)


def batches(kind: str, seed: int, world: int):
    g = torch.Generator().manual_seed(seed + 1)
    batch = batch_size(world)
    for _ in range(STEPS):
        if kind == "mlp":
            yield torch.randn(batch, 32, generator=g), torch.randn(batch, 16, generator=g)
        else:
            ids = torch.randint(0, 128, (batch, 16), generator=g)
            yield ids, ids


def loss_of(kind: str, model, x, y):
    if kind == "mlp":
        return (model(x).float() - y).pow(2).mean()
    return model(input_ids=x, labels=y).loss


def run(kind: str, level: str, seed: int, world: int, rank: int, shard: bool, reduce_scatter: str = "fp8",
        micro: int = 1, embeddings: str = "rowwise"):
    import fp8
    from fp8.comm import CommBytesCounter
    from fp8.distributed.fsdp import FSDPConfig
    from torch.distributed.fsdp import fully_shard

    model = (mlp if kind == "mlp" else llama)(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    from fp8.comm_trace import CollectiveTrace

    counter = CommBytesCounter(trace=CollectiveTrace(rank) if shard else None)  # every call, for NCCL's rules
    model, optimizer = fp8.initialize(model, optimizer, level, fsdp=FSDPConfig(reduce_scatter, counter,
                                                                              embeddings=embeddings))
    if shard:
        for block in (mlp_blocks if kind == "mlp" else llama_blocks)(model):
            fully_shard(block)
        fully_shard(model)
    losses, step_bytes = [], []
    for x, y in batches(kind, seed, world):
        if shard:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        before = counter.summary()["by_tag"]
        total = 0.0
        for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            if shard:  # FSDP2's gradient accumulation: no reduce-scatter until the last micro-batch
                model.set_requires_gradient_sync(i == micro - 1)
            loss = loss_of(kind, model, xs, ys) / micro
            loss.backward()
            total = total + loss.detach()
        loss = total
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone().reshape(1)
        if shard:
            dist.all_reduce(value)  # the test's own reading, not counted
            value /= world
        losses.append(float(value))
        after = counter.summary()["by_tag"]
        step_bytes.append({k: after[k] - before.get(k, 0.0) for k in after})
    out = {"losses": losses, "step_bytes": step_bytes}
    if shard:
        out["trace"] = list(counter.trace.calls)
        from fp8.distributed.sharding import local
        from fp8.tensor import Float8Tensor

        fp8_weights = [(n, local(p)) for n, p in model.named_parameters() if isinstance(local(p), Float8Tensor)]
        out["fp8_elements"] = sum(p.numel() for n, p in model.named_parameters() if isinstance(local(p), Float8Tensor))
        out["plain_bytes"] = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                                 if not isinstance(local(p), Float8Tensor))
        out["local_fp8_bytes"] = sum(w.payload.numel() for _, w in fp8_weights)
        out["scales"] = {n: float(w.scale) for n, w in fp8_weights}
        out["shard_types"] = sorted({type(local(p)).__name__ for _, p in model.named_parameters()})
    return out


RESUME_AT = 3  # the checkpoint is written after this many steps; the run then goes on for RESUME_AT more


def snapshot(model, optimizer) -> dict:
    """This rank's rows of every parameter (FP8 weights: payload bytes) and optimizer state, keyed as fp8.checkpoint
    keys them, each with its first row (None for a whole tensor: scales, steps)."""
    from fp8.distributed.sharding import is_dtensor, local, local_rows
    from fp8.formats import byte_view
    from fp8.tensor import Float8Tensor

    out = {}
    for name, p in model.named_parameters():
        shard = local(p)
        start = local_rows(p.shape[0], p).start if is_dtensor(p) else 0
        if isinstance(shard, Float8Tensor):
            out[f"model/{name}/payload"] = (start, byte_view(shard.payload).clone())
            out[f"model/{name}/scale"] = (None, shard.scale.clone())
        else:
            out[f"model/{name}"] = (start, shard.detach().clone())
        for key, value in optimizer.state[p].items():
            if isinstance(value, torch.Tensor):
                rows = value.dim() > 0 and value.shape[0] == shard.shape[0] and value.shape[1:] == shard.shape[1:]
                out[f"optim/{name}/{key}"] = (start if rows else None, byte_view(value).clone())
    return out


def train(model, optimizer, steps, world: int, rank: int, shard: bool, first: int = 0) -> list[float]:
    losses = []
    for step, (x, y) in enumerate(batches("llama", 0, world)):
        if step < first:
            continue
        if step >= first + steps:
            break
        if shard:
            x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = loss_of("llama", model, x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().clone().reshape(1)
        if shard:
            dist.all_reduce(value)
            value /= world
        losses.append(float(value))
    return losses


def sharded_llama(seed: int, level: str = "O2"):
    import fp8
    from torch.distributed.fsdp import fully_shard

    model = llama(seed)
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=2e-3), level)
    for block in llama_blocks(model):
        fully_shard(block)
    fully_shard(model)
    return model, optimizer


def activation_checkpointing_case(seed: int, world: int, rank: int) -> dict:
    """5 steps of the sharded Llama at O2 without and with transformers' activation checkpointing (non-reentrant:
    the blocks' forwards run again in the backward, FSDP2 gathering their FP8 weights again)."""
    import fp8
    from torch.distributed.fsdp import fully_shard

    out = {"forwards": {}}
    for checkpointing in (False, True):
        model = llama(seed)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.config.use_cache = False
        model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=2e-3), "O2")
        for block in llama_blocks(model):
            fully_shard(block)
        fully_shard(model)
        model.train()
        calls = []
        handle = model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *args: calls.append(1))
        out[checkpointing] = train(model, optimizer, 5, world, rank, True)
        handle.remove()
        out["forwards"][checkpointing] = len(calls)  # with checkpointing, the backward runs each forward again
    return out


def reduce_scatter_case(seed: int, world: int, rank: int) -> dict:
    """fp8.distributed.fsdp.fp8_reduce_scatter on a buffer laid out as FSDP2's (three FP8 weights of very different
    magnitudes and a high-precision parameter): this rank's output, and every rank's input (made here from seeds, so
    the test recomputes the float64 reference)."""
    from fp8.comm import Collectives
    from fp8.distributed.fsdp import ReduceScatterLayout, fp8_reduce_scatter

    lengths, scales = [48, 20, 16, 32, 40], [1e-6, 1.0, 3.0, 1e3, 1.0]
    layout = ReduceScatterLayout(lengths, [True, True, False, True, False], [0, 0, 0, 0, 8])  # the last: a table
    g = torch.Generator().manual_seed(seed + 100 * rank)
    rows = torch.cat([torch.randn(world, n, generator=g) * s for n, s in zip(lengths, scales)], dim=1)
    # the table's 5 rows per rank from 1e-8 to 1e2: rarely and often used embedding rows
    rows[:, -40:] *= torch.logspace(-8, 2, 5).repeat_interleave(8)
    comm = Collectives()
    out = {}
    for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
        result = torch.empty(sum(lengths))
        fp8_reduce_scatter(result, rows.clone().reshape(-1), comm, op, layout)
        out[name] = result
    out["input"] = rows
    return out


def checkpoint_case(seed: int, world: int, rank: int, out_dir: str) -> dict:
    """Train RESUME_AT steps, save (fp8.checkpoint), snapshot, train RESUME_AT more. At 4 ranks also load the 2-rank
    run's checkpoint (a sibling launch directory, when that launch ran), snapshot it, and continue from it."""
    import glob

    from fp8.checkpoint import load_checkpoint, save_checkpoint

    model, optimizer = sharded_llama(seed)
    out = {"before": train(model, optimizer, RESUME_AT, world, rank, True), "ckpt": os.path.join(out_dir, "ckpt")}
    save_checkpoint(out["ckpt"], model, optimizer)
    out["saved"] = snapshot(model, optimizer)
    from fp8.integrations.transformers import high_precision_state_dict

    export = high_precision_state_dict(model, optimizer)  # a collective: every rank, the same whole tensors
    out["export"] = export if rank == 0 else {k: v.sum() for k, v in export.items()}
    out["after"] = train(model, optimizer, RESUME_AT, world, rank, True, first=RESUME_AT)
    found = sorted(glob.glob(os.path.join(os.path.dirname(out_dir), "fsdp_world2*", "ckpt")))
    if world == 4 and found:
        model, optimizer = sharded_llama(seed)
        load_checkpoint(found[0], model, optimizer)
        out["resumed_from_2"] = snapshot(model, optimizer)
        out["resumed_after"] = train(model, optimizer, RESUME_AT, world, rank, True, first=RESUME_AT)
    return out


def misuse(kind: str, seed: int, world: int) -> dict:
    """The error each misuse raises (its message), or None."""
    import fp8
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    errors = {}

    def attempt(name, fn):
        try:
            fn()
            errors[name] = None
        except Exception as error:  # noqa: BLE001 - recorded for the test
            errors[name] = f"{type(error).__name__}: {error}"

    def sharded_first():
        model = mlp(seed)
        fully_shard(model)
        fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1")

    def mixed_block():
        model = mlp(seed).to(torch.bfloat16)
        model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1")
        fully_shard(model)
        model(torch.randn(2, 32, dtype=torch.bfloat16))

    def blockwise():
        model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.Linear(256, 128))
        model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1", recipe="blockwise")
        fully_shard(model)
        model(torch.randn(2, 128))

    def bf16_compute():  # fp32 parameters, bf16 compute (FSDP2's mixed precision): accepted
        model = mlp(seed)
        model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O2")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in mlp_blocks(model):
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        loss = model(torch.randn(4, 32)).float().pow(2).mean()
        loss.backward()
        optimizer.step()
        if not torch.isfinite(loss):
            raise RuntimeError("non-finite loss under MixedPrecisionPolicy")

    attempt("sharded_first", sharded_first)
    attempt("mixed_block", mixed_block)
    attempt("blockwise", blockwise)

    def placement():  # a sharding the optimizers cannot follow: refused at every step, never trained silently
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import Shard

        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(48, 48), torch.nn.Linear(48, 48))  # 48: 2, 3 and 4 divide it
        model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O2")
        fully_shard(model, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else Shard(0))
        messages = []
        for _ in range(2):
            try:
                optimizer.step()
            except NotImplementedError as error:
                messages.append(str(error))
        if len(messages) != 2:
            raise RuntimeError(f"refused {len(messages)} time(s) of 2")
        raise NotImplementedError(messages[1])

    attempt("placement", placement)
    attempt("bf16_compute", bf16_compute)
    return errors


def worker(rank: int, world: int, port: int, seed: int, out_dir: str) -> None:
    from tests.spawn import init_gloo_worker

    init_gloo_worker(rank, world, port)
    result = {}
    for kind in ("mlp", "llama"):
        for level in ("O1", "O2"):
            result[(kind, level, "single")] = run(kind, level, seed, world, rank, shard=False)
            result[(kind, level, "fsdp")] = run(kind, level, seed, world, rank, shard=True)
    result[("llama", "O3", "fsdp")] = run("llama", "O3", seed, world, rank, shard=True)  # O3's owners hand over
    result[("mlp", "O2", "fsdp-high")] = run("mlp", "O2", seed, world, rank, shard=True, reduce_scatter="high")
    # the embedding table's gradient in the buffer's dtype (fp32) instead of row-scaled E4M3
    result[("llama", "O2", "fsdp-embeddings-high")] = run("llama", "O2", seed, world, rank, shard=True,
                                                          embeddings="high")
    for level in ("O1", "O2"):  # 2 micro-batches per step, accumulated (FSDP2: set_requires_gradient_sync(False))
        result[("llama", level, "single-accum")] = run("llama", level, seed, world, rank, shard=False, micro=2)
        result[("llama", level, "fsdp-accum")] = run("llama", level, seed, world, rank, shard=True, micro=2)
    result["misuse"] = misuse("mlp", seed, world)
    result["checkpoint"] = checkpoint_case(seed, world, rank, out_dir)
    result["activation_checkpointing"] = activation_checkpointing_case(seed, world, rank)
    result["reduce_scatter"] = reduce_scatter_case(seed, world, rank)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
