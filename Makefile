# The README's two commands (demo, test) each set up their own environment first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
TORCH  := torch==2.13.0
# SGLang for the CPU tests of the SGLang integration: the pinned wheels without their (CUDA) deps (the
# router is a Rust binary that runs on CPU: tests/test_sglang_router.py starts it), plus
# the pure-python modules its layers / KV pools / scheduler data structures import (SGLang's own pins
# where it has them), plus what its HTTP server imports (a live CPU server: tests/test_sglang_live.py;
# xgrammar without its declared triton dependency). sgl_kernel, triton and torchvision are CPU
# stand-ins (sparserl_mcore/sglang/cpu_stubs.py).
SGLANG := sglang==0.5.23 sglang-router==0.3.2 xgrammar==0.2.7
SGLANG_CPU_DEPS := orjson==3.13.0 pybase64==1.5.1 requests==2.34.2 msgspec==0.22.0 pyzmq==27.3.0 \
	ipython==9.18.1 aiohttp==3.14.5 apache-tvm-ffi==0.1.11 dill==0.4.1 sentencepiece==0.2.1 \
	compressed-tensors==0.18.0 gguf==0.19.0 openai==2.8.0 partial_json_parser==0.2.1.1.post7 \
	setproctitle==1.3.8 einops==0.8.2 uvloop==0.23.0 python-multipart==0.0.34 jsonschema==4.26.0 \
	soundfile==0.13.1

.PHONY: setup test demo bench lint slurm-test apt-shellcheck gpu-wheels gpu-check

setup: $(STAMP)

# torch goes in first and stays pinned: otherwise a dependency would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[test]' $(TORCH)
	$(BIN)/python -m pip install -q $(SGLANG_CPU_DEPS) $(TORCH)
	$(BIN)/python -m pip install -q --no-deps $(SGLANG)
	touch $@

test: setup apt-shellcheck
	$(BIN)/python -m pytest -q tests

# Debian packages some tests need, installed where that is possible (root with apt-get).
APT_INSTALL := apt-get install -y -q --no-install-recommends
CAN_APT     := { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }

# shellcheck lints the rendered sbatch scripts; without it those tests skip (and say why).
apt-shellcheck:
	@command -v shellcheck >/dev/null 2>&1 || ! $(CAN_APT) || \
		(apt-get update -q && $(APT_INSTALL) shellcheck) >/dev/null || echo "could not install shellcheck"

# Rendered sbatch jobs through a real Slurm started on this machine (slurmctld + two slurmd, CPU
# nodes, private config and ports; stopped at the end). Root only; about 5 minutes on 2 cores.
slurm-test: setup apt-shellcheck
	@command -v slurmctld >/dev/null 2>&1 && command -v munged >/dev/null 2>&1 || \
		(apt-get update -q && $(APT_INSTALL) slurm-wlm munge)
	SPARSERL_SLURM_TEST=1 $(BIN)/python -m pytest -q -s tests/test_slurm_cluster.py

demo: setup
	$(BIN)/sparserl demo

bench: setup
	$(BIN)/python -m benchmarks

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# ---- GPU box without a package index (README "On a GPU") ------------------------------------
GPU_PYTHON ?= python3
GPU_PYVER  ?= 3.12
GPU_WHEELS ?= .gpu-wheels
GPU_SITE   ?= .gpu-site
GPU_OUT    ?= gpu-results
GPU_ENV    := PYTHONPATH=$(CURDIR)/$(GPU_SITE):$(CURDIR)

# Here, where an index is reachable: binary wheels of what the GPU image lacks, for its Python.
gpu-wheels: setup
	$(BIN)/python tools/gpu_wheels.py download --python-version $(GPU_PYVER) --dest $(GPU_WHEELS)

# There: install the carried wheels (no index, no resolution), check the imports, then the GPU
# tests (marker gpu) and the GPU benchmarks, each under a time limit (tools/gpu_check.sh: logs in
# $(GPU_OUT)/, records and summary.md in $(GPU_OUT)/res/).
gpu-check:
	$(GPU_PYTHON) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device visible')"
	if [ -d $(GPU_WHEELS) ]; then $(GPU_PYTHON) tools/gpu_wheels.py install --wheels $(GPU_WHEELS) --target $(GPU_SITE); fi
	$(GPU_ENV) $(GPU_PYTHON) tools/gpu_wheels.py check --target $(GPU_SITE)
	$(GPU_ENV) GPU_PYTHON=$(GPU_PYTHON) GPU_OUT=$(GPU_OUT) tools/gpu_check.sh
