"""The per-rank RNG streams a training checkpoint stores: safetensors + JSON (nothing unpickled),
and every stream (torch, python, numpy, megatron's model-parallel tracker) continues exactly."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from megatron.core import tensor_parallel
from safetensors import safe_open

from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown
from sparserl_mcore.trainer.checkpoint import _load_rng, _save_rng


def _draw() -> tuple:
    with tensor_parallel.get_cuda_rng_tracker().fork():
        tracked = torch.rand(3)
    return torch.rand(3), random.random(), random.gauss(0, 1), np.random.rand(3), tracked


@pytest.mark.skipif(torch.cuda.is_available(), reason="single CPU process")
def test_rng_streams_round_trip_through_safetensors(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    initialize(ParallelConfig(), seed=11)
    try:
        _draw()
        random.gauss(0, 1)  # leaves a cached gaussian in python's state
        _save_rng(tmp_path / "rng.safetensors")
        expected = _draw()
        _draw()  # move every stream on
        _load_rng(tmp_path / "rng.safetensors")
        got = _draw()
    finally:
        shutdown()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[4], expected[4])
    assert got[1:3] == expected[1:3] and np.array_equal(got[3], expected[3])
    with safe_open(tmp_path / "rng.safetensors", framework="pt") as f:
        assert {"torch", "python", "numpy"} <= set(f.keys()) and "scalars" in f.metadata()
