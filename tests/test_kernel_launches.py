"""The FP8 linear's launch budget, counted on the CPU (``benchmarks/kernels.py``: every dispatched op that is not a view
is one GPU launch; each fused kernel of :mod:`fp8.ops` is one op), held per recipe.

Per FP8 linear (forward + backward, GEMMs on the hardware path, steady state; the slope between models of 2 and 8
linears), against BF16's 3 (one forward GEMM, two backward GEMMs):

- tensor-wise, delayed scaling: 7 launches and 7 full-size passes: the input's cast+transpose (1), the forward GEMM,
  the output gradient's cast+transpose (1), the two backward GEMMs, the weight gradient's amax and cast (2, the
  gradient is FP8 at rest); the weight's transpose is refreshed by the optimizer for all weights in one launch;
- tensor-wise, current scaling: 9: each of the two current-scaled casts needs the tensor's amax before its first
  element is written (an amax kernel, then the cast: one more launch each, the physical minimum without a grid-wide
  sync);
- rowwise: 9 (per-row and per-column casts of both activations, three GEMMs, the weight gradient's two kernels; the
  weight's per-input-channel copy is made by the optimizer step, one kernel per weight);
- blockwise: 7 (1x128 and 128x1 tiles of the input and the gradient from one read each; the weights' scale_inv grids
  are refreshed by the optimizer step for all weights at once).

The optimizer step is flat in the number of linears at O2 (multi-tensor ops; tensor-wise weights: block-scaled weights
still take the per-parameter update) and grows by torch's own foreach AdamW's 2 per linear at O1 (its master weights
are plain fp32 tensors).
"""

from __future__ import annotations

import pytest

from benchmarks import kernels

# (recipe, scaling) -> most launches per linear forward+backward, most full-size passes
BUDGET = {
    ("tensorwise", "delayed"): (7, 7),
    ("tensorwise", "current"): (9, 9),
    ("rowwise", "delayed"): (9, 9),
    ("blockwise", "delayed"): (7, 7),
}


def _slopes(level, recipe="tensorwise", kind="delayed"):
    small = kernels.measure(level, kernels.SMALL, recipe, kind)
    large = kernels.measure(level, kernels.LARGE, recipe, kind)
    return {part: kernels._slope(small, large, part) for part in ("forward", "backward", "step")}, small, large


@pytest.mark.parametrize("recipe,kind", list(BUDGET))
def test_fp8_linear_launches_per_recipe(recipe, kind):
    slopes, _, _ = _slopes("O2", recipe, kind)
    launches = slopes["forward"]["launches"] + slopes["backward"]["launches"]
    passes = slopes["forward"]["full_size_passes"] + slopes["backward"]["full_size_passes"]
    most_launches, most_passes = BUDGET[(recipe, kind)]
    assert launches <= most_launches, (launches, slopes["forward"]["by_op"], slopes["backward"]["by_op"])
    assert passes <= most_passes, (passes, slopes["forward"]["by_op"], slopes["backward"]["by_op"])
    # no 0-d scale math, no abs+amax pairs, no full-size copies left in the per-linear path
    per_linear_ops = set(slopes["forward"]["by_op"]) | set(slopes["backward"]["by_op"])
    assert not per_linear_ops & {"aten.abs", "aten.amax", "aten.clone", "aten._to_copy", "aten.reciprocal",
                                 "aten.log2", "aten.exp2", "aten.where"}, per_linear_ops
    # the optimizer step (O2, multi-tensor) costs nothing more per linear, the weights' transposes included (rowwise:
    # the weight's per-input-channel copy, one kernel per weight); block-scaled weights still take the per-parameter
    # O2 update (docs/gpu.md), so the flat step is held for tensor-wise weights
    if recipe == "tensorwise":
        assert slopes["step"]["launches"] == 0, slopes["step"]["by_op"]
    elif recipe == "rowwise":
        assert slopes["step"]["by_op"].get("fp8lm.quantize_cols_t.default") == 1, slopes["step"]["by_op"]


def test_bf16_reference_is_three_launches():
    slopes, _, _ = _slopes("bf16")
    assert slopes["forward"]["launches"] + slopes["backward"]["launches"] == 3


def test_o1_step_grows_only_by_torch_adamw():
    slopes, _, large = _slopes("O1")
    bf16, _, _ = _slopes("bf16")
    assert slopes["step"]["launches"] <= bf16["step"]["launches"], (slopes["step"]["by_op"], bf16["step"]["by_op"])
    assert slopes["forward"]["launches"] + slopes["backward"]["launches"] <= BUDGET[("tensorwise", "delayed")][0]


def test_megatron_layers_and_tensor_parallel_linears():
    """pretrain_gpt.py's GPT per rank (benchmarks/kernels_megatron.py: TP1 on one process, TP2 with sequence
    parallelism on two): each FP8 tensor-parallel linear alone within 16 launches forward+backward (the FP8 all-gather
    and reduce-scatter of sequence parallelism included: the cast agreed over the group, then one fused cast and one
    fused epilogue), and a whole FP8 O2 transformer layer within 1.7x BF16's launches."""
    from benchmarks import kernels_megatron

    result = kernels_megatron.run()
    for layout in ("TP1", "TP2+SP"):
        for name, counts in result[layout]["linears"]["fp8"].items():
            assert counts["total"] <= 16, (layout, name, counts)
        per_layer = {level: result[layout]["layer"][level]["per_layer"]["iteration"] for level in ("none", "O2")}
        assert per_layer["O2"] <= 1.7 * per_layer["none"], (layout, per_layer)
        assert result[layout]["layer"]["O2"]["per_layer"]["optimizer step"] == 0  # multi-tensor: flat in the layers
