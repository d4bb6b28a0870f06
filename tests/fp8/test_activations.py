"""FP8 activation compression (fp8.activations): round-trip error bound, what is left alone, stored-once,
gradients of an MLP and of a Hugging Face Llama under compression, hooks active during the forward only.

References are float64; inputs are fresh random per run (the ``seed`` fixture). The round-trip bound is the
E4M3 one: relative error <= 2**-4 for values in the normal range of their 1x128 tile, plus half the
subnormal spacing divided by the tile's scale below it (tests/fp8_bounds.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp8
from fp8.activations import EXACT_OPS, ActivationCompressor, ActivationStats, compress_activations
from fp8.blocks import TILE, block_scales, expand_scales
from tests.fp8_bounds import quantization_error_bound


def _intermediate(*shape, dtype=torch.float32, spread=8):
    """A non-leaf tensor (what an op saves) whose rows span magnitudes ``2**-spread .. 2**spread``."""
    x = torch.randn(*shape, dtype=torch.float64)
    x = x * torch.exp2(torch.randint(-spread, spread + 1, (*shape[:-1], 1))).to(torch.float64)
    leaf = x.to(dtype).requires_grad_()
    return leaf * 1


def _bound(x: torch.Tensor, rows: tuple[int, int]) -> torch.Tensor:
    """Element-wise float64 bound on the round-trip error of ``x`` quantized as ``rows`` in 1x128 tiles."""
    flat = x.detach().contiguous().reshape(rows)
    scales = expand_scales(block_scales(flat, TILE, "e4m3"), TILE, rows)
    return quantization_error_bound(flat, scales, "e4m3").reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(8, 3, 200), (64, 96), (4, 16, 32, 32)])
def test_round_trip_within_the_e4m3_bound(seed, dtype, shape):
    c = ActivationCompressor(min_numel=1)
    x = _intermediate(*shape, dtype=dtype)
    packed = c.pack(x)
    assert not isinstance(packed, torch.Tensor)
    y = c.unpack(packed)
    assert y.shape == x.shape and y.dtype == x.dtype and y.device == x.device and y.stride() == x.stride()
    last = shape[-1]
    rows = (x.numel() // 128, 128) if last < 128 and x.numel() % 128 == 0 else (x.numel() // last, last)
    err = (y.double() - x.detach().double()).abs()
    assert (err <= _bound(x, rows)).all(), f"max excess {(err - _bound(x, rows)).max().item():.3e}"
    assert c.stats.tensors == 1 and c.stats.saved_bytes == x.numel() * x.element_size()
    assert c.stats.stored_bytes == x.numel() + 4 * rows[0] * -(-rows[1] // 128)


def test_strided_inputs_are_restored(seed):
    c = ActivationCompressor(min_numel=1)
    base = _intermediate(16, 40, 256)
    for x, dense in ((base.transpose(0, 1), True), (base[:, :, ::2], False), (base[:, 3:, :], False)):
        y = c.unpack(c.pack(x))
        assert y.shape == x.shape and y.dtype == x.dtype
        if dense:
            assert y.stride() == x.stride()  # a permuted dense layout comes back in the same layout
        rows = (x.numel() // x.shape[-1], x.shape[-1])
        assert ((y.double() - x.detach().double()).abs() <= _bound(x, rows)).all()


def test_left_alone(seed):
    c = ActivationCompressor()
    big = (64, 128)
    cases = {
        "parameter": nn.Parameter(torch.randn(big)),
        "requires_grad leaf": torch.randn(big, requires_grad=True),
        "input (leaf)": torch.randn(big),
        "float8 payload": torch.randn(big).to(torch.float8_e4m3fn),
        "Float8Tensor": fp8.to_float8(torch.randn(big)),
        "int": torch.randint(0, 100, big),
        "float64 intermediate": _intermediate(*big, dtype=torch.float64),
        "small intermediate": _intermediate(8, 128),
        "per-row statistic": _intermediate(8192, 1),
        "expanded": (torch.randn(1, 128, requires_grad=True) * 1).expand(64, 128),
        "parameter view": torch.nn.Parameter(torch.randn(*big)).t(),
        "parameter copy": torch.nn.Parameter(torch.randn(*big)).to(torch.bfloat16),
        "tanh output": torch.tanh(_intermediate(*big)),
        "log_softmax output": torch.log_softmax(_intermediate(*big), dim=-1),
    }
    for name, t in cases.items():
        out = c.unpack(c.pack(t))
        if t.grad_fn is None:
            assert out is t, name
        else:  # an op's own output comes back as a detached alias (no reference cycle)
            assert out.data_ptr() == t.data_ptr() and torch.equal(out, t.detach()), name
    assert c.stats.tensors == 0 and c.stats.passed == len(cases)
    assert {"LogSoftmaxBackward0", "TanhBackward0"} <= EXACT_OPS
    scalar = torch.ones((), requires_grad=True) * 2
    assert torch.equal(c.unpack(ActivationCompressor(min_numel=0).pack(scalar)), scalar)


def test_compress_leaves_keeps_parameters(seed):
    c = ActivationCompressor(compress_leaves=True)
    p, x = nn.Parameter(torch.randn(64, 128)), torch.randn(64, 128)
    assert c.pack(p) is p
    assert not isinstance(c.pack(x), torch.Tensor)


def test_a_tensor_saved_twice_is_stored_once_and_freed_after_backward(seed):
    c = ActivationCompressor()
    x = torch.randn(32, 256, requires_grad=True)
    with c:
        h = x * 3
        y = (h * h).sum() + h.sin().sum()  # mul saves h twice, sin once more
    assert c.stats.tensors == 1 and c.stats.deduplicated == 2
    assert c.stats.held_bytes == c.stats.stored_bytes > 0
    y.backward()
    assert c.stats.held_bytes == 0  # the graph was the only owner of the packed payload
    h64 = 3 * x.detach().double()
    expected = 3 * (2 * h64 + h64.cos())
    # d(2h + cos h)/dh is at most 3 in magnitude: the error is <= 3 * 3 * (h's round-trip bound), plus fp32
    bound = 9 * _bound(h64, (32, 256)) + 1e-5 * (expected.abs() + 1)
    assert ((x.grad.double() - expected).abs() <= bound).all()


def test_views_of_one_storage_are_stored_once(seed):
    c = ActivationCompressor()
    x = torch.randn(2, 4, 64, 256, requires_grad=True)
    with c:
        q = x * 1
        F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    assert c.stats.deduplicated >= 2  # q, k and v are one tensor
    assert c.stats.held_bytes == 0


class _GatedMLP(nn.Module):
    """LayerNorm -> SwiGLU (silu(gate) * up) -> down, residual, GELU -> out."""

    def __init__(self, d: int = 256, f: int = 512):
        super().__init__()
        self.norm, self.gate, self.up = nn.LayerNorm(d), nn.Linear(d, f), nn.Linear(d, f)
        self.down, self.out = nn.Linear(f, d), nn.Linear(d, d)

    def forward(self, x):
        h = self.norm(x)
        h = self.down(F.silu(self.gate(h)) * self.up(h))
        return self.out(F.gelu(x + h))


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).pow(2).mean().backward()
    return [x.grad.double()] + [p.grad.double() for p in model.parameters()]


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_mlp_gradients_under_compression(seed):
    # Measured (6 seeds, fp32, x 8x64x256): input gradient 0.0074, worst weight gradient 0.0331-0.0343
    # (relative norm error vs the uncompressed run); bounds have >= 2x headroom.
    model, x = _GatedMLP(), torch.randn(8, 64, 256, requires_grad=True)
    reference = _grads(model, x)
    compressor = compress_activations(model)
    got = _grads(model, x)
    assert compressor.stats.tensors >= 7 and compressor.stats.held_bytes == 0  # the weights' views are left alone
    assert _rel(got[0], reference[0]) < 0.04
    for g, r in zip(got[1:], reference[1:]):
        assert _rel(g, r) < 0.1
    compressor.remove()
    assert all(torch.equal(g, r) for g, r in zip(_grads(model, x), reference))  # removed: exact again


def test_hooks_are_active_during_the_forward_only(seed):
    model = _GatedMLP(64, 128)
    compressor = compress_activations(model)
    y = model(torch.randn(8, 64, 64))
    assert not compressor.active
    before = compressor.stats.tensors
    (y * y).sum().backward()  # outside the forward: not compressed
    assert compressor.stats.tensors == before
    with pytest.raises(ValueError, match="already compressed"):
        compress_activations(model)
    with pytest.raises(RuntimeError):
        model(torch.randn(8, 64, 3))  # a failing forward still exits the context
    assert not compressor.active


class _Spy(ActivationCompressor):
    """Records, for every FP8 payload saved, whether it was saved as is."""

    def __init__(self, **options):
        super().__init__(**options)
        self.fp8_saved_as_is: list[bool] = []

    def pack(self, t):
        out = super().pack(t)
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            self.fp8_saved_as_is.append(out is t)
        return out


def test_fp8_linear_payloads_pass_through(seed):
    model, converted = fp8.convert_to_float8_linear(_GatedMLP(64, 128))
    assert len(converted) == 4
    x = torch.randn(8, 64, 64, requires_grad=True)
    spy = _Spy()
    with spy:
        y = model(x)
    y.pow(2).mean().backward()
    assert len(spy.fp8_saved_as_is) >= 8 and all(spy.fp8_saved_as_is)  # input and weight payloads, 4 linears
    assert spy.stats.tensors > 0 and torch.isfinite(x.grad).all() and spy.stats.held_bytes == 0


def test_stats_ledger():
    stats = ActivationStats(tensors=2, saved_bytes=400, stored_bytes=100, held_bytes=100)
    assert stats.ratio == 0.25 and stats.as_dict()["ratio"] == 0.25
    stats.reset()
    assert stats.tensors == 0 and stats.saved_bytes == 0 and stats.held_bytes == 100
    with pytest.raises(ValueError, match="group"):
        ActivationCompressor(group=0)


def _llama(seed: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=1000, max_position_embeddings=256, attn_implementation="eager")
    return transformers.LlamaForCausalLM(config)


def test_llama_trains_under_compression(seed):
    # Measured (3 seeds, fp32, batch 2 x 128 tokens): relative norm error of the full gradient vector
    # 0.0276-0.0283 (eager attention; 0.0263-0.0269 with SDPA); stored/saved bytes 0.258.
    model = _llama(seed)
    ids = torch.randint(0, 1000, (2, 128))

    def grad():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten().double() for p in model.parameters()])

    _, reference = grad()
    compressor = compress_activations(model)
    _, got = grad()
    assert _rel(got, reference) < 0.12
    assert compressor.stats.tensors > 20 and compressor.stats.stored_bytes <= 0.3 * compressor.stats.saved_bytes
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(4):
        loss, _ = grad()
        assert compressor.stats.held_bytes == 0
        optimizer.step()
        losses.append(loss)
    assert all(map(lambda v: v == v, losses)) and losses[-1] < losses[0]


def test_memory_report_counts_the_activations_held_for_backward():
    """The ledger between forward and backward: tensors saved as is (the caller's input, each storage once) plus the
    FP8 copies; parameters and their views (linear weights) not counted."""
    model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))
    x = torch.randn(64, 256)
    # x; fc1 output (GELU input); fc2 input; fc2 output (square's input); compressed: the last three as E4M3 + scales
    for compress, expected in ((False, 64 * 256 * 4 + 2 * 64 * 512 * 4 + 64 * 256 * 4),
                               (True, 64 * 256 * 4 + 2 * (64 * 512 + 4 * 64 * 4) + 64 * 256 + 4 * 64 * 2)):
        ledger = ActivationCompressor() if compress else ActivationCompressor(dtypes=())
        with ledger:
            loss = model(x).square().mean()
        state = fp8.memory_report(model)
        report = fp8.memory_report(model, None, activations=ledger)
        assert report["activations"] == expected and report["total"] == state["total"] + expected
        assert "activations" not in state
        loss.backward()
        assert ledger.stats.held_bytes == 0
