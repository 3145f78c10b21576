"""`EmbeddedEngine`: the in-process RolloutEngine (CPU or one CUDA device, plain PyTorch).

Threading: any number of threads may call `generate` at once; their requests join ONE continuous
batch. Whichever caller finds no driver becomes it and runs scheduler steps until its own requests
are done, then hands over. New requests, aborts and pauses are picked up between steps; weight
updates and cache flushes take the step lock, so they never interleave with a forward pass. While
paused (`pause()`), in-flight requests stay parked with their KV and continue on `resume()`.

Weights: `update_weights` (full or partial HF-named state dict) and `apply_patch` (sync's sparse
BF16 patch, applied + verified all-or-nothing) replace parameters in place and flush the radix
prefix cache, so no request admitted afterwards reuses KV computed with old weights. Requests in
flight keep their KV (pause, update, resume is the caller's choice, as with SGLang).
"""

from __future__ import annotations

import pathlib
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from sparserl_mcore.rollout.hf_model import CausalLM
from sparserl_mcore.rollout.kv_pool import KVPool
from sparserl_mcore.rollout.kvcompress import KVCompressionConfig, build_compressor
from sparserl_mcore.rollout.protocol import GenerateRequest, Sample
from sparserl_mcore.rollout.radix_cache import RadixCache
from sparserl_mcore.rollout.scheduler import CompressionListener, RequestState, Scheduler

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

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose 'auto' or one of {sorted(DTYPES)}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r}: choose 'auto', 'cpu', 'cuda' or 'cuda:N'")
        if self.page_size < 1:
            raise ValueError(f"page_size={self.page_size}: must be >= 1")
        if self.capacity_pages is not None and self.capacity_bytes is not None:
            raise ValueError("capacity_pages and capacity_bytes are both set: set at most one")
        for name in ("capacity_pages", "capacity_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")
        if self.max_running_requests < 1 or self.max_prefill_tokens < 1:
            raise ValueError(
                f"max_running_requests={self.max_running_requests}, max_prefill_tokens="
                f"{self.max_prefill_tokens}: both must be >= 1"
            )

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

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
        self.pool = self._build_pool()
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
        )
        self._generator = torch.Generator(device=device).manual_seed(cfg.seed)
        self._cond = threading.Condition()
        self._step_lock = threading.Lock()
        self._inbox: list[RequestState] = []
        self._aborts: set[str] = set()
        self._driving = False
        self._paused = False
        self._receiver = None  # sync.HFReceiver, built on the first patch

    def _build_pool(self) -> KVPool:
        mc, cfg = self.model.cfg, self.cfg
        dims = dict(
            num_layers=mc.num_layers, page_size=cfg.page_size, kv_heads=mc.num_kv_heads, head_dim=mc.head_dim
        )
        if cfg.capacity_pages is not None:
            pages = cfg.capacity_pages
        else:
            page_bytes = KVPool.page_bytes_for(**dims, dtype=self.model.dtype)
            pages = max(1, (cfg.capacity_bytes or 256 * 2**20) // page_bytes)
        return KVPool(**dims, num_pages=pages, dtype=self.model.dtype, device=self.model.device)

    # ---- generation ----------------------------------------------------------------------------
    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        states = [self._new_state(r) for r in requests]
        with self._cond:
            self._inbox.extend(states)
        while True:
            with self._cond:
                if all(_done(s) for s in states):
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
        for s in states:
            if s.error is not None:
                raise RuntimeError(f"request {s.rid} failed: {s.error}") from s.error
        return [s.result for s in states]

    def _new_state(self, req: GenerateRequest) -> RequestState:
        if max(req.input_ids) >= self.model.cfg.vocab_size:
            raise ValueError(
                f"input_ids hold token {max(req.input_ids)} >= vocab_size {self.model.cfg.vocab_size}"
            )
        if req.sampling.stop and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer, and {self.hf_dir} has none; use stop_token_ids")
        seeded = req.sampling.seed is not None
        gen = torch.Generator(device=self.model.device) if seeded else self._generator
        return RequestState(req=req, rid=req.rid or uuid.uuid4().hex, generator=gen)

    def _drive(self, mine: list[RequestState]) -> None:
        """Run steps until `mine` are done or the engine is paused (caller holds the driver role)."""
        while True:
            with self._cond:
                if self._paused or all(_done(s) for s in mine):
                    return
                self.scheduler.waiting.extend(self._inbox)
                self._inbox.clear()
                self.scheduler.aborted |= self._aborts
                self._aborts.clear()
            with self._step_lock:
                try:
                    anything_finished = bool(self.scheduler.step())
                except BaseException as exc:
                    self._fail_all(exc)
                    anything_finished = True
            if anything_finished:
                with self._cond:
                    self._cond.notify_all()

    def _fail_all(self, exc: BaseException) -> None:
        """A step raised: every queued and running request fails with it; their pages are released."""
        for r in [*self.scheduler.waiting, *self.scheduler.running]:
            r.error = exc
            if r in self.scheduler.running:
                self.pool.decref(r.pages)
        self.scheduler.waiting.clear()
        self.scheduler.running.clear()

    def abort(self, rid: str) -> None:
        """Finish request `rid` at the next step boundary with finish_reason "abort"."""
        with self._cond:
            self._aborts.add(rid)

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def add_compression_listener(self, listener: CompressionListener) -> None:
        """Observe which positions every compression keeps (see scheduler.CompressionListener)."""
        self.scheduler.listeners.append(listener)

    # ---- weights and cache ---------------------------------------------------------------------
    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        with self._step_lock:
            self.model.update(state_dict)
            self._receiver = None  # its digests describe the old weights
            self._set_version(version)

    def apply_patch(self, patch_bytes: bytes) -> int:
        """Apply + verify a sync patch (all-or-nothing, raises sync's PatchError); returns its version."""
        from sparserl_mcore.sync.apply import HFReceiver

        with self._step_lock:
            if self._receiver is None:
                self._receiver = HFReceiver(self._wire_state(), version=self.scheduler.weight_version)
            result = self._receiver.apply(patch_bytes)
            changed = {n: self._receiver.state[n] for n in result.touched}
            if self._receiver.state is not self.model.params:
                self.model.update(changed)
            self._set_version(result.version)
            return result.version

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
        if self.radix is not None:
            self.radix.flush()

    def flush_cache(self) -> None:
        with self._step_lock:
            if self.radix is not None:
                self.radix.flush()

    # ---- introspection -------------------------------------------------------------------------
    def model_info(self) -> dict[str, Any]:
        mc = self.model.cfg
        return {
            "model_path": self.hf_dir,
            "tokenizer_path": self.hf_dir if self.tokenizer is not None else None,
            "is_generation": True,
            "architecture": mc.model_type,
            "vocab_size": mc.vocab_size,
            "num_layers": mc.num_layers,
            "eos_token_ids": list(mc.eos_token_ids),
            "weight_version": self.scheduler.weight_version,
            "kv_compression": asdict(self.cfg.kv_compression),
            "device": str(self.model.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "page_size": self.pool.page_size,
            "pool_pages": self.pool.num_pages,
            "page_bytes": self.pool.page_bytes,
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


def _done(s: RequestState) -> bool:
    return s.result is not None or s.error is not None


def _load_tokenizer(hf_dir: str | pathlib.Path):
    """The checkpoint's tokenizer, or None when it ships none (stop strings then unavailable)."""
    root = pathlib.Path(hf_dir)
    if not any((root / n).exists() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(root))
