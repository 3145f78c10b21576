"""EnginePool: requests of failing or hanging engines are retried elsewhere, never lost or duplicated.

In-process engines that echo their requests stand in for real ones here (fast); the e2e test
kills a real `sparserl serve` subprocess.
"""

from __future__ import annotations

import threading

import pytest

from sparserl_mcore.rollout.protocol import GenerateRequest, Sample
from sparserl_mcore.trainer.engine_pool import EnginePool, NoEngineLeftError, PoolConfig


class EchoEngine:
    """Answers each request with its own prompt; can be told to fail or hang after some calls."""

    def __init__(self, *, fail_after: int | None = None, hang_after: int | None = None):
        self.calls = 0
        self.fail_after, self.hang_after = fail_after, hang_after
        self.release = threading.Event()

    def generate(self, requests):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise ConnectionError("engine died")
        if self.hang_after is not None and self.calls > self.hang_after:
            self.release.wait(30)
        return [
            Sample(
                rid=r.rid,
                prompt_ids=r.input_ids,
                output_ids=r.input_ids,
                output_logprobs=(0.0,),
                finish_reason="stop",
            )
            for r in requests
        ]


def _requests(n: int) -> list[GenerateRequest]:
    return [GenerateRequest(input_ids=(i + 1,), rid=f"r{i}") for i in range(n)]


def test_dead_and_hung_engines_lose_nothing_and_duplicate_nothing():
    events = []
    hung = EchoEngine(hang_after=1)
    engines = {"ok": EchoEngine(), "dies": EchoEngine(fail_after=0), "hangs": hung}
    pool = EnginePool(
        engines, PoolConfig(chunk_size=2, chunk_timeout_s=0.5), lambda k, f: events.append((k, f))
    )
    try:
        samples = pool.generate(_requests(13))
    finally:
        hung.release.set()
    assert [s.rid for s in samples] == [f"r{i}" for i in range(13)]
    assert [s.prompt_ids for s in samples] == [(i + 1,) for i in range(13)]
    assert set(pool.dead) == {"dies", "hangs"} and list(pool.live) == ["ok"]
    assert {f["engine"] for k, f in events if k == "rollout_retry"} == {"dies", "hangs"}


def test_no_engine_left_is_a_clear_error():
    pool = EnginePool(
        {"a": EchoEngine(fail_after=0), "b": EchoEngine(fail_after=0)}, PoolConfig(chunk_size=4)
    )
    with pytest.raises(NoEngineLeftError, match="no rollout engine left"):
        pool.generate(_requests(8))


def test_retries_are_bounded():
    engines = {f"e{i}": EchoEngine(fail_after=0) for i in range(5)}
    with pytest.raises(NoEngineLeftError, match="failed 2 times"):
        EnginePool(engines, PoolConfig(chunk_size=8, max_attempts=2)).generate(_requests(8))


def test_bad_pool_config_names_the_field():
    with pytest.raises(ValueError, match="chunk_timeout_s=0 must be > 0"):
        PoolConfig(chunk_timeout_s=0)


class SlotEngine(EchoEngine):
    """Takes `concurrency` chunks at once (as the SGLang router does); records the most in flight."""

    def __init__(self, concurrency: int, **kwargs):
        super().__init__(**kwargs)
        self.concurrency = concurrency
        self.in_flight = self.peak = 0
        self.lock = threading.Lock()
        self.all_in = threading.Barrier(concurrency, timeout=5)

    def generate(self, requests):
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            self.all_in.wait()  # every slot is busy at once, or this raises BrokenBarrierError
            return super().generate(requests)
        finally:
            with self.lock:
                self.in_flight -= 1


def test_an_engine_with_concurrency_takes_that_many_chunks_at_once():
    engine = SlotEngine(3)
    samples = EnginePool({"router": engine}, PoolConfig(chunk_size=2)).generate(_requests(12))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(12)]
    assert engine.peak == 3 and engine.calls == 6


def test_chunks_go_out_one_per_engine_in_turn():
    """Two servers with room for the whole step share it: neither takes all before the other."""
    a, b = EchoEngine(), EchoEngine()
    a.concurrency = b.concurrency = 8
    samples = EnginePool({"a": a, "b": b}, PoolConfig(chunk_size=2)).generate(_requests(12))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(12)]
    assert (a.calls, b.calls) == (3, 3)


def test_a_failing_concurrent_engine_leaves_with_all_its_chunks():
    """Its chunks in flight go to the other engine; with it alone the step fails at once."""
    router = SlotEngine(2, fail_after=0)
    pool = EnginePool({"router": router, "ok": EchoEngine()}, PoolConfig(chunk_size=2, max_attempts=2))
    samples = pool.generate(_requests(8))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(8)] and list(pool.dead) == ["router"]
    alone = EnginePool({"router": SlotEngine(2, fail_after=0)}, PoolConfig(chunk_size=2))
    with pytest.raises(NoEngineLeftError, match="router.*engine died"):
        alone.generate(_requests(8))
