# Two set-up commands (see README): `make quickstart` runs the main job, `make test` runs the test suite.
PYTHON ?= python3
# CPU wheel for CI and laptops; on a GPU machine set TORCH_SPEC to the CUDA build you use.
TORCH_SPEC ?= torch==2.13.0
PIP := $(PYTHON) -m pip install -q --disable-pip-version-check

.PHONY: install quickstart test

install:
	$(PIP) "$(TORCH_SPEC)"
	$(PIP) -e ".[test]"

quickstart: install
	$(PYTHON) examples/quickstart.py

test: install
	$(PYTHON) -m pytest -q tests
