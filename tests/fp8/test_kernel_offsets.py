"""64-bit offsets in the Triton kernels: each kernel reads and writes the right elements of a tensor past
2**31 (2**32) elements, run on CPU under TRITON_INTERPRET=1 in a few seconds.

How. The interpreter computes ``tl.program_id`` and integer kernel arguments below 2**31 as int32 and its
int32 arithmetic wraps, like the compiled kernel's: an offset computed in 32 bits lands ``2**32`` elements
early. Each test therefore

* reserves operands of ``2**32`` + a little bytes with ``torch.empty`` (virtual memory: only the pages
  written or read are ever backed, a few MB in all; the test skips where the reservation is refused),
* runs only the program(s) whose offsets pass ``2**32`` (:func:`_only_programs` narrows the interpreter's
  grid to them; the Adam kernels take their block from a one-row block table instead),
* fills those elements, and different values ``2**32`` elements earlier where a 32-bit offset would land
  (inside the operand, so a 32-bit kernel reads and writes wrong but valid memory and fails an assertion,
  never crashes), and
* compares with an oracle on a small copy: the torch reference, or the same kernel on the same values at
  small offsets (bit-identical by construction).

Every test below fails against the kernels' former 32-bit ``program_id * BLOCK``, ``rows * stride``,
``cols * stride`` and ``k * stride`` (cast, amax, accumulation, block GEMM), and the Adam test against its
kernels without their ``.to(tl.int64)`` block offsets (they were run against both).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported (lazily, by the kernels)

import pytest
import torch

import fp8
from fp8.kernels import accumulate_fp8_payload, accumulate_fp8_payload_reference, amax_unless

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
WRAP = 2**32  # where a 32-bit offset wraps: element WRAP + i is read as element i


def _needs_triton():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("kernel tests run under TRITON_INTERPRET=1")


def _reserve(nbytes: int) -> torch.Tensor:
    """``nbytes`` uninitialized bytes: virtual memory, backed only where touched."""
    try:
        return torch.empty(nbytes, dtype=torch.uint8)
    except RuntimeError as exc:  # strict overcommit, small address space
        pytest.skip(f"cannot reserve {nbytes / 2**30:.1f} GiB of virtual memory: {exc}")


def _only_programs(monkeypatch, *programs):
    """Run only ``programs`` (program-id tuples) of every interpreted launch that follows; ``program_id``
    returns their real ids, checked to lie in the launch's grid. Returns the list of programs run."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    real_set_grid_idx, real_init = builder.set_grid_idx, interpreter.GridExecutor.__init__
    launched, ran = [], []

    def init(self, fn, arg_names, grid, *args, **kwargs):
        real_init(self, fn, arg_names, grid, *args, **kwargs)
        launched.append(tuple(grid) + (1,) * (3 - len(grid)))
        self.grid = (len(programs),)

    def set_grid_idx(x, y, z):
        pid = tuple(programs[x]) + (0,) * (3 - len(programs[x]))
        assert all(p < g for p, g in zip(pid, launched[-1])), f"program {pid} is outside the grid {launched[-1]}"
        builder.grid_dim = launched[-1]
        real_set_grid_idx(*pid)
        ran.append(pid)

    monkeypatch.setattr(interpreter.GridExecutor, "__init__", init)
    monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)
    return ran


def _fp8(shape, gen, dtype=E4M3, lo=-6, hi=6):
    """Random finite FP8 values (magnitudes 2**lo..2**hi, random signs)."""
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.empty(shape).uniform_(lo, hi, generator=gen))
    return x.to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def test_interpreter_int32_arithmetic_wraps():
    """The premise: 32-bit offset arithmetic wraps in the interpreter (as on the GPU), 64-bit does not."""
    _needs_triton()
    import triton
    import triton.language as tl

    @triton.jit
    def offsets(out_ptr, stride, WIDE: tl.constexpr):
        pid = tl.program_id(0)
        if WIDE:
            pid = pid.to(tl.int64)
        tl.store(out_ptr, (pid + 4) * stride)

    out = torch.zeros(1, dtype=torch.int64)
    offsets[(1,)](out, 2**30, WIDE=False)
    assert out.item() == 0  # 4 * 2**30 = 2**32 wrapped
    offsets[(1,)](out, 2**30, WIDE=True)
    assert out.item() == 2**32


def test_cast_transpose_amax_past_2_32_elements(gen, monkeypatch):
    """Tile (1024, 1023) of a 65600 x 65536 cast: rows * stride_m (input), rows * N (output) and
    cols * M + rows (transposed output) are all in [2**32, 2**32 + 2**31)."""
    _needs_triton()
    from fp8.kernels.triton_cast import launch_cast_transpose_amax

    m, n, tile = 65600, 65536, 64
    pm, pn = 1024, 1023
    rows, cols = slice(pm * tile, (pm + 1) * tile), slice(pn * tile, (pn + 1) * tile)
    x = _reserve(m * n).view(E4M3).view(m, n)
    x[rows, cols] = _fp8((tile, tile), gen)
    x[0:tile, cols] = torch.full((tile, tile), 448.0).to(E4M3)  # where a 32-bit rows * stride_m lands
    scale = torch.tensor(0.25)
    ran = _only_programs(monkeypatch, (pm, pn))
    data, data_t, amax, nonfinite = launch_cast_transpose_amax(x, scale, E5M2, transpose=True)
    monkeypatch.undo()
    assert ran == [(pm, pn, 0)]
    ref_data, ref_t, ref_amax, ref_nonfinite = launch_cast_transpose_amax(x[rows, cols].contiguous(), scale, E5M2, True)
    assert torch.equal(_bits(data[rows, cols]), _bits(ref_data))
    assert torch.equal(_bits(data_t[cols, rows]), _bits(ref_t))
    assert torch.equal(amax, ref_amax) and amax.item() < 448.0 and nonfinite.item() == ref_nonfinite.item() == 0
    assert torch.equal(_bits(ref_data), _bits(fp8.quantize(x[rows, cols].float(), scale, "e5m2")))


def test_amax_unless_past_2_32_elements(gen, monkeypatch):
    """The last block of a 2**32 + 1000-element tensor: program_id * BLOCK = 2**32."""
    _needs_triton()
    numel = WRAP + 1000
    x = _reserve(numel).view(E4M3)
    x[WRAP:] = _fp8(1000, gen, hi=3)
    x[:1024] = torch.full((1024,), 448.0).to(E4M3)
    ran = _only_programs(monkeypatch, (WRAP // 1024,))
    amax = amax_unless(x, torch.zeros((), dtype=torch.int32), backend="triton")
    monkeypatch.undo()
    assert ran == [(WRAP // 1024, 0, 0)]
    assert amax.item() == x[WRAP:].float().abs().max().item()


def test_grad_accumulate_past_2_32_elements(gen, monkeypatch):
    """Both kernels (amax, cast) on the last block of 2**32 + 1000-element FP8 payloads."""
    _needs_triton()
    numel = WRAP + 1000
    acc, new = _reserve(numel).view(E4M3), _reserve(numel).view(E5M2)
    acc[WRAP:], new[WRAP:] = _fp8(1000, gen), _fp8(1000, gen, E5M2, lo=2, hi=10)
    acc[:1024], new[:1024] = torch.zeros(1024).to(E4M3), torch.full((1024,), 57344.0).to(E5M2)
    acc_scale, new_scale = torch.tensor(4.0), torch.tensor(0.5)
    ref_acc, ref_scale = acc[WRAP:].clone(), acc_scale.clone()
    accumulate_fp8_payload_reference(ref_acc, ref_scale, new[WRAP:].clone(), new_scale)
    ran = _only_programs(monkeypatch, (WRAP // 1024,))
    accumulate_fp8_payload(acc, acc_scale, new, new_scale, backend="triton")
    monkeypatch.undo()
    assert ran == [(WRAP // 1024, 0, 0)] * 2
    assert torch.equal(acc_scale, ref_scale) and acc_scale.item() != 4.0
    assert torch.equal(_bits(acc[WRAP:]), _bits(ref_acc))


def _block_operands(gen, m, k, n):
    """Block-quantized random ``a`` (m x k, 1x128 tiles) and ``b`` (k x n, 128x128 blocks)."""
    from fp8.blocks import BLOCK, TILE, quantize_to_blocks

    a, sa = quantize_to_blocks(torch.randn(m, k, generator=gen), TILE, "e4m3")
    b, sb = quantize_to_blocks(torch.randn(k, n, generator=gen) * 8, BLOCK, "e4m3")
    return a, sa, b, sb


def test_block_mm_a_rows_past_2_32(gen, monkeypatch):
    """Row tile 16384 of a (2**20 + 64) x 4096 row-major ``a``: rows * stride_am >= 2**32."""
    _needs_triton()
    from fp8.blocks import BLOCK, TILE
    from fp8.kernels.triton_block_gemm import block_mm

    m, k, n, pm = 2**20 + 64, 4096, 128, 2**20 // 64
    rows = slice(pm * 64, pm * 64 + 64)
    a_tile, sa_tile, b, sb = _block_operands(gen, 64, k, n)
    a = _reserve(m * k).view(E4M3).view(m, k)
    sa = torch.empty(m, k // 128)
    a[rows], sa[rows] = a_tile, sa_tile
    a[:64], sa[:64] = torch.full((64, k), 448.0).to(E4M3), 1.0  # where 32-bit rows * stride_am lands
    ran = _only_programs(monkeypatch, (pm, 0))
    out = block_mm(a, sa, TILE, b, sb, BLOCK)
    monkeypatch.undo()
    assert ran == [(pm, 0, 0)]
    assert torch.equal(out[rows], block_mm(a_tile, sa_tile, TILE, b, sb, BLOCK))


def test_block_mm_column_major_a_k_past_2_32(gen, monkeypatch):
    """Column-major ``a`` (stride_ak = M = 2**20 + 64, K = 4096): k * stride_ak passes 2**31 and 2**32. A
    32-bit offset then lands up to 2**31 elements before ``a``: the operand sits 2**31 bytes into its
    reservation, so that memory is there."""
    _needs_triton()
    from fp8.blocks import BLOCK, TILE
    from fp8.kernels.triton_block_gemm import block_mm

    m, k, n = 2**20 + 64, 4096, 128
    a_tile, sa_tile, b, sb = _block_operands(gen, 64, k, n)
    store = _reserve(2**31 + m * k).view(E4M3)
    a = torch.as_strided(store, (m, k), (1, m), 2**31)
    sa = torch.empty(m, k // 128)
    a[:64], sa[:64] = a_tile, sa_tile
    ran = _only_programs(monkeypatch, (0, 0))
    out = block_mm(a, sa, TILE, b, sb, BLOCK)
    monkeypatch.undo()
    assert ran == [(0, 0, 0)]
    assert torch.equal(out[:64], block_mm(a_tile, sa_tile, TILE, b, sb, BLOCK))


def test_block_mm_b_cols_past_2_32(gen, monkeypatch):
    """Column tile 8192 of a column-major 4096 x (2**20 + 128) ``b``: cols * stride_bn >= 2**32."""
    _needs_triton()
    from fp8.blocks import BLOCK, TILE
    from fp8.kernels.triton_block_gemm import block_mm

    m, k, n, pn = 64, 4096, 2**20 + 128, 2**20 // 128
    cols = slice(pn * 128, pn * 128 + 128)
    a, sa, b_tile, sb_tile = _block_operands(gen, m, k, 128)
    b = _reserve(k * n).view(E4M3).view(n, k).t()  # strides (1, k)
    sb = torch.empty(k // 128, pn + 1)
    b[:, cols], sb[:, pn] = b_tile, sb_tile[:, 0]
    b[:, :128], sb[:, 0] = torch.full((k, 128), 448.0).to(E4M3), 1.0  # where 32-bit cols * stride_bn lands
    ran = _only_programs(monkeypatch, (0, pn))
    out = block_mm(a, sa, TILE, b, sb, BLOCK)
    monkeypatch.undo()
    assert ran == [(0, pn, 0)]
    assert torch.equal(out[:, cols], block_mm(a, sa, TILE, b_tile, sb_tile, BLOCK))


def _adam_run(store: torch.Tensor, bases: dict, numel: int, blk: int):
    """Stage 1 and stage 2 of the fused Adam kernels on one FP8 tensor row (master, moments, weight and
    gradient all E4M3 payloads at ``store`` + ``bases``), block ``blk`` only. Returns the amax table."""
    from fp8.kernels.triton_adam import adam_stage1_kernel, adam_stage2_kernel

    addr = {name: store.data_ptr() + base for name, base in bases.items()}
    side = torch.zeros(5)  # master, m, v, weight scales and the step: written by block 0 only
    codes = 3 | 3 << 4 | 3 << 8 | 3 << 12
    table = torch.tensor([[addr["w"], addr["m"], addr["v"], addr["p"],
                           *(side.data_ptr() + 4 * i for i in range(5)), numel, codes, 31]], dtype=torch.int64)
    grads = torch.tensor([[addr["g"], 3]], dtype=torch.int64)
    blocks = torch.tensor([[0, blk]], dtype=torch.int32)
    old = torch.tensor([[2.0, 1.0, 4.0, 64.0, 1.0]])
    bc = torch.tensor([[0.1, 0.5]])
    amax, bad = torch.zeros(1, 3), torch.zeros(1, dtype=torch.int32)
    fmax, new_scales = torch.full((1, 4), 448.0), torch.tensor([[8.0, 128.0, 2.0, 1.0]])
    scalars = dict(lr=0.01, omb1=0.1, beta2=0.999, omb2=0.001, eps=1e-8, weight_decay=0.01, decay_factor=0.9999)
    flags = dict(MAXIMIZE=False, DECOUPLED=True, HAS_DECAY=True, BLOCK=1024)
    adam_stage1_kernel[(1,)](blocks, table, grads, old, bc, amax, bad, **scalars, **flags)
    adam_stage2_kernel[(1,)](blocks, table, grads, old, bc, fmax, new_scales, bad, **scalars, **flags)
    assert bad.item() == 0
    return amax


def test_fused_adam_past_2_32_elements(gen):
    """Block 2**22 (offsets from 2**32) of a 2**32 + 1000-element parameter, against the same kernels on the
    same values as a 1000-element parameter (block 0)."""
    _needs_triton()
    bases = {"w": 0, "m": 1024, "v": 2048, "p": 3072, "g": 4096}
    small, big = torch.empty(5 * 1024, dtype=torch.uint8), _reserve(WRAP + 5 * 1024)
    for name, base in bases.items():
        values = _fp8(1000, gen).view(torch.uint8)
        if name == "v":
            values = values & 0x7F  # a second moment is >= 0
        small[base:base + 1000] = values
        big[WRAP + base:WRAP + base + 1000] = values
        big[base:base + 1024] = 0x7E  # 448: where a 32-bit offset lands
    before = small.clone()
    ref_amax = _adam_run(small, bases, 1000, 0)
    assert not torch.equal(small[:1000], before[:1000])  # the step moved the master
    amax = _adam_run(big, bases, WRAP + 1000, WRAP // 1024)
    assert torch.equal(amax, ref_amax)
    for base in bases.values():
        assert torch.equal(big[WRAP + base:WRAP + base + 1000], small[base:base + 1000])
