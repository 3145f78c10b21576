"""The compression policies behind one interface, and their registry.

A compressor answers one question per layer: which cached positions does each KV head keep?
`select(keys [Hk, n, d], queries [Hq, w, d] | None, n_keep, accumulated=None)` returns int64
[Hk, min(n, n_keep)] position indices, ascending per head, always containing the last `window`
positions. Heads choose independently (per-head selection, as SnapKV and R-KV define it); the
engine gathers K and V of each head with the same indices. Keys are post-RoPE, as cached.
Policies that never read the window queries (`needs_window_queries = False`) accept None, so an
engine need not keep a ring of recent queries for them.
"""

from __future__ import annotations

import torch

from sparserl_mcore.rollout.kvcompress import scoring
from sparserl_mcore.rollout.kvcompress.config import KVCompressionConfig


class KVCompressor:
    """Base: argument checks, the no-op case and "top scores + recent window" selection."""

    needs_accumulated_attention = False
    needs_window_queries = True

    def __init__(self, cfg: KVCompressionConfig) -> None:
        self.cfg = cfg

    def select(
        self,
        keys: torch.Tensor,
        queries: torch.Tensor | None,
        n_keep: int,
        accumulated: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if queries is None and self.needs_window_queries:
            raise ValueError(f"{self.cfg.method} scores with the window queries: pass [q_heads, w, d]")
        _check_inputs(keys, queries, n_keep, accumulated, self.cfg.window)
        kv_heads, n, _ = keys.shape
        if n <= n_keep:
            return torch.arange(n, device=keys.device).expand(kv_heads, n).contiguous()
        return self._select(keys, queries, n_keep, accumulated)

    def _select(
        self, keys: torch.Tensor, queries: torch.Tensor | None, n_keep: int, accumulated: torch.Tensor | None
    ) -> torch.Tensor:
        raise NotImplementedError

    def _top_plus_window(self, prefix_scores: torch.Tensor, n_keep: int) -> torch.Tensor:
        """Keep the last `window` positions and the best-scored `n_keep - window` of the rest.

        prefix_scores [Hk, n - window] score the positions before the window.
        """
        kv_heads, recent_start = prefix_scores.shape
        top = prefix_scores.topk(n_keep - self.cfg.window, dim=-1, sorted=False).indices  # one sort below
        recent = torch.arange(recent_start, recent_start + self.cfg.window, device=prefix_scores.device)
        return torch.cat([top, recent.expand(kv_heads, -1)], dim=-1).sort(dim=-1).values

    def _prefix(self, keys: torch.Tensor) -> int:
        return keys.shape[1] - self.cfg.window


class SnapKV(KVCompressor):
    """Keep the positions the recent queries attend to most (pooled window attention)."""

    def _select(
        self, keys: torch.Tensor, queries: torch.Tensor | None, n_keep: int, accumulated: torch.Tensor | None
    ) -> torch.Tensor:
        assert queries is not None  # select() refused a missing window for this policy
        imp = scoring.importance(keys, queries, self.cfg.kernel_size)
        return self._top_plus_window(imp[:, : self._prefix(keys)], n_keep)


class RKV(KVCompressor):
    """Importance minus redundancy: drops near-duplicate keys before rarely attended ones."""

    def _select(
        self, keys: torch.Tensor, queries: torch.Tensor | None, n_keep: int, accumulated: torch.Tensor | None
    ) -> torch.Tensor:
        assert queries is not None  # select() refused a missing window for this policy
        lam, prefix = self.cfg.rkv_lambda, self._prefix(keys)
        imp = scoring.importance(keys, queries, self.cfg.kernel_size)[:, :prefix]
        red = scoring.redundancy(keys[:, :prefix], self.cfg.similarity_threshold)
        return self._top_plus_window(lam * imp - (1.0 - lam) * red, n_keep)


class StreamingLLM(KVCompressor):
    """Attention sinks (the first `sink_tokens`) plus the most recent positions; same for every head."""

    needs_window_queries = False

    def _select(
        self, keys: torch.Tensor, queries: torch.Tensor | None, n_keep: int, accumulated: torch.Tensor | None
    ) -> torch.Tensor:
        kv_heads, n, _ = keys.shape
        if n_keep < self.cfg.sink_tokens + self.cfg.window:
            raise ValueError(
                f"n_keep={n_keep} < sink_tokens + window = {self.cfg.sink_tokens + self.cfg.window}"
            )
        sinks = torch.arange(self.cfg.sink_tokens, device=keys.device)
        recent = torch.arange(n - (n_keep - self.cfg.sink_tokens), n, device=keys.device)
        return torch.cat([sinks, recent]).expand(kv_heads, n_keep).contiguous()


class H2O(KVCompressor):
    """Heavy hitters by accumulated attention (see `scoring.attention_mass`) plus the recent window."""

    needs_accumulated_attention = True
    needs_window_queries = False

    def _select(
        self, keys: torch.Tensor, queries: torch.Tensor | None, n_keep: int, accumulated: torch.Tensor | None
    ) -> torch.Tensor:
        if accumulated is None:
            raise ValueError(
                "h2o needs accumulated attention [kv_heads, n]: accumulate scoring.attention_mass "
                "per step and pass it as `accumulated`"
            )
        return self._top_plus_window(accumulated[:, : self._prefix(keys)].float(), n_keep)


# method name -> compressor class. "none" builds no compressor (KVCompressionConfig.enabled is False).
COMPRESSORS: dict[str, type[KVCompressor]] = {
    "snapkv": SnapKV,
    "rkv": RKV,
    "streamingllm": StreamingLLM,
    "h2o": H2O,
}


def build_compressor(cfg: KVCompressionConfig) -> KVCompressor | None:
    """The compressor for `cfg.method`, or None for "none"."""
    if not cfg.enabled:
        return None
    try:
        return COMPRESSORS[cfg.method](cfg)
    except KeyError:
        raise KeyError(f"no compressor for method {cfg.method!r}; known: {sorted(COMPRESSORS)}") from None


def _check_inputs(
    keys: torch.Tensor,
    queries: torch.Tensor | None,
    n_keep: int,
    accumulated: torch.Tensor | None,
    window: int,
) -> None:
    if keys.dim() != 3:
        raise ValueError(f"keys {tuple(keys.shape)}: expected [kv_heads, n, d]")
    if n_keep < window:
        raise ValueError(f"n_keep={n_keep} < window={window}: the recent window is always kept")
    kv_heads, n, d = keys.shape
    if accumulated is not None and tuple(accumulated.shape) != (kv_heads, n):
        raise ValueError(f"accumulated {tuple(accumulated.shape)}: expected [kv_heads, n] = {(kv_heads, n)}")
    if queries is None:
        return
    if queries.dim() != 3:
        raise ValueError(
            f"keys {tuple(keys.shape)} / queries {tuple(queries.shape)}: "
            "expected [kv_heads, n, d] / [q_heads, w, d]"
        )
    q_heads, w, qd = queries.shape
    if qd != d or q_heads % kv_heads != 0:
        raise ValueError(
            f"queries {tuple(queries.shape)} do not match keys {tuple(keys.shape)}: need the same head dim "
            "and q_heads a multiple of kv_heads"
        )
    if not 1 <= w <= n:
        raise ValueError(f"{w} window queries for {n} cached positions: need 1 <= w <= n")
