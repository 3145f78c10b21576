"""Shared set-up of the single-process learner tests: one CPU rank over gloo, and the tiny Qwen2
HF config those tests build from (imported by the tests, like e2e_support)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

TINY_QWEN2: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}


def tiny_qwen2_config(**changes: Any) -> dict[str, Any]:
    """TINY_QWEN2 with `changes` (a test's own layer count, vocabulary, tying...)."""
    return {**TINY_QWEN2, **changes}


@contextmanager
def cpu_runtime(seed: int) -> Iterator[Any]:
    """`parallel.initialize` for one CPU rank (skipped where CUDA is visible: those paths have the
    GPU tests), with torchrun's rank variables set aside for its duration."""
    from sparserl_mcore.parallel import ParallelConfig, initialize, shutdown

    if torch.cuda.is_available():
        pytest.skip("single CPU process")
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS") if k in os.environ}
    try:
        yield initialize(ParallelConfig(), seed=seed)
    finally:
        shutdown()
        os.environ.update(saved)
