"""FP8 optimizers (O2): agreement with torch.optim in float64 for every precision combination,
non-finite step skipping, clipping, conversion from torch.optim, exact resume."""

from __future__ import annotations

import io
import itertools
import logging

import pytest
import torch

import fp8
from fp8.optim import SGD, Adam, AdamW, OptimizerPrecision

STEPS = 200
# Stated bound on |w - w_ref| / |w_ref - w_0| (error relative to the distance travelled) after 200 steps,
# as the sum of a contribution per role format (measured maxima over seeds in parentheses, bounds ~1.5-2x;
# over 63 combinations x 8 seeds the largest error was 0.70 of its bound).
CONTRIBUTION = {
    ("exp_avg", "e4m3"): 0.08,  # (0.057 over 30 seeds)
    ("exp_avg", "bf16"): 0.01,  # (0.006)
    ("exp_avg_sq", "bf16"): 0.03,  # (0.017)
    ("exp_avg_sq", "fp16"): 0.003,  # (0.0014)
    ("master", "bf16"): 0.10,  # (0.077)
    ("master", "fp16"): 0.01,  # (0.006)
}
ROUNDING = 1e-5  # fp32/fp32/fp32: |w - w_ref| / |w_ref| after 200 steps

COMBOS = list(itertools.product(("e4m3", "bf16", "fp32"), ("fp16", "bf16", "fp32"), ("fp16", "bf16", "fp32")))
CASES = [("AdamW", c) for c in COMBOS] + [("Adam", c) for c in COMBOS] + [
    ("SGD", c) for c in COMBOS if c[1] == "fp32"  # SGD has no second moment
]
OPTIMIZERS = {
    "AdamW": (AdamW, torch.optim.AdamW, dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)),
    "Adam": (Adam, torch.optim.Adam, dict(lr=1e-3, weight_decay=0.01)),
    "SGD": (SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=True)),
}


def _bound(precision: OptimizerPrecision, roles) -> float:
    return sum(CONTRIBUTION.get((role, getattr(precision, role)), 0.0) for role in roles)


@pytest.mark.parametrize("name,combo", CASES, ids=[f"{n}-{'/'.join(c)}" for n, c in CASES])
def test_matches_torch_optim_in_float64(name, combo, gen):
    """A GPT-like FP8 weight (std 0.02), an fp32 and a bf16 vector; gradients log-uniform over 4
    decades, fresh per step; the reference runs torch.optim in float64 on the same gradient values."""
    ours_cls, ref_cls, kwargs = OPTIMIZERS[name]
    precision = OptimizerPrecision(*combo)
    w0 = torch.randn(64, 64, generator=gen, dtype=torch.float64) * 0.02
    v0 = torch.randn(1024, generator=gen, dtype=torch.float64)  # large enough for a stable statistic
    b0 = torch.randn(512, generator=gen, dtype=torch.float64).to(torch.bfloat16).to(torch.float64)
    weight = torch.nn.Parameter(fp8.to_float8(w0.float()))
    vector = torch.nn.Parameter(v0.float())
    half = torch.nn.Parameter(b0.to(torch.bfloat16))
    ours = ours_cls([weight, vector, half], precision=precision, initial_masters={weight: w0.float()}, **kwargs)
    refs = [torch.nn.Parameter(t.clone()) for t in (w0, v0, b0)]
    reference = ref_cls(refs, **kwargs)
    for _ in range(STEPS):
        magnitude = torch.exp(torch.empty(64, 64, dtype=torch.float64).uniform_(-9, 0, generator=gen))
        g_weight = fp8.to_float8((torch.randn(64, 64, generator=gen, dtype=torch.float64) * magnitude).float())
        g_vector = torch.randn(1024, generator=gen, dtype=torch.float64).float()
        g_half = torch.randn(512, generator=gen, dtype=torch.float64).to(torch.bfloat16)
        weight.grad, vector.grad, half.grad = g_weight, g_vector, g_half
        for ref, g in zip(refs, (g_weight.dequantize(torch.float64), g_vector, g_half)):
            ref.grad = g.to(torch.float64)
        ours.step()
        reference.step()
    moment_roles = ("exp_avg",) if name == "SGD" else ("exp_avg", "exp_avg_sq")
    for param, ref, start, has_master in ((weight, refs[0], w0, True), (vector, refs[1], v0, False),
                                          (half, refs[2], b0, False)):  # 16-bit params: fp32 master
        value = ours.master_value(param).double()
        ref = ref.detach()
        bound = _bound(precision, moment_roles + (("master",) if has_master else ()))
        if bound == 0:  # every role of this parameter in fp32
            assert (value - ref).norm() / ref.norm() < ROUNDING
            continue
        relative = ((value - ref).norm() / (ref - start).norm()).item()
        assert relative < bound + 1e-4, f"{name} {combo}: {relative:.4f} > {bound}"
    # The FP8 weight is its master, re-quantized.
    assert torch.equal(weight.payload.view(torch.uint8), fp8.to_float8(ours.master_value(weight)).payload.view(torch.uint8))


def test_states_are_stored_compressed(gen):
    weight = torch.nn.Parameter(fp8.to_float8(torch.randn(32, 32, generator=gen)))
    weight.grad = fp8.to_float8(torch.randn(32, 32, generator=gen))
    opt = AdamW([weight])  # default precision: the O2 recipe
    opt.step()
    state = opt.state[weight]
    assert state["exp_avg"].dtype == torch.float8_e4m3fn
    assert state["exp_avg_sq"].dtype == torch.float16
    assert state["master"].dtype == torch.float16
    for key in ("exp_avg", "exp_avg_sq", "master"):
        mantissa, _ = torch.frexp(state[f"{key}_scale"])
        assert state[f"{key}_scale"].dtype == torch.float32 and mantissa.item() == 0.5  # power of two
        # Scaled into the top octave of its format: no overflow, least underflow.
        top = {torch.float8_e4m3fn: 448.0, torch.float16: 65504.0}[state[key].dtype]
        assert top / 2 <= state[key].to(torch.float32).abs().max() <= top


def test_precision_config_validation():
    with pytest.raises(ValueError, match="exp_avg_sq='e5m2'"):
        OptimizerPrecision(exp_avg_sq="e5m2")
    with pytest.raises(ValueError, match="master='e4m3'"):
        OptimizerPrecision(master="e4m3")
    assert fp8.optim.PRECISION_PRESETS["O2"] == OptimizerPrecision("e4m3", "fp16", "fp16")
    assert OptimizerPrecision.preset("O1") == OptimizerPrecision("fp32", "fp32", "fp32")
    with pytest.raises(ValueError, match="preset"):
        OptimizerPrecision.preset("O9")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("where", ["fp8", "hp"])
def test_non_finite_gradient_skips_the_step(gen, caplog, bad, where):
    weight = torch.nn.Parameter(fp8.to_float8(torch.randn(32, 32, generator=gen)))
    vector = torch.nn.Parameter(torch.randn(32, generator=gen))
    opt = AdamW([weight, vector])
    for _ in range(2):
        weight.grad = fp8.to_float8(torch.randn(32, 32, generator=gen))
        vector.grad = torch.randn(32, generator=gen)
        opt.step()
    before = {k: [v.clone() for v in s.values()] for k, s in enumerate(opt.state.values())}
    weight_bits, vector_before = weight.payload.clone(), vector.detach().clone()
    g = torch.randn(32, 32, generator=gen)
    g[3, 4] = bad
    if where == "fp8":
        weight.grad = fp8.to_float8(g.nan_to_num(0.0))
        weight.grad.payload[3, 4] = bad  # the FP8 payload itself holds the NaN/inf (inf saturates in E4M3)
        if bad == float("inf"):
            weight.grad.scale.fill_(float("inf"))
    else:
        vector.grad = torch.randn(32, generator=gen)
        vector.grad[5] = bad
    with caplog.at_level(logging.WARNING, logger="fp8"):
        opt.step()
    assert opt.skipped_steps == 1 and "skipped" in caplog.text
    after = {k: list(s.values()) for k, s in enumerate(opt.state.values())}
    for k in before:
        for a, b in zip(before[k], after[k]):
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b)
    assert torch.equal(weight.payload.view(torch.uint8), weight_bits.view(torch.uint8))
    assert torch.equal(vector.detach(), vector_before)


def test_o1_wrapper_also_skips_non_finite_steps(gen):
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 16))
    model, opt = fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1")
    model(torch.randn(16, 32, generator=gen)).sum().backward()
    model[1].bias.grad[0] = float("nan")
    masters = [m.detach().clone() for m in opt.master_weights]
    opt.step()
    assert opt.skipped_steps == 1 and not opt.optimizer.state
    assert all(torch.equal(a, b) for a, b in zip(masters, opt.master_weights))


def test_clip_grad_norm_equals_torch_on_high_precision_models(gen):
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))
    twin = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Tanh(), torch.nn.Linear(48, 8))
    twin.load_state_dict(model.state_dict())
    x = torch.randn(16, 32, generator=gen)
    for m in (model, twin):
        (m(x) * 100).pow(2).sum().backward()
    for norm_type in (2.0,):
        ours = fp8.optim.clip_grad_norm_(model.parameters(), 1.0, norm_type)
        theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0, norm_type)
        assert torch.allclose(ours, theirs, rtol=1e-6)
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=0)
    inf_model = torch.nn.Linear(8, 8)
    inf_model.weight.grad = torch.randn(8, 8, generator=gen) * 50
    inf_twin = torch.nn.Linear(8, 8)
    inf_twin.weight.grad = inf_model.weight.grad.clone()
    assert torch.allclose(fp8.optim.clip_grad_norm_([inf_model.weight], 2.0, float("inf")),
                          torch.nn.utils.clip_grad_norm_([inf_twin.weight], 2.0, float("inf")), rtol=1e-6)
    assert torch.allclose(inf_model.weight.grad, inf_twin.weight.grad, rtol=1e-6)


def test_clip_grad_norm_over_fp8_and_high_precision_gradients(gen):
    weight = torch.nn.Parameter(fp8.to_float8(torch.randn(32, 32, generator=gen)))
    vector = torch.nn.Parameter(torch.randn(32, generator=gen))
    weight.grad = fp8.to_float8(torch.randn(32, 32, generator=gen) * 3)
    vector.grad = torch.randn(32, generator=gen) * 3
    values = [weight.grad.dequantize(torch.float64), vector.grad.double()]
    exact = torch.sqrt(sum(v.pow(2).sum() for v in values))
    total = fp8.optim.clip_grad_norm_([weight, vector], 1.0)
    assert torch.allclose(total.double(), exact, rtol=1e-6)
    coef = 1.0 / (exact + 1e-6)
    assert isinstance(weight.grad, fp8.Float8Tensor)
    assert torch.allclose(weight.grad.dequantize(torch.float64), values[0] * coef, rtol=1e-6)
    assert torch.allclose(vector.grad.double(), values[1] * coef, rtol=1e-6)
    with pytest.raises(RuntimeError, match="non-finite"):
        vector.grad[0] = float("nan")
        fp8.optim.clip_grad_norm_([weight, vector], 1.0, error_if_nonfinite=True)


def test_initialize_o2_converts_torch_optimizers(gen):
    for torch_cls, fp8_cls, kwargs in (
        (torch.optim.AdamW, AdamW, dict(lr=2e-3, betas=(0.8, 0.9), eps=1e-7, weight_decay=0.05)),
        (torch.optim.Adam, Adam, dict(lr=2e-3, weight_decay=0.02)),
        (torch.optim.SGD, SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)),
    ):
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32))
        original_weight = model[0].weight.detach().clone()
        optimizer = torch_cls([{"params": [model[0].weight, model[0].bias]}, {"params": model[2].parameters(), "lr": 1e-4}], **kwargs)
        model, opt = fp8.initialize(model, optimizer, "O2")
        assert type(opt) is fp8_cls and opt.precision == fp8.optim.PRECISION_PRESETS["O2"]
        for key, value in kwargs.items():
            assert opt.param_groups[0][key] == value
        assert opt.param_groups[1]["lr"] == 1e-4
        assert opt.param_groups[0]["params"][0] is model[0].weight and isinstance(model[0].weight, fp8.Float8Tensor)
        # The master starts from the original high-precision weight, stored as FP16 + scale.
        master = opt.master_value(model[0].weight)
        assert ((master - original_weight).abs() <= original_weight.abs() * 2**-11 + 1e-7).all()


def test_initialize_o2_refuses_what_it_cannot_convert(gen):
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    with pytest.raises(TypeError, match="Adam, AdamW and SGD"):
        fp8.initialize(model, torch.optim.RMSprop(model.parameters()), "O2")
    assert type(model[0]) is torch.nn.Linear  # refused before touching the model
    with pytest.raises(ValueError, match="amsgrad"):
        fp8.initialize(model, torch.optim.Adam(model.parameters(), amsgrad=True), "O2")
    stepped = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 32, generator=gen)).sum().backward()
    stepped.step()
    with pytest.raises(ValueError, match="before the first optimizer step"):
        fp8.initialize(model, stepped, "O2")
    with pytest.raises(ValueError, match="optimizer_precision= applies"):
        fp8.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1", optimizer_precision=OptimizerPrecision())
    with pytest.raises(TypeError, match="precision= takes per-layer precision rules.*optimizer_precision="):
        fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O2", precision=OptimizerPrecision())


def test_o2_state_dict_resume_is_bit_identical(gen):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    data = [(torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)) for _ in range(10)]

    def build():
        torch.manual_seed(1234)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.LayerNorm(64), torch.nn.Linear(64, 32))
        return fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O2")

    def run(model, opt, part):
        for x, y in part:
            (model(x) - y).pow(2).mean().backward()
            fp8.optim.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()

    model, opt = build()
    run(model, opt, data[:5])
    opt.skipped_steps = 2  # as if two steps had been skipped: the count is part of the checkpoint
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    run(model, opt, data[5:])
    buffer.seek(0)
    with torch.serialization.safe_globals(fp8.safe_globals()):
        saved = torch.load(buffer, weights_only=True)
    resumed, resumed_opt = build()
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["optimizer"])
    assert resumed_opt.state[resumed[0].weight]["exp_avg"].dtype == torch.float8_e4m3fn
    assert resumed_opt.skipped_steps == opt.skipped_steps
    run(resumed, resumed_opt, data[5:])
    for (name, a), b in zip(model.state_dict().items(), resumed.state_dict().values()):
        if isinstance(a, fp8.Float8Tensor):
            assert torch.equal(a.payload.view(torch.uint8), b.payload.view(torch.uint8)) and torch.equal(a.scale, b.scale), name
        else:
            assert torch.equal(a, b), name
    for s1, s2 in zip(opt.state.values(), resumed_opt.state.values()):
        for k in s1:
            a, b = s1[k].reshape(-1), s2[k].reshape(-1)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), k


def test_kernel_backend_and_scaling_module_are_constructor_arguments():
    """No class-level switch and no attribute set after construction: each optimizer takes its own."""
    from fp8.optim.base import FP8Optimizer

    assert "kernel_backend" not in vars(FP8Optimizer)
    model = torch.nn.Linear(16, 16)
    for cls in (fp8.optim.Adam, fp8.optim.AdamW, fp8.optim.SGD):
        opt = cls(model.parameters(), lr=1e-3, kernel_backend="torch", scaling_module=model)
        assert opt.kernel_backend == "torch" and opt.scaling_module is model
        assert cls(model.parameters(), lr=1e-3).kernel_backend == "auto"
        with pytest.raises(ValueError, match="kernel_backend must be one of"):
            cls(model.parameters(), lr=1e-3, kernel_backend="cuda")
        with pytest.raises(TypeError, match="scaling_module must be an nn.Module"):
            cls(model.parameters(), lr=1e-3, scaling_module=[model])
    model, fp8_opt = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2")
    assert fp8_opt.scaling_module is model  # fp8.initialize passes the (converted) model


def test_one_level_table_builds_each_levels_optimizer():
    """fp8.optim.wrap_for_level: O1 wraps the given optimizer over masters, O2 converts it, O3 needs a process group;
    a level without an FP8 optimizer, and options of another level, are refused naming the level."""
    from fp8.optim import FP8Weight, MasterWeightOptimizer, ShardedFP8Optimizer, wrap_for_level
    from fp8.tensor import to_float8

    torch.manual_seed(0)
    model = torch.nn.Linear(32, 32)
    master = torch.nn.Parameter(model.weight.detach().clone())
    weight = torch.nn.Parameter(to_float8(master.detach(), "e4m3"), requires_grad=True)
    for level, kind in (("O1", MasterWeightOptimizer), ("O2", fp8.optim.AdamW)):
        base = torch.optim.AdamW([master, model.bias], lr=1e-3)
        opt = wrap_for_level(level, base, [FP8Weight(master, weight, master.detach())], scaling_module=model)
        assert isinstance(opt, kind) and not isinstance(opt, ShardedFP8Optimizer)
        if level == "O1":  # the master O1 steps is the parameter the given optimizer holds
            assert opt.pairs[0][0] is master and opt.optimizer is base
    with pytest.raises(ValueError, match="no FP8 optimizer for opt level 'none'"):
        wrap_for_level("none", torch.optim.AdamW([master]), [], scaling_module=model)
    with pytest.raises(ValueError, match="apply to opt level 'O3', not 'O2'"):
        wrap_for_level("O2", torch.optim.AdamW([master]), [], scaling_module=model, process_group=object())
    with pytest.raises(ValueError, match="applies to opt levels 'O2' and 'O3', not 'O1'"):
        wrap_for_level("O1", torch.optim.AdamW([master]), [], scaling_module=model, precision="O2")
