# The README's two commands (demo, test) each set up their own environment first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
TORCH  := torch==2.13.0
# SGLang for the CPU tests of the SGLang integration: the pinned wheel without its (CUDA) deps, plus
# the pure-python modules its layers / KV pools / scheduler data structures import (SGLang's own pins
# where it has them). sgl_kernel, triton and torchvision are stubbed by tests/sglang_cpu.py.
SGLANG := sglang==0.5.23
SGLANG_CPU_DEPS := orjson pybase64 requests msgspec pyzmq ipython aiohttp apache-tvm-ffi==0.1.11 \
	dill sentencepiece==0.2.1 compressed-tensors==0.18.0 gguf openai==2.8.0 partial_json_parser \
	setproctitle einops

.PHONY: setup test demo bench lint

setup: $(STAMP)

# torch goes in first and stays pinned: otherwise a dependency would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test]' $(TORCH)
	$(BIN)/python -m pip install -q $(SGLANG_CPU_DEPS) $(TORCH)
	$(BIN)/python -m pip install -q --no-deps $(SGLANG)
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
