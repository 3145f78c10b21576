"""KV compression of running requests: select what to keep, compact it into fresh private pages.

Copy-on-write: the kept entries of every layer/head are gathered out of the pool, ALL the
request's page references are dropped (private pages return to the free list, shared ones stay
with the radix tree and the other requests), and the kept entries are written, compacted into slot
order, into freshly allocated private pages. Shared pages are never modified.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from model_providers.hf_config import HFModelConfig
from sparserl_mcore.rollout.engine.compression_lanes import CompressionLanes
from sparserl_mcore.rollout.engine.kv_pool import KVPool
from sparserl_mcore.rollout.engine.request_state import CompressionListener, RequestState
from sparserl_mcore.rollout.kvcompress import KVCompressionConfig, KVCompressor

# (pages wanted, requester) -> pages, or None when memory ran so short that the requester itself
# was retracted (Scheduler.alloc; it may retract other running requests too)
Alloc = Callable[[int, RequestState], list[int] | None]


class Compactor:
    """Compresses the requests of a step that reached the budget (see the module docstring)."""

    def __init__(
        self,
        model_cfg: HFModelConfig,
        pool: KVPool,
        kv_cfg: KVCompressionConfig,
        compressor: KVCompressor,
        lanes: CompressionLanes,
        listeners: list[CompressionListener],
    ) -> None:
        self.cfg, self.pool, self.kv_cfg = model_cfg, pool, kv_cfg
        self.compressor, self.lanes, self.listeners = compressor, lanes, listeners
        # pool row (l * S + slot) * Hk + h of entry (layer l, slot, KV head h) = slot * Hk + this[l, h]
        dev, L, Hk = pool.k.device, model_cfg.num_layers, model_cfg.num_kv_heads
        layer_rows = torch.arange(L, device=dev).view(L, 1, 1) * (pool.num_pages * pool.page_size * Hk)
        self._pool_row_offsets = layer_rows + torch.arange(Hk, device=dev).view(Hk, 1)  # [L, Hk, 1]

    def compress_due(self, batch: list[RequestState], running: list[RequestState], alloc: Alloc) -> None:
        """Compress every request of the batch still in `running` that reached the budget.

        Requests with the same cache length and window fill are compressed together in ONE
        `select` call: layers and requests are stacked along the head axis, which is exact because
        every policy scores and selects each KV head on its own (queries follow their KV head's
        block, so the GQA grouping h // group still holds)."""
        due = [r for r in batch if r in running and self.kv_cfg.should_compress(r.n_cached)]
        groups: dict[tuple[int, int], list[RequestState]] = {}
        for r in due:
            groups.setdefault((r.n_cached, min(r.q_seen, self.kv_cfg.window)), []).append(r)
        for group in groups.values():
            self._compress_group(group, running, alloc)

    def _compress_group(self, rs: list[RequestState], running: list[RequestState], alloc: Alloc) -> None:
        """Keep `keep_tokens` entries per layer and KV head, compacted into fresh private pages."""
        cfg, L = self.cfg, self.cfg.num_layers
        B, n, keep, d, Hk = len(rs), rs[0].n_cached, self.kv_cfg.keep_tokens, cfg.head_dim, cfg.num_kv_heads
        slots = torch.stack([r.slot_table(self.pool)[:n] for r in rs])  # [B, n]
        flat, dev = slots.view(-1), slots.device
        # keys [B * L * Hk, n, d] for scoring, copied out of the pool with all layers in one gather
        pool_k, pool_v = self.pool.k.view(L, -1, Hk, d), self.pool.v.view(L, -1, Hk, d)
        keys = pool_k.index_select(1, flat).view(L, B, n, Hk, d).permute(1, 0, 3, 2, 4).reshape(-1, n, d)
        lanes = torch.tensor([r.lane for r in rs], device=dev)
        queries = None
        if self.compressor.needs_window_queries:  # the group shares min(q_seen, window) (its key)
            w = self.kv_cfg.window
            seen = min(rs[0].q_seen, w)
            ring = [[(r.q_seen - seen + j) % w for j in range(seen)] for r in rs]  # oldest first
            queries = self.lanes.window_queries(lanes, torch.tensor(ring, device=dev))
            queries = queries.reshape(-1, seen, d)  # [B, L, Hq, w, d] -> [B * L * Hq, w, d]
        acc = self.lanes.read_mass(lanes, n) if self.lanes.mass is not None else None  # [B, L, Hk, n]
        idx = self.compressor.select(
            keys, queries, keep, acc.reshape(-1, n) if acc is not None else None
        ).view(B, L, -1, keep)
        # kept K/V straight from the pool in the destination layout [L, B, keep, Hk, d], read before
        # the pages are released below: entry (l, b, j, h) is row (l * S + slot) * Hk + h of the
        # pool viewed as [L * S * Hk, d] (one index_select: cheaper than 3-index advanced indexing)
        src = slots.view(B, 1, 1, n).expand(B, L, Hk, n).gather(3, idx)  # [B, L, Hk, keep]
        rows = (src * Hk + self._pool_row_offsets).permute(1, 0, 3, 2).reshape(-1)
        kept_k, kept_v = (
            x.view(-1, d).index_select(0, rows).view(L, B, keep, Hk, d) for x in (pool_k, pool_v)
        )
        kept_pos = self._group_positions(rs, n).gather(3, idx)
        for r in rs:
            self.pool.decref(r.pages)
            r.pages = []
        for r in rs:  # allocation may retract younger requests, members of this group included
            if r in running:
                pages = alloc(math.ceil(keep / self.pool.page_size), r)
                if pages is not None:
                    r.set_pages(pages)
        live = [b for b, r in enumerate(rs) if r in running]
        if not live:
            return
        new_slots = torch.cat([rs[b].slot_table(self.pool)[:keep] for b in live])
        if len(live) < B:  # indexing by a list is a gather: only after a retraction
            kept_k, kept_v, idx, lanes = kept_k[:, live], kept_v[:, live], idx[live], lanes[live]
            acc = acc[live] if acc is not None else None
        # slot-major [L, live * keep, Hk, d], all layers in one write
        pool_k.index_copy_(1, new_slots, kept_k.reshape(L, -1, Hk, d))
        pool_v.index_copy_(1, new_slots, kept_v.reshape(L, -1, Hk, d))
        if acc is not None:
            self.lanes.replace_mass(lanes, acc.gather(3, idx))
        for b in live:
            r = rs[b]
            r.kept_positions, r.tail_start = kept_pos[b], r.next_pos
            r.evictions += n - keep
            r.compressions += 1
            r.n_cached = keep
            for listener in self.listeners:
                listener(r.rid, r.kept_positions, r.next_pos)

    def _group_positions(self, rs: list[RequestState], n: int) -> torch.Tensor:
        """Original token position of each of the first n slots of each request, per layer and KV
        head: [B, L, Hk, n]. Slots [0, k) hold the positions the last compression kept (none before
        the first), later slots consecutive positions from `tail_start`."""
        cfg, dev = self.cfg, self.pool.k.device
        widths = [0 if r.kept_positions is None else r.kept_positions.shape[-1] for r in rs]
        starts = torch.tensor([r.tail_start - k for r, k in zip(rs, widths, strict=True)], device=dev)
        pos = (starts[:, None] + torch.arange(n, device=dev)).view(len(rs), 1, 1, n)
        pos = pos.expand(-1, cfg.num_layers, cfg.num_kv_heads, -1)
        based = [b for b, k in enumerate(widths) if k]
        if not based:
            return pos
        pos = pos.clone()
        pos[based, :, :, : widths[based[0]]] = torch.stack([_kept(rs[b]) for b in based])
        return pos


def _kept(r: RequestState) -> torch.Tensor:
    assert r.kept_positions is not None
    return r.kept_positions
