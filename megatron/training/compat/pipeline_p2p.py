"""Pipeline-stage communication for megatron-core's schedules, with FP8 activations and gradients.

:class:`FP8P2PCommunicator` is a megatron-core ``P2PCommunicator`` (pass it to the 1F1B or interleaved
schedule as ``p2p_communicator=``) whose messages are encoded by :class:`fp8.parallel.PipelineCodec`:
activations sent forward as E4M3 with their scale, their gradients sent back as E5M2 with theirs, 1 byte
per value plus 4 bytes per message. With ``fp8=False`` it sends the high-precision tensors (the
baseline), through the same code, counted the same way. Receive buffers live on the model's device, so
this works on CPU (gloo) and GPU (NCCL) alike.

NCCL-safe: the sends and receives of one schedule step are posted as one ``batch_isend_irecv`` group
(:meth:`fp8.comm.Collectives.batch_isend_irecv`), which NCCL runs as one unit, so the 1F1B steady state
(stage ``i`` sending activations forward while receiving gradients back, stage ``i+1`` the reverse) cannot
deadlock on the pair's in-order stream.

Overlap: with ``wait_on_reqs=False`` (megatron-core's ``overlap_p2p_comm``, which pretrain_gpt.py turns on
for the interleaved schedule, as Megatron-LM does) the requests are handed to the schedule and the
received tensor is filled (decoded) when the schedule waits on its request; otherwise every request has
completed on return (megatron-core's 1F1B schedule waits right away too).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fp8.comm import Collectives, CommBytesCounter, P2PMessage
from fp8.parallel import PipelineCodec
from fp8.recipes import get_recipe
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

__all__ = ["FP8P2PCommunicator"]


class FP8P2PCommunicator(P2PCommunicator):
    """megatron-core's pipeline communicator with FP8 (or high-precision) messages, bytes counted.

    ``pp_group``/``config``: as megatron-core's; ``config.pipeline_dtype`` is the dtype of received
    tensors. ``fp8``: encode activations as E4M3 and gradients as E5M2 (``recipe``: per-token or per-tile scales and
    E4M3 gradients for ``"rowwise"``/``"blockwise"``, :mod:`fp8.recipes`). ``device``: where receive
    buffers go. ``counter``: counts every message sent (tag ``"pp activations"`` / ``"pp gradients"``).
    """

    def __init__(self, pp_group: dist.ProcessGroup, config, *, fp8: bool = True, device: torch.device | str = "cpu",
                 counter: CommBytesCounter | None = None, recipe: str = "tensorwise") -> None:
        super().__init__(pp_group, config)
        if config.pipeline_dtype is None:
            raise ValueError("config.pipeline_dtype must be set for pipeline parallelism (e.g. torch.float32)")
        spec = get_recipe(recipe)  # rowwise/blockwise: per-token / per-tile scales, E4M3 gradients
        self.forward_codec = PipelineCodec("e4m3" if fp8 else None, config.pipeline_dtype, spec.input)
        self.backward_codec = PipelineCodec(spec.grad_fmt if fp8 else None, config.pipeline_dtype, spec.grad_output)
        self.device = torch.device(device)
        self.comm = Collectives(pp_group, counter)
        self._prev_peer = dist.get_group_rank(pp_group, self.prev_rank)
        self._next_peer = dist.get_group_rank(pp_group, self.next_rank)
        self.overlapped_calls = 0  # calls that handed the schedule asynchronous requests (wait_on_reqs=False)

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                     wait_on_reqs: bool = True):
        if (recv_prev or recv_next) and tensor_shape is None:
            raise RuntimeError("tensor_shape must be given to receive (seq_length, micro_batch_size, hidden_size)")
        if self.config.variable_seq_lengths:
            raise ValueError("FP8P2PCommunicator needs fixed sequence lengths (variable_seq_lengths=False)")
        # Every operation of one schedule step goes out as one batch_isend_irecv group: NCCL runs a pair's
        # operations in issue order on one stream, and a group as one unit, so neither direction can wait on a
        # receive queued behind the other's (unbatched receives posted first on both sides deadlock). Inside the
        # group, sends go to next then prev and receives come from prev then next: when prev and next are the
        # same rank (two stages, interleaved), its receives from us then meet our sends in the order they
        # expect, activations with activations and gradients with gradients.
        messages, wires = [], {}
        fwd, bwd = self.forward_codec, self.backward_codec
        for key, op, wanted, codec, peer, tag in (
                ("send_next", "send", tensor_send_next, fwd, self._next_peer, "pp activations"),
                ("recv_prev", "recv", recv_prev, fwd, self._prev_peer, "pp activations"),
                ("send_prev", "send", tensor_send_prev, bwd, self._prev_peer, "pp gradients"),
                ("recv_next", "recv", recv_next, bwd, self._next_peer, "pp gradients")):
            if op == "send" and wanted is not None:
                wires[key] = codec.encode(wanted)
            elif op == "recv" and wanted:
                wires[key] = codec.empty_wire(tensor_shape, self.device)
            else:
                continue
            messages.append(P2PMessage(op, wires[key], peer, tag))
        batch = _Batch(self.comm.batch_isend_irecv(messages), list(wires.values()))
        codecs = {"recv_prev": self.forward_codec, "recv_next": self.backward_codec}
        if not wait_on_reqs:
            # Overlap (megatron-core's interleaved schedule with overlap_p2p_comm): hand the schedule a request
            # per operation, each completing the whole group; a receive's wait() also decodes the wire into the
            # tensor returned now, which the schedule reads only after waiting on that request.
            self.overlapped_calls += 1
            handles, received = {}, {}
            for key in wires:
                if key in codecs:
                    received[key] = codecs[key].empty_output(tensor_shape, self.device).requires_grad_(True)
                    handles[key] = _DecodeOnWait(batch, codecs[key], wires[key], received[key], tensor_shape)
                else:
                    handles[key] = batch
            return received.get("recv_prev"), received.get("recv_next"), handles
        batch.wait()
        received = {key: codecs[key].decode(wires[key], tensor_shape).requires_grad_(True) for key in wires
                    if key in codecs}
        # Everything has completed: no handles left for the schedule to wait on.
        handles = [] if self.config.batch_p2p_comm else {}
        return received.get("recv_prev"), received.get("recv_next"), handles


class _Batch:
    """The work handles of one ``batch_isend_irecv`` group, holding its wire buffers until it has completed;
    ``wait()`` waits for all of them (once)."""

    def __init__(self, works: list, wires: list[torch.Tensor]) -> None:
        self.works, self.wires = works, wires

    def wait(self) -> bool:
        if self.works is not None:
            for work in self.works:
                work.wait()
            self.works = self.wires = None
        return True


class _DecodeOnWait:
    """A pipeline receive request: ``wait()`` waits for its group, then decodes the wire buffer (FP8 payload and
    scale, or the high-precision values) into the tensor the schedule was handed (once)."""

    def __init__(self, batch: _Batch, codec: PipelineCodec, wire: torch.Tensor, out: torch.Tensor, shape) -> None:
        self.batch, self.codec, self.wire, self.out, self.shape = batch, codec, wire, out, shape

    def wait(self) -> bool:
        if self.batch is not None:
            self.batch.wait()
            with torch.no_grad():
                self.out.copy_(self.codec.decode(self.wire, self.shape))
            self.batch = self.wire = None
        return True
