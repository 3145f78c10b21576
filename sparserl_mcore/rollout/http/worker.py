"""The scheduler thread between the HTTP server and a rollout engine.

Why threads: generation is long, blocking tensor work; running it on the asyncio event loop would
stall every other connection (health checks, pause, other clients). One scheduler thread takes
queued jobs in arrival order. Generate jobs that wait together become ONE `engine.generate` call
(a batch), run on a pool of `max_concurrent` batch threads, and each job's future resolves to its
own samples. `max_concurrent = 1` (the default) suits any engine; an engine whose `generate` may
be called from several threads at once (`EmbeddedEngine`: concurrent calls join its continuous
batch) gets `max_concurrent > 1`, so a request arriving mid-batch starts at the next decode step
instead of waiting for the batch to end.

Control operations (weight updates, cache flush) run between engine steps, so they finish within
about one step however long the running requests are: unless generation is paused already, the
worker pauses the engine with the operation's mode (weight updates "retract": in-flight requests
restart from their prompts under the new weights, so no sample mixes two versions; a flush
"in_place"), runs it and resumes. Explicit `pause(mode)` / `resume()` (the trainer's, SGLang's
pause_generation) hold generation until resumed; control operations then run at once.

Limits: at most `max_pending_requests` requests accepted and not yet answered (`Overloaded`
beyond, HTTP 503 with Retry-After); a request still queued `request_timeout_s` after it arrived
fails (`DeadlineExceeded`), one already running is aborted in the engine and returns what it
generated with finish_reason "abort".

Failures: an engine raising `RequestsFailed` says which requests failed: only their jobs fail. Any
other exception from a multi-job batch reruns its jobs one by one to find the bad one.
Cancellation: a cancelled job that has not started is dropped; one already running is aborted
through `engine.abort(rid)` (its requests finish as "abort").
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

from sparserl_mcore.rollout.protocol import (
    GenerateRequest,
    PauseMode,
    RequestsFailed,
    RolloutEngine,
    Sample,
)


class Overloaded(RuntimeError):
    """The server holds as many pending requests as it may (HTTP 503 + Retry-After)."""


class DeadlineExceeded(RuntimeError):
    """A request waited in the queue past its deadline without starting (HTTP 503)."""


class ShuttingDown(RuntimeError):
    """The server is stopping (HTTP 503)."""


class GenerateJob:
    """Requests of one HTTP call; `future` resolves to their samples in request order."""

    def __init__(self, requests: Sequence[GenerateRequest], deadline: float | None) -> None:
        self.requests = list(requests)
        self.future: Future[list[Sample]] = Future()
        self.deadline = deadline  # time.monotonic() value, None: none
        self.cancelled = False
        self.expired = False  # aborted in the engine at its deadline


class EngineWorker:
    """Dispatches all engine work from one scheduler thread; see the module docstring."""

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        max_batch_requests: int = 256,
        max_concurrent: int = 1,
        max_pending_requests: int | None = None,
        request_timeout_s: float | None = None,
    ) -> None:
        if max_batch_requests < 1 or max_concurrent < 1:
            raise ValueError(
                f"max_batch_requests={max_batch_requests}, max_concurrent={max_concurrent}: must be >= 1"
            )
        self.engine = engine
        self.max_batch_requests = max_batch_requests
        self.max_concurrent = max_concurrent
        self.max_pending_requests = max_pending_requests
        self.request_timeout_s = request_timeout_s
        self._queue: collections.deque[GenerateJob] = collections.deque()
        self._cond = threading.Condition()
        self._control_lock = threading.Lock()  # pause state changes and control operations, one at a time
        self._running: set[GenerateJob] = set()
        self._pending = 0  # requests accepted and not yet answered
        self._batches_running = 0
        self._paused = False
        self._stopping = False
        self._batch_pool = ThreadPoolExecutor(max_concurrent, thread_name_prefix="sparserl-generate")
        self._thread = threading.Thread(target=self._loop, name="sparserl-engine-scheduler", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Fail queued jobs, cancel running ones (aborted in the engine when it can), and join the
        scheduler thread, so shutting down never waits for a long generation to finish."""
        with self._cond:
            self._stopping = True
            pending, self._queue = list(self._queue), collections.deque()
            running = list(self._running)
            self._cond.notify_all()
        for job in pending:
            _settle(job.future, exc=ShuttingDown("server is shutting down"))
        for job in running:
            self.cancel(job)
        if self._paused:
            self.engine.resume()
        self._thread.join(timeout)
        self._batch_pool.shutdown(wait=False, cancel_futures=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def pending_requests(self) -> int:
        return self._pending

    # -- submission --------------------------------------------------------------------------
    def submit_generate(self, requests: Sequence[GenerateRequest]) -> GenerateJob:
        """Queue a job; Overloaded when it would exceed max_pending_requests."""
        limit, n = self.max_pending_requests, len(requests)
        if limit is not None and n > limit:
            raise ValueError(f"a batch of {n} requests is more than this server's limit of {limit} pending")
        deadline = None if self.request_timeout_s is None else time.monotonic() + self.request_timeout_s
        job = GenerateJob(requests, deadline)
        with self._cond:
            if self._stopping:
                raise ShuttingDown("server is shutting down")
            if limit is not None and self._pending + n > limit:
                raise Overloaded(f"{self._pending} requests pending, limit {limit}: retry later")
            self._pending += n
            self._queue.append(job)
            self._cond.notify_all()
        job.future.add_done_callback(lambda _: self._answered(n))
        return job

    def _answered(self, n: int) -> None:
        with self._cond:
            self._pending -= n

    def cancel(self, job: GenerateJob) -> None:
        """The client went away: drop the job, or abort its requests if they are running."""
        with self._cond:
            job.cancelled = True
            running = job in self._running
            if not running and job in self._queue:
                self._queue.remove(job)
        if running:
            for request in job.requests:
                self.engine.abort(request.rid)
        job.future.cancel()

    def control(self, fn: Callable[[RolloutEngine], Any], *, pause_mode: PauseMode) -> Any:
        """Run `fn(engine)` between engine steps and return its result (see the module docstring)."""
        with self._control_lock:
            if self._paused:
                return fn(self.engine)
            self.engine.pause(pause_mode)
            try:
                return fn(self.engine)
            finally:
                self.engine.resume()

    def pause(self, mode: PauseMode = "in_place") -> None:
        with self._control_lock:
            with self._cond:
                self._paused = True
            self.engine.pause(mode)

    def resume(self) -> None:
        with self._control_lock:
            self.engine.resume()
            with self._cond:
                self._paused = False
                self._cond.notify_all()

    # -- the scheduler thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._stopping:
                    return
                expired = self._expire()
                batch = self._take_batch() if self._ready() else []
                if not expired and not batch:
                    self._cond.wait(self._until_next_deadline())
                    continue
            for job in expired:  # abort outside the lock: the engine takes its own
                for request in job.requests:
                    self.engine.abort(request.rid)
            if batch:
                self._batch_pool.submit(self._run_batch_and_release, batch)

    def _ready(self) -> bool:
        return not self._paused and bool(self._queue) and self._batches_running < self.max_concurrent

    def _until_next_deadline(self) -> float | None:
        deadlines = [j.deadline for j in (*self._queue, *self._running) if j.deadline and not j.expired]
        return max(0.0, min(deadlines) - time.monotonic()) if deadlines else None

    def _expire(self) -> list[GenerateJob]:
        """Fail queued jobs past their deadline; return running ones to abort (caller holds _cond)."""
        now = time.monotonic()
        for job in [j for j in self._queue if j.deadline is not None and j.deadline <= now]:
            self._queue.remove(job)
            error = DeadlineExceeded(f"queued for {self.request_timeout_s:g} s without starting: overloaded")
            _settle(job.future, exc=error)
        late = [j for j in self._running if j.deadline is not None and j.deadline <= now and not j.expired]
        for job in late:
            job.expired = True
        return late

    def _take_batch(self) -> list[GenerateJob]:
        """The head job plus every waiting generate job behind it, up to max_batch_requests."""
        batch = [self._queue.popleft()]
        size = len(batch[0].requests)
        while self._queue and size + len(self._queue[0].requests) <= self.max_batch_requests:
            size += len(self._queue[0].requests)
            batch.append(self._queue.popleft())
        self._running.update(batch)
        self._batches_running += 1
        return batch

    def _run_batch_and_release(self, batch: list[GenerateJob]) -> None:
        try:
            self._run_batch(batch)
        finally:
            with self._cond:
                self._running.difference_update(batch)
                self._batches_running -= 1
                self._cond.notify_all()

    def _run_batch(self, batch: list[GenerateJob]) -> None:
        batch = [job for job in batch if not job.cancelled]
        if not batch:
            return
        requests = [r for job in batch for r in job.requests]
        try:
            outcomes: list[Sample | BaseException] = list(self.engine.generate(requests))
        except RequestsFailed as exc:  # the engine says which requests failed
            outcomes = exc.outcomes
        except Exception as exc:
            if len(batch) == 1:
                _settle(batch[0].future, exc=exc)
                return
            # One bad job must not fail the others: rerun them one by one to find it.
            for job in batch:
                self._run_batch([job])
            return
        start = 0
        for job in batch:
            mine = outcomes[start : start + len(job.requests)]
            start += len(job.requests)
            errors = [o for o in mine if isinstance(o, BaseException)]
            if errors:
                _settle(job.future, exc=errors[0])
            else:
                _settle(job.future, mine)


def _settle(future: Future[Any], result: Any = None, exc: BaseException | None = None) -> None:
    """Resolve unless the client already cancelled (a race the worker must tolerate)."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
