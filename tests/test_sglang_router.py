"""The real sglang-router (0.3.2, its Rust binary) in front of two real `sparserl serve` workers.

Cheaper than SGLang workers (tests/test_sglang_live.py puts it in front of those); `sparserl serve`
answers the routes the router uses: it registers a worker after GET /health and GET /get_model_info
(it also tries /server_info, /get_server_info and /model_info, 404 here), and forwards each
/generate re-serialized with SGLang's default `GenerateReqInput` fields, which our server accepts.
What is checked: the worker list (`router_workers`), SGLang-dialect generation through the router
(`SGLangRouter`, seeds honoured: the same samples as the worker gives directly), the trainer's own
path (`rollout.router_url` -> `build_engines` -> `EnginePool`), the weight sync taking a dropped
worker out, the preflight check, and that a dead router fails the step at once with its URL in the
error.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import httpx
import pytest
from e2e_support import free_port
from fault_proxy import FaultProxy
from waiting import wait_until

pytest.importorskip("sglang_router", reason="sglang-router is not installed (make setup installs it)")

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny  # noqa: E402
from sparserl_mcore.config import config_from_dict  # noqa: E402
from sparserl_mcore.rollout.client import RemoteEngine  # noqa: E402
from sparserl_mcore.rollout.protocol import SamplingParams  # noqa: E402
from sparserl_mcore.sglang.client import SGLangRouter, router_workers  # noqa: E402
from sparserl_mcore.sglang.launch import LaunchConfig, ServerProcess, router_argv  # noqa: E402
from sparserl_mcore.trainer.engine_pool import EnginePool, NoEngineLeftError, PoolConfig  # noqa: E402
from sparserl_mcore.trainer.preflight import PreflightError, _check_router  # noqa: E402
from sparserl_mcore.trainer.rollouts import Prompt, make_requests  # noqa: E402
from sparserl_mcore.trainer.setup import build_engines  # noqa: E402
from sparserl_mcore.trainer.weight_sync import WeightSyncer  # noqa: E402

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=5)


def _launch(port: int) -> LaunchConfig:
    return LaunchConfig(model_path="unused", port=port, startup_timeout_s=120, grace_s=10)


WORKERS: dict[str, ServerProcess] = {}  # the module's worker processes by URL (to kill one)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """(router process, router URL, worker URLs, hf dir): two workers, then the router."""
    hf = make_tiny(TinyModelConfig(), tmp_path_factory.mktemp("router") / "tiny")
    workers = []
    try:
        for _ in range(2):
            cfg = _launch(free_port())
            argv = [
                sys.executable,
                "-m",
                "sparserl_mcore",
                "serve",
                "--hf-dir",
                str(hf),
                "--port",
                str(cfg.port),
            ]
            workers.append(ServerProcess(cfg, argv=argv).__enter__())
        for w in workers:
            w.wait_healthy()
        urls = [w.cfg.url for w in workers]
        WORKERS.update(zip(urls, workers, strict=True))
        cfg = _launch(free_port())
        router = ServerProcess(cfg, argv=router_argv(urls, host=cfg.host, port=cfg.port)).__enter__()
        workers.append(router)
        router.wait_healthy()
        yield router, cfg.url, urls, hf
    finally:
        for process in reversed(workers):
            process.stop()


def _config(hf, router_url: str, urls: list[str]):
    rollout = {
        "engine": "remote",
        "server": "sglang",
        "urls": urls,
        "router_url": router_url,
        "group_size": 4,
    }
    return config_from_dict(
        {
            "model": {"hf_path": str(hf)},
            "data": {"train_path": "unused"},
            "train": {"prompts_per_step": 4, "global_batch_size": 16},
            "rollout": rollout,
        }
    )


def _requests(n_prompts: int, tag: str):
    prompts = [Prompt(input_ids=(3 + p, 7, 11), answer="") for p in range(n_prompts)]
    return make_requests(prompts, tag=tag, group_size=4, sampling=SAMPLING, run_seed=5)


def test_router_lists_the_workers_and_generates_what_they_would(stack):
    _, router_url, urls, _ = stack
    deadline = time.monotonic() + 30  # registration runs in the background after /health
    while sorted(router_workers(router_url)) != sorted(urls) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert sorted(router_workers(router_url)) == sorted(urls)
    requests = _requests(2, "direct")
    router = SGLangRouter(router_url, concurrency=2, chunk_size=4, timeout=60)
    samples = router.generate(requests)
    with RemoteEngine(urls[1], timeout=60) as worker:  # our dialect, one batch, the same seeds
        direct = worker.generate(requests)
    assert [s.rid for s in samples] == [r.rid for r in requests]
    assert [s.output_ids for s in samples] == [d.output_ids for d in direct]
    assert all(len(s.output_ids) == 5 and len(s.output_logprobs) == 5 for s in samples)
    assert {s.weight_version for s in samples} == {0} and {s.finish_reason for s in samples} == {"length"}
    assert len({s.output_ids for s in samples}) > 1  # per-request seeds reached the workers
    router.close()


def test_the_trainer_generates_through_router_url(stack):
    _, router_url, urls, hf = stack
    cfg = _config(hf, router_url, urls)
    engines = build_engines(cfg, compressed=True, device="cpu")
    assert list(engines) == [router_url]  # each worker's groups in flight, summed
    assert engines[router_url].concurrency == 2 * cfg.rollout.groups_in_flight
    pool = EnginePool(engines, PoolConfig(chunk_size=4, chunk_timeout_s=60))
    requests = _requests(4, "step0")
    samples = pool.generate(requests)
    assert [s.rid for s in samples] == [r.rid for r in requests] and not pool.dead
    _check_router(cfg.rollout)  # the router routes to exactly rollout.urls
    with pytest.raises(PreflightError, match="routes to .* but rollout.urls are"):
        _check_router(_config(hf, router_url, urls[:1]).rollout)
    pool.close()


def test_a_routing_key_keeps_its_requests_on_one_worker(stack):
    """A multi-turn episode group's requests carry its routing key (`x-smg-routing-key`): under the
    router's `manual` policy every request of one key goes to one worker, whichever that is. The
    same requests without a key are spread at random. Counted by a proxy in front of each worker."""
    import dataclasses

    _, _, urls, _ = stack
    proxies = [FaultProxy(u) for u in urls]
    cfg = _launch(free_port())
    argv = router_argv([p.url for p in proxies], host=cfg.host, port=cfg.port, policy="manual")
    router = None
    try:
        with ServerProcess(cfg, argv=argv) as process:
            process.wait_healthy()
            wait_until(
                lambda: sorted(router_workers(cfg.url)) == sorted(p.url for p in proxies),
                timeout=60,
                what="the manual router lists both proxies",
            )
            router = SGLangRouter(cfg.url, concurrency=2, chunk_size=4, timeout=60)

            def served(requests) -> list[int]:
                before = [p.generates for p in proxies]
                assert len(router.generate(requests)) == len(requests)
                return [p.generates - b for p, b in zip(proxies, before, strict=True)]

            per_key = []
            for key in range(4):  # 2 turns of one group: 8 requests of one key, all at once
                keyed = _requests(2, f"k{key}")
                per_key.append(served([dataclasses.replace(r, routing_key=f"group-{key}") for r in keyed]))
            assert all(sorted(counts) == [0, 8] for counts in per_key), per_key
            unkeyed = served(_requests(4, "unkeyed"))  # 16 requests, each routed on its own
            assert sum(unkeyed) == 16 and min(unkeyed) > 0, unkeyed
    finally:
        if router is not None:
            router.close()
        for proxy in proxies:
            proxy.close()


def test_a_step_through_the_router_runs_on_one_io_thread_not_a_thread_per_request(stack):
    """The router takes one prompt per call, so a step is hundreds of calls at scale: they share the
    router engine's asyncio loop (started with it). While a step's 32 requests run, the host has
    two threads more than before: the caller's and the pool's one call to the router, none per
    request; closing the router stops the loop."""
    _, router_url, urls, hf = stack
    engines = build_engines(_config(hf, router_url, urls), compressed=True, device="cpu")
    pool = EnginePool(engines, PoolConfig(chunk_size=4, chunk_timeout_s=60))
    long = SamplingParams(temperature=1.0, max_new_tokens=48, ignore_eos=True)
    prompts = [Prompt(input_ids=(3 + p, 7, 11), answer="") for p in range(8)]
    requests = make_requests(prompts, tag="threads", group_size=4, sampling=long, run_seed=5)
    before, peak = threading.active_count(), []
    with ThreadPoolExecutor(1) as call:
        pending = call.submit(pool.generate, requests)
        while not pending.done():
            peak.append(threading.active_count())
            time.sleep(0.005)
        samples = pending.result()
    assert [len(s.output_ids) for s in samples] == [48] * 32
    assert max(peak) - before <= 2, (before, max(peak))
    assert "sglang-router-io" in {t.name for t in threading.enumerate()}
    pool.close()
    assert "sglang-router-io" not in {t.name for t in threading.enumerate()}


def test_pausing_the_router_pauses_the_workers_behind_it(stack):
    """A stop aborts what the engines run through `pause`; sglang-router does not forward the pause
    routes, so the trainer's router engine pauses its workers. While they are paused in place a
    generation through the router does not complete; it does once they continue."""
    _, router_url, urls, hf = stack
    router = build_engines(_config(hf, router_url, urls), compressed=True, device="cpu")[router_url]
    assert [w.url for w in router.workers] == urls
    router.pause("in_place")
    with ThreadPoolExecutor(1) as call:
        pending = call.submit(router.generate, _requests(1, "paused"))
        with pytest.raises(FutureTimeout):
            pending.result(timeout=3)  # 5 tokens of the tiny model take well under that unpaused
        router.resume()
        assert len(pending.result(timeout=60)) == 4
    router.close()


def test_a_router_failing_some_requests_costs_retries_of_those_requests_only(stack):
    """A router answering 502 / 503 to every 4th request (a proxy in front of the real one): each
    failed request is sent again with its id and seed (a request unlucky every time fails its
    chunk, which the pool sends again), so the step gets exactly the samples a fault-free step
    gets and the pool keeps the router. Before, the chunk's first failure cancelled its other
    requests and the pool dropped its only engine."""
    _, router_url, urls, hf = stack
    proxy = FaultProxy(router_url, fail_every=4)
    try:
        clean = SGLangRouter(router_url, concurrency=4, chunk_size=4, timeout=60)
        faulty = SGLangRouter(proxy.url, concurrency=4, chunk_size=4, timeout=60, retries=2, backoff_s=0.05)
        pool = EnginePool({proxy.url: faulty}, PoolConfig(chunk_size=4, chunk_timeout_s=60))
        requests = _requests(4, "router-faults")
        samples = pool.generate(requests)
        expected = clean.generate(requests)
        assert [s.rid for s in samples] == [r.rid for r in requests]
        assert [s.output_ids for s in samples] == [e.output_ids for e in expected]
        assert set(proxy.injected) == {502, 503} and len(proxy.injected) >= 4
        assert list(pool.live) == [proxy.url] and not pool.dead
        pool.close()
        clean.close()
    finally:
        proxy.close()


def test_a_worker_dying_under_the_router_mid_step_loses_no_request(stack):
    """Worker 0 is SIGKILLed while the step's requests run on both: the requests it held fail at
    the router and are sent again (same ids and seeds), the router routes them to worker 1, and
    the step completes with one sample per request; the router stays the pool's engine. (Runs
    before the tests below, which need only worker 1.)"""
    _, router_url, urls, hf = stack
    engines = build_engines(_config(hf, router_url, urls), compressed=True, device="cpu")
    pool = EnginePool(engines, PoolConfig(chunk_size=4, chunk_timeout_s=60, retry_backoff_s=0.2))
    long = SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True)
    prompts = [Prompt(input_ids=(3 + p, 7, 11), answer="") for p in range(8)]
    requests = make_requests(prompts, tag="worker-dies", group_size=4, sampling=long, run_seed=5)

    def running_on_worker_0() -> bool:
        return httpx.get(f"{urls[0]}/get_model_info", timeout=10).json()["pending_requests"] > 0

    with ThreadPoolExecutor(1) as call:
        pending = call.submit(pool.generate, requests)
        wait_until(running_on_worker_0, timeout=60, what="requests running on worker 0")
        os.killpg(WORKERS[urls[0]].proc.pid, signal.SIGKILL)
        samples = pending.result(timeout=300)
    assert [s.rid for s in samples] == [r.rid for r in requests]
    assert [len(s.output_ids) for s in samples] == [64] * 32
    assert list(pool.live) == [router_url] and not pool.dead
    pool.close()


def test_a_worker_dropped_by_the_weight_sync_leaves_the_router(stack):
    """`WeightSyncer._drop` (a worker failed a sync and its full fallback) against the real router;
    the syncer is built bare: its constructor needs a learner, `_drop` only these fields."""
    _, router_url, urls, _ = stack
    router = SGLangRouter(router_url, concurrency=2, chunk_size=4, timeout=60)
    pool = EnginePool({router_url: router}, PoolConfig(chunk_size=4))
    syncer = WeightSyncer.__new__(WeightSyncer)
    syncer._dropped, syncer._remote, syncer._router_url = set(), set(urls), router_url
    syncer.in_flight = False  # nothing paused to release
    syncer._drop([pool, None], {urls[0]})
    assert list(pool.live) == [router_url]  # the router itself stays
    deadline = time.monotonic() + 30  # the router removes it in the background (202)
    while router_workers(router_url) != urls[1:] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert router_workers(router_url) == urls[1:]
    assert len(router.generate(_requests(1, "after-removal"))) == 4
    router.close()


def _serve_again(url: str, hf) -> ServerProcess:
    """`sparserl serve` again on the port of `url` (a worker killed above), healthy."""
    cfg = _launch(int(url.rsplit(":", 1)[1]))
    argv = [sys.executable, "-m", "sparserl_mcore", "serve", "--hf-dir", str(hf), "--port", str(cfg.port)]
    process = ServerProcess(cfg, argv=argv).__enter__()
    process.wait_healthy()
    return process


def test_a_worker_dead_under_the_router_is_taken_out_and_returns_only_when_admitted(stack):
    """The pool watches the workers behind its router: worker 0, SIGKILLed, fails its health check
    and is taken out of the router (`DELETE /workers/{id}`); started again, it answers health and is
    `recovered`, but the router does not route to it until `admit` (which the loop calls only after
    its full weight sync) puts it back (`POST /workers`). Worker 0 was killed by the test above."""
    _, router_url, urls, hf = stack
    events: list[tuple[str, dict]] = []
    restarted = [_serve_again(urls[0], hf)]
    try:
        engines = build_engines(_config(hf, router_url, urls), compressed=True, device="cpu")
        router = engines[router_url]
        router.add_worker(router.workers[0])  # taken out by the test above: in again
        assert sorted(router_workers(router_url)) == sorted(urls)
        cfg = PoolConfig(chunk_size=4, chunk_timeout_s=60, probe_interval_s=0.2)
        pool = EnginePool(engines, cfg, lambda kind, fields: events.append((kind, fields)))
        os.killpg(restarted[0].proc.pid, signal.SIGKILL)
        wait_until(lambda: router_workers(router_url) == urls[1:], timeout=30, what="worker 0 taken out")
        assert [(k, f["engine"], f["live"]) for k, f in events] == [("engine_removed", urls[0], 1)]
        assert list(pool.live) == [router_url] and [w.url for w in router.workers] == urls[1:]
        assert len(pool.generate(_requests(2, "one-worker"))) == 8  # worker 1 serves the step
        restarted.append(_serve_again(urls[0], hf))
        wait_until(lambda: pool.recovered() == [urls[0]], timeout=30, what="worker 0 recovered")
        assert router_workers(router_url) == urls[1:]  # healthy, but not routed to before admit
        pool.admit(urls[0])
        assert sorted(router_workers(router_url)) == sorted(urls) and pool.recovered() == []
        assert events[-1][0] == "engine_readmitted" and events[-1][1]["engine"] == urls[0]
        assert sorted(w.url for w in router.workers) == sorted(urls)  # a stop pauses it again
        pool.close()
    finally:
        for process in restarted:
            process.stop()


def test_a_dead_router_fails_the_step_at_once_with_its_url(stack):
    process, router_url, urls, hf = stack
    engines = build_engines(_config(hf, router_url, urls), compressed=True, device="cpu")
    pool = EnginePool(engines, PoolConfig(chunk_size=4, chunk_timeout_s=60))
    process.stop()
    started = time.monotonic()
    with pytest.raises(NoEngineLeftError, match=router_url):
        pool.generate(_requests(4, "dead"))
    assert time.monotonic() - started < 10


def test_a_router_still_registering_lists_no_workers_and_preflight_leaves_it_to_the_run(tmp_path):
    """Right after start the router answers /health but lists no worker yet (it registers them in
    the background): an empty list, not an error, and no refusal before the run."""
    cfg = _launch(free_port())
    with ServerProcess(cfg, argv=router_argv([], host=cfg.host, port=cfg.port)) as router:
        router.wait_healthy()
        assert router_workers(cfg.url) == []
        _check_router(_config(tmp_path, cfg.url, ["http://127.0.0.1:1"]).rollout)
