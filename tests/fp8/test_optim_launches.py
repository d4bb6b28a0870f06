"""The optimizer step in a fixed number of device launches, whatever the number of FP8 linears.

Counted with :class:`fp8.launches.LaunchCounter` (every dispatched non-view op is one launch on a GPU; each multi-tensor
custom op of :mod:`fp8.optim.ops` is one op here and one Triton launch there, which
``tests/fp8/test_multi_tensor_ops.py`` checks), on models of ``n`` bias-free FP8 linears, after three warm-up steps,
counting ``optimizer.step(); optimizer.zero_grad()``. The slope is the count's growth per extra FP8 linear between 2
and 8 linears. The delayed-scaling states' close (``discard_step_amaxes`` + ``update_scales``, called by the step) is
counted apart and left out of the slope: it is the scaling code's own. Counts are deterministic, so the bound is
exact: at most one launch per extra linear (the step has none today). O3 is counted at 2 and 4 processes in
``tests/training/test_o3.py``; on one rank it is O2's step.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fp8
from fp8.launches import LaunchCounter
from fp8.scaling import discard_step_amaxes, update_scales

LINEARS = (2, 8)
DIM = 32


def step_launches(level: str, n_linears: int, make_optimizer, *, bias: bool = False, process_group=None,
                  ddp: bool = False):
    """``(step launches, the scaling close's launches, launches per op)`` of one steady-state step of a model of
    ``n_linears`` ``DIM x DIM`` bf16 linears at ``level`` (``"none"``: the model and optimizer as given)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(DIM, DIM, bias=bias) for _ in range(n_linears)]).to(torch.bfloat16)
    optimizer = make_optimizer(model.parameters())
    if level != "none":
        extra = {"process_group": process_group} if level == "O3" else {}
        model, optimizer = fp8.initialize(model, optimizer, level, **extra)
    run = model
    if ddp:
        import fp8.distributed as fd

        run = fd.DistributedDataParallel(model, process_group=process_group, o3_optimizer=optimizer)
    x = torch.randn(16, DIM, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def backward():
        run(x).float().pow(2).mean().backward()

    for _ in range(3):
        backward()
        optimizer.step()
        optimizer.zero_grad()
    backward()
    with LaunchCounter() as step:
        optimizer.step()
        optimizer.zero_grad()
    scaling = LaunchCounter()
    if level != "none":
        ok = torch.ones((), dtype=torch.bool)
        with scaling:
            discard_step_amaxes(model, keep=ok)
            update_scales(model, enabled=ok)
    return step.launches, scaling.launches, step.by_op


def slope(level: str, make_optimizer, linears: tuple[int, int] = LINEARS, **kwargs) -> tuple[float, dict]:
    """Launches per extra FP8 linear of the step without the scaling close (between the two model sizes
    ``linears``), and the per-op counts at the larger model."""
    counts = [step_launches(level, n, make_optimizer, **kwargs) for n in linears]
    (a, sa, _), (b, sb, by_op) = counts
    return ((b - sb) - (a - sa)) / (linears[1] - linears[0]), by_op


def adamw_for_counts(params):
    """The AdamW of the counts (also tests/training/test_o3.py's)."""
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


OPTIMIZERS = {
    "AdamW": adamw_for_counts,
    "Adam-L2": lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.01),
    "SGD-nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "SGD": lambda p: torch.optim.SGD(p, lr=0.05),
}


@pytest.mark.parametrize("bias", [False, True], ids=["bias-free", "bf16-biases"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_o2_step_launches_do_not_grow_with_the_fp8_linears(name, bias):
    """O2 (also O3 on one rank): the step is one multi-tensor op per stage (per param group for the update passes),
    whatever the number of FP8 weights (and of bf16 biases, with their fp32 masters)."""
    per_linear, by_op = slope("O2", OPTIMIZERS[name], bias=bias)
    assert per_linear <= 1, per_linear
    stage = "fp8lm.adam_stage2_.default" if name.startswith("Adam") else "fp8lm.sgd_stage2_.default"
    assert by_op[stage] == 1 and by_op["fp8lm.prepare_states_.default"] == 1, dict(by_op)


@pytest.mark.parametrize("flag", ["fused", "foreach"])
def test_o1_wrapper_launches_do_not_grow_with_the_fp8_linears(flag):
    """O1: the wrapper's own work (finite check, master gradients, masked step, FP8 refresh) is a fixed number of
    ops; the wrapped torch optimizer's launches are its own (torch's foreach AdamW reads each step count on the host),
    so the bound is on the growth beyond BF16's with the same optimizer."""
    make = (lambda p: torch.optim.AdamW(p, lr=1e-3, **{flag: True}))
    per_linear, by_op = slope("O1", make)
    baseline, _ = slope("none", make)
    assert per_linear - baseline <= 1, (per_linear, baseline)
    assert by_op["fp8lm.quantize_weights_.default"] == 1 and by_op["fp8lm.dequantize_grads.default"] == 1, dict(by_op)
    if flag == "foreach":  # the masked step: one copy before, one restore after
        assert by_op["fp8lm.clone_tensors.default"] == 1 and by_op["fp8lm.restore_unless_.default"] == 1, dict(by_op)


def test_clip_grad_norm_launches_do_not_grow_with_the_gradients(gen):
    """``fp8.clip_grad_norm_`` over FP8 (scaled FP16 and E4M3) and bf16 gradients: a fixed number of ops."""
    counts = []
    for n in LINEARS:
        grads = []
        for i in range(n):
            p = nn.Parameter(torch.randn(DIM, generator=gen).to(torch.bfloat16))
            p.grad = torch.randn(DIM, generator=gen).to(torch.bfloat16)
            w = nn.Parameter(fp8.to_float8(torch.randn(DIM, DIM, generator=gen)))
            w.grad = fp8.to_float8(torch.randn(DIM, DIM, generator=gen)) if i % 2 else \
                fp8.scaled_fp16.to_scaled_fp16(torch.randn(DIM, DIM, generator=gen))
            grads += [p, w]
        with LaunchCounter() as counter:
            fp8.clip_grad_norm_(grads, 0.1)
        counts.append(counter.launches)
    assert counts[1] == counts[0], counts
