"""Fault-tolerant fan-out of generation requests over one or more rollout engines.

The trainer sees ONE engine interface (`RolloutEngine` from `sparserl_mcore.rollout.protocol`):
an in-process `EmbeddedEngine` or `RemoteEngine` HTTP clients. `EnginePool.generate` splits a
step's requests into chunks (one GRPO group per chunk by default, so a group's prompt KV stays
shared in one engine's radix cache) and hands them out from a shared queue, one per live engine in
turn, so servers share a step evenly. An engine with a `concurrency` attribute (a server) holds
that many chunks at once IN TOTAL, over every `generate` running at the same time (the asynchronous loop
generates up to max_staleness + 1 batches plus an eval at once: they share each server's budget,
`rollout.server_concurrency`); the chunks it takes in one round go out in one call, on a worker
thread of their own. The embedded engine takes one chunk at a time per `generate` (concurrent
callers join its continuous batch): its sampling then consumes its generator in request order, so
a seeded run repeats exactly.

Faults: a failed request is retried, not its engine. A chunk whose call raises (or, through
`RequestsFailed`, whose requests failed), or that gets no answer within `chunk_timeout_s`, goes
back to the queue after a backoff (`retry_backoff_s`, doubling) and is sent to another engine when
one is live; its request ids and seeds are unchanged, so a retry samples what the first attempt
would have. A chunk is tried at most `max_attempts` times. The engine leaves the pool only when it
then fails its health check, or after `engine_failures` failed calls in a row (not a router while
a worker behind it is in service: one hung request must not end the run); its other chunks
in flight go back to the queue then (a hung thread is abandoned; whatever it returns later is
discarded, so no sample is ever duplicated). Removed engines are probed in the background
(`probe_interval_s`); one answering health again is `recovered()`, and the loop re-admits it
(`admit`) only after a full weight sync to the current version (`WeightSyncer.readmit`).
SGLang workers behind a router engine (`trainer/router_workers.py`) are watched the same way from
the start: one failing its health check (or a sync) is taken out of the router, probed, and put
back into the router only by `admit`, after its full sync, so none serves an older version.
Every result is keyed by request id, so the output has exactly one sample per request, in the
order of the input. With no engine left, `NoEngineLeftError` tells the loop to checkpoint and stop.

Threads: `generate` runs on the producer's worker threads while the main thread syncs weights, so
the engine tables are guarded by one lock and `live` / `dead` are snapshots (iterating the table
itself while a worker removes an engine raises on the host only and skips a collective there).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from sparserl_mcore.trainer.engine_calls import Answer, call_engine, is_healthy, oldest_version
from sparserl_mcore.trainer.router_workers import RouterWorkers

EventSink = Callable[[str, dict[str, Any]], None]


class Fleet(Protocol):
    """What the loop, the weight syncer and the evaluator use of the host's engines: an
    `EnginePool` in the learner's process, or a `RolloutManager` (`trainer/rollout_manager.py`)
    whose pool runs in a process of its own (`rollout.manager`)."""

    version: int
    on_chunk_done: Callable[[int], None]

    @property
    def live(self) -> dict[str, Any]: ...
    @property
    def dead(self) -> dict[str, str]: ...
    def __len__(self) -> int: ...
    def generate(self, requests: Sequence[Any]) -> list[Any]: ...
    def engine(self, name: str) -> Any: ...
    def remove(self, name: str, reason: str) -> None: ...
    def remove_workers(self, router: str, urls: set[str], reason: str) -> None: ...
    def workers_live(self) -> int | None: ...
    def recovered(self) -> list[str]: ...
    def admit(self, name: str) -> None: ...
    def not_recovered(self, name: str) -> None: ...
    def take_requests_retried(self) -> int: ...
    def stop(self) -> None: ...
    def close(self) -> None: ...


class NoEngineLeftError(RuntimeError):
    """Every rollout engine has failed; the loop checkpoints and stops."""


class GenerationStopped(RuntimeError):
    """The run is stopping (`EnginePool.stop`): a batch still generating is dropped."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """How requests are spread over engines and how long a failing engine is tolerated."""

    chunk_size: int = 8  # requests per engine call; the loop passes the GRPO group size
    chunk_timeout_s: float = 600.0  # an engine call taking longer counts as a hang
    max_attempts: int = 3  # tries per chunk across engines before the step fails
    retry_backoff_s: float = 0.5  # wait before a chunk's first retry, doubling after each
    engine_failures: int = 3  # failed calls in a row before an engine that still answers health leaves
    probe_interval_s: float = 10.0  # how often removed engines are asked for health (0: never)

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(
                f"chunk_size={self.chunk_size} must be >= 1 (the trainer passes rollout.group_size)"
            )
        if self.chunk_timeout_s <= 0:
            raise ValueError(
                f"chunk_timeout_s={self.chunk_timeout_s} must be > 0 seconds (from rollout.request_timeout_s)"
            )
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts={self.max_attempts} must be >= 1 (rollout.max_retries + 1)")
        for key in ("retry_backoff_s", "probe_interval_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{key}={value!r} must be a finite number of seconds")
            if value < 0:
                raise ValueError(f"{key}={value!r} must be >= 0 seconds")
        if self.engine_failures < 1:
            raise ValueError(f"engine_failures={self.engine_failures} must be >= 1")


@dataclasses.dataclass
class _Chunk:
    index: int
    requests: list[Any]
    attempts: int = 0
    floor: int = 0  # the pool's `version` when it was sent: no token may be older
    ready_at: float = 0.0  # monotonic time before which it is not sent again (retry backoff)
    failed_on: set[str] = dataclasses.field(default_factory=set)


# chunks in flight of one `generate`: (engine name, chunk index) -> (chunk, when it was sent)
_Busy = dict[tuple[str, int], tuple[_Chunk, float]]


def _no_events(kind: str, fields: dict[str, Any]) -> None:
    del kind, fields


class EnginePool:
    """Engines by name; `generate` survives engines failing, dying or hanging mid-batch."""

    def __init__(self, engines: dict[str, Any], cfg: PoolConfig, on_event: EventSink = _no_events):
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self.cfg = cfg
        self._engines = dict(engines)  # every engine of the pool, removed ones included (probing)
        self._live = dict(engines)
        self._dead: dict[str, str] = {}  # name -> reason it left the pool
        self._strikes = dict.fromkeys(engines, 0)  # failed calls in a row
        self._held = dict.fromkeys(engines, 0)  # chunks in flight, over every `generate` at once
        self._recovered: set[str] = set()  # removed engines that answered health again
        self._not_before: dict[str, float] = {}  # failed re-admissions: when to probe it again
        self._failed_readmissions: dict[str, int] = {}
        self._inboxes: set[queue.Queue] = set()  # the answer queues of the `generate`s running now
        self._requests_retried = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._prober: threading.Thread | None = None
        self._on_event = on_event
        self._behind = RouterWorkers(engines)  # SGLang workers behind router engines
        if self._behind:
            with self._lock:
                self._start_probing()  # a worker may die under the router at any time
        # the weight version every live engine holds (the loop sets it after each sync): a sample
        # with an older token comes from an engine that restarted or missed a sync
        self.version = 0
        self.on_chunk_done: Callable[[int], None] = lambda n: None  # progress display hook
        self._stopping = threading.Event()

    @property
    def live(self) -> dict[str, Any]:
        """A snapshot of the engines in service (safe to iterate while `generate` removes one)."""
        with self._lock:
            return dict(self._live)

    @property
    def dead(self) -> dict[str, str]:
        """A snapshot of the removed engines and why each left."""
        with self._lock:
            return dict(self._dead)

    def workers_live(self) -> int | None:
        """SGLang workers in service behind the pool's routers (None when it has no router)."""
        return len(self._behind.serving(set(self.live))) if self._behind else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._live)

    def remove(self, name: str, reason: str) -> None:
        """Take an engine out of service (also used by weight sync when a patch cannot land)."""
        with self._lock:
            if self._live.pop(name, None) is None:
                return
            self._dead[name] = reason
            self._recovered.discard(name)
            live = len(self._live)
            self._start_probing()
            self._wake()  # a chunk waiting for another engine than the ones it failed on looks again
        self._on_event("engine_removed", {"engine": name, "reason": reason, "live": live})

    def engine(self, name: str) -> Any:
        """The engine (or worker behind a router) `name`, in service or not (None when unknown)."""
        return self._engines.get(name) or self._behind.worker(name)

    def remove_workers(self, router: str, urls: set[str], reason: str) -> None:
        """Take SGLang workers out of the router engine `router` (dead, or a weight sync failed on
        them); they are probed and come back through `admit`. A router that cannot take them out
        leaves the pool (stale workers must not keep generating)."""
        engine = self.live.get(router)
        if engine is None:
            return
        try:
            taken = self._behind.take_out(engine, urls, reason)
        except Exception as exc:  # noqa: BLE001 - reported as the router's removal
            self.remove(router, f"could not take {sorted(urls)} out: {exc}")
            return
        with self._lock:
            self._recovered.difference_update(taken)
            self._start_probing()
        fields = {"router": router, "reason": reason, "live": self._behind.serving_count(router)}
        for url in taken:
            self._on_event("engine_removed", {"engine": url, **fields})

    def recovered(self) -> list[str]:
        """Removed engines that answered health since; each needs a full weight sync, then `admit`."""
        with self._lock:
            return sorted(self._recovered)

    def admit(self, name: str) -> None:
        """Put a removed engine back in service (it now holds the learner's current version); a
        worker behind a router goes back into the router (`_admit_worker`)."""
        if self._behind.owns(name):
            self._admit_worker(name)
            return
        with self._lock:
            if name in self._live or name not in self._engines:
                return
            self._live[name] = self._engines[name]
            self._dead.pop(name, None)
            self._recovered.discard(name)
            self._strikes[name] = self._held[name] = 0
            self._failed_readmissions.pop(name, None)
            self._not_before.pop(name, None)
            live = len(self._live)
            self._wake()
        self._on_event("engine_readmitted", {"engine": name, "live": live})

    def _admit_worker(self, url: str) -> None:
        router = self._behind.router_of(url)
        engine = self.live.get(router)
        try:
            if engine is None:
                raise RuntimeError(f"its router {router} left the pool")
            self._behind.put_back(engine, url)
        except Exception as exc:  # noqa: BLE001 - it stays out and is probed again
            self._on_event("readmission_failed", {"engine": url, "reason": f"{type(exc).__name__}: {exc}"})
            self.not_recovered(url)
            return
        with self._lock:
            self._recovered.discard(url)
            self._failed_readmissions.pop(url, None)
            self._not_before.pop(url, None)
        live = self._behind.serving_count(router)
        self._on_event("engine_readmitted", {"engine": url, "router": router, "live": live})

    def not_recovered(self, name: str) -> None:
        """Its re-admission sync failed: it stays removed and is probed again, after twice the
        wait of its last failed re-admission (each attempt is a full weight sync)."""
        with self._lock:
            self._recovered.discard(name)
            waits = self._failed_readmissions[name] = self._failed_readmissions.get(name, 0) + 1
            self._not_before[name] = time.monotonic() + self.cfg.probe_interval_s * 2**waits

    def take_requests_retried(self) -> int:
        """Requests retried since the last call (telemetry, per step)."""
        with self._lock:
            n, self._requests_retried = self._requests_retried, 0
        return n

    def stop(self) -> None:
        """The run is stopping: no `generate` starts another chunk; each one in progress raises
        GenerationStopped at its next answer (the caller aborts what the engines run)."""
        self._stopping.set()

    def close(self) -> None:
        """Stop probing and close every engine that holds resources (HTTP clients)."""
        self._closed.set()
        self._behind.close_out()
        for engine in self._engines.values():
            close = getattr(engine, "close", None)
            if callable(close):
                close()

    def sticky(self, key: str) -> str:
        """The live engine `key` (an episode group) keeps to: the highest hash of (key, engine)
        (rendezvous hashing), so a group stays on one engine across calls and only the groups of
        an engine that leaves the pool move."""
        live = self.live
        if not live:
            raise NoEngineLeftError(f"no rollout engine left: {self.dead}")
        return max(live, key=lambda name: hashlib.blake2b(f"{key}|{name}".encode()).digest())

    # -- probing removed engines ----------------------------------------------------------------
    def _start_probing(self) -> None:
        """(lock held) The prober thread, started at the first removal."""
        if self._prober is None and self.cfg.probe_interval_s > 0:
            self._prober = threading.Thread(target=self._probe, name="sparserl-engine-probe", daemon=True)
            self._prober.start()

    def _probe(self) -> None:
        """Removed engines and workers taken out of their router: recovered once they answer
        health; workers in service behind a router: taken out when they do not."""
        while not self._closed.wait(self.cfg.probe_interval_s):
            now = time.monotonic()
            out = self._behind.out()
            with self._lock:
                waiting = [
                    (n, self._engines.get(n) or self._behind.worker(n))
                    for n in [*self._dead, *out]
                    if n not in self._recovered and self._not_before.get(n, 0.0) <= now
                ]
                serving = self._behind.serving(set(self._live))
            for name, engine in waiting:
                if is_healthy(engine):
                    with self._lock:
                        if name in self._dead or name in self._behind.out():
                            self._recovered.add(name)
            for url, worker in serving:
                if is_healthy(worker) is False:
                    self.remove_workers(self._behind.router_of(url), {url}, "health check failed")

    # -- generation -----------------------------------------------------------------------------
    def generate(self, requests: Sequence[Any]) -> list[Any]:
        """One sample per request, in input order; retries the chunks of failed or hung calls."""
        size = self.cfg.chunk_size
        pending = [
            _Chunk(index=i, requests=list(requests[start : start + size]))
            for i, start in enumerate(range(0, len(requests), size))
        ]
        done: dict[int, list[Any]] = {}
        inbox: queue.Queue[Answer | None] = queue.Queue()
        busy: _Busy = {}
        with self._lock:
            self._inboxes.add(inbox)
        try:
            while pending or busy:
                if self._stopping.is_set():
                    raise GenerationStopped(f"the run is stopping ({len(done)} chunks done)")
                self._dispatch(pending, busy, inbox)
                self._collect(pending, busy, inbox, done)
        finally:
            with self._lock:
                self._inboxes.discard(inbox)
                for name, _ in busy:  # only on an error: the abandoned calls' slots are free again
                    self._held[name] = max(0, self._held.get(name, 0) - 1)
                self._wake()
        return [sample for index in sorted(done) for sample in done[index]]

    def _wake(self) -> None:
        """(lock held) Slots were freed or an engine came back: every waiting `generate` looks again."""
        for inbox in self._inboxes:
            inbox.put(None)

    def _dispatch(self, pending: list[_Chunk], busy: _Busy, inbox: queue.Queue) -> None:
        """Hand out ready chunks one per engine in turn, each engine up to its free `concurrency`
        (shared by every `generate`); a chunk goes to an engine it has not failed on when one such is
        live. An engine's chunks of one round go out in ONE call (per-call HTTP and JSON work is CPU
        on the learner's host, which in the asynchronous modes is the learner's own core)."""
        now = time.monotonic()
        calls: dict[str, list[_Chunk]] = {}
        with self._lock:
            live = list(self._live.items())
            if not live:
                raise NoEngineLeftError(
                    f"no rollout engine left mid-batch ({len(busy)} chunks in flight, "
                    f"{len(pending)} to send): {self._dead}"
                )
            for (name, index), (chunk, _) in list(busy.items()):  # removed by another `generate`
                if name not in self._live:
                    del busy[(name, index)]
                    self._held[name] = max(0, self._held[name] - 1)
                    chunk.attempts -= 1
                    pending.append(chunk)
            names = {name for name, _ in live}
            free = {n: self._free(n, e, busy) for n, e in live}
            placed = True
            while placed:
                placed = False
                for name, _ in live:
                    if free[name] <= 0:
                        continue
                    picked = _pick(pending, name, names, now)
                    if picked is None:
                        continue
                    pending.remove(picked)
                    # this attempt's own object: a late answer of an earlier attempt on the same
                    # engine (a call abandoned as hung) is told apart from it, and discarded
                    picked = dataclasses.replace(picked)
                    free[name] -= 1
                    self._held[name] += 1
                    picked.attempts += 1
                    picked.floor = self.version
                    busy[(name, picked.index)] = (picked, now)
                    calls.setdefault(name, []).append(picked)
                    placed = True
        for name, engine in live:
            if name in calls:
                threading.Thread(
                    target=call_engine, args=(name, engine, calls[name], inbox), daemon=True
                ).start()

    def _free(self, name: str, engine: Any, busy: _Busy) -> int:
        """(lock held) Chunks `name` may take now: a server's `concurrency` less what every running
        `generate` holds there; an engine without one (the embedded engine, which batches concurrent
        callers itself) one chunk per `generate`."""
        limit = getattr(engine, "concurrency", None)
        if limit is None:
            return 1 - sum(owner == name for owner, _ in busy)
        return int(limit) - self._held[name]

    def _collect(self, pending: list[_Chunk], busy: _Busy, inbox: queue.Queue, done: dict) -> None:
        """Wait for an answer, a timeout, a chunk's backoff to end or a freed slot; then take every
        answer already in: the chunks of one call finish together, and go out again together."""
        now = time.monotonic()
        deadlines = [started + self.cfg.chunk_timeout_s for _, started in busy.values()]
        deadlines += [c.ready_at for c in pending if c.ready_at > now]
        wait_s = max(0.0, min(deadlines) - now) if deadlines else None
        try:
            answer = inbox.get(timeout=wait_s)
        except queue.Empty:
            self._expire(pending, busy)
            return
        while True:
            if answer is not None:
                self._accept(answer, pending, busy, done)
            try:
                answer = inbox.get_nowait()
            except queue.Empty:
                return

    def _expire(self, pending: list[_Chunk], busy: _Busy) -> None:
        """Chunks past `chunk_timeout_s` are retried; their engines get one failure each."""
        now, hung = time.monotonic(), set()
        for (name, index), (chunk, started) in list(busy.items()):
            if now - started >= self.cfg.chunk_timeout_s:
                self._release(busy, name, index)
                why = f"no answer within {self.cfg.chunk_timeout_s:g} s"
                hung.add((name, why))
                self._retry(chunk, pending, name, why)
        for name, why in sorted(hung):
            self._strike(name, why, "", pending, busy)

    def _accept(self, answer: Answer, pending: list[_Chunk], busy: _Busy, done: dict) -> None:
        name, results, healthy = answer
        failure, leave = "", "; health check failed" if healthy is False else ""
        for chunk, samples, error in results:
            key = (name, chunk.index)
            if key not in busy or busy[key][0] is not chunk:
                continue  # a late answer from a call already declared hung or failed: discarded
            self._release(busy, name, chunk.index)
            if samples is not None and [s.rid for s in samples] != [r.rid for r in chunk.requests]:
                error = f"returned samples for other requests than asked ({len(samples)} samples)"
                samples = None
            elif samples is not None and (oldest := oldest_version(samples)) < chunk.floor:
                error = f"served weight version {oldest} below {chunk.floor} (restarted, or missed a sync)"
                samples = None
                if not hasattr(self._engines[name], "workers"):  # a router: its workers' problem
                    leave = " (out at once: a full sync must bring it back)"
            if samples is None:
                failure = failure or error
                self._retry(chunk, pending, name, error)
            else:
                done[chunk.index] = samples
                self.on_chunk_done(len(samples))
        if failure:
            self._strike(name, failure, leave, pending, busy)
        else:
            with self._lock:
                self._strikes[name] = 0

    def _release(self, busy: _Busy, name: str, index: int) -> None:
        del busy[(name, index)]
        with self._lock:
            self._held[name] = max(0, self._held[name] - 1)
            self._wake()

    def _strike(self, name: str, why: str, leave: str, pending: list[_Chunk], busy: _Busy) -> None:
        """A failed call: the engine leaves at once when `leave` says why (its health check failed,
        it served stale weights), else after `engine_failures` in a row; then its other chunks in
        flight are requeued without counting an attempt. A router with a worker in service is the
        whole fleet and its failed requests are its workers' (a hung one, a worker that died): only
        its own failed health check takes it out; its workers are watched by the prober."""
        with self._lock:
            self._strikes[name] = strikes = self._strikes.get(name, 0) + 1
        if leave:
            reason = why + leave
        elif strikes >= self.cfg.engine_failures and not self._behind.serving_count(name):
            reason = f"{why} ({strikes} failed calls in a row)"
        else:
            return
        self.remove(name, reason)
        for (owner, index), (chunk, _) in list(busy.items()):
            if owner == name:
                self._release(busy, owner, index)
                chunk.attempts -= 1
                pending.append(chunk)

    def _retry(self, chunk: _Chunk, pending: list[_Chunk], engine: str, why: str) -> None:
        if chunk.attempts >= self.cfg.max_attempts:
            raise NoEngineLeftError(
                f"chunk {chunk.index} failed {chunk.attempts} times (last on {engine}: {why}); "
                f"raise rollout.max_retries or check the engines"
            )
        chunk.failed_on.add(engine)
        chunk.ready_at = time.monotonic() + self.cfg.retry_backoff_s * 2 ** (chunk.attempts - 1)
        rids = [r.rid for r in chunk.requests]
        with self._lock:
            self._requests_retried += len(rids)
        self._on_event(
            "rollout_retry", {"engine": engine, "reason": why, "attempt": chunk.attempts, "rids": rids}
        )
        pending.append(chunk)


def _pick(pending: list[_Chunk], name: str, live: set[str], now: float) -> _Chunk | None:
    """The first chunk ready to go to `name`: one that failed there waits for another live engine."""
    for chunk in sorted(pending, key=lambda c: c.index):
        if chunk.ready_at > now:
            continue
        if name in chunk.failed_on and live - chunk.failed_on:
            continue
        return chunk
    return None
