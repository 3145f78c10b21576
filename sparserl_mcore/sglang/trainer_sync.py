"""The trainer's weight delivery into SGLang workers: per-rank fragments, one bracket per sync.

SGLang has no `/update_weights_from_patch`; a fragment reaches our loader through
`/update_weights_from_tensor`, which SGLang 0.5.23 accepts only inside a begin/end weight-update
session (`SchedulerWeightUpdaterManager.update_weights_from_tensor`). So one sync is, per worker:

1. the host rank: `/server_info` (the worker's TP size, first time only; broadcast to every rank);
2. every learner rank: its own changes split per SGLang TP rank (`split_by_receiver` with
   `SGLangLayout`), one fragment each, encoded BEFORE the pause (fragment = (learner rank,
   learner ranks): the worker's ledger moves to the version when every rank's has landed), so
   the pause below holds only the HTTP calls and the loader's writes; a full sync is cut into
   `full_sync_pieces` pieces per rank (fragment = (rank * pieces + piece, ranks * pieces)), the
   first encoded before the pause and each other one as it is sent, so no request body holds
   more than about `FULL_CHUNK_ELEMENTS`;
3. the host rank: `/pause_generation` {"mode": "retract"}, `/begin_weight_update` (a session left
   open by a trainer that died mid-sync is ended first); the outcome reaches every rank in one
   broadcast, so no rank sends before the session is open; then every rank POSTs each piece's
   fragments in ONE `send_fragments` call per worker;
4. the failures of all ranks are gathered (so the host closes the session only after every rank
   has sent), then the host: `/end_weight_update`, `/flush_cache`, `/continue_generation`, for
   every worker whose session it opened, failed or not (a worker must never stay paused; in
   flight, below, one that failed stays paused for the trainer's fallback).

In-flight updates (`in_flight`, asynchronous RL) pause `{"mode": "in_place"}` instead: running
requests keep their KV and continue under the new version (SGLang records the version change per
request: `meta_info.weight_versions`), and there is no flush (0.5.23 refuses one while requests
hold pages); requests carry the run and version as `extra_key` instead (`SGLangWorker.prefix_key`),
set by the host (`while_paused`) once the workers are paused, so no request sent after they
continue carries the old version's key. A worker that failed an in-flight delivery (it may hold
the fragments of some ranks) ends its session but is not continued: it decodes nothing on those
weights until the trainer's full fallback lands, or drops it (`WeightSyncer._release`).
The host times each bracket, pause to continue: `pause_ms`.

Collective over the default group (the learner ranks); every rank returns the same failure map.
A full sync is the same path with every owned element (`overwrite`, base None), which a worker
whose patch was rejected accepts (its ledger is `broken` until a full version lands).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from model_providers.hf_config import HFModelConfig
from sparserl_mcore.sglang.client import SGLangWorker
from sparserl_mcore.sglang.dense_sync import (
    DenseSyncConfig,
    DenseSyncError,
    Spec,
    byte_offsets,
    dense_sync,
    plan_buckets,
)
from sparserl_mcore.sglang.layout import SGLangLayout
from sparserl_mcore.sync.per_rank import Change, split_by_receiver

# (changes of one SGLang TP rank, fragment (index, count)) -> one encoded fragment
Encode = Callable[[Sequence[Change], tuple[int, int]], bytes]

# Elements one learner rank sends per POST in a full sync (bf16: 128 MiB, ~170 MiB of base64 JSON
# that SGLang's HTTP server parses whole): a 7B model's share of one of 8 ranks (1.9 GB) would
# otherwise be one 2.5 GB body per worker, 8 at once.
FULL_CHUNK_ELEMENTS = 64 * 2**20


def full_sync_pieces(numel: int, world: int) -> int:
    """Fragments each learner rank cuts its share of a full sync into (the same on every rank:
    the version is complete when all `world * pieces` have landed)."""
    return max(1, -(-numel // (world * FULL_CHUNK_ELEMENTS)))


def split_even(changes: Sequence[Change], pieces: int) -> list[list[Change]]:
    """`changes` cut into exactly `pieces` consecutive parts of about equal element counts (a
    tensor may straddle two; a part may be empty when there are fewer elements than parts)."""
    total = sum(len(idx) for _, idx, _, _ in changes)
    per = max(1, -(-total // pieces))
    out: list[list[Change]] = [[] for _ in range(pieces)]
    slot, room = 0, per
    for name, idx, old, new in changes:
        start = 0
        while start < len(idx):
            take = min(room, len(idx) - start)
            cut = slice(start, start + take)
            out[slot].append((name, idx[cut], None if old is None else old[cut], new[cut]))
            start, room = start + take, room - take
            if room == 0:
                slot, room = min(slot + 1, pieces - 1), per if slot + 1 < pieces else total
    return out


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


class SGLangDelivery:
    """SGLang workers by URL; `deliver` is one bracketed sync of this rank's changes."""

    def __init__(
        self,
        urls: Sequence[str],
        hf: HFModelConfig,
        *,
        host_rank: int,
        token: str | None = None,
        timeout_s: float = 600.0,
        in_flight: bool = False,
    ) -> None:
        self.workers = {u: SGLangWorker(u, token, timeout=timeout_s, retries=1) for u in urls}
        self.in_flight = in_flight
        self.pause_ms: dict[str, float] = {}  # host: per worker, pause to continue of the last sync
        self._hf = hf
        self._host_rank = host_rank
        # worker -> its (TP, EP) sizes, learned by the host at the first sync
        self._tp: dict[str, tuple[int, int]] = {}
        self._layouts: dict[tuple[int, int], SGLangLayout] = {}

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()

    def deliver(
        self,
        changes: Sequence[Change],
        encode: Encode,
        *,
        version: int,
        pieces: int = 1,
        only: set[str] | None,
        while_paused: Callable[[], None] | None = None,
    ) -> dict[str, str]:
        """Collective: this rank's `changes` of `version` to every worker (or those in `only`), as
        `pieces` fragments (one POST each; `full_sync_pieces` for a full sync); the workers that
        failed, with why, the same map on every rank. `while_paused`: called on the host once the
        workers are paused, before any continues (in flight: the requests' prefix-cache key)."""
        targets = [u for u in self.workers if only is None or u in only]
        if not targets:
            return {}
        self.pause_ms = {}
        failed = self._share_sizes(targets)
        rank, world = dist.get_rank(), dist.get_world_size()
        shares = split_even(changes, pieces)
        mine: dict[str, str] = {}  # workers this rank could not serve
        live = [u for u in targets if u not in failed]
        # the first piece (all of a sparse patch) is encoded before the workers pause
        by_tp = self._encode(shares[0], (rank * pieces, world * pieces), live, encode, mine)
        opened, paused_at = self._open_all(live, failed)
        if while_paused is not None and rank == self._host_rank:
            while_paused()
        for piece in range(pieces):
            if piece:
                fragment = (rank * pieces + piece, world * pieces)
                by_tp = self._encode(shares[piece], fragment, live, encode, mine)
            for url in live:
                if url in failed or url in mine:
                    continue
                try:
                    self.workers[url].send_fragments(by_tp[self._tp[url]], version)
                except Exception as exc:  # noqa: BLE001 - reported below; the learner carries on
                    mine[url] = _reason(exc)
        everyone: list[dict[str, str] | None] = [None] * world
        dist.all_gather_object(everyone, mine)  # every rank has sent before the host closes
        for part in everyone:
            failed.update(part or {})
        for url in opened:
            problem = self._close(url, keep_paused=self.in_flight and url in failed)
            self.pause_ms[url] = (time.perf_counter() - paused_at[url]) * 1e3
            if problem and url not in failed:
                failed[url] = problem
        box: list[Any] = [failed]
        dist.broadcast_object_list(box, src=self._host_rank)
        return dict(box[0])

    def _share_sizes(self, targets: list[str]) -> dict[str, str]:
        """Collective: the host asks each new worker's (TP, EP) sizes (`/server_info`); every rank
        learns them and the workers that could not be asked."""
        failed: dict[str, str] = {}
        if dist.get_rank() == self._host_rank:
            for url in targets:
                try:
                    if url not in self._tp:
                        self._tp[url] = self.workers[url].layout_sizes()
                except Exception as exc:  # noqa: BLE001 - this worker is reported, the others go on
                    failed[url] = f"reading its layout (/server_info): {_reason(exc)}"
        box: list[Any] = [(failed, self._tp)]
        dist.broadcast_object_list(box, src=self._host_rank)
        failed, tp = box[0]
        self._tp.update(tp)
        return dict(failed)

    def _encode(
        self, share: Sequence[Change], fragment: tuple[int, int], urls: list[str], encode: Encode,
        mine: dict[str, str],
    ) -> dict[tuple[int, int], list[bytes]]:  # fmt: skip
        """`share` split per SGLang TP rank and encoded, once per distinct worker layout among
        `urls`; a layout that fails marks its workers in `mine`."""
        out: dict[tuple[int, int], list[bytes]] = {}
        for size in sorted({self._tp[u] for u in urls if u not in mine}):
            try:
                out[size] = [encode(c, fragment) for c in split_by_receiver(share, self._layout(size))]
            except Exception as exc:  # noqa: BLE001 - reported like a failed send
                mine.update({u: _reason(exc) for u in urls if self._tp[u] == size})
        return out

    def _open_all(self, live: list[str], failed: dict[str, str]) -> tuple[list[str], dict[str, float]]:
        """Collective: the host pauses each worker and opens its session; every rank learns which
        failed (added to `failed`), so no rank sends before the sessions are open. (opened, when
        each was paused), both empty on the other ranks."""
        opened, paused_at, problems = [], {}, {}
        if dist.get_rank() == self._host_rank:
            mode = "in_place" if self.in_flight else "retract"
            for url in live:
                try:
                    paused_at[url] = time.perf_counter()
                    self.workers[url].open_update_session(mode)
                    opened.append(url)
                except Exception as exc:  # noqa: BLE001 - this worker is reported, the others go on
                    problems[url] = f"opening the update session: {_reason(exc)}"
        box: list[Any] = [problems]
        dist.broadcast_object_list(box, src=self._host_rank)
        failed.update(box[0])
        return opened, paused_at

    def _close(self, url: str, *, keep_paused: bool) -> str:
        try:
            self.workers[url].close_update_session(flush=not self.in_flight, keep_paused=keep_paused)
        except Exception as exc:  # noqa: BLE001 - reported as this worker's failure
            return str(exc)
        return ""

    def _layout(self, sizes: tuple[int, int]) -> SGLangLayout:
        if sizes not in self._layouts:
            self._layouts[sizes] = SGLangLayout(self._hf, tp_size=sizes[0], ep_size=sizes[1])
        return self._layouts[sizes]


Owned = dict[str, list[tuple[torch.Tensor, torch.Tensor]]]  # HF name -> (flat indices, int16 bits)


class BucketReducer:
    """Assembles each bucket on the host rank by one `reduce` (SUM of uint8 bytes: every element is
    owned by exactly one learner rank and the others contribute zero bytes, so the sum is its exact
    bits), in ONE buffer of the largest bucket per rank, reused for every bucket.

    Before refilling the buffer a rank waits for the reduce that last read it (`Work.wait`: on NCCL
    the current stream waits for the communication stream, on gloo the thread waits), so a rank
    that is not the host, whose reduces return at once, never has more than one bucket in memory;
    allocating a fresh bucket per reduce instead would keep every bucket alive until the host
    reached it, up to the whole dense state."""

    def __init__(self, plan: Sequence[Sequence[Spec]], *, host_rank: int, device: str) -> None:
        self.host_rank = host_rank
        self.buffer = torch.empty(max(byte_offsets(b)[-1] for b in plan), dtype=torch.uint8, device=device)
        self._pending: Any = None  # the reduce still reading the buffer

    def reduce(self, bucket: Sequence[Spec], owned: Owned) -> torch.Tensor:
        """Collective: the bucket's bytes (a view of the buffer, valid until the next call) on the
        host; this rank's elements in place, zeros elsewhere, on the others."""
        self.wait()
        offsets = byte_offsets(bucket)
        flat = self.buffer[: offsets[-1]]
        flat.zero_()
        for (name, _, _), start, end in zip(bucket, offsets, offsets[1:], strict=False):
            values = flat[start:end].view(torch.int16)
            for idx, bits in owned.get(name, ()):
                values[idx.to(flat.device)] = bits.to(flat.device)
        work = dist.reduce(flat, dst=self.host_rank, op=dist.ReduceOp.SUM, async_op=True)
        if dist.get_rank() == self.host_rank:
            work.wait()  # the host broadcasts these bytes next
        else:
            self._pending = work
        return flat

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.wait()
            self._pending = None


class SGLangBroadcast:
    """Full syncs (start, resume, fallback) into SGLang workers as bucketed broadcasts over their
    weight-update group (`dense_sync`), instead of HTTP fragments.

    The host rank is the group's sender. Each bucket is assembled from the learner ranks' own
    elements by one `reduce` onto the host just before its broadcast (`BucketReducer`): no rank
    ever holds more than one bucket of the dense state (`bucket_bytes`), and the bytes cross the
    learner group once."""

    def __init__(
        self,
        workers: dict[str, SGLangWorker],
        hf_shapes: dict[str, tuple[int, ...]],
        cfg: DenseSyncConfig,
        *,
        host_rank: int,
    ) -> None:
        self.workers, self.cfg, self._host_rank = workers, cfg, host_rank
        specs = [(name, torch.bfloat16, tuple(hf_shapes[name])) for name in sorted(hf_shapes)]
        self._plan = plan_buckets(specs, cfg.bucket_bytes)  # the same on every rank

    def send(self, changes: Sequence[Change], *, version: int, only: set[str] | None) -> dict[str, str]:
        """Collective: the whole state, of which `changes` (every element this rank owns, base None)
        is this rank's part, to every worker (or those in `only`); the workers that failed, with
        why, the same map on every rank. A failed sync fails every worker of the group."""
        targets = [w for url, w in self.workers.items() if only is None or url in only]
        if not targets:
            return {}
        owned: Owned = {}
        for name, idx, _, bits in changes:
            owned.setdefault(name, []).append((torch.from_numpy(idx), torch.from_numpy(bits.view(np.int16))))
        reducer = BucketReducer(self._plan, host_rank=self._host_rank, device=self.cfg.device)
        filled = 0

        def fill(bucket: Sequence[Spec]) -> torch.Tensor:
            nonlocal filled
            filled += 1
            return reducer.reduce(bucket, owned)

        failed: dict[str, str] = {}
        if dist.get_rank() == self._host_rank:
            try:
                dense_sync(targets, self._plan, fill, version=version, cfg=self.cfg)
            except DenseSyncError as exc:
                failed = {url: _reason(exc) for url in exc.workers}
            finally:  # the other ranks reduce every bucket whatever happened here
                for bucket in self._plan[filled:]:
                    fill(bucket)
        else:
            for bucket in self._plan:
                fill(bucket)
        reducer.wait()
        box: list[Any] = [failed]
        dist.broadcast_object_list(box, src=self._host_rank)
        return dict(box[0])
