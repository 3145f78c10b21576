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

    def __init__(self, *, fail_after: int | None = None, hang_after: int | None = None, concurrency: int = 1):
        self.calls = 0
        self.fail_after, self.hang_after = fail_after, hang_after
        self.concurrency = concurrency
        self.release = threading.Event()
        self.rids: list[list[str]] = []  # per call

    def generate(self, requests):
        self.calls += 1
        self.rids.append([r.rid for r in requests])
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


def test_an_engine_with_concurrency_takes_that_many_chunks_at_once_in_one_call():
    engine = EchoEngine(concurrency=3)
    samples = EnginePool({"server": engine}, PoolConfig(chunk_size=2)).generate(_requests(12))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(12)]
    assert engine.rids == [[f"r{i}" for i in range(6)], [f"r{i}" for i in range(6, 12)]]


def test_chunks_go_out_one_per_engine_in_turn():
    """Two servers with room for the whole step share it: neither takes all before the other."""
    a, b = EchoEngine(concurrency=8), EchoEngine(concurrency=8)
    samples = EnginePool({"a": a, "b": b}, PoolConfig(chunk_size=2)).generate(_requests(12))
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
    pool = EnginePool({"short": ShortEngine(concurrency=4), "ok": EchoEngine()}, PoolConfig(chunk_size=2))
    samples = pool.generate(_requests(8))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(8)]
    assert [s.prompt_ids for s in samples] == [(i + 1,) for i in range(8)]
    assert list(pool.dead) == ["short"] and "other requests than asked" in pool.dead["short"]


def test_a_failing_concurrent_engine_leaves_with_all_its_chunks():
    """Its chunks in flight go to the other engine; with it alone the step fails at once."""
    router = EchoEngine(concurrency=2, fail_after=0)
    pool = EnginePool({"router": router, "ok": EchoEngine()}, PoolConfig(chunk_size=2, max_attempts=2))
    samples = pool.generate(_requests(8))
    assert [s.rid for s in samples] == [f"r{i}" for i in range(8)] and list(pool.dead) == ["router"]
    alone = EnginePool({"router": EchoEngine(concurrency=2, fail_after=0)}, PoolConfig(chunk_size=2))
    with pytest.raises(NoEngineLeftError, match="router.*engine died"):
        alone.generate(_requests(8))
