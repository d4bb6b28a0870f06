"""``fp8.initialize(..., precision=RULES)`` on transformers models (issue 27): the same per-layer rules as
``pretrain_gpt.py --fp8-precision-config``, over ``model.named_modules()`` names, on a Llama and a GPT-2 (``Conv1D``);
the first matching rule wins; patterns matching nothing are refused before the model changes; an
``OptimizerPrecision`` still means the optimizer's precision."""

from __future__ import annotations

import pytest
import torch

import fp8
from fp8.linear import Float8Linear

transformers = pytest.importorskip("transformers")


def _llama(seed):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2(seed):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _fp8_layers(model):
    return {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}


def test_llama_rules_first_match_wins_and_training_works(seed):
    model = _llama(seed)
    rules = {"rules": [{"pattern": "model.layers.0.*", "precision": "bf16"},
                       {"pattern": "*.mlp.down_proj", "precision": "fp8", "recipe": "rowwise"},
                       {"pattern": "*.self_attn.q_proj", "precision": "fp8", "grad_output_fmt": "e4m3"}]}
    model, opt = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2", precision=rules,
                                min_fp8_dim=0)
    layers = _fp8_layers(model)
    assert not any(name.startswith("model.layers.0.") for name in layers)  # rule 1: layer 0 in high precision
    assert isinstance(model.model.layers[0].mlp.down_proj, torch.nn.Linear)
    assert layers["model.layers.1.mlp.down_proj"].config.recipe == "rowwise"
    assert layers["model.layers.1.self_attn.q_proj"].config.grad_output.fmt == "e4m3"
    assert layers["model.layers.1.self_attn.k_proj"].config.grad_output.fmt == "e5m2"  # no rule: the default
    assert layers["model.layers.1.self_attn.k_proj"].config.recipe == "tensorwise"
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert torch.isfinite(loss)


def test_gpt2_conv1d_rules(seed):
    model = _gpt2(seed)
    rules = [{"pattern": "transformer.h.1.mlp.*", "precision": "high"}, {"pattern": "transformer.h.*", "precision": "fp8"}]
    model, _ = fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1", precision=rules, min_fp8_dim=0)
    layers = _fp8_layers(model)
    assert sorted(layers) == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj", "transformer.h.0.mlp.c_fc",
                              "transformer.h.0.mlp.c_proj", "transformer.h.1.attn.c_attn", "transformer.h.1.attn.c_proj"]


def test_a_pattern_matching_nothing_is_refused_before_any_change(seed):
    model = _llama(seed)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"\['model.layers.7.\*'\] match no linear layer"):
        fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O2",
                       precision={"rules": [{"pattern": "model.layers.7.*", "precision": "bf16"}]})
    assert not _fp8_layers(model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="precision must be 'fp8', 'bf16' or 'high'"):
        fp8.initialize(_llama(seed), None, "O1", precision=[{"pattern": "*", "precision": "int8"}])


def test_an_optimizer_precision_is_still_the_optimizer_s(seed):
    from fp8.optim import OptimizerPrecision

    model = _llama(seed)
    model, opt = fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O2", min_fp8_dim=0,
                                optimizer_precision=OptimizerPrecision(exp_avg="fp16"))
    assert _fp8_layers(model) and opt.precision.exp_avg == "fp16"


def test_layer_precisions_names_each_linears_current_setting():
    """``fp8.layer_precisions``: "fp8:<recipe>" per FP8 linear (a layer too narrow for blockwise runs tensorwise),
    the dtype of a high-precision one (a rule's, a tied head, GPT-2's unconverted Conv1D), and the high-precision
    forward while it is switched on."""
    rules = [{"pattern": "*.mlp.down_proj", "precision": "bf16"}]
    model, _ = fp8.initialize(_llama(0).to(torch.bfloat16), None, "O1", recipe="blockwise", precision=rules)
    settings = fp8.layer_precisions(model)
    assert settings["model.layers.0.mlp.down_proj"] == "bf16" and settings["model.layers.1.mlp.down_proj"] == "bf16"
    assert settings["model.layers.0.self_attn.q_proj"] == "fp8:tensorwise"  # 64 wide: below blockwise's 128
    assert len(settings) == 2 * 7 + 1 and settings["lm_head"] in ("fp8:tensorwise", "bf16")
    with fp8.convert.high_precision_forward(model):
        assert fp8.layer_precisions(model)["model.layers.1.self_attn.o_proj"] == "fp8:tensorwise:high-precision-forward"
    assert fp8.layer_precisions(model) == settings
    gpt2, _ = fp8.initialize(_gpt2(0), None, "O1", module_filter_fn=lambda m, name: "c_fc" not in name)
    settings = fp8.layer_precisions(gpt2)
    assert settings["transformer.h.0.mlp.c_fc"] == "fp32" and settings["transformer.h.0.attn.c_attn"] == "fp8:tensorwise"
