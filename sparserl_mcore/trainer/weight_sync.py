"""Learner -> rollout engines: sparse BF16 patches after each step, a full sync at start/resume.

Current path: every pipeline stage's TP ranks assemble their HF tensors on the stage's tp_rank 0
(`ckpt` layout), these reach the host rank, which casts to BF16, diffs bit-wise against its host
snapshot of the last synced version (`sync.diff`) and sends the encoded patch to every engine
(`apply_patch`: in-process for the embedded engine, the HTTP weight route for remote ones).
The engines receive only changed values; inside the learner the TP gather is still dense.
An engine whose patch fails verification gets a full state dict instead (logged); an engine that
cannot be reached leaves the pool.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from sparserl_mcore.ckpt.hf_io import _stage_hf_tensors
from sparserl_mcore.sync.codec import CodecConfig, encode_patch
from sparserl_mcore.sync.diff import make_patch
from sparserl_mcore.trainer.engine_pool import EnginePool, EventSink
from sparserl_mcore.trainer.rollouts import HOST_RANK


class WeightSyncer:
    """Collective `sync`/`full_sync`: every learner rank calls them; only the host talks to engines."""

    def __init__(
        self, model: torch.nn.Module, layout: Any, runtime: Any, codec: CodecConfig, on_event: EventSink
    ):
        self.model, self.layout, self.runtime, self.codec = model, layout, runtime, codec
        self._on_event = on_event
        self.snapshot: dict[str, torch.Tensor] | None = None  # host rank: BF16 state of `version`
        self.version = 0

    def _hf_state_bf16(self) -> dict[str, torch.Tensor] | None:
        """The whole model as HF-named BF16 tensors on the host rank (None elsewhere)."""
        core = self.model
        while hasattr(core, "module"):
            core = core.module
        rt = self.runtime
        stage = {
            name: t.to(torch.bfloat16)
            for name, t in _stage_hf_tensors(core, self.layout, rt.tp_rank, rt.pp_rank, rt.groups.tp)
            if t is not None
        }
        gathered = [None] * rt.world_size if rt.rank == HOST_RANK else None
        dist.gather_object(stage if rt.tp_rank == 0 else {}, gathered, dst=HOST_RANK)
        if rt.rank != HOST_RANK:
            return None
        return {name: t for part in gathered for name, t in part.items()}

    def full_sync(self, pools: list[EnginePool | None], *, version: int) -> None:
        """Send every weight (start of a run, resume): engines then hold exactly bf16(learner)."""
        state = self._hf_state_bf16()
        if state is not None:
            for pool in pools:
                if pool is not None:
                    pool.for_each(lambda e: e.update_weights(state, version), "full weight sync")
            self.snapshot = state
        self.version = version

    def sync(self, pools: list[EnginePool | None], *, version: int) -> dict[str, float]:
        """Sparse patch from the last synced version to now, applied by every engine."""
        start = time.perf_counter()
        state = self._hf_state_bf16()
        metrics: dict[str, float] = {}
        if state is not None:
            patch = make_patch(
                self.snapshot, state, version=version, base_version=self.version, anchor_version=0
            )
            blob = encode_patch(patch, self.codec)
            for pool in pools:
                if pool is not None:
                    pool.for_each(lambda e: self._apply(e, blob, state, version), "sparse weight sync")
            dense = sum(t.numel() * t.element_size() for t in state.values())
            changed = sum(c.nnz for c in patch.tensors)
            numel = sum(t.numel() for t in state.values())
            metrics = {
                "sync/patch_bytes": float(len(blob)),
                "sync/dense_bytes": float(dense),
                "sync/ratio_vs_dense": dense / max(len(blob), 1),
                "sync/changed_frac": changed / max(numel, 1),
            }
            self.snapshot = state
        self.version = version
        metrics["time/sync_wall_s"] = time.perf_counter() - start
        return metrics

    def _apply(self, engine: Any, blob: bytes, state: dict[str, torch.Tensor], version: int) -> None:
        try:
            engine.apply_patch(blob)
        except ValueError as exc:  # verification failed on the receiver: fall back to a full sync
            self._on_event("sync_fallback_full", {"engine": repr(engine), "reason": str(exc)})
            engine.update_weights(state, version)
