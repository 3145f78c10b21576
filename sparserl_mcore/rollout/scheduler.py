"""Continuous batching over the paged pool: one `step()` = admit, one forward, sample, compress, retire.

Every step runs ONE forward (batch_forward.py) over a mixed batch: one token for each running
(decoding) request and the uncached prompt tail of each newly admitted one. Requests join and
leave at every step. This module owns admission, memory and retirement; compression is
compaction.py's.

Memory rules (see docs/rollout.md, "Engine"):
- A request's page table = radix-shared prompt pages (read-only) + private pages.
- Prompts are inserted into the radix tree right after their prefill; only whole pages are shared,
  so decode never writes into a shared page. Admitted requests whose prompt shares a not-yet-cached
  page prefix with another request admitted in the same step wait one step and then hit the cache
  (the G samples of a GRPO prompt prefill once).
- Compression is copy-on-write into fresh private pages (compaction.py); shared pages are never
  modified.
- Out of pages: evict unreferenced radix leaves (LRU), then retract the youngest running request
  (its pages are freed and it restarts from its prompt later, with its seed re-applied).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparserl_mcore.rollout.batch_forward import BatchForward
from sparserl_mcore.rollout.compaction import Compactor
from sparserl_mcore.rollout.compression_lanes import CompressionLanes
from sparserl_mcore.rollout.hf_model import CausalLM
from sparserl_mcore.rollout.kv_pool import KVPool, PoolExhaustedError
from sparserl_mcore.rollout.kvcompress import KVCompressionConfig, KVCompressor
from sparserl_mcore.rollout.protocol import FinishReason, KVStats, Sample
from sparserl_mcore.rollout.radix_cache import RadixCache
from sparserl_mcore.rollout.request_state import CompressionListener, RequestState
from sparserl_mcore.rollout.sampler import sample

__all__ = ["CompressionListener", "RequestState", "Scheduler", "SchedulerStats"]

StopTextFn = Callable[[list[int]], str]


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
        self._forward = BatchForward(model, pool, kv_cfg, compressor, self.lanes)
        self._compactor = (
            Compactor(model.cfg, pool, kv_cfg, compressor, self.lanes, self.listeners)
            if compressor is not None and self.lanes is not None
            else None
        )
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
            if self._compactor is not None:
                self._compactor.compress_due(batch, self.running, self._alloc_for)
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
                    r.set_pages(r.pages + pages)
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
        r.set_pages(shared + own)
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

    def _alloc_for(self, n: int, requester: RequestState) -> list[int] | None:
        """Compaction's allocation: may retract other running requests, never the requester."""
        return self._alloc(n, requester=requester)

    def _retract(self, r: RequestState) -> None:
        self.running.remove(r)
        self.pool.decref(r.pages)
        self._release_lane(r)
        r.reset()
        self.waiting.appendleft(r)
        self.stats.retractions += 1

    def _cache_prompt(self, r: RequestState) -> None:
        if self.radix is not None:
            full = len(r.req.input_ids) // self.pool.page_size
            self.radix.insert(r.req.input_ids, r.pages[:full])

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

    def _release_lane(self, r: RequestState) -> None:
        if r.lane is not None:
            assert self.lanes is not None
            self.lanes.release(r.lane)
            r.lane = None


def _common_pages(a: tuple[int, ...], b: tuple[int, ...], limit: int, page_size: int) -> int:
    """Whole pages of a[:limit] that b shares as a prefix."""
    n = 0
    while n + page_size <= min(limit, len(b)) and a[n : n + page_size] == b[n : n + page_size]:
        n += page_size
    return n // page_size
