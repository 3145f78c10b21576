"""Learner -> rollout engines: sparse BF16 patches after each step, a full sync at start/resume.

Per step (`sync`): `sync.learner.ShardSyncer` diffs every learner rank's OWN BF16 shard against
its snapshot and maps the changed positions to HF coordinates; each pipeline stage's source rank
encodes its fragment; the fragments reach the host rank, which hands the concatenated patch to
every engine (`apply_patch`: in process for the embedded engine, the HTTP weight route for remote
ones). Nothing dense moves. An fp32 learner (CPU) is diffed through a BF16 shadow of its
parameters, refreshed before each diff: exactly the values the engines hold.

Start and resume (`full_sync`): the HF tensors are assembled densely once (each stage's mirror,
then to the host) and sent as a full state dict, so every engine holds exactly bf16(learner) and
a resumed run continues from the same engine weights as an uninterrupted one. An engine whose
patch fails verification gets that full state instead (logged); an unreachable engine leaves the
pool.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from sparserl_mcore.sync.codec import CodecConfig
from sparserl_mcore.sync.learner import ShardSyncConfig, ShardSyncer, build_sync_groups, even_ranges
from sparserl_mcore.trainer.engine_pool import EnginePool, EventSink
from sparserl_mcore.trainer.learner import unwrap_model
from sparserl_mcore.trainer.rollouts import HOST_RANK


class _Bf16Shadow:
    """BF16 copies of an fp32 model's parameters under the same names (what ShardSyncer diffs)."""

    def __init__(self, model: torch.nn.Module):
        self._model = model
        self._params = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}

    def refresh(self) -> None:
        for name, p in self._model.named_parameters():
            self._params[name].copy_(p.detach())

    def named_parameters(self):
        return iter(self._params.items())


class WeightSyncer:
    """Collective `sync`/`full_sync`: every learner rank calls them; only the host talks to engines."""

    def __init__(
        self, model: torch.nn.Module, layout: Any, runtime: Any, codec: CodecConfig, on_event: EventSink
    ):
        self.layout, self.runtime, self.codec = layout, runtime, codec
        self._on_event = on_event
        self._groups = build_sync_groups(runtime)
        core = unwrap_model(model)
        self._shadow = _Bf16Shadow(core) if next(core.parameters()).dtype == torch.float32 else None
        self._diffed = self._shadow if self._shadow is not None else core
        self._shards: ShardSyncer | None = None
        self._dense_bytes = 2 * sum(torch.Size(s).numel() for s in layout.hf_shapes.values())

    def _new_shard_syncer(self, version: int) -> ShardSyncer:
        """Snapshot of the current weights as `version` (after a full sync, or a resume)."""
        if self._shadow is not None:
            self._shadow.refresh()
        rt = self.runtime
        # every DP rank holds the same weights after a step: each diffs an even share of every param
        owned = even_ranges(self._diffed, rt.dp_rank, rt.dp_size)
        return ShardSyncer(
            self._diffed,
            self.layout,
            tp_rank=rt.tp_rank,
            pp_rank=rt.pp_rank,
            groups=self._groups,
            owned=owned,
            version=version,
            # the snapshot lives where the weights do: on a GPU only changed pairs leave the device
            config=ShardSyncConfig(codec=self.codec, snapshot="host" if rt.cpu else "device"),
        )

    def full_sync(self, pools: list[EnginePool | None], *, version: int) -> None:
        """Send every weight (start of a run, resume): engines then hold exactly bf16(learner).

        The shard syncer's construction assembles each stage's HF-layout BF16 mirror on the stage
        source (its one dense gather); the mirrors reach the host rank and go out as a state dict.
        """
        self._shards = self._new_shard_syncer(version)
        rt = self.runtime
        gathered = [None] * rt.world_size if rt.rank == HOST_RANK else None
        dist.gather_object(self._shards.mirror if self._shards.is_source else {}, gathered, dst=HOST_RANK)
        if gathered is not None:
            state = {name: t for part in gathered for name, t in part.items()}
            for pool in pools:
                if pool is not None:
                    pool.for_each(lambda e: e.update_weights(state, version), "full weight sync")

    def sync(self, pools: list[EnginePool | None], *, version: int) -> dict[str, float]:
        """Collective: this version's sparse patch, made from the learner shards, applied by every engine."""
        if self._shadow is not None:
            self._shadow.refresh()
        fragments = self._shards.make_patch(version)
        gathered = [None] * self.runtime.world_size if self.runtime.rank == HOST_RANK else None
        dist.gather_object(fragments, gathered, dst=HOST_RANK)
        metrics: dict[str, float] = {}
        if gathered is not None:
            blob = b"".join(part for parts in gathered for part in parts)
            for pool in pools:
                if pool is not None:
                    pool.for_each(lambda e: self._apply(e, blob, version), "sparse weight sync")
            metrics = {
                "sync/patch_bytes": float(len(blob)),
                "sync/dense_bytes": float(self._dense_bytes),
                "sync/ratio_vs_dense": self._dense_bytes / max(len(blob), 1),
            }
        return metrics

    def _apply(self, engine: Any, blob: bytes, version: int) -> None:
        try:
            engine.apply_patch(blob)
        except ValueError as exc:  # verification failed on the receiver: fall back to a full sync
            self._on_event("sync_fallback_full", {"engine": repr(engine), "reason": str(exc)})
            mirror = self._shards.mirror  # the host is stage 0's source: its HF mirror is current
            if set(mirror) != set(self.layout.hf_shapes):
                raise RuntimeError(
                    f"patch rejected ({exc}) and no full state on the host under PP > 1"
                ) from exc
            engine.update_weights(mirror, version)
