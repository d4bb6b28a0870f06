"""pretrain_gpt.py --fp8-gemm-backend {auto,scaled_mm,emulated}: the command-line face of
``Float8LinearConfig.gemm_backend``, on every FP8 linear the run builds (dense, tensor-parallel, per-layer rules,
experts, grouped experts); ``scaled_mm`` refused at start-up (and in ``--dry-run``) where a GEMM cannot take it,
naming the layer and the shape; on CPU a ``scaled_mm`` run trains, bit-identical to the emulated one."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron.training.arguments import ConfigurationError, build_parser, parse_args, parse_config, validate_args

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--micro-batch-size", "2", "--mock-data", "--vocab-size", "256", "--no-progress"]


def _run(args, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_flag_and_its_choices_are_the_engines():
    from fp8.gemm import GEMM_BACKENDS
    from megatron.training.config_rules import GEMM_BACKENDS as FLAG_CHOICES

    assert FLAG_CHOICES == GEMM_BACKENDS
    text = build_parser().format_help()
    assert "--fp8-gemm-backend {auto,scaled_mm,emulated}" in text
    proc = _run(["pretrain_gpt.py", "--help"])
    assert proc.returncode == 0 and "--fp8-gemm-backend" in proc.stdout
    with pytest.raises(SystemExit):
        parse_args(["--fp8-gemm-backend", "cublas"])


@pytest.mark.parametrize("backend", ["auto", "scaled_mm", "emulated"])
def test_the_flag_reaches_the_recipe_and_the_planner(backend):
    from megatron.training.model import fp8_recipe_from_args
    from megatron.training.planning.memory_plan import PlannerConfig

    config = parse_config([*SMALL, "--fp8-gemm-backend", backend], world_size=1)
    assert fp8_recipe_from_args(config).gemm_backend == backend
    assert PlannerConfig.from_run_config(config).fp8_gemm_backend == backend
    default = parse_config(SMALL, world_size=1)
    assert default.precision.fp8_gemm_backend == "auto" and fp8_recipe_from_args(default).gemm_backend == "auto"


_BUILD = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, ".")
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from megatron.core import parallel_state
    from megatron.training.arguments import parse_config
    from megatron.training.model import build_model, fp8_linear_shapes, transformer_config_from_args
    from megatron.training.moe_grouped import FP8GroupedMLP
    from megatron.training.training import initialize_model_parallel
    from fp8.parallel.linear import ParallelLinearBase
    flags, world = json.loads(sys.argv[1]), int(sys.argv[2])
    cfg = parse_config(flags, world_size=world)
    expected = [(l.name, l.in_features, l.out_features, l.config.recipe, l.config.gemm_backend)
                for l in fp8_linear_shapes(cfg)]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    initialize_model_parallel(cfg.parallel, create_gloo_process_groups=False)
    with torch.device("meta"):
        chunks = build_model(cfg, transformer_config_from_args(cfg, torch.float32), 256)
    built, grouped = [], []
    for name, m in chunks[0].named_modules():
        if isinstance(m, ParallelLinearBase) and m.fp8 is not None:
            out_f, in_f = m.weight.shape
            built.append((name, in_f, out_f, m.fp8.recipe, m.fp8.gemm_backend))
        if isinstance(m, FP8GroupedMLP):
            grouped += [fp8.gemm_backend for fp8 in (m.fc1_fp8, m.fc2_fp8) if fp8 is not None]
    print("RESULT " + json.dumps({"expected": expected, "built": built, "grouped": grouped}))
""")


def _built(flags, world=1):
    proc = _run(["-c", _BUILD, json.dumps(flags), str(world)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def _expert_pattern(name: str) -> str:
    return re.sub(r"\.local_experts\.\d+\.", ".local_experts.*.", name)


@pytest.mark.parametrize("extra,world", [
    ([], 1),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--swiglu", "--fp8-recipe", "rowwise"], 2),
    (["--num-experts", "4", "--swiglu", "--disable-bias-linear", "--moe-shared-expert-intermediate-size", "64",
      "--first-last-layers-bf16", "--num-layers", "3", "--hidden-size", "128", "--fp8-recipe", "blockwise"], 1),
    (["--num-experts", "4", "--moe-grouped-gemm"], 1),
    (["--num-experts", "2", "--hidden-size", "128", "--moe-ffn-hidden-size", "64", "--fp8-min-dim", "128",
      "--disable-bias-linear", "--moe-shared-expert-intermediate-size", "256"], 1),
], ids=["dense", "tp2-sp-rowwise", "moe-shared-bf16-layers-blockwise", "moe-grouped", "moe-min-dim"])
def test_every_fp8_linear_the_model_builds_takes_the_backend(extra, world):
    """The built model (every pipeline stage here has all layers) against ``fp8_linear_shapes``, the check's view of
    the run: the same FP8 linears, local shapes, recipes (blockwise falls back where a shard does not tile) and
    backend, experts and grouped experts included."""
    result = _built([*SMALL, *extra, "--fp8-gemm-backend", "emulated"], world)
    built = sorted({(_expert_pattern(n), *rest) for n, *rest in result["built"]})
    assert sorted(map(tuple, result["expected"])) == built and built
    assert {b for *_, b in built} == {"emulated"}
    if "--moe-grouped-gemm" in extra:
        assert result["grouped"] and set(result["grouped"]) == {"emulated"}
    if "--fp8-min-dim" in extra:  # the experts (64 features) stay in high precision, the shared expert does not
        assert not any("local_experts" in n for n, *_ in built) and any("shared_experts" in n for n, *_ in built)
    if "--first-last-layers-bf16" in extra:  # only the middle layer in FP8, its experts and shared expert included
        assert {n.split(".")[2] for n, *_ in built} == {"1"}
        assert any(".local_experts.*." in n for n, *_ in built) and any("shared_experts" in n for n, *_ in built)


NO_TRITON = ("cuda", (9, 0), False)  # an H100/H200 without Triton: no block-scaled GEMM on the hardware


@pytest.fixture
def pretrain_gpt():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_main", ROOT / "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_refused_gemm_names_the_layer_and_the_shape(monkeypatch, pretrain_gpt, capsys):
    """--fp8-gemm-backend scaled_mm on a device whose hardware GEMMs cannot take some of the run's GEMMs (here a
    compute-capability 9.0 GPU without Triton: the blockwise recipe's GEMMs whose scales vary along K) stops at
    start-up and in --dry-run, exit status 2, naming each layer with its GEMM and shape and the fix."""
    from fp8.gemm import GemmTarget
    from megatron.training import model

    monkeypatch.setattr(model, "gemm_target", lambda: GemmTarget(*NO_TRITON))  # the run's device, as decided
    flags = [*SMALL, "--hidden-size", "128", "--fp8-recipe", "blockwise", "--fp8-gemm-backend", "scaled_mm"]
    with pytest.raises(ConfigurationError) as error:
        validate_args(parse_args(flags), world_size=1)
    message = str(error.value)
    assert "this machine's device (a CUDA GPU of compute capability (9, 0) without Triton)" in message
    assert "decoder.layers.0.self_attention.linear_qkv and 1 more layer(s) of that shape" in message
    assert "(in_features=128, out_features=384 per rank, blockwise recipe): input gradient dX = dY @ W, " \
           "M x K x N = 64 x 384 x 128, scale blocks (1, 128) x (128, 128)" in message
    assert "decoder.layers.0.mlp.linear_fc2" in message and "needs Triton: pip install triton" in message
    assert "linear_proj" not in message  # K = 128: one block along K, the row-wise torch._scaled_mm takes it
    assert "use --fp8-gemm-backend auto" in message
    for ok in ("auto", "emulated"):  # nothing is refused: auto and emulated take the emulation where they must
        validate_args(parse_args([*flags[:-1], ok]), world_size=1)
    for extra in (["--dry-run"], ["--train-iters", "1"]):  # before anything is built or trained
        capsys.readouterr()
        assert pretrain_gpt.main([*flags, *extra]) == 2
        err = capsys.readouterr()
        assert "configuration error: --fp8-gemm-backend scaled_mm" in err.err
        assert "M x K x N = 64 x 384 x 128" in err.err and "dry run" not in err.out and "iter" not in err.out


def test_the_check_decides_for_the_runs_device():
    """The same run decided for other targets (fp8.gemm.GemmTarget): an H100/H200 with Triton takes every blockwise
    GEMM (the Triton block GEMM), one without Triton refuses the block-scaled ones, naming the fix."""
    from fp8.gemm import GemmTarget
    from megatron.training.model import check_gemm_backend, gemm_backend_problems, gemm_target

    config = parse_config([*SMALL, "--hidden-size", "128", "--fp8-recipe", "blockwise"], world_size=1)
    assert gemm_target() == GemmTarget("cpu")
    assert gemm_backend_problems(config, GemmTarget("cuda", (9, 0), triton=True), "scaled_mm") == []
    problems = gemm_backend_problems(config, GemmTarget("cuda", (9, 0), triton=False), "scaled_mm")
    assert problems and all("needs Triton: pip install triton" in p for p in problems)
    config = config.replace(precision={"fp8_gemm_backend": "scaled_mm"})
    with pytest.raises(ConfigurationError, match=r"a CUDA GPU of compute capability \(9, 0\) without Triton"):
        check_gemm_backend(config, GemmTarget("cuda", (9, 0), triton=False))
    for recipe in ("tensorwise", "rowwise"):  # every GEMM of these recipes runs torch._scaled_mm, CPU and GPU alike
        other = parse_config([*SMALL, "--fp8-recipe", recipe], world_size=1)
        for target in (GemmTarget("cpu"), GemmTarget("cuda", (9, 0), triton=False)):
            assert gemm_backend_problems(other, target, "scaled_mm") == [], (recipe, target)


_TRAIN = textwrap.dedent("""
    import json, sys, warnings
    warnings.filterwarnings("ignore")
    sys.path.insert(0, ".")
    from megatron.training.arguments import parse_config
    from megatron.training import training
    flags = json.loads(sys.argv[1])
    out = {}
    for backend in ("emulated", "scaled_mm"):
        history = training.pretrain(parse_config(flags + ["--fp8-gemm-backend", backend]))[-1]
        out[backend] = {"loss": [r["loss"] for r in history["train"]],
                        "transposes": history["summary"]["memory"].get("weight transposes", 0)}
    print("RESULT " + json.dumps(out))
""")


def test_a_scaled_mm_run_trains_on_cpu_bit_identical_to_the_emulated_one():
    """A tiny GPT at O2 for three iterations of two micro-batches with the hardware GEMM (CPU torch._scaled_mm) and
    with the emulation: the same losses bit for bit (the measured bound on CPU: the two GEMMs are bit-identical), and
    the hardware GEMM's weights keep their transposes (1 byte per FP8 weight element and a 4-byte scale_inv, in the
    run's memory report)."""
    flags = [*SMALL, "--global-batch-size", "4", "--fp8-opt-level", "O2", "--eval-interval", "0", "--train-iters", "3",
             "--seed", "5"]
    proc = _run(["-c", _TRAIN, json.dumps(flags)])
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert len(out["scaled_mm"]["loss"]) == 3
    assert out["scaled_mm"]["loss"] == out["emulated"]["loss"]
    per_layer = 64 * 192 + 64 * 64 + 64 * 256 + 256 * 64 + 4 * 4  # qkv, proj, fc1, fc2, each with its 4 B scale_inv
    assert out["scaled_mm"]["transposes"] == 2 * per_layer and out["emulated"]["transposes"] == 0
