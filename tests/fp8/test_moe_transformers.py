"""transformers MoE experts and nn.Linear subclasses under fp8.initialize: the FP8 grouped GEMM against float64,
Float8Experts against the transformers module, FP8 fractions and O2 loss of tiny Mixtral / Qwen2-MoE / Qwen3-MoE /
Falcon (benchmarks/transformers_architectures.py), and checkpoints saved back in transformers' layout."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import fp8
from benchmarks import transformers_architectures as archs
from fp8.cast import quantize
from fp8.gemm import fp8_mm_payload
from fp8.grouped_gemm import (GroupedLinearFunction, group_bounds, grouped_fp8_mm, grouped_mm_problem,
                              grouped_mm_reference, scaled_grouped_mm)
from fp8.linear import Float8LinearConfig
from fp8.moe import Float8Experts
from fp8.scaling import ScalingConfig, ScalingState, power_of_two_scale
from tests.fp8_bounds import product_error_bound, quantization_error_bound

transformers = pytest.importorskip("transformers")

E4M3, E5M2 = fp8.get_format("e4m3"), fp8.get_format("e5m2")
U32 = 2.0 ** -24  # fp32 unit roundoff


def _accumulation_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 accumulation of a K-term dot product plus the output rounding: (K + 1) * u * |a| @ |b| (float64)."""
    return (a.shape[1] + 1) * U32 * (a.double().abs() @ b.double().abs())


def _sizes(n_groups: int, total: int) -> list[int]:
    cuts = sorted(torch.randint(0, total + 1, (n_groups - 1,)).tolist())
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    sizes[0], sizes[1] = sizes[0] + sizes[1], 0  # an expert no token reached
    return sizes


def _scale(x: torch.Tensor, fmt) -> torch.Tensor:
    return power_of_two_scale(x.abs().max(), fmt.max)


def test_grouped_gemm_is_the_per_group_fp8_gemm_and_matches_float64(seed):
    sizes = _sizes(4, 96)
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    a = torch.randn(96, 48)
    b = [torch.randn(48, 32) * 0.1 for _ in sizes]
    a_scale = _scale(a, E4M3)
    a_q = quantize(a, a_scale, E4M3)
    b_scales = torch.stack([_scale(w, E4M3) for w in b])
    b_q = [quantize(w, s, E4M3) for w, s in zip(b, b_scales)]
    out = grouped_fp8_mm(a_q, a_scale, b_q, b_scales, offsets, sizes, torch.float32)
    per_group = torch.cat([fp8_mm_payload(a_q[s:e], a_scale, w, ws, torch.float32)
                           for (s, e), w, ws in zip(group_bounds(sizes), b_q, b_scales)])
    assert torch.equal(out, per_group)  # the repo's FP8 GEMM, group by group
    a_dq = a_q.double() / a_scale.double()
    b_dq = [w.double() / s.double() for w, s in zip(b_q, b_scales)]
    exact = grouped_mm_reference(a_dq, b_dq, sizes)  # the product of the FP8 values: only fp32 accumulation differs
    bound = torch.cat([_accumulation_bound(a_dq[s:e], w) for (s, e), w in zip(group_bounds(sizes), b_dq)])
    assert ((out.double() - exact).abs() <= bound).all()
    reference = grouped_mm_reference(a, b, sizes)  # the high-precision operands: quantization error bounded
    qbound = torch.cat([product_error_bound(a[s:e].double(), quantization_error_bound(a[s:e], a_scale, E4M3), w.double(),
                                            quantization_error_bound(w, ws, E4M3)) + _accumulation_bound(a[s:e], w) * 2
                        for (s, e), w, ws in zip(group_bounds(sizes), b, b_scales)])
    assert ((out.double() - reference).abs() <= qbound).all()
    with pytest.raises(ValueError, match="one weight and one 0-d scale per group"):
        grouped_fp8_mm(a_q, a_scale, b_q[:2], b_scales, offsets, sizes, torch.float32)


def test_grouped_linear_forward_and_backward_match_float64(seed):
    sizes = _sizes(3, 64)
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    k, n = 32, 48
    x = torch.randn(64, k, requires_grad=True)
    masters = [torch.randn(n, k) * 0.2 for _ in sizes]
    config = Float8LinearConfig(grad_accumulation="fp32")
    weights = [nn.Parameter(config.quantize_weight(w)) for w in masters]
    in_state, grad_state = ScalingState(config.input), ScalingState(config.grad_output)
    y = GroupedLinearFunction.apply(x, offsets, sizes, in_state, grad_state, config, True, torch.float32, *weights)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, dy64 = x.detach().double(), dy.double()
    # First step: both delayed states fall back to the current power-of-two scale of the tensor itself.
    x_scale, g_scale = _scale(x.detach(), E4M3), _scale(dy, E5M2)
    ex, eg = quantization_error_bound(x, x_scale, E4M3), quantization_error_bound(dy, g_scale, E5M2)
    for (s, e), w, p in zip(group_bounds(sizes), masters, weights):
        ew = quantization_error_bound(w, p.scale, E4M3)
        w64 = w.double()
        y_bound = product_error_bound(x64[s:e], ex[s:e], w64.t(), ew.t()) + 2 * _accumulation_bound(x64[s:e], w64.t())
        assert ((y[s:e].detach().double() - x64[s:e] @ w64.t()).abs() <= y_bound).all()
        dx_bound = product_error_bound(dy64[s:e], eg[s:e], w64, ew) + 2 * _accumulation_bound(dy64[s:e], w64)
        assert ((x.grad[s:e].double() - dy64[s:e] @ w64).abs() <= dx_bound).all()
        dw_bound = (product_error_bound(dy64[s:e].t(), eg[s:e].t(), x64[s:e], ex[s:e])
                    + 2 * _accumulation_bound(dy64[s:e].t(), x64[s:e]))
        assert type(p.grad) is torch.Tensor and p.grad.shape == (n, k)
        assert ((p.grad.double() - dy64[s:e].t() @ x64[s:e]).abs() <= dw_bound).all()
    assert torch.equal(weights[1].grad, torch.zeros(n, k))  # the expert no token reached: a zero gradient
    assert (y.detach().double() - grouped_mm_reference(x64, [w.double().t() for w in masters], sizes)).abs().max() > 0


def _experts(seed: int):
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = transformers.MixtralConfig(hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    experts = MixtralExperts(config)
    nn.init.normal_(experts.gate_up_proj, std=0.1)
    nn.init.normal_(experts.down_proj, std=0.1)
    return experts


def test_float8_experts_forward_is_the_transformers_forward_up_to_fp8(seed):
    experts = _experts(seed)
    tokens = 48
    hidden = torch.randn(tokens, 64)
    index = torch.stack([torch.randperm(5)[:2] for _ in range(tokens)])  # 4 = num_experts: a dropped slot
    weights = torch.rand(tokens, 2)
    reference = copy.deepcopy(experts).double()(hidden.double(), index, weights.double())
    converted, masters = Float8Experts.from_experts(experts)
    out = converted(hidden, index, weights)
    # Measured over 30 seeds: at most 0.075 (a plain Float8Linear chain on the same weights: 0.070); 2x headroom.
    assert (out.double() - reference).norm() / reference.norm() < 0.15
    assert len(masters) == 8 and all(m.shape in ((128, 64), (64, 64)) for m in masters)
    assert all(isinstance(p, fp8.Float8Tensor) for p in converted.expert_weights())
    fused = converted.state_dict()
    assert fused["gate_up_proj"].shape == (4, 128, 64) and fused["down_proj"].shape == (4, 64, 64)
    assert not any(k.startswith(("gate_up.", "down.")) for k in fused)
    again, _ = Float8Experts.from_experts(_experts(seed + 1))
    again.load_state_dict(fused)  # fused layout in: split and re-quantized, bit for bit (power-of-two scales)
    for p, q in zip(again.expert_weights(), converted.expert_weights()):
        assert torch.equal(p.dequantize(), q.dequantize())


@pytest.fixture(scope="module")
def measured():
    return {arch: archs.measure(arch, steps=3, batch=2, seq=16) for arch in archs.ARCHITECTURES}


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_experts_in_fp8_stay_on_the_high_precision_curve(arch):
    """Issue 36's protocol (3 distinct batches of 4 x 32 tokens cycled, AdamW lr 2e-3) for 30 steps, 3 seeds: O2's
    mean loss of the last 10 steps within 1.5% of ``none``'s. Measured over 10 seeds: worst 0.61%; at 100 steps the
    same figure moves by up to 7.7% from a 1e-4 relative perturbation of the initial weights in fp32 alone (top-k
    routing flips on the memorized tokens), so 100 steps are reported by the benchmark with that noise control
    (docs/moe.md), not tested."""
    for seed in range(3):
        r = archs.measure(arch, steps=30, seed=seed, n_batches=3, lr=2e-3)
        assert abs(r["gaps"]["last10"]) < 0.015, (seed, r["gaps"])


def test_benchmark_corpus_batches_are_fresh_seeded_byte_windows():
    """``--data shakespeare``: a new batch of byte windows every step, the same for a seed, another for another seed;
    bad requests are refused naming the fix."""
    batches = archs.token_batches("shakespeare", steps=4, seed=0, batch=3, seq=64)
    assert [tuple(b.shape) for b in batches] == [(3, 64)] * 4
    assert all(b.dtype == torch.long and 0 <= int(b.min()) and int(b.max()) < 256 for b in batches)
    assert len({tuple(b.flatten().tolist()) for b in batches}) == 4  # fresh every step, not cycled
    again = archs.token_batches("shakespeare", steps=4, seed=0, batch=3, seq=64)
    assert all(torch.equal(a, b) for a, b in zip(batches, again))
    other = archs.token_batches("shakespeare", steps=4, seed=1, batch=3, seq=64)
    assert not any(torch.equal(a, b) for a, b in zip(batches, other))
    text = bytes(batches[0][0].tolist()).decode("utf-8", errors="replace")
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.8 * len(text)  # English text, not random bytes
    cycled = archs.token_batches("random", steps=5, seed=0, n_batches=2)
    assert torch.equal(cycled[0], cycled[2]) and not torch.equal(cycled[0], cycled[1])
    with pytest.raises(ValueError, match="leave --batches out"):
        archs.token_batches("shakespeare", steps=2, seed=0, n_batches=3)
    with pytest.raises(ValueError, match="seq <= 64"):
        archs.token_batches("shakespeare", steps=2, seed=0, seq=65)
    with pytest.raises(ValueError, match="use one of"):
        archs.token_batches("wiki", steps=2, seed=0)
    with pytest.raises(ValueError, match="byte-level"):
        archs.token_batches("shakespeare", steps=2, seed=0, vocab_size=1000)


def test_benchmark_cosine_schedule():
    """``--schedule cosine --warmup W``: a linear ramp over W steps, then a cosine from lr to lr / 10 at the last step;
    ``constant`` keeps lr (the published random-token figures were measured so)."""
    steps, warmup = 100, 10
    factors = [archs.lr_factor(i, steps, "cosine", warmup) for i in range(steps)]
    cosine = [0.1 + 0.45 * (1 + math.cos(math.pi * i / (steps - 1))) for i in range(steps)]
    assert factors[:warmup] == pytest.approx([(i + 1) / warmup * cosine[i] for i in range(warmup)], rel=1e-12)
    assert factors[warmup:] == pytest.approx(cosine[warmup:], rel=1e-12)
    assert factors[0] == pytest.approx(0.1, rel=1e-12)  # 1/10 of the ramp, at the cosine's top
    assert factors[warmup - 1] == pytest.approx(0.98177, abs=1e-5)  # the peak: the cosine at step 9 of 99
    assert factors[-1] == pytest.approx(0.1, rel=1e-12)
    assert all(a > b for a, b in zip(factors[warmup - 1:], factors[warmup:]))
    assert {archs.lr_factor(i, steps) for i in range(steps)} == {1.0}
    with pytest.raises(ValueError, match="use one of"):
        archs.lr_factor(0, steps, "linear")
    with pytest.raises(ValueError, match="only with schedule='cosine'"):
        archs.lr_factor(0, steps, "constant", warmup)
    with pytest.raises(ValueError, match="warmup >= 0"):
        archs.lr_factor(0, steps, "cosine", -1)
    with pytest.raises(SystemExit):  # refused before any model is built
        archs.main(["--warmup", "5"])


@pytest.mark.parametrize("level", ["none", "O2"])
def test_benchmark_schedule_reaches_the_optimizer(monkeypatch, level):
    """The learning rate of every step reaches the (FP8) optimizer: at factor 0 nothing moves, the loss stays."""
    batches = [archs.token_batches("random", steps=1, seed=0, batch=2, seq=16)[0]] * 3
    moving = archs.train(archs.tiny_model("qwen3_moe"), level, batches, lr=1e-2, schedule="cosine", warmup=1)[1]
    assert moving[-1] < moving[0]
    monkeypatch.setattr(archs, "lr_factor", lambda step, steps, schedule, warmup: 0.0)
    frozen = archs.train(archs.tiny_model("qwen3_moe"), level, batches, lr=1e-2, schedule="cosine", warmup=1)[1]
    assert frozen[0] == moving[0] and frozen[1] == frozen[0] and frozen[2] == frozen[0]


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "falcon"])
def test_fp8_fraction_and_o2_loss(measured, arch):
    r = measured[arch]
    print(f"{arch}: FP8 fraction {r['fp8_fraction_old_rule']:.1%} -> {r['fp8_fraction']:.1%}, final loss none "
          f"{r['loss_none'][-1]:.4f} O2 {r['loss_O2'][-1]:.4f}")
    assert r["fp8_fraction_old_rule"] < 0.95 <= r["fp8_fraction"]
    assert r["loss_O2"][-1] < r["loss_O2"][0]  # it trains
    # measured 1e-4 (3 steps, random tokens); 1% is the project's loss-parity bound
    assert r["final_loss_rel_diff"] < 0.01


def test_selection_reports_kept_subclasses_and_experts(caplog):
    class Scaled(nn.Linear):  # a subclass with its own semantics
        def forward(self, x):
            return super().forward(x) * 2

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.plain, self.scaled = nn.Linear(32, 32), Scaled(32, 32)
            self.attn = nn.MultiheadAttention(32, 2)  # out_proj: a subclass whose weight the parent reads directly
            self.experts = _experts(0)

    model = Model()
    with caplog.at_level("WARNING", logger="fp8.convert"):
        model, converted = fp8.convert_to_float8_linear(model, module_filter_fn=lambda m, fqn: fqn != "experts")
    message = caplog.records[-1].getMessage()
    assert type(model.scaled) is Scaled and type(model.attn.out_proj) is not fp8.Float8Linear
    assert "0 of 1 MoE experts module(s)" in message and "experts (experts)" in message
    assert "scaled" in message and "attn.out_proj" in message and "not known to be a plain linear" in message
    assert [c.fqn for c in converted] == ["plain"]


def test_o1_trains_the_expert_masters(seed):
    model = archs.tiny_model("mixtral")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fp8.initialize(model, optimizer, "O1")
    experts = model.model.layers[0].mlp.experts
    before = experts.gate_up[0].weight.dequantize().clone()
    tokens = torch.randint(0, 256, (2, 16))
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    assert not torch.equal(before, experts.gate_up[0].weight.dequantize())
    fused = {id(p) for m in model.modules() for p in m.parameters(recurse=False) if p.dim() == 3}
    assert not fused and not any(p.dim() == 3 for g in optimizer.param_groups for p in g["params"])


def test_saved_state_dict_reloads_into_transformers_with_the_same_logits(seed, tmp_path):
    from fp8.integrations.transformers import high_precision_state_dict

    model = archs.tiny_model("qwen2_moe")
    config = model.config
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fp8.initialize(model, optimizer, "O2")
    tokens = torch.randint(0, 256, (2, 16))
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    state = high_precision_state_dict(model, optimizer)
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    fresh = transformers.AutoModelForCausalLM.from_config(config)
    fresh.load_state_dict(state, strict=True)
    model.eval()
    with torch.no_grad():
        ours, theirs = model(tokens).logits.double(), fresh(tokens).logits.double()
    # the reloaded model runs the masters in high precision, ours in FP8: FP8 error only. Measured 0.068 here, and
    # 0.053-0.063 between these tiny models (Falcon too, no experts) and their unconverted selves; 2x headroom.
    assert (ours - theirs).norm() / theirs.norm() < 0.15
    model.save_pretrained(tmp_path, state_dict=state)  # transformers writes its hub layout (per-expert tensors)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        hub = loaded(tokens).logits.double()
    assert (hub - theirs).norm() / theirs.norm() < 1e-5  # the same fp32 weights (measured 2e-7 max abs difference)
    expert = model.model.layers[0].mlp.experts.gate_up[1].weight
    assert torch.equal(state["model.layers.0.mlp.experts.gate_up_proj"][1], optimizer.master_value(expert).float())


def test_fp8_trainer_trains_and_saves_a_moe_model_transformers_reloads(seed, tmp_path):
    from fp8.integrations.transformers import FP8Trainer, fp8_optimizer_of

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.randint(0, 256, (8, 16))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                          gradient_accumulation_steps=2, learning_rate=1e-3, report_to=[], use_cpu=True,
                                          save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    trainer = FP8Trainer(model=archs.tiny_model("qwen3_moe"), args=args, train_dataset=Tokens(), fp8_opt_level="O2")
    trainer.train()
    experts = trainer.model.model.layers[0].mlp.experts
    assert isinstance(experts, Float8Experts) and experts.gate_up[0].weight.grad is None  # zeroed after the step
    trainer.save_model(str(tmp_path / "out"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    master = fp8_optimizer_of(trainer.optimizer).master_value(experts.down[2].weight).float()
    assert torch.equal(loaded.model.layers[0].mlp.experts.down_proj[2].float(), master)


def test_fp8_checkpoint_resumes_moe_training_bit_for_bit(seed, tmp_path):
    from fp8.checkpoint import load_checkpoint, save_checkpoint

    def build():
        model = archs.tiny_model("mixtral")
        return fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2")

    tokens = torch.randint(0, 256, (2, 16))
    model, optimizer = build()
    for _ in range(2):
        model(tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    save_checkpoint(tmp_path / "ckpt", model, optimizer)
    resumed, resumed_optimizer = build()
    load_checkpoint(tmp_path / "ckpt", resumed, resumed_optimizer)
    losses = []
    for m, o in ((model, optimizer), (resumed, resumed_optimizer)):
        loss = m(tokens, labels=tokens).loss
        loss.backward()
        o.step()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for a, b in zip(model.model.layers[1].mlp.experts.expert_weights(), resumed.model.layers[1].mlp.experts.expert_weights()):
        assert torch.equal(a.payload, b.payload) and torch.equal(a.scale, b.scale)


def test_scaled_grouped_mm_call_passes_torchs_checks():
    """The hardware call, replayed on ``meta`` tensors against torch's meta kernel (its CUDA checks: E4M3 operands,
    row-major a, column-major b, 16-byte strides, row-wise fp32 scales of the right shapes, int32 offsets)."""
    a = torch.empty(100, 64, device="meta", dtype=torch.float8_e4m3fn)
    b = [torch.empty(32, 64, device="meta", dtype=torch.float8_e4m3fn).t() for _ in range(3)]
    offsets = torch.empty(3, device="meta", dtype=torch.int32)
    out = scaled_grouped_mm(a, torch.ones((), device="meta"), b, torch.ones(3, device="meta"), offsets, torch.bfloat16)
    assert out.shape == (100, 32) and out.dtype == torch.bfloat16
    e5m2 = torch.empty(100, 64, device="cpu", dtype=torch.float8_e5m2)
    assert "E4M3 operands only" in grouped_mm_problem(e5m2, b[0], torch.bfloat16, "auto")


@pytest.mark.gpu
def test_scaled_grouped_mm_matches_the_per_group_path():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with torch._scaled_grouped_mm (compute capability >= 9.0); on a GPU machine: "
                    "make gpu-check")
    a = torch.randn(100, 64, device="cuda")
    fp8_a = a.to(torch.float8_e4m3fn)
    problem = grouped_mm_problem(fp8_a, fp8_a.t(), torch.bfloat16, "auto")
    if problem:
        pytest.skip(f"needs a CUDA GPU that runs torch._scaled_grouped_mm: {problem}; on a GPU machine: make gpu-check")
    sizes = [40, 0, 60]
    offsets = torch.tensor(sizes, device="cuda").cumsum(0).to(torch.int32)
    a_scale = _scale(a, E4M3)
    a_q = quantize(a, a_scale, E4M3)
    b = [torch.randn(64, 32, device="cuda") for _ in sizes]
    b_scales = torch.stack([_scale(w, E4M3) for w in b])
    b_q = [quantize(w, s, E4M3) for w, s in zip(b, b_scales)]
    hardware = grouped_fp8_mm(a_q, a_scale, b_q, b_scales, offsets, sizes, torch.bfloat16)
    emulated = grouped_fp8_mm(a_q, a_scale, b_q, b_scales, offsets, sizes, torch.bfloat16, "emulated")
    assert (hardware.float() - emulated.float()).abs().max() <= 2.0 ** -7 * emulated.float().abs().max()
