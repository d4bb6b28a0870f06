"""``fp8.freeze``: a model that is only evaluated (a DPO / RLHF reference model, a teacher) held as FP8 weights.

Every eligible linear (``nn.Linear``, transformers ``Conv1D``) becomes a :class:`~fp8.linear.Float8Linear`
whose weight is an E4M3 :class:`~fp8.tensor.Float8Tensor` (1 byte per element plus its scales) and whose
input is cast with a current scale (a frozen model keeps no scaling history to warm up); every ``nn.Embedding``
becomes a :class:`~fp8.embedding.Float8Embedding` (E4M3 rows, one power-of-two scale per row). An output layer tied to an
embedding shares its FP8 weight: it runs the ``rowwise`` recipe (its per-output-channel scales are the
embedding's per-row scales), or, where its dimensions cannot run an FP8 GEMM, multiplies by the dequantized
table. Nothing requires gradients and nothing is kept in high precision but what has no FP8 form (norms,
biases, linears the selection rules keep: :func:`fp8.convert.convert_to_float8_linear`, logged).

The model holds no optimizer state, no master weights and no gradients: ``fp8.memory_report(frozen)`` is its
whole footprint. Gradients still flow to the model's inputs (e.g. for a distillation loss on embeddings fed in).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import ROWWISE, dequantize_blocks
from .convert import convert_to_float8_linear, module_paths, set_submodule
from .embedding import Float8Embedding, embedding_problem
from .linear import Float8Linear, Float8LinearConfig, fp8_dims_problem
from .recipes import get_recipe
from .scaling import ScalingConfig

__all__ = ["freeze", "Float8TiedOutput"]

logger = logging.getLogger(__name__)


class Float8TiedOutput(nn.Module):
    """An output linear tied to a :class:`Float8Embedding` whose dimensions cannot run an FP8 GEMM
    (:func:`fp8.linear.fp8_dims_problem`): ``x @ dequantized(table)^T (+ bias)``; the table stays FP8 at rest
    (the dequantized copy lives only during the call)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None) -> None:
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = dequantize_blocks(self.weight.payload, self.weight.scale, ROWWISE, x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))


def freeze(model: nn.Module, *, recipe: str = "tensorwise", min_fp8_dim: int | None = None,
           embeddings: bool = True) -> nn.Module:
    """Turn ``model`` (in place) into an evaluation-only FP8 model and return it (see the module docstring).

    ``recipe`` (:data:`fp8.recipes.RECIPES`) is the scale granularity of the converted linears; ``min_fp8_dim``
    as in :func:`fp8.convert.convert_to_float8_linear` (None: 2048 on CUDA, 0 on CPU); ``embeddings=False``
    keeps embedding tables (and outputs tied to them) in high precision. Refuses a model that
    ``fp8.initialize`` already converted (freeze the high-precision model, e.g. a copy taken before
    ``initialize``). The result is in ``eval()`` mode with every parameter's ``requires_grad`` False.
    """
    get_recipe(recipe)
    if any(isinstance(m, Float8Linear) for m in model.modules()):
        raise ValueError(
            "fp8.freeze: the model already holds Float8Linear layers (it went through fp8.initialize, whose FP8 "
            "weights come with masters in the optimizer); freeze a high-precision copy instead, e.g. "
            "copy.deepcopy(model) taken before fp8.initialize, or a model loaded with from_pretrained"
        )
    config = Float8LinearConfig(input=ScalingConfig(fmt="e4m3", kind="current"), recipe=recipe)
    if isinstance(model, nn.Embedding):
        raise ValueError("fp8.freeze: pass the model holding the embedding, not the embedding itself")
    n_tables = 0
    if embeddings:
        owners: dict[int, list[tuple[str, nn.Module]]] = {}
        for fqn, module in model.named_modules(remove_duplicate=False):
            weight = getattr(module, "weight", None)
            if isinstance(weight, nn.Parameter):
                owners.setdefault(id(weight), []).append((fqn, module))
        paths = module_paths(model)  # a table registered under several names (T5's shared one) swapped at every one
        for fqn, emb in list(model.named_modules()):
            if type(emb) is not nn.Embedding:
                continue
            problem = embedding_problem(emb)
            if problem:
                raise ValueError(f"fp8.freeze: embedding {fqn or '<root>'}: {problem}; build the model without them, or "
                                 f"pass embeddings=False to keep the tables in high precision")
            tied = [(name, m) for name, m in owners.get(id(emb.weight), []) if m is not emb]
            others = [name for name, m in tied if type(m) is not nn.Linear]
            if others:
                raise ValueError(
                    f"fp8.freeze: embedding {fqn} shares its weight with {others}, which are not nn.Linear; pass "
                    f"embeddings=False to keep the table in high precision"
                )
            new = Float8Embedding.from_embedding(emb)
            for path in paths[id(emb)]:
                set_submodule(model, path, new)
            n_tables += 1
            for name, head in tied:
                if fp8_dims_problem(head.in_features, head.out_features) is None:
                    lin = Float8Linear.from_linear(head, dataclasses.replace(config, recipe="rowwise"))
                    lin.weight = new.weight  # the table's row-wise scales are the head's per-channel scales
                else:
                    lin = Float8TiedOutput(new.weight, head.bias)
                    logger.info("fp8: %s (tied to %s) multiplies by the dequantized FP8 table: %s", name, fqn,
                                fp8_dims_problem(head.in_features, head.out_features))
                set_submodule(model, name, lin)
    model, _ = convert_to_float8_linear(model, config, min_fp8_dim=min_fp8_dim)
    if n_tables:
        logger.info("fp8: %d embedding table(s) held in FP8 (E4M3, one scale per row)", n_tables)
    for param in model.parameters():
        param.requires_grad_(False)
    return model.eval()
