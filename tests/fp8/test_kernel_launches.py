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
- mxfp8: 7 launches, 7 full-size passes, its Blackwell sequence (the GEMM counted as :func:`fp8.ops.mx_mm`, the
  ``F.scaled_mm`` call's CPU reference): 1x32 and 32x1 tiles of the input and the gradient with both operands'
  swizzled E8M0 scales from one read each (2, :func:`fp8.ops.quantize_mx`), three GEMMs, the weight gradient's two
  kernels; the optimizer step adds 3 per weight (its transpose and its two GEMMs' swizzled scales).
- nvfp4: 13 launches, 13 full-size passes, its Blackwell sequence (the GEMM counted as :func:`fp8.fp4.nvfp4_mm`):
  each of the four activation operands (x and dY, row-wise and, transposed and Hadamard-transformed, column-wise) is
  its amax then one fused pass (:func:`fp8.fp4.nvfp4_quantize`, which also writes the GEMM's swizzled scales: 8),
  three GEMMs, the weight gradient's two kernels; the optimizer step adds 3 per weight (the amax of its E4M3 payload
  and its two NVFP4 copies). Each operand needs its per-tensor amax before its first element is written, as current
  scaling does (the reference quantizers launched 82 and 105 kernels per operand).
- with ``grad_accumulation="fp32"`` (the weight gradient left as the GEMM's fp32 output, as Transformer Engine's
  ``main_grad``): 5 at delayed and 7 at current scaling; the 2-byte gradient's amax and cast are the 2 launches
  between those and the default's 7 and 9.

The optimizer step is flat in the number of linears at O2 and O3 for every recipe (multi-tensor ops; block-scaled
weights quantized from their masters by one op for all), except the row-wise recipe's per-input-channel copy of each
weight (1 per linear), MXFP8's transpose and swizzled scales (3 per linear) and NVFP4's two copies (3 per linear); at O1 it grows by nothing more than torch's own AdamW on the masters: 0 with ``fused=True``, the
2 host reads of each step count with ``foreach=True`` (BF16 pays the same).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import kernels

ROOT = Path(__file__).resolve().parents[2]

# (recipe, scaling) -> most launches per linear forward+backward, most full-size passes
BUDGET = {
    ("tensorwise", "delayed"): (7, 7),
    ("tensorwise", "current"): (9, 9),
    ("rowwise", "delayed"): (9, 9),
    ("blockwise", "delayed"): (7, 7),
    ("mxfp8", "delayed"): (7, 7),
    ("nvfp4", "delayed"): (13, 13),
}
FP32_WGRAD_BUDGET = {"delayed": (5, 5), "current": (7, 7)}
# optimizer-step launches per extra linear, per recipe (rowwise: the weight's per-input-channel copy)
STEP_SLOPE = {"tensorwise": 0, "rowwise": 1, "blockwise": 0, "mxfp8": 3, "nvfp4": 3}


def _slopes(level, recipe="tensorwise", kind="delayed", **kwargs):
    small = kernels.measure(level, kernels.SMALL, recipe, kind, **kwargs)
    large = kernels.measure(level, kernels.LARGE, recipe, kind, **kwargs)
    return {part: kernels.slope(small, large, part) for part in ("forward", "backward", "step")}, small, large


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
    # the optimizer step (O2, multi-tensor) costs nothing more per linear, the weights' operands included (rowwise:
    # the weight's per-input-channel copy, one kernel per weight)
    assert slopes["step"]["launches"] == STEP_SLOPE[recipe], slopes["step"]["by_op"]
    if recipe == "rowwise":
        assert slopes["step"]["by_op"] == {"fp8lm.quantize_cols_t.default": 1}, slopes["step"]["by_op"]
    if recipe == "mxfp8":  # the weight's transpose and its two GEMMs' swizzled E8M0 scales, made in the step
        assert slopes["step"]["by_op"] == {"fp8lm.mx_scales.default": 2, "aten.clone": 1}, slopes["step"]["by_op"]
    if recipe == "nvfp4":  # the weight's two NVFP4 copies from its E4M3 payload: their amax, then one pass each
        assert slopes["step"]["by_op"] == {"fp8lm.nvfp4_amax.default": 1, "fp8lm.nvfp4_quantize.default": 2}, \
            slopes["step"]["by_op"]


@pytest.mark.parametrize("kind", list(FP32_WGRAD_BUDGET))
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp32_weight_gradients_reach_transformer_engines_count(level, kind):
    slopes, _, _ = _slopes(level, "tensorwise", kind, grad_accumulation="fp32")
    launches = slopes["forward"]["launches"] + slopes["backward"]["launches"]
    passes = slopes["forward"]["full_size_passes"] + slopes["backward"]["full_size_passes"]
    assert launches <= FP32_WGRAD_BUDGET[kind][0] and passes <= FP32_WGRAD_BUDGET[kind][1], \
        (slopes["forward"]["by_op"], slopes["backward"]["by_op"])


@pytest.mark.parametrize("recipe", list(STEP_SLOPE))
def test_o1_step_with_fused_adamw_is_flat(recipe):
    """O1 steps torch's AdamW on its masters: with ``fused=True`` nothing per linear but the recipe's own (rowwise: the
    per-input-channel copy); every block-scaled weight refreshed by one op."""
    slopes, small, _ = _slopes("O1", recipe, adamw={"fused": True})
    assert slopes["step"]["launches"] == STEP_SLOPE[recipe], slopes["step"]["by_op"]
    if recipe != "tensorwise":
        assert small["step"][2].get("fp8lm.quantize_weight_blocks_.default") == 1, small["step"][2]


def test_o3_step_is_flat_for_every_recipe():
    """O3 (the sharded optimizer, here in a one-rank gloo group of its own process) runs the same multi-tensor step."""
    code = ("import json, sys; sys.path.insert(0, '.'); from benchmarks import kernels; kernels._one_rank_group(); "
            "print(json.dumps({r: kernels.slope(kernels.measure('O3', kernels.SMALL, r), "
            "kernels.measure('O3', kernels.LARGE, r), 'step') for r in ('tensorwise', 'rowwise', 'blockwise', 'mxfp8', 'nvfp4')}))")
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    slopes = json.loads(done.stdout.strip().splitlines()[-1])
    for recipe, slope in slopes.items():
        assert slope["launches"] == STEP_SLOPE[recipe], (recipe, slope["by_op"])


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
