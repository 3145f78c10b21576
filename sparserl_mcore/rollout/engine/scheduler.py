"""Continuous batching over the paged pool: one `step()` = admit, one forward, sample, compress, retire.

Every step runs ONE forward (batch_forward.py) over a mixed batch: one token for each running
(decoding) request and the uncached prompt tail of each newly admitted one. Requests join and
leave at every step. This module owns admission, memory and retirement; compression is
compaction.py's.

Memory rules (see docs/rollout.md, "Engine"):
- A request's page table = radix-shared prompt pages (read-only) + private pages.
- Prompts are inserted into the radix tree right after their prefill; only whole pages are shared,
  so decode never writes into a shared page. A request that finishes uncompressed, all of it under
  the current weights, also inserts its whole sequence (prompt + output but the last token, which
  was never fed): a multi-turn episode's next turn extends it and prefills only its new tokens.
  Admitted requests whose prompt shares a not-yet-cached page prefix with another request
  admitted in the same step wait one step and then hit the cache (the G samples of a GRPO prompt
  prefill once).
- Compression is copy-on-write into fresh private pages (compaction.py); shared pages are never
  modified.
- Out of pages: evict unreferenced radix leaves (LRU), then retract the youngest running request
  (its pages are freed and it restarts from its prompt later, with its seed re-applied).

Every resource a request holds is recorded on its RequestState as soon as it is taken and dropped
by `release`, which every exit path goes through (finish, abort, retraction, failure); the
invariants of invariants.py check that. A step that raises fails only the request behind it
(quarantine.py finds it); the others restart and complete.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from sparserl_mcore.rollout.engine.batch_forward import BatchForward
from sparserl_mcore.rollout.engine.compaction import Compactor
from sparserl_mcore.rollout.engine.compression_lanes import CompressionLanes
from sparserl_mcore.rollout.engine.decode_graphs import DecodeGraphs
from sparserl_mcore.rollout.engine.hf_model import CausalLM
from sparserl_mcore.rollout.engine.invariants import resource_problems
from sparserl_mcore.rollout.engine.kv_pool import KVPool, PoolExhaustedError
from sparserl_mcore.rollout.engine.quarantine import Quarantine, log_step_failure
from sparserl_mcore.rollout.engine.radix_cache import RadixCache
from sparserl_mcore.rollout.engine.request_state import CompressionListener, RequestState
from sparserl_mcore.rollout.engine.sampler import sample
from sparserl_mcore.rollout.kvcompress import KVCompressionConfig, KVCompressor
from sparserl_mcore.rollout.protocol import FinishReason

__all__ = ["CompressionListener", "RequestState", "Scheduler", "SchedulerStats"]

StopTextFn = Callable[[list[int]], str]


@dataclass
class SchedulerStats:
    steps: int = 0
    retractions: int = 0
    generated_tokens: int = 0
    prefill_tokens: int = 0
    failed_steps: int = 0
    failed_requests: int = 0
    batched_requests: int = 0  # requests summed over forward steps: / steps = mean batch (concurrency)
    peak_running: int = 0


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
        graphs: DecodeGraphs | None = None,
        triton_decode: bool = False,
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
        self._forward = BatchForward(model, pool, kv_cfg, compressor, self.lanes, graphs, triton_decode)
        self._compactor = (
            Compactor(model.cfg, pool, kv_cfg, compressor, self.lanes, self.listeners)
            if compressor is not None and self.lanes is not None
            else None
        )
        self.weight_version = 0
        self.consecutive_failures = 0  # failed (or stalled) steps since the last good one
        self.last_failure: str | None = None
        self._quarantine = Quarantine()
        self._order = 0

    def disable_decode_graphs(self) -> None:
        """Run every step on the eager path from now on (graph capture failed)."""
        self._forward.graphs = None

    @property
    def idle(self) -> bool:
        """No request queued or running (read without the engine's locks: a snapshot)."""
        return not self.waiting and not self.running

    @torch.inference_mode()
    def step(self) -> list[RequestState]:
        """Advance every request by one token; returns the requests that finished or failed.

        Never raises for a request's sake (only BaseExceptions such as KeyboardInterrupt pass): a
        failure is contained (`_contain`), so no resource outlives its request and the other
        requests carry on. Runs under inference_mode (no autograd bookkeeping on any op); the
        per-request tensors it creates (slot tables, query windows, kept positions) are only ever
        modified inside step()."""
        finished: list[RequestState] = []
        try:
            progressed = self._step(finished)
        except Exception as exc:
            self._contain(exc, finished)
            return finished
        self.consecutive_failures = 0
        if not progressed and not finished and self.waiting:
            self._stalled(finished)
        return finished

    def _step(self, finished: list[RequestState]) -> bool:
        """admit, forward, sample, compress, retire; False when no forward ran."""
        self._take_aborted(finished)
        decodes = self._reserve_decode_slots()
        prefills = self._admit(finished)
        if not decodes and not prefills:
            return False
        self.stats.steps += 1
        logits = self._forward(decodes, prefills)
        batch = decodes + prefills
        self.stats.batched_requests += len(batch)
        self.stats.peak_running = max(self.stats.peak_running, len(batch))
        tokens, logprobs = sample(logits, [r.req.sampling for r in batch], [r.generator for r in batch])
        for r in prefills:
            self._cache_prompt(r)
        self.stats.generated_tokens += len(batch)
        for r, tok, lp in zip(batch, tokens, logprobs, strict=True):
            reason = self._append(r, tok, lp)
            if reason is not None:
                self._finish(r, reason)
                finished.append(r)
        if self._compactor is not None:
            self._compactor.compress_due(batch, self.running, self._alloc_for)
        return True

    # ---- failures --------------------------------------------------------------------------------
    def _contain(self, exc: Exception, finished: list[RequestState]) -> None:
        """A step raised outside admission. Every running request is retracted (all it holds is
        released); a lone suspect is failed with the error, several are rerun in halves until the
        failure has a single owner (quarantine.py). Nothing running: the waiting requests fail,
        since retrying cannot help them and the driver must not spin."""
        self.stats.failed_steps += 1
        self.consecutive_failures += 1
        self.last_failure = f"{type(exc).__name__}: {exc}"
        involved = list(self.running)
        log_step_failure(exc, len(involved))
        for r in involved:
            self._retract(r)
        culprit = self._quarantine.after_failure(involved)
        victims = [culprit] if culprit is not None else [] if involved else list(self.waiting)
        for r in victims:
            self._fail(r, exc)
            finished.append(r)

    def _stalled(self, finished: list[RequestState]) -> None:
        """Requests wait, nothing runs, nothing could be admitted: only a leak does that (a prompt
        too large for an idle pool already fails alone). Fail them rather than spin."""
        lanes = f", {self.lanes.num_free}/{self.lanes.num_lanes} lanes free" if self.lanes else ""
        reason = (
            f"engine cannot make progress: {len(self.waiting)} requests waiting, none admitted "
            f"({self.pool.num_free}/{self.pool.num_pages} pages free{lanes})"
        )
        self.stats.failed_steps += 1
        self.consecutive_failures += 1
        self.last_failure = reason
        for r in list(self.waiting):
            self._fail(r, RuntimeError(reason))
            finished.append(r)

    def _fail(self, r: RequestState, exc: BaseException) -> None:
        self.release(r)
        r.error = exc
        self.stats.failed_requests += 1

    def release(self, r: RequestState) -> None:
        """Drop everything `r` holds: its place in the queues, its page references, its lane.
        Every exit path (finish, abort, retraction, failure) goes through here."""
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        self._drop_pages(r)
        if r.lane is not None:
            assert self.lanes is not None
            lane, r.lane = r.lane, None
            self.lanes.release(lane)

    def _drop_pages(self, r: RequestState) -> None:
        pages, r.pages, r.slots = r.pages, [], None
        if pages:
            self.pool.decref(pages)

    def resource_problems(self) -> list[str]:
        """Violated resource invariants (rollout/engine/invariants.py), one line each."""
        return resource_problems(self.pool, self.radix, self.lanes, self.running, self.waiting)

    # ---- pause modes -----------------------------------------------------------------------------
    @torch.inference_mode()  # lanes and slot tables are inference tensors
    def retract_all(self) -> None:
        """Every running request back to the queue, its KV freed (pause mode "retract")."""
        for r in sorted(self.running, key=lambda x: x.order, reverse=True):  # oldest ends up first
            self._retract(r)

    @torch.inference_mode()
    def abort_all(self) -> list[RequestState]:
        """Finish every queued and running request as "abort" (pause mode "abort")."""
        everyone = [*self.running, *self.waiting]
        for r in everyone:
            self._finish(r, "abort")
        return everyone

    # ---- admission and memory ------------------------------------------------------------------
    def _take_aborted(self, finished: list[RequestState]) -> None:
        for r in [r for r in (*self.waiting, *self.running) if r.rid in self.aborted]:
            self._finish(r, "abort")
            finished.append(r)
        self.aborted.clear()

    def _reserve_decode_slots(self) -> list[RequestState]:
        """Give each running request room for its next token (a new page when the last is full)."""
        ps = self.pool.page_size
        # only the requests whose last page is full (one in page_size, each step) pay the
        # membership test: an allocation may retract others
        for r in [r for r in self.running if r.n_cached == len(r.pages) * ps]:
            if r in self.running:
                pages = self._alloc(1, requester=r, may_retract_requester=True)
                if pages is not None:
                    r.set_pages(r.pages + pages)
        return list(self.running)

    def _admit(self, finished: list[RequestState]) -> list[RequestState]:
        """Start waiting requests while pages and limits allow. A request whose admission raises,
        or whose prompt cannot fit even in an idle pool, fails alone (appended to `finished`)."""
        admitted: list[RequestState] = []
        budget = self.max_prefill_tokens
        for r in list(self.waiting):
            if len(self.running) >= self.max_running or (admitted and budget <= 0):
                break
            if not self._quarantine.admits(r):
                continue
            try:
                verdict = self._admit_one(r, admitted)
            except Exception as exc:
                log_step_failure(exc, 1)
                verdict = exc
            if verdict == "stop":
                break
            if isinstance(verdict, BaseException):
                self._fail(r, verdict)
                finished.append(r)
            elif verdict == "finished":
                finished.append(r)
            elif verdict == "admitted":
                admitted.append(r)
                budget -= len(r.req.input_ids) - r.n_cached
                self.stats.prefill_tokens += len(r.req.input_ids) - r.n_cached
        return admitted

    def _admit_one(self, r: RequestState, admitted: list[RequestState]) -> str | BaseException:
        """ "admitted", "finished" (nothing to generate), "wait", "stop" (memory returns as running
        requests finish) or the error it fails with. Pages are recorded on r as soon as they are
        taken, so `release` returns them whatever happens next."""
        if r.req.sampling.max_new_tokens == 0:
            self._finish(r, "length")
            return "finished"
        if self.lanes is not None and self.lanes.num_free == 0:
            return "stop"  # one lane per running request: none free only when one leaked (_stalled)
        prompt, ps = r.req.input_ids, self.pool.page_size
        limit = (len(prompt) - 1) // ps * ps  # at least one prompt token is always computed
        r.pages = self.radix.match(prompt, limit) if self.radix is not None else []
        if self.radix is not None and any(
            _common_pages(prompt, a.req.input_ids, limit, ps) > len(r.pages) for a in admitted
        ):
            self._drop_pages(r)  # wait one step: the other request's prefill will be cached
            return "wait"
        own = self._alloc(math.ceil(len(prompt) / ps) - len(r.pages), requester=None)
        if own is None:
            shared = len(r.pages)
            self._drop_pages(r)
            if self.running or admitted:
                return "stop"
            return PoolExhaustedError(
                f"a {len(prompt)}-token prompt needs more pages than the pool has "
                f"({self.pool.num_pages} of {ps} tokens, {shared} shared); raise capacity_pages / "
                "capacity_bytes"
            )
        self.waiting.remove(r)
        self._start(r, own)
        return "admitted"

    def _start(self, r: RequestState, own: list[int]) -> None:
        self._order += 1
        r.order = self._order
        shared = len(r.pages)
        r.set_pages(r.pages + own)
        r.n_cached = r.next_pos = r.cached_prompt_tokens = shared * self.pool.page_size
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
        self.release(r)
        r.reset()
        self.waiting.appendleft(r)
        self.stats.retractions += 1

    def _cache_prompt(self, r: RequestState) -> None:
        if self.radix is not None:
            full = len(r.req.input_ids) // self.pool.page_size
            self.radix.insert(r.req.input_ids, r.pages[:full])

    def _cache_sequence(self, r: RequestState) -> None:
        """Insert a finished request's cached positions (whole pages) if they are the plain,
        uncompressed KV of its tokens under the weights the cache now serves."""
        if self.radix is None or r.compressions or not r.output_ids or not r.pages:
            return
        if any(v != self.weight_version for v in r.versions):
            return  # an update landed mid-request: its KV mixes versions
        tokens = r.req.input_ids + tuple(r.output_ids[:-1])
        full = min(r.n_cached, len(tokens)) // self.pool.page_size
        self.radix.insert(tokens, r.pages[:full])

    # ---- per-token bookkeeping -----------------------------------------------------------------
    def _append(self, r: RequestState, token: int, logprob: float) -> FinishReason | None:
        r.output_ids.append(token)
        r.logprobs.append(logprob)
        r.versions.append(self.weight_version)
        sp = r.req.sampling
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.model.cfg.eos_token_ids):
            return "stop"
        if sp.stop and self.stop_text is not None:
            tail = self.stop_text(r.output_ids[-(max(len(s) for s in sp.stop) + 2) :])
            if any(s in tail for s in sp.stop):
                return "stop"
        return "length" if len(r.output_ids) >= sp.max_new_tokens else None

    def _finish(self, r: RequestState, reason: FinishReason) -> None:
        self._cache_sequence(r)
        self.release(r)
        r.result = r.sample(reason, weight_version=self.weight_version, page_bytes=self.pool.page_bytes)


def _common_pages(a: tuple[int, ...], b: tuple[int, ...], limit: int, page_size: int) -> int:
    """Whole pages of a[:limit] that b shares as a prefix."""
    n = 0
    while n + page_size <= min(limit, len(b)) and a[n : n + page_size] == b[n : n + page_size]:
        n += page_size
    return n // page_size
