"""The tensor-parallel collectives that megatron-core's own modules issue, counted from the micro-batch's shapes.

Every collective of fp8lm goes through :class:`fp8.comm.Collectives` and is counted there. Three modules
of megatron-core's ``GPTModel`` communicate inside megatron-core, where the counter cannot see them: the
vocabulary-parallel input embedding, the column-parallel output layer and the vocabulary-parallel
cross-entropy. :func:`record_core_collectives` records, per micro-batch and pipeline chunk, exactly the
collectives they issue (megatron-core 0.16; the test ``tests/training/test_comm_coverage.py`` checks the record
against every call that reaches ``torch.distributed``), for ``S`` tokens per sequence, ``B`` sequences per
micro-batch, hidden size ``H`` and activations of ``d`` bytes, over tensor-parallel size ``T > 1``:

================================  =====================================  ====================================
module                            forward                                backward
================================  =====================================  ====================================
embedding (first stage)           all-reduce ``S*B*H*d``                 with SP: all-gather ``S*B*H*d``
output layer (last stage)         with SP: all-gather ``S*B*H*d``        SP: all-gather + reduce-scatter
                                                                         ``S*B*H*d``; else all-reduce
cross-entropy (last stage)        3 all-reduces of ``S*B`` fp32          --
================================  =====================================  ====================================

At construction (:func:`record_core_construction`), with tied input/output embeddings over several pipeline
stages, the first stage's embedding and the last stage's output weight are made equal by one all-reduce of
the weight over the embedding group.
"""

from __future__ import annotations

from fp8.comm import CommBytesCounter

__all__ = ["record_core_collectives", "record_core_construction"]


def record_core_construction(counter: CommBytesCounter | None, chunks, embd_group_size: int) -> None:
    """Record the tied-embedding all-reduce of each pipeline chunk's construction (module docstring)."""
    if counter is None or embd_group_size < 2:
        return
    for chunk in chunks:
        pre, post = getattr(chunk, "pre_process", False), getattr(chunk, "post_process", False)
        if getattr(chunk, "share_embeddings_and_output_weights", False) and (pre or post) and not (pre and post):
            weight = chunk.shared_embedding_or_output_weight()
            counter.record("all_reduce", weight.numel() * weight.element_size(), embd_group_size,
                           "megatron-core tied embedding init")


def record_core_collectives(counter: CommBytesCounter | None, chunk, *, tp_size: int, sequence_parallel: bool,
                            tokens: int, hidden_size: int, activation_bytes: int, backward: bool) -> None:
    """Record in ``counter`` the megatron-core collectives of one micro-batch through ``chunk`` (a
    ``GPTModel``: its ``pre_process``/``post_process`` say whether it holds the embedding and the output
    layer) with ``tokens`` = sequence length x micro-batch size; ``backward``: the micro-batch is trained."""
    if counter is None or tp_size == 1:
        return
    activations = tokens * hidden_size * activation_bytes
    if getattr(chunk, "pre_process", False):
        counter.record("all_reduce", activations, tp_size, "megatron-core embedding")
        if sequence_parallel and backward:
            counter.record("all_gather", activations, tp_size, "megatron-core embedding")
    if getattr(chunk, "post_process", False):
        if sequence_parallel:
            counter.record("all_gather", activations, tp_size, "megatron-core output layer")
        if backward:
            if sequence_parallel:
                counter.record("all_gather", activations, tp_size, "megatron-core output layer")
                counter.record("reduce_scatter", activations, tp_size, "megatron-core output layer")
            else:
                counter.record("all_reduce", activations, tp_size, "megatron-core output layer")
        for _ in range(3):  # max logit, target logit, sum of exponentials
            counter.record("all_reduce", tokens * 4, tp_size, "megatron-core loss")
