"""Fault-tolerant fan-out of generation requests over one or more rollout engines.

The trainer sees ONE engine interface (`RolloutEngine` from `sparserl_mcore.rollout.protocol`):
an in-process `EmbeddedEngine` or `RemoteEngine` HTTP clients. `EnginePool.generate` splits a
step's requests into chunks (one GRPO group per chunk by default, so a group's prompt KV stays
shared in one engine's radix cache) and hands them out from a shared queue, one per live engine in
turn, so servers share a step evenly. An engine with a `concurrency` attribute takes that many
chunks at once, so a server batches many groups (remote servers: `rollout.server_concurrency`
requests; the SGLang router, `sglang.client.SGLangRouter`: its workers' sum); the chunks it takes in
one round go out in one call, on a worker thread of their own. The embedded engine takes one chunk
at a time: its sampling then consumes its generator in request order, so a seeded run repeats
exactly.

Faults: a chunk whose engine raises, or does not answer within `chunk_timeout_s`, goes back to
the queue and that engine leaves the pool (a hung thread is abandoned; whatever it returns later
is discarded, so no sample is ever duplicated); its other chunks in flight go back to the queue
too. A chunk is tried at most `max_attempts` times.
Every result is keyed by request id, so the output has exactly one sample per request, in the
order of the input. With no engine left, `NoEngineLeftError` tells the loop to checkpoint and stop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

EventSink = Callable[[str, dict[str, Any]], None]


class NoEngineLeftError(RuntimeError):
    """Every rollout engine has failed; the loop checkpoints and stops."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolConfig:
    """How requests are spread over engines and how long a failing engine is tolerated."""

    chunk_size: int = 8  # requests per engine call; the loop passes the GRPO group size
    chunk_timeout_s: float = 600.0  # an engine call taking longer counts as a hang
    max_attempts: int = 3  # tries per chunk across engines before the step fails

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


@dataclasses.dataclass
class _Chunk:
    index: int
    requests: list[Any]
    attempts: int = 0


# chunks in flight: (engine name, chunk index) -> (chunk, when it was sent)
_Busy = dict[tuple[str, int], tuple[_Chunk, float]]
# one chunk's answer: (chunk, its samples, "") or (chunk, None, the error)
_Result = tuple[_Chunk, list[Any] | None, str]


def _no_events(kind: str, fields: dict[str, Any]) -> None:
    del kind, fields


class EnginePool:
    """Engines by name; `generate` survives engines dying or hanging mid-batch."""

    def __init__(self, engines: dict[str, Any], cfg: PoolConfig, on_event: EventSink = _no_events):
        if not engines:
            raise ValueError("EnginePool needs at least one engine")
        self.cfg = cfg
        self.live: dict[str, Any] = dict(engines)
        self.dead: dict[str, str] = {}  # name -> reason it left the pool
        self._on_event = on_event
        self.on_chunk_done: Callable[[int], None] = lambda n: None  # progress display hook

    def __len__(self) -> int:
        return len(self.live)

    def remove(self, name: str, reason: str) -> None:
        """Take an engine out of service (also used by weight sync when a patch cannot land)."""
        if self.live.pop(name, None) is not None:
            self.dead[name] = reason
            self._on_event("engine_removed", {"engine": name, "reason": reason, "live": len(self.live)})

    def close(self) -> None:
        """Close every engine that holds resources (HTTP clients); the pool is done with."""
        for engine in (*self.live.values(),):
            close = getattr(engine, "close", None)
            if callable(close):
                close()

    def sticky(self, key: str) -> str:
        """The live engine `key` (an episode group) keeps to: the highest hash of (key, engine)
        (rendezvous hashing), so a group stays on one engine across calls and only the groups of
        an engine that leaves the pool move."""
        if not self.live:
            raise NoEngineLeftError(f"no rollout engine left: {self.dead}")
        return max(self.live, key=lambda name: hashlib.blake2b(f"{key}|{name}".encode()).digest())

    def for_each(self, fn: Callable[[Any], Any], what: str) -> dict[str, Any]:
        """Call `fn(engine)` on every live engine; an engine that raises leaves the pool."""
        results = {}
        for name, engine in list(self.live.items()):
            try:
                results[name] = fn(engine)
            except Exception as exc:  # an engine's failure must not stop the learner
                self.remove(name, f"{what} failed: {type(exc).__name__}: {exc}")
        if not self.live:
            raise NoEngineLeftError(f"no rollout engine left after {what}: {self.dead}")
        return results

    def generate(self, requests: Sequence[Any]) -> list[Any]:
        """One sample per request, in input order; retries chunks of failed or hung engines."""
        if not self.live:
            raise NoEngineLeftError(f"no rollout engine left: {self.dead}")
        size = self.cfg.chunk_size
        pending: queue.Queue[_Chunk] = queue.Queue()
        n_chunks = 0
        for start in range(0, len(requests), size):
            pending.put(_Chunk(index=n_chunks, requests=list(requests[start : start + size])))
            n_chunks += 1
        done: dict[int, list[Any]] = {}
        finished: queue.Queue[tuple[str, list[_Result]]] = queue.Queue()
        busy: _Busy = {}
        while len(done) < n_chunks:
            self._dispatch(pending, busy, finished)
            if not busy:
                raise NoEngineLeftError(
                    f"no rollout engine left mid-batch ({len(done)}/{n_chunks} chunks done): {self.dead}"
                )
            self._collect(pending, busy, finished, done)
        return [sample for index in range(n_chunks) for sample in done[index]]

    def _dispatch(self, pending: queue.Queue, busy: _Busy, finished: queue.Queue) -> None:
        """Hand out pending chunks one per engine in turn, each engine up to its `concurrency`; an
        engine's chunks of one round go out in ONE call (per-call HTTP and JSON work is CPU on the
        learner's host, which in the asynchronous modes is the learner's own core)."""
        live = list(self.live.items())  # a weight sync may remove one meanwhile
        free = {name: getattr(engine, "concurrency", 1) for name, engine in live}
        for owner, _ in busy:
            if owner in free:
                free[owner] -= 1
        calls: dict[str, list[_Chunk]] = {name: [] for name, _ in live}
        while not pending.empty() and any(n > 0 for n in free.values()):
            for name, _ in live:
                if free[name] <= 0 or pending.empty():
                    continue
                free[name] -= 1
                chunk = pending.get_nowait()
                chunk.attempts += 1
                busy[(name, chunk.index)] = (chunk, time.monotonic())
                calls[name].append(chunk)
        for name, engine in live:
            if calls[name]:
                threading.Thread(
                    target=_call_engine, args=(name, engine, calls[name], finished), daemon=True
                ).start()

    def _collect(self, pending: queue.Queue, busy: _Busy, finished: queue.Queue, done: dict) -> None:
        """Wait for an answer (or a timeout), then take every answer already in: the chunks of one
        call finish together, and their slots go out again together."""
        oldest = min(started for _, started in busy.values())
        wait_s = max(0.0, oldest + self.cfg.chunk_timeout_s - time.monotonic())
        try:
            answer = finished.get(timeout=wait_s)
        except queue.Empty:
            for (name, _), (chunk, started) in list(busy.items()):
                if (name, chunk.index) in busy and time.monotonic() - started >= self.cfg.chunk_timeout_s:
                    self._fail(name, chunk, busy, pending, f"no answer within {self.cfg.chunk_timeout_s:g} s")
            return
        while True:
            name, results = answer
            for chunk, samples, error in results:
                self._accept(name, chunk, samples, error, pending, busy, done)
            try:
                answer = finished.get_nowait()
            except queue.Empty:
                return

    def _accept(
        self,
        name: str,
        chunk: _Chunk,
        samples: list[Any] | None,
        error: str,
        pending: queue.Queue,
        busy: _Busy,
        done: dict,
    ) -> None:
        key = (name, chunk.index)
        if key not in busy or busy[key][0] is not chunk:
            return  # a late answer from an engine already declared hung or failed: discarded
        if samples is None:
            self._fail(name, chunk, busy, pending, error)
        elif [s.rid for s in samples] != [r.rid for r in chunk.requests]:
            why = f"returned samples for other requests than asked ({len(samples)} samples)"
            self._fail(name, chunk, busy, pending, why)
        else:
            del busy[key]
            done[chunk.index] = samples
            self.on_chunk_done(len(samples))

    def _fail(self, name: str, chunk: _Chunk, busy: _Busy, pending: queue.Queue, why: str) -> None:
        """`name` leaves the pool: `chunk` is retried elsewhere, its other chunks in flight are
        requeued without counting it as an attempt of theirs."""
        self.remove(name, why)
        for key, (other, _) in list(busy.items()):
            if key[0] == name:
                del busy[key]
                if other is not chunk:
                    other.attempts -= 1
                    pending.put(other)
        self._retry(chunk, pending, name, why)

    def _retry(self, chunk: _Chunk, pending: queue.Queue, engine: str, why: str) -> None:
        if chunk.attempts >= self.cfg.max_attempts:
            raise NoEngineLeftError(
                f"chunk {chunk.index} failed {chunk.attempts} times (last on {engine}: {why}); "
                f"raise rollout.max_attempts or check the engines"
            )
        rids = [r.rid for r in chunk.requests]
        self._on_event(
            "rollout_retry", {"engine": engine, "reason": why, "attempt": chunk.attempts, "rids": rids}
        )
        pending.put(chunk)


def _call_engine(name: str, engine: Any, chunks: list[_Chunk], finished: queue.Queue) -> None:
    """One `generate` for all of `chunks`, answered as one item of per-chunk results (a short
    answer is then caught per chunk by the request ids)."""
    try:
        samples = list(engine.generate([r for chunk in chunks for r in chunk.requests]))
    except Exception as exc:  # reported to the pool, which retries elsewhere
        error = f"generate failed: {type(exc).__name__}: {exc}"
        finished.put((name, [(chunk, None, error) for chunk in chunks]))
        return
    results, start = [], 0
    for chunk in chunks:
        results.append((chunk, samples[start : start + len(chunk.requests)], ""))
        start += len(chunk.requests)
    finished.put((name, results))
