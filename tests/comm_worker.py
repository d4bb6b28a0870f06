"""Worker of tests/training/test_comm_coverage.py: trains a tiny GPT on TP2 x PP2 x DP2 (8 ranks, sequence parallel) and
watches every call that reaches ``torch.distributed``.

The watch is this test's own: it wraps the ``torch.distributed`` collectives in this process only and, for
every call, computes the bytes this rank sends from the tensors' shapes and dtypes and the group's size
(its own table of ring costs, written independently of ``fp8.comm``), and checks that every tensor is on
the group's device. The run's byte counter must then hold exactly those bytes.

    torchrun --nproc_per_node 8 tests/comm_worker.py --out DIR --seed S --levels O2,none
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "128",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data",
         "--vocab-size", "256", "--train-iters", "3", "--eval-interval", "2", "--eval-iters", "1", "--log-interval",
         "2", "--no-progress", "--lr", "3e-3", "--lr-warmup-iters", "0",
         "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]


def _size(group) -> int:
    return dist.get_world_size(group)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Watch:
    """Per call: the bytes sent by this rank (ring costs computed here from shapes), and the devices seen.
    Installed before megatron-core is imported (it binds some collectives at import); counts while ``active``."""

    def __init__(self) -> None:
        self.active = False
        self.sent = 0.0
        self.calls = 0
        self.misplaced: list[str] = []
        self.unexpected: list[str] = []

    def _check(self, name: str, group, *tensors: torch.Tensor) -> None:
        if not self.active:
            return
        backend = str(dist.get_backend(group)).lower()
        expected = "cuda" if backend == "nccl" else "cpu"
        for t in tensors:
            if t.device.type != expected:
                self.misplaced.append(f"{name}: a {t.device} tensor on a {backend} group")

    def install(self) -> None:
        orig = {n: getattr(dist, n) for n in ("all_reduce", "all_gather_into_tensor", "all_gather_single",
                                             "reduce_scatter_tensor", "all_to_all_single", "broadcast", "isend",
                                             "irecv", "send", "recv", "all_gather", "reduce_scatter", "all_to_all",
                                             "all_gather_object", "broadcast_object_list", "gather_object",
                                             "scatter_object_list", "barrier", "batch_isend_irecv", "gather",
                                             "scatter", "reduce", "_all_gather_base", "_reduce_scatter_base")
                if hasattr(dist, n)}

        def ring(name, group, full_bytes, factor):
            if not self.active:
                return
            n = _size(group)
            self.sent += factor(n) * full_bytes
            self.calls += 1

        def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self._check("all_reduce", group, tensor)
            ring("all_reduce", group, _bytes(tensor), lambda n: 2.0 * (n - 1) / n)
            return orig["all_reduce"](tensor, op=op, group=group, async_op=async_op)

        def gather_into(name):
            def call(output, input, group=None, async_op=False):
                self._check(name, group, output, input)
                ring(name, group, _bytes(output), lambda n: (n - 1) / n)
                return orig[name](output, input, group=group, async_op=async_op)
            return call

        def reduce_scatter_tensor(output, input, op=dist.ReduceOp.SUM, group=None, async_op=False):
            self._check("reduce_scatter_tensor", group, output, input)
            ring("reduce_scatter", group, _bytes(input), lambda n: (n - 1) / n)
            return orig["reduce_scatter_tensor"](output, input, op=op, group=group, async_op=async_op)

        def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                              async_op=False):
            self._check("all_to_all_single", group, output, input)
            if input_split_sizes is None:
                ring("all_to_all", group, _bytes(input), lambda n: (n - 1) / n)
            else:
                me = dist.get_rank(group)
                others = sum(input_split_sizes) - input_split_sizes[me]
                ring("all_to_all_v", group, others * input.element_size(), lambda n: 1.0)
            return orig["all_to_all_single"](output, input, output_split_sizes=output_split_sizes,
                                             input_split_sizes=input_split_sizes, group=group, async_op=async_op)

        def broadcast(tensor, src=None, group=None, async_op=False, **kw):
            self._check("broadcast", group, tensor)
            ring("broadcast", group, _bytes(tensor), lambda n: (n - 1) / n)
            return orig["broadcast"](tensor, src=src, group=group, async_op=async_op, **kw)

        def isend(tensor, dst=None, group=None, tag=0, **kw):
            self._check("isend", group, tensor)
            ring("send", group, _bytes(tensor), lambda n: 1.0)
            return orig["isend"](tensor, dst, group=group, tag=tag, **kw)

        def irecv(tensor, src=None, group=None, tag=0, **kw):
            self._check("irecv", group, tensor)
            ring("recv", group, 0, lambda n: 0.0)
            return orig["irecv"](tensor, src, group=group, tag=tag, **kw)

        def unexpected(name):
            def call(*a, **k):
                if self.active:
                    self.unexpected.append(name)
                return orig[name](*a, **k)
            return call

        def batch_isend_irecv(ops):
            # Each operation is watched like an isend/irecv (P2POp below holds torch's own functions).
            for op in ops:
                self._check("batch_isend_irecv", op.group, op.tensor)
                if op.op is orig["isend"]:
                    ring("send", op.group, _bytes(op.tensor), lambda n: 1.0)
                else:
                    ring("recv", op.group, 0, lambda n: 0.0)
            return orig["batch_isend_irecv"](ops)

        p2p_op = dist.P2POp

        def make_p2p_op(op, tensor, peer=None, group=None, tag=0, group_peer=None):
            # P2POp accepts only torch's own isend/irecv, which the watch replaced: hand it those.
            original = orig["isend"] if op in (orig["isend"], isend) else orig["irecv"]
            return p2p_op(original, tensor, peer, group, tag, group_peer)

        dist.P2POp = make_p2p_op

        wrapped = {"all_reduce": all_reduce, "batch_isend_irecv": batch_isend_irecv,
                   "all_gather_into_tensor": gather_into("all_gather_into_tensor"),
                   "reduce_scatter_tensor": reduce_scatter_tensor, "all_to_all_single": all_to_all_single,
                   "broadcast": broadcast, "isend": isend, "irecv": irecv}
        for name in ("all_gather_single", "_all_gather_base"):
            if name in orig:
                wrapped[name] = gather_into(name)
        if "_reduce_scatter_base" in orig:
            wrapped["_reduce_scatter_base"] = lambda output, input, op=dist.ReduceOp.SUM, group=None, async_op=False: (
                reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op))
        for name in orig:
            setattr(dist, name, wrapped.get(name) or unexpected(name))


WATCH = Watch()
WATCH.install()

from fp8.comm import CommBytesCounter  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.training import training  # noqa: E402
from megatron.training.arguments import parse_args, parse_config  # noqa: E402
from megatron.training.monitoring.log import TrainingLogger  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--levels", required=True)
    a = parser.parse_args()
    watch = WATCH
    results = {}
    for level in a.levels.split(","):
        cfg = parse_config(MODEL + ["--seed", str(a.seed), "--fp8-opt-level", level])
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        training.initialize_distributed(cfg)
        datasets = training.Datasets(cfg)
        logger = TrainingLogger(cfg, rank=dist.get_rank(), is_logging_rank=False)
        counter = CommBytesCounter()
        sent_before, calls_before = watch.sent, watch.calls
        watch.active = True  # the process groups exist: their creation is torch's, not the project's
        history = training.train_level(cfg, datasets, logger, counter)
        watch.active = False
        results[level] = {
            "watched_bytes": watch.sent - sent_before, "watched_calls": watch.calls - calls_before,
            "counted_bytes": counter.total, "counted_calls": sum(counter.calls.values()),
            "by_tag": dict(counter.by_tag), "losses": [r["loss"] for r in history["train"]],
        }
    results["misplaced"] = watch.misplaced
    results["unexpected"] = watch.unexpected
    results["rank"] = dist.get_rank()
    with open(os.path.join(a.out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
