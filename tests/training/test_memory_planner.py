"""tools/memory_planner.py: parameter counts, model-state bytes against fp8.memory_report, activations
against the bytes autograd saves, monotonicity across levels and layouts, errors, the CLI."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks import planner_validation as pv
from fp8.testing import GPTConfig, TinyGPT
from benchmarks.figure1 import largest_model
from megatron.training.planning.memory_plan import STATE_CATEGORIES
from tools.memory_planner import CATEGORIES, PlannerConfig, plan_memory, whole_tensor_partition

ROOT = Path(__file__).resolve().parents[2]


def gpt(**kw) -> PlannerConfig:
    base = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, seq_length=2048, vocab_size=50257, bf16=True)
    return PlannerConfig(**{**base, **kw})


def analytic_params(L: int, h: int, V: int, s: int, untied: bool = False) -> int:
    """Megatron GPT with LayerNorm, biases, learned positions: 12 L h^2 + 13 L h + (V + s) h + 2 h (+ V h)."""
    return 12 * L * h * h + 13 * L * h + (V + s) * h + 2 * h + (V * h if untied else 0)


@pytest.mark.parametrize("L,h,heads,expected_billions", [(12, 768, 12, 0.125), (32, 4096, 32, 6.7),
                                                           (40, 5120, 40, 12.9), (96, 12288, 96, 174.6)])
def test_gpt3_parameter_counts_match_the_analytic_formula(L, h, heads, expected_billions):
    plan = plan_memory(gpt(num_layers=L, hidden_size=h, num_attention_heads=heads))
    assert plan["params_total"] == analytic_params(L, h, 50304, 2048)  # 50257 padded to a multiple of 128
    assert plan["params_total"] / 1e9 == pytest.approx(expected_billions, rel=0.01)


def test_params_per_gpu_split_over_tensor_and_pipeline_parallel():
    L, h, V, s = 96, 12288, 51200, 2048  # TP 8: the vocabulary is padded to a multiple of 128 x 8
    plan = plan_memory(gpt(num_layers=L, hidden_size=h, num_attention_heads=96, tensor_model_parallel_size=8,
                           pipeline_model_parallel_size=4, data_parallel_size=2))
    layer_tp = (12 * h * h + 7 * h) // 8 + 6 * h  # split weights/column biases; proj/fc2 biases and norms replicated
    first = 24 * layer_tp + V // 8 * h + s * h
    last = 24 * layer_tp + 2 * h + V // 8 * h  # final norm + Megatron's copy of the tied embedding
    assert [st["params"] for st in plan["stages"]] == [first, 24 * layer_tp, 24 * layer_tp, last]
    assert plan["params_per_gpu"] == max(first, last)
    assert plan["params_total"] == analytic_params(L, h, V, s)


@pytest.mark.parametrize("swiglu,norm", [(False, "LayerNorm"), (True, "RMSNorm")])
def test_params_match_a_real_model(swiglu, norm):
    """A TinyGPT (LayerNorm, GELU) counted exactly; SwiGLU/RMSNorm/rope/untied against the formula."""
    model = TinyGPT(GPTConfig(vocab_size=256, seq_len=64, n_layer=3, d_model=96, n_head=4))
    cfg = PlannerConfig(num_layers=3, hidden_size=96, num_attention_heads=4, seq_length=64, vocab_size=256,
                        untie_embeddings_and_output_weights=True, swiglu=swiglu, normalization=norm,
                        position_embedding_type="rope" if swiglu else "learned_absolute")
    plan = plan_memory(cfg)
    if not swiglu:
        assert plan["params_total"] == plan["params_per_gpu"] == sum(p.numel() for p in model.parameters())
    else:
        h, f, L, V = 96, 384, 3, 256
        per_layer = h + 3 * h * h + 3 * h + h * h + h + h + 2 * f * h + 2 * f + f * h + h
        assert plan["params_total"] == L * per_layer + V * h + h + V * h


def test_grouped_query_attention_shrinks_qkv():
    h, heads, groups, L = 1024, 16, 4, 2
    full = plan_memory(gpt(num_layers=L, hidden_size=h, num_attention_heads=heads, tensor_model_parallel_size=2))
    gqa = plan_memory(gpt(num_layers=L, hidden_size=h, num_attention_heads=heads, num_query_groups=groups,
                          tensor_model_parallel_size=2))
    kv_saved = 2 * (heads - groups) * (h // heads)  # fewer k and v rows (and bias entries) per layer
    assert full["params_total"] - gqa["params_total"] == L * kv_saved * (h + 1)
    assert gqa["bytes"]["activations"] < full["bytes"]["activations"]
    with pytest.raises(ValueError, match="--num-query-groups 3"):
        gpt(num_query_groups=3)


@pytest.fixture(scope="module")
def tiny_case():
    return pv.small_cases()[0]


@pytest.mark.parametrize("level", ["none", "none-bf16", "O1", "O2", pv.SCALED_MM])
def test_model_state_bytes_match_memory_report(tiny_case, level):
    rows = pv.validate_case(tiny_case, levels=(level,))
    state = [r for r in rows if not r["what"].startswith("activations")]
    assert {r["what"] for r in state} == {*pv.STATE_KEYS, "model state"}
    for row in state:
        assert row["planned"] == pytest.approx(row["measured"], rel=0.01, abs=64), row
    transposes = next(r for r in state if r["what"] == "weight_transposes")
    if level == pv.SCALED_MM:  # the hardware GEMM (CPU torch._scaled_mm): 1 B per FP8 weight element + its scale_inv
        assert transposes["measured"] == transposes["planned"] > plan_memory(
            replace(tiny_case.planner, fp8_opt_level="O2"))["fp8_params_per_gpu"] > 0
    else:  # the emulated GEMM (the CPU default) keeps none
        assert transposes["measured"] == transposes["planned"] == 0
    for row in rows:
        if row["what"].startswith("activations"):
            assert row["planned"] == pytest.approx(row["measured"], rel=0.02), row


def test_o3_model_state_matches_two_gloo_ranks():
    rows = pv.validate_o3(0, 2, factory="benchmarks.planner_validation:small_cases")
    assert len(rows) == len(pv.STATE_KEYS) + 1
    for row in rows:
        assert row["planned"] == pytest.approx(row["measured"], rel=0.01, abs=64), row


def test_o3_partition_is_the_engines(seed):
    from fp8.optim.partition import partition_by_size

    gen = torch.Generator().manual_seed(seed)
    for world in (2, 3, 8):
        sizes = torch.randint(1, 5000, (60,), generator=gen).tolist() + [4096] * 6
        owners, loads = whole_tensor_partition(sizes, world)
        ref = partition_by_size(sizes, world)
        assert owners == list(ref.owners) and loads == ref.loads()


def _state(plan: dict) -> int:
    return sum(plan["bytes"][c] for c in STATE_CATEGORIES)


def test_levels_shrink_model_state_and_o3_shrinks_with_dp():
    plans = {level: plan_memory(gpt(fp8_opt_level=level, data_parallel_size=8)) for level in ("none", "O1", "O2", "O3")}
    assert _state(plans["O3"]) < _state(plans["O2"]) < _state(plans["O1"]) < _state(plans["none"])
    assert plans["O2"]["total_bytes"] < plans["none"]["total_bytes"]
    assert plans["none"]["model_state_bytes_per_param"] == pytest.approx(16.0, abs=0.01)
    # 7 B per FP8-layer parameter, and 1 more for the weight transposes a GPU's hardware GEMM keeps
    assert plans["O2"]["model_state_bytes_per_param"] == pytest.approx(8.1, abs=0.2)
    assert plan_memory(gpt(fp8_opt_level="O2", data_parallel_size=8, gemm_device="cpu"))[
        "model_state_bytes_per_param"] == pytest.approx(7.1, abs=0.2)
    o3 = [_state(plan_memory(gpt(fp8_opt_level="O3", data_parallel_size=dp))) for dp in (1, 2, 4, 8, 16)]
    assert o3 == sorted(o3, reverse=True) and len(set(o3)) == 5
    assert o3[0] == _state(plan_memory(gpt(fp8_opt_level="O2", data_parallel_size=1)))  # one rank: O3 is O2
    # The FP16 sums of the accumulation window (the default): 2 B per FP8 element (+ a scale per tensor) less the
    # step's E4M3 gradient (+ scale) on every rank at DP > 1, counted with the activations; none at one rank (the
    # sum is the step's gradient).
    o2 = plans["O2"]
    n_fp8 = o2["fp8_params_per_gpu"]
    assert o2["bytes"]["gradient_accumulation"] == pytest.approx(1 * n_fp8, rel=1e-4)
    assert o2["total_bytes"] == _state(o2) + max(
        o2["bytes"]["activations"] + o2["bytes"]["communication_buffers"] + o2["bytes"]["gradient_accumulation"],
        o2["bytes"]["step_transients"])
    o3_dp8 = plans["O3"]["bytes"]["gradient_accumulation"]
    assert 1 * n_fp8 < o3_dp8 < 2 * n_fp8  # the worst rank owns only some of the E4M3 gradients
    one = plan_memory(gpt(fp8_opt_level="O2", data_parallel_size=1))
    assert one["bytes"]["gradient_accumulation"] == 0 and one["bytes"]["gradients"] >= 2 * n_fp8
    fp32_sum = plan_memory(gpt(fp8_opt_level="O2", data_parallel_size=8, grad_accumulation="fp32"))
    assert fp32_sum["bytes"]["gradient_accumulation"] == pytest.approx(3 * n_fp8, rel=1e-4)
    fp8_sum = plan_memory(gpt(fp8_opt_level="O2", data_parallel_size=8, grad_accumulation="fp8"))
    assert fp8_sum["bytes"]["gradient_accumulation"] == 0 and _state(fp8_sum) == _state(o2)


def test_sequence_parallel_recompute_and_pipeline_shape_activations():
    tp2 = gpt(tensor_model_parallel_size=2, fp8_opt_level="O2")
    act = lambda cfg: plan_memory(cfg)["bytes"]["activations"]  # noqa: E731
    assert act(replace(tp2, sequence_parallel=True)) < act(tp2) < act(replace(tp2, tensor_model_parallel_size=1))
    assert act(replace(tp2, recompute_granularity="full")) < act(tp2) / 4
    assert act(replace(tp2, micro_batch_size=2)) == pytest.approx(2 * act(tp2), rel=1e-6)
    assert act(gpt(fp8_opt_level="O2")) < act(gpt())  # FP8 linears save E4M3 inputs
    pp = plan_memory(gpt(pipeline_model_parallel_size=4, fp8_opt_level="O2"))
    stage_act = [s["bytes"]["activations"] for s in pp["stages"]]
    assert stage_act[0] > stage_act[1] > stage_act[2]  # 1F1B: 4, 3, 2 micro-batches in flight
    few = plan_memory(gpt(pipeline_model_parallel_size=4, fp8_opt_level="O2", global_batch_size=2))
    assert few["stages"][0]["bytes"]["activations"] < stage_act[0]  # only 2 micro-batches per step
    vpp = plan_memory(gpt(pipeline_model_parallel_size=4, num_layers_per_virtual_pipeline_stage=2, fp8_opt_level="O2"))
    assert vpp["stages"][0]["bytes"]["activations"] > stage_act[0]  # interleaving holds more on stage 0


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_attention_heads=32, tensor_model_parallel_size=3), "--tensor-model-parallel-size 3"),
    (dict(num_layers=30, pipeline_model_parallel_size=4), "--pipeline-model-parallel-size 4"),
    (dict(hidden_size=4000, num_attention_heads=48), "--num-attention-heads 48"),
    (dict(hidden_size=1000, num_attention_heads=8, fp8_opt_level="O2"), "multiples of 16"),
    (dict(fp8_opt_level="O4"), "none|O1|O2|O3"),
    (dict(global_batch_size=100, data_parallel_size=8), "--global-batch-size"),
    (dict(num_layers_per_virtual_pipeline_stage=2), "--pipeline-model-parallel-size > 1"),
    (dict(seq_length=4096, max_position_embeddings=2048), "--max-position-embeddings"),
    (dict(use_distributed_optimizer=True, fp8_opt_level="O2"), "O3"),
    (dict(tensor_model_parallel_size=0), "tensor_model_parallel_size"),
])
def test_bad_configurations_name_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("|", r"\|").replace("+", r"\+")):
        gpt(**kwargs)


def test_from_args_takes_pretrain_gpt_namespace(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "16")
    ns = argparse.Namespace(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1000,
                            ffn_hidden_size=None, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                            recompute_activations=True, fp8_opt_level="O3", bf16=True, data_parallel_size=None,
                            lr=1e-4, dry_run=True)
    cfg = PlannerConfig.from_args(ns)
    assert (cfg.data_parallel_size, cfg.recompute_granularity, cfg.ffn_hidden_size, cfg.padded_vocab_size) == (4, "full", 1024, 1024)
    assert PlannerConfig.from_args(ns, data_parallel_size=2).data_parallel_size == 2
    with pytest.raises(ValueError, match="--vocab-size or --tokenizer-model"):
        PlannerConfig.from_args(argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=16))


def test_cli_json_and_errors():
    flags = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8", "--seq-length", "128",
             "--vocab-size", "1000", "--fp8-opt-level", "O2", "--bf16", "--data-parallel-size", "2", "--lr", "1e-4"]
    out = subprocess.run([sys.executable, "tools/memory_planner.py", *flags, "--json"], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    plan = json.loads(out.stdout)
    assert set(plan["bytes"]) == set(CATEGORIES)
    assert plan["params_per_gpu"] == plan_memory(replace(gpt(num_layers=4, hidden_size=256, num_attention_heads=8,
                                                             seq_length=128, vocab_size=1000, fp8_opt_level="O2",
                                                             data_parallel_size=2)))["params_per_gpu"]
    bad = subprocess.run([sys.executable, "tools/memory_planner.py", *flags, "--tensor-model-parallel-size", "3"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "--tensor-model-parallel-size 3" in bad.stderr


def test_figure1_fp8_fits_larger_models(tmp_path):
    sizes = {level: largest_model(8, level)[1]["params_total"] for level in ("none", "O2")}
    assert sizes["O2"] > 1.8 * sizes["none"]
    out = subprocess.run([sys.executable, "benchmarks/figure1.py", "--gpus", "8",
                          "--output", str(tmp_path / "fig")], cwd=ROOT, capture_output=True, text=True, check=True)
    assert "| 8 |" in out.stdout
    assert (tmp_path / "fig.png").stat().st_size > 0 and json.loads((tmp_path / "fig.json").read_text())


def test_recipes_and_activation_compression_match_the_planner():
    """One process, hidden 128 (blockwise tiles every linear): the scale grids of each recipe (weights: model
    state; saved FP8 inputs: activations) and what --fp8-activations stores, planned as measured (the tracker
    packs with the model's compressor), with and without recomputation."""
    model = ["--hidden-size", "128", "--ffn-hidden-size", "512"]
    cases = [{"name": recipe, "flags": [*model, "--fp8-recipe", recipe], "levels": ["O2"], "recompute": [False]}
             for recipe in ("rowwise", "blockwise", "mxfp8")]
    # every layer in NVFP4: the planner plans each layer in the run's recipe (it does not model high-precision layers)
    cases += [{"name": "nvfp4", "flags": [*model, "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4",
                                          "--num-layers-at-end-in-bf16", "0"], "levels": ["O2"], "recompute": [False]}]
    cases += [{"name": f"{level} act", "flags": [*model, "--fp8-recipe", "blockwise", "--fp8-activations"],
               "levels": [level], "recompute": [False, True]} for level in ("none", "O2")]
    rows = pv.validate_megatron(1, cases, timeout=300)
    assert {r["what"] for r in rows} >= {"model state", "activations (recompute none)", "activations (recompute full)"}
    for row in rows:
        # Measured: exact but for a few scalars (<= 68 bytes)
        assert row["planned"] == pytest.approx(row["measured"], rel=1e-4, abs=128), row


def test_megatron_gpt_tp2_sp_matches_planner_on_every_rank():
    """megatron-core GPTModel built by fp8lm at TP=2 + SP on two gloo ranks (one launch): the planner's model
    state per category matches fp8.memory_report exactly (rel 1e-4), activations (peak of saved bytes over
    the step, with and without recomputation) within 0.1% (position ids and scalars are not modelled)."""
    rows = pv.validate_megatron(2, [
        {"name": "tp2sp", "layout": "TP=2+SP", "flags": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
         "levels": ["O2"], "recompute": [False, True]},
        {"name": "tp2sp", "layout": "TP=2+SP", "flags": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
         "levels": ["none"], "recompute": [False]},
        {"name": "tp2sp blockwise+act", "layout": "TP=2+SP", "levels": ["O2"], "recompute": [False, True],
         "flags": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--hidden-size", "256",
                   "--ffn-hidden-size", "512", "--fp8-recipe", "blockwise", "--fp8-activations"]},
        # the hardware GEMM (CPU torch._scaled_mm): each FP8 weight keeps its transpose (rowwise: re-quantized per
        # input channel, with its scales)
        *({"name": f"tp2sp scaled_mm {recipe}", "layout": "TP=2+SP", "levels": ["O2"], "recompute": [False],
           "flags": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--fp8-gemm-backend", "scaled_mm",
                     "--fp8-recipe", recipe]} for recipe in ("tensorwise", "rowwise")),
    ], timeout=300)
    transposes = {(r["case"], r["rank"]): r for r in rows if r["what"] == "weight_transposes"}
    for (case, _), row in transposes.items():
        assert (row["measured"] > 0) == ("scaled_mm" in case or "blockwise" in case), row  # blockwise: scale grids
    # per rank and layer: qkv 64 x 96, proj 32 x 64, fc1 64 x 128, fc2 128 x 64 (in x out), each with a 4 B
    # scale_inv; rowwise: 4 B per input channel (the per-column scales) and per output channel (the forward's scale_inv)
    per_layer = 64 * 96 + 32 * 64 + 64 * 128 + 128 * 64
    assert transposes[("tp2sp scaled_mm tensorwise", 0)]["measured"] == 4 * (per_layer + 4 * 4)
    assert transposes[("tp2sp scaled_mm rowwise", 0)]["measured"] == 4 * (
        per_layer + 4 * (64 + 32 + 64 + 128) + 4 * (96 + 64 + 128 + 64))
    assert {r["rank"] for r in rows} == {0, 1}
    assert {r["what"] for r in rows} >= {*pv.STATE_KEYS, "model state", "activations (recompute none)",
                                         "activations (recompute full)"}
    for row in rows:
        if row["what"] in (*pv.STATE_KEYS, "model state"):
            assert row["planned"] == pytest.approx(row["measured"], rel=1e-4, abs=16), row
        else:  # activations; peak gradients (which also hold the FP8 gradients' fp32 scales)
            assert row["planned"] == pytest.approx(row["measured"], rel=1e-3), row


@pytest.mark.parametrize("variant", [v for v in __import__("benchmarks.activation_memory", fromlist=["VARIANTS"]).VARIANTS],
                         ids=lambda v: v[0].replace(" ", "_"))
def test_planner_matches_a_transformers_llama_forward(variant):
    """``implementation="transformers"``: the planner's activations of a transformers Llama (what its RMSNorm, SwiGLU,
    attention and loss save, compressed or not) vs the bytes the engine's ledger counts after its forward."""
    pytest.importorskip("transformers")
    from benchmarks import activation_memory as am

    args = argparse.Namespace(hidden=256, intermediate=768, heads=4, layers=2, batch=1, seq=256, vocab=384,
                              attn="sdpa")
    row = am.measure(args, *variant)
    # Measured: within 36 bytes (the 0-d loss and scaling scalars) at hidden 512, 2 x 1024 tokens.
    assert row["planned_bytes"] == pytest.approx(row["held_bytes"], rel=1e-3, abs=256), row


def test_transformers_implementation_is_refused_for_other_models():
    with pytest.raises(ValueError, match="implementation='transformers' models transformers' LlamaForCausalLM"):
        PlannerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, implementation="transformers")
    with pytest.raises(ValueError, match="implementation must be one of"):
        PlannerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, implementation="hf")


def _cli_plan(*flags: str) -> dict:
    out = subprocess.run([sys.executable, "tools/memory_planner.py", "--num-layers", "2", "--hidden-size", "64",
                          "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "100", "--json", *flags],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_planner_flags_mean_what_pretrain_gpts_mean():
    """--bf16 is pretrain_gpt.py's (FP32 main gradients at none: 18 B/param, not FP8-LM's 16), and --fp8-min-dim
    keeps the same linears in high precision as the model: each layer's four linears (64x192, 64x64, 64x256,
    256x64) are FP8 at 0, none at 2048."""
    assert _cli_plan("--bf16")["model_state_bytes_per_param"] == pytest.approx(18.0, abs=0.01)
    per_layer = 64 * 192 + 64 * 64 + 64 * 256 + 256 * 64
    assert _cli_plan("--fp8-opt-level", "O2", "--fp8-min-dim", "0")["fp8_params_per_gpu"] == 2 * per_layer
    assert _cli_plan("--fp8-opt-level", "O2", "--fp8-min-dim", "2048")["fp8_params_per_gpu"] == 0
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.planning.memory_plan import PlannerConfig

    for min_dim in (0, 2048):  # pretrain_gpt.py's arguments plan the same
        args = validate_args(parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                                         "--seq-length", "32", "--vocab-size", "100", "--mock-data", "--bf16",
                                         "--fp8-min-dim", str(min_dim)]), world_size=1)
        assert PlannerConfig.from_args(args).min_fp8_dim == min_dim
        assert PlannerConfig.from_args(args).fp32_grads is False  # O2: FP8 levels keep their own gradients


def test_weight_transposes_are_planned_where_the_hardware_gemm_keeps_them():
    """The weights' GEMM operands kept between steps (fp8.quantizers, fp8.Float8Tensor.transpose_cache): the transposed
    FP8 weight, 1 B per element, and its 4 B scale_inv on a GPU (the default plan: 6 GiB at 7B) and with
    --fp8-gemm-backend scaled_mm anywhere; none on the CPU's emulated GEMM or with the emulated backend; under
    blockwise only the scale_inv grid (4 B per 128 x 128 block, the block GEMM reads the weight as it is); rowwise adds
    4 B per input and per output channel; every O3 rank keeps all of its FP8 weights'."""
    o2 = gpt(fp8_opt_level="O2", data_parallel_size=8)
    plan = plan_memory(o2)
    n_fp8 = plan["fp8_params_per_gpu"]
    n_weights = 32 * 4  # qkv, proj, fc1, fc2 per layer
    assert n_fp8 == 32 * 12 * 4096 * 4096
    assert plan["bytes"]["weight_transposes"] == n_fp8 + 4 * n_weights  # 6.0 GiB
    assert round(plan["bytes"]["weight_transposes"] / 2**30, 3) == 6.0
    assert plan["total_bytes"] == plan_memory(replace(o2, gemm_device="cpu"))["total_bytes"] + n_fp8 + 4 * n_weights
    for other in (replace(o2, gemm_device="cpu"), replace(o2, fp8_gemm_backend="emulated"),
                  replace(o2, fp8_opt_level="none")):
        assert plan_memory(other)["bytes"]["weight_transposes"] == 0, other
    assert plan_memory(replace(o2, fp8_recipe="blockwise"))["bytes"]["weight_transposes"] == 4 * n_fp8 // 128 ** 2
    assert plan_memory(replace(o2, gemm_device="cpu", fp8_gemm_backend="scaled_mm"))["bytes"][
        "weight_transposes"] == n_fp8 + 4 * n_weights
    inputs = 32 * (4096 + 4096 + 4096 + 16384)  # qkv, proj, fc1, fc2 input channels
    outputs = 32 * (12288 + 4096 + 16384 + 4096)
    assert plan_memory(replace(o2, fp8_recipe="rowwise"))["bytes"]["weight_transposes"] == \
        n_fp8 + 4 * inputs + 4 * outputs
    o3 = plan_memory(replace(o2, fp8_opt_level="O3"))
    assert all(rank["weight_transposes"] == n_fp8 + 4 * n_weights for rank in o3["stages"][0]["dp_rank_bytes"])
    assert o3["model_state_bytes_per_param"] > plan_memory(replace(o2, fp8_opt_level="O3", gemm_device="cpu"))[
        "model_state_bytes_per_param"]
    moe = gpt(num_layers=4, fp8_opt_level="O2", data_parallel_size=8, num_experts=8, expert_model_parallel_size=8,
              add_bias_linear=False)
    dense = 4 * (4096 * 12288 + 4096 * 4096 + 2 * 4)  # attention keeps its transposes either way
    expert = 4 * 2 * (4096 * 16384 + 4)  # one expert per rank (EP 8): fc1, fc2
    assert plan_memory(moe)["bytes"]["weight_transposes"] == dense + expert
    # grouped experts keep theirs too, and on a GPU the grouped forward GEMM's stack (1 B/element + 4 B per output)
    stacked = 4 * (4096 * 16384 + 4 * 16384 + 16384 * 4096 + 4 * 4096)
    assert plan_memory(replace(moe, moe_grouped_gemm=True))["bytes"]["weight_transposes"] == dense + expert + stacked
    with pytest.raises(ValueError, match="--moe-grouped-gemm runs each expert unsplit"):
        replace(moe, moe_grouped_gemm=True, tensor_model_parallel_size=2, sequence_parallel=True)
    with pytest.raises(ValueError, match=re.escape("--fp8-gemm-backend must be one of auto|scaled_mm|emulated")):
        replace(o2, fp8_gemm_backend="cublas")
