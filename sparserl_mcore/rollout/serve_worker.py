"""The scheduler thread between the HTTP server and a rollout engine.

Why threads: generation is long, blocking tensor work; running it on the asyncio event loop would
stall every other connection (health checks, pause, other clients). One scheduler thread takes
queued jobs in arrival order. Generate jobs that wait together become ONE `engine.generate` call
(a batch), run on a pool of `max_concurrent` batch threads, and each job's future resolves to its
own samples. `max_concurrent = 1` (the default) suits any engine; an engine whose `generate` may
be called from several threads at once (`EmbeddedEngine`: concurrent calls join its continuous
batch) gets `max_concurrent > 1`, so a request arriving mid-batch starts at the next decode step
instead of waiting for the batch to end. Control operations (weight updates, cache flush) wait
until no batch runs, so they never interleave with generation.

Pause: `pause()` stops new batches and calls `engine.pause()`, which parks in-flight batches
between decode steps (RolloutEngine contract). While paused, control operations run immediately on
the caller's thread -- the engine is parked -- which lets a trainer do pause -> update weights ->
continue, as with SGLang.

Cancellation: a cancelled job that has not started is dropped; one already running is aborted
through `engine.abort(rid)` (its requests finish as "abort"). Either way the other jobs complete
normally.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

from sparserl_mcore.rollout.protocol import GenerateRequest, RolloutEngine, Sample


class GenerateJob:
    """Requests of one HTTP call; `future` resolves to their samples in request order."""

    def __init__(self, requests: Sequence[GenerateRequest]) -> None:
        self.requests = list(requests)
        self.future: Future[list[Sample]] = Future()
        self.cancelled = False


class _ControlJob:
    def __init__(self, fn: Callable[[RolloutEngine], Any]) -> None:
        self.fn = fn
        self.future: Future[Any] = Future()


class EngineWorker:
    """Dispatches all engine work from one scheduler thread; see the module docstring."""

    def __init__(
        self, engine: RolloutEngine, *, max_batch_requests: int = 256, max_concurrent: int = 1
    ) -> None:
        if max_batch_requests < 1:
            raise ValueError(f"max_batch_requests={max_batch_requests}: must be >= 1")
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent={max_concurrent}: must be >= 1")
        self.engine = engine
        self.max_batch_requests = max_batch_requests
        self.max_concurrent = max_concurrent
        self._queue: collections.deque[GenerateJob | _ControlJob] = collections.deque()
        self._cond = threading.Condition()
        self._control_lock = threading.Lock()  # one control operation at a time, wherever it runs
        self._running: set[GenerateJob] = set()
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
            _settle(job.future, exc=RuntimeError("server is shutting down"))
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

    # -- submission --------------------------------------------------------------------------
    def submit_generate(self, requests: Sequence[GenerateRequest]) -> GenerateJob:
        job = GenerateJob(requests)
        self._enqueue(job)
        return job

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

    def control(self, fn: Callable[[RolloutEngine], Any]) -> Future[Any]:
        """Run `fn(engine)` once no batch is running (or right now, on this thread, while paused)."""
        if self._paused:
            future: Future[Any] = Future()
            with self._control_lock:
                _resolve(future, fn, self.engine)
            return future
        job = _ControlJob(fn)
        self._enqueue(job)
        return job.future

    def pause(self) -> None:
        with self._cond:
            self._paused = True
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def _enqueue(self, job: GenerateJob | _ControlJob) -> None:
        with self._cond:
            if self._stopping:
                raise RuntimeError("server is shutting down")
            self._queue.append(job)
            self._cond.notify_all()

    # -- the scheduler thread ----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._ready():
                    self._cond.wait()
                if self._stopping:
                    return
                head = self._queue.popleft()
                if isinstance(head, GenerateJob):
                    batch = self._take_batch(head)
                    self._running.update(batch)
                    self._batches_running += 1
            if isinstance(head, _ControlJob):
                with self._control_lock:
                    _resolve(head.future, head.fn, self.engine)
            else:
                self._batch_pool.submit(self._run_batch_and_release, batch)

    def _ready(self) -> bool:
        """May the head of the queue start now? Control jobs wait until no batch is running."""
        if self._paused or not self._queue:
            return False
        if isinstance(self._queue[0], _ControlJob):
            return self._batches_running == 0
        return self._batches_running < self.max_concurrent

    def _take_batch(self, head: GenerateJob) -> list[GenerateJob]:
        """The head job plus every waiting generate job behind it, up to max_batch_requests."""
        batch, size = [head], len(head.requests)
        while self._queue and isinstance(self._queue[0], GenerateJob):
            nxt = self._queue[0]
            if size + len(nxt.requests) > self.max_batch_requests:
                break
            batch.append(self._queue.popleft())
            size += len(nxt.requests)
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
            samples = self.engine.generate(requests)
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
            end = start + len(job.requests)
            _settle(job.future, samples[start:end])
            start = end


def _resolve(future: Future[Any], fn: Callable[[RolloutEngine], Any], engine: RolloutEngine) -> None:
    try:
        result = fn(engine)
    except Exception as exc:
        _settle(future, exc=exc)
    else:
        _settle(future, result)


def _settle(future: Future[Any], result: Any = None, exc: Exception | None = None) -> None:
    """Resolve unless the client already cancelled (a race the worker must tolerate)."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
