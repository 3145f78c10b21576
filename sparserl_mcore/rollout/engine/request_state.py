"""Scheduler-side state of one request, shared by admission (scheduler), the forward and compaction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from sparserl_mcore.rollout.engine.kv_pool import KVPool
from sparserl_mcore.rollout.protocol import FinishReason, GenerateRequest, KVStats, Sample

# Called after each compression with (rid, original positions kept [layers, kv_heads, n_keep], the
# position the next token will take). Tests rebuild the "retained positions only" recompute from it.
# The positions tensor is created under inference_mode: read it (or .clone() it), never modify it.
CompressionListener = Callable[[str, torch.Tensor, int], None]


@dataclass(eq=False)
class RequestState:
    """One request's progress and the resources it holds (reset completely when it is retracted).

    Resources (pool page references, its compression lane) are recorded here the moment they are
    acquired, so `Scheduler.release` can drop everything a request holds on any exit path."""

    req: GenerateRequest
    rid: str
    generator: torch.Generator
    order: int = 0
    pages: list[int] = field(default_factory=list)
    slots: torch.Tensor | None = None  # flat slot ids of `pages`, built on demand (slot_table)
    n_cached: int = 0  # cache entries in use (per layer and KV head)
    next_pos: int = 0  # RoPE position of the next token fed in
    cached_prompt_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # weight version that sampled each output token
    routed: list[torch.Tensor] = field(default_factory=list)  # [t, L, k] expert ids per forward it fed
    q_seen: int = 0  # queries pushed to its window ring
    lane: int | None = None  # its lane of the scheduler's CompressionLanes (queries, h2o's mass)
    kept_positions: torch.Tensor | None = None  # [L, Hk, k] positions of slots [0, k) after compressing
    tail_start: int = 0  # position of slot k (later slots hold consecutive positions)
    peak_retained: int = 0
    peak_pages: int = 0
    evictions: int = 0
    compressions: int = 0
    result: Sample | None = None
    error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None

    def reset(self) -> None:
        """Back to "never started" (retraction): it will restart from its prompt."""
        self.__dict__.update(RequestState(req=self.req, rid=self.rid, generator=self.generator).__dict__)

    def set_pages(self, pages: list[int]) -> None:
        self.pages = pages
        self.slots = None  # decode steps address pages directly; only prefill and compression need slots
        self.peak_pages = max(self.peak_pages, len(pages))

    def slot_table(self, pool: KVPool) -> torch.Tensor:
        """Flat slot ids of its pages, built when first needed after its pages changed (a decode
        step that adds a page would otherwise pay several ops for a table it never reads)."""
        if self.slots is None:
            self.slots = pool.slot_table(self.pages)
        return self.slots

    def sample(self, reason: FinishReason, *, weight_version: int, page_bytes: int) -> Sample:
        """Its result as the engine returns it. Routed experts, when asked for, cover the positions
        it fed through the model itself: from its first uncached prompt token to its last fed
        output (`Sample.routed_experts_problem` refuses any other count)."""
        routed, start = None, 0
        if self.req.return_routed_experts:
            fed = len(self.req.input_ids) + len(self.output_ids) - 1
            routed = torch.cat(self.routed) if self.routed else None
            start = self.cached_prompt_tokens if routed is not None else max(0, fed)
        return Sample(
            rid=self.rid,
            prompt_ids=self.req.input_ids,
            output_ids=tuple(self.output_ids),
            output_logprobs=tuple(self.logprobs),
            finish_reason=reason,
            kv_stats=KVStats(
                peak_retained_tokens=self.peak_retained,
                evictions=self.evictions,
                compressions=self.compressions,
                peak_pages=self.peak_pages,
                peak_kv_bytes=self.peak_pages * page_bytes,
            ),
            weight_version=weight_version,
            cached_prompt_tokens=self.cached_prompt_tokens,
            output_versions=tuple(self.versions),
            routed_experts=routed,
            routed_experts_start=start,
        )
