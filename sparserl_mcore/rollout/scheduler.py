"""Continuous batching over the paged pool: one `step()` = admit, one forward, sample, compress, retire.

Every step runs ONE forward over a mixed batch: one token for each running (decoding) request and
the uncached prompt tail of each newly admitted one. Requests join and leave at every step.

Memory rules (see docs/rollout.md, "Engine"):
- A request's page table = radix-shared prompt pages (read-only) + private pages.
- Prompts are inserted into the radix tree right after their prefill; only whole pages are shared,
  so decode never writes into a shared page. Admitted requests whose prompt shares a not-yet-cached
  page prefix with another request admitted in the same step wait one step and then hit the cache
  (the G samples of a GRPO prompt prefill once).
- Compression (copy-on-write): the kept entries of every layer/head are gathered out of the pool,
  ALL the request's page references are dropped (private pages return to the free list, shared
  ones stay with the tree and the other requests), and the kept entries are written, compacted
  into slot order, into freshly allocated private pages. Shared pages are never modified.
- Out of pages: evict unreferenced radix leaves (LRU), then retract the youngest running request
  (its pages are freed and it restarts from its prompt later, with its seed re-applied).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparserl_mcore.rollout.compression_lanes import CompressionLanes
from sparserl_mcore.rollout.hf_model import CausalLM
from sparserl_mcore.rollout.host_ints import long_tensor
from sparserl_mcore.rollout.kv_pool import KVPool, PoolExhaustedError
from sparserl_mcore.rollout.kvcompress import KVCompressionConfig, KVCompressor
from sparserl_mcore.rollout.paged_attention import (
    CROSS_HEAD_MAX_KV_HEADS,
    DecodeLayout,
    decode_attention,
    native_decode_kernel,
    prefill_attention,
)
from sparserl_mcore.rollout.protocol import FinishReason, GenerateRequest, KVStats, Sample
from sparserl_mcore.rollout.radix_cache import RadixCache
from sparserl_mcore.rollout.sampler import sample

# Called after each compression with (rid, original positions kept [layers, kv_heads, n_keep], the
# position the next token will take). Tests rebuild the "retained positions only" recompute from it.
# The positions tensor is created under inference_mode: read it (or .clone() it), never modify it.
CompressionListener = Callable[[str, torch.Tensor, int], None]
StopTextFn = Callable[[list[int]], str]


@dataclass(eq=False)
class RequestState:
    """Scheduler-side state of one request (reset completely when it is retracted)."""

    req: GenerateRequest
    rid: str
    generator: torch.Generator
    order: int = 0
    pages: list[int] = field(default_factory=list)
    slots: torch.Tensor | None = None  # flat slot ids of `pages`, built on demand (Scheduler._slots)
    n_cached: int = 0  # cache entries in use (per layer and KV head)
    next_pos: int = 0  # RoPE position of the next token fed in
    cached_prompt_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    q_seen: int = 0  # queries pushed to its window ring
    lane: int | None = None  # its lane of Scheduler.lanes (window queries, h2o's attention mass)
    kept_positions: torch.Tensor | None = None  # [L, Hk, k] positions of slots [0, k) after compressing
    tail_start: int = 0  # position of slot k (later slots hold consecutive positions)
    peak_retained: int = 0
    peak_pages: int = 0
    evictions: int = 0
    compressions: int = 0
    result: Sample | None = None
    error: BaseException | None = None

    def reset(self) -> None:
        """Back to "never started" (retraction): it will restart from its prompt."""
        self.__dict__.update(RequestState(req=self.req, rid=self.rid, generator=self.generator).__dict__)


@dataclass
class SchedulerStats:
    steps: int = 0
    retractions: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0


class Scheduler:
    """Owns the waiting queue, the running batch, and the pages they hold."""

    def __init__(
        self,
        model: CausalLM,
        pool: KVPool,
        radix: RadixCache | None,
        kv_cfg: KVCompressionConfig,
        compressor: KVCompressor | None,
        *,
        max_running: int,
        max_prefill_tokens: int,
        stop_text: StopTextFn | None,
    ) -> None:
        self.model, self.pool, self.radix = model, pool, radix
        self.kv_cfg, self.compressor = kv_cfg, compressor
        self.max_running, self.max_prefill_tokens = max_running, max_prefill_tokens
        self.stop_text = stop_text
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.listeners: list[CompressionListener] = []
        self.aborted: set[str] = set()
        self.stats = SchedulerStats()
        self.lanes = (
            CompressionLanes(
                layers=model.cfg.num_layers,
                q_heads=model.cfg.num_heads,
                kv_heads=model.cfg.num_kv_heads,
                head_dim=model.cfg.head_dim,
                window=kv_cfg.window,
                lanes=max_running,
                queries=compressor.needs_window_queries,
                mass=compressor.needs_accumulated_attention,
                dtype=pool.k.dtype,
                device=pool.k.device,
            )
            if compressor is not None
            else None
        )
        # pool row (l * S + slot) * Hk + h of entry (layer l, slot, KV head h) = slot * Hk + this[l, h]
        dev, L, Hk = pool.k.device, model.cfg.num_layers, model.cfg.num_kv_heads
        layer_rows = torch.arange(L, device=dev).view(L, 1, 1) * (pool.num_pages * pool.page_size * Hk)
        self._pool_row_offsets = layer_rows + torch.arange(Hk, device=dev).view(Hk, 1)  # [L, Hk, 1]
        self.weight_version = 0
        self._order = 0

    @property
    def idle(self) -> bool:
        """No request queued or running (read without the engine's locks: a snapshot)."""
        return not self.waiting and not self.running

    @torch.inference_mode()
    def step(self) -> list[RequestState]:
        """Advance every request by one token; returns the requests that finished.

        Runs under inference_mode (no autograd bookkeeping on any op); the per-request tensors it
        creates (slot tables, query windows, kept positions) are only ever modified inside step()."""
        finished = self._take_aborted()
        decodes = self._reserve_decode_slots()
        prefills = self._admit(finished)
        if decodes or prefills:
            self.stats.steps += 1
            logits = self._forward(decodes, prefills)
            batch = decodes + prefills
            tokens, logprobs = sample(logits, [r.req.sampling for r in batch], [r.generator for r in batch])
            for r in prefills:
                self._cache_prompt(r)
            for r, tok, lp in zip(batch, tokens, logprobs, strict=True):
                reason = self._append(r, tok, lp)
                if reason is not None:
                    self._finish(r, reason)
                    finished.append(r)
            self._compress_due(batch)
        return finished

    # ---- admission and memory ------------------------------------------------------------------
    def _take_aborted(self) -> list[RequestState]:
        done = []
        for r in [r for r in (*self.waiting, *self.running) if r.rid in self.aborted]:
            if r in self.waiting:
                self.waiting.remove(r)
            self._finish(r, "abort")
            done.append(r)
        self.aborted.clear()
        return done

    def _reserve_decode_slots(self) -> list[RequestState]:
        """Give each running request room for its next token (a new page when the last is full)."""
        for r in list(self.running):
            if r in self.running and r.n_cached == len(r.pages) * self.pool.page_size:
                pages = self._alloc(1, requester=r, may_retract_requester=True)
                if pages is not None:
                    self._set_pages(r, r.pages + pages)
        return list(self.running)

    def _admit(self, finished: list[RequestState]) -> list[RequestState]:
        """Start waiting requests while pages and limits allow; a prompt that cannot fit even in an
        idle pool fails alone (appended to `finished` with its error)."""
        admitted: list[RequestState] = []
        budget = self.max_prefill_tokens
        for r in list(self.waiting):
            if len(self.running) >= self.max_running or (admitted and budget <= 0):
                break
            prompt, ps = r.req.input_ids, self.pool.page_size
            limit = (len(prompt) - 1) // ps * ps  # at least one prompt token is always computed
            shared = self.radix.match(prompt, limit) if self.radix is not None else []
            if self.radix is not None and any(
                _common_pages(prompt, a.req.input_ids, limit, ps) > len(shared) for a in admitted
            ):
                self.pool.decref(shared)  # wait one step: the other request's prefill will be cached
                continue
            own = self._alloc(math.ceil(len(prompt) / ps) - len(shared), requester=None)
            if own is None:
                self.pool.decref(shared)
                if self.running or admitted:
                    break  # memory returns as running requests finish
                r.error = PoolExhaustedError(
                    f"a {len(prompt)}-token prompt needs more pages than the pool has "
                    f"({self.pool.num_pages} of {ps} tokens); raise capacity_pages / capacity_bytes"
                )
                self.waiting.remove(r)
                finished.append(r)
                continue
            self.waiting.remove(r)
            self._start(r, shared, own)
            admitted.append(r)
            budget -= len(prompt) - r.n_cached
            self.stats.prefill_tokens += len(prompt) - r.n_cached
        return admitted

    def _start(self, r: RequestState, shared: list[int], own: list[int]) -> None:
        self._order += 1
        r.order = self._order
        self._set_pages(r, shared + own)
        r.n_cached = r.next_pos = r.cached_prompt_tokens = len(shared) * self.pool.page_size
        self.running.append(r)
        if r.req.sampling.seed is not None:
            r.generator.manual_seed(r.req.sampling.seed)
        if self.lanes is not None:  # mass: decode never exceeds the budget (hard cap), prefill the prompt
            ps = self.pool.page_size
            r.lane = self.lanes.acquire(-(-max(self.kv_cfg.budget, len(r.req.input_ids)) // ps) * ps)

    def _alloc(
        self, n: int, *, requester: RequestState | None, may_retract_requester: bool = False
    ) -> list[int] | None:
        """n pages: from the free list, else by evicting radix leaves, else by retracting the youngest
        running request. Returns None when the requester itself was retracted, or (requester None:
        admission) when memory is short, since admission never retracts."""
        while True:
            try:
                return self.pool.alloc(n)
            except PoolExhaustedError:
                if self.radix is not None and self.radix.evict(n - self.pool.num_free) > 0:
                    continue
                if requester is None:
                    return None
                victims = [x for x in self.running if may_retract_requester or x is not requester]
                if not victims:
                    raise
                victim = max(victims, key=lambda x: x.order)
                self._retract(victim)
                if victim is requester:
                    return None

    def _retract(self, r: RequestState) -> None:
        self.running.remove(r)
        self.pool.decref(r.pages)
        self._release_lane(r)
        r.reset()
        self.waiting.appendleft(r)
        self.stats.retractions += 1

    def _set_pages(self, r: RequestState, pages: list[int]) -> None:
        r.pages = pages
        r.slots = None  # decode steps address pages directly; only prefill and compression need slots
        r.peak_pages = max(r.peak_pages, len(pages))

    def _slots(self, r: RequestState) -> torch.Tensor:
        """Flat slot ids of r's pages, built when first needed after its pages changed (a decode
        step that adds a page would otherwise pay several ops for a table it never reads)."""
        if r.slots is None:
            r.slots = self.pool.slot_table(r.pages)
        return r.slots

    def _cache_prompt(self, r: RequestState) -> None:
        if self.radix is not None:
            full = len(r.req.input_ids) // self.pool.page_size
            self.radix.insert(r.req.input_ids, r.pages[:full])

    # ---- the forward ---------------------------------------------------------------------------
    def _forward(self, decodes: list[RequestState], prefills: list[RequestState]) -> torch.Tensor:
        """One mixed forward; writes the new K/V into the pool; returns logits [B, V] (decodes first)."""
        dev, model, ps = self.pool.k.device, self.model, self.pool.page_size
        # token ids, RoPE positions and pool slots of every new token, as Python ints: one tensor
        ids, pos, write, prefill_tokens = [], [], [], []
        for r in decodes:
            ids.append(r.output_ids[-1])
            pos.append(r.next_pos)
            write.append(r.pages[r.n_cached // ps] * ps + r.n_cached % ps)
        for r in prefills:
            n = len(r.req.input_ids)
            ids.extend(r.req.input_ids[r.n_cached :])
            pos.extend(range(r.n_cached, n))
            write.extend(r.pages[i // ps] * ps + i % ps for i in range(r.n_cached, n))
            prefill_tokens.append(n - r.n_cached)
        ids_t, pos_t, write = long_tensor(ids + pos + write, dev).view(3, -1)
        cos, sin = model.rope(pos_t, max(pos) + 1)
        n_dec = len(decodes)
        layout = self._decode_layout(decodes) if decodes else None
        ends = list(itertools.accumulate(prefill_tokens))
        starts = [0, *ends[:-1]] if ends else []
        want_mass = self.compressor is not None and self.compressor.needs_accumulated_attention
        want_queries = self.compressor is not None and self.compressor.needs_window_queries
        # decode-only steps (most steps): the window rows are all rows, a slice of q, no gather
        window_rows = self._window_rows(n_dec, prefill_tokens) if want_queries and prefills else None
        q_rows, masses = [], []
        h = model.embed(ids_t)
        for layer in range(model.cfg.num_layers):
            q, k, v = model.qkv(layer, h, cos, sin)
            kf, vf = self.pool.k_flat(layer), self.pool.v_flat(layer)
            kf.index_copy_(0, write, k)
            vf.index_copy_(0, write, v)
            outs, layer_mass = [], []
            if decodes:
                out, mass = decode_attention(
                    q[:n_dec], self.pool.k_rows(layer), self.pool.v_rows(layer), layout, want_mass=want_mass
                )
                outs.append(out)
                layer_mass.append(mass)
            for r, start, end in zip(prefills, starts, ends, strict=True):
                sl = self._slots(r)[: len(r.req.input_ids)]
                out, mass = prefill_attention(q[n_dec + start : n_dec + end], kf, vf, sl, want_mass=want_mass)
                outs.append(out)
                layer_mass.append(mass)
            if want_queries:
                q_rows.append(q[:n_dec] if window_rows is None else q.index_select(0, window_rows))
            masses.append(layer_mass)
            h = model.finish_layer(layer, h, outs[0] if len(outs) == 1 else torch.cat(outs))
        self._after_forward(decodes, prefills, q_rows, masses if want_mass else None)
        if prefills:  # only each prompt's last position samples
            last = list(range(n_dec)) + [n_dec + e - 1 for e in ends]
            h = h.index_select(0, long_tensor(last, dev))
        return model.logits(h)

    def _decode_layout(self, decodes: list[RequestState]) -> DecodeLayout:
        """Page tables padded with page 0 (real, finite, masked) and masks, built once per step and
        shared by every layer's decode attention."""
        ps = self.pool.page_size
        lengths = [r.n_cached + 1 for r in decodes]
        tables = [r.pages[: -(-n // ps)] for r, n in zip(decodes, lengths, strict=True)]
        dtype, device, cfg = self.pool.k.dtype, self.pool.k.device, self.model.cfg
        cross = (
            (cfg.num_heads, cfg.num_kv_heads)
            if self.compressor is not None
            and self.compressor.needs_accumulated_attention
            and cfg.num_kv_heads <= CROSS_HEAD_MAX_KV_HEADS
            and native_decode_kernel(device, dtype) is None  # the kernel returns the mass itself
            else None
        )
        return DecodeLayout.build(
            tables, lengths, page_size=ps, dtype=dtype, device=device, cross_heads=cross
        )

    def _window_rows(self, n_dec: int, prefill_tokens: list[int]) -> torch.Tensor:
        """Rows whose queries enter the observation window: every decode row, each prompt's last w."""
        rows, start, w = list(range(n_dec)), n_dec, self.kv_cfg.window
        for t in prefill_tokens:
            rows.extend(range(start + max(0, t - w), start + t))
            start += t
        return long_tensor(rows, self.pool.k.device)

    def _after_forward(
        self,
        decodes: list[RequestState],
        prefills: list[RequestState],
        q_rows: list[torch.Tensor],
        masses: list[list[torch.Tensor]] | None,
    ) -> None:
        """Advance counters; record window queries and (h2o) attention mass, all requests at once."""
        dev, w = self.pool.k.device, self.kv_cfg.window
        # per layer, masses hold [decode mass [B, Hk, N]] (when decoding) + one [Hk, n] per prefill
        if masses and decodes:  # [L, B, Hk, N], slot order
            lanes = long_tensor([r.lane for r in decodes], dev)
            self.lanes.add_mass(lanes, torch.stack([m[0] for m in masses]))
        if q_rows:  # ring rows of the rows of _window_rows: 1 per decode, the last <= w of a prompt
            rows = [self.lanes.ring_row(r.lane, r.q_seen) for r in decodes]
            for r in prefills:
                seen, n_rows = r.q_seen, min(len(r.req.input_ids) - r.n_cached, w)
                rows.extend(self.lanes.ring_row(r.lane, seen + j) for j in range(n_rows))
            rows_t = long_tensor(rows, dev)
            self.lanes.push_queries(rows_t, torch.stack(q_rows))  # [L, rows, Hq, d]
        for i, r in enumerate(decodes + prefills):
            t = 1 if i < len(decodes) else len(r.req.input_ids) - r.n_cached
            if q_rows:
                r.q_seen += 1 if i < len(decodes) else min(t, w)
            if masses is not None and i >= len(decodes):
                prefill_mass = torch.stack([m[i - len(decodes) + bool(decodes)] for m in masses])
                self.lanes.mass[:, r.lane, :, : r.n_cached + t] += prefill_mass
            r.n_cached += t
            r.next_pos += t
            r.peak_retained = max(r.peak_retained, r.n_cached)

    # ---- per-token bookkeeping -----------------------------------------------------------------
    def _append(self, r: RequestState, token: int, logprob: float) -> FinishReason | None:
        r.output_ids.append(token)
        r.logprobs.append(logprob)
        self.stats.generated_tokens += 1
        sp = r.req.sampling
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.model.cfg.eos_token_ids):
            return "stop"
        if sp.stop and self.stop_text is not None:
            tail = self.stop_text(r.output_ids[-(max(len(s) for s in sp.stop) + 2) :])
            if any(s in tail for s in sp.stop):
                return "stop"
        return "length" if len(r.output_ids) >= sp.max_new_tokens else None

    def _finish(self, r: RequestState, reason: FinishReason) -> None:
        if r in self.running:
            self.running.remove(r)
            self.pool.decref(r.pages)
        self._release_lane(r)
        r.pages = []
        r.result = Sample(
            rid=r.rid,
            prompt_ids=r.req.input_ids,
            output_ids=tuple(r.output_ids),
            output_logprobs=tuple(r.logprobs),
            finish_reason=reason,
            kv_stats=KVStats(
                peak_retained_tokens=r.peak_retained,
                evictions=r.evictions,
                compressions=r.compressions,
                peak_pages=r.peak_pages,
                peak_kv_bytes=r.peak_pages * self.pool.page_bytes,
            ),
            weight_version=self.weight_version,
            cached_prompt_tokens=r.cached_prompt_tokens,
        )

    # ---- compression ---------------------------------------------------------------------------
    def _compress_due(self, batch: list[RequestState]) -> None:
        """Compress every running request of the batch that reached the budget.

        Requests with the same cache length and window fill are compressed together in ONE
        `select` call: layers and requests are stacked along the head axis, which is exact because
        every policy scores and selects each KV head on its own (queries follow their KV head's
        block, so the GQA grouping h // group still holds)."""
        if self.compressor is None:
            return
        due = [r for r in batch if r in self.running and self.kv_cfg.should_compress(r.n_cached)]
        groups: dict[tuple[int, int], list[RequestState]] = {}
        for r in due:
            groups.setdefault((r.n_cached, min(r.q_seen, self.kv_cfg.window)), []).append(r)
        for group in groups.values():
            self._compress_group(group)

    def _compress_group(self, rs: list[RequestState]) -> None:
        """Keep `keep_tokens` entries per layer and KV head, compacted into fresh private pages."""
        assert self.compressor is not None
        cfg, L = self.model.cfg, self.model.cfg.num_layers
        B, n, keep, d, Hk = len(rs), rs[0].n_cached, self.kv_cfg.keep_tokens, cfg.head_dim, cfg.num_kv_heads
        slots = torch.stack([self._slots(r)[:n] for r in rs])  # [B, n]
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
            if r in self.running:
                self._set_pages(r, self._alloc(math.ceil(keep / self.pool.page_size), requester=r))
        live = [b for b, r in enumerate(rs) if r in self.running]
        if not live:
            return
        new_slots = torch.cat([self._slots(rs[b])[:keep] for b in live])
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

    def _release_lane(self, r: RequestState) -> None:
        if r.lane is not None:
            self.lanes.release(r.lane)
            r.lane = None

    def _group_positions(self, rs: list[RequestState], n: int) -> torch.Tensor:
        """Original token position of each of the first n slots of each request, per layer and KV
        head: [B, L, Hk, n]. Slots [0, k) hold the positions the last compression kept (none before
        the first), later slots consecutive positions from `tail_start`."""
        cfg, dev = self.model.cfg, self.pool.k.device
        widths = [0 if r.kept_positions is None else r.kept_positions.shape[-1] for r in rs]
        starts = torch.tensor([r.tail_start - k for r, k in zip(rs, widths, strict=True)], device=dev)
        pos = (starts[:, None] + torch.arange(n, device=dev)).view(len(rs), 1, 1, n)
        pos = pos.expand(-1, cfg.num_layers, cfg.num_kv_heads, -1)
        based = [b for b, k in enumerate(widths) if k]
        if not based:
            return pos
        pos = pos.clone()
        pos[based, :, :, : widths[based[0]]] = torch.stack([rs[b].kept_positions for b in based])
        return pos


def _common_pages(a: tuple[int, ...], b: tuple[int, ...], limit: int, page_size: int) -> int:
    """Whole pages of a[:limit] that b shares as a prefix."""
    n = 0
    while n + page_size <= min(limit, len(b)) and a[n : n + page_size] == b[n : n + page_size]:
        n += page_size
    return n // page_size
