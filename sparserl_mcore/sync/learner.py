"""Learner side: every rank diffs its OWN BF16 shard; only (HF index, value) pairs move.

Per sync (collective over the learner ranks):
1. each rank compares the bits of the parameters it owns against its snapshot: with the
   megatron distributed optimizer, the param range its DP rank updates (`distributed_optimizer_ranges`),
   else an even split of every parameter over the DP ranks, so no index is emitted twice and none
   is missed; only params the layout emits are diffed (tp_rank > 0 norm replicas, the tied output
   copy and vocab padding map to nothing);
2. changed local flat indices become (HF name, HF flat index) through `ckpt.layout.to_hf_index`;
3. the pairs are gathered to the PP stage's source rank (tp = dp = cp = 0), which merges them,
   applies them to its HF-layout mirror of the stage (for the old bits of delta encodings and the
   xxh3-128 digests), exchanges per-tensor digests with the other stage sources (16 bytes per
   tensor) and encodes its fragment of the version's patch.

Memory: each rank keeps a copy of its owned slice (2 bytes x params / (TP x PP x DP)), on the host
by default (`ShardSyncConfig.snapshot`); each stage source keeps an HF-layout mirror of its stage
(2 bytes x stage params), filled by one dense gather at construction, which also serves full
syncs (anchors, fallbacks) without touching the trainer's GPUs again.

Mixture of experts: a rank's shard is (tp, pp, ep); without the distributed optimizer the routed
experts are split over the expert data-parallel ranks (`runtime_ranges`), with it the expert
optimizer's own ranges say who owns what.

Use (every learner rank, after the weights are loaded and the optimizer is built):
    syncer = ShardSyncer.for_runtime(ddp_model, layout, runtime, optimizer=optimizer)
    parts = syncer.make_patch(version)   # [fragment] on stage sources, [] elsewhere
    full = syncer.full_parts()           # dense fragments for anchors / fallback
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from sparserl_mcore.ckpt.layout import ModelLayout
from sparserl_mcore.sync.codec import CodecConfig, Patch, TensorChange, encode_patch, worker_count
from sparserl_mcore.sync.device_diff import FlatDiff, HostDiff, Piece
from sparserl_mcore.sync.diff import changed_bits
from sparserl_mcore.sync.hashing import bits_view, dtype_name, model_digest, tensor_digest

if TYPE_CHECKING:
    from sparserl_mcore.parallel.runtime import Runtime

Ranges = dict[str, tuple[int, int]]


class NamedParameters(Protocol):
    """What the syncer diffs: a megatron module, or BF16 copies of an fp32 one's parameters."""

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]: ...


def mcore_name(name: str) -> str:
    """Parameter name without DDP / Float16Module wrapper prefixes."""
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def distributed_optimizer_ranges(optimizer, model: torch.nn.Module) -> Ranges:
    """{param name: (start, end)} of the flat param range this DP rank's distributed optimizer updates."""
    inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    by_param: dict[torch.nn.Parameter, tuple[int, int]] = {}
    for opt in inner:
        if not hasattr(opt, "gbuf_ranges"):
            raise ValueError(f"{type(opt).__name__} is not a megatron DistributedOptimizer (no gbuf_ranges)")
        for gbuf_range_map in opt.gbuf_ranges:
            for buckets in gbuf_range_map.values():
                for bucket in buckets:
                    for param, ranges in bucket["param_map"].items():
                        if param in by_param:  # megatron puts each param in exactly one bucket
                            raise ValueError("a parameter appears in two distributed-optimizer buckets")
                        by_param[param] = (ranges["param"].start, ranges["param"].end)
    # a param wholly inside other DP ranks' ranges is owned by none of this rank's buckets
    return {mcore_name(n): by_param.get(p, (0, 0)) for n, p in model.named_parameters()}


def even_ranges(
    model: NamedParameters,
    dp_rank: int,
    dp_size: int,
    *,
    experts: Collection[str] = (),
    expert_dp: tuple[int, int] = (0, 1),
) -> Ranges:
    """Each param's flat range split evenly over the DP ranks (replicated params, no dist-opt).

    MoE: the routed experts' params (`experts`, megatron names) are split over the expert
    data-parallel ranks instead (`expert_dp` = (rank, size)): with expert parallelism the copies of
    an expert live on fewer ranks than the dense weights (`runtime_ranges` fills both in)."""
    out = {}
    for name, p in model.named_parameters():
        n, key = p.numel(), mcore_name(name)
        rank, size = expert_dp if key in experts else (dp_rank, dp_size)
        out[key] = (n * rank // size, n * (rank + 1) // size)
    return out


def runtime_ranges(model: NamedParameters, layout: ModelLayout, runtime: Runtime) -> Ranges:
    """`even_ranges` for this rank of `runtime`: dense params over DP, routed experts (the layout's
    `expert` params of this rank's shard) over expert DP."""
    shard = layout.shard(runtime.tp_rank, runtime.pp_rank, runtime.ep_rank)
    return even_ranges(
        model,
        runtime.dp_rank,
        runtime.dp_size,
        experts={n for n, p in shard.items() if p.expert},
        expert_dp=(runtime.expert_dp_rank, runtime.expert_dp_size),
    )


def storage_ranges(model: NamedParameters, layout: ModelLayout, runtime: Runtime) -> Ranges | None:
    """`runtime_ranges`' contract (every element owned by one DP rank) with each DP rank's share one
    contiguous span of the storage all params live in (megatron's DDP param buffer, a flat shadow),
    so snapshot "flat" diffs it as one view; None when they do not share one storage, or routed
    experts (split over expert-DP ranks instead) are in the shard."""
    params = [(mcore_name(n), p) for n, p in model.named_parameters()]
    shard = layout.shard(runtime.tp_rank, runtime.pp_rank, runtime.ep_rank)
    if len({p.untyped_storage().data_ptr() for _, p in params}) != 1 or any(p.expert for p in shard.values()):
        return None
    span = {name: (int(p.storage_offset()), int(p.storage_offset()) + p.numel()) for name, p in params}
    lo, hi = min(a for a, _ in span.values()), max(b for _, b in span.values())
    rank, size = runtime.dp_rank, runtime.dp_size
    a, b = lo + (hi - lo) * rank // size, lo + (hi - lo) * (rank + 1) // size
    out = {}
    for name, (first, last) in span.items():
        start, end = max(a, first) - first, min(b, last) - first
        out[name] = (start, end) if start < end else (0, 0)
    return out


@dataclass(frozen=True)
class SyncGroups:
    """Process groups of the learner-side sync (built once, collectively, by `build_sync_groups`)."""

    stage: dist.ProcessGroup  # every rank of this PP stage (megatron's tp_dp_cp group)
    stage_source: int  # global rank that assembles this stage's fragment
    sources: dist.ProcessGroup | None  # the PP stage sources (None on other ranks)
    source_ranks: tuple[int, ...]  # global ranks of the stage sources, by pp rank


def build_sync_groups(runtime: Runtime) -> SyncGroups:
    """Collective over all learner ranks: find each stage's source rank and group the sources."""
    coords: list[Any] = [None] * runtime.world_size
    # the replica of the whole job (with DiLoCo islands dp_rank is the island's own)
    dp = getattr(runtime, "replica_rank", runtime.dp_rank)
    dist.all_gather_object(coords, (runtime.rank, runtime.pp_rank, runtime.tp_rank, dp, runtime.cp_rank))
    sources = tuple(sorted((pp, rank) for rank, pp, tp, dp, cp in coords if tp == dp == cp == 0))
    source_ranks = tuple(rank for _, rank in sources)
    group = dist.new_group(list(source_ranks))
    return SyncGroups(
        stage=runtime.groups.tp_dp_cp,
        stage_source=source_ranks[runtime.pp_rank],
        sources=group if runtime.rank in source_ranks else None,
        source_ranks=source_ranks,
    )


SNAPSHOT_PLACES = ("host", "device", "flat")


@dataclass(frozen=True, kw_only=True)
class ShardSyncConfig:
    """codec: the patch encoding. snapshot: where the last synced copy of the owned slice lives:
    "host" (default) costs no accelerator memory but copies the owned slice to the host at every
    sync; "device" compares where the weights live and moves only the changed pairs; "flat" (the
    trainer's) keeps one flat copy where the weights live and diffs, maps and gap-codes the whole
    owned slice in a few torch ops with one host sync (`sync.device_diff`, `local_diff`)."""

    codec: CodecConfig = CodecConfig()
    snapshot: str = "host"
    mirror: bool = True

    def __post_init__(self) -> None:
        if self.snapshot not in SNAPSHOT_PLACES:
            raise ValueError(
                f"snapshot={self.snapshot!r} is unknown; choose from {', '.join(SNAPSHOT_PLACES)}"
            )


class ShardSyncer:
    """Makes each version's patch fragment from this rank's BF16 shard; see the module docstring."""

    def __init__(
        self,
        model: NamedParameters,
        layout: ModelLayout,
        *,
        tp_rank: int,
        pp_rank: int,
        groups: SyncGroups,
        owned: Ranges,
        version: int = 0,
        config: ShardSyncConfig = ShardSyncConfig(),
        ep_rank: int = 0,
    ) -> None:
        self.layout, self.tp_rank, self.pp_rank, self.ep_rank = layout, tp_rank, pp_rank, ep_rank
        self.groups, self.config, self.version = groups, config, version
        self.rank = dist.get_rank()
        shard = layout.shard(tp_rank, pp_rank, ep_rank)
        self.params: dict[str, torch.Tensor] = {}
        for name, p in model.named_parameters():
            name = mcore_name(name)
            if name not in shard:
                raise KeyError(
                    f"model parameter {name!r} is not in {layout!r} shard ({tp_rank}, {pp_rank}, {ep_rank})"
                )
            if shard[name].emit:
                dtype_name(p.dtype)  # 16-bit weights only
                self.params[name] = p
        self.owned = {n: owned[n] for n in self.params}
        on_host = config.snapshot == "host"
        self.flat: FlatDiff | None = None
        self.snapshot: dict[str, torch.Tensor] = {}
        if config.snapshot == "flat":
            pieces = [Piece(n, self._owned(n), *self.owned[n]) for n in self.params]
            self.flat = FlatDiff(layout, pieces, (tp_rank, pp_rank, ep_rank), config.codec.encoding)
        else:
            self.snapshot = {
                n: (self._owned(n).cpu() if on_host else self._owned(n)).clone() for n in self.params
            }
        # the stage-gathered path's HF mirror (one dense gather now); the per-rank path needs none
        self._mirror = self._gather_mirror() if config.mirror else None
        self._mirror_digests = {n: tensor_digest(t) for n, t in (self._mirror or {}).items()}
        self.all_digests: dict[str, bytes] = {}
        dtype = dtype_name(next(p for _, p in model.named_parameters()).dtype)
        self.meta = {n: (dtype, shape) for n, shape in layout.hf_shapes.items()}

    @classmethod
    def for_runtime(
        cls,
        model: torch.nn.Module,
        layout: ModelLayout,
        runtime,
        *,
        optimizer=None,
        version: int = 0,
        config: ShardSyncConfig = ShardSyncConfig(),
    ) -> ShardSyncer:
        """Collective: groups from `runtime`, owned ranges from a megatron distributed optimizer
        when `optimizer` is one, else an even DP split."""
        inner = getattr(optimizer, "chained_optimizers", None) or [optimizer]
        if optimizer is not None and all(hasattr(o, "gbuf_ranges") for o in inner):
            owned = distributed_optimizer_ranges(optimizer, model)
        else:
            owned = runtime_ranges(model, layout, runtime)
        return cls(
            model,
            layout,
            tp_rank=runtime.tp_rank,
            pp_rank=runtime.pp_rank,
            groups=build_sync_groups(runtime),
            owned=owned,
            version=version,
            config=config,
            ep_rank=runtime.ep_rank,
        )

    @property
    def mirror(self) -> dict[str, torch.Tensor]:
        """The stage's HF tensors on the stage source ({} elsewhere); only with `config.mirror`."""
        if self._mirror is None:
            raise RuntimeError("this ShardSyncer was built with mirror=False (per-rank fragments only)")
        return self._mirror

    @property
    def mirror_digests(self) -> dict[str, bytes]:
        self.mirror  # noqa: B018 - raises without a mirror
        return self._mirror_digests

    @property
    def is_source(self) -> bool:
        return self.rank == self.groups.stage_source

    def _owned(self, name: str) -> torch.Tensor:
        """int16 view of the owned slice of a param, on the param's device. A tensor of exactly
        end - start elements is the slice itself (a compact source, e.g. DiLoCo's agreed weights)."""
        start, end = self.owned[name]
        flat = self.params[name].detach().view(-1)
        return (flat if flat.numel() == end - start else flat[start:end]).view(torch.int16)

    def _changed(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(owned-slice positions, old and new uint16 bits) that differ from the snapshot; updates it."""
        cur, snap = self._owned(name), self.snapshot[name]
        if self.config.snapshot == "device":
            at = (cur != snap).nonzero().squeeze(1)
            was, now = snap.index_select(0, at), cur.index_select(0, at)
            snap.index_copy_(0, at, now)
            return at.cpu().numpy(), was.cpu().numpy().view(np.uint16), now.cpu().numpy().view(np.uint16)
        cur_bits, snap_bits = cur.cpu().numpy().view(np.uint16), snap.numpy().view(np.uint16)
        return changed_bits(snap_bits, cur_bits, move=True)

    def _pieces(self) -> Iterator[tuple[str, slice, slice | None, torch.Tensor]]:
        for name, p in self.params.items():
            start, end = self.owned[name]
            if start == 0 and end > 0:  # one DP rank ships each param's dense pieces (mirror build)
                yield from self.layout.hf_pieces(
                    self.layout.param(name, self.tp_rank, self.pp_rank, self.ep_rank), p.detach().cpu()
                )

    def _gather_mirror(self) -> dict[str, torch.Tensor]:
        """The stage's HF tensors, assembled densely on the stage source (once)."""
        pieces = [(n, r, c, t.clone()) for n, r, c, t in self._pieces()]
        gathered: list[Any] | None = (
            [None] * dist.get_world_size(self.groups.stage) if self.is_source else None
        )
        dist.gather_object(pieces, gathered, dst=self.groups.stage_source, group=self.groups.stage)
        if gathered is None:  # not the stage source
            return {}
        mirror: dict[str, torch.Tensor] = {}
        for name, rows, cols, tensor in (item for part in gathered for item in part):
            if name not in mirror:
                mirror[name] = torch.zeros(self.layout.hf_shapes[name], dtype=tensor.dtype)
            target = mirror[name][rows] if cols is None else mirror[name][rows, cols]
            target.copy_(tensor)
        return mirror

    def _local_changes(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """(hf_name, hf flat indices, new bits) for every changed element this rank owns."""
        return [(name, idx, new) for name, idx, _, new in self.local_changes()]

    def local_diff(self) -> HostDiff:
        """This rank's changes since the last sync, coded for `config.codec` (snapshot "flat" only):
        `.fragment(...)` gives `per_rank.encode_fragment`'s bytes for them, `.changes()` the lists."""
        if self.flat is None:
            raise RuntimeError(f"local_diff needs snapshot 'flat', not {self.config.snapshot!r}")
        return self.flat.diff()

    def local_changes(self) -> list[tuple[str, np.ndarray, np.ndarray | None, np.ndarray]]:
        """(hf_name, hf flat indices, old bits, new bits) of every element this rank owns that changed
        since the last call (the snapshot moves on); an HF tensor may appear once per local param
        (once in all under snapshot "flat", whose old bits are None under `overwrite`)."""
        if self.flat is not None:
            return self.flat.diff().changes()
        out: list[tuple[str, np.ndarray, np.ndarray | None, np.ndarray]] = []
        if self.config.snapshot == "host":  # numpy diffs release the GIL: params run in a pool
            with ThreadPoolExecutor(worker_count()) as pool:
                found = list(pool.map(self._changed, self.params))
        else:  # device compares stay on this thread (its current CUDA device and stream)
            found = [self._changed(name) for name in self.params]
        for name, (changed, old_bits, new_bits) in zip(self.params, found, strict=True):
            if not changed.size:
                continue
            local = torch.from_numpy(changed + self.owned[name][0])
            for hf_name, pos, hf_idx in self.layout.to_hf_index(
                name, local, self.tp_rank, self.pp_rank, self.ep_rank
            ):
                p = pos.numpy()
                out.append((hf_name, hf_idx.numpy(), old_bits[p], new_bits[p]))
        return out

    def owned_elements(self) -> list[tuple[str, np.ndarray, np.ndarray]]:
        """(hf_name, hf flat indices, current bits) of every element this rank owns (full syncs);
        also resets the snapshot to the current weights."""
        out = []
        if self.flat is not None:
            self.flat.reset()
        for name in self.params:
            cur = self._owned(name)
            if self.flat is None:
                self.snapshot[name].copy_(cur if self.config.snapshot == "device" else cur.cpu())
            start, end = self.owned[name]
            bits = cur.cpu().numpy().view(np.uint16)
            local = torch.arange(start, end, dtype=torch.int64)
            for hf_name, pos, hf_idx in self.layout.to_hf_index(
                name, local, self.tp_rank, self.pp_rank, self.ep_rank
            ):
                out.append((hf_name, hf_idx.numpy(), bits[pos.numpy()]))
        return out

    def _merge_into_mirror(self, gathered: list[list]) -> list[TensorChange]:
        per_tensor: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        for name, idx, bits in (item for part in gathered for item in part):
            per_tensor.setdefault(name, []).append((idx, bits))
        changes = []
        for name in sorted(per_tensor):
            idx = np.concatenate([i for i, _ in per_tensor[name]])
            bits = np.concatenate([b for _, b in per_tensor[name]])
            order = np.argsort(idx, kind="stable")
            idx, bits = idx[order], bits[order]
            if idx.size > 1 and not (np.diff(idx) > 0).all():
                raise RuntimeError(
                    f"{name}: an HF element was reported by two learner ranks (layout/range bug)"
                )
            flat = bits_view(self.mirror[name])
            old = flat[idx].copy()
            flat[idx] = bits
            self.mirror_digests[name] = tensor_digest(self.mirror[name])
            changes.append(
                TensorChange(
                    name=name,
                    dtype=dtype_name(self.mirror[name].dtype),
                    shape=tuple(self.mirror[name].shape),
                    indices=idx,
                    new_bits=bits,
                    old_bits=old,
                    digest=self.mirror_digests[name],
                    base_bits=flat,  # the updated mirror: unchanged positions are the base's
                )
            )
        return changes

    def _model_fields(self) -> dict:
        digests = dict(self.mirror_digests)
        if self.groups.sources is not None and dist.get_world_size(self.groups.sources) > 1:
            parts: list[Any] = [None] * dist.get_world_size(self.groups.sources)
            dist.all_gather_object(parts, self.mirror_digests, group=self.groups.sources)
            digests = {k: v for part in parts for k, v in part.items()}
        if set(digests) != set(self.layout.hf_shapes):
            missing = sorted(set(self.layout.hf_shapes) - set(digests))[:5]
            raise RuntimeError(f"stage mirrors do not cover the HF model; missing {missing}")
        self.all_digests = digests
        return {
            "model_digest": model_digest(digests, self.meta),
            "model_tensors": len(self.layout.hf_shapes),
            "model_numel": sum(int(np.prod(s)) for s in self.layout.hf_shapes.values()),
        }

    def make_patch(self, version: int, *, anchor_version: int = 0) -> list[bytes]:
        """Collective: this version's fragment (a one-element list) on stage sources, [] elsewhere."""
        if version <= self.version:
            raise ValueError(f"version {version} must be newer than the last synced {self.version}")
        local = self._local_changes()
        gathered: list[Any] | None = (
            [None] * dist.get_world_size(self.groups.stage) if self.is_source else None
        )
        dist.gather_object(local, gathered, dst=self.groups.stage_source, group=self.groups.stage)
        base, self.version = self.version, version
        if gathered is None:  # not the stage source
            return []
        changes = self._merge_into_mirror(gathered)
        patch = Patch(
            version=version,
            base_version=base,
            anchor_version=anchor_version,
            tensors=tuple(changes),
            fragment=(self.pp_rank, self.layout.pp_size),
            **self._model_fields(),
        )
        return [encode_patch(patch, self.config.codec)]

    def collect_parts(self, parts: list[bytes]) -> list[bytes]:
        """Collective over the stage sources: all fragments of a version on the first source (for
        a single writer such as `DirectoryPublisher`); [] on the other ranks."""
        if self.groups.sources is None:
            return []
        first = self.groups.source_ranks[0]
        gathered: list[Any] | None = [None] * len(self.groups.source_ranks) if self.rank == first else None
        dist.gather_object(parts, gathered, dst=first, group=self.groups.sources)
        return [p for stage in gathered for p in stage] if gathered is not None else []

    def full_parts(self) -> list[bytes]:
        """This stage's dense fragment of the last synced version; collective over the stage sources."""
        if not self.is_source:
            return []
        if not self.all_digests:
            self._model_fields()
        changes = tuple(
            TensorChange(name=n, dtype=dtype_name(t.dtype), shape=tuple(t.shape), indices=None,
                         new_bits=bits_view(t).copy(), old_bits=None, digest=self.mirror_digests[n])
            for n, t in sorted(self.mirror.items())
        )  # fmt: skip
        patch = Patch(
            version=self.version,
            base_version=None,
            anchor_version=self.version,
            model_digest=model_digest(self.all_digests, self.meta),
            model_tensors=len(self.layout.hf_shapes),
            model_numel=sum(int(np.prod(s)) for s in self.layout.hf_shapes.values()),
            tensors=changes,
            fragment=(self.pp_rank, self.layout.pp_size),
        )
        return [encode_patch(patch, self.config.codec)]
