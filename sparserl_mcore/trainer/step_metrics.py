"""What one RL step reports besides the loss: reward and KV statistics of its samples, and the
wall time of its phases (`time/<phase>_s`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch


def rollout_metrics(samples: Sequence[Any], batch: Any, kv_bytes_per_token: int) -> dict[str, float]:
    """Reward and KV statistics of one step's samples (before the zero-variance filter).

    peak_kv_bytes: the most KV one request held, in the engine's whole pool pages. dense_kv_bytes:
    what the longest request would hold uncompressed (every cached position: prompt + output but
    the last token), in whole pages of the same size, so the two compare like with like.
    """
    peak = max(samples, key=lambda s: s.kv_stats.peak_kv_bytes)
    cached = max(max(len(s.prompt_ids), len(s.prompt_ids) + len(s.output_ids) - 1) for s in samples)
    dense = cached * kv_bytes_per_token
    if peak.kv_stats.peak_pages:  # round up to the pages the engine allocates
        page_bytes = peak.kv_stats.peak_kv_bytes // peak.kv_stats.peak_pages
        dense = -(-dense // page_bytes) * page_bytes
    lengths = torch.tensor([len(s.output_ids) for s in samples], dtype=torch.float32)
    return {
        "rollout/reward_mean": float(batch.rewards_B.mean()),
        "rollout/response_len_mean": float(lengths.mean()),
        "rollout/peak_kv_bytes": float(peak.kv_stats.peak_kv_bytes),
        "rollout/dense_kv_bytes": float(dense),
        "rollout/peak_retained_tokens": float(max(s.kv_stats.peak_retained_tokens for s in samples)),
        "rollout/truncated_frac": float(sum(s.finish_reason == "length" for s in samples) / len(samples)),
    }


class StepTimer:
    """Wall time of named phases, reported as time/<phase>_s."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._name = ""

    def __call__(self, name: str) -> StepTimer:
        self._name = name
        return self

    def __enter__(self) -> None:
        self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds[self._name] = time.perf_counter() - self._start

    def metrics(self) -> dict[str, float]:
        return {f"time/{k}_s": v for k, v in self.seconds.items()}
