"""KV compression of one running request inside SGLang's own pools (sglang 0.5.23, page size 1).

SGLang's names this module works on (all in `srt/mem_cache/`): `memory_pool.py: ReqToTokenPool`
(`req_to_token[row, pos]` = the KV slot of position `pos` of the request on `row`),
`memory_pool.py: MHATokenToKVPool` (`k_buffer[layer][slot]` / `v_buffer[layer][slot]` =
[kv_heads, head_dim] of one token; one slot holds every layer and head of that token),
`allocator/token.py: TokenToKVPoolAllocator` (frees single slots), and the request's
`managers/schedule_batch.py: ReqKvInfo` (`cache_protected_len`: the radix tree owns row positions
[0, here) and other requests may share their slots; `kv_committed_len` / `kv_allocated_len`: the
row positions in use).

In place, no copy-on-write: the policy chooses, per layer and KV head, which of the request's OWN
positions [cache_protected_len, n) to keep; the kept K/V of each head is gathered and written into
the first `keep` own slots, in position order; the other own slots go back to the allocator
through SGLang's `BasePrefixCache.free_kv_row`; the row's kv length shrinks to
cache_protected_len + keep. Slots below cache_protected_len are never read for writing, moved or
freed. Keys are cached after RoPE, so a kept key keeps its true position by construction; the
model's NEXT position is its kv length plus the positions this row evicted (`evicted[row]`), which
the hook wiring adds to SGLang's decode positions. The request is marked
`skip_radix_cache_insert`: its row no longer holds the KV of its tokens in order, so SGLang's own
release path (`mem_cache/common.py: release_kv_cache`) must not insert it into the radix tree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from sparserl_mcore.rollout.kvcompress import KVCompressionConfig, KVCompressor


@dataclasses.dataclass(frozen=True)
class Compaction:
    """What one compression did to one request."""

    freed: int  # own slots returned to SGLang's allocator
    kv_len: int  # row positions in use afterwards (protected prefix + kept)


class SGLangCompactor:
    """Compresses requests whose own KV tail reached the budget, on SGLang's real pools.

    Budget with a radix-shared prefix of P positions: the prefix is never compressed (other
    requests read its slots), so the request's own tail keeps `own_keep(P) = max(keep_tokens - P,
    window + sink_tokens)` positions per layer and head and is compressed when it holds
    `own_keep(P) + interval`. With P = 0 this is the embedded engine's rule (`should_compress`):
    compress at `budget`, down to `budget - interval`.
    """

    def __init__(self, kv_cfg: KVCompressionConfig, compressor: KVCompressor, tree_cache: Any) -> None:
        self.cfg, self.compressor, self.tree_cache = kv_cfg, compressor, tree_cache
        self.req_to_token = tree_cache.req_to_token_pool.req_to_token
        allocator = tree_cache.token_to_kv_pool_allocator
        if allocator.page_size != 1:
            raise ValueError(f"page size {allocator.page_size}: KV compression in SGLang needs --page-size 1")
        self.kv = allocator.get_kvcache()
        _check_pool(self.kv)
        # positions each req_to_token row evicted since its request took it (reset on allocation)
        self.evicted = torch.zeros(
            self.req_to_token.shape[0], dtype=torch.int64, device=self.req_to_token.device
        )

    def own_keep(self, protected: int) -> int:
        return max(self.cfg.keep_tokens - protected, self.cfg.window + self.cfg.sink_tokens)

    def due(self, req: Any) -> bool:
        kv = req.kv
        return (
            kv.kv_committed_len - kv.cache_protected_len
            >= self.own_keep(kv.cache_protected_len) + self.cfg.interval
        )

    def reset_rows(self, rows: list[int]) -> None:
        """A row handed to a new request has evicted nothing yet."""
        if rows:
            self.evicted[torch.tensor(rows, device=self.evicted.device)] = 0

    def compress(self, req: Any, queries: torch.Tensor | None) -> Compaction:
        """Compress one request now. queries: [layers * q_heads, w, d] window queries of this row
        (layer-major, the layout of `QueryRing.window`), or None for a policy that needs none."""
        kv, L, Hk = req.kv, self.kv.layer_num, self.kv.head_num
        row, protected, n = kv.req_pool_idx, kv.cache_protected_len, kv.kv_committed_len
        if kv.kv_allocated_len != n:
            raise RuntimeError(
                f"request {req.rid}: {kv.kv_allocated_len} KV slots allocated but {n} committed; "
                "compression needs decode without over-allocation (no speculative decoding)"
            )
        keep = self.own_keep(protected)
        slots = self.req_to_token[row, protected:n].to(torch.int64)  # [own]
        own = slots.numel()
        if own <= keep:
            return Compaction(freed=0, kv_len=n)
        keys = torch.stack([self._keys(layer)[slots] for layer in range(L)])  # [L, own, Hk, d]
        keys = keys.transpose(1, 2).reshape(L * Hk, own, -1)
        idx = self.compressor.select(keys, queries, keep).view(L, Hk, keep)
        dest, heads = slots[:keep], torch.arange(Hk, device=slots.device)
        for layer in range(L):
            src = slots[idx[layer].T]  # [keep, Hk]: slot of kept entry j of head h
            for buf in (self.kv.k_buffer[layer], self.kv.v_buffer[layer]):
                buf[dest] = buf[src, heads]  # the gather copies before the write
        # SGLang's own path for giving back row ranges (reads the slots from the row, so first)
        self.tree_cache.free_kv_row(kv, [(protected + keep, n)])
        self.req_to_token[row, protected + keep : n] = 0  # slot 0 is SGLang's padding slot
        kv.kv_committed_len = kv.kv_allocated_len = protected + keep
        req.skip_radix_cache_insert = True
        self.evicted[row] += own - keep
        return Compaction(freed=own - keep, kv_len=protected + keep)

    def _keys(self, layer: int) -> torch.Tensor:
        buf = self.kv.k_buffer[layer]
        return buf if self.kv.store_dtype == self.kv.dtype else buf.view(self.kv.dtype)


def _check_pool(kv: Any) -> None:
    """Only the plain token-major MHA pool: per-slot rows of [kv_heads, head_dim] for K and V."""
    name = type(kv).__name__
    if name != "MHATokenToKVPool":
        raise ValueError(f"KV pool {name}: KV compression in SGLang supports MHATokenToKVPool only")
    if kv.is_quantized_kv_cache:
        raise ValueError("quantized KV cache (scales per slot): KV compression needs an unquantized cache")
    shape = tuple(kv.k_buffer[0].shape)
    if shape[1:] != (kv.head_num, kv.head_dim) or tuple(kv.v_buffer[0].shape)[1:] != (
        kv.head_num,
        kv.v_head_dim,
    ):
        raise ValueError(f"KV buffer layout {shape}: expected [slots, kv_heads, head_dim] (no HND layout)")
