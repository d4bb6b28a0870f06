"""The MXFP8 recipe (issue 33, :mod:`fp8.mxfp8`): scales per 32 elements along K, exact E8M0, cuBLAS's swizzled
layout, numerics against float64, the GEMM semantics of all three passes, and the refusal on GPUs older than
Blackwell. The dispatch audit of a training step on a simulated B200 (every GEMM ``scaled_mm_mx``, every call through
torch's ``meta`` kernel) is in ``test_gemm_readiness.py`` with the other recipes'."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import fp8
from fp8 import ops
from fp8.blocks import MX_BLOCK, MX_TILE, MX_TILE_T, dequantize_blocks, quantize_to_blocks
from fp8.gemm import GemmTarget, Operand, gemm_path, mm, mx_call_problem, mx_scale
from fp8.linear import Float8LinearConfig
from fp8.microscaling import swizzle, swizzled_numel, to_e8m0, unswizzle
from fp8.mxfp8 import MXWeightQuantizer
from fp8.recipes import get_recipe

B200 = GemmTarget("cuda", (10, 0), triton=True)
H100 = GemmTarget("cuda", (9, 0), triton=True)
E4M3_MAX = 448.0
SEEDS = range(8)


def _cublas_offset(r: int, c: int, k_blocks: int) -> int:
    """cuBLAS's documented 1D block-scaling-factor layout: 128 x 4 tiles, row tiles outer; inside a tile, row ``r``
    and K-block ``c`` at ``(r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4``."""
    k_tiles = -(-k_blocks // 4)
    tile = (r // 128) * k_tiles + c // 4
    return tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4


@pytest.mark.parametrize("rows,k_blocks", [(128, 4), (200, 7), (33, 1), (256, 12), (1, 2)])
def test_swizzle_puts_each_scale_where_cublas_reads_it(rows, k_blocks):
    scales = torch.arange(rows * k_blocks, dtype=torch.float32).reshape(rows, k_blocks) + 1
    flat = swizzle(scales)
    assert flat.numel() == swizzled_numel(rows, k_blocks) == -(-rows // 128) * 128 * -(-k_blocks // 4) * 4
    for r in range(rows):
        for c in range(k_blocks):
            assert flat[_cublas_offset(r, c, k_blocks)] == scales[r, c]
    assert int((flat != 0).sum()) == rows * k_blocks  # padding is zeros
    assert torch.equal(unswizzle(flat, rows, k_blocks), scales)


def test_mx_scales_op_is_repeat_e8m0_and_swizzle_in_one():
    gen = torch.Generator().manual_seed(2)
    grid = torch.exp2(torch.randint(-126, 127, (7, 5), generator=gen).float())
    got = ops.mx_scales(grid, 200, 32)  # a 32x32-block weight's grid serving 200 rows
    want = swizzle(to_e8m0(grid.repeat_interleave(32, 0)[:200]))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_e8m0_holds_every_power_of_two_scale_exactly():
    exponents = torch.arange(-126, 127, dtype=torch.float32)
    values = torch.exp2(exponents)
    e8m0 = to_e8m0(values)
    assert e8m0.dtype == torch.float8_e8m0fnu
    assert torch.equal(e8m0.to(torch.float32), values)
    assert torch.equal(e8m0.view(torch.uint8).to(torch.int32), exponents.to(torch.int32) + 127)


def _mx_bound(x64: torch.Tensor, amax_blocks: torch.Tensor) -> torch.Tensor:
    """Largest error of an E4M3 cast with a power-of-two scale mapping the block's amax into (224, 448]: half an ulp
    (2**-4 relative) for a normal scaled value, half the subnormal step (2**-10) divided by the scale (<= amax / 224)
    below it."""
    return torch.maximum(2.0**-4 * x64.abs(), 2.0**-10 * amax_blocks / 224.0) * (1 + 1e-9)


@pytest.mark.parametrize("seed", SEEDS)
def test_mx_tiles_error_within_analysis_bound_in_both_orientations(seed):
    gen = torch.Generator().manual_seed(seed)
    m, n = 96, 160
    # values over 2**+-12 with outlier channels, as activations have
    x = torch.randn(m, n, generator=gen) * torch.exp2(torch.randint(-12, 4, (1, n), generator=gen).float())
    x[:, 7] *= 300.0
    data, inv, data_c, inv_c = ops.quantize_tiles(x, "e4m3", True, 32, None, 32)
    assert inv.shape == (m, n // 32) and inv_c.shape == (m // 32, n) and data_c.shape == (m, n)
    x64 = x.double()
    for payload, scale_inv, block in ((data, inv, MX_TILE), (data_c, inv_c, MX_TILE_T)):
        assert torch.equal(to_e8m0(scale_inv).to(torch.float32), scale_inv)  # every scale is an E8M0 value
        got = dequantize_blocks(payload, scale_inv.reciprocal(), block, torch.float64)  # takes scales
        rows, cols = block
        amax = x64.abs().reshape(m // rows, rows, n // cols, cols).amax(dim=(1, 3))
        amax = amax.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
        assert ((got - x64).abs() <= _mx_bound(x64, amax)).all()
        assert (payload.to(torch.float32).abs().amax() <= E4M3_MAX)


def test_mx_scales_one_per_32_along_k_for_every_gemm_operand():
    """The recipe's blocks: activations 1x32 (forward, input gradient), 32x1 along the tokens (weight gradient),
    weights 32x32 (one scale per 32 along K in both of their GEMMs)."""
    recipe = get_recipe("mxfp8")
    assert (recipe.input, recipe.grad_output, recipe.weight, recipe.dgrad_weight) == (MX_TILE, MX_TILE, MX_BLOCK,
                                                                                       MX_BLOCK)
    assert (recipe.wgrad_grad_output, recipe.wgrad_input, recipe.grad_fmt) == (MX_TILE_T, MX_TILE_T, "e4m3")
    assert recipe.token_multiple == 32 and recipe.tile == 32


def _dq(op: Operand) -> torch.Tensor:
    return dequantize_blocks(op.data, op.scale_inv.reciprocal(), op.block, torch.float64)  # scale = 1 / scale_inv


def test_mxfp8_linear_runs_exactly_the_three_mx_gemms():
    """Forward, input gradient and weight gradient of an MXFP8 linear equal float64 products of the dequantized MX
    operands (x and dY in 1x32 tiles, their 32x1 copies for the weight gradient, W in 32x32 blocks) to the fp32
    summation bound: the recipe is exactly what the GEMMs compute."""
    torch.manual_seed(0)
    k, n, tokens = 96, 64, 48
    layer = fp8.Float8Linear.from_linear(nn.Linear(k, n, bias=False),
                                         Float8LinearConfig(recipe="mxfp8", grad_accumulation="fp32"))
    x = torch.randn(tokens, k, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    w = layer.weight
    assert w.block == MX_BLOCK and w.scale.shape == (n // 32, k // 32)
    w64 = w.dequantize().double()
    xq, xi, xc, xci = ops.quantize_tiles(x.detach(), "e4m3", True, 32, None, 32)
    gq, gi, gc, gci = ops.quantize_tiles(dy, "e4m3", True, 32, None, 32)
    checks = (
        (y, _dq(Operand(xq, xi, MX_TILE)) @ w64.t(), k),
        (x.grad, _dq(Operand(gq, gi, MX_TILE)) @ w64, n),
        (w.grad, _dq(Operand(gc, gci, MX_TILE_T)).t() @ _dq(Operand(xc, xci, MX_TILE_T)), tokens),
    )
    for got, want, depth in checks:
        bound = depth * 2.0**-24 * want.abs().max() * 4 + 1e-30
        assert (got.double() - want).abs().max() <= bound


def test_mx_gemm_meets_the_meta_kernel_with_the_weights_kept_swizzled_scales():
    """On a simulated B200 the MXFP8 weight keeps its transpose and both GEMMs' swizzled E8M0 scales (made once per
    optimizer step); those scales are the weight's 32x32 grid repeated per row, and the calls they make meet torch's
    ``meta`` kernel of ``F.scaled_mm`` (padded scale counts, E8M0, layouts)."""
    torch.manual_seed(1)
    n, k, tokens = 96, 160, 40
    w, scale = quantize_to_blocks(torch.randn(n, k), MX_BLOCK, "e4m3")
    quantizer = MXWeightQuantizer()
    fwd = quantizer.forward_b(w, scale, None, "auto", target=B200)
    assert fwd.hw_scale is not None and fwd.hw_scale.dtype == torch.float8_e8m0fnu
    per_row = scale.reciprocal().repeat_interleave(32, 0)  # (n, k / 32): W's rows are the forward's N
    assert torch.equal(unswizzle(fwd.hw_scale, n, k // 32).to(torch.float32), per_row)
    a = Operand(torch.zeros(tokens, k, dtype=torch.float8_e4m3fn), torch.ones(tokens, k // 32), MX_TILE)
    dgrad = quantizer.dgrad_b(w, scale, None, a, torch.bfloat16, "auto", target=B200)
    assert dgrad.data.shape == (n, k) and dgrad.data.stride() == (1, n)  # column-major W (the kept transpose)
    assert torch.equal(unswizzle(dgrad.hw_scale, k, n // 32).to(torch.float32), scale.reciprocal().t()
                       .repeat_interleave(32, 0))
    assert torch.equal(dgrad.hw_scale, mx_scale(Operand(w, scale.reciprocal(), MX_BLOCK), 0))
    meta = lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")  # noqa: E731
    for lhs, rhs, out_dtype in ((Operand(meta(a.data), meta(a.scale_inv), MX_TILE), fwd, torch.bfloat16),
                                (Operand(torch.empty(tokens, n, dtype=torch.float8_e4m3fn, device="meta"),
                                         torch.empty(tokens, n // 32, device="meta"), MX_TILE), dgrad, torch.float32)):
        rhs = Operand(meta(rhs.data), meta(rhs.scale_inv), rhs.block, meta(rhs.hw_scale))
        assert gemm_path(lhs.data, rhs.data, out_dtype, B200, "auto", lhs.block, rhs.block).path == "scaled_mm_mx"
        out = mm(lhs, rhs, out_dtype, "auto", target=B200)  # F.scaled_mm on meta tensors: torch's own checks
        assert out.shape == (tokens, rhs.data.shape[1]) and out.dtype == out_dtype


def test_mx_call_rules_reject_what_the_gpu_rejects():
    a = torch.empty(64, 96, dtype=torch.float8_e4m3fn, device="meta")
    b = torch.empty(48, 96, dtype=torch.float8_e4m3fn, device="meta").t()
    sa = torch.empty(swizzled_numel(64, 3), dtype=torch.float8_e8m0fnu, device="meta")
    sb = torch.empty(swizzled_numel(48, 3), dtype=torch.float8_e8m0fnu, device="meta")
    assert mx_call_problem(a, b, sa, sb, torch.bfloat16, B200) is None
    assert "Blackwell" in mx_call_problem(a, b, sa, sb, torch.bfloat16, H100)
    assert "float8_e8m0fnu" in mx_call_problem(a, b, sa[:64 * 3], sb, torch.bfloat16, B200)  # unpadded scales
    assert "column-major" in mx_call_problem(a, b.t().contiguous().t().contiguous(), sa, sb, torch.bfloat16, B200)
    odd = torch.empty(64, 80, dtype=torch.float8_e4m3fn, device="meta")
    assert "multiple of 32" in mx_call_problem(odd, b[:80], sa, sb, torch.bfloat16, B200)
    with pytest.raises(RuntimeError, match="scale_a must have"):  # what the meta kernel says of the same mistake
        torch.nn.functional.scaled_mm(a, b, sa[:64 * 3], torch.nn.functional.ScalingType.BlockWise1x32, sb,
                                      torch.nn.functional.ScalingType.BlockWise1x32,
                                      torch.nn.functional.SwizzleType.SWIZZLE_32_4_4,
                                      torch.nn.functional.SwizzleType.SWIZZLE_32_4_4, output_dtype=torch.bfloat16)


def test_gpus_before_blackwell_refuse_mxfp8_naming_the_generation():
    recipe = get_recipe("mxfp8")
    problem = recipe.hardware_problem(H100)
    assert "Hopper" in problem and "Blackwell" in problem and "10.0" in problem and "emulated" in problem
    assert recipe.hardware_problem(H100, "emulated") is None  # asked for: runs the emulation
    assert recipe.hardware_problem(B200) is None and recipe.hardware_problem(GemmTarget("cpu")) is None
    assert all(get_recipe(r).hardware_problem(H100) is None for r in ("tensorwise", "rowwise", "blockwise"))
    from megatron.training.arguments import check_recipe_hardware
    from megatron.training.config_rules import ConfigurationError

    args = SimpleNamespace(fp8_opt_level="O2", compare_levels=[], fp8_recipe="mxfp8", fp8_gemm_backend="auto",
                           sequence_parallel=False)
    with pytest.raises(ConfigurationError, match="--fp8-recipe mxfp8: .*Hopper.*--fp8-gemm-backend emulated"):
        check_recipe_hardware(args, H100)
    check_recipe_hardware(SimpleNamespace(**{**vars(args), "fp8_gemm_backend": "emulated"}), H100)
    check_recipe_hardware(args, B200)


def test_layers_off_the_32_multiple_run_tensorwise():
    config = Float8LinearConfig(recipe="mxfp8")
    assert config.for_dims(96, 64).recipe == "mxfp8"
    assert config.for_dims(80, 64).recipe == "tensorwise"  # 80 = 2.5 blocks of 32


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_mxfp8_trains_at_every_single_process_level(level):
    """A few optimizer steps of a small MLP at O1/O2 with MXFP8: weights stay in 32x32 blocks, the loss falls and stays
    within a few percent of the high-precision run's on the same data (O3: tests/fp8/test_recipes_distributed.py)."""
    losses = {}
    for run in ("none", level):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 32))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model, opt = fp8.initialize(model, opt, run, config=Float8LinearConfig(recipe="mxfp8"))
        gen = torch.Generator().manual_seed(1)
        x, target = torch.randn(64, 64, generator=gen), torch.randn(64, 32, generator=gen)
        for _ in range(30):
            loss = (model(x) - target).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[run] = loss.item()
        if run != "none":
            assert all(m.weight.block == MX_BLOCK for m in model if isinstance(m, fp8.Float8Linear))
    assert math.isfinite(losses[level]) and abs(losses[level] / losses["none"] - 1) < 0.05, losses


def test_the_gpu_op_sequence_on_the_cpu_equals_the_emulation_bit_for_bit():
    """``gemm_backend="scaled_mm"`` on the CPU runs the Blackwell sequence (swizzled E8M0 scales by
    :func:`fp8.ops.mx_scales`, the call's reference :func:`fp8.ops.mx_mm`) and keeps the weights' operands (transpose,
    scale grid, both GEMMs' swizzled scales): two O2 steps give the emulation's loss, gradients and weights, bit for
    bit."""
    results = []
    for backend in ("emulated", "scaled_mm"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, opt = fp8.initialize(model, opt, "O2", config=Float8LinearConfig(recipe="mxfp8", gemm_backend=backend))
        x = torch.randn(2, 40, 64, requires_grad=True)  # 80 tokens: the weight gradient's K padded to 96
        for _ in range(2):
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        kept = [len(m.weight.transpose_cache) for m in model if isinstance(m, fp8.Float8Linear)]
        results.append((loss.detach(), x.grad, [m.weight.dequantize() for m in model
                                                 if isinstance(m, fp8.Float8Linear)], kept))
    (loss0, grad0, w0, kept0), (loss1, grad1, w1, kept1) = results
    assert torch.equal(loss0, loss1) and torch.equal(grad0, grad1) and all(map(torch.equal, w0, w1))
    assert kept0 == [0, 0] and kept1 == [4, 4]


@pytest.mark.parametrize("rows,cols", [(64, 96), (40, 160), (300, 64), (33, 32)])
def test_quantize_mx_kernel_writes_the_tiles_and_their_swizzled_scales(rows, cols, seed):
    """fp8lm::quantize_mx: the Triton kernel (TRITON_INTERPRET=1) equals its torch reference bit for bit (tiles, grids,
    both swizzled E8M0 layouts with their zero padding), from high-precision x and from an FP8 x with its 1x32 grid;
    the reference is quantize_tiles(tile=32, transpose_c) and mx_scales of each grid."""
    import os

    pytest.importorskip("triton")
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernel tests run under TRITON_INTERPRET=1")
    from fp8 import ops
    from fp8.kernels import triton_quantize as tq

    def bits(t):
        return t if t.dtype == torch.float32 else t.view(torch.uint8)

    g = torch.Generator().manual_seed(seed)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(rows, cols, generator=g) * torch.logspace(-3, 3, cols)).to(dtype)
        for columnwise in (False, True):
            want = ops.quantize_mx(x, "e4m3", columnwise, 32)
            got = tq.launch_quantize_mx(x, torch.float8_e4m3fn, columnwise, 32)
            assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want)), (dtype, columnwise)
        data, inv, data_c, inv_c = ops.quantize_tiles(x, "e4m3", True, 32, None, 32, True)
        want = ops.quantize_mx(x, "e4m3", True, 32)
        assert torch.equal(bits(want[0]), bits(data)) and torch.equal(want[4], inv_c)
        assert torch.equal(bits(want[2]), bits(ops.mx_scales(inv, rows, 1)))
        assert torch.equal(bits(want[5]), bits(ops.mx_scales(inv_c, cols, 1)))
        fp8_x, fp8_inv = want[0], want[1]
        want = ops.quantize_mx(fp8_x, "e4m3", True, 32, fp8_inv)
        got = tq.launch_quantize_mx(fp8_x, torch.float8_e4m3fn, True, 32, fp8_inv)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, want)), dtype


def test_tile_operands_keep_their_hardware_scales_through_a_transpose():
    """A 1x32 operand's swizzled scales follow it through ``.t`` (its K is its own), an NVFP4 operand's too; a square
    block's (a 32x32 weight's: one layout per orientation) are dropped."""
    from fp8 import ops
    from fp8.gemm import Operand

    x = torch.randn(64, 64)
    data, inv, hw, data_c, inv_c, hw_c = ops.quantize_mx(x, "e4m3", True, 32)
    assert Operand(data_c, inv_c, (1, 32), hw_c).t.hw_scale is hw_c
    assert Operand(data, inv, (32, 32), hw).t.hw_scale is None
