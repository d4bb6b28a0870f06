"""FSDP2 (``fully_shard`` per block and at the root) at 2, 4 and 8 gloo ranks: per-rank model-state bytes and bytes on
the wire per step, fp8lm (O1, O2) beside BF16 FSDP2 and torchao's float8 training with its FP8 all-gather.

    python benchmarks/fsdp.py [--worlds 2 4 8] [--json benchmarks/results/fsdp.json]

The model is a transformers Llama (4 layers, hidden 256, MLP 704, vocabulary 512, untied embeddings), AdamW, one
step of 8 sequences of 64 tokens per rank. Every configuration starts from fp32 parameters:

- ``bf16``: FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (torchtitan's default): fp32
  shards, bf16 all-gather, fp32 reduce-scatter, AdamW's fp32 moments.
- ``torchao``: torchao's ``convert_to_float8_training`` (tensor-wise, ``enable_fsdp_float8_all_gather=True``) under
  the same policy: fp32 shards, FP8 all-gather of the linears' weights, fp32 reduce-scatter, fp32 moments.
  torchao's per-step amax all-reduce for the FP8 all-gather scales runs inside DTensor and is not counted (4 bytes
  per weight).
- ``fp8lm O1`` / ``fp8lm O2``: ``fp8.initialize`` then ``fully_shard`` under the same policy (docs/fsdp.md): FP8
  shards, FP8 all-gather, FP8 reduce-scatter (the embedding table's gradient as E4M3 rows, each with its sender's
  scale: ``FSDPConfig(embeddings="rowwise")``); O1 fp32 masters and moments, O2 FP16 masters with E4M3/FP16 moments
  (O3's memory: under FSDP2, O2 is sharded like the weights).

Every linear is FP8 in the FP8 configurations (the LM head included), embeddings and norms stay fp32 shards.

Per rank, after the step (the largest rank: rank 0): ``weights`` (the sharded parameters: FP8 payloads and their
scales, other parameters in their dtype), ``optimizer`` (masters, moments, their scales), ``grads`` (FSDP2's sharded
gradients, held from the backward to ``zero_grad``). Bytes on the wire: every all-gather and reduce-scatter FSDP2 runs
goes through :class:`fp8.comm.Collectives` (``fp8.distributed.fsdp.install_comms``), plus fp8lm's scale agreements.
torchao is needed for its rows only (``pip install torchao``); without it they are skipped, said so.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

CONFIGS = ("bf16", "torchao", "fp8lm O1", "fp8lm O2")


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def _bytes(t) -> int:
    from fp8.distributed.sharding import local

    t = local(t)
    parts = [getattr(t, "_data", None), getattr(t, "_scale", None)]
    if all(isinstance(p, torch.Tensor) for p in parts):  # a scaled tensor subclass: payload and scale
        return sum(p.numel() * p.element_size() for p in parts)
    inner = [getattr(t, name) for name in getattr(t, "__tensor_flatten__", lambda: ([], None))()[0]]
    if inner:  # another wrapper subclass (torchao's weight wrapper): its inner tensors
        return sum(_bytes(i) for i in inner)
    return t.numel() * t.element_size()


def _optimizer_bytes(optimizer) -> int:
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and id(value) not in seen:
                seen.add(id(value))
                total += _bytes(value)
    for master in getattr(optimizer, "master_weights", []):  # O1: the masters are the wrapped optimizer's params
        total += _bytes(master)
    return total


def _run(config: str, rank: int, world: int) -> dict:
    import fp8
    from fp8.comm import CommBytesCounter
    from fp8.distributed.fsdp import FSDPConfig, install_comms
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    counter = CommBytesCounter()
    model = _model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if config.startswith("fp8lm"):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = fp8.initialize(model, optimizer, config.split()[1], fsdp=FSDPConfig(counter=counter))
    elif config == "torchao":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if not config.startswith("fp8lm"):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        install_comms(model, FSDPConfig(reduce_scatter="high", counter=counter))
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, 512, (8, 64), generator=g)
    for step in range(2):  # the second step is measured (the first builds states, fp8lm's optimizer follows the shards)
        counter.reset()
        model(input_ids=ids, labels=ids).loss.backward()
        grads = sum(_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        optimizer.step()
        wire = counter.summary()
        optimizer.zero_grad()
    params = sum(_bytes(p) for p in model.parameters())
    n_params = sum(p.numel() for p in model.parameters())
    return {"weights": params, "optimizer": _optimizer_bytes(optimizer), "grads": grads, "wire": wire,
            "params": n_params}


def _worker(rank: int, world: int, port: int, out_dir: str, configs: list[str]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import logging

    logging.getLogger("fp8").setLevel(logging.ERROR)
    results = {config: _run(config, rank, world) for config in configs}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    from fp8.comm import Collectives

    Collectives().barrier("benchmark end")  # every collective through fp8.comm (tests/training/test_comm_coverage.py)
    dist.destroy_process_group()


def main() -> None:
    from benchmarks.launch import spawn
    from tests.spawn import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--json", default="benchmarks/results/fsdp.json")
    args = parser.parse_args()
    try:
        import torchao  # noqa: F401

        configs = list(CONFIGS)
    except ImportError:
        configs = [c for c in CONFIGS if c != "torchao"]
        print("torchao is not installed: its rows are skipped (pip install torchao)")
    rows = []
    for world in args.worlds:
        out_dir = tempfile.mkdtemp()
        spawn(_worker, (world, free_port(), out_dir, configs), world)
        result = torch.load(os.path.join(out_dir, "rank0.pt"), weights_only=False)
        for config in configs:
            r = result[config]
            state = r["weights"] + r["optimizer"]
            rows.append({"world": world, "config": config, "params": r["params"], "weights": r["weights"],
                         "optimizer": r["optimizer"], "grads": r["grads"], "state": state,
                         "wire": r["wire"]["total"], "wire_by_tag": r["wire"]["by_tag"]})
    print(f"| ranks | config | weights | optimizer | state (w + opt) | B/param x ranks | grads | wire/step | "
          f"state vs torchao | wire vs torchao |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        base = next((r for r in rows if r["world"] == row["world"] and r["config"] == "torchao"), None)
        ratio = lambda key: f"{row[key] / base[key]:.3f}x" if base else "-"  # noqa: E731
        print(f"| {row['world']} | {row['config']} | {row['weights']:,} | {row['optimizer']:,} | {row['state']:,} | "
              f"{row['state'] * row['world'] / row['params']:.2f} | {row['grads']:,} | {row['wire']:,.0f} | "
              f"{ratio('state')} | {ratio('wire')} |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
