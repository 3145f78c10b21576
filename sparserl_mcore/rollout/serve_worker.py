"""The one thread that drives a rollout engine behind the HTTP server.

Why a thread: generation is long, blocking tensor work; running it on the asyncio event loop would
stall every other connection (health checks, pause, other clients). The worker owns the engine: it
takes queued generate jobs in arrival order, runs all that are waiting as ONE `engine.generate`
batch, and resolves a future per job. Control operations (weight updates, cache flush) run
between batches, so they never interleave with a forward pass.

Pause: `pause()` stops the worker from starting batches and calls `engine.pause()`, which parks an
in-flight batch between decode steps (RolloutEngine contract). While paused, control operations run
immediately on the caller's thread -- the engine is parked -- which is what lets a trainer do
pause -> update weights -> continue, as with SGLang.

Cancellation: a cancelled job that has not started is dropped; one already in the running batch
is aborted through `engine.abort(rid)` when the engine offers it, else its result is discarded.
Either way the other jobs of the batch complete normally.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
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
    """Serialises all engine work on one daemon thread; see the module docstring."""

    def __init__(self, engine: RolloutEngine, *, max_batch_requests: int = 256) -> None:
        if max_batch_requests < 1:
            raise ValueError(f"max_batch_requests={max_batch_requests}: must be >= 1")
        self.engine = engine
        self.max_batch_requests = max_batch_requests
        self._queue: collections.deque[GenerateJob | _ControlJob] = collections.deque()
        self._cond = threading.Condition()
        self._control_lock = threading.Lock()  # one control operation at a time, wherever it runs
        self._running: list[GenerateJob] = []
        self._paused = False
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="sparserl-engine-worker", daemon=True)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Finish the running batch, fail queued jobs, and join the thread."""
        with self._cond:
            self._stopping = True
            pending, self._queue = list(self._queue), collections.deque()
            self._cond.notify_all()
        if self._paused:
            self.engine.resume()
        for job in pending:
            _settle(job.future, exc=RuntimeError("server is shutting down"))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def queued(self) -> int:
        return len(self._queue)

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
        abort = getattr(self.engine, "abort", None)
        if running and abort is not None:
            for request in job.requests:
                abort(request.rid)
        job.future.cancel()

    def control(self, fn: Callable[[RolloutEngine], Any]) -> Future[Any]:
        """Run `fn(engine)` between batches (or right now, on this thread, while paused)."""
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

    # -- the thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (self._paused or not self._queue):
                    self._cond.wait()
                if self._stopping:
                    return
                head = self._queue.popleft()
                if isinstance(head, _ControlJob):
                    batch: list[GenerateJob] = []
                else:
                    batch = self._take_batch(head)
                    self._running = batch
            if isinstance(head, _ControlJob):
                with self._control_lock:
                    _resolve(head.future, head.fn, self.engine)
            else:
                self._run_batch(batch)
                with self._cond:
                    self._running = []

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

    def _run_batch(self, batch: list[GenerateJob]) -> None:
        requests = [r for job in batch for r in job.requests]
        try:
            samples = self.engine.generate(requests)
        except Exception as exc:
            if len(batch) == 1:
                _fail(batch[0], exc)
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


def _fail(job: GenerateJob, exc: Exception) -> None:
    _settle(job.future, exc=exc)


def _settle(future: Future[Any], result: Any = None, exc: Exception | None = None) -> None:
    """Resolve unless the client already cancelled (a race the worker must tolerate)."""
    try:
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
