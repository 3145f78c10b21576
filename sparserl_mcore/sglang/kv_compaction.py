"""KV compression of one running request inside SGLang's own pools (sglang 0.5.23, page size 1).

SGLang's names this module works on (all in `srt/mem_cache/`): `memory_pool.py: ReqToTokenPool`
(`req_to_token[row, pos]` = the KV slot of entry `pos` of the request on `row`),
`memory_pool.py: MHATokenToKVPool` (`k_buffer[layer][slot]` / `v_buffer[layer][slot]` =
[kv_heads, head_dim] of one token; one slot holds every layer and head of that token),
`allocator/token.py: TokenToKVPoolAllocator` (single slots; `allocator/base.py:
evict_to_free_tokens` makes room by evicting unlocked radix entries), `base_prefix_cache.py:
BasePrefixCache.free_kv_row` (gives row ranges back), and the request's `managers/schedule_batch.py:
ReqKvInfo` (`cache_protected_len`: the radix tree owns row entries [0, here) and other requests may
share their slots; `kv_committed_len` / `kv_allocated_len`: the row entries in use). Works with
the legacy `radix_cache.py: RadixCache` and with 0.5.23's default `unified_radix_cache.py:
UnifiedRadixCache` alike (only the base-class methods above are used).

The budget is the embedded engine's, on the request's WHOLE cache (prompt included, shared or not):
a request holding `budget` entries is compressed to `keep_tokens = budget - interval` entries per
layer and KV head, chosen by the shared policy over all of them (`KVCompressor.select`), so the same
request keeps the same positions here and in `rollout/engine/compaction.py`. Radix-shared slots are never
written, moved or freed (copy-on-write, as in the embedded engine): the kept entries are written
into the request's OWN slots [cache_protected_len, n), in entry order, plus freshly allocated ones
when a long shared prompt leaves the request fewer own slots than it keeps. Only the leading entries
that every layer and head keeps in place (StreamingLLM's sinks, typically) stay on their shared
slots; the row is rewritten so entry j is the j-th kept entry, `cache_protected_len` drops to that
shared head, and the rest of the own slots go back through `free_kv_row`. The request's radix lock
is kept until SGLang releases it (its shared prefix stays pinned while it runs, as without
compression).

Keys are cached after RoPE, so a kept key keeps its true position by construction; the model's NEXT
position is its kv length plus the positions this row evicted (`evicted[row]`), which the hook
wiring adds to SGLang's decode positions. The request is marked `skip_radix_cache_insert`: its row
no longer holds the KV of its tokens in order, so SGLang's release path (`mem_cache/common.py:
release_kv_cache`) must not insert it into the radix tree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from sparserl_mcore.rollout.kvcompress import KVCompressionConfig, KVCompressor


@dataclasses.dataclass(frozen=True)
class Compaction:
    """What one compression did to one request (all zero when it was postponed)."""

    freed: int  # own slots returned to SGLang's allocator
    allocated: int  # slots taken for kept entries that came from shared slots
    kv_len: int  # row entries in use afterwards
    shared: int = 0  # leading entries still on radix-shared slots


@dataclasses.dataclass(frozen=True)
class HeadReplicas:
    """This TP rank's share of the attention heads, as SGLang 0.5.23 cuts them
    (`layers/linear.py: QKVParallelLinear`): rank r holds query heads [r * Hq_l, (r + 1) * Hq_l);
    with more ranks than KV heads, each KV head is replicated on `replicas` consecutive ranks
    (rank r holds KV head r // replicas), and its query heads are spread over those ranks.

    A KV head is scored with ALL the query heads of its group on every replica (gathered over
    `group`, SGLang's TP group), so every replica keeps the same positions and the result does not
    depend on the TP size. Without replication a rank holds whole groups: nothing to gather."""

    rank: int = 0
    size: int = 1
    replicas: int = 1
    group: Any = None  # torch.distributed ProcessGroup of the TP ranks (None: TP 1)

    @classmethod
    def of(cls, *, rank: int, size: int, total_kv_heads: int, group: Any) -> HeadReplicas:
        replicas = size // total_kv_heads if size >= total_kv_heads else 1
        return cls(rank=rank, size=size, replicas=replicas, group=group)

    def group_queries(self, queries: torch.Tensor, layers: int) -> torch.Tensor:
        """Window queries [layers * Hq_l, w, d] of this rank -> those of its KV heads' whole groups
        [layers * replicas * Hq_l, w, d] (layer-major, query heads in global order). Collective
        over `group` when replicated: every TP rank must call it for the same request."""
        if self.replicas == 1:
            return queries
        parts = [torch.empty_like(queries) for _ in range(self.size)]
        dist.all_gather(parts, queries.contiguous(), group=self.group)
        first = self.rank // self.replicas * self.replicas
        mine = torch.stack(parts[first : first + self.replicas])  # [R, L * Hq_l, w, d]
        mine = mine.view(self.replicas, layers, -1, *queries.shape[1:]).transpose(0, 1)  # [L, R, Hq_l, w, d]
        return mine.reshape(-1, *queries.shape[1:])


class SGLangCompactor:
    """Compresses requests whose cache reached the budget, on SGLang's real pools."""

    def __init__(
        self,
        kv_cfg: KVCompressionConfig,
        compressor: KVCompressor,
        tree_cache: Any,
        heads: HeadReplicas | None = None,
    ) -> None:
        self.cfg, self.compressor, self.tree_cache = kv_cfg, compressor, tree_cache
        self.heads = heads or HeadReplicas()
        self.req_to_token = tree_cache.req_to_token_pool.req_to_token
        self.allocator = tree_cache.token_to_kv_pool_allocator
        if self.allocator.page_size != 1:
            raise ValueError(
                f"page size {self.allocator.page_size}: KV compression in SGLang needs --page-size 1"
            )
        self.kv = self.allocator.get_kvcache()
        _check_pool(self.kv)
        # positions each req_to_token row evicted since its request took it (reset on allocation)
        self.evicted = torch.zeros(
            self.req_to_token.shape[0], dtype=torch.int64, device=self.req_to_token.device
        )

    def due(self, req: Any) -> bool:
        """The embedded engine's trigger (`KVCompressionConfig.should_compress`) on the whole row."""
        return self.cfg.should_compress(req.kv.kv_committed_len)

    def compressed(self, req: Any) -> bool:
        """The request's row has been compressed since it was (re)admitted."""
        row = req.kv.req_pool_idx
        return row is not None and int(self.evicted[row]) > 0

    def reset_rows(self, rows: list[int]) -> None:
        """A row handed to a new request has evicted nothing yet."""
        if rows:
            self.evicted[torch.tensor(rows, device=self.evicted.device)] = 0

    def select(self, req: Any, queries: torch.Tensor | None) -> torch.Tensor:
        """Entries [layers, kv_heads, keep] of the request's row the policy keeps (ascending)."""
        kv, L, Hk = req.kv, self.kv.layer_num, self.kv.head_num
        slots = self.req_to_token[kv.req_pool_idx, : kv.kv_committed_len].to(torch.int64)
        keys = torch.stack([self._keys(layer)[slots] for layer in range(L)])  # [L, n, Hk, d]
        keys = keys.transpose(1, 2).reshape(L * Hk, slots.numel(), -1)
        keep = min(self.cfg.keep_tokens, slots.numel())
        if queries is not None:
            queries = self.heads.group_queries(queries, L)
        return self.compressor.select(keys, queries, keep).view(L, Hk, keep)

    def compress(self, req: Any, queries: torch.Tensor | None, *, reserve: int = 0) -> Compaction:
        """Compress one request now. queries: [layers * q_heads, w, d] window queries of its row
        (layer-major, `QueryRing.window_queries`), or None for a policy that needs none. `reserve`:
        free slots to leave for the rest of the step (the batch's decode tokens); when copying
        shared entries would need more slots than are free, nothing changes (postponed)."""
        kv = req.kv
        row, protected, n = kv.req_pool_idx, kv.cache_protected_len, kv.kv_committed_len
        if kv.kv_allocated_len != n:
            raise RuntimeError(
                f"request {req.rid}: {kv.kv_allocated_len} KV slots allocated but {n} committed; "
                "compression needs decode without over-allocation (no speculative decoding)"
            )
        keep = self.cfg.keep_tokens
        if n <= keep:
            return Compaction(freed=0, allocated=0, kv_len=n, shared=protected)
        idx = self.select(req, queries)
        shared = _kept_in_place(idx, protected)
        slots = self.req_to_token[row, :n].to(torch.int64)
        need, own = keep - shared, n - protected
        extra = self._take(need - own, reserve) if need > own else slots[:0]
        if extra is None:
            return Compaction(freed=0, allocated=0, kv_len=n, shared=protected)
        dest = torch.cat([slots[protected : protected + min(need, own)], extra.to(slots.device)])
        heads = torch.arange(self.kv.head_num, device=slots.device)
        for layer in range(self.kv.layer_num):
            src = slots[idx[layer, :, shared:].T]  # [need, Hk]: slot of kept entry j of head h
            for buf in (self.kv.k_buffer[layer], self.kv.v_buffer[layer]):
                buf[dest] = buf[src, heads]  # the gather copies before the write
        if need < own:  # SGLang's own path for row ranges (reads the slots from the row, so first)
            self.tree_cache.free_kv_row(kv, [(protected + need, n)])
        self.req_to_token[row, shared:keep] = dest.to(self.req_to_token.dtype)
        self.req_to_token[row, keep:n] = 0  # slot 0 is SGLang's padding slot
        kv.kv_committed_len = kv.kv_allocated_len = keep
        kv.cache_protected_len = shared
        req.skip_radix_cache_insert = True
        self.evicted[row] += n - keep
        return Compaction(freed=max(0, own - need), allocated=extra.numel(), kv_len=keep, shared=shared)

    def _take(self, count: int, reserve: int) -> torch.Tensor | None:
        """`count` fresh slots, leaving `reserve` free; evicts unlocked radix entries first (what
        SGLang's `alloc_token_slots` does). None when the pool cannot spare them now."""
        self.allocator.evict_to_free_tokens(self.tree_cache, count + reserve)
        if self.allocator.available_size() < count + reserve:
            return None
        slots: torch.Tensor | None = self.allocator.alloc(count)
        return slots

    def _keys(self, layer: int) -> torch.Tensor:
        buf = self.kv.k_buffer[layer]
        return buf if self.kv.store_dtype == self.kv.dtype else buf.view(self.kv.dtype)


def _kept_in_place(idx: torch.Tensor, protected: int) -> int:
    """Leading entries [0, m) that every layer and head keeps where they are, m <= protected: they
    can stay on their (shared) slots. idx: [L, Hk, keep], ascending per head."""
    keep = idx.shape[-1]
    same = (idx == torch.arange(keep, device=idx.device)).flatten(0, 1).all(dim=0)  # [keep]
    return min(int(same.sum()), protected)  # ascending + distinct: the matches are a prefix


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
