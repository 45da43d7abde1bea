# xfam developer commands. `make help` lists them.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
# Extra index for TORCH, e.g. TORCH_INDEX=https://download.pytorch.org/whl/cu124
TORCH_INDEX ?=
BIN    := $(VENV)/bin
# Tests and the main job run single-threaded per process: oversubscribed threads on a small
# machine slow a test run by an order of magnitude (docs/architecture.md).
TEST_ENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
PYTEST_ARGS ?=
# `make test` runs its files on this many processes (pytest-xdist; a file stays on one process). 0: one process.
TEST_WORKERS ?= 2

.DEFAULT_GOAL := help
.PHONY: help setup test test-slow test-all train lint docs generated format bench compile-kernels gpu-wheels clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	touch $@

setup: $(BIN)/.installed  ## create .venv: torch pinned first (TORCH=... to override), then xfam[dev]

test: setup  ## the test suite (slow checks excluded), ~9 min on 2 cores
	$(TEST_ENV) $(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && exit 0; exit $$rc

test-slow: setup  ## only the long checks (marked slow)
	$(TEST_ENV) $(BIN)/python -m pytest -m slow $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && exit 0; exit $$rc

test-all: test test-slow  ## everything

train: setup  ## the main job: tiny decoder on the embedded corpus (a few minutes), continued if already started
	OMP_NUM_THREADS=2 $(BIN)/python train.py ckpt_path=auto

lint: setup  ## ruff (lint and format) and mypy over xfam/ (.pre-commit-config.yaml runs the same)
	$(BIN)/ruff check xfam kernels tests scripts train.py
	$(BIN)/ruff format --check xfam kernels tests scripts train.py
	$(BIN)/mypy

docs: setup  ## build the documentation site into site/ (warnings are errors) and check links
	$(BIN)/python scripts/generate_docs.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
	$(BIN)/python scripts/check_links.py

generated: setup  ## regenerate every generated section (README, docs/reference, docs/blocks.md)
	$(BIN)/python scripts/generate_docs.py

format: setup  ## apply ruff fixes and formatting
	$(BIN)/ruff check --fix xfam kernels tests scripts train.py
	$(BIN)/ruff format xfam kernels tests scripts train.py

bench: setup  ## training throughput vs x-transformers and a minimal model, the encoder-decoder, block options, scale-out, data, memory models (docs/benchmarks.md), scaling (docs/scaling.md), compiled training (docs/compile.md), decoding (docs/decoding.md)
	$(BIN)/python scripts/bench_train.py
	$(BIN)/python scripts/bench_seq2seq.py
	$(BIN)/python scripts/bench_blocks.py
	$(BIN)/python scripts/bench_scaleout.py
	$(BIN)/python scripts/bench_data.py
	$(BIN)/python scripts/bench_memory_models.py --profile
	$(BIN)/python scripts/bench_scaling.py
	$(BIN)/python scripts/bench_compile.py
	$(BIN)/python scripts/bench_generate.py

compile-kernels: setup  ## compile every Triton kernel for sm_90 (H100/H200) without a GPU: registers, spills, shared memory
	$(BIN)/python scripts/compile_kernels.py

gpu-wheels: setup  ## wheels in .whl/ for a CUDA host without a package index (docs/kernels.md, GPU checks)
	$(BIN)/python scripts/gpu_wheels.py

clean:  ## remove caches (not .venv, not runs/)
	rm -rf .pytest_cache .ruff_cache build dist *.egg-info
