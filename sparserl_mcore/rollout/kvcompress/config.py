"""KV-compression settings and the one trigger rule every engine shares.

Budget semantics (differs from the Sparse-RL / R-KV code on purpose): `budget` is a HARD cap on the
positions a request retains per layer and KV head. When the cache reaches `budget`, it is compressed
to `budget - interval`, so it grows for `interval` decode steps before the next compression and
never holds more than `budget`. The paper's code instead lets the cache grow to `budget + interval`
and compresses back to `budget`: same compression period, but its peak is `budget + interval`. With
a hard cap the memory reservation of a request is known in advance, which is what a paged pool
needs. The prompt is never compressed during prefill; a prompt longer than the budget is stored
whole and compressed at the first decode step (so the cap holds from then on).
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("none", "snapkv", "rkv", "streamingllm", "h2o")


@dataclass(frozen=True, kw_only=True)
class KVCompressionConfig:
    """Which positions a request keeps in its KV cache during decode.

    method: one of METHODS ("none" disables compression).
    budget: hard cap on retained positions per layer and KV head (see module docstring).
    interval: decode steps between compressions; compression keeps `budget - interval` positions.
    window: the most recent positions always kept; their queries are the observation window.
    kernel_size: odd width of the 1-D max-pool that smooths importance scores (SnapKV, R-KV).
    rkv_lambda: R-KV mix, score = lambda * importance - (1 - lambda) * redundancy.
    similarity_threshold: R-KV counts two keys as redundant when their cosine similarity exceeds it.
    sink_tokens: StreamingLLM's always-kept first positions (attention sinks).
    """

    method: str = "none"
    budget: int = 512
    interval: int = 128
    window: int = 8
    kernel_size: int = 7
    rkv_lambda: float = 0.1
    similarity_threshold: float = 0.5
    sink_tokens: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r}: unknown KV compression; choose from {list(METHODS)}")
        if self.interval < 1:
            raise ValueError(f"interval={self.interval}: must be >= 1 decode step")
        if self.window < 1:
            raise ValueError(f"window={self.window}: must be >= 1 (the observation window of recent queries)")
        if self.budget <= self.interval:
            raise ValueError(
                f"budget={self.budget} <= interval={self.interval}: compression keeps budget - interval "
                "positions, so raise budget or lower interval"
            )
        if self.keep_tokens < self.window + self.sink_tokens:
            raise ValueError(
                f"budget - interval = {self.keep_tokens} < window + sink_tokens = "
                f"{self.window + self.sink_tokens}: nothing left to select; raise budget or lower interval"
            )
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size={self.kernel_size}: must be an odd number >= 1 (1 = no pooling)")
        if not 0.0 <= self.rkv_lambda <= 1.0:
            raise ValueError(f"rkv_lambda={self.rkv_lambda}: must be in [0, 1]")
        if not -1.0 <= self.similarity_threshold < 1.0:
            raise ValueError(f"similarity_threshold={self.similarity_threshold}: must be in [-1, 1)")
        if self.sink_tokens < 0:
            raise ValueError(f"sink_tokens={self.sink_tokens}: must be >= 0")

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @property
    def keep_tokens(self) -> int:
        """Positions retained right after a compression."""
        return self.budget - self.interval

    def should_compress(self, n_cached: int) -> bool:
        """True when a request holding `n_cached` positions (after the latest step wrote its KV)
        must be compressed to `keep_tokens` before the next step."""
        return self.enabled and n_cached >= self.budget
