"""Bad input to the engine API never passes silently (issue 16): ``fp8.initialize`` refuses, each error
naming the fix, a model already initialized, an optimizer built on other parameters, a model on the meta
device, and at O1 an optimizer whose step needs a closure; a conversion that makes no layer FP8 warns (or,
with ``require_fp8=True``, raises); ``fp8.checkpoint`` is there after ``import fp8``. The valid paths still
work."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8

ROOT = Path(__file__).resolve().parents[2]


def _model():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))


def _fp8_layers(model):
    return [m for m in model.modules() if isinstance(m, fp8.Float8Linear)]


def _train(model, optimizer, steps=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


# -- 1. a model already initialized ----------------------------------------------------------------------
@pytest.mark.parametrize("level", ["none", "O1", "O2"])
def test_initializing_an_initialized_model_again_is_refused(seed, level):
    model, optimizer = fp8.initialize(_model(), None, "O1")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=r"model is already initialized for FP8 \(it holds 2 Float8Linear module"
                                         r"\(s\): '0', '2'\); call fp8.initialize once, on the original model and "
                                         r"optimizer"):
        fp8.initialize(model, optimizer, level)
    with pytest.raises(ValueError, match="model is already initialized for FP8"):
        fp8.initialize(model, None, level)


def test_a_model_holding_float8_weights_is_refused(seed):
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(fp8.to_float8(torch.randn(32, 32)), requires_grad=False)
    with pytest.raises(ValueError, match=r"already initialized for FP8 \(it holds 1 Float8Tensor parameter\(s\): 'w'\)"):
        fp8.initialize(model, None, "O1")


def test_initialize_once_then_training_moves_every_weight(seed):
    """The valid path: one call, then every weight (through its master) changes, and the loss falls."""
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O1")
    assert len(_fp8_layers(model)) == 2
    losses = _train(model, optimizer)
    assert losses[-1] < losses[0]
    for old, new in zip(before, model.parameters()):
        new = new.dequantize(torch.float32) if isinstance(new, fp8.Float8Tensor) else new.detach()
        assert (new != old).float().mean() > 0.5


# -- 2. an optimizer over another model's parameters -----------------------------------------------------
@pytest.mark.parametrize("level", ["none", "O1", "O2"])
def test_an_optimizer_built_on_another_model_is_refused(seed, level):
    model, other = _model(), _model()
    optimizer = torch.optim.AdamW(other.parameters())
    with pytest.raises(ValueError, match=r"the optimizer holds 4 parameter\(s\) that are not parameters of this "
                                         r"model: param_groups\[0\]\['params'\]\[0\] \(shape \[64, 32\]\), "
                                         r"param_groups\[0\]\['params'\]\[1\] \(shape \[64\]\)") as err:
        fp8.initialize(model, optimizer, level)
    assert "build the optimizer on this model's parameters" in str(err.value)
    assert not _fp8_layers(model)  # refused before the model is touched


def test_a_partly_foreign_optimizer_names_only_the_foreign_parameters(seed):
    model = _model()
    stray = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.SGD([{"params": model.parameters()}, {"params": [stray]}], lr=0.1)
    with pytest.raises(ValueError, match=r"holds 1 parameter\(s\) .*param_groups\[1\]\['params'\]\[0\] \(shape \[3\]\)"):
        fp8.initialize(model, optimizer, "O1")


def test_an_optimizer_over_part_of_the_model_is_accepted(seed):
    model = _model()
    optimizer = torch.optim.SGD(model[2].parameters(), lr=0.1)  # the first layer frozen: fine
    model, optimizer = fp8.initialize(model, optimizer, "O1")
    assert len(optimizer.master_weights) == 1
    frozen = model[0].weight.dequantize(torch.float32)
    losses = _train(model, optimizer)
    assert losses[-1] < losses[0]
    assert torch.equal(model[0].weight.dequantize(torch.float32), frozen)


# -- 3. a conversion that makes no layer FP8 --------------------------------------------------------------
def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "run in FP8" in r.getMessage()]


def test_a_model_without_linears_warns(seed, caplog):
    model = torch.nn.Sequential(torch.nn.Embedding(16, 32), torch.nn.LayerNorm(32))
    with caplog.at_level(logging.WARNING, logger="fp8"):
        fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1")
    (message,) = _warnings(caplog)
    assert message == ("fp8: 0 of 0 linear layer(s) run in FP8 (the model has no torch.nn.Linear; only nn.Linear "
                       "modules are converted) -- no FP8 GEMM will run")


def test_a_model_with_no_eligible_linear_warns_with_the_reason(seed, caplog):
    model = torch.nn.Sequential(torch.nn.Linear(30, 10))
    with caplog.at_level(logging.WARNING, logger="fp8"):
        fp8.initialize(model, torch.optim.AdamW(model.parameters()), "O1")
    (message,) = _warnings(caplog)
    assert message.startswith("fp8: 0 of 1 linear layer(s) run in FP8; 1 stay in high precision: 1 dimensions not "
                              "multiples of 16") and message.endswith("-- no FP8 GEMM will run")


@pytest.mark.parametrize("build, min_dim, reason", [
    (lambda: torch.nn.Sequential(torch.nn.Embedding(16, 32)), None, "the model has no torch.nn.Linear"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(30, 10)), None, "dimensions not multiples of 16"),
    (_model, 4096, "smaller than min_fp8_dim=4096"),
])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_require_fp8_raises_instead_and_touches_nothing(seed, build, min_dim, reason, level):
    model = build()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params)
    with pytest.raises(ValueError, match="require_fp8=True asks for at least one FP8 layer") as err:
        fp8.initialize(model, optimizer, level, min_fp8_dim=min_dim, require_fp8=True)
    assert reason in str(err.value) and "pass require_fp8=False to train in high precision" in str(err.value)
    assert list(model.parameters()) == params and not _fp8_layers(model)
    assert optimizer.param_groups[0]["params"] == params


def test_require_fp8_accepts_a_model_with_fp8_layers(seed, caplog):
    with caplog.at_level(logging.WARNING, logger="fp8"):
        model, _ = fp8.initialize(_model(), None, "O1", require_fp8=True)
    assert len(_fp8_layers(model)) == 2
    assert _warnings(caplog) == ["fp8: 2 of 2 linear layer(s) run in FP8"]
    with pytest.raises(ValueError, match="require_fp8=True"):
        fp8.convert_to_float8_linear(torch.nn.Sequential(torch.nn.Linear(30, 10)), require_fp8=True)
    assert len(fp8.convert_to_float8_linear(_model(), require_fp8=True)[1]) == 2


# -- 4. a model on the meta device ------------------------------------------------------------------------
def test_a_meta_device_model_is_refused_then_works_once_materialized(seed):
    with torch.device("meta"):
        model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"model has 4 parameter\(s\) on the meta device .*; build the model on a "
                                         r"real device \(or call model.to_empty\(device=...\) and initialize the "
                                         r"weights\) before fp8.initialize"):
        fp8.initialize(model, optimizer, "O1")
    assert not _fp8_layers(model)
    assert fp8.initialize(model, optimizer, "none") == (model, optimizer)  # the baseline touches nothing
    model.to_empty(device="cpu")
    for layer in (model[0], model[2]):
        layer.reset_parameters()
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "O1")
    losses = _train(model, optimizer)
    assert losses[-1] < losses[0]


# -- 5. closure optimizers ----------------------------------------------------------------------------------
def test_an_optimizer_needing_a_closure_is_refused_at_o1(seed):
    model = _model()
    with pytest.raises(TypeError, match=r"LBFGS.step\(closure\) re-evaluates the model within one step, which "
                                        r"opt_level 'O1' does not support .*opt_level='none' to train with LBFGS"):
        fp8.initialize(model, torch.optim.LBFGS(model.parameters()), "O1")
    assert not _fp8_layers(model)
    with pytest.raises(TypeError, match="opt_level O2 converts torch.optim.Adam, AdamW and SGD"):
        fp8.initialize(model, torch.optim.LBFGS(model.parameters()), "O2")


def test_lbfgs_trains_at_none_and_a_closure_works_at_o1(seed):
    """The valid paths: LBFGS at the baseline; at O1, ``step(closure)`` of a first-order optimizer."""
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 32, generator=gen)
    for level, make in (("none", lambda p: torch.optim.LBFGS(p, lr=0.5)), ("O1", lambda p: torch.optim.AdamW(p, lr=1e-2))):
        model = _model()
        model, optimizer = fp8.initialize(model, make(model.parameters()), level)

        def closure():
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        losses = [optimizer.step(closure).item() for _ in range(6)]
        assert losses[-1] < losses[0], (level, losses)


# -- 6. fp8.checkpoint after `import fp8` ------------------------------------------------------------------
def test_fp8_checkpoint_is_available_after_import_fp8_without_importing_it_up_front():
    code = (
        "import sys, tempfile, torch, fp8\n"
        "assert 'fp8.checkpoint' not in sys.modules and 'torch.distributed.checkpoint' not in sys.modules\n"
        "m = torch.nn.Sequential(torch.nn.Linear(32, 32))\n"
        "m, o = fp8.initialize(m, torch.optim.AdamW(m.parameters()), 'O2')\n"
        "m(torch.randn(4, 32)).sum().backward(); o.step()\n"
        "path = tempfile.mkdtemp() + '/ckpt'\n"
        "fp8.checkpoint.save_checkpoint(path, m, o)\n"
        "fp8.checkpoint.load_checkpoint(path, m, o)\n"
        "assert sys.modules['fp8.checkpoint'] is fp8.checkpoint\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr
    with pytest.raises(AttributeError, match="module 'fp8' has no attribute 'no_such_module'"):
        fp8.no_such_module


def test_training_through_a_bare_fp8_weight_outside_the_recipe_raises():
    """F.linear / @ on a Float8Tensor that requires grad, with grad enabled, would be a second, implicit FP8
    training GEMM: refused, naming Float8Linear; evaluation (no_grad, or a weight not requiring grad) runs."""
    weight = torch.nn.Parameter(fp8.to_float8(torch.randn(32, 16)))
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="Float8Linear"):
        torch.nn.functional.linear(x, weight)
    with pytest.raises(RuntimeError, match="Float8Linear"):
        x @ weight.t()
    with torch.no_grad():
        out = torch.nn.functional.linear(x, weight)
    frozen = fp8.to_float8(torch.randn(32, 16))  # requires no grad: evaluation of a frozen weight
    assert out.shape == (4, 32) and torch.nn.functional.linear(x, frozen).shape == (4, 32)
