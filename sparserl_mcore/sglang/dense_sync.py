"""Dense weight sync into SGLang workers: bucketed broadcast over SGLang's weight-update group.

The first sync of a run, a resume and the fallback after a rejected sparse patch send every weight.
SGLang 0.5.23 receives them with (file: symbol, paths under `sglang/srt/`):
- `model_executor/model_runner_components/weight_updater.py: WeightUpdater.init_weights_update_group`:
  TP rank r of a worker joins group `group_name` as rank `rank_offset + r` through
  `utils/common.py: init_custom_process_group` (`torch.distributed.rendezvous("tcp://addr:port")`,
  a `PrefixStore(group_name, store)`, then torch's `_new_process_group_helper` with no global ranks).
  The sender is rank 0: it hosts the TCP store, so it must join while the workers join.
- `managers/scheduler_components/weight_updater.py:
  SchedulerWeightUpdaterManager.update_weights_from_distributed` (only inside a
  `begin_weight_update` / `end_weight_update` session): every TP rank calls
  `WeightUpdater.receive_weights_from_distributed` (with `load_format="flattened_bucket"`:
  `_receive_bucketed_weights_from_distributed` allocates `weight_sync/tensor_bucket.py:
  FlattenedTensorBucket.empty(names, dtypes, shapes)`, ONE uint8 tensor of the tensors' bytes back
  to back, and `torch.distributed.broadcast(..., src=0)` into it), then
  `WeightUpdater.load_weights_from_distributed` -> the model's own `load_weights` (HF names; each
  rank keeps its shard).
So one bucket = one HTTP call per worker, which blocks in that broadcast, overlapping the sender's
broadcast of the same bytes: the calls run on threads while the sender broadcasts.

Order of waiting (`_Fanout.during`): the sender's side of a collective (group set-up, a broadcast)
runs on its own thread while this one watches it AND the workers' HTTP calls; the first worker
call that fails ends the wait at once and aborts the sender's side: a worker that fails before it
joins (refused, unreachable, dead) can never complete the collective, so waiting for it is pointless.
Group set-up is bounded by `connect_timeout_s`, each bucket by `timeout_s`. Aborting set-up closes
the TCP store the sender hosts, which ends every pending rendezvous on it at once (the sender's own
and the workers' that did join) and frees the port for the next sync; NCCL's communicator is made
with non-blocking init so that `abort()` also ends its set-up (never run: no GPU here).

Around the buckets, per worker: `/pause_generation` (retract), `/begin_weight_update`, ...,
the version marker through our loader (`client.version_payloads`: the sparse receiver's base),
`/end_weight_update`, `/flush_cache`, `/continue_generation`. A dense sync is all or nothing for
the workers of one group: a broadcast needs every member, so one failed worker fails them all.

The sender never holds the whole state: `fill` produces one bucket's bytes when its broadcast is
due (the trainer assembles it from the learner ranks' shards, `trainer_sync.SGLangBroadcast`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import Any, Literal, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend

T = TypeVar("T")
Spec = tuple[str, torch.dtype, tuple[int, ...]]  # one HF tensor: name, dtype, shape
Fill = Callable[[Sequence[Spec]], torch.Tensor]  # a bucket -> its bytes back to back (uint8)


class DenseSyncError(RuntimeError):
    """The dense sync did not complete on these workers: their weights are undefined (mixed)."""

    def __init__(self, message: str, workers: Sequence[str]) -> None:
        super().__init__(message)
        self.workers = list(workers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DenseSyncConfig:
    """master_address / master_port: where the sender (group rank 0) hosts the group's TCP store;
    every worker must reach it. backend: "nccl" (tensors broadcast from `device`) or "gloo" (CPU).
    bucket_bytes: at most this many bytes per broadcast (a larger tensor goes alone); the sender
    and each receiver hold one bucket at a time besides the model. timeout_s: bounds each
    collective and each HTTP wait, so a dead worker cannot stall the trainer forever.
    connect_timeout_s: bounds the group's set-up (every worker joining)."""

    master_address: str
    master_port: int
    backend: Literal["nccl", "gloo"] = "nccl"
    device: str = "cuda"
    bucket_bytes: int = 512 * 2**20
    timeout_s: float = 600.0
    connect_timeout_s: float = 120.0
    group_prefix: str = "sparserl-dense"

    def __post_init__(self) -> None:
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port={self.master_port}: must be a TCP port (1..65535)")
        if self.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend={self.backend!r}: use 'nccl' (GPU) or 'gloo' (CPU)")
        if self.backend == "gloo" and self.device != "cpu":
            raise ValueError(f"backend='gloo' broadcasts CPU tensors: set device='cpu' (got {self.device!r})")
        if self.bucket_bytes < 1 or self.timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError(
                f"bucket_bytes={self.bucket_bytes}, timeout_s={self.timeout_s}, connect_timeout_s="
                f"{self.connect_timeout_s}: must be > 0"
            )


class DenseWorker(Protocol):
    """What the sync needs of one SGLang server (`client.SGLangWorker`, which never retries
    `init_weights_update_group` / `update_weights_from_distributed`: a repeated call would join
    the collective a second time)."""

    url: str

    def tp_size(self) -> int: ...
    def open_update_session(self) -> None: ...
    def close_update_session(self) -> None: ...
    def declare_version(self, version: int, tp_size: int) -> None: ...
    def destroy_weights_update_group(self, group_name: str) -> None: ...

    def init_weights_update_group(
        self, *, master_address: str, master_port: int, rank_offset: int, world_size: int, group_name: str,
        backend: str = "nccl",
    ) -> None: ...  # fmt: skip

    def update_weights_from_distributed(
        self, tensors: Sequence[tuple[str, torch.dtype, Sequence[int]]], *, group_name: str, version: int
    ) -> None: ...


@dataclasses.dataclass(frozen=True)
class DenseSyncStats:
    """What one dense sync sent: broadcasts, bytes per broadcast receiver, workers reached."""

    buckets: int
    bytes: int
    workers: int


def address_towards(url: str) -> str:
    """This host's address on the route to `url`'s host (what the kernel would send from; a UDP
    connect sends nothing): the master address workers at `url` can reach, without configuration."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname is None:
        raise ValueError(f"{url!r}: no host to find a route to")
    family, _, _, _, target = socket.getaddrinfo(parts.hostname, parts.port or 80, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(target)
        return str(probe.getsockname()[0])


def _nbytes(spec: Spec) -> int:
    _, dtype, shape = spec
    return math.prod(shape) * dtype.itemsize


def plan_buckets(specs: Sequence[Spec], bucket_bytes: int) -> list[list[Spec]]:
    """Consecutive tensors, at most `bucket_bytes` per bucket (a larger tensor alone). Refuses
    what `FlattenedTensorBucket.empty` would refuse on the receivers: a tensor whose byte offset
    in its bucket is not a multiple of its element size (mixed dtypes in a bad order)."""
    if not specs:
        raise ValueError("no tensors to send: a dense sync needs the whole HF state")
    buckets: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        nbytes, itemsize = _nbytes(spec), spec[1].itemsize
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        if size % itemsize:
            raise ValueError(
                f"{spec[0]}: {spec[1]} at byte offset {size} of its bucket is unaligned; order the "
                "tensors by element size (largest first)"
            )
        buckets[-1].append(spec)
        size += nbytes
    return [b for b in buckets if b]


def byte_offsets(bucket: Sequence[Spec]) -> list[int]:
    """Where each tensor starts in the bucket's bytes, as `FlattenedTensorBucket` lays them out
    (back to back, in order), then the bucket's total size."""
    offsets = [0]
    for spec in bucket:
        offsets.append(offsets[-1] + _nbytes(spec))
    return offsets


class UpdateGroup:
    """Rank 0 of the group the workers join in `init_weights_update_group`: the TCP store they
    rendezvous at (hosted here) and, once `join` returns, the backend.

    Built to match SGLang's `init_custom_process_group` key for key: the TCP store its
    `rendezvous("tcp://addr:port")` joins, `PrefixStore(group_name)`, then what torch's
    `_new_process_group_helper` does for one backend (`PrefixStore(f"{group_name}/")`,
    `PrefixStore(f"{device}/")`, the backend, `_set_sequence_number_for_group`, which exchanges a
    sequence number through the store). Not that helper itself: on a trainer whose default group
    is bound to a GPU (`parallel.runtime` passes `device_id`) it would build the NCCL communicator
    by splitting the trainer's own world communicator, which the workers are not part of.

    The store's server is made here, not waiting for anyone (`wait_for_workers=False`); the
    sender's own rendezvous in `join` is a client of it, like the workers'. So `abort` can end a
    set-up that waits for a worker that will never come: dropping the server fails every pending
    rendezvous on it and frees the port."""

    def __init__(self, cfg: DenseSyncConfig, world_size: int, group_name: str) -> None:
        self.cfg, self.world_size, self.name = cfg, world_size, group_name
        self._connect = datetime.timedelta(seconds=cfg.connect_timeout_s)
        # what rank 0's `rendezvous("tcp://addr:port")` hosts in a plain process; not that call
        # itself, which under torchrun (TORCHELASTIC_USE_AGENT_STORE) only makes a client of the store
        self._server: dist.TCPStore | None = dist.TCPStore(
            cfg.master_address, cfg.master_port, world_size, is_master=True, timeout=self._connect,
            wait_for_workers=False, multi_tenant=True,
        )  # fmt: skip
        # this rank's own connection to it, made now (the server is local): once the server is
        # dropped, whatever waits on this connection fails at once
        self._client = dist.TCPStore(
            cfg.master_address, cfg.master_port, world_size, is_master=False, timeout=self._connect,
            wait_for_workers=False,
        )  # fmt: skip
        self.backend: C10dBackend | None = None

    def join(self) -> C10dBackend:
        """Rank 0's side of the set-up; blocks until all `world_size` ranks have joined."""
        cfg = self.cfg
        device = "cuda" if cfg.backend == "nccl" else "cpu"
        prefixed = dist.PrefixStore(
            f"{device}/", dist.PrefixStore(f"{self.name}/", dist.PrefixStore(self.name, self._client))
        )
        timeout = datetime.timedelta(seconds=cfg.timeout_s)
        backend: C10dBackend
        if cfg.backend == "nccl":
            from torch.distributed import ProcessGroupNCCL

            options = ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            options.config.blocking = 0  # communicator init that abort() can end
            backend = ProcessGroupNCCL(prefixed, 0, self.world_size, options)
        else:
            backend = dist.ProcessGroupGloo(prefixed, 0, self.world_size, timeout)
        backend._set_sequence_number_for_group()
        self.backend = backend
        return backend

    def abort(self) -> None:
        """End whatever is pending (set-up or a broadcast) and give the port back."""
        if self.backend is not None:
            self.backend.abort()
        self._server = None  # the last reference: the server stops, pending rendezvous fail

    def close(self) -> None:
        if self.backend is not None:
            self.backend.shutdown()
        self._server = None


def broadcast(group: C10dBackend, flat: torch.Tensor) -> None:
    """What the receivers' `torch.distributed.broadcast(flat, src=0, group=...)` meets."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    options.rootTensor = 0
    backend: Any = group  # torch's stubs omit Backend.broadcast, which every backend has
    backend.broadcast([flat], options).wait()


def dense_sync(
    workers: Sequence[DenseWorker], plan: Sequence[Sequence[Spec]], fill: Fill, *, version: int,
    cfg: DenseSyncConfig,
) -> DenseSyncStats:  # fmt: skip
    """Send every bucket of `plan` (`plan_buckets`: HF names, the dtype the workers serve), each
    filled by `fill` just before its broadcast, to every worker, then declare `version` to their
    sparse receivers. Raises DenseSyncError naming all `workers` if any step fails on any of them
    (their weights are then mixed: drop them or sync them again)."""
    urls = [w.url for w in workers]
    if not urls or len(set(urls)) != len(urls):
        raise ValueError(
            f"workers={urls}: need at least one, each once (a worker's ranks join the group once)"
        )
    group_name = f"{cfg.group_prefix}-{version}-{uuid.uuid4().hex[:8]}"
    pool = ThreadPoolExecutor(max_workers=max(1, len(workers)))
    try:
        run = _Fanout(pool, workers, cfg.timeout_s)
        tp = dict(zip((w.url for w in workers), run.each(lambda w: w.tp_size()), strict=True))
        try:  # a worker whose session did open must not stay paused when another's did not
            run.each(lambda w: w.open_update_session())
            sent = _send(run, plan, fill, group_name, tp, version, cfg)
            run.each(lambda w: w.declare_version(version, tp[w.url]))
        except BaseException:
            with contextlib.suppress(DenseSyncError):  # the first failure is the one reported
                run.each(lambda w: w.close_update_session())
            raise
        run.each(lambda w: w.close_update_session())
    finally:  # a call still hanging on a worker past its timeout is not waited for
        pool.shutdown(wait=False, cancel_futures=True)
    return DenseSyncStats(buckets=len(plan), bytes=sent, workers=len(workers))


def _send(
    run: _Fanout,
    plan: Sequence[Sequence[Spec]],
    fill: Fill,
    group_name: str,
    tp: dict[str, int],
    version: int,
    cfg: DenseSyncConfig,
) -> int:
    """Open the group, broadcast every bucket while each worker's HTTP call receives it, close it."""
    offsets, world = {}, 1
    for url, size in tp.items():
        offsets[url], world = world, world + size
    try:
        group = UpdateGroup(cfg, world, group_name)
    except Exception as exc:  # e.g. the port is taken: no worker was asked to join yet
        raise DenseSyncError(
            f"dense sync: cannot host the update group's store at {cfg.master_address}:{cfg.master_port} "
            f"({type(exc).__name__}: {exc}); free the port or set sync.broadcast.master_port",
            run.urls,
        ) from exc
    sent, completed = 0, False
    try:
        backend = run.during(
            lambda w: w.init_weights_update_group(
                master_address=cfg.master_address,
                master_port=cfg.master_port,
                rank_offset=offsets[w.url],
                world_size=world,
                group_name=group_name,
                backend=cfg.backend,
            ),
            group.join,
            cancel=group.abort,
            timeout_s=cfg.connect_timeout_s,
        )
        for bucket in plan:
            flat = fill(bucket)
            run.during(
                lambda w, bucket=bucket: w.update_weights_from_distributed(  # type: ignore[misc]
                    bucket, group_name=group_name, version=version
                ),
                lambda flat=flat: broadcast(backend, flat),  # type: ignore[misc]
                cancel=group.abort,
                timeout_s=cfg.timeout_s,
            )
            sent += flat.numel()
        completed = True
    finally:  # abort: a failed bucket may have left a broadcast waiting for a worker that never joins
        if completed:
            group.close()
        else:
            group.abort()
        run.each(lambda w: w.destroy_weights_update_group(group_name))
    return sent


class _Fanout:
    """One call on every worker at once (threads: each HTTP call may block in a collective)."""

    def __init__(self, pool: ThreadPoolExecutor, workers: Sequence[DenseWorker], timeout_s: float) -> None:
        self.pool, self.workers, self.timeout_s = pool, list(workers), timeout_s
        self.urls = [w.url for w in workers]

    def each(self, call: Callable[[DenseWorker], T]) -> list[T]:
        """`call` on every worker; raises DenseSyncError if any failed or did not answer in time."""
        futures = [self.pool.submit(call, w) for w in self.workers]
        self._settle(futures)
        return [f.result() for f in futures]

    def during(
        self, call: Callable[[DenseWorker], object], local: Callable[[], T], *, cancel: Callable[[], None],
        timeout_s: float,
    ) -> T:  # fmt: skip
        """`call` on every worker while this process runs its side (`local`) of the collective they
        join, on a thread of its own. Whichever fails first ends the wait: a worker's call that
        fails (it cannot complete the collective now) or `local`; so does `timeout_s`. Then
        `cancel` aborts the local side, which may still be blocked, and DenseSyncError is raised."""
        futures = [self.pool.submit(call, w) for w in self.workers]
        mine = _in_thread(local)
        pending: set[Future[Any]] = {mine, *futures}
        deadline = time.monotonic() + timeout_s
        while pending:
            done, pending = wait(
                pending, timeout=max(0.0, deadline - time.monotonic()), return_when=FIRST_COMPLETED
            )
            failed = self._failures(futures)
            if failed or not done or (mine in done and mine.exception() is not None):
                cancel()
                error = mine.exception() if mine.done() else None
                why = (
                    f"{type(error).__name__}: {error}"
                    if error
                    else ("done" if mine.done() else "still waiting")
                )
                late = [u for u, f in zip(self.urls, futures, strict=True) if not f.done()]
                raise DenseSyncError(
                    f"dense sync: worker failures {failed}; this side: {why}; no answer yet "
                    f"(timeout {timeout_s:g} s): {late}",
                    self.urls,
                )
        return mine.result()

    def _failures(self, futures: Sequence[Future[Any]]) -> list[str]:
        return [
            f"{url}: {type(f.exception()).__name__}: {f.exception()}"
            for url, f in zip(self.urls, futures, strict=True)
            if f.done() and f.exception() is not None
        ]

    def _settle(self, futures: Sequence[Future[Any]]) -> None:
        _, pending = wait(futures, timeout=self.timeout_s, return_when=FIRST_EXCEPTION)
        failed = self._failures(futures)
        late = [url for url, f in zip(self.urls, futures, strict=True) if f in pending]
        if failed or late:
            raise DenseSyncError(
                f"dense sync failed: {failed}; still waiting (timeout {self.timeout_s} s): {late}", self.urls
            )


def _in_thread(fn: Callable[[], T]) -> Future[T]:
    """`fn` on a daemon thread: one blocked in a collective that was aborted must not keep the
    trainer's process from exiting (a pool's threads are joined at exit)."""
    future: Future[T] = Future()

    def target() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            future.set_exception(exc)

    threading.Thread(target=target, name="dense-sync-local", daemon=True).start()
    return future
