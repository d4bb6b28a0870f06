"""transformers ``Conv1D`` (GPT-2's transposed linear) converts to FP8 like ``nn.Linear``: a single layer
(numerics, bits of the FP8 weight) and a tiny ``GPT2LMHeadModel`` trained at O1 and O2 (masters shaped
(out, in), FP8 weights re-quantized from them)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402
from transformers.pytorch_utils import Conv1D  # noqa: E402

import fp8  # noqa: E402
from fp8.convert import convert_to_float8_linear, float8_linear_from_conv1d, is_conv1d  # noqa: E402
from fp8.tensor import Float8Tensor, to_float8  # noqa: E402

FORWARD_BOUND = 0.1  # relative Frobenius error of the FP8 forward vs float64 (measured 0.037, E4M3 x and w)
MASTER_BOUND = 0.07  # relative Frobenius error of the FP8 weight vs its master (E4M3 rounding; measured 0.027)
TRACKING_BOUND = 0.01  # |loss_fp8 - loss_fp32| / loss_fp32 after 5 steps (measured 0.0003 at O2 and O1)
N_CONV1D = 8  # per GPT-2 block: attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj; 2 blocks


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def _same_bits(a: Float8Tensor, b: Float8Tensor) -> bool:
    return (torch.equal(a.payload.view(torch.uint8), b.payload.view(torch.uint8))
            and torch.equal(a.scale, b.scale))


def _conv1d(nf=64, nx=32, seed=0) -> Conv1D:
    torch.manual_seed(seed)
    conv = Conv1D(nf, nx)
    with torch.no_grad():
        conv.weight.normal_(0, 0.2)
        conv.bias.normal_(0, 0.1)
    return conv


def test_single_conv1d_converts_with_transposed_weight():
    conv = _conv1d()
    assert is_conv1d(conv) and tuple(conv.weight.shape) == (32, 64)
    weight, bias = conv.weight, conv.bias
    x = torch.randn(4, 8, 32)
    reference = x.double() @ weight.detach().double() + bias.detach().double()

    new, converted = convert_to_float8_linear(conv, min_fp8_dim=0)
    assert isinstance(new, fp8.Float8Linear) and (new.in_features, new.out_features) == (32, 64)
    assert len(converted) == 1
    record = converted[0]
    assert record.transposed_from is weight and record.optimizer_param is weight
    assert tuple(record.original_weight.shape) == (64, 32)
    assert torch.equal(record.original_weight, weight.detach().t())
    assert new.bias is bias  # the same Parameter, as from_linear does for nn.Linear
    assert isinstance(new.weight, Float8Tensor) and tuple(new.weight.shape) == (64, 32)
    assert _same_bits(new.weight, to_float8(weight.detach().t()))

    out = new(x)
    assert out.shape == (4, 8, 64)
    error = _rel(out, reference)
    assert error < FORWARD_BOUND, error


def test_float8_linear_from_conv1d_refuses_other_modules():
    with pytest.raises(TypeError, match="Conv1D"):
        float8_linear_from_conv1d(nn.Linear(32, 64))


def test_conv1d_eligibility_rules_match_linear(caplog):
    model = nn.Sequential(_conv1d(nf=64, nx=24), _conv1d(nf=64, nx=64), _conv1d(nf=64, nx=64))
    with caplog.at_level("INFO", logger="fp8"):
        _, converted = convert_to_float8_linear(model, module_filter_fn=lambda m, fqn: fqn != "2", min_fp8_dim=0)
    assert [c.fqn for c in converted] == ["1"]
    assert "kept 0 in high precision" in caplog.text and "multiples of 16" in caplog.text
    assert "kept 2 in high precision: excluded by module_filter_fn" in caplog.text
    _, converted = convert_to_float8_linear(nn.Sequential(_conv1d(nf=64, nx=32)), min_fp8_dim=64)
    assert converted == []


def _gpt2(seed=0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def _train(model, optimizer, steps=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (4, 32), generator=gen)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _fp8_layers(model):
    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, fp8.Float8Linear)}


def _check_converted(model):
    layers = _fp8_layers(model)
    assert len(layers) == N_CONV1D, sorted(layers)
    assert all(fqn.split(".")[-1] in ("c_attn", "c_proj", "c_fc") for fqn in layers)
    assert not any(is_conv1d(m) for m in model.modules())
    assert type(model.lm_head) is nn.Linear  # tied to wte: kept, as before
    assert model.lm_head.weight is model.transformer.wte.weight
    return layers


def _check_losses(losses):
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert sum(losses[-2:]) / 2 < sum(losses[:2]) / 2, losses  # decreasing on average
    assert losses[-1] < losses[0], losses
    reference = _gpt2()  # the same model and batch in fp32
    fp32 = _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-3))
    assert abs(losses[-1] - fp32[-1]) / fp32[-1] < TRACKING_BOUND, (losses, fp32)


def test_gpt2_o2_converts_every_conv1d_and_trains():
    model = _gpt2()
    shapes = {fqn: tuple(m.weight.shape) for fqn, m in model.named_modules() if is_conv1d(m)}
    assert len(shapes) == N_CONV1D
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2")
    layers = _check_converted(model)
    fp8_weights = {id(m.weight) for m in layers.values()}
    held = [p for g in optimizer.param_groups for p in g["params"]]
    assert sum(id(p) in fp8_weights for p in held) == N_CONV1D
    own = {id(p) for p in model.parameters()}
    assert all(id(p) in own for p in held)  # no stale (in, out) Conv1D weight left in the optimizer
    for fqn, layer in layers.items():
        in_features, out_features = shapes[fqn]
        assert tuple(layer.weight.shape) == (out_features, in_features)
        assert tuple(optimizer.master_value(layer.weight).shape) == (out_features, in_features)

    losses = _train(model, optimizer)
    _check_losses(losses)
    for layer in layers.values():
        master = optimizer.master_value(layer.weight)
        assert _same_bits(layer.weight, to_float8(master))
        assert _rel(layer.weight.dequantize(), master) < MASTER_BOUND


def test_gpt2_o1_converts_every_conv1d_and_trains():
    model = _gpt2()
    conv_weights = {id(m.weight) for m in model.modules() if is_conv1d(m)}
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O1")
    layers = _check_converted(model)
    assert len(optimizer.pairs) == N_CONV1D
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert not held & conv_weights  # the (in, out) weights were swapped for their (out, in) masters
    for master, weight in optimizer.pairs:
        assert id(master) in held and master.shape == weight.shape and not isinstance(master, Float8Tensor)
    before = [m.detach().clone() for m in optimizer.master_weights]

    losses = _train(model, optimizer)
    _check_losses(losses)
    for (master, weight), old in zip(optimizer.pairs, before):
        assert not torch.equal(master, old)  # the masters are what the optimizer steps
        assert _same_bits(weight, to_float8(master.detach()))
        assert _rel(weight.dequantize(), master) < MASTER_BOUND
    assert len(layers) == N_CONV1D


def test_o1_refuses_conv1d_weights_with_optimizer_state():
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, optimizer, steps=1)
    with pytest.raises(ValueError, match="Conv1D"):
        fp8.initialize(model, optimizer, "O1")
    assert not _fp8_layers(model)  # refused before the model was touched
