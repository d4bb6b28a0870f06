"""Pipeline-stage communication for megatron-core's schedules, with FP8 activations and gradients.

:class:`FP8P2PCommunicator` is a megatron-core ``P2PCommunicator`` (pass it to the 1F1B or interleaved
schedule as ``p2p_communicator=``) whose messages are encoded by :class:`fp8.parallel.PipelineCodec`:
activations sent forward as E4M3 with their scale, their gradients sent back as E5M2 with theirs, 1 byte
per value plus 4 bytes per message. With ``fp8=False`` it sends the high-precision tensors (the
baseline), through the same code, counted the same way. Receive buffers live on the model's device, so
this works on CPU (gloo) and GPU (NCCL) alike.

Overlap: with ``wait_on_reqs=False`` (megatron-core's ``overlap_p2p_comm``, which pretrain_gpt.py turns on
for the interleaved schedule, as Megatron-LM does) the requests are handed to the schedule and the
received tensor is filled (decoded) when the schedule waits on its request; otherwise every request has
completed on return (megatron-core's 1F1B schedule waits right away too).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fp8.comm import Collectives, CommBytesCounter
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

    @property
    def counter(self) -> CommBytesCounter | None:
        """The byte counter of the pipeline messages (settable)."""
        return self.comm.counter

    @counter.setter
    def counter(self, counter: CommBytesCounter | None) -> None:
        self.comm.counter = counter

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                     wait_on_reqs: bool = True):
        if (recv_prev or recv_next) and tensor_shape is None:
            raise RuntimeError("tensor_shape must be given to receive (seq_length, micro_batch_size, hidden_size)")
        if self.config.variable_seq_lengths:
            raise ValueError("FP8P2PCommunicator needs fixed sequence lengths (variable_seq_lengths=False)")
        works = {}
        recv_prev_wire = recv_next_wire = None
        # Receives are posted before sends; every call is asynchronous, so the order cannot deadlock.
        if recv_prev:
            recv_prev_wire = self.forward_codec.empty_wire(tensor_shape, self.device)
            works["recv_prev"] = self.comm.recv(recv_prev_wire, self._prev_peer, "pp activations")
        if recv_next:
            recv_next_wire = self.backward_codec.empty_wire(tensor_shape, self.device)
            works["recv_next"] = self.comm.recv(recv_next_wire, self._next_peer, "pp gradients")
        sent = {}
        if tensor_send_next is not None:
            sent["send_next"] = self.forward_codec.encode(tensor_send_next)
            works["send_next"] = self.comm.send(sent["send_next"], self._next_peer, "pp activations")
        if tensor_send_prev is not None:
            sent["send_prev"] = self.backward_codec.encode(tensor_send_prev)
            works["send_prev"] = self.comm.send(sent["send_prev"], self._prev_peer, "pp gradients")
        if not wait_on_reqs:
            # Overlap (megatron-core's interleaved schedule with overlap_p2p_comm): hand the schedule its
            # requests; a receive's wait() also decodes the wire into the tensor returned now, which the
            # schedule reads only after waiting on that request. Sends keep their wire buffers alive.
            self.overlapped_calls += 1
            handles = {}
            recv_prev_tensor = recv_next_tensor = None
            if recv_prev_wire is not None:
                recv_prev_tensor = self.forward_codec.empty_output(tensor_shape, self.device).requires_grad_(True)
                handles["recv_prev"] = _DecodeOnWait(works["recv_prev"], self.forward_codec, recv_prev_wire,
                                                     recv_prev_tensor, tensor_shape)
            if recv_next_wire is not None:
                recv_next_tensor = self.backward_codec.empty_output(tensor_shape, self.device).requires_grad_(True)
                handles["recv_next"] = _DecodeOnWait(works["recv_next"], self.backward_codec, recv_next_wire,
                                                     recv_next_tensor, tensor_shape)
            for key, wire in sent.items():
                handles[key] = _SendRequest(works[key], wire)
            return recv_prev_tensor, recv_next_tensor, handles
        for work in works.values():
            work.wait()
        recv_prev_tensor = recv_next_tensor = None
        if recv_prev_wire is not None:
            recv_prev_tensor = self.forward_codec.decode(recv_prev_wire, tensor_shape).requires_grad_(True)
        if recv_next_wire is not None:
            recv_next_tensor = self.backward_codec.decode(recv_next_wire, tensor_shape).requires_grad_(True)
        # Everything has completed: no handles left for the schedule to wait on.
        handles = [] if self.config.batch_p2p_comm else {}
        return recv_prev_tensor, recv_next_tensor, handles


class _DecodeOnWait:
    """A pipeline receive request: ``wait()`` waits for the wire buffer, then decodes it (FP8 payload and
    scale, or the high-precision values) into the tensor the schedule was handed (once)."""

    def __init__(self, work: dist.Work, codec: PipelineCodec, wire: torch.Tensor, out: torch.Tensor, shape) -> None:
        self.work, self.codec, self.wire, self.out, self.shape = work, codec, wire, out, shape

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            with torch.no_grad():
                self.out.copy_(self.codec.decode(self.wire, self.shape))
            self.work = self.wire = None
        return True

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()


class _SendRequest:
    """A pipeline send request holding its wire buffer until the send has completed."""

    def __init__(self, work: dist.Work, wire: torch.Tensor) -> None:
        self.work, self.wire = work, wire

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
            self.work = self.wire = None
        return True

    def is_completed(self) -> bool:
        return self.work is None or self.work.is_completed()
