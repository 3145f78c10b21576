"""`EmbeddedEngine`: the in-process RolloutEngine (CPU or one CUDA device, plain PyTorch).

Threading: any number of threads may call `generate` at once; their requests join ONE continuous
batch. Whichever caller finds no driver becomes it and runs scheduler steps until its own requests
are done, then hands over. New requests, aborts and pauses are picked up between steps; weight
updates, cache flushes and pauses take the step lock, so they never interleave with a forward pass
and wait for at most one step. `pause(mode)` follows SGLang's modes (protocol.PauseMode): parked
with their KV, retracted (restarted from the prompt after `resume()`), or aborted.

Failures: a step that raises fails only the request behind it (scheduler + quarantine.py), and
every resource a request holds is released on every exit path. `health_problem()` says when the
engine cannot make progress (steps failing in a row, broken resource invariants, no step for
`stall_timeout_s` with work pending).

Weights: `update_weights` (full or partial HF-named state dict) and `apply_patch` (sync's sparse
BF16 patch, applied + verified all-or-nothing) replace parameters in place between two steps and
flush the radix prefix cache, so no request admitted afterwards reuses KV computed with old
weights (unless `prefix_cache_across_versions`). Requests in flight keep their KV and continue
under the new weights unless the caller paused with "retract" or "abort" first; every token
records the version that sampled it (`Sample.output_versions`). `last_pause_ms` is how long
generation stood still for the last update (or explicit pause): asynchronous RL's in-flight cost.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sparserl_mcore.rollout.engine import triton_decode
from sparserl_mcore.rollout.engine.decode_graphs import DecodeGraphs
from sparserl_mcore.rollout.engine.hf_model import CausalLM
from sparserl_mcore.rollout.engine.kv_pool import KVPool
from sparserl_mcore.rollout.engine.radix_cache import RadixCache
from sparserl_mcore.rollout.engine.request_state import CompressionListener, RequestState
from sparserl_mcore.rollout.engine.scheduler import Scheduler
from sparserl_mcore.rollout.kvcompress import KVCompressionConfig, build_compressor
from sparserl_mcore.rollout.protocol import (
    PAUSE_MODES,
    GenerateRequest,
    PauseMode,
    RequestLimits,
    RequestsFailed,
    Sample,
    WeightVersionConflict,
)

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from sparserl_mcore.sync.apply import HFReceiver

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Embedded engine settings.

    device: "auto" (CUDA when available), "cpu", "cuda" or "cuda:N".
    dtype: "auto" (bfloat16 on CUDA, float32 on CPU) or one of DTYPES.
    page_size: KV entries per page. capacity_pages / capacity_bytes: pool size (set at most one;
    bytes count K+V of all layers; default 256 MiB). max_running_requests: batch cap.
    max_prefill_tokens: prompt tokens admitted per step (one longer prompt is still admitted alone).
    radix_cache: share prompt-prefix KV pages across requests. kv_compression: the decode-time
    policy (sparserl_mcore.rollout.kvcompress). seed: generator of requests without their own seed.
    unhealthy_after_failed_steps: failed steps in a row after which `health_problem()` reports
    the engine (isolating one bad request among n costs about log2(n) + 1). stall_timeout_s: work
    pending and no step completed for this long is unhealthy too. check_invariants: check the
    resource invariants after every step, not only when idle (tests; O(pages) per step).
    prefix_cache_across_versions: keep the prefix cache over weight updates, so requests admitted
    after an update may reuse prompt KV an older version computed (saves prefill; that staleness is
    invisible to the per-token versions, which name only the version that sampled each token).
    cuda_graph: run pure-decode steps as one static step (`decode_graphs`), captured as CUDA graphs
    on CUDA; None: on for dense models on CUDA, off elsewhere; True on the CPU runs the same static
    step eagerly (tests). cuda_graph_max_bs / cuda_graph_max_context: the largest batch and context
    a graph covers; larger steps run eagerly.
    triton_decode: decode attention by the Triton kernel that reads KV pages in place
    (`triton_decode.py`), in the static step and the eager one (not where H2O wants the attention
    mass); None: on where it can run (CUDA, Triton importable), else the gather path; True where it
    cannot is refused with the reason.
    """

    device: str = "auto"
    dtype: str = "auto"
    page_size: int = 16
    capacity_pages: int | None = None
    capacity_bytes: int | None = None
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    radix_cache: bool = True
    kv_compression: KVCompressionConfig = field(default_factory=KVCompressionConfig)
    seed: int = 0
    unhealthy_after_failed_steps: int = 16
    stall_timeout_s: float = 300.0
    check_invariants: bool = False
    prefix_cache_across_versions: bool = False
    cuda_graph: bool | None = None
    cuda_graph_max_bs: int = 64
    cuda_graph_max_context: int = 4096
    triton_decode: bool | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose 'auto' or one of {sorted(DTYPES)}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r}: choose 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.page_size < 1:
            raise ValueError(f"page_size={self.page_size}: must be >= 1")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed={self.seed}: must be in [0, 2**63)")
        if self.capacity_pages is not None and self.capacity_bytes is not None:
            raise ValueError("capacity_pages and capacity_bytes are both set: set at most one")
        for name in ("capacity_pages", "capacity_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")
        if self.unhealthy_after_failed_steps < 1 or not self.stall_timeout_s > 0:
            raise ValueError(
                f"unhealthy_after_failed_steps={self.unhealthy_after_failed_steps}, stall_timeout_s="
                f"{self.stall_timeout_s}: must be >= 1 and > 0"
            )
        if self.cuda_graph_max_bs < 1 or self.cuda_graph_max_context < 1:
            raise ValueError(
                f"cuda_graph_max_bs={self.cuda_graph_max_bs}, cuda_graph_max_context="
                f"{self.cuda_graph_max_context}: both must be >= 1"
            )
        if self.max_running_requests < 1 or self.max_prefill_tokens < 1:
            raise ValueError(
                f"max_running_requests={self.max_running_requests}, max_prefill_tokens="
                f"{self.max_prefill_tokens}: both must be >= 1"
            )

    def resolved_device(self) -> torch.device:
        """The device to run on; ValueError naming what is there for a CUDA device that is not."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if (device.index or 0) >= count:
                there = f"{count} CUDA device(s) visible" if count else "no CUDA device here"
                raise ValueError(f"device={self.device!r}: {there}; use 'cpu' or 'auto'")
        return device

    def resolved_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]


class EmbeddedEngine:
    """RolloutEngine over an HF checkpoint directory (see the module docstring)."""

    def __init__(self, hf_dir: str | pathlib.Path, cfg: EngineConfig | None = None) -> None:
        self.cfg = cfg = cfg or EngineConfig()
        self.hf_dir = str(hf_dir)
        device = cfg.resolved_device()
        self.model = CausalLM.from_pretrained(hf_dir, device=device, dtype=cfg.resolved_dtype(device))
        self.tokenizer = _load_tokenizer(hf_dir)
        use_triton = self._triton_decode(device)
        self.decode_attention = "triton" if use_triton else "gather"  # what model_info reports
        static_decode = self._static_decode(device)
        self.pool = self._build_pool(extra_pages=1 if static_decode else 0)
        graphs = (
            DecodeGraphs(
                self.model,
                self.pool,
                max_bs=min(cfg.cuda_graph_max_bs, cfg.max_running_requests),
                max_context=cfg.cuda_graph_max_context,
                triton_decode=use_triton,
            )
            if static_decode
            else None
        )
        self.radix = RadixCache(self.pool) if cfg.radix_cache else None
        self.scheduler = Scheduler(
            self.model,
            self.pool,
            self.radix,
            cfg.kv_compression,
            build_compressor(cfg.kv_compression),
            max_running=cfg.max_running_requests,
            max_prefill_tokens=cfg.max_prefill_tokens,
            stop_text=self.tokenizer.decode if self.tokenizer is not None else None,
            graphs=graphs,
            triton_decode=use_triton,
        )
        self.decode_graphs = "off" if graphs is None else "eager"  # what model_info reports
        if graphs is not None and device.type == "cuda":
            self._capture(graphs)
        self._generator = torch.Generator(device=device).manual_seed(cfg.seed)
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()  # held by a decode step, or by a control op between steps
        self._control_waiting = 0  # control ops queued for _step_lock; the driver yields to them
        self._inbox: list[RequestState] = []
        self._aborts: set[str] = set()
        self._driving = False
        self._paused = False
        self._receiver: HFReceiver | None = None  # built on the first patch
        self._paused_at: float | None = None  # perf_counter when an explicit pause stopped stepping
        self.last_pause_ms: float | None = None  # how long the last update / pause held generation
        mc, kv = self.model.cfg, cfg.kv_compression
        self.limits = RequestLimits(
            vocab_size=mc.vocab_size,
            context_length=mc.max_position_embeddings,
            kv_tokens=(self.pool.num_pages - len(self.pool.reserved)) * self.pool.page_size,
            kv_budget=kv.budget if kv.enabled else None,
        )
        self._last_progress = time.monotonic()  # last step end, or when work arrived at an idle engine
        self._resource_problem: str | None = None  # first broken invariant seen (never cleared)

    def _capture(self, graphs: DecodeGraphs) -> None:
        """Capture the decode graphs; an engine that cannot still serves, eagerly, and says why
        (in the log and in model_info's `decode_graphs`)."""
        started = time.perf_counter()
        try:
            graphs.capture()
        except Exception as exc:  # a driver or kernel that refuses capture: slower, not broken
            log.warning("CUDA graph capture failed, decoding eagerly: %s", exc)
            self.scheduler.disable_decode_graphs()
            self.decode_graphs = f"capture failed: {exc}"
            return
        self.decode_graphs = f"{len(graphs.batches) * len(graphs.widths)} graphs"
        log.info("captured %s in %.1f s", self.decode_graphs, time.perf_counter() - started)

    def _static_decode(self, device: torch.device) -> bool:
        """Whether pure-decode steps run the static step (`EngineConfig.cuda_graph`)."""
        moe = self.model.cfg.moe is not None
        if self.cfg.cuda_graph and moe:
            raise ValueError(
                "cuda_graph=True: the mixture-of-experts forward picks its experts on the host, "
                "which a static decode step cannot; leave cuda_graph unset for MoE models"
            )
        if self.cfg.cuda_graph is None:
            return device.type == "cuda" and not moe
        return self.cfg.cuda_graph

    def _triton_decode(self, device: torch.device) -> bool:
        """Whether decode attention runs the Triton kernel (`EngineConfig.triton_decode`)."""
        why_not = triton_decode.why_unusable(device)
        if self.cfg.triton_decode and why_not is not None:
            raise ValueError(f"triton_decode=True: {why_not}; leave it unset to use the gather path")
        if self.cfg.triton_decode is None:
            return device.type == "cuda" and why_not is None
        return self.cfg.triton_decode

    def _build_pool(self, *, extra_pages: int) -> KVPool:
        """The KV pool of the configured capacity, plus `extra_pages` the engine reserves itself."""
        mc, cfg = self.model.cfg, self.cfg
        dims = dict(
            num_layers=mc.num_layers, page_size=cfg.page_size, kv_heads=mc.num_kv_heads, head_dim=mc.head_dim
        )
        if cfg.capacity_pages is not None:
            pages = cfg.capacity_pages
        else:
            page_bytes = KVPool.page_bytes_for(**dims, dtype=self.model.dtype)
            pages = max(1, (cfg.capacity_bytes or 256 * 2**20) // page_bytes)
        return KVPool(**dims, num_pages=pages + extra_pages, dtype=self.model.dtype, device=self.model.device)

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        states = [self._new_state(r) for r in requests]  # all validated before any is queued
        with self._cond:
            if not self._busy():
                self._last_progress = time.monotonic()
            self._inbox.extend(states)
        while True:
            with self._cond:
                if all(s.done for s in states):
                    break
                if self._driving or self._paused:
                    self._cond.wait()
                    continue
                self._driving = True
            try:
                self._drive(states)
            finally:
                with self._cond:
                    self._driving = False
                    self._cond.notify_all()
        if any(s.error is not None for s in states):
            raise RequestsFailed([s.error or s.result for s in states])  # type: ignore[misc]
        return [s.result for s in states]  # type: ignore[misc]

    def _new_state(self, req: GenerateRequest) -> RequestState:
        self.limits.check(req)
        if req.sampling.stop and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer, and {self.hf_dir} has none; use stop_token_ids")
        if req.return_routed_experts and self.model.cfg.moe is None:
            raise ValueError(
                f"return_routed_experts: {self.model.cfg.arch} is a dense model, it routes no experts"
            )
        seeded = req.sampling.seed is not None
        gen = torch.Generator(device=self.model.device) if seeded else self._generator
        return RequestState(req=req, rid=req.rid or uuid.uuid4().hex, generator=gen)

    def _drive(self, mine: list[RequestState]) -> None:
        """Run steps until `mine` are done or the engine is paused (caller holds the driver role)."""
        while True:
            with self._cond:
                while self._control_waiting and not self._paused:
                    self._cond.wait()  # threading.Lock is not fair: let a queued update in first
                if self._paused or all(s.done for s in mine):
                    return
            with self._step_lock:  # lock order everywhere: _step_lock, then _cond
                with self._cond:
                    if self._paused:  # a pause landed between the check above and the lock
                        continue
                    self._take_inbox()
                finished = self.scheduler.step()
                self._after_step()
            if finished:
                with self._cond:
                    self._cond.notify_all()

    def _take_inbox(self) -> None:
        """New requests and aborts into the scheduler (caller holds _step_lock and _cond)."""
        self.scheduler.waiting.extend(self._inbox)
        self._inbox.clear()
        self.scheduler.aborted |= self._aborts
        self._aborts.clear()

    def _after_step(self) -> None:
        self._last_progress = time.monotonic()
        if self._resource_problem is None and (self.cfg.check_invariants or self.scheduler.idle):
            problems = self.scheduler.resource_problems()
            if problems:
                self._resource_problem = "; ".join(problems)
                log.error("engine resource invariant broken: %s", self._resource_problem)

    def _busy(self) -> bool:
        return bool(self._inbox or not self.scheduler.idle)

    @contextlib.contextmanager
    def _between_steps(self) -> Iterator[None]:
        """Hold generation at the next step boundary. The driver re-takes _step_lock right after
        each step and threading.Lock is not fair, so without the queue count an update could wait
        until every running request finished."""
        with self._cond:
            self._control_waiting += 1
        try:
            self._step_lock.acquire()
        finally:
            with self._cond:
                self._control_waiting -= 1
                self._cond.notify_all()
        try:
            yield
        finally:
            self._step_lock.release()

    def abort(self, rid: str) -> None:
        """Finish request `rid` at the next step boundary with finish_reason "abort"."""
        with self._cond:
            self._aborts.add(rid)

    def pause(self, mode: PauseMode = "in_place") -> None:
        """Stop at the next step boundary (returns once no step runs); see protocol.PauseMode."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: choose one of {list(PAUSE_MODES)}")
        with self._cond:
            self._paused = True
        with self._between_steps():
            if self._paused_at is None:
                self._paused_at = time.perf_counter()
            if mode == "in_place":
                return
            with self._cond:
                self._take_inbox()
            if mode == "retract":
                self.scheduler.retract_all()
            else:
                self.scheduler.abort_all()
            self._after_step()
        with self._cond:
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            if self._paused_at is not None:
                self.last_pause_ms = (time.perf_counter() - self._paused_at) * 1e3
                self._paused_at = None
            self._paused = False
            self._last_progress = time.monotonic()
            self._cond.notify_all()

    def health_problem(self) -> str | None:
        """Why the engine cannot make progress, or None when it can (read without locks)."""
        sched = self.scheduler
        if self._resource_problem is not None:
            return f"resource invariant broken: {self._resource_problem}"
        if sched.consecutive_failures >= self.cfg.unhealthy_after_failed_steps:
            return f"{sched.consecutive_failures} engine steps failed in a row; last: {sched.last_failure}"
        idle_s = time.monotonic() - self._last_progress
        if not self._paused and self._busy() and idle_s > self.cfg.stall_timeout_s:
            return f"no engine step completed for {idle_s:.0f} s with requests pending"
        return None

    def add_compression_listener(self, listener: CompressionListener) -> None:
        """Observe which positions every compression keeps (see scheduler.CompressionListener)."""
        self.scheduler.listeners.append(listener)

    # ---- weights and cache ---------------------------------------------------------------------
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        with self._between_steps():
            started = time.perf_counter()
            self.model.update(state_dict)
            self._receiver = None  # its digests describe the old weights
            self._set_version(version)
            self._stalled_since(started)

    def apply_patch(self, patch_bytes: bytes) -> int:
        """Apply + verify a sync patch (all-or-nothing, raises sync's PatchError); returns its version.
        Decoding runs before generation is held; only the write and its verification hold it."""
        from sparserl_mcore.sync import apply as sync_apply  # lazy: no sync deps unless patches arrive

        decoded = sync_apply.decode_parts(patch_bytes)  # generation goes on meanwhile
        with self._between_steps():
            started = time.perf_counter()
            if self._receiver is None:
                version = self.scheduler.weight_version
                self._receiver = sync_apply.HFReceiver(self._wire_state(), version=version)
            try:
                result = self._receiver.apply_decoded(decoded)
            except sync_apply.PatchVersionError as exc:
                raise WeightVersionConflict(str(exc)) from None
            changed = {n: self._receiver.state[n] for n in result.touched}
            if self._receiver.state is not self.model.params:
                self.model.update(changed)
            if result.version is not None:  # None only for a receiver that never held a version
                self._set_version(result.version)
            self._stalled_since(started)
            return self.scheduler.weight_version

    def _stalled_since(self, started: float) -> None:
        """An update held the step lock since `started`: generation stood still that long (within
        an explicit pause, the pause's own clock counts instead)."""
        if self._paused_at is None:
            self.last_pause_ms = (time.perf_counter() - started) * 1e3

    def _wire_state(self) -> dict[str, torch.Tensor]:
        """The BF16 HF-layout state patches address: the live parameters when they are 16-bit (then
        stored HF-major, so contiguous), else a contiguous BF16 copy whose changed tensors are copied
        into the fp32 parameters (views into input-major weights, see CausalLM)."""
        if self.model.dtype in (torch.bfloat16, torch.float16):
            return self.model.params
        return {
            n: t.to(torch.bfloat16, memory_format=torch.contiguous_format)
            for n, t in self.model.params.items()
        }

    def _set_version(self, version: int) -> None:
        self.scheduler.weight_version = version
        if self.radix is not None and not self.cfg.prefix_cache_across_versions:
            self.radix.flush()

    def flush_cache(self) -> None:
        with self._between_steps():
            if self.radix is not None:
                self.radix.flush()

    # ---- introspection -------------------------------------------------------------------------
    def model_info(self) -> dict[str, Any]:
        mc = self.model.cfg
        return {
            "model_path": self.hf_dir,
            "tokenizer_path": self.hf_dir if self.tokenizer is not None else None,
            "is_generation": True,
            "architecture": mc.arch,
            "vocab_size": mc.vocab_size,
            "num_layers": mc.num_layers,
            "eos_token_ids": list(mc.eos_token_ids),
            "context_length": mc.max_position_embeddings,
            "request_limits": asdict(self.limits),
            "weight_version": self.scheduler.weight_version,
            "kv_compression": asdict(self.cfg.kv_compression),
            "device": str(self.model.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "page_size": self.pool.page_size,
            "pool_pages": self.pool.num_pages,
            "page_bytes": self.pool.page_bytes,
            "decode_graphs": self.decode_graphs,
            "decode_attention": self.decode_attention,
        }

    def stats(self) -> dict[str, Any]:
        """Pool, radix and scheduler counters (for benchmarks and telemetry)."""
        radix = self.radix.stats if self.radix is not None else None
        return {
            "pool_pages": self.pool.num_pages,
            "pool_free_pages": self.pool.num_free,
            "pool_peak_used_pages": self.pool.peak_used,
            "radix_cached_pages": self.radix.num_pages if self.radix is not None else 0,
            "radix_hit_rate": radix.hit_rate if radix is not None else 0.0,
            "radix_hit_tokens": radix.hit_tokens if radix is not None else 0,
            **asdict(self.scheduler.stats),
        }


def _load_tokenizer(hf_dir: str | pathlib.Path):
    """The checkpoint's tokenizer, or None when it ships none (stop strings then unavailable)."""
    root = pathlib.Path(hf_dir)
    if not any((root / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root))
