# The README's two commands (demo, test) each set up their own environment first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
TORCH  := torch==2.13.0

.PHONY: setup test demo bench lint

setup: $(STAMP)

# torch goes in first and stays pinned: otherwise a dependency would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test]' $(TORCH)
	touch $@

test: setup
	$(BIN)/python -m pytest -q tests

demo: setup
	$(BIN)/sparserl demo

bench: setup
	$(BIN)/python -m benchmarks

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
