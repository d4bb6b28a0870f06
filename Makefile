# Two set-up commands (see README): `make quickstart` runs the main job, `make test` runs the test suite.
PYTHON ?= python3
# CPU wheel for CI and laptops; on a GPU machine set TORCH_SPEC to the CUDA build you use.
TORCH_SPEC ?= torch==2.13.0
PIP := $(PYTHON) -m pip install -q --disable-pip-version-check

.PHONY: install quickstart quickstart-engine test

install:
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e ".[test]"

# The main job: pretrain_gpt.py on its embedded default (a small GPT on Shakespeare, FP8 O2 beside the baseline).
quickstart: install
	$(PYTHON) pretrain_gpt.py

# The FP8 engine alone on a plain PyTorch GPT (fp8.initialize at O0/O1/O2).
quickstart-engine: install
	$(PYTHON) examples/quickstart.py

test: install
	$(PYTHON) -m pytest -q tests
