"""fp8.parallel on one rank: megatron-core's layer contract, equality with fp8.Float8Linear, the pipeline
codec and layout-independent initialisation (the multi-rank behaviour is in test_megatron_parallel.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from fp8 import Float8Linear, Float8LinearConfig, Float8Tensor, ScaledFloat16Tensor
from fp8.parallel import (
    ColumnParallelLinear, FP8ColumnParallelLinear, FP8RowParallelLinear, PipelineCodec, RowParallelLinear,
    initialize_sharded_weight, take_initial_masters,
)


@dataclass
class _Config:
    sequence_parallel: bool = False
    params_dtype: torch.dtype = torch.float32
    perform_initialization: bool = True


def _init(w):
    return torch.nn.init.normal_(w, std=0.05)


@pytest.mark.parametrize("cls", [FP8ColumnParallelLinear, FP8RowParallelLinear])
def test_one_rank_parallel_linear_equals_float8_linear(cls, seed):
    layer = cls(64, 32, config=_Config(), init_method=_init, bias=True, skip_bias_add=False,
                **({"input_is_parallel": True} if cls is FP8RowParallelLinear else {}))
    master = take_initial_masters(layer)[layer.weight]
    ref_linear = torch.nn.Linear(64, 32)
    with torch.no_grad():
        ref_linear.weight.copy_(master)
        ref_linear.bias.copy_(torch.randn(32))
        layer.bias.copy_(ref_linear.bias)
    ref = Float8Linear.from_linear(ref_linear)
    x = torch.randn(16, 2, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, bias = layer(x1)
    assert bias is None
    out_ref = ref(x2)
    assert torch.equal(out, out_ref)
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    assert torch.equal(x1.grad, x2.grad)
    assert isinstance(layer.weight.grad, ScaledFloat16Tensor)  # the default grad_accumulation="fp16"
    assert torch.equal(layer.weight.grad, ref.weight.grad)
    assert torch.equal(layer.bias.grad, ref.bias.grad)


def test_high_precision_layers_are_exact_linears(seed):
    col = ColumnParallelLinear(48, 32, config=_Config(), init_method=_init, bias=True, skip_bias_add=True)
    row = RowParallelLinear(32, 48, config=_Config(), init_method=_init, bias=True, input_is_parallel=True,
                            skip_bias_add=False)
    x = torch.randn(8, 3, 48, dtype=torch.float32)
    y, bias = col(x)
    assert bias is col.bias
    torch.testing.assert_close(y, F.linear(x, col.weight), rtol=0, atol=0)
    z, none = row(y + bias)
    assert none is None
    torch.testing.assert_close(z, F.linear(y + bias, row.weight, row.bias), rtol=1e-6, atol=1e-6)
    assert col.initial_master is None and not isinstance(col.weight, Float8Tensor)


def test_megatron_parameter_attributes():
    col = FP8ColumnParallelLinear(32, 64, config=_Config(), init_method=_init, stride=2)
    row = FP8RowParallelLinear(64, 32, config=_Config(sequence_parallel=True), init_method=_init, bias=True,
                               input_is_parallel=True, skip_bias_add=True)
    assert (col.weight.tensor_model_parallel, col.weight.partition_dim, col.weight.partition_stride) == (True, 0, 2)
    assert col.bias.tensor_model_parallel and row.weight.partition_dim == 1
    # One rank: sequence parallelism has nothing to split, so it is off and the bias is not marked.
    assert row.sequence_parallel is False and row.bias.sequence_parallel is False


def test_fp8_shard_dimensions_must_be_multiples_of_16():
    with pytest.raises(ValueError, match="multiples of 16"):
        FP8ColumnParallelLinear(40, 64, config=_Config(), init_method=_init)
    with pytest.raises(ValueError, match="input_is_parallel"):
        RowParallelLinear(64, 32, config=_Config(), init_method=_init, input_is_parallel=False)


def test_sharded_initialisation_is_layout_independent(seed):
    torch.manual_seed(seed)
    full = initialize_sharded_weight((64, 32), 0, 0, 1, _init, stride=2)
    for world in (2, 4):
        shards = []
        for rank in range(world):
            torch.manual_seed(seed)
            shards.append(initialize_sharded_weight((64, 32), 0, rank, world, _init, stride=2))
        # Strided partitioning: block b of the full weight lives on rank b % world.
        blocks = torch.split(full, 64 // (world * 2), dim=0)
        for rank, shard in enumerate(shards):
            assert torch.equal(shard, torch.cat(blocks[rank::world], dim=0))
    with pytest.raises(ValueError, match="divisible"):
        initialize_sharded_weight((60, 32), 0, 0, 8, _init)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_pipeline_codec_round_trip(fmt, gen):
    codec = PipelineCodec(fmt, torch.float32)
    x = torch.randn(32, 4, 64, generator=gen, dtype=torch.float64) * 3
    wire = codec.encode(x.float())
    assert wire.dtype == torch.uint8 and wire.numel() == x.numel() + 4 == codec.wire_numel(x.shape)
    y = codec.decode(wire, x.shape)
    # Relative error of each value within half an FP8 ulp of its binade (normal range), i.e. 2**-(m+1).
    mantissa = 3 if fmt == "e4m3" else 2
    rel = ((y.double() - x) / x).abs()
    normal = x.abs() > x.abs().max() * 2.0 ** -6
    assert rel[normal].max() <= 2.0 ** -(mantissa + 1) + 1e-12
    bad = x.float().clone()
    bad[0, 0, 0] = float("inf")
    assert torch.isnan(codec.decode(codec.encode(bad), x.shape)).any()
    plain = PipelineCodec(None, torch.float32)
    assert torch.equal(plain.decode(plain.encode(x.float()), x.shape), x.float())


@pytest.mark.parametrize("block", [(1, 0), (1, 128)])
def test_pipeline_codec_with_block_scales(block, gen):
    """Per-token / per-tile scales travel after the payload; values within E4M3 rounding of their block; a
    non-finite value reaches the receiver."""
    from fp8.blocks import block_amax, expand_scales

    x = torch.randn(8, 2, 256, generator=gen) * torch.logspace(-4, 4, 8).reshape(8, 1, 1)
    codec = PipelineCodec("e4m3", torch.float32, block)
    wire = codec.encode(x)
    rows = 16 * (1 if block == (1, 0) else 2)
    assert wire.dtype == torch.uint8 and wire.numel() == codec.wire_numel(x.shape) == x.numel() + 4 * rows
    back = codec.decode(wire, x.shape)
    amax = expand_scales(block_amax(x.reshape(16, 256), block), block, (16, 256)).reshape(x.shape)
    assert torch.all((back - x).abs() <= 2.0**-4 * x.abs() + amax * 2.0**-10 / 224)
    x[3, 1, 5] = float("inf")
    assert not torch.isfinite(codec.decode(codec.encode(x), x.shape)[3, 1]).all()
