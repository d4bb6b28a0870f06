"""CUDA-only checks (pytest marker ``gpu``; skipped with a reason on machines without a CUDA GPU).

Run them alone, in their own process, so that Triton compiles real kernels (the CPU kernel tests turn the
Triton interpreter on for the whole process when they are imported)::

    python -m pytest -m gpu tests/e2e/test_gpu.py        # what `make gpu-check` runs

- FP8 GEMM and linear on CUDA against the emulation: bit-exact where ``torch._scaled_mm`` is exact (small
  integer values: every product and partial sum is exact in fp32, whatever the summation order), within
  the fp32 accumulation-order bound elsewhere;
- every Triton kernel against its torch reference on CUDA tensors (the same contracts as tests/fp8/test_kernels.py);
- ``torch.compile(fullgraph=True)`` of a Float8Linear block and of the O2 optimizer step;
- a steady-state O2 step under ``torch.cuda.set_sync_debug_mode("error")`` (any host sync raises);
- ``pretrain_gpt.py`` on NCCL: one step of the training loop (world size 1) at none/O1/O2/O3 with ``--bf16``
  under the same sync check, a full ``pretrain_gpt.py`` run per level, and TP=2 / PP=2 with two GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp8

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def _fp8_gpu() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"FP8 GEMMs need compute capability >= 8.9, this GPU is {torch.cuda.get_device_capability()}")
    return torch.device("cuda", torch.cuda.current_device())


def _real_triton() -> None:
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set (tests/fp8/test_kernels.py sets it): run `pytest -m gpu tests/e2e/test_gpu.py` alone")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16) if t.element_size() == 2 else t


# -- FP8 GEMM and linear --------------------------------------------------------------------------------
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_is_bit_exact_with_the_emulation_on_exact_inputs(gen, out_dtype):
    """Integer payloads in [-4, 4] and power-of-two scales: every product and every partial sum over
    K=256 (|sum| <= 256 * 16 = 2**12) is an integer that even a tensor-core accumulator with ~14 mantissa
    bits (Hopper's FP8 MMA before promotion to fp32) holds exactly, so any summation order gives the same
    value and both paths must give the same bits."""
    from fp8.gemm import fp8_mm_payload

    device = _fp8_gpu()
    m, k, n = 256, 256, 128
    a = torch.randint(-4, 5, (m, k), generator=gen).float().to(torch.float8_e4m3fn).to(device)
    b = torch.randint(-4, 5, (n, k), generator=gen).float().to(torch.float8_e4m3fn).to(device).t()  # column-major
    sa, sb = torch.tensor(0.5, device=device), torch.tensor(4.0, device=device)
    hw = fp8_mm_payload(a, sa, b, sb, out_dtype, backend="scaled_mm")
    em = fp8_mm_payload(a, sa, b, sb, out_dtype, backend="emulated")
    assert torch.equal(_bits(hw), _bits(em))


def test_scaled_mm_matches_the_emulation_within_the_accumulation_bound(gen):
    """Random E4M3 operands: the two paths differ by summation order and accumulator precision only. fp32
    order alone is bounded by K * 2**-24 * sum_k |a_ik b_kj|; Hopper's FP8 MMA keeps ~14 mantissa bits before
    promoting to fp32 (DeepSeek-V3 report, sec. 3.3.2), i.e. up to ~2**-13 relative: bound 2**-11 of the
    magnitude (4x that)."""
    from fp8.gemm import fp8_mm_payload

    device = _fp8_gpu()
    m, k, n = 512, 1024, 256
    a = (torch.randn(m, k, generator=gen) * 50).to(torch.float8_e4m3fn).to(device)
    b = (torch.randn(n, k, generator=gen) * 50).to(torch.float8_e4m3fn).to(device).t()
    sa, sb = torch.tensor(8.0, device=device), torch.tensor(0.25, device=device)
    hw = fp8_mm_payload(a, sa, b, sb, torch.float32, backend="scaled_mm")
    em = fp8_mm_payload(a, sa, b, sb, torch.float32, backend="emulated")
    magnitude = (a.float().abs() / sa) @ (b.float().abs() / sb)
    assert ((hw - em).abs() <= 2**-11 * magnitude + 1e-30).all()


def test_float8_linear_on_cuda_matches_the_emulated_linear(gen):
    """Forward and backward of a Float8Linear with the hardware GEMM and with the emulated one (same
    weights, same inputs, same scales): the GEMMs differ by fp32 summation order only (< 2**-14 relative at
    K=1024, test above), which can move a BF16 output or an E5M2/E4M3-quantized gradient by one rounding
    step; bound: 2**-7 of each tensor's amax (two BF16 ulps at the amax)."""
    device = _fp8_gpu()
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    base = torch.nn.Linear(1024, 512).to(device, torch.bfloat16)
    outs = {}
    for backend in ("scaled_mm", "emulated"):
        layer = fp8.Float8Linear.from_linear(base, fp8.Float8LinearConfig(gemm_backend=backend))
        torch.manual_seed(0)
        x = torch.randn(256, 1024, device=device, dtype=torch.bfloat16).requires_grad_()
        grad = torch.randn(256, 512, device=device, dtype=torch.bfloat16)
        y = layer(x)
        y.backward(grad)
        w_grad = layer.weight.grad
        w_grad = w_grad.dequantize(torch.float32) if isinstance(w_grad, fp8.Float8Tensor) else w_grad.float()
        outs[backend] = (y.float(), x.grad.float(), w_grad)
    for hw, em in zip(outs["scaled_mm"], outs["emulated"]):
        scale = em.abs().max()
        assert (hw - em).abs().max() <= 2**-7 * scale, ((hw - em).abs().max() / scale).item()


# -- Triton kernels against their torch references on CUDA ---------------------------------------------
@pytest.mark.parametrize("shape", [(1, 1), (17, 33), (64, 64), (1030, 2050)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_cast_transpose_amax_kernel_is_bit_exact_on_cuda(gen, shape, dtype, fmt):
    from fp8.kernels import cast_transpose_amax

    device = _fp8_gpu()
    _real_triton()
    x = (torch.randn(shape, generator=gen) * torch.exp2(torch.empty(shape).uniform_(-20, 20, generator=gen)))
    x = x.to(dtype).to(device)
    scale = torch.exp2(torch.randint(-8, 9, (), generator=gen).float()).to(device)
    data, data_t, amax = cast_transpose_amax(x, scale, fmt, backend="triton")
    ref_data, ref_t, ref_amax = cast_transpose_amax(x, scale, fmt, backend="torch")
    assert torch.equal(_bits(data), _bits(ref_data)) and torch.equal(_bits(data_t), _bits(ref_t))
    assert torch.equal(amax, ref_amax)


def test_amax_unless_kernel_on_cuda(gen):
    from fp8.kernels import amax_unless

    device = _fp8_gpu()
    _real_triton()
    x = torch.randn(333, 650, generator=gen).to(device)
    assert torch.equal(amax_unless(x, torch.tensor(False, device=device), backend="triton"), x.abs().amax())
    assert amax_unless(x, torch.tensor(True, device=device), backend="triton").item() == 0


def test_delayed_scaling_with_the_fused_kernel_matches_torch_on_cuda(gen):
    device = _fp8_gpu()
    _real_triton()
    states = {b: fp8.ScalingState(fp8.ScalingConfig("e5m2", "delayed", history_len=4), device=device)
              for b in ("torch", "triton")}
    for step in range(3):
        x = (torch.randn(480, 800, generator=gen) * 10.0 ** step).to(device)
        out = {b: s.quantize_transpose(x, backend=b) for b, s in states.items()}
        for a, b in zip(out["torch"], out["triton"]):
            assert torch.equal(_bits(a), _bits(b))
        for s in states.values():
            s.update()
        assert torch.equal(states["torch"].amax_history, states["triton"].amax_history)


@pytest.mark.parametrize("new_kind", ["fp32", "fp8"])
def test_grad_accumulation_kernel_is_bit_exact_on_cuda(gen, new_kind):
    from fp8.kernels import accumulate_fp8_grad

    device = _fp8_gpu()
    _real_triton()
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    results = {}
    for backend in ("torch", "triton"):
        g = torch.Generator().manual_seed(seed)
        acc = fp8.to_float8(torch.randn(1030, 2050, generator=g).to(device))
        for magnitude in (1e-3, 1e2, 1.0):
            new = (torch.randn(1030, 2050, generator=g) * magnitude).to(device)
            accumulate_fp8_grad(acc, fp8.to_float8(new) if new_kind == "fp8" else new, backend=backend)
        results[backend] = acc
    assert torch.equal(_bits(results["torch"].payload), _bits(results["triton"].payload))
    assert torch.equal(results["torch"].scale, results["triton"].scale)


def _close(a, b, a_scale, b_scale):
    """tests/fp8/test_kernels.py's criterion: same scale, within 4 storage steps (16 fp32 ulps) at the amax, at
    most 10% of elements differing."""
    assert torch.equal(a_scale, b_scale)
    step = {torch.float8_e4m3fn: 2**-3, torch.float8_e5m2: 2**-2, torch.float16: 2**-10, torch.bfloat16: 2**-7,
            torch.float32: 2**-23}[a.dtype]
    bound = (16 if a.dtype == torch.float32 else 4) * step
    x, y = a.float(), b.float()
    assert (x - y).abs().max() <= bound * x.abs().max()
    assert (x != y).float().mean() <= 0.10


def test_fused_adam_kernel_matches_the_torch_path_on_cuda(gen):
    device = _fp8_gpu()
    _real_triton()
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    runs = {}
    for backend in ("torch", "triton"):
        g = torch.Generator().manual_seed(seed)
        params = [torch.nn.Parameter(fp8.to_float8((torch.randn(400, 520, generator=g) * 0.02).to(device))),
                  torch.nn.Parameter(torch.randn(11000, generator=g).to(device)),
                  torch.nn.Parameter(torch.randn(3000, generator=g).to(device, torch.bfloat16))]
        opt = fp8.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, kernel_backend=backend)
        for step in range(5):
            params[0].grad = fp8.to_float8((torch.randn(400, 520, generator=g) * 1e-3).to(device))
            params[1].grad = torch.randn(11000, generator=g).to(device)
            params[2].grad = torch.randn(3000, generator=g).to(device, torch.bfloat16)
            if step == 3:
                params[1].grad[17] = float("nan")
            opt.step()
        runs[backend] = (params, opt)
    (p_ref, o_ref), (p_tri, o_tri) = runs["torch"], runs["triton"]
    assert o_ref.skipped_steps == o_tri.skipped_steps == 1
    for a, b in zip(p_ref, p_tri):
        for key in ("exp_avg", "exp_avg_sq", "master"):
            if key in o_ref.state[a]:
                _close(o_ref.state[a][key], o_tri.state[b][key], o_ref.state[a][f"{key}_scale"],
                       o_tri.state[b][f"{key}_scale"])


# -- torch.compile and host syncs ------------------------------------------------------------------------
def _block(device):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.LayerNorm(4096),
                               torch.nn.Linear(4096, 1024)).to(device, torch.bfloat16)


def test_compiled_float8_block_and_o2_step_fullgraph_on_cuda(gen, tmp_path, monkeypatch):
    device = _fp8_gpu()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cold cache: see docs (repr on cache miss)
    torch._dynamo.reset()
    eager = _block(device)
    eager, eager_opt = fp8.initialize(eager, torch.optim.AdamW(eager.parameters(), lr=1e-3), "O2", min_fp8_dim=0)
    model = _block(device)
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2", min_fp8_dim=0)
    model.load_state_dict(eager.state_dict())
    optimizer.load_state_dict(eager_opt.state_dict())
    compiled = torch.compile(model, fullgraph=True)
    compiled_step = torch.compile(optimizer.step, fullgraph=True)
    for _ in range(3):
        x = torch.randn(512, 1024, generator=gen).to(device, torch.bfloat16)
        y = torch.randn(512, 1024, generator=gen).to(device, torch.bfloat16)
        for m, step, opt in ((eager, eager_opt.step, eager_opt), (compiled, compiled_step, optimizer)):
            (m(x).float() - y.float()).pow(2).mean().backward()
            step()
            opt.zero_grad()
    for (name, a), b in zip(eager.state_dict().items(), model.state_dict().values()):
        a = a.dequantize() if isinstance(a, fp8.Float8Tensor) else a
        b = b.dequantize() if isinstance(b, fp8.Float8Tensor) else b
        assert torch.allclose(a.float(), b.float(), rtol=2**-3, atol=1e-5), name


def test_o2_steady_state_step_never_syncs(gen):
    """Forward, backward, clipping, O2 step and zero_grad under set_sync_debug_mode("error"): any operation
    that synchronises the host with the GPU raises."""
    device = _fp8_gpu()
    model = _block(device)
    model, optimizer = fp8.initialize(model, torch.optim.AdamW(model.parameters(), lr=1e-3), "O2", min_fp8_dim=0)
    data = [(torch.randn(512, 1024, generator=gen).to(device, torch.bfloat16),
             torch.randn(512, 1024, generator=gen).to(device, torch.bfloat16)) for _ in range(4)]

    def step(x, y):
        (model(x).float() - y.float()).pow(2).mean().backward()
        fp8.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    step(*data[0])  # first step (lazy states, first scales) outside
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in data[1:]:
            step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert optimizer.skipped_steps == 0


# -- pretrain_gpt.py on NCCL -----------------------------------------------------------------------------
_LOOP = r"""
import json, sys, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, ".")
import torch
from megatron.training.arguments import parse_config
from megatron.training import training
level = sys.argv[1]
flags = ["--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "512",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--vocab-size", "4096",
         "--train-iters", "6", "--eval-interval", "0", "--bf16", "--fp8-min-dim", "0", "--fp8-opt-level", level,
         "--no-progress"]
cfg = parse_config(flags, world_size=1)
training.initialize_distributed(cfg)
assert torch.distributed.get_backend() == "nccl"
run = training.TrainingRun(cfg, training.Datasets(cfg))
source = run.data_iterators(training.Datasets(cfg).train)
batches = [{k: v.to(run.device) for k, v in next(source).items()} for _ in range(6 * cfg.training.num_microbatches)]
data = iter(batches)
run.train_step(data, 0)
run.train_step(data, 1)  # first steps: lazy optimizer states, first scales, NCCL communicators
pending = training.PendingRecords(cfg, run)
torch.cuda.synchronize()
torch.cuda.set_sync_debug_mode("error")
try:
    for it in range(2, 6):
        pending.add(it + 1, run.train_step(data, it), {}, 0.0, run.mu())
finally:
    torch.cuda.set_sync_debug_mode("default")
records = pending.flush()
dtypes = sorted({str(p.dtype) for c in run.bare_chunks for p in c.parameters()
                 if type(p).__name__ != "Float8Tensor"})
print("RESULT " + json.dumps({"losses": [r["loss"] for r in records], "skipped": run.skipped_steps,
                              "fp8": run.fp8_selection[0], "dtypes": dtypes}))
torch.distributed.destroy_process_group()
"""


def _python(args, timeout=600, env=None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("level", ["none", "O1", "O2", "O3"])
def test_training_loop_steps_on_nccl_without_host_syncs(level):
    """World size 1 on NCCL, --bf16: four steady-state steps of pretrain_gpt.py's loop under
    set_sync_debug_mode("error"), then the one batched read of their values."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if level != "none":
        _fp8_gpu()
    proc = _python(["-c", _LOOP, level])
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert all(l == l and 0 < l < 20 for l in out["losses"]) and out["skipped"] == 0
    assert out["dtypes"] == ["torch.bfloat16"]
    assert out["fp8"] == (0 if level == "none" else 8)


@pytest.mark.parametrize("level", ["none", "O1", "O2", "O3"])
def test_pretrain_gpt_runs_on_nccl(level, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if level != "none":
        _fp8_gpu()
    log = tmp_path / "log.jsonl"
    proc = _python(["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "8",
                    "--seq-length", "512", "--micro-batch-size", "2", "--mock-data", "--vocab-size", "4096",
                    "--train-iters", "3", "--eval-interval", "3", "--eval-iters", "1", "--log-interval", "2",
                    "--bf16", "--fp8-opt-level", level, "--log-json", str(log), "--no-progress"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in log.read_text().splitlines() if '"iteration"' in line]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(r["loss"] == r["loss"] for r in records) and "val_loss" in records[-1]
    if level != "none":  # hidden 1024 < the CUDA default --fp8-min-dim 2048: announced, nothing converted
        assert "0 of 9 linear layer(s) run in FP8" in proc.stderr and "no FP8 GEMM will run" in proc.stderr


@pytest.mark.parametrize("layout", [["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                                    ["--pipeline-model-parallel-size", "2"]], ids=["tp2sp", "pp2"])
def test_pretrain_gpt_model_parallel_on_two_gpus(layout, tmp_path):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    _fp8_gpu()
    proc = _python(["-m", "torch.distributed.run", "--nproc_per_node", "2", "pretrain_gpt.py", *layout,
                    "--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "512",
                    "--micro-batch-size", "2", "--global-batch-size", "8", "--mock-data", "--vocab-size", "4096",
                    "--train-iters", "3", "--eval-interval", "0", "--bf16", "--fp8-opt-level", "O2",
                    "--fp8-min-dim", "0", "--compare", "none", "--no-progress", "--log-json", str(tmp_path / "log.jsonl")])
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    summary = next(line["summary"] for line in lines if "summary" in line)
    by_level = {s["level"]: s for s in summary}
    assert set(by_level) == {"none", "O2"}
    for level in ("none", "O2"):
        losses = [r["loss"] for r in lines if r.get("level") == level and "iteration" in r]
        assert len(losses) == 3 and all(0 < l < 20 for l in losses), (level, losses)
        assert by_level[level]["skipped_steps"] == 0
    assert by_level["O2"]["fp8_weights"] > 0 and by_level["none"]["fp8_weights"] == 0
    # the same seed and data: O2 within a few percent of the baseline after 3 steps
    assert abs(by_level["O2"]["final_train_loss"] - by_level["none"]["final_train_loss"]) <= (
        0.05 * by_level["none"]["final_train_loss"])
