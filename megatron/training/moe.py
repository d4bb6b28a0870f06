"""megatron-core's mixture-of-experts layer with expert parallelism through fp8lm's counted collectives.

Plugged in by :func:`megatron.training.gpt_layer_specs.get_gpt_layer_fp8_spec` (``num_experts``) through the
``ModuleSpec`` of the layer's MLP:

- :func:`install_counted_dispatcher` (called by the layer once megatron-core built its ``MoELayer``: router, token
  dispatcher, experts, shared expert) replaces the all-to-all token dispatcher (``--moe-token-dispatcher-type
  alltoall``) by :class:`CountedAlltoAllTokenDispatcher`:
  megatron-core's routing metadata and permutations, the expert-parallel all-to-alls through
  :class:`fp8.comm.Collectives` (counted under ``moe dispatch``/``moe combine``, their backwards under ``... grad``),
  and with ``--moe-fp8-dispatch`` the tokens and the combine's expert outputs in E4M3 with one scale per token, both
  backwards in the recipe's gradient format (:func:`fp8.parallel.token_a2a.all_to_all_rows`).
- :class:`SeededSequentialMLP`: megatron-core's ``SequentialMLP`` whose experts are initialised from their global
  expert index, so a model split over any number of expert-parallel ranks starts from the same weights as one
  process, and the modules built after the experts (the shared expert) from the same generator state.

Parameters of routed experts carry megatron-core's ``allreduce = False`` when expert-parallel (set by the parallel
linears): the training loop reduces their gradients over the expert-data-parallel group, not the data-parallel one.
"""

from __future__ import annotations

import torch

from fp8.comm import Collectives, CommBytesCounter
from fp8.parallel.token_a2a import all_to_all_rows
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

__all__ = ["install_counted_dispatcher", "CountedAlltoAllTokenDispatcher", "SeededSequentialMLP", "expert_init_seed",
           "is_routed_expert_param", "permute_dropless"]


def expert_init_seed(base: int, global_expert: int) -> int:
    """The generator seed for building expert ``global_expert`` of a layer whose experts draw ``base`` (-1: the
    state after the experts), the same in every process."""
    return (int(base) * 1_000_033 + (int(global_expert) + 2) * 104_729 + 11) % (2**63)


def is_routed_expert_param(p: torch.nn.Parameter) -> bool:
    """A routed expert's parameter under expert parallelism (megatron-core's mark ``allreduce = False``): its
    gradient is reduced over the expert-data-parallel group."""
    return getattr(p, "allreduce", True) is False


class SeededSequentialMLP(SequentialMLP):
    """``SequentialMLP`` whose local expert ``i`` on expert-parallel rank ``r`` is built from the default generator
    seeded by :func:`expert_init_seed` of its global index ``r * num_local_experts + i`` (one draw from the
    generator the layer was seeded with gives the base); the generator then continues from the same state on every
    expert-parallel layout."""

    def __init__(self, num_local_experts, config, submodules, pg_collection=None) -> None:
        super().__init__(0, config, submodules, pg_collection)  # the experts are built below, one seed each
        self.num_local_experts = num_local_experts
        ep_rank = self.ep_group.rank() if self.ep_group is not None else 0
        # one draw from the CPU generator the layer was seeded with (weights are initialised on the CPU, then sharded;
        # the default device may be meta or CUDA): construction only, before any expert
        base = int(torch.randint(0, 2**62, (), device="cpu"))
        for i in range(num_local_experts):
            torch.manual_seed(expert_init_seed(base, ep_rank * num_local_experts + i))
            self.local_experts.append(MLP(self.config, submodules, ffn_hidden_size=self.config.moe_ffn_hidden_size,
                                          is_expert=True, tp_group=pg_collection.expt_tp))
        torch.manual_seed(expert_init_seed(base, -1))


def permute_dropless(tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor,
                     num_out_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megatron-core's unfused ``moe_utils.permute`` (no drop, no padding) without a host sync: ``(tokens sorted by
    expert, their probabilities, each row's token index)``, the same values in the same order. megatron-core selects
    the routed (expert, token) pairs with ``masked_select`` (an output size read from the device); their number is
    known on the host in dropless routing (``num_out_tokens``: tokens x top-k, each token routed to top-k distinct
    experts, as megatron-core's own buffer sizes assume), so ``nonzero_static`` finds them on the device."""
    num_tokens = routing_map.shape[0]
    flat = routing_map.T.contiguous().view(-1)  # expert-major: position e * num_tokens + t
    selected = torch.nonzero_static(flat, size=num_out_tokens).view(-1)
    sorted_indices = selected % num_tokens
    permuted_probs = probs.T.contiguous().view(-1).index_select(0, selected)
    return tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices


class CountedAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """megatron-core's all-to-all dispatcher with its expert-parallel all-to-alls through ``comm`` (the
    expert-parallel group's :class:`Collectives`). ``fmt``: the format tokens are dispatched in (``"e4m3"``, one
    scale per token; None: their own dtype); ``grad_fmt``: the combine's and both backwards' (None: own dtype).

    The split sizes are megatron-core's, moved to the host once per layer and micro-batch by its dispatcher (an
    all-to-all with uneven splits needs them there, on NCCL as on gloo); the router's token counts are all-gathered
    over the tensor x expert-parallel group by megatron-core and counted here (``moe token counts``)."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection, *, comm: Collectives,
                 fmt: str | None, grad_fmt: str | None) -> None:
        super().__init__(num_local_experts, local_expert_indices, config=config, pg_collection=pg_collection)
        self.comm = comm
        self.fmt, self.grad_fmt = fmt, grad_fmt

    def preprocess(self, routing_map: torch.Tensor) -> torch.Tensor:
        out = super().preprocess(routing_map)
        world = self.tp_size * self.ep_size
        if world > 1 and not self.drop_and_pad and self.comm.counter is not None:
            # megatron-core's all-gather of this rank's per-expert token counts (int64) over the tp x ep group
            self.comm.counter.record("all_gather", world * self.num_experts * 8, world, "moe token counts")
        return out

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """megatron-core's, with the dropless permutation made without a host sync (:func:`permute_dropless`) where
        megatron-core's unfused one reads the routing map's size to the host (``masked_select``, twice)."""
        config = self.config
        if (self.drop_and_pad or config.moe_permute_fusion or config.moe_router_padding_for_quantization
                or config.moe_expert_capacity_factor is not None):
            return super().dispatch_preprocess(hidden_states, routing_map, probs)
        # megatron-core 0.16.1's dispatch_preprocess, its permutation replaced
        self.hidden_shape = hidden_states.shape
        self.probs = probs
        self.routing_map = routing_map
        if probs.dim() != 2 or routing_map.dim() != 2 or routing_map.dtype != torch.bool:
            raise ValueError(f"the all-to-all dispatcher takes 2-D probs and a 2-D bool routing map, not "
                             f"{tuple(probs.shape)} and {tuple(routing_map.shape)} {routing_map.dtype}")
        hidden_states = hidden_states.view(-1, self.hidden_shape[-1])
        self.tokens_per_expert = self.preprocess(self.routing_map)
        if self.shared_experts is not None:
            self.shared_experts.pre_forward_comm(hidden_states.view(self.hidden_shape))
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_permutation_1", self.tokens_per_expert)
        self.hidden_shape_before_permute = hidden_states.shape
        tokens, permuted_probs, self.reversed_local_input_permutation_mapping = permute_dropless(
            hidden_states, self.routing_map, probs, self.num_out_tokens)
        return tokens, permuted_probs

    def _splits(self) -> tuple[list[int], list[int]]:
        """(output, input) split sizes in rows, host integers (megatron-core's dispatcher moved them there)."""
        return [int(s) for s in self.output_splits], [int(s) for s in self.input_splits]

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
        if self.ep_size == 1:
            return permutated_local_input_tokens, permuted_probs
        output_splits, input_splits = self._splits()
        tokens = all_to_all_rows(permutated_local_input_tokens, self.comm, output_splits, input_splits,
                                 fmt=self.fmt, grad_fmt=self.grad_fmt, tag="moe dispatch")
        probs = all_to_all_rows(permuted_probs, self.comm, output_splits, input_splits, tag="moe dispatch probs")
        return tokens, probs

    def token_combine(self, hidden_states, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        if self.ep_size == 1:
            return hidden_states
        output_splits, input_splits = self._splits()
        # the expert outputs are forward activations: E4M3 like the dispatched tokens (E5M2's 2 mantissa bits would
        # round each to 1/8 relative); their gradients travel back in the gradient format
        return all_to_all_rows(hidden_states, self.comm, input_splits, output_splits, fmt=self.fmt,
                               grad_fmt=self.grad_fmt, tag="moe combine")


def install_counted_dispatcher(moe: MoELayer, pg_collection, counter: CommBytesCounter | None,
                               fmt: str | None, grad_fmt: str | None) -> None:
    """Give megatron-core's ``MoELayer`` ``moe`` (built with ``pg_collection``) a
    :class:`CountedAlltoAllTokenDispatcher` in place of its all-to-all dispatcher (``fmt``/``grad_fmt`` as the
    dispatcher's). Other dispatcher types stay megatron-core's (``allgather``: no expert-parallel all-to-all)."""
    if moe.config.moe_token_dispatcher_type != "alltoall":
        return
    moe.token_dispatcher = CountedAlltoAllTokenDispatcher(
        moe.num_local_experts, moe.local_expert_indices, config=moe.config, pg_collection=pg_collection,
        comm=Collectives(pg_collection.ep, counter), fmt=fmt, grad_fmt=grad_fmt)
    if moe.use_shared_expert and moe.shared_expert_overlap:
        moe.token_dispatcher.set_shared_experts(moe.shared_experts)
