"""Smooth-SwiGLU (:mod:`fp8.smooth_swiglu`): the down projection of a gated MLP scales its input per channel before
the FP8 cast and folds the inverse scales into its weight operand. The same function in exact arithmetic (float64,
and the high-precision forward), the FP8 output and both gradients within their quantization bounds of float64 on
inputs with planted outlier channels, no saturation where the tensor-wise delayed cast saturates, the launch budget,
a transformers Llama training with it, and Megatron's layer spec building it (``swiglu_smooth``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import fp8
from fp8.launches import LaunchCounter
from fp8.smooth_swiglu import (SmoothSwiGLUConfig, SmoothSwiGLULinear, smooth_config, smooth_swiglu, smoothing_scales,
                               weight_operand_exact)
from fp8.stats import FP8Statistics, flush_and_saturation_counts
from tests.fp8_bounds import product_error_bound, quantization_error_bound

TOKENS, HIDDEN, FFN = 96, 64, 256


def _gated(gen, tokens=TOKENS, outliers=6, magnitude=256.0):
    """``(h, outlier channels)``: SwiGLU's gated product ``silu(x W1^T) * (x W2^T)`` of random data with
    ``outliers`` channels scaled by ``magnitude`` (the aligned channels Fishman et al. observe)."""
    x = torch.randn(tokens, HIDDEN, generator=gen)
    w1, w2 = (torch.randn(FFN, HIDDEN, generator=gen) / HIDDEN ** 0.5 for _ in range(2))
    h = F.silu(x @ w1.t()) * (x @ w2.t())
    channels = torch.randperm(FFN, generator=gen)[:outliers]
    h[:, channels] *= magnitude
    return h, channels


def _down(gen, smooth=True, **config):
    linear = torch.nn.Linear(FFN, HIDDEN, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(HIDDEN, FFN, generator=gen) / FFN ** 0.5)
    layer = fp8.Float8Linear.from_linear(linear, fp8.Float8LinearConfig(**config))
    return SmoothSwiGLULinear.from_float8_linear(layer) if smooth else layer


def _forward_bound(h64, w64, s, fmt="e4m3"):
    """Element-wise bound on ``|y - h @ W^T|`` for the smoothed forward: ``h`` rounded per channel (its scale ``s``),
    ``W / s`` re-quantized per output channel, exact except where a value falls below the normal range of its row
    (:func:`weight_operand_exact`), fp32 accumulation."""
    eh = quantization_error_bound(h64, s, fmt)
    shifted = w64 / s.double()
    row_scale = fp8.compute_scale(shifted.abs().amax(dim=1, keepdim=True).float(), fmt).double()
    ew = torch.where(weight_operand_exact(w64, s, fmt), torch.zeros_like(w64),
                     quantization_error_bound(shifted, row_scale, fmt) * s.double())
    prod = product_error_bound(h64, eh, w64.t(), ew.t())
    accumulation = h64.shape[1] * 2.0 ** -23 * ((h64.abs() + eh) @ (w64.abs() + ew).t())
    return prod + accumulation + 1e-30


@pytest.mark.parametrize("magnitude", [1.0, 64.0, 4096.0])
def test_forward_matches_float64_within_its_quantization_bound(gen, magnitude):
    layer = _down(gen)
    w64 = layer.weight.dequantize(torch.float64)  # the layer's function is h @ W^T with its FP8 weight's values
    for _ in range(3):  # fresh inputs, the same layer
        h, _ = _gated(gen, magnitude=magnitude)
        y = layer(h)
        exact = h.double() @ w64.t()
        bound = _forward_bound(h.double(), w64, smoothing_scales(h))
        assert torch.all((y.double() - exact).abs() <= bound)
        # typical error (relative, Frobenius): E4M3's rounding of h, whatever the outliers (measured over 300 seeds:
        # 0.025-0.028 without outliers, 0.020-0.036 with them; the bound holds 2x of headroom)
        assert (y.double() - exact).norm() / exact.norm() < 0.075


def test_the_function_is_unchanged_in_exact_arithmetic(gen):
    """In float64 the scaling is exact (powers of two): ``(h s) @ (W / s)^T`` is ``h @ W^T`` bit for bit. The FP8
    operands are exactly ``h`` rounded per channel and ``W`` itself (divided and multiplied by ``s``), and the FP8
    output equals their float64 product to fp32 accumulation. With the forward in high precision the smoothed and
    the plain linear compute the same output."""
    h, _ = _gated(gen)
    layer = _down(gen)
    w64, h64 = layer.weight.dequantize(torch.float64), h.double()
    s = smoothing_scales(h).double()
    assert torch.equal((h64 * s) @ (w64 / s).t(), h64 @ w64.t())

    quantizers = layer.config.recipe_spec.make_quantizers(layer.input_scaling, layer.grad_output_scaling, "e4m3")
    rows, cols = quantizers.input.quantize(h, record=False, columnwise=True)
    b = quantizers.weight.forward_b(layer.weight.payload, layer.weight.scale, layer.weight, "emulated")
    a64 = rows.data.double() * rows.scale_inv.double()  # Q(h * s), unit row scales
    b64 = b.data.double() * b.scale_inv.double()  # (W / s)^T
    h_q = cols.data[:, :TOKENS].t().double() * cols.scale_inv.t().double()  # h rounded per channel
    assert torch.equal(a64 / s, h_q)  # the forward's a and the weight gradient's operand: one rounding of h
    kept = weight_operand_exact(w64, s)  # where W / s is an E4M3 value in its row's scale
    # measured over 40 seeds: 0.975-0.992 kept with outliers 256x (the smallest weights of quiet channels fall below
    # the normal range of their row), 0.9997-1.0 without
    assert kept.double().mean() > 0.95
    assert torch.equal((b64.t() * s)[kept], w64[kept])  # the weight operand is W, shifted by whole binades
    accumulation = FFN * 2.0 ** -23 * (a64.abs() @ b64.abs())  # the GEMM's fp32 sums
    assert torch.all((layer(h).double() - a64 @ b64).abs() <= accumulation)
    calm, _ = _gated(gen, magnitude=1.0)
    assert weight_operand_exact(w64, smoothing_scales(calm)).double().mean() > 0.999

    plain = _down(torch.Generator().manual_seed(0), smooth=False)
    smoothed = SmoothSwiGLULinear.from_float8_linear(_down(torch.Generator().manual_seed(0), smooth=False))
    for module in (plain, smoothed):
        fp8.set_high_precision_forward(module)
    assert isinstance(smoothed.config, SmoothSwiGLUConfig)  # switching keeps the smoothed config
    assert torch.equal(plain(h), smoothed(h))


def test_gradients_match_float64_within_their_bounds(gen):
    """``dh = Q(dY) @ W`` (the stored weight: no ``s``) and ``dW = Q(dY)^T @ h_q`` (``h`` rounded per channel):
    finite, within their quantization bounds of float64, and ``dh`` bit for bit the plain tensor-wise linear's."""
    h, _ = _gated(gen, magnitude=1024.0)
    g = torch.randn(TOKENS, HIDDEN, generator=gen) * 1e-3
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    layers = {smooth: _down(torch.Generator().manual_seed(seed), smooth, grad_accumulation="fp32")
              for smooth in (True, False)}
    grads = {}
    for smooth, layer in layers.items():
        hin = h.clone().requires_grad_(True)
        layer(hin).backward(g)
        grads[smooth] = (hin.grad, layer.weight.grad)
    dh, dw = grads[True]
    assert torch.isfinite(dh).all() and torch.isfinite(dw).all()
    assert torch.equal(dh, grads[False][0])

    w64, h64, g64 = layers[True].weight.dequantize(torch.float64), h.double(), g.double()
    eg = quantization_error_bound(g, fp8.compute_scale(g.abs().amax(), "e5m2"), "e5m2")
    eh = quantization_error_bound(h, smoothing_scales(h), "e4m3")
    slack = 1 + 1e-5
    exact_dh = g64 @ w64
    assert torch.all((dh.double() - exact_dh).abs() <= product_error_bound(g64, eg, w64, torch.zeros_like(w64)) * slack)
    exact_dw = g64.t() @ h64
    assert torch.all((dw.double() - exact_dw).abs() <= product_error_bound(g64.t(), eg.t(), h64, eh) * slack + 1e-30)
    # typical errors (measured over 300 seeds: 0.051-0.055 and 0.051-0.070; E5M2's rounding of dY dominates)
    assert (dh.double() - exact_dh).norm() / exact_dh.norm() < 0.11
    assert (dw.double() - exact_dw).norm() / exact_dw.norm() < 0.14


def test_outlier_channels_saturate_the_delayed_cast_but_not_the_smoothed_one(gen):
    """The tensor-wise delayed scale, set on steps without outliers, clamps outlier channels that appear later
    (FP8Statistics and flush_and_saturation_counts); the smoothed cast saturates nothing, and its output stays within
    E4M3's rounding where the delayed one's is far off."""
    quiet, _ = _gated(gen, magnitude=1.0)
    loud, channels = _gated(gen, magnitude=256.0)
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    saturated, errors = {}, {}
    for smooth in (False, True):
        layer = _down(torch.Generator().manual_seed(seed), smooth)
        layer(quiet.clone().requires_grad_(True)).sum().backward()  # a training step without outliers
        fp8.update_scales(layer)
        stats = FP8Statistics(layer, interval=1)
        stats.begin_step(1)
        y = layer(loud.clone().requires_grad_(True))
        saturated[smooth] = stats.read()[""]["input"]["saturated"]
        exact = loud.double() @ layer.weight.dequantize(torch.float64).t()
        errors[smooth] = ((y.double() - exact).norm() / exact.norm()).item()
        if not smooth:  # the delayed scale it cast with, on the outlier channels alone
            counts = flush_and_saturation_counts(loud[:, channels], layer.input_scaling.scale, fp8.E4M3)
            assert counts[1] / counts[2] > 0.35
    counts = flush_and_saturation_counts(loud, smoothing_scales(loud), fp8.E4M3)
    assert counts[1] == 0
    # measured over 40 seeds: 0.71-0.87 of the outlier channels' values saturate, 0.017-0.021 of all (6 channels of
    # 256), relative error 0.94-0.98 of the delayed cast's output; bounds at half of those
    assert saturated[False] > 0.008 and saturated[True] == 0.0
    assert errors[False] > 0.47 and errors[True] < 0.075


def test_launches_per_smoothed_linear():
    """On the hardware GEMM path (counted on the CPU, :class:`fp8.launches.LaunchCounter`): the forward adds 4
    launches to the tensor-wise delayed recipe's 2 (the per-channel cast replaces the cast-transpose; its row-major
    copy, the weight operand, the unit row scales, ``1 / s`` times the weight's ``1 / scale``), the backward 1 (the
    weight-gradient GEMM's per-column scales with a tensor-wise ``dY``: its row scales expanded)."""
    from benchmarks.smooth_swiglu import launches

    counted = launches(64, 64)
    counts = {smooth: (c["forward"]["launches"], c["backward"]["launches"], c["forward"]["full_size_passes"],
                       c["backward"]["full_size_passes"]) for smooth, c in ((False, counted["plain"]),
                                                                            (True, counted["smoothed"]))}
    plain, smoothed = counts[False], counts[True]
    assert smoothed[0] == plain[0] + 4 and smoothed[1] == plain[1] + 1, counts
    assert smoothed[2] == plain[2] + 2 and smoothed[3] == plain[3], counts  # + the FP8 transpose, the weight pass


transformers = pytest.importorskip("transformers")


def _llama(seed):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _train(model, optimizer, ids, steps):
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_tiny_llama_trains_with_smoothed_down_projections(seed):
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(seed))
    runs = {}
    for smooth in (False, True):
        model = _llama(seed)
        model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=3e-3), "O2", min_fp8_dim=0)
        keys = set(model.state_dict())
        if smooth:
            assert smooth_swiglu(model) == 2 and smooth_swiglu(model) == 0  # idempotent
            assert set(model.state_dict()) == keys  # checkpoints keep their keys
            down = model.model.layers[1].mlp.down_proj
            assert isinstance(down, SmoothSwiGLULinear) and "smooth_swiglu=True" in repr(down)
            before = down.weight.dequantize(torch.float32).clone()
        runs[smooth] = _train(model, optimizer, ids, 4)
        if smooth:
            assert not torch.equal(down.weight.dequantize(torch.float32), before)  # the optimizer steps it
    plain, smoothed = runs[False], runs[True]
    assert all(torch.isfinite(torch.tensor(smoothed))) and smoothed[-1] < smoothed[0] - 0.1
    # the same function: losses within FP8 rounding of the plain run (measured over 6 seeds: 0.0001-0.003 apart)
    assert max(abs(a - b) for a, b in zip(plain, smoothed)) < 0.02


def test_smooth_swiglu_refuses_naming_the_fix(seed):
    with pytest.raises(ValueError, match="no gated MLP"):
        smooth_swiglu(torch.nn.Sequential(torch.nn.Linear(16, 16)))
    with pytest.raises(ValueError, match=r"call fp8.initialize\(model, optimizer"):
        smooth_swiglu(_llama(seed))
    model, _ = fp8.initialize(_llama(seed), None, "O1", min_fp8_dim=0, recipe="rowwise")
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj: .*use recipe 'tensorwise'"):
        smooth_swiglu(model)
    assert not isinstance(model.model.layers[0].mlp.down_proj, SmoothSwiGLULinear)  # nothing changed
    with pytest.raises(ValueError, match="tensorwise"):
        smooth_config(fp8.Float8LinearConfig(recipe="blockwise"))
    config = smooth_config(fp8.Float8LinearConfig(grad_accumulation="fp32"))
    assert config.grad_accumulation == "fp32" and smooth_config(config) is config
    assert isinstance(dataclasses.replace(config, gemm_backend="emulated"), SmoothSwiGLUConfig)


def test_megatron_spec_builds_a_smoothed_fc2():
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from fp8.parallel import RowParallelLinear
    from megatron.training.gpt_layer_specs import get_gpt_layer_fp8_spec

    recipe = fp8.Float8LinearConfig()
    spec = get_gpt_layer_fp8_spec(recipe, swiglu_smooth=True)
    mlp_spec = spec.submodules.mlp.submodules
    assert isinstance(mlp_spec.linear_fc2.params["fp8"], SmoothSwiGLUConfig)
    assert type(mlp_spec.linear_fc1.params["fp8"]) is fp8.Float8LinearConfig
    assert type(spec.submodules.self_attention.submodules.linear_proj.params["fp8"]) is fp8.Float8LinearConfig
    assert get_gpt_layer_fp8_spec(high_precision=True, swiglu_smooth=True).submodules.mlp.submodules.linear_fc2 \
        .params["fp8"] is None  # a layer kept in high precision has nothing to smooth
    with pytest.raises(ValueError, match="--fp8-recipe tensorwise"):
        get_gpt_layer_fp8_spec(fp8.Float8LinearConfig(recipe="rowwise"), swiglu_smooth=True)
    with pytest.raises(ValueError, match="drop --swiglu-smooth or --num-experts"):
        get_gpt_layer_fp8_spec(recipe, swiglu_smooth=True, num_experts=2)

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=FFN,
                               gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                               bias_activation_fusion=False, use_cpu_initialization=True)
    outs = {}
    for smooth in (False, True):
        torch.manual_seed(0)
        mlp = build_module(get_gpt_layer_fp8_spec(recipe, swiglu_smooth=smooth).submodules.mlp, config=config,
                           ffn_hidden_size=FFN)
        assert isinstance(mlp.linear_fc2, RowParallelLinear)
        assert isinstance(mlp.linear_fc2.fp8, SmoothSwiGLUConfig) == smooth
        x = torch.randn(16, 2, HIDDEN, generator=torch.Generator().manual_seed(1), requires_grad=True)
        y, _ = mlp(x)
        y.sum().backward()
        assert torch.isfinite(x.grad).all()
        outs[smooth] = y.detach()
    # the same weights (same seed), the same function: outputs within E4M3's rounding of the gated product
    assert (outs[True] - outs[False]).norm() / outs[False].norm() < 0.05


def test_initialize_smooths_and_the_fallback_keeps_the_smoothed_recipe(seed):
    """``fp8.initialize(..., smooth_swiglu=True)``: every FP8 down projection smoothed, the rest as before; automatic
    fallback can move a smoothed linear only to high precision (its quantizers are its own)."""
    from fp8.fallback import allowed_settings

    model, _ = fp8.initialize(_llama(seed), None, "O1",
                              min_fp8_dim=0, smooth_swiglu=True)
    downs = [m.mlp.down_proj for m in model.model.layers]
    assert all(isinstance(d, SmoothSwiGLULinear) for d in downs)
    assert not isinstance(model.model.layers[0].mlp.up_proj, SmoothSwiGLULinear)
    assert allowed_settings(downs[0], ("tensorwise", "rowwise", "blockwise", "high")) == ("tensorwise", "high")
    with pytest.raises(ValueError, match="pass an FP8 opt_level"):
        fp8.initialize(_llama(seed), None, "none", smooth_swiglu=True)


def test_pretrain_gpt_swiglu_smooth(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--micro-batch-size", "2", "--mock-data", "--vocab-size", "256", "--train-iters", "3", "--log-interval",
             "1", "--eval-interval", "0", "--no-progress", "--fp8-opt-level", "O2", "--swiglu"]
    runs = {}
    for name, extra in (("plain", []), ("smooth", ["--swiglu-smooth"])):
        log = tmp_path / f"{name}.jsonl"
        proc = subprocess.run([sys.executable, "pretrain_gpt.py", *flags, *extra, "--log-json", str(log)], cwd=root,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = [json.loads(line)["loss"] for line in log.read_text().splitlines() if '"iteration"' in line]
    # the same function: the first loss (the same weights, before any step) within FP8 rounding
    assert abs(runs["plain"][0] - runs["smooth"][0]) < 0.01 * runs["plain"][0]
    for extra, message in ((["--swiglu-smooth"], "add --swiglu"),
                           (["--swiglu", "--swiglu-smooth", "--fp8-recipe", "rowwise"], "never saturates")):
        args = [a for a in flags if a != "--swiglu"] + extra
        proc = subprocess.run([sys.executable, "pretrain_gpt.py", *args], cwd=root, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
