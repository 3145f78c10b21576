"""Learner -> rollout engines: per-rank sparse BF16 fragments after each step, full ones at start/resume.

Per step (`sync`): every learner rank diffs its OWN BF16 shard against its snapshot
(`sync.learner.ShardSyncer.local_changes`, HF coordinates) and encodes its own fragment of the
version (`sync.per_rank.encode_fragment`: touched-value digests, fragment (rank, world)). Nothing
is gathered on a stage source and no rank holds a mirror of the model. Delivery:
- remote engines (`remote_urls`): every rank POSTs its fragment to every engine itself;
  SGLang workers (`remote_server="sglang"`) get it split per SGLang TP rank, inside one
  pause / begin ... end / flush / continue bracket per sync made by the host rank
  (`sglang.trainer_sync.SGLangDelivery`); their full syncs, with `broadcast` set, go as bucketed
  broadcasts from the host over SGLang's weight-update group instead (`SGLangBroadcast`);
- in-process engines (the embedded engine on the host rank): the fragments, already encoded,
  reach the host (the receiver's own process) in one `gather_object` of bytes.
Every engine applies each fragment as it lands and moves to the version when all have landed.

In-flight updates (`in_flight`, asynchronous RL): requests keep running while a sync lands. An
in-process engine applies the whole version in one call between two decode steps; remote
`sparserl serve` engines, which get one fragment per learner rank, are paused `in_place` by the
host first (running requests keep their KV and wait) and continued after every rank has sent, so no
decode step sees half a version; one that failed the delivery (it may hold the fragments of some
ranks) stays paused until its full fallback lands, or is dropped (its requests aborted, then
continued). How long each engine stood still comes back as `time/sync_pause_ms`.
Any failure (digest mismatch, wrong base, unreachable) is shared by one `all_gather_object` of
names, and the failed engines get a full sync made the same way (each rank its owned elements,
`overwrite`); an engine failing that too leaves the pool. An fp32 learner (CPU) is diffed through a
BF16 shadow of its parameters, refreshed before each diff: exactly the values the engines hold.

Start and resume (`full_sync`): the same per-rank path with every owned element, so every engine
holds exactly bf16(learner) and a resumed run continues from the same engine weights.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from sparserl_mcore.sglang import wire
from sparserl_mcore.sglang.dense_sync import DenseSyncConfig
from sparserl_mcore.sglang.trainer_sync import Encode, SGLangBroadcast, SGLangDelivery, full_sync_pieces
from sparserl_mcore.sync.codec import CodecConfig
from sparserl_mcore.sync.device_diff import HostDiff
from sparserl_mcore.sync.hashing import dtype_name
from sparserl_mcore.sync.learner import (
    ShardSyncConfig,
    ShardSyncer,
    build_sync_groups,
    runtime_ranges,
    storage_ranges,
)
from sparserl_mcore.sync.per_rank import Change, ModelMeta, encode_fragment
from sparserl_mcore.trainer.engine_pool import EventSink, Fleet
from sparserl_mcore.trainer.learner import unwrap_model
from sparserl_mcore.trainer.rollouts import HOST_RANK


class _Bf16Shadow:
    """BF16 copies of an fp32 model's parameters under the same names (what ShardSyncer diffs), as
    views of one flat buffer: the flat diff compares it as one view (`sync.learner.storage_ranges`)."""

    def __init__(self, model: torch.nn.Module):
        self._model = model
        params = list(model.named_parameters())
        flat = torch.empty(sum(p.numel() for _, p in params), dtype=torch.bfloat16)
        self._params, at = {}, 0
        for name, p in params:
            self._params[name] = flat[at : at + p.numel()].view(p.shape)
            self._params[name].copy_(p.detach())
            at += p.numel()

    def refresh(self) -> None:
        for name, p in self._model.named_parameters():
            self._params[name].copy_(p.detach())

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self._params.items())


# `Encode` that also frames a diff coded on the device (`sync.device_diff.HostDiff`)
_Encode = Callable[[Sequence[Change] | HostDiff, tuple[int, int]], bytes]


class WeightSyncer:
    """Collective `sync`/`full_sync`: every learner rank encodes and sends its own fragment.

    remote_urls: engines every rank sends to directly (their generate traffic stays with the host's
    pool); the host's pools' other engines are in-process and get the fragments through the host.
    router_url: the pool's engine when an sglang-router fronts the `remote_urls` workers: it takes
    no weights; a worker a sync fails on is taken out of it (`EnginePool.remove_workers`: its
    weights are stale) until `readmit` brings it back.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        layout: Any,
        runtime: Any,
        codec: CodecConfig,
        on_event: EventSink,
        *,
        remote_urls: Sequence[str] = (),
        remote_server: str = "sparserl",
        router_url: str | None = None,
        token: str | None = None,
        timeout_s: float = 600.0,
        broadcast: DenseSyncConfig | None = None,
        in_flight: bool = False,
        agreed: Any = None,
    ):
        self.layout, self.runtime, self.codec = layout, runtime, codec
        self.in_flight = in_flight
        self._pauses: dict[str, float] = {}  # engine -> ms it stood still for the last delivery
        self._run_key = uuid.uuid4().hex[:12]  # this run's part of SGLang prefix-cache keys (host)
        self._on_event = on_event
        self._groups = build_sync_groups(runtime)
        core = unwrap_model(model)
        self._shadow = _Bf16Shadow(core) if next(core.parameters()).dtype == torch.float32 else None
        # DiLoCo islands: the engines get the weights every island agreed on (bf16 of the anchor),
        # never an island's local ones (`diloco.agreed.AgreedWeights`, with its own owned ranges)
        self._agreed = agreed
        if agreed is not None:
            self._shadow = None
        self._diffed = agreed if agreed is not None else self._shadow if self._shadow is not None else core
        self._shards: ShardSyncer | None = None
        self._meta = ModelMeta(dtype_name(torch.bfloat16), layout.hf_shapes)
        self._dense_bytes = 2 * self._meta.numel
        self._senders: dict[str, Any] = {}
        self._sglang: SGLangDelivery | None = None  # when the remote servers are SGLang
        self._broadcast: SGLangBroadcast | None = None  # their full syncs, when not as fragments
        self._remote = set(remote_urls)
        self._router_url = router_url
        self._dropped: set[str] = set()  # engines a full sync failed on: no syncs until re-admitted
        if remote_urls and remote_server == "sglang":
            self._sglang = SGLangDelivery(
                remote_urls,
                layout.hf,
                host_rank=HOST_RANK,
                token=token,
                timeout_s=timeout_s,
                in_flight=in_flight,
            )
            if broadcast is not None:
                self._broadcast = SGLangBroadcast(
                    self._sglang.workers, layout.hf_shapes, broadcast, host_rank=HOST_RANK
                )
        elif remote_urls:
            from sparserl_mcore.rollout.client import RemoteEngine

            self._senders = {u: RemoteEngine(u, token, timeout=timeout_s, retries=1) for u in remote_urls}

    def _new_shard_syncer(self, version: int) -> ShardSyncer:
        """Snapshot of the current weights as `version` (after a full sync, or a resume)."""
        self._refresh()
        rt = self.runtime
        # every DP rank holds the same weights after a step: each diffs an even share of every param
        # (of every routed expert: over the expert data-parallel ranks); islands: the agreed weights
        diffed, layout = self._diffed, self.layout
        owned = (
            self._agreed.ranges
            if self._agreed is not None
            else storage_ranges(diffed, layout, rt) or runtime_ranges(diffed, layout, rt)
        )
        return ShardSyncer(
            self._diffed,
            self.layout,
            tp_rank=rt.tp_rank,
            pp_rank=rt.pp_rank,
            ep_rank=rt.ep_rank,
            groups=self._groups,
            owned=owned,
            version=version,
            # one flat snapshot where the weights live: diff, HF mapping and gap coding in a few
            # torch ops, one host sync (`sync.device_diff`); "host" / "device" are the old paths
            config=ShardSyncConfig(codec=self.codec, snapshot="flat", mirror=False),
        )

    def _refresh(self) -> None:
        """Bring the diffed copy (BF16 shadow of an fp32 learner, or the agreed weights) up to date."""
        for source in (self._shadow, self._agreed):
            if source is not None:
                source.refresh()

    def _encoder(self, version: int, base_version: int | None) -> _Encode:
        """(changes, fragment) -> a fragment of `version` (base None: a full fragment)."""
        meta, codec = self._meta, self.codec

        def encode(changes: Sequence[Change] | HostDiff, fragment: tuple[int, int]) -> bytes:
            if isinstance(changes, HostDiff):  # coded on the device already: frame it
                assert base_version is not None
                return changes.fragment(
                    meta, version=version, base_version=base_version, fragment=fragment, codec=codec
                )
            return encode_fragment(
                changes, meta, version=version, base_version=base_version, fragment=fragment, codec=codec
            )

        return encode

    def _full_changes(self) -> list[Change]:
        assert self._shards is not None
        return [(n, i, None, b) for n, i, b in self._shards.owned_elements()]

    def full_sync(self, pools: list[Fleet | None], *, version: int) -> None:
        """Send every weight (start of a run, resume): engines then hold exactly bf16(learner)."""
        self._shards = self._new_shard_syncer(version)
        failed, _ = self._deliver(self._full_changes(), version, None, pools, None, "full weight sync")
        self._drop(pools, failed)
        self._key_prefixes(pools, version)  # also after a broadcast (nothing generates yet)

    def readmit(self, pools: list[Fleet | None], names: set[str]) -> set[str]:
        """Collective: engines the host's pool found healthy again get a full sync to the version the
        others hold (the fallback's path, every rank its owned elements); returns those that took it,
        the same set on every rank. The loop re-admits only those, so none serves an older version."""
        assert self._shards is not None, "full_sync must run first"
        # the router takes no weights (its workers get every sync); in-process engines never leave
        remote = names & self._remote
        failed: set[str] = set()
        if remote:  # `names` is the same on every rank, so all take this branch or none
            self._dropped -= remote
            failed, _ = self._deliver(
                self._full_changes(), self._shards.version, None, pools, remote, "re-admission full sync"
            )
            self._dropped |= failed
        synced = (remote - failed) | {n for n in names if n == self._router_url}
        if self.in_flight and self._sglang is not None:  # its requests key the prefix cache anew
            key = wire.prefix_key(self._run_key, self._shards.version)
            engines = [pool.engine(name) for pool in pools if pool is not None for name in synced]
            for engine in engines:
                if hasattr(engine, "prefix_key"):
                    engine.prefix_key = key
        return synced

    def _key_prefixes(self, pools: list[Fleet | None], version: int) -> None:
        """In-flight updates into SGLang (no flush while requests run in place): the host's SGLang
        clients key later requests' prefix cache by this run and version (`SGLangWorker.prefix_key`):
        the run's nonce keeps a resumed or later run from matching KV an earlier run cached under the
        same version number (its full sync does not flush either). Called while the workers are
        paused for the version (`SGLangDelivery.deliver`'s `while_paused`): set after they continue,
        requests sent in between would run the new weights under the old key, matching the prefix KV
        the old weights computed."""
        if not self.in_flight or self._sglang is None:
            return
        for pool in pools:
            for engine in pool.live.values() if pool is not None else ():
                if hasattr(engine, "prefix_key"):
                    engine.prefix_key = wire.prefix_key(self._run_key, version)

    def sync(self, pools: list[Fleet | None], *, version: int) -> dict[str, float]:
        """Collective: this version's fragments, one per learner rank, applied by every engine."""
        assert self._shards is not None, "full_sync must run first"
        self._refresh()
        base = self._shards.version
        if version <= base:
            raise ValueError(f"version {version} must be newer than the last synced {base}")
        diff = self._shards.local_diff()
        # SGLang workers get it split per SGLang TP rank: as lists of changes
        changes: Sequence[Change] | HostDiff = diff.changes() if self._sglang is not None else diff
        self._shards.version = version
        failed, size = self._deliver(changes, version, base, pools, None, "sparse weight sync")
        if failed:  # every rank learned the same names: all send their full fragment to those
            self._on_event("sync_fallback_full", {"engines": sorted(failed)})
            failed, _ = self._deliver(
                self._full_changes(), version, None, pools, failed, "full fallback sync"
            )
            self._drop(pools, failed)
        sent = torch.tensor([size], dtype=torch.int64)
        dist.all_reduce(sent)
        metrics = {
            "sync/patch_bytes": float(sent),
            "sync/dense_bytes": float(self._dense_bytes),
            "sync/ratio_vs_dense": self._dense_bytes / max(int(sent), 1),
        }
        if self._pauses:  # host: the engines that measured their stall
            metrics["time/sync_pause_ms"] = max(self._pauses.values())
        return metrics

    def _deliver(
        self,
        changes: Sequence[Change] | HostDiff,
        version: int,
        base_version: int | None,
        pools: list[Fleet | None],
        only: set[str] | None,
        what: str,
    ) -> tuple[set[str], int]:
        """Collective: this rank's changes to every engine (or those in `only`); the names of the
        engines that failed (the same set on every rank) and the bytes of this rank's fragment
        (for SGLang: its per-SGLang-TP-rank fragments, one set per distinct worker TP size)."""
        encode = self._encoder(version, base_version)
        # remote engines dropped earlier get nothing more (every rank dropped the same ones)
        remote = (self._remote if only is None else only & self._remote) - self._dropped
        self._pauses = {}
        bracketed = self._bracketed(remote)
        failed = self._pause_in_place(bracketed)
        remote -= set(failed)
        size = 0
        if self._sglang is not None:
            assert not isinstance(changes, HostDiff), "SGLang workers take the changes as lists"
            keyed = lambda: self._key_prefixes(pools, version)  # noqa: E731
            sglang_failed, size = self._deliver_sglang(
                changes, encode, version, base_version is None, remote, keyed
            )
            failed.update(sglang_failed)
        local = self._local_engines(pools, only)
        any_local = self._any_local(local)
        mine = (self.runtime.rank, self.runtime.world_size)
        whole = encode(changes, mine) if self._senders or any_local else b""
        size = size or len(whole)
        for name, client in self._senders.items():
            if name in remote:
                try:
                    client.apply_patch(whole)
                except Exception as exc:  # noqa: BLE001 - reported below, the learner carries on
                    failed[name] = f"{type(exc).__name__}: {exc}"
                    continue
                if client.last_pause_ms is not None:  # the server paused for this fragment itself
                    self._pauses[name] = client.last_pause_ms
        if any_local:
            failed.update(self._deliver_to_host(whole, local))
        everyone: list[dict[str, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, failed)  # also: every rank has sent
        merged = {k: v for part in everyone for k, v in (part or {}).items()}
        merged.update(self._continue(bracketed, set(merged)))
        for name, reason in sorted(merged.items()):
            self._on_event("sync_engine_failed", {"engine": name, "what": what, "reason": reason})
        return set(merged), size

    def _bracketed(self, remote: set[str]) -> list[str] | None:
        """The remote `sparserl serve` engines an in-flight delivery pauses in place (the host
        pauses them; [] on the other ranks), or None when there is no such bracket (on every rank)."""
        if not self.in_flight or not self._senders:
            return None
        if self.runtime.rank != HOST_RANK:
            return []
        return sorted(name for name in self._senders if name in remote)

    def _pause_in_place(self, bracketed: list[str] | None) -> dict[str, str]:
        """Collective when bracketed: the host pauses those engines `in_place` (running requests keep
        their KV); every rank learns which could not be paused (they fail this delivery) and nobody
        sends before the pauses are done."""
        if bracketed is None:
            return {}
        failed: dict[str, str] = {}
        for name in bracketed:
            try:
                self._senders[name].pause("in_place")
            except Exception as exc:  # noqa: BLE001 - reported like any failed delivery
                failed[name] = f"pause before the update failed: {type(exc).__name__}: {exc}"
        box: list[Any] = [failed]
        dist.broadcast_object_list(box, src=HOST_RANK)
        return box[0]

    def _continue(self, bracketed: list[str] | None, failed_here: set[str]) -> dict[str, str]:
        """Collective when bracketed: the host continues every engine it paused that took the
        version and records how long each stood still; returns, on every rank, those that could
        not be continued. An engine in `failed_here` may hold part of the version (the fragments
        of some ranks landed): it stays paused, so it decodes nothing on those weights, until the
        full fallback lands (continued then) or it is dropped (`_release`)."""
        if bracketed is None:
            return {}
        failed: dict[str, str] = {}
        for name in (n for n in bracketed if n not in failed_here):
            engine = self._senders[name]
            try:
                engine.resume()
            except Exception as exc:  # noqa: BLE001 - it would stay paused: it leaves the pool
                failed[name] = f"continue after the update failed: {type(exc).__name__}: {exc}"
                continue
            if engine.last_pause_ms is not None:
                self._pauses[name] = engine.last_pause_ms
        box: list[Any] = [failed]
        dist.broadcast_object_list(box, src=HOST_RANK)
        return box[0]

    def _release(self, dropped: set[str]) -> None:
        """Host, in flight: the dropped engines a bracket left paused finish what they run as
        "abort" and continue: none decodes a token on the weights it could not take, and no
        request waits on a paused engine (a later full sync is what could bring one back)."""
        if not self.in_flight or self.runtime.rank != HOST_RANK:
            return
        clients: dict[str, Any] = {**self._senders, **(self._sglang.workers if self._sglang else {})}
        for name in sorted(dropped & set(clients)):
            try:
                clients[name].pause("abort")
                clients[name].resume()
            except Exception as exc:  # noqa: BLE001 - dropped already; its requests fail at their timeout
                self._on_event("abort_failed", {"engine": name, "reason": f"{type(exc).__name__}: {exc}"})

    def _deliver_sglang(
        self,
        changes: Sequence[Change],
        encode: Encode,
        version: int,
        full: bool,
        remote: set[str],
        while_paused: Callable[[], None],
    ) -> tuple[dict[str, str], int]:
        """Collective: into the SGLang workers in `remote`, a full sync by broadcast when
        `sync.broadcast` is set, else per-rank fragments; (failed workers, this rank's bytes sent)."""
        assert self._sglang is not None
        if full and self._broadcast is not None:
            return self._broadcast.send(changes, version=version, only=remote), 0
        sizes: list[int] = []

        def counted(part: Sequence[Change], fragment: tuple[int, int]) -> bytes:
            blob = encode(part, fragment)
            sizes.append(len(blob))
            return blob

        pieces = full_sync_pieces(self._meta.numel, self.runtime.world_size) if full else 1
        failed = self._sglang.deliver(
            changes, counted, version=version, pieces=pieces, only=remote, while_paused=while_paused
        )
        self._pauses.update(self._sglang.pause_ms)
        return failed, sum(sizes)

    def _local_engines(self, pools: list[Fleet | None], only: set[str] | None) -> dict[str, Any]:
        """The host's in-process engines (empty on other ranks)."""
        return {
            name: engine
            for pool in pools
            if pool is not None
            for name, engine in pool.live.items()
            if name not in self._remote and name != self._router_url and (only is None or name in only)
        }

    def _any_local(self, local: dict[str, Any]) -> bool:
        """Collective: whether the host has in-process engines to serve (so all ranks join its gather)."""
        flag = torch.tensor([int(bool(local))], dtype=torch.int64)
        dist.broadcast(flag, HOST_RANK)
        return bool(flag)

    def _deliver_to_host(self, fragment: bytes, local: dict[str, Any]) -> dict[str, str]:
        host = self.runtime.rank == HOST_RANK
        gathered: list[bytes] | None = [b""] * dist.get_world_size() if host else None
        dist.gather_object(fragment, gathered, dst=HOST_RANK)
        failed = {}
        blob = b"".join(gathered or [])  # the version's fragments, each framed (codec.split_fragments)
        for name, engine in local.items():
            try:
                engine.apply_patch(blob)  # one call, between two decode steps
            except Exception as exc:  # noqa: BLE001 - a failing engine must not stop the learner
                failed[name] = f"{type(exc).__name__}: {exc}"
                continue
            if getattr(engine, "last_pause_ms", None) is not None:
                self._pauses[name] = engine.last_pause_ms
        return failed

    def _drop(self, pools: list[Fleet | None], failed: set[str]) -> None:
        self._dropped |= failed
        self._release(failed)
        for pool in pools:
            if pool is not None:
                for name in failed & set(pool.live):
                    pool.remove(name, "weight sync failed twice (sparse and full)")
                router, workers = self._router_url, failed & self._remote
                if router is not None and workers:  # out of the router until re-admitted
                    pool.remove_workers(router, workers, "weight sync failed twice (sparse and full)")
