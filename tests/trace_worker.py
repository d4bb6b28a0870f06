"""Worker of tests/training/test_collective_trace.py: two training iterations of pretrain_gpt.py's set-up (megatron-core's
real 1F1B or interleaved schedule) under a collective trace, with the pipeline communicator as it is or
(``"legacy": true``) with the ordering it had before the fix: unbatched receives posted before the sends on every
rank, which gloo runs and NCCL deadlocks on. Each case writes ``OUT/<name>/rank<R>.jsonl``.

    torchrun --nproc_per_node 2 tests/trace_worker.py --out DIR --cases '[{"name": ..., "legacy": ..., "flags": [...]}]'
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")

import torch.distributed as dist  # noqa: E402

from fp8.comm import CommBytesCounter  # noqa: E402
from fp8.comm_trace import CollectiveTrace  # noqa: E402


class _Done:
    def wait(self) -> bool:
        return True


def _legacy_communicator_class():
    from megatron.training.compat.pipeline_p2p import FP8P2PCommunicator

    class LegacyP2P(FP8P2PCommunicator):
        """The pipeline communicator's ordering before the fix: receives posted first, unbatched, then sends."""

        def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                         wait_on_reqs=True):
            works, wires = {}, {}
            if recv_prev:
                wires["recv_prev"] = self.forward_codec.empty_wire(tensor_shape, self.device)
                works["recv_prev"] = self.comm.recv(wires["recv_prev"], self._prev_peer, "pp activations")
            if recv_next:
                wires["recv_next"] = self.backward_codec.empty_wire(tensor_shape, self.device)
                works["recv_next"] = self.comm.recv(wires["recv_next"], self._next_peer, "pp gradients")
            if tensor_send_next is not None:
                wires["send_next"] = self.forward_codec.encode(tensor_send_next)
                works["send_next"] = self.comm.send(wires["send_next"], self._next_peer, "pp activations")
            if tensor_send_prev is not None:
                wires["send_prev"] = self.backward_codec.encode(tensor_send_prev)
                works["send_prev"] = self.comm.send(wires["send_prev"], self._prev_peer, "pp gradients")
            for work in works.values():
                work.wait()
            prev = self.forward_codec.decode(wires["recv_prev"], tensor_shape).requires_grad_(True) if recv_prev else None
            nxt = self.backward_codec.decode(wires["recv_next"], tensor_shape).requires_grad_(True) if recv_next else None
            if not wait_on_reqs:
                return prev, nxt, {key: _Done() for key in works}
            return prev, nxt, ([] if self.config.batch_p2p_comm else {})

    return LegacyP2P


def p2p(out: str, legacy: bool, flags: list[str]) -> None:
    from megatron.training import training
    from megatron.training.arguments import parse_args, parse_config
    from megatron.training.compat.core_trace import trace_megatron_core

    cfg = parse_config(flags)
    training.initialize_distributed(cfg)
    trace = CollectiveTrace(dist.get_rank())
    counter = CommBytesCounter(trace=trace)
    datasets = training.Datasets(cfg)
    core = trace_megatron_core(trace)
    try:
        run = training.TrainingRun(cfg, datasets, counter)
        if legacy:
            current = run.schedule_kwargs["p2p_communicator"]
            replay = _legacy_communicator_class()(run.pp_group, run.config, fp8=True, device=run.device, counter=counter)
            assert replay.forward_codec.empty_wire((2, 2, 2), run.device).shape == \
                current.forward_codec.empty_wire((2, 2, 2), run.device).shape
            run.schedule_kwargs["p2p_communicator"] = replay
        data = run.data_iterators(datasets.train)
        for it in range(2):
            run.train_step(data, it)
    finally:
        core.close()
    trace.save(os.path.join(out, f"rank{dist.get_rank()}.jsonl"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    a = parser.parse_args()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state

    for case in json.loads(a.cases):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        p2p(os.path.join(a.out, case["name"]), case["legacy"], case["flags"])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
