"""One rule decides whether a linear runs in FP8 (:mod:`fp8.eligibility`): ``fp8.initialize``'s conversion, Megatron's
layer specs and the memory planner (its torch-free mirror) agree on every shape, and the reasons name the fix."""

from __future__ import annotations

import itertools

import torch
from torch import nn

import fp8
from fp8.eligibility import fp8_linear_problem
from megatron.training.planning.memory_plan import fp8_linear_planned

SIZES = (8, 16, 24, 48, 64, 100, 128, 2048, 4096)
MIN_DIMS = (0, 64, 2048)


def test_planner_mirror_matches_the_engine_rule():
    for n_in, n_out, min_dim in itertools.product(SIZES, SIZES, MIN_DIMS):
        problem = fp8_linear_problem(n_in, n_out, min_dim)
        # Megatron keeps too-small layers in high precision; a shape problem is refused at construction
        assert fp8_linear_planned(n_in, n_out, min_dim) == (problem is None or not problem.too_small), (n_in, n_out)


def test_initialize_converts_exactly_the_eligible_linears():
    shapes = [(n_in, n_out) for n_in, n_out in itertools.product((16, 24, 64, 128), repeat=2)]
    for min_dim in (0, 64):
        model = nn.ModuleList([nn.Linear(n_in, n_out) for n_in, n_out in shapes])
        model, _ = fp8.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1", min_fp8_dim=min_dim)
        for (n_in, n_out), module in zip(shapes, model):
            assert isinstance(module, fp8.Float8Linear) == (fp8_linear_problem(n_in, n_out, min_dim) is None), \
                (n_in, n_out, min_dim)


def test_reasons_name_the_fix():
    small = fp8_linear_problem(64, 128, 2048)
    assert small.too_small and "min_fp8_dim=2048" in small.reason and "min_fp8_dim=0" in small.reason
    shape = fp8_linear_problem(24, 128)
    assert not shape.too_small and "multiples of 16" in shape.reason and "pad the layer" in shape.reason
    megatron = fp8_linear_problem(64, 128, 2048, " (per tensor-parallel rank)", "--fp8-min-dim 0 converts it")
    assert "(per tensor-parallel rank) below" in megatron.reason and "--fp8-min-dim 0" in megatron.reason
