"""The rollout phase as a producer the update phase consumes: ONE loop for synchronous and
asynchronous RL (`train.async`).

Batch s is the prompts drawn for step s; its request ids and seeds are functions of (run seed,
"step<s>", prompt, sample) whatever the mode. Every rank calls `submit(s, ...)` and `take(s)` at
the same points of the loop (the prompts come from the data sampler every rank holds):
- `ahead == 0` (synchronous): nothing runs in the background. `take` generates and scores on the
  host on the calling thread, then shares the result: the synchronous loop, unchanged.
- `ahead > 0`: on the host, `submit` starts generating and scoring at once on a worker thread
  (at most ahead + 1 batches at a time), while the learner trains on an earlier batch; `take`
  waits for the batch and shares it. The loop decides WHEN a batch may be submitted (admission by
  staleness, loop.py), this class only runs them.

Collective discipline: only the main thread of every rank calls `take` (one broadcast over the
learner group); worker threads only talk to the engines.

Checkpoints regenerate what is in flight instead of carrying it: `resume_data_state()` is the data
sampler's position before the oldest batch not yet trained (not taken, or taken and failed), so a
resumed run draws exactly those prompts again (same request ids and seeds, sampled under the
resumed weights). No sample is trained twice, none is skipped. `close()` aborts what is still generating.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

import torch.distributed as dist

from sparserl_mcore.rollout.protocol import Sample
from sparserl_mcore.trainer.rollouts import Prompt, share_from_host

# (step, prompts) -> (samples, rewards); runs on the host rank only
ScoreFn = Callable[[int, Sequence[Prompt]], tuple[list[Sample], list[float]]]


@dataclasses.dataclass(frozen=True)
class Produced:
    """One batch as every rank receives it; `generate_s`: how long the host took to make it."""

    samples: list[Sample]
    rewards: list[float]
    generate_s: float


@dataclasses.dataclass
class _Batch:
    step: int
    prompts: list[Prompt]
    data_before: dict[str, Any]  # the data sampler's state before these prompts were drawn
    future: Future[Produced] | None = None


class RolloutProducer:
    """See the module docstring. `abort` (host): make the engines finish what they are generating."""

    def __init__(
        self,
        score: ScoreFn,
        *,
        ahead: int,
        host: bool,
        group: dist.ProcessGroup,
        abort: Callable[[], None] | None = None,
    ) -> None:
        if ahead < 0:
            raise ValueError(f"ahead={ahead}: must be >= 0")
        self._score, self.ahead, self._host, self._group = score, ahead, host, group
        self._abort = abort
        self._pending: collections.OrderedDict[int, _Batch] = collections.OrderedDict()
        self._background = host and ahead > 0

    @property
    def submitted(self) -> list[int]:
        """Steps whose batches are submitted and not yet taken, oldest first."""
        return list(self._pending)

    def submit(self, step: int, prompts: Sequence[Prompt], data_before: dict[str, Any]) -> None:
        """Every rank, in step order: batch `step` exists; the host starts it when running ahead."""
        if self._pending and step <= next(reversed(self._pending)):
            raise ValueError(f"batch {step} submitted after batch {next(reversed(self._pending))}")
        batch = _Batch(step, list(prompts), data_before)
        if self._background:
            batch.future = Future()
            # a daemon thread: a hung engine call must never keep the process from exiting
            threading.Thread(
                target=self._produce_into, args=(batch,), name=f"sparserl-rollout-{step}", daemon=True
            ).start()
        self._pending[step] = batch

    def take(self, step: int) -> Produced:
        """Collective over the learner group: batch `step` (the oldest submitted) on every rank.
        A batch that failed (raised here on every rank) stays the oldest submitted: a checkpoint
        taken after the failure records the data position before it, so its prompts are drawn
        again on resume, never skipped."""
        if not self._pending or next(iter(self._pending)) != step:
            raise ValueError(f"batch {step} taken, but the oldest submitted is {self.submitted[:1]}")
        batch = self._pending[step]
        payload: Any = None
        if self._host:
            try:
                payload = batch.future.result() if batch.future else self._produce(step, batch.prompts)
            except Exception as exc:  # shared: every rank raises it
                payload = exc
        produced = share_from_host(payload, self._group)
        del self._pending[step]  # trained from here on: a checkpoint's data position is past it
        return produced

    def _produce_into(self, batch: _Batch) -> None:
        assert batch.future is not None
        try:
            batch.future.set_result(self._produce(batch.step, batch.prompts))
        except BaseException as exc:  # noqa: BLE001 - delivered to `take`, which shares it
            batch.future.set_exception(exc)

    def _produce(self, step: int, prompts: Sequence[Prompt]) -> Produced:
        started = time.perf_counter()
        samples, rewards = self._score(step, prompts)
        return Produced(samples, rewards, time.perf_counter() - started)

    def wait_generated(self) -> None:
        """Host: return once no submitted batch is still generating (one_step mode syncs only then,
        so no sample spans two versions). Failures stay in the batches, raised at `take`."""
        futures = [b.future for b in self._pending.values() if b.future is not None]
        wait_futures(futures)

    def resume_data_state(self) -> dict[str, Any] | None:
        """The data position a checkpoint records: before the oldest batch not yet trained (one not
        taken, or one whose `take` failed); None: nothing is pending, the sampler's own position
        is right."""
        return next(iter(self._pending.values())).data_before if self._pending else None

    def close(self, timeout_s: float = 30.0) -> None:
        """Abort what is generating, wait for it to return (at most `timeout_s`), and drop every
        batch not taken: a resumed run regenerates them."""
        running = [b.future for b in self._pending.values() if b.future is not None and not b.future.done()]
        if running and self._abort is not None:
            self._abort()
            wait_futures(running, timeout=timeout_s)
        self._pending.clear()
