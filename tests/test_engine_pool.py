"""EnginePool: requests of failing or hanging engines are retried elsewhere, never lost or duplicated.

In-process engines that echo their requests stand in for real ones here (fast); the e2e test
kills a real `sparserl serve` subprocess.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
from waiting import wait_until

from sparserl_mcore.rollout.protocol import GenerateRequest, RequestsFailed, Sample
from sparserl_mcore.trainer.engine_pool import EnginePool, NoEngineLeftError, PoolConfig


class EchoEngine:
    """Answers each request with its own prompt; can be told to fail or hang after some calls, or
    to fail given calls only (`fail_calls`, 1-based). `healthy`: what its health check answers
    (None: it has none, as the embedded engine)."""

    def __init__(
        self,
        *,
        fail_after: int | None = None,
        hang_after: int | None = None,
        concurrency: int = 1,
        fail_calls: tuple[int, ...] = (),
        healthy: bool | None = None,
    ):
        self.calls = 0
        self.fail_after, self.hang_after, self.fail_calls = fail_after, hang_after, fail_calls
        self.concurrency = concurrency
        self.release = threading.Event()
        self.rids: list[list[str]] = []  # per call
        self.called_at: list[float] = []
        self.healthy = healthy
        if healthy is None:
            self.health = None

    def health(self):
        return self.healthy

    def generate(self, requests):
        self.calls += 1
        self.rids.append([r.rid for r in requests])
        self.called_at.append(time.monotonic())
        if (self.fail_after is not None and self.calls > self.fail_after) or self.calls in self.fail_calls:
            raise ConnectionError("engine died")
        if self.hang_after is not None and self.calls > self.hang_after:
            self.release.wait(30)
        return [_sample(r) for r in requests]


def _sample(r: GenerateRequest) -> Sample:
    return Sample(
        rid=r.rid,
        prompt_ids=r.input_ids,
        output_ids=r.input_ids,
        output_logprobs=(0.0,),
        finish_reason="stop",
    )


def _requests(n: int) -> list[GenerateRequest]:
    return [GenerateRequest(input_ids=(i + 1,), rid=f"r{i}") for i in range(n)]


def _cfg(**kw) -> PoolConfig:
    return PoolConfig(**{"chunk_size": 2, "retry_backoff_s": 0.0, "probe_interval_s": 0.0, **kw})


def test_dead_and_hung_engines_lose_nothing_and_duplicate_nothing():
    """A dead engine (health fails) leaves at its first failure; a hung one (no health check) once it
    has hung `engine_failures` times; their chunks go to the live engine."""
    events = []
    hung = EchoEngine(hang_after=1)
    engines = {"ok": EchoEngine(), "dies": EchoEngine(fail_after=0, healthy=False), "hangs": hung}
    pool = EnginePool(
        engines, _cfg(chunk_timeout_s=0.5, engine_failures=1), lambda k, f: events.append((k, f))
    )
    try:
        samples = pool.generate(_requests(13))
    finally:
        hung.release.set()
    assert [s.rid for s in samples] == [f"r{i}" for i in range(13)]
    assert [s.prompt_ids for s in samples] == [(i + 1,) for i in range(13)]
    assert set(pool.dead) == {"dies", "hangs"} and list(pool.live) == ["ok"]
    assert "health check failed" in pool.dead["dies"]
    assert {f["engine"] for k, f in events if k == "rollout_retry"} == {"dies", "hangs"}


def test_a_failed_request_is_retried_on_another_engine_not_its_engine_removed():
    """One call in three fails on a server whose health is fine: its chunk goes to the other
    server (same request ids), and both stay in the pool."""
    events = []
    flaky, other = EchoEngine(fail_calls=(2,), healthy=True), EchoEngine(healthy=True)
    pool = EnginePool({"flaky": flaky, "other": other}, _cfg(), lambda k, f: events.append((k, f)))
    samples = pool.generate(_requests(12))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(12)]
    assert not pool.dead and sorted(pool.live) == ["flaky", "other"]
    failed = flaky.rids[1]
    assert failed in other.rids and failed not in flaky.rids[2:]  # retried there, once
    retries = [f for k, f in events if k == "rollout_retry"]
    assert [f["rids"] for f in retries] == [failed] and pool.take_requests_retried() == 2
    assert pool.take_requests_retried() == 0


def test_an_engine_leaves_after_repeated_failures_even_when_healthy():
    always = EchoEngine(fail_after=0, healthy=True)
    pool = EnginePool({"bad": always, "ok": EchoEngine()}, _cfg(engine_failures=2, max_attempts=3))
    samples = pool.generate(_requests(12))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(12)]
    assert list(pool.dead) == ["bad"] and "2 failed calls in a row" in pool.dead["bad"]
    assert always.calls == 2


def test_a_lone_engine_is_retried_after_the_backoff():
    """With one engine, the retry goes back to it, no sooner than retry_backoff_s."""
    engine = EchoEngine(fail_calls=(1,), healthy=True)
    pool = EnginePool({"only": engine}, _cfg(chunk_size=4, retry_backoff_s=0.3))
    samples = pool.generate(_requests(4))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(4)] and list(pool.live) == ["only"]
    assert engine.rids == [[f"r{i}" for i in range(4)]] * 2
    assert engine.called_at[1] - engine.called_at[0] >= 0.3


class PartlyFailing(EchoEngine):
    """Fails request `rid` once, as `RequestsFailed` (the others of the call complete)."""

    def __init__(self, rid: str, **kw):
        super().__init__(**kw)
        self.bad = rid

    def generate(self, requests):
        outcomes: list = super().generate(requests)
        rids = [r.rid for r in requests]
        if self.bad in rids:
            outcomes[rids.index(self.bad)] = RuntimeError("decode failed")
            self.bad = ""
            raise RequestsFailed(outcomes)
        return outcomes


def test_requests_failed_retries_only_the_chunks_holding_a_failed_request():
    engine = PartlyFailing("r5", concurrency=4, healthy=True)
    pool = EnginePool({"server": engine}, _cfg())
    samples = pool.generate(_requests(8))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(8)]
    assert engine.rids == [[f"r{i}" for i in range(8)], ["r4", "r5"]]
    assert pool.take_requests_retried() == 2 and not pool.dead


class Gate(EchoEngine):
    """Holds every call until released; records the most chunks it held at once."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.lock = threading.Lock()
        self.holding = self.most = 0
        self.open = threading.Event()
        self.entered = threading.Semaphore(0)

    def generate(self, requests):
        with self.lock:
            self.holding += len(requests) // 2
            self.most = max(self.most, self.holding)
        self.entered.release()
        self.open.wait(30)
        with self.lock:
            self.holding -= len(requests) // 2
        return super().generate(requests)


def test_server_concurrency_is_one_budget_over_concurrent_batches():
    """Two batches (the asynchronous loop's) and an eval at once: the server never holds more than
    its `concurrency` chunks in total (per call, it held 3x as many)."""
    engine = Gate(concurrency=2)
    pool = EnginePool({"server": engine}, _cfg())
    results: dict[int, list] = {}

    def batch(k: int) -> None:
        results[k] = pool.generate([GenerateRequest(input_ids=(1,), rid=f"b{k}-{i}") for i in range(4)])

    threads = [threading.Thread(target=batch, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    assert engine.entered.acquire(timeout=30)  # the budget is taken...
    assert not engine.entered.acquire(timeout=0.5)  # ...and nobody else gets in meanwhile
    engine.open.set()
    for t in threads:
        t.join(timeout=60)
    assert engine.most == 2
    assert all([s.rid for s in results[k]] == [f"b{k}-{i}" for i in range(4)] for k in range(3))


def test_live_is_a_snapshot_while_a_generating_thread_removes_an_engine():
    """The main thread iterates the live engines (weight sync) while the producer's thread removes
    one: iterating the pool's own table raised 'dictionary changed size during iteration'."""
    removed = threading.Event()
    engines = {"ok": EchoEngine(), "dies": EchoEngine(fail_after=0, healthy=False)}
    pool = EnginePool(engines, _cfg(), lambda kind, _: removed.set() if kind == "engine_removed" else None)
    seen = []
    for name, _ in pool.live.items():
        seen.append(name)
        if len(seen) == 1:
            worker = threading.Thread(target=pool.generate, args=(_requests(4),))
            worker.start()
            assert removed.wait(30)
            worker.join(30)
    assert seen == ["ok", "dies"] and list(pool.live) == ["ok"]


def test_a_removed_engine_is_probed_and_comes_back_only_when_admitted():
    events = []
    engine = EchoEngine(fail_calls=(1,), healthy=False)
    pool = EnginePool(
        {"a": engine, "b": EchoEngine()},
        _cfg(probe_interval_s=0.05),
        lambda kind, fields: events.append(kind),
    )
    pool.generate(_requests(4))
    assert list(pool.dead) == ["a"] and pool.recovered() == []
    engine.healthy = True
    wait_until(pool.recovered, timeout=30, what="engine a recovered")
    assert list(pool.live) == ["b"]  # healthy is not enough: the loop syncs its weights first
    pool.admit("a")
    assert sorted(pool.live) == ["a", "b"] and not pool.dead and pool.recovered() == []
    pool.remove("a", "its re-admission sync failed")
    pool.not_recovered("a")  # probed again after 2 x 0.05 s, not at once
    wait_until(pool.recovered, timeout=30, what="engine a recovered again")
    pool.admit("a")
    calls = engine.calls
    pool.generate(_requests(8))
    assert engine.calls > calls
    assert [k for k in events if k.startswith("engine_")] == ["engine_removed", "engine_readmitted"] * 2
    pool.close()


class Worker:
    """A worker behind `Router`: its URL and what its health check answers."""

    def __init__(self, url: str) -> None:
        self.url, self.healthy, self.closed = url, True, False

    def health(self) -> bool:
        return self.healthy

    def close(self) -> None:
        self.closed = True


class Router(EchoEngine):
    """Stands in for sglang-router's worker routes (`SGLangRouter`): `routed` is what it lists;
    `refuse`: its add / remove calls fail (the router's HTTP API down)."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__(concurrency=4)
        self.workers = [Worker(u) for u in urls]
        self.routed, self.refuse = set(urls), False

    def remove_workers(self, urls) -> None:
        if self.refuse:
            raise ConnectionError("router down")
        self.routed -= set(urls)
        self.workers = [w for w in self.workers if w.url not in urls]

    def add_worker(self, worker) -> None:
        if self.refuse:
            raise ConnectionError("router down")
        self.routed.add(worker.url)
        self.workers.append(worker)


def test_workers_behind_a_router_are_taken_out_when_unhealthy_and_put_back_only_when_admitted():
    events = []
    router = Router(["w0", "w1"])
    w0 = router.workers[0]
    pool = EnginePool({"r": router}, _cfg(probe_interval_s=0.05), lambda k, f: events.append((k, f)))
    w0.healthy = False
    wait_until(lambda: router.routed == {"w1"}, timeout=30, what="w0 taken out of the router")
    assert list(pool.live) == ["r"] and pool.workers_live() == 1 and events[0] == (
        "engine_removed", {"engine": "w0", "router": "r", "reason": "health check failed", "live": 1}
    )  # fmt: skip
    w0.healthy = True
    wait_until(lambda: pool.recovered() == ["w0"], timeout=30, what="w0 recovered")
    assert router.routed == {"w1"}  # healthy is not enough: the loop syncs its weights first
    router.refuse = True  # the router does not take it back: it stays out, probed again later
    pool.admit("w0")
    assert router.routed == {"w1"} and pool.recovered() == [] and events[-1][0] == "readmission_failed"
    router.refuse = False
    wait_until(lambda: pool.recovered() == ["w0"], timeout=30, what="w0 recovered again")
    pool.admit("w0")
    assert router.routed == {"w0", "w1"} and [w.url for w in router.workers] == ["w1", "w0"]
    assert events[-1] == ("engine_readmitted", {"engine": "w0", "router": "r", "live": 2})
    router.refuse = True  # a router that cannot take a stale worker out leaves the pool
    pool.remove_workers("r", {"w1"}, "weight sync failed twice (sparse and full)")
    assert not pool.live and "could not take ['w1'] out" in pool.dead["r"]
    pool.close()


def test_a_router_with_a_worker_in_service_is_not_removed_by_failed_calls():
    """Behind a router a failed call is a request's or a worker's: with a worker in service the
    router (the whole fleet) stays through `engine_failures` failed calls in a row; with none it
    leaves as any engine."""
    router = Router(["w0"])
    router.fail_calls = (1, 2, 3)
    pool = EnginePool({"r": router}, _cfg(chunk_size=8, max_attempts=4))
    assert [s.rid for s in pool.generate(_requests(8))] == [f"r{i}" for i in range(8)]
    assert list(pool.live) == ["r"] and router.calls == 4
    pool.remove_workers("r", {"w0"}, "health check failed")
    router.fail_after = 4
    with pytest.raises(NoEngineLeftError, match="3 failed calls in a row"):
        pool.generate(_requests(8))
    pool.close()


class Versioned(EchoEngine):
    """Serves its samples at weight version `version` (a restarted server: 0)."""

    def __init__(self, version: int, **kw):
        super().__init__(**kw)
        self.version = version

    def generate(self, requests):
        return [dataclasses.replace(s, weight_version=self.version) for s in super().generate(requests)]


def test_an_engine_serving_older_weights_than_the_pool_holds_leaves_and_its_samples_are_dropped():
    """A server restarted behind the trainer's back answers health but holds its initial weights:
    its samples are refused and it leaves at once (a full sync must bring it back)."""
    pool = EnginePool({"restarted": Versioned(0, healthy=True), "current": Versioned(3)}, _cfg())
    pool.version = 3
    samples = pool.generate(_requests(8))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(8)]
    assert {s.weight_version for s in samples} == {3}
    assert list(pool.dead) == ["restarted"] and "served weight version 0 below 3" in pool.dead["restarted"]


class LateStale(EchoEngine):
    """Its first call hangs, then answers at version 0 while the retry (call 2) runs; call 2
    answers at the pool's version once the first one has answered."""

    def __init__(self) -> None:
        super().__init__(concurrency=2, healthy=True)
        self.retry_started, self.first_answered = threading.Event(), threading.Event()

    def generate(self, requests):
        samples = super().generate(requests)
        if self.calls == 1:
            self.retry_started.wait(30)
            self.first_answered.set()
            return samples  # version 0: the abandoned call's late answer
        self.retry_started.set()
        self.first_answered.wait(30)
        time.sleep(0.3)  # its answer reaches the pool after the first call's
        return [dataclasses.replace(s, weight_version=1) for s in samples]


def test_a_late_answer_of_an_abandoned_call_is_not_taken_for_its_retry_on_the_same_engine():
    """The retry of a hung chunk goes to the same (lone) engine: the hung call's late answer (here
    older weights) must be discarded, not taken as the retry's answer (which failed the chunk
    and removed the engine: "served weight version 0 below 1")."""
    engine = LateStale()
    pool = EnginePool({"e": engine}, _cfg(chunk_size=8, chunk_timeout_s=2.0, max_attempts=2))
    pool.version = 1
    samples = pool.generate(_requests(8))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(8)]
    assert {s.weight_version for s in samples} == {1}
    assert list(pool.live) == ["e"] and engine.calls == 2


def test_no_engine_left_is_a_clear_error():
    pool = EnginePool(
        {"a": EchoEngine(fail_after=0, healthy=False), "b": EchoEngine(fail_after=0, healthy=False)},
        _cfg(chunk_size=4),
    )
    with pytest.raises(NoEngineLeftError, match="no rollout engine left"):
        pool.generate(_requests(8))


def test_retries_are_bounded():
    engines = {f"e{i}": EchoEngine(fail_after=0) for i in range(5)}
    with pytest.raises(NoEngineLeftError, match="failed 2 times"):
        EnginePool(engines, _cfg(chunk_size=8, max_attempts=2)).generate(_requests(8))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"chunk_timeout_s": 0}, "chunk_timeout_s=0 must be > 0"),
        ({"retry_backoff_s": "soon"}, "retry_backoff_s='soon' must be a finite number of seconds"),
        ({"retry_backoff_s": -1.0}, "retry_backoff_s=-1.0 must be >= 0"),
    ],
)
def test_bad_pool_config_names_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        PoolConfig(**kw)


def test_an_engine_with_concurrency_takes_that_many_chunks_at_once_in_one_call():
    engine = EchoEngine(concurrency=3)
    samples = EnginePool({"server": engine}, _cfg()).generate(_requests(12))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(12)]
    assert engine.rids == [[f"r{i}" for i in range(6)], [f"r{i}" for i in range(6, 12)]]


def test_chunks_go_out_one_per_engine_in_turn():
    """Two servers with room for the whole step share it: neither takes all before the other."""
    a, b = EchoEngine(concurrency=8), EchoEngine(concurrency=8)
    samples = EnginePool({"a": a, "b": b}, _cfg()).generate(_requests(12))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(12)]
    assert a.rids == [["r0", "r1", "r4", "r5", "r8", "r9"]] and b.rids == [
        ["r2", "r3", "r6", "r7", "r10", "r11"]
    ]


class ShortEngine(EchoEngine):
    """Drops the last sample of every call."""

    def generate(self, requests):
        return super().generate(requests)[:-1]


def test_a_call_answering_short_fails_its_chunks_and_nothing_is_misattributed():
    """A call carries several chunks and its answer is cut back into them by position: a short
    answer must fail the chunks it no longer matches, never hand one chunk another's samples."""
    pool = EnginePool({"short": ShortEngine(concurrency=4), "ok": EchoEngine()}, _cfg(engine_failures=1))
    samples = pool.generate(_requests(8))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(8)]
    assert [s.prompt_ids for s in samples] == [(i + 1,) for i in range(8)]
    assert list(pool.dead) == ["short"] and "other requests than asked" in pool.dead["short"]


def test_a_removed_concurrent_engine_leaves_with_all_its_chunks():
    """Its chunks in flight go to the other engine; with it alone the step fails at once."""
    router = EchoEngine(concurrency=2, fail_after=0, healthy=False)
    pool = EnginePool({"router": router, "ok": EchoEngine()}, _cfg(max_attempts=2))
    samples = pool.generate(_requests(8))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(8)] and list(pool.dead) == ["router"]
    alone = EnginePool({"router": EchoEngine(concurrency=2, fail_after=0, healthy=False)}, _cfg())
    with pytest.raises(NoEngineLeftError, match="no rollout engine left.*router.*engine died"):
        alone.generate(_requests(8))
