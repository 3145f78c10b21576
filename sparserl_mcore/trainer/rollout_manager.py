"""The rollout manager (`rollout.manager: process`): the host rank's rollout client in a process of
its own, so its HTTP calls, JSON parsing, retries, health probing and rewards take neither the
learner's GIL nor its CPU time (docs/async.md, "Rollout manager").

The child process owns an `EnginePool` of its own clients (every guarantee of docs/rollout.md
"Faults" holds as in-process: it is the same pool) and the reward function (its own tokenizer and
reward process). The host rank holds a `RolloutManager`, which offers what the loop, the weight
syncer and the evaluator use of an `EnginePool`: each call goes down one pipe as (call id, op,
arguments) and its reply comes back on a reader thread, so the producer's worker threads each wait
for their own batch while the main thread asks about the fleet. What crosses the pipe is pickled by
the two trusted ends only: prompts down, finished `Sample`s and rewards up. Nothing read from the
network is unpickled: the servers' JSON is parsed in the child.

The weights still go from the learner ranks to the servers directly (`WeightSyncer`): the host keeps
its own clients of the same servers for the pauses and patches, and tells the child the version the
fleet holds (`version`), the engines a sync dropped (`remove`) and those it re-admitted (`admit`).

Lifetime: the child ignores the stop signals (torchrun signals whole process groups; the rank stops
it at its step boundary through `stop` and `close`) and is SIGKILLed by the kernel when its rank
dies (`rank_entry.helper_process_init`).
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from sparserl_mcore.parallel.rank_entry import helper_process_init
from sparserl_mcore.rollout.protocol import GenerateRequest, Sample, SamplingParams
from sparserl_mcore.trainer.engine_pool import EnginePool, EventSink, NoEngineLeftError, PoolConfig
from sparserl_mcore.trainer.rollouts import Prompt, RewardFn, score_on_host

CONTROL_TIMEOUT_S = 120.0  # a question about the fleet; the child answers it between two messages


class RolloutManagerError(NoEngineLeftError):
    """The rollout manager process is gone or did not answer: no engine can be reached, so the loop
    checkpoints and stops as when the fleet is gone (a restart starts a new manager)."""


@dataclasses.dataclass(frozen=True)
class Scoring:
    """How a batch's prompts become requests (`rollouts.make_requests`); the child builds them."""

    group_size: int
    sampling: SamplingParams
    run_seed: int
    return_routed_experts: bool = False


# (RewardFn, close) in the child: the reward function and what releases its resources
RewardFactory = Callable[[], tuple[RewardFn, Callable[[], None]]]


class RolloutManager:
    """Host side. `make_engines` and `make_reward` are picklable factories (module-level functions
    or partials of them): the child calls both, the host calls `make_engines` for its own clients."""

    def __init__(
        self,
        make_engines: Callable[[], dict[str, Any]],
        pool_cfg: PoolConfig,
        scoring: Scoring,
        make_reward: RewardFactory,
        on_event: EventSink,
    ) -> None:
        self._engines = make_engines()
        self._on_event = on_event
        self.on_chunk_done: Callable[[int], None] = lambda n: None  # progress display hook
        self._version = 0
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        spawn = multiprocessing.get_context(
            "spawn"
        )  # a fresh interpreter: no learner state, no fork of threads
        self._conn, child = spawn.Pipe()
        self._proc = spawn.Process(
            target=_child_main,
            args=(child, make_engines, pool_cfg, scoring, make_reward),
            name="sparserl-rollout-manager",
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._gone: str | None = None
        self._reader = threading.Thread(
            target=self._read, name="sparserl-rollout-manager-reader", daemon=True
        )
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    # -- what the loop asks of an EnginePool ---------------------------------------------------
    def score(self, tag: str, prompts: Sequence[Prompt]) -> tuple[list[Sample], list[float]]:
        """G samples per prompt with their rewards, generated and scored in the child."""
        return self._call("score", tag, list(prompts))

    def score_requests(
        self, requests: Sequence[GenerateRequest], prompts: Sequence[Prompt]
    ) -> tuple[list[Sample], list[float]]:
        """One sample per request, each scored against its prompt, in the child (the evaluator's)."""
        return self._call("score_requests", list(requests), list(prompts))

    def generate(self, requests: Sequence[GenerateRequest]) -> list[Sample]:
        return self._call("generate", list(requests))

    @property
    def live(self) -> dict[str, Any]:
        """The host's clients of the engines the child's pool has in service (a snapshot)."""
        return {name: self._engines[name] for name in self._call("live", timeout=CONTROL_TIMEOUT_S)}

    @property
    def dead(self) -> dict[str, str]:
        return self._call("dead", timeout=CONTROL_TIMEOUT_S)

    def __len__(self) -> int:
        return len(self._call("live", timeout=CONTROL_TIMEOUT_S))

    @property
    def version(self) -> int:
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        """The weight version every live engine holds (after a sync): older tokens are refused."""
        self._call("set_version", int(value), timeout=CONTROL_TIMEOUT_S)
        self._version = int(value)

    def engine(self, name: str) -> Any:
        return self._engines.get(name)

    def remove(self, name: str, reason: str) -> None:
        self._call("remove", name, reason, timeout=CONTROL_TIMEOUT_S)

    def remove_workers(self, router: str, urls: set[str], reason: str) -> None:
        self._call("remove_workers", router, set(urls), reason, timeout=CONTROL_TIMEOUT_S)

    def workers_live(self) -> int | None:
        return self._call("workers_live", timeout=CONTROL_TIMEOUT_S)

    def recovered(self) -> list[str]:
        return self._call("recovered", timeout=CONTROL_TIMEOUT_S)

    def admit(self, name: str) -> None:
        self._call("admit", name, timeout=CONTROL_TIMEOUT_S)

    def not_recovered(self, name: str) -> None:
        self._call("not_recovered", name, timeout=CONTROL_TIMEOUT_S)

    def take_requests_retried(self) -> int:
        return self._call("take_requests_retried", timeout=CONTROL_TIMEOUT_S)

    def stop(self) -> None:
        if self._gone is None:
            self._call("stop", timeout=CONTROL_TIMEOUT_S)

    def close(self, timeout_s: float = 30.0) -> None:
        """Ask the child to close its clients and reward process and exit; kill it past `timeout_s`."""
        if self._gone is None:
            try:
                self._call("close", timeout=timeout_s)
            except RolloutManagerError:
                pass
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()
        for client in self._engines.values():
            close = getattr(client, "close", None)
            if callable(close):
                close()

    # -- the pipe ------------------------------------------------------------------------------
    def _call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        future: Future = Future()
        with self._lock:
            if self._gone is not None:
                raise RolloutManagerError(self._gone)
            call = next(self._ids)
            self._calls[call] = future
            try:
                self._conn.send((call, op, args))
            except OSError as exc:  # it died; the reader is about to say how
                del self._calls[call]
                raise RolloutManagerError(f"the rollout manager process exited ({exc})") from None
        try:
            return future.result(timeout)
        except TimeoutError:
            raise RolloutManagerError(
                f"the rollout manager did not answer {op!r} within {timeout:g} s"
            ) from None

    def _read(self) -> None:
        """Replies to their callers; events to the telemetry, chunk counts to the progress display."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "reply":
                _, call, ok, value = message
                with self._lock:
                    future = self._calls.pop(call)
                (future.set_result if ok else future.set_exception)(value)
            elif kind == "event":
                self._on_event(message[1], message[2])
            elif kind == "progress":
                self.on_chunk_done(message[1])
        self._proc.join(5.0)
        with self._lock:
            self._gone = f"the rollout manager process exited (code {self._proc.exitcode})"
            calls, self._calls = self._calls, {}
        for future in calls.values():
            future.set_exception(RolloutManagerError(self._gone))


# -- the child --------------------------------------------------------------------------------
def _child_main(
    conn: Connection,
    make_engines: Callable[[], dict[str, Any]],
    pool_cfg: PoolConfig,
    scoring: Scoring,
    make_reward: RewardFactory,
) -> None:
    helper_process_init()
    sending = threading.Lock()

    def send(message: tuple) -> None:
        with sending:
            conn.send(message)

    pool = EnginePool(make_engines(), pool_cfg, lambda kind, fields: send(("event", kind, fields)))
    pool.on_chunk_done = lambda n: send(("progress", n))
    child = _Child(pool, scoring, make_reward, send)
    try:
        while True:
            try:
                call, op, args = conn.recv()
            except EOFError:  # the host is gone
                return
            if op in ("score", "score_requests", "generate"):  # the long ones, each on a thread of its own
                threading.Thread(target=child.answer, args=(call, op, args), daemon=True).start()
                continue
            child.answer(call, op, args)
            if op == "close":
                return
    finally:
        child.close()


class _Child:
    """The child's side of each op: the pool, and the reward function made at the first `score`."""

    def __init__(
        self, pool: EnginePool, scoring: Scoring, make_reward: RewardFactory, send: Callable
    ) -> None:
        self.pool, self.scoring, self.send = pool, scoring, send
        self._make_reward = make_reward
        self._reward: tuple[RewardFn, Callable[[], None]] | None = None
        self._reward_lock = threading.Lock()

    def answer(self, call: int, op: str, args: tuple) -> None:
        try:
            value, ok = getattr(self, f"op_{op}")(*args), True
        except Exception as exc:  # noqa: BLE001 - raised in the host's caller (e.g. NoEngineLeftError)
            value, ok = exc, False
        try:
            self.send(("reply", call, ok, value))
        except Exception as exc:  # noqa: BLE001 - an exception that does not pickle: its text instead
            self.send(("reply", call, False, RolloutManagerError(f"{type(value).__name__}: {value} ({exc})")))

    def op_score(self, tag: str, prompts: list[Prompt]) -> tuple[list[Sample], list[float]]:
        s = self.scoring
        return score_on_host(
            self.pool,
            prompts,
            tag=tag,
            group_size=s.group_size,
            sampling=s.sampling,
            run_seed=s.run_seed,
            reward_fn=self._reward_fn(),
            return_routed_experts=s.return_routed_experts,
        )

    def op_score_requests(
        self, requests: list[GenerateRequest], prompts: list[Prompt]
    ) -> tuple[list[Sample], list[float]]:
        samples = self.pool.generate(requests)
        reward_fn = self._reward_fn()
        return samples, [reward_fn(s, p) for s, p in zip(samples, prompts, strict=True)]

    def _reward_fn(self) -> RewardFn:
        with self._reward_lock:
            if self._reward is None:
                self._reward = self._make_reward()
            return self._reward[0]

    def op_generate(self, requests: list[GenerateRequest]) -> list[Sample]:
        return self.pool.generate(requests)

    def op_live(self) -> list[str]:
        return list(self.pool.live)

    def op_dead(self) -> dict[str, str]:
        return self.pool.dead

    def op_set_version(self, version: int) -> None:
        self.pool.version = version

    def op_remove(self, name: str, reason: str) -> None:
        self.pool.remove(name, reason)

    def op_remove_workers(self, router: str, urls: set[str], reason: str) -> None:
        self.pool.remove_workers(router, urls, reason)

    def op_workers_live(self) -> int | None:
        return self.pool.workers_live()

    def op_recovered(self) -> list[str]:
        return self.pool.recovered()

    def op_admit(self, name: str) -> None:
        self.pool.admit(name)

    def op_not_recovered(self, name: str) -> None:
        self.pool.not_recovered(name)

    def op_take_requests_retried(self) -> int:
        return self.pool.take_requests_retried()

    def op_stop(self) -> None:
        self.pool.stop()

    def op_close(self) -> None:
        self.close()

    def close(self) -> None:
        self.pool.close()
        with self._reward_lock:
            reward, self._reward = self._reward, None
        if reward is not None:
            reward[1]()
