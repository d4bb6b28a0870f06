"""The FP8 core's fused kernels (:mod:`fp8.ops`): the scale formula against float64, each op's Triton launcher (run
under ``TRITON_INTERPRET=1`` on CPU tensors, as CUDA runs it through ``register_kernel("cuda")``) against the op's
torch reference bit for bit, on fresh random inputs with odd shapes, padding, inf and NaN; and each op one launch.

The references are the oracles: every cast, transpose and scale of the FP8 linear, the grouped experts and the
delayed-scaling step goes through these ops, so their agreement with the Triton kernels is what makes the CPU
launch counts (``benchmarks/kernels.py``) the GPU's.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (lazily, by the kernels)

import pytest
import torch

from fp8 import ops
from fp8.launches import LaunchCounter

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FMT = {"e4m3": E4M3, "e5m2": E5M2}
SHAPES = [(100, 272), (37, 128), (256, 200), (1, 16), (130, 384)]


def _needs_triton():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernel tests run under TRITON_INTERPRET=1")
    from fp8.kernels import triton_quantize

    return triton_quantize


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _same(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if a.is_floating_point() and a.element_size() > 1:  # NaN's sign and payload bits are free in fp32/bf16/fp16
        nan = torch.isnan(a)
        assert torch.equal(nan, torch.isnan(b)), what
        a, b = a.masked_fill(nan, 0), b.masked_fill(nan, 0)
    assert torch.equal(_bits(a), _bits(b)), (what, (_bits(a) != _bits(b)).sum().item())


def _input(shape, dtype, seed, special=True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over many binades, so every scale and rounding path is met
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 8, shape, generator=g).float())
    if special:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (3,), generator=g)
        flat[idx[0]] = float("inf")
        flat[idx[1]] = float("nan")
        flat[idx[2]] = -float("inf")
    return x.to(dtype)


# -- the scale formula ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmax,margin", [(448.0, 0), (57344.0, 0), (448.0, 2), (65504.0, 11)])
def test_power_of_two_scale_is_exact_against_float64(fmax, margin):
    g = torch.Generator().manual_seed(7)
    amax = torch.cat([
        torch.exp2(torch.randint(-120, 120, (4000,), generator=g).float()) * (1 + torch.rand(4000, generator=g)),
        torch.exp2(torch.arange(-120, 121).float()),  # exact powers of two: the floor's edge
        torch.tensor([0.0, float("inf"), float("nan"), fmax, fmax / 2, 1e-40]),
    ])
    got = ops.power_of_two_scale(amax, fmax, margin, previous=torch.full_like(amax, 3.0))
    for a, s in zip(amax.tolist(), got.tolist()):
        if not (math.isfinite(a) and a > 0):
            assert s == 3.0  # the previous scale
            continue
        e = math.floor(math.log2(fmax / float(torch.tensor(a, dtype=torch.float32))))
        # float64's floor(log2) can round up at an exact power of two's neighbour: correct as the op does
        while 2.0 ** e > fmax / a:
            e -= 1
        e = min(e, 128)  # the ratio is an fp32 number: past its range it is inf, whose exponent is 128
        assert s == 2.0 ** max(-126, min(126, e - margin)), (a, s, e)
        if -126 < e - margin < 126:
            assert fmax / 2 < a * s * 2 ** margin <= fmax or a * s * 2 ** margin <= fmax


# -- each Triton launcher against its reference -------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_amax_kernel_matches_reference(shape, dtype):
    tq = _needs_triton()
    for seed, special in ((0, True), (1, False)):
        x = _input(shape, dtype, seed, special)
        row = torch.rand(shape[0], 1) + 0.5
        col = torch.rand(1, shape[1]) + 0.5
        for r, c in ((None, None), (row, None), (None, col), (row, col)):
            _same(tq.launch_amax(x, r, c), ops.amax(x, r, c), f"amax {shape} {r is None} {c is None}")
    _same(tq.launch_amax(x.t(), None, None), ops.amax(x.t()), "amax of a transposed view")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pad", [1, 16])
def test_cast_transpose_kernels_match_reference(shape, fmt, pad):
    tq = _needs_triton()
    x = _input(shape, torch.bfloat16, 3)
    scale = torch.tensor(2.0 ** 5)
    for transpose in (False, True):
        slot_ref, slot_tri = torch.tensor([0.25]), torch.tensor([0.25])
        want = ops.cast_transpose(x, scale, slot_ref, fmt, transpose, pad, True)
        got = tq.launch_cast_transpose(x, scale, None, None, slot_tri, FMT[fmt], 0, transpose, pad, True, None, None)
        for w, g, name in zip(want, got, ("data", "data_t", "scale_inv")):
            _same(g, w, f"delayed {name}")
        _same(slot_tri, slot_ref, "recorded amax")
        # current scaling: the scale from the amax op's result, in the kernel
        for special in (True, False):
            x2 = _input(shape, torch.bfloat16, 4, special)
            amax2 = ops.amax(x2)
            previous = torch.tensor(8.0)
            slot_ref, slot_tri = torch.zeros(1), torch.zeros(1)
            want = ops.cast_transpose_from_amax(x2, amax2, previous, slot_ref, fmt, 1, transpose, pad, True)
            got = tq.launch_cast_transpose(x2, None, amax2, previous, slot_tri, FMT[fmt], 1, transpose, pad, True,
                                           None, None)
            for w, g, name in zip(want, got, ("data", "data_t", "scale_inv")):
                _same(g, w, f"current {name} special={special}")
            _same(slot_tri, slot_ref, "recorded amax (current)")


def test_cast_transpose_into_grouped_columns_matches_reference():
    """Grouped experts: each group's rows written at its padded columns of one shared transpose."""
    tq = _needs_triton()
    x = _input((40, 128), torch.bfloat16, 5, special=False)
    dst = torch.cat([torch.arange(0, 5), torch.arange(16, 51)])  # groups of 5 and 35 rows, each padded to 16
    scale = torch.tensor(4.0)
    out_ref = torch.zeros((128, 64), dtype=E4M3)
    out_tri = torch.zeros((128, 64), dtype=E4M3)
    want = ops.cast_transpose(x, scale, torch.zeros(1), "e4m3", True, 16, False, dst, out_ref)
    got = tq.launch_cast_transpose(x, scale, None, None, torch.zeros(1), E4M3, 0, True, 16, False, dst, out_tri)
    _same(got[0], want[0], "data")
    _same(out_tri, out_ref, "grouped transpose")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_rowwise_and_columnwise_kernels_match_reference(shape, fmt):
    tq = _needs_triton()
    x = _input(shape, torch.bfloat16, 6)
    for w, g in zip(ops.quantize_rows(x, fmt), tq.launch_quantize_rows(x, FMT[fmt], None)):
        _same(g, w, "rows")
    for pad in (1, 16):
        for w, g in zip(ops.quantize_cols_t(x, fmt, pad), tq.launch_quantize_cols_t(x, FMT[fmt], pad, None)):
            _same(g, w, f"cols_t pad {pad}")
    # an FP8 payload with per-row scale_inv re-quantized per column (the rowwise weight's input-gradient operand)
    data, row_inv = ops.quantize_rows(_input(shape, torch.bfloat16, 7, special=False), fmt)
    for w, g in zip(ops.quantize_cols_t(data, fmt, 1, row_inv), tq.launch_quantize_cols_t(data, FMT[fmt], 1, row_inv)):
        _same(g, w, "cols_t of an FP8 payload")


@pytest.mark.parametrize("tile", [128, 32], ids=["blockwise", "mxfp8"])
@pytest.mark.parametrize("shape", [(100, 256), (37, 128), (300, 384)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_tile_kernel_matches_reference(shape, fmt, tile):
    tq = _needs_triton()
    x = _input(shape, torch.float32, 8)
    for columnwise in (False, True):
        for pad in (1, tile):
            for transpose_c in (False, True):
                want = ops.quantize_tiles(x, fmt, columnwise, pad, None, tile, transpose_c)
                got = tq.launch_quantize_tiles(x, FMT[fmt], columnwise, pad, None, tile, transpose_c)
                for w, g, name in zip(want, got, ("data", "scale_inv", "data_c", "scale_inv_c")):
                    _same(g, w, f"tiles {name} columnwise={columnwise} pad={pad} transpose_c={transpose_c}")
    data, inv, _, _ = ops.quantize_tiles(_input(shape, torch.float32, 9, special=False), fmt, False, 1, None, tile)
    want = ops.quantize_tiles(data, fmt, True, tile, inv, tile)
    got = tq.launch_quantize_tiles(data, FMT[fmt], True, tile, inv, tile)
    for w, g, name in zip(want, got, ("data", "scale_inv", "data_c", "scale_inv_c")):
        _same(g, w, f"tiles of an FP8 payload {name}")


@pytest.mark.parametrize("shape", SHAPES)
def test_transpose_kernels_match_reference(shape):
    tq = _needs_triton()
    payload = _input(shape, torch.float32, 10, special=False).clamp(-400, 400).to(E4M3)
    scale = torch.tensor(2.0 ** -3)
    for pad in (1, 16):
        for w, g in zip(ops.transpose_fp8(payload, scale, pad), tq.launch_transpose_fp8(payload, scale, pad)):
            _same(g, w, f"transpose pad {pad}")
    # the multi-tensor refresh: several weights of different shapes in one launch, in place
    payloads = [_input(s, torch.float32, 11 + i, special=False).clamp(-400, 400).to(E4M3)
                for i, s in enumerate(SHAPES)]
    scales = [torch.tensor(2.0 ** i) for i in range(len(SHAPES))]
    outs_ref = [torch.zeros(p.shape[::-1], dtype=E4M3) for p in payloads]
    outs_tri = [torch.zeros(p.shape[::-1], dtype=E4M3) for p in payloads]
    invs_ref = [torch.zeros(()) for _ in payloads]
    invs_tri = [torch.zeros(()) for _ in payloads]
    ops.transpose_fp8_into_(payloads, scales, outs_ref, invs_ref)
    tq.launch_transpose_fp8_into(payloads, scales, outs_tri, invs_tri)
    for a, b in zip(outs_tri + invs_tri, outs_ref + invs_ref):
        _same(a, b, "multi-tensor transpose")
    with pytest.raises(ValueError, match="contiguous"):
        tq.launch_transpose_fp8_into(payloads[:1], scales[:1], [outs_tri[0].t()], invs_tri[:1])


@pytest.mark.parametrize("shape", SHAPES)
def test_elementwise_scale_kernels_match_reference(shape):
    tq = _needs_triton()
    x = _input(shape, torch.float32, 12)
    row, col = torch.rand(shape[0], 1) + 0.5, torch.rand(1, shape[1]) + 0.5
    for r, c in ((None, None), (row, col)):
        amax2 = ops.amax(x, r, c)
        for w, g in zip(ops.scaled_fp16(x, amax2, r, c), tq.launch_scaled_fp16(x, amax2, r, c)):
            _same(g, w, "scaled_fp16")
        for dtype in (torch.bfloat16, torch.float32):
            _same(tq.launch_apply_scales(x, r, c, dtype), ops.apply_scales(x, r, c, dtype), "apply_scales")


@pytest.mark.parametrize("chunks", [2, 4])
def test_sum_chunks_kernel_matches_reference(chunks):
    """The FP8 reduce-scatter's epilogue: each rank's FP8 contribution decoded and summed in fp32, times scale_inv."""
    tq = _needs_triton()
    for fmt in (E4M3, E5M2):
        received = _input((chunks * 48, 80), torch.float32, 15, special=False).clamp(-400, 400).to(fmt)
        inv = torch.tensor(2.0 ** -5)
        for dtype in (torch.bfloat16, torch.float32):
            _same(tq.launch_sum_chunks(received, chunks, inv, dtype), ops.sum_chunks(received, chunks, inv, dtype),
                  f"sum_chunks {fmt} {dtype}")
    exact = received.double().view(chunks, 48, 80).sum(0) * 2.0 ** -5  # float64: within fp32's rounding of the sum
    assert (ops.sum_chunks(received, chunks, inv, torch.float32).double() - exact).abs().max() <= \
        chunks * 2.0 ** -24 * received.double().view(chunks, 48, 80).abs().sum(0).max() * 2.0 ** -5


@pytest.mark.parametrize("enabled", [None, True, False])
def test_update_scales_kernel_matches_reference(enabled):
    tq = _needs_triton()
    g = torch.Generator().manual_seed(13)
    lengths = [1, 16, 1024, 5]
    fmaxes, margins = [448.0, 57344.0, 448.0, 448.0], [0, 0, 1, 0]

    def states():
        hist = [torch.rand(n, generator=g) * 2 ** 10 for n in lengths]
        hist[3].zero_()  # a state that saw nothing: keeps its scale
        hist[0][0] = float("inf")  # a non-finite amax never enters a history, but the kernel must still match
        scales = [torch.tensor(2.0 ** i) for i in range(len(lengths))]
        flags = [torch.tensor(i % 2 == 0) for i in range(len(lengths))]
        return hist, scales, flags

    ref, tri = states(), None
    tri = tuple([t.clone() for t in group] for group in ref)
    flag = None if enabled is None else torch.tensor(enabled)
    ops.update_scales_(*ref, fmaxes, margins, flag)
    tq.launch_update_scales(*tri, fmaxes, margins, flag)
    for a, b in zip(sum(tri, []), sum(ref, [])):
        _same(a, b, f"update_scales enabled={enabled}")


def test_block_gemm_inverse_matches_reference():
    _needs_triton()
    from fp8.kernels.triton_block_gemm import block_mm_inverse

    g = torch.Generator().manual_seed(14)
    a = (torch.randn(64, 256, generator=g) * 8).to(E4M3)
    b = (torch.randn(256, 128, generator=g) * 8).to(E4M3)
    a_inv = torch.exp2(torch.randint(-4, 4, (64, 2), generator=g).float())
    b_inv = torch.exp2(torch.randint(-4, 4, (2, 1), generator=g).float())
    want = ops.block_mm(a, a_inv, [1, 128], b, b_inv, [128, 128], torch.float32)
    got = block_mm_inverse(a, a_inv, (1, 128), b, b_inv, (128, 128), torch.float32)
    exact = (a.double() * a_inv.repeat_interleave(128, 1).double()) @ (b.double() * b_inv.repeat_interleave(128, 0)
                                                                          .repeat_interleave(128, 1)[:, :128].double())
    # different summation orders (fp32 accumulations): both within fp32 rounding of the float64 product
    scale = exact.abs().max().item()
    assert (want.double() - exact).abs().max().item() <= 1e-5 * scale
    assert (got.double() - exact).abs().max().item() <= 1e-5 * scale


# -- one launch per op ------------------------------------------------------------------------------------------------
def test_each_op_is_one_launch():
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    slot, one, amax2 = torch.zeros(1), torch.tensor(1.0), torch.tensor([1.0, 0.0])
    hist, scales, flags = [torch.zeros(4) for _ in range(3)], [torch.ones(()) for _ in range(3)], \
        [torch.zeros((), dtype=torch.bool) for _ in range(3)]
    payload = x.to(E4M3)
    out, inv = torch.empty(128, 64, dtype=E4M3), torch.empty(())
    calls = {
        "amax": lambda: ops.amax(x),
        "cast_transpose": lambda: ops.cast_transpose(x, one, slot, "e4m3", True, 16, True),
        "cast_transpose_from_amax": lambda: ops.cast_transpose_from_amax(x, amax2, one, slot, "e4m3", 0, True, 16,
                                                                         True),
        "quantize_rows": lambda: ops.quantize_rows(x, "e4m3"),
        "quantize_cols_t": lambda: ops.quantize_cols_t(x, "e4m3", 16),
        "quantize_tiles": lambda: ops.quantize_tiles(x, "e4m3", True, 128),
        "quantize_mx": lambda: ops.quantize_mx(x, "e4m3", True, 32),
        "transpose_fp8": lambda: ops.transpose_fp8(payload, one, 16),
        "transpose_fp8_into_": lambda: ops.transpose_fp8_into_([payload] * 3, [one] * 3, [out] * 3, [inv] * 3),
        "update_scales_": lambda: ops.update_scales_(hist, scales, flags, [448.0] * 3, [0] * 3),
        "sum_chunks": lambda: ops.sum_chunks(payload, 2, one, torch.bfloat16),
    }
    for name, call in calls.items():
        with LaunchCounter() as counter:
            call()
        assert counter.launches == 1, (name, counter.by_op)


def test_fake_implementations_match_the_ops():
    """Each block-scaled op's fake implementation (what torch.compile traces) gives its outputs' shapes and dtypes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fp8 import fp4

    x = torch.randn(72, 96)
    amax2 = ops.amax(x)
    calls = [lambda t, a: ops.quantize_mx(t, "e4m3", True, 32), lambda t, a: ops.quantize_mx(t, "e4m3", False, 32),
             lambda t, a: fp4.nvfp4_quantize(t, a, 1, True, 32, 5, True, 3),
             lambda t, a: fp4.nvfp4_quantize(t[:64], a, 16, False, 1, -1, False, 0),
             lambda t, a: (fp4.nvfp4_amax(t, 5, True),)]
    for call in calls:
        real = call(x, amax2)
        with FakeTensorMode() as mode:
            fake = call(mode.from_tensor(x), mode.from_tensor(amax2))
        assert [(tuple(r.shape), r.dtype) for r in real] == [(tuple(f.shape), f.dtype) for f in fake]


@pytest.mark.parametrize("rows,kb,repeat", [(96, 5, 1), (200, 8, 32), (33, 1, 1), (256, 3, 32)])
def test_mx_scales_kernel_matches_reference(rows, kb, repeat):
    tq = _needs_triton()
    g = torch.Generator().manual_seed(rows + kb)
    grid = torch.exp2(torch.randint(-126, 127, (-(-rows // repeat), kb), generator=g).float())
    for layout in (grid, grid.t().contiguous().t()):  # row-major and a transposed view (a weight's dgrad grid)
        want = ops.mx_scales(layout, rows, repeat)
        got = tq.launch_mx_scales(layout, rows, repeat)
        assert got.dtype == want.dtype == torch.float8_e8m0fnu
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segment_kernels_match_the_references(dtype):
    """The FSDP2 FP8 reduce-scatter's ops (each FP8 weight a run of columns with its own scale): the Triton kernels
    against the torch references bit for bit, ragged segments, an empty-amax segment, non-finite values flagged."""
    tq = _needs_triton()
    torch.manual_seed(0)
    lengths = [5, 1, 1300, 17, 3]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    segments = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    x = (torch.randn(3, sum(lengths)) * torch.logspace(-6, 6, sum(lengths))).to(dtype)
    x[:, 5] = 0  # segment 1: all zeros (scale 1)
    for bad in (False, True):
        if bad:
            x[1, 700] = float("inf")
        amax = ops.segment_amax(x, offsets)
        _same(tq.launch_segment_amax(x, offsets), amax, "segment_amax")
        assert float(amax[-1]) == float(bad) and float(amax[1]) == 0.0
        data, inv = ops.segment_cast(x, offsets, amax, "e4m3")
        t_data, t_inv = tq.launch_segment_cast(x, offsets, amax, torch.float8_e4m3fn)
        _same(t_data.view(torch.uint8), data.view(torch.uint8), "segment_cast payload")
        _same(t_inv, inv, "segment_cast scale_inv")  # every segment's, written by one program
        assert float(inv[1]) == 1.0
        for divisor in (1.0, 3.0):
            ref = ops.segment_sum(data, offsets, inv, amax, divisor)
            _same(tq.launch_segment_sum(data, offsets, inv, amax, divisor), ref, "segment_sum")
            assert bool(torch.isnan(ref).all()) is bad
        if not bad:  # the reference: decode, sum, unscale, exactly as float64 on these values
            expect = (data.double() * inv.double()[segments.long()]).sum(0)
            assert torch.allclose(ops.segment_sum(data, offsets, inv, amax, 1.0).double(), expect, rtol=1e-6, atol=0)
    empty = ops.segment_cast(x[:0], offsets, amax, "e4m3")  # no rows: still every segment's scale_inv
    _same(tq.launch_segment_cast(x[:0], offsets, amax, torch.float8_e4m3fn)[1], empty[1], "segment_cast, no rows")


def test_row_chunk_sum_kernel_matches_the_reference():
    """The FSDP2 reduce-scatter's epilogue for embedding tables (each sender's scale per table row): the Triton kernel
    against the torch reference bit for bit, on a strided view of the received buffer (a run of its columns), a NaN
    kept in its element only, and the reference against float64."""
    tq = _needs_triton()
    torch.manual_seed(0)
    senders, rows, width = 3, 37, 24
    table = torch.randn(senders * rows, width) * torch.logspace(-9, 3, senders * rows).unsqueeze(1)
    data, inv = ops.quantize_rows(table, "e4m3")
    buffer = torch.zeros(senders, 5 + rows * width + 7, dtype=torch.float8_e4m3fn)
    buffer[:, 5:5 + rows * width] = data.view(senders, rows * width)
    received = buffer[:, 5:5 + rows * width]  # strided: a run of columns, as the reduce-scatter reads it
    scale_inv = inv.view(senders, rows)
    for divisor in (1.0, 3.0):
        ref = ops.row_chunk_sum(received, scale_inv, divisor)
        _same(tq.launch_row_chunk_sum(received, scale_inv, divisor), ref, "row_chunk_sum")
    expect = (data.double() * inv.double()).view(senders, rows * width).sum(0)
    assert torch.allclose(ops.row_chunk_sum(received, scale_inv, 1.0).double(), expect, rtol=1e-6, atol=0)
    buffer[1, 5 + 100] = float("nan")
    ref = ops.row_chunk_sum(received, scale_inv, 1.0)
    _same(tq.launch_row_chunk_sum(received, scale_inv, 1.0), ref, "row_chunk_sum, NaN")
    assert torch.isnan(ref).nonzero().flatten().tolist() == [100]
    assert ops.row_chunk_sum(received[:, :0], scale_inv[:, :0], 1.0).shape == (0,)
