"""The rollout-engine contract: what the trainer and the HTTP server code against.

`EmbeddedEngine` (in-process, this package) and the serve engineer's `RemoteEngine` (HTTP client)
both implement `RolloutEngine`. Everything here is plain data so it crosses process boundaries
(JSON over HTTP) unchanged; `SamplingParams` validates on construction so a bad request fails
before it reaches the scheduler.

Log-prob convention (the learner uses the same one): each sampled token's log-prob is
``log_softmax(logits / T)[token]`` with ``T = temperature``, taken BEFORE top-p / top-k
filtering; with ``temperature == 0`` (greedy) it is ``log_softmax(logits)[token]`` (T = 1). The
logits are those of the forward pass that actually produced the token, i.e. over the compressed
KV cache when compression is on (pi_sparse in Sparse-RL's notation).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request sampling settings (SGLang's `sampling_params` names).

    temperature 0 means greedy; top_k -1 (or 0) and top_p 1.0 disable those filters; `stop` holds
    stop strings, matched on the decoded output text (needs the model's tokenizer); `seed` makes
    one request's draws reproducible regardless of what else is in the batch. The model's EOS token
    ids (config.json / generation_config.json) also stop a request unless `ignore_eos`.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Lists arrive from JSON; store tuples so the params stay hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature={self.temperature!r}: must be a finite number >= 0 (0 = greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]; use 1.0 to disable")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r}: must be >= 1, or -1 / 0 to disable")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r}: must be >= 1")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r}: token ids must be >= 0")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r}: stop strings must be non-empty str")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise ValueError(f"seed={self.seed!r}: must be None or an int in [0, 2**63)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Build from a JSON object, rejecting unknown keys by name."""
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown sampling params {unknown}; known: {sorted(known)}")
        return cls(**dict(data))


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One prompt to complete. `rid` is echoed back in the `Sample` (a uuid is made when empty)."""

    input_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    rid: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_ids", tuple(int(t) for t in self.input_ids))
        if not self.input_ids:
            raise ValueError("input_ids is empty: a request needs at least one prompt token")
        if any(t < 0 for t in self.input_ids):
            raise ValueError("input_ids contains negative token ids")


@dataclass(frozen=True, kw_only=True)
class KVStats:
    """KV-cache usage of one request over its lifetime.

    peak_retained_tokens: most cached positions the request attended over at any decode step
    (per layer and KV head; every layer/head keeps the same count). evictions: cached positions
    dropped by compression in total (per layer and head). compressions: how many times it was
    compressed. peak_pages / peak_kv_bytes: most pool pages (and their K+V bytes over all layers)
    the request referenced at once, shared prefix pages included.
    """

    peak_retained_tokens: int = 0
    evictions: int = 0
    compressions: int = 0
    peak_pages: int = 0
    peak_kv_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class Sample:
    """A finished request: generated tokens, the sampler's log-prob of each, and KV stats."""

    rid: str
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    finish_reason: FinishReason
    kv_stats: KVStats = field(default_factory=KVStats)
    weight_version: int = 0
    cached_prompt_tokens: int = 0


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generator, in-process or remote."""

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        """Complete every request; results are in request order."""
        ...

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace weights in place from HF-named tensors (all or a subset); flushes the prefix cache."""
        ...

    def apply_patch(self, patch_bytes: bytes) -> int:
        """Apply + verify a sparse sync patch (sparserl_mcore.sync); returns the new weight version."""
        ...

    def flush_cache(self) -> None:
        """Drop every unreferenced prefix-cache entry so no stale KV is reused."""
        ...

    def abort(self, rid: str) -> None:
        """Finish request `rid` early with finish_reason "abort" (no-op if it is not in flight)."""
        ...

    def pause(self) -> None:
        """Stop scheduling decode steps (in-flight requests wait) until `resume`."""
        ...

    def resume(self) -> None: ...

    def model_info(self) -> dict[str, Any]:
        """At least: model_path, architecture, vocab_size, weight_version, kv_compression."""
        ...
