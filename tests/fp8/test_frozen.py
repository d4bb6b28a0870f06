"""``fp8.freeze``: evaluation-only FP8 models (a DPO reference): 1 byte per weight, logits near the float64 model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fp8
from fp8.blocks import ROWWISE
from fp8.embedding import Float8Embedding
from fp8.frozen import Float8TiedOutput
from fp8.linear import Float8Linear
from fp8.tensor import Float8Tensor

transformers = pytest.importorskip("transformers")

# Relative L2 error of the logits of a frozen random-init model vs its float64 original (E4M3 weights, inputs
# cast with current scales, 2 layers, hidden 128). Measured max over 12 seeds: Llama (tied / untied, every
# recipe) 0.081, GPT-2 (Conv1D, learned positions, tied head of a vocabulary that is no multiple of 16) 0.067.
LOGIT_REL_ERR = 0.16


def _llama(tie: bool, vocab: int = 512):
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=tie)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=500, n_positions=64, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("build,recipe", [
    (lambda: _llama(True), "tensorwise"), (lambda: _llama(False), "tensorwise"), (lambda: _llama(False), "rowwise"),
    (lambda: _llama(False), "blockwise"), (_gpt2, "tensorwise"),
], ids=["llama-tied", "llama", "llama-rowwise", "llama-blockwise", "gpt2-conv1d"])
def test_frozen_logits_near_the_float64_model(build, recipe, seed):
    torch.manual_seed(seed)
    model = build()
    reference = copy.deepcopy(model).double().eval()
    frozen = fp8.freeze(model, recipe=recipe)
    linears = [m for m in frozen.modules() if isinstance(m, Float8Linear)]
    assert linears and not any(type(m) is nn.Linear for m in frozen.modules())
    assert not any(type(m).__name__ == "Conv1D" for m in frozen.modules())
    assert all(m.config.input.kind == "current" for m in linears)
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        err = _rel(frozen(ids).logits, reference(ids).logits)
    assert err < LOGIT_REL_ERR


def test_frozen_model_holds_one_byte_per_weight_and_nothing_to_train(seed):
    torch.manual_seed(seed)
    model = _llama(tie=False)
    n_params = sum(p.numel() for p in model.parameters())
    frozen = fp8.freeze(model)
    assert not frozen.training
    assert all(not p.requires_grad for p in frozen.parameters())
    fp8_elems = sum(p.numel() for p in frozen.parameters() if isinstance(p, Float8Tensor))
    other_bytes = sum(p.numel() * p.element_size() for p in frozen.parameters() if not isinstance(p, Float8Tensor))
    report = fp8.memory_report(frozen)
    assert report["weights"] == fp8_elems + other_bytes
    assert report["master weights"] == report["weight gradients"] == report["optimizer states"] == 0
    assert fp8_elems > 0.99 * n_params  # only the norms stay in high precision
    # scales: one per row of every embedding table, one per linear weight and input (tensorwise)
    assert report["FP8 scaling metadata"] < 0.02 * report["weights"]
    # gradients reach the inputs (a loss on embeddings fed in), never the frozen weights
    embeds = torch.randn(2, 16, 128, requires_grad=True)
    frozen(inputs_embeds=embeds).logits.square().mean().backward()
    assert embeds.grad is not None and embeds.grad.abs().sum() > 0
    assert all(p.grad is None for p in frozen.parameters())


def test_tied_output_shares_the_fp8_table():
    torch.manual_seed(0)
    frozen = fp8.freeze(_llama(tie=True))
    table = frozen.model.embed_tokens
    assert isinstance(table, Float8Embedding) and isinstance(frozen.lm_head, Float8Linear)
    assert frozen.lm_head.weight is table.weight and frozen.lm_head.config.recipe == "rowwise"
    # a vocabulary that cannot run an FP8 GEMM: the head multiplies by the dequantized table, still shared
    frozen = fp8.freeze(_gpt2())
    assert isinstance(frozen.lm_head, Float8TiedOutput) and frozen.lm_head.weight is frozen.transformer.wte.weight
    bytes_ = fp8.memory_report(frozen)["weights"]
    assert bytes_ < sum(p.numel() * 4 for p in frozen.parameters()) / 3


def test_embedding_rows_are_the_e4m3_values_within_rounding(seed):
    gen = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(300, 64)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(300, 64, generator=gen) * torch.logspace(-3, 2, 300).unsqueeze(1))
    new = Float8Embedding.from_embedding(emb)
    assert new.weight.block == ROWWISE and new.weight.payload.dtype == torch.float8_e4m3fn
    ids = torch.randint(0, 300, (4, 9), generator=gen)
    got = new(ids).double()
    want = emb.weight.detach().double()[ids]
    scale = new.weight.scale.double()[ids]  # (4, 9, 1): value = payload / scale
    # E4M3 round to nearest: 2^-4 relative for normal values, half a subnormal step (2^-10 / scale) below 2^-6
    bound = torch.maximum(want.abs() * 2.0 ** -4, 2.0 ** -10 / scale)
    assert ((got - want).abs() <= bound * (1 + 1e-12)).all()
    assert torch.equal(got, new.weight.dequantize().double()[ids])


def test_bad_input_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="recipe must be one of"):
        fp8.freeze(_llama(tie=False), recipe="colwise")
    model = _llama(tie=False)
    model, _ = fp8.initialize(model, torch.optim.AdamW(model.parameters()), opt_level="O2")
    with pytest.raises(ValueError, match="copy.deepcopy"):
        fp8.freeze(model)
    with pytest.raises(ValueError, match="max_norm=1.0"):
        fp8.freeze(nn.Sequential(nn.Embedding(10, 16, max_norm=1.0), nn.Linear(16, 16)))


def test_a_table_registered_under_several_names_is_swapped_at_each():
    """T5-style: one embedding module reachable as ``shared`` and ``encoder_embed`` becomes one FP8 table at both."""
    model = nn.Module()
    model.shared = nn.Embedding(64, 32)
    model.encoder_embed = model.shared
    model.proj = nn.Linear(32, 32)
    frozen = fp8.freeze(model)
    assert isinstance(frozen.shared, Float8Embedding) and frozen.encoder_embed is frozen.shared
    assert not any(type(m) is nn.Embedding for _, m in frozen.named_modules(remove_duplicate=False))
