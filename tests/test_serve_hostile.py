"""The rollout server under bad and heavy requests (issue 17).

Engine level: a step that raises fails only the request behind it, every resource (pages, radix
references, compression lanes) is released on every exit path, and the resource invariants hold
after every step (`EngineConfig(check_invariants=True)`). HTTP level, over real loopback sockets:
validation at the edge (400 naming the field, one log line, nothing reaches the engine), limits
(context, KV pool, max_new_tokens cap, pending requests, deadlines), bounded pause / weight
updates with long requests in flight, /health, the weight routes' refusals, and a bounded load
test of concurrent valid and invalid traffic.

Faults are injected by making the model's RoPE lookup raise for one position (`_poisoned`): a
request that reaches it makes the whole batched step raise, exactly as a kernel error or an
out-of-memory would. References are the same requests served alone (greedy or seeded).
"""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
from sparserl_mcore.rollout.http.server import BackgroundServer, ServerConfig, create_app
from sparserl_mcore.rollout.kvcompress import KVCompressionConfig
from sparserl_mcore.rollout.protocol import GenerateRequest, RequestsFailed, Sample, SamplingParams
from sparserl_mcore.sync.codec import encode_patch
from sparserl_mcore.sync.diff import make_patch

TOKEN = "hostile-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
POISON_POS = 50  # a step computing this RoPE position raises (see _poisoned)
SNAPKV = KVCompressionConfig(method="snapkv", budget=24, interval=8, window=4)
SERVER_LOG = "sparserl_mcore.rollout.http.server"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> pathlib.Path:
    return make_tiny(TinyModelConfig(seed=11), tmp_path_factory.mktemp("m") / "tiny")


def _engine(hf_dir: pathlib.Path, **kw) -> EmbeddedEngine:
    cfg = dict(device="cpu", page_size=4, capacity_pages=256, max_running_requests=4)
    cfg.update(kv_compression=SNAPKV, check_invariants=True)
    cfg.update(kw)
    return EmbeddedEngine(hf_dir, EngineConfig(**cfg))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)


def _prompt(i: int, n: int) -> tuple[int, ...]:
    return tuple((7 * i + 3 * j) % 100 + 10 for j in range(n))


def _alone(hf_dir: pathlib.Path, requests: list[GenerateRequest]) -> list[Sample]:
    """Each request served alone on a fresh engine of the same shape: the reference."""
    engine = _engine(hf_dir, max_running_requests=8)
    return [engine.generate([r])[0] for r in requests]


@contextlib.contextmanager
def _poisoned(engine: EmbeddedEngine, position: int = POISON_POS) -> Iterator[None]:
    """Every step that computes RoPE for `position` raises, like a kernel fault would."""
    real = engine.model.rope

    def rope(positions: torch.Tensor, end: int):
        if bool((positions == position).any()):
            raise RuntimeError(f"injected fault at position {position}")
        return real(positions, end)

    engine.model.rope = rope  # type: ignore[method-assign]
    try:
        yield
    finally:
        del engine.model.rope


def _assert_clean(engine: EmbeddedEngine) -> None:
    """No resource held once idle: invariants, every lane and (after a flush) every page free."""
    assert engine.scheduler.idle
    assert engine.scheduler.resource_problems() == []
    assert engine.health_problem() is None
    lanes = engine.scheduler.lanes
    assert lanes is None or lanes.num_free == lanes.num_lanes
    engine.flush_cache()
    assert engine.pool.num_free == engine.pool.num_pages


# ---- failure isolation (engine) ------------------------------------------------------------------
def test_failed_steps_leak_nothing_and_the_engine_keeps_serving(hf_dir):
    """The wedge of issue 17: failed steps used to leak compression lanes until every step failed."""
    engine = _engine(hf_dir)
    poison = GenerateRequest(input_ids=_prompt(0, 45), sampling=_greedy(20))
    good = GenerateRequest(input_ids=_prompt(1, 9), sampling=_greedy(30), rid="good")
    with _poisoned(engine):
        for _ in range(3 * engine.cfg.max_running_requests):  # more failures than lanes
            with pytest.raises(RequestsFailed, match="injected fault"):
                engine.generate([poison])
        assert engine.generate([good])[0].output_ids == _alone(hf_dir, [good])[0].output_ids
    assert engine.stats()["failed_requests"] == 3 * engine.cfg.max_running_requests
    _assert_clean(engine)


def test_a_failing_request_fails_alone_in_a_shared_batch(hf_dir):
    """One request makes a batched step raise mid-decode: it fails, the others (greedy and seeded
    sampling, compressed) return what they return when served alone."""
    engine = _engine(hf_dir, max_running_requests=8)
    good = [GenerateRequest(input_ids=_prompt(i, 6 + i), sampling=_greedy(28), rid=f"g{i}") for i in range(5)]
    good.append(
        GenerateRequest(
            input_ids=_prompt(9, 8), sampling=SamplingParams(max_new_tokens=28, seed=3, ignore_eos=True)
        )
    )
    poison = GenerateRequest(input_ids=_prompt(7, 40), sampling=_greedy(30), rid="poison")
    with _poisoned(engine), pytest.raises(RequestsFailed) as failed:
        engine.generate([*good[:3], poison, *good[3:]])
    outcomes = failed.value.outcomes
    assert isinstance(outcomes[3], RuntimeError) and "injected fault" in str(outcomes[3])
    served = [o for i, o in enumerate(outcomes) if i != 3]
    for got, ref in zip(served, _alone(hf_dir, good), strict=True):
        assert isinstance(got, Sample) and got.output_ids == ref.output_ids, got
        assert got.kv_stats.compressions == ref.kv_stats.compressions > 0
    assert engine.stats()["failed_steps"] >= 2  # the batch failed, then its halves were probed
    _assert_clean(engine)


def test_every_exit_path_releases_everything(hf_dir):
    """finish, abort, retraction (a pool too small for the batch), failure and max_new_tokens=0,
    with the invariants checked after every step."""
    engine = _engine(hf_dir, capacity_pages=24, max_running_requests=6)
    reqs = [GenerateRequest(input_ids=_prompt(i, 10), sampling=_greedy(30), rid=f"r{i}") for i in range(5)]
    reqs.append(GenerateRequest(input_ids=_prompt(8, 4), sampling=_greedy(0), rid="empty"))
    reqs.append(GenerateRequest(input_ids=_prompt(9, 45), sampling=_greedy(10), rid="poison"))
    reqs.append(GenerateRequest(input_ids=_prompt(6, 5), sampling=_greedy(1000 - 5), rid="aborted"))
    started = threading.Event()
    engine.add_compression_listener(lambda rid, *_: started.set() if rid == "aborted" else None)
    result: dict = {}

    def run() -> None:
        with pytest.raises(RequestsFailed) as failed:
            engine.generate(reqs)
        result["outcomes"] = failed.value.outcomes

    with _poisoned(engine):
        t = threading.Thread(target=run)
        t.start()
        assert started.wait(60), "the long request never compressed"
        engine.abort("aborted")
        t.join(60)
    out = {r.rid: o for r, o in zip(reqs, result["outcomes"], strict=True)}
    assert isinstance(out["poison"], RuntimeError)
    assert out["aborted"].finish_reason == "abort" and out["empty"].output_ids == ()
    assert all(len(out[f"r{i}"].output_ids) == 30 for i in range(5))
    assert engine.stats()["retractions"] > 0
    _assert_clean(engine)


# ---- HTTP: validation at the edge ---------------------------------------------------------------
@pytest.fixture()
def plain_server(hf_dir) -> Iterator[tuple[str, EmbeddedEngine, list]]:
    """No compression, a 256-token KV pool, --max-new-tokens 512; records engine.generate calls."""
    engine = _engine(hf_dir, capacity_pages=64, kv_compression=KVCompressionConfig())
    calls: list = []
    real = engine.generate
    engine.generate = lambda reqs: calls.append(reqs) or real(reqs)  # type: ignore[method-assign]
    app = create_app(engine, ServerConfig(token=TOKEN, max_new_tokens=512, max_concurrent_batches=4))
    with BackgroundServer(app) as server:
        yield server.url, engine, calls


def _body(sampling: dict | None = None, **top) -> dict:
    return {"input_ids": [5, 6, 7], "sampling_params": sampling or {}, **top}


BAD_REQUESTS = [
    (_body({"top_k": 1.5}), "top_k"),
    (_body({"top_k": 0}), "top_k"),
    (_body({"top_k": -2}), "top_k"),
    (_body({"top_k": "5"}), "top_k"),
    (_body({"top_k": True}), "top_k"),
    (_body({"max_new_tokens": "5"}), "max_new_tokens"),
    (_body({"max_new_tokens": 2.0}), "max_new_tokens"),
    (_body({"max_new_tokens": -1}), "max_new_tokens"),
    (_body({"max_new_tokens": 10**9, "ignore_eos": True}), "max_new_tokens"),
    (_body({"max_new_tokens": 600}), "max_new_tokens=600: above this server's limit of 512"),
    (_body({"max_new_tokens": 300}), "whole KV pool"),
    (_body({"temperature": "hot"}), "temperature"),
    (_body({"temperature": -0.5}), "temperature"),
    (_body({"temperature": 1e-300}), "temperature=1e-300: below 1e-06"),  # underflows: never a 500
    (_body({"top_p": 0}), "top_p"),
    (_body({"top_p": 1.5}), "top_p"),
    (_body({"min_p": 2}), "min_p"),
    (_body({"seed": "x"}), "seed"),
    (_body({"seed": -1}), "seed"),
    (_body({"seed": 1.5}), "seed"),
    (_body({"ignore_eos": "yes"}), "ignore_eos"),
    (_body({"stop": [""]}), "stop"),
    (_body({"stop": 5}), "stop"),
    (_body({"stop_token_ids": [-1]}), "stop_token_ids"),
    (_body({"stop_token_ids": [1.5]}), "stop_token_ids"),
    (_body({"stop_token_ids": "3"}), "stop_token_ids"),
    (_body({"stop_token_ids": [100_000]}), "stop_token_ids holds token 100000, outside the vocabulary"),
    ({"input_ids": [5, 100_000]}, "input_ids holds token 100000, outside the vocabulary"),
    ({"input_ids": [5, True]}, "input_ids"),
    ({"input_ids": [5, 6.0]}, "input_ids"),
    ({"input_ids": [[5], []]}, "input_ids"),
    ({"input_ids": list(range(10, 110)) * 30}, "input_ids: the prompt has 3000 tokens"),
    ({"input_ids": [5] * 2000, "sampling_params": {"max_new_tokens": 100}}, "context length 2048"),
]


def test_invalid_requests_are_400_naming_the_field_and_never_reach_the_engine(plain_server, caplog):
    url, engine, calls = plain_server
    caplog.set_level(logging.INFO, logger=SERVER_LOG)
    with httpx.Client(timeout=30) as http:
        for body, reason in BAD_REQUESTS:
            r = http.post(f"{url}/generate", json=body)
            assert r.status_code == 400 and reason in r.json()["error"], (body, r.text)
            assert "\n" not in r.json()["error"]
        raw = b'{"input_ids": [1], "sampling_params": {"temperature": Infinity}}'
        r = http.post(f"{url}/generate", content=raw)
        assert r.status_code == 400 and "temperature" in r.json()["error"], r.text
        r = http.post(f"{url}/generate", json=_body({"max_new_tokens": None}))
        assert r.status_code == 400 and "max_new_tokens=None" in r.json()["error"]
        nulls = {"top_k": None, "stop": None, "seed": None, "temperature": None}  # null: the default
        ok = http.post(f"{url}/generate", json=_body({"max_new_tokens": 4, "min_p": 0.1, **nulls}))
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 4
    assert len(calls) == 1, "an invalid request reached the engine"
    rejected = [r for r in caplog.records if r.name == SERVER_LOG and "/generate -> 400" in r.getMessage()]
    assert len(rejected) == len(BAD_REQUESTS) + 2
    assert all(r.exc_info is None for r in caplog.records), "a refusal logged a traceback"
    assert engine.stats()["failed_requests"] == 0


def test_min_p_keeps_only_tokens_near_the_most_likely(hf_dir):
    engine = _engine(hf_dir)
    prompt = _prompt(3, 7)
    greedy = engine.generate([GenerateRequest(input_ids=prompt, sampling=_greedy(12))])[0]
    hot = SamplingParams(temperature=5.0, min_p=1.0, max_new_tokens=12, ignore_eos=True, seed=1)
    sampled = engine.generate([GenerateRequest(input_ids=prompt, sampling=hot)])[0]
    assert sampled.output_ids == greedy.output_ids


# ---- HTTP: limits, pause, health, weight routes ----------------------------------------------------
def _post_in_background(url: str, body: dict, out: dict, key: str) -> threading.Thread:
    def run() -> None:
        out[key] = httpx.post(f"{url}/generate", json=body, timeout=120)

    t = threading.Thread(target=run)
    t.start()
    return t


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_pending_cap_answers_503_with_retry_after(hf_dir):
    engine = _engine(hf_dir)
    app = create_app(engine, ServerConfig(token=TOKEN, max_pending_requests=2, max_concurrent_batches=2))
    worker, out = app.state.worker, {}
    with BackgroundServer(app) as server:
        worker.pause("in_place")  # queued requests stay pending
        body = _body({"max_new_tokens": 3})
        threads = [_post_in_background(server.url, body, out, k) for k in ("a", "b")]
        _wait_for(lambda: worker.pending_requests == 2, "two pending requests")
        full = httpx.post(f"{server.url}/generate", json=body, timeout=30)
        assert full.status_code == 503 and full.headers["retry-after"] == "1", full.text
        assert "pending" in full.json()["error"]
        worker.resume()
        for t in threads:
            t.join(60)
    assert out["a"].status_code == out["b"].status_code == 200
    _assert_clean(engine)


def test_deadline_aborts_a_running_request_and_fails_a_queued_one(hf_dir):
    engine = _engine(hf_dir, kv_compression=KVCompressionConfig(), capacity_pages=1024)
    app = create_app(engine, ServerConfig(request_timeout_s=1.0, max_concurrent_batches=1))
    long = _body({"max_new_tokens": 2000, "ignore_eos": True})
    with BackgroundServer(app) as server:
        r = httpx.post(f"{server.url}/generate", json=long, timeout=60)
        meta = r.json()["meta_info"]
        assert meta["finish_reason"] == {"type": "abort", "message": "deadline of 1 s passed"}
        assert 0 < meta["completion_tokens"] < 2000
        app.state.worker.pause("in_place")  # nothing starts: the next request waits in the queue
        queued = httpx.post(f"{server.url}/generate", json=_body({"max_new_tokens": 2}), timeout=30)
        assert queued.status_code == 503 and "without starting" in queued.json()["error"]
        assert queued.headers["retry-after"] == "1"
        app.state.worker.resume()
    _assert_clean(engine)


def _shifted_weights(hf_dir: pathlib.Path, out: pathlib.Path) -> dict[str, torch.Tensor]:
    state = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    state["lm_head.weight"] = state["lm_head.weight"].roll(1, dims=0)  # other greedy tokens
    save_file(state, out)
    return state


def test_weight_update_is_bounded_with_a_long_request_in_flight(hf_dir, tmp_path):
    """A flush and an update land between steps: neither waits for the long request. The update
    retracts it, so it restarts under the new weights and its output is the new model's alone."""
    engine = _engine(hf_dir)
    new = tmp_path / "new.safetensors"
    _shifted_weights(hf_dir, new)
    app = create_app(engine, ServerConfig(token=TOKEN, max_concurrent_batches=2))
    long = _body({"temperature": 0, "max_new_tokens": 400, "ignore_eos": True})
    out: dict = {}
    with BackgroundServer(app) as server:
        t = _post_in_background(server.url, long, out, "long")
        _wait_for(lambda: engine.stats()["generated_tokens"] > 20, "the long request to decode")
        flushed = httpx.post(f"{server.url}/flush_cache", headers=AUTH, timeout=10)  # in place, at once
        assert flushed.status_code == 200 and not engine.scheduler.idle
        start = time.monotonic()
        r = httpx.post(
            f"{server.url}/update_weights_from_disk",
            json={"model_path": str(new), "weight_version": 1},
            headers=AUTH,
            timeout=60,
        )
        took = time.monotonic() - start
        assert r.status_code == 200, r.text
        assert not engine.scheduler.idle, "the long request finished before the update: no overlap"
        t.join(120)
    assert took < 10, f"the update waited {took:.1f} s"
    got = out["long"].json()
    assert got["meta_info"]["weight_version"] == 1
    ref = engine.generate([GenerateRequest(input_ids=(5, 6, 7), sampling=_greedy(400))])[0]
    assert got["output_ids"] == list(ref.output_ids)
    _assert_clean(engine)


def test_pause_modes(hf_dir):
    engine = _engine(hf_dir, kv_compression=KVCompressionConfig(), capacity_pages=1024)
    app = create_app(engine, ServerConfig(token=TOKEN, max_concurrent_batches=2))
    out: dict = {}
    with BackgroundServer(app) as server:
        bad = httpx.post(f"{server.url}/pause_generation", json={"mode": "later"}, headers=AUTH)
        assert bad.status_code == 400 and "mode" in bad.json()["error"]
        t = _post_in_background(server.url, _body({"max_new_tokens": 2000, "ignore_eos": True}), out, "x")
        _wait_for(lambda: bool(engine.scheduler.running), "the request to start")
        r = httpx.post(f"{server.url}/pause_generation", headers=AUTH)  # SGLang's default: abort
        assert r.status_code == 200 and "abort" in r.json()["message"]
        t.join(60)
        assert out["x"].json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert httpx.post(f"{server.url}/continue_generation", headers=AUTH).status_code == 200
    _assert_clean(engine)


def test_health_reports_an_engine_that_cannot_make_progress(hf_dir):
    engine = _engine(hf_dir, unhealthy_after_failed_steps=2)
    app = create_app(engine, ServerConfig(max_concurrent_batches=2))
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").text == "ok"
        with _poisoned(engine, position=0):  # every prefill fails
            for _ in range(2):
                r = http.post("/generate", json=_body({"max_new_tokens": 2}))
                assert r.status_code == 500 and "injected fault" in r.json()["error"]
            sick = http.get("/health")
            assert sick.status_code == 503 and "2 engine steps failed in a row" in sick.text
        assert http.post("/generate", json=_body({"max_new_tokens": 2})).status_code == 200
        assert http.get("/health").text == "ok"  # a good step clears it
        lanes = engine.scheduler.lanes
        assert lanes is not None
        leaked = [lanes.acquire(0) for _ in range(lanes.num_lanes)]  # a leak: no lane left
        r = http.post("/generate", json=_body({"max_new_tokens": 2}))  # fails at once, never hangs
        assert r.status_code == 500 and "cannot make progress" in r.json()["error"], r.text
        sick = http.get("/health")
        assert sick.status_code == 503 and "lanes" in sick.text, sick.text
        for lane in leaked:
            lanes.release(lane)
        app.state.worker.stop()
        assert http.get("/health").text == "unhealthy: engine worker thread is not running"


def test_health_reports_a_hung_step(hf_dir):
    engine = _engine(hf_dir, stall_timeout_s=0.2)
    app = create_app(engine, ServerConfig())
    release, real = threading.Event(), engine.model.rope

    def hung(positions: torch.Tensor, end: int):
        release.wait(60)  # a kernel that never returns, until the test lets it
        return real(positions, end)

    engine.model.rope = hung  # type: ignore[method-assign]
    out: dict = {}
    with BackgroundServer(app) as server:
        t = _post_in_background(server.url, _body({"max_new_tokens": 2}), out, "r")
        _wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 503, "the health check to notice")
        assert "no engine step completed for" in httpx.get(f"{server.url}/health").text
        release.set()
        t.join(60)
        assert out["r"].status_code == 200 and httpx.get(f"{server.url}/health").text == "ok"


def test_weight_routes_refuse_bad_updates_in_one_line(hf_dir, tmp_path):
    engine = _engine(hf_dir)
    state = {k: v for f in sorted(hf_dir.glob("*.safetensors")) for k, v in load_file(f).items()}
    files = {
        "shape": {"lm_head.weight": state["lm_head.weight"][:-1].contiguous()},
        "name": {"model.layers.9.mlp.up_proj.weight": state["lm_head.weight"]},
        "dtype": {"lm_head.weight": state["lm_head.weight"].to(torch.int32)},
    }
    for name, tensors in files.items():
        save_file(tensors, tmp_path / f"{name}.safetensors")
    (tmp_path / "text.safetensors").write_text("not a safetensors file")
    (tmp_path / "empty").mkdir()
    cases = [
        ({"model_path": str(tmp_path / "missing"), "weight_version": 1}, 400, "no such file"),
        ({"model_path": str(tmp_path / "empty"), "weight_version": 1}, 400, "no .safetensors"),
        ({"model_path": str(tmp_path / "text.safetensors"), "weight_version": 1}, 400, "not a readable"),
        ({"model_path": str(tmp_path / "shape.safetensors"), "weight_version": 1}, 400, "shape"),
        ({"model_path": str(tmp_path / "name.safetensors"), "weight_version": 1}, 400, "not a parameter"),
        ({"model_path": str(tmp_path / "dtype.safetensors"), "weight_version": 1}, 400, "floating-point"),
        ({"model_path": str(hf_dir), "weight_version": True}, 400, "weight_version"),
        ({"model_path": str(hf_dir), "weight_version": 3}, 200, ""),
        ({"model_path": str(hf_dir), "weight_version": 3}, 200, ""),  # equal: the next bucket
        ({"model_path": str(hf_dir), "weight_version": 2}, 200, ""),  # full updates are authoritative
    ]
    app = create_app(engine, ServerConfig(token=TOKEN))
    prompt = GenerateRequest(input_ids=(5, 6, 7), sampling=_greedy(8))
    before = engine.generate([prompt])[0].output_ids
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, headers=AUTH, timeout=30) as http:
        for body, status, reason in cases:
            r = http.post("/update_weights_from_disk", json=body)
            assert r.status_code == status and reason in r.text and "\n" not in r.text, (body, r.text)
        r = http.post(
            "/update_weights_from_safetensors",
            params={"weight_version": 3},
            content=(tmp_path / "shape.safetensors").read_bytes(),
            headers={"Content-Type": "application/octet-stream"},
        )
        assert r.status_code == 400 and "shape" in r.json()["error"]
        wire = {k: v.to(torch.bfloat16) for k, v in state.items()}
        stale = encode_patch(make_patch(wire, wire, version=8, base_version=7, anchor_version=0))
        r = http.post(
            "/update_weights_from_patch", content=stale, headers={"Content-Type": "application/octet-stream"}
        )
        assert r.status_code == 409 and "based on version 7" in r.json()["error"], r.text
    assert engine.generate([prompt])[0].output_ids == before  # nothing half-applied
    assert engine.model_info()["weight_version"] == 2


# ---- the bounded load test ------------------------------------------------------------------------
def test_concurrent_valid_and_invalid_traffic(hf_dir, caplog):
    """48 requests from 12 client threads over loopback: every valid one (greedy or seeded, some
    compressed) equals the same request served alone, every invalid one gets 4xx with one log line,
    and the engine holds nothing once idle."""
    caplog.set_level(logging.INFO, logger=SERVER_LOG)
    params = [
        SamplingParams(max_new_tokens=20, seed=i, ignore_eos=True) if i % 3 == 0 else _greedy(8 + i % 24)
        for i in range(32)
    ]
    valid = [
        GenerateRequest(input_ids=_prompt(i, 3 + i % 11), sampling=sp, rid=f"v{i}")
        for i, sp in enumerate(params)
    ]
    invalid = [(body, reason) for body, reason in BAD_REQUESTS if "KV pool" not in reason][:16]
    refs = {r.rid: r for r in _alone(hf_dir, valid)}
    engine = _engine(hf_dir, max_running_requests=8, capacity_pages=24)  # retractions under load
    app = create_app(engine, ServerConfig(max_concurrent_batches=4, max_new_tokens=512))

    def send(item: GenerateRequest | tuple[dict, str]) -> tuple[object, httpx.Response]:
        if isinstance(item, GenerateRequest):
            sampling = json.loads(json.dumps(item.sampling.__dict__, default=list))
            body = {"input_ids": list(item.input_ids), "sampling_params": sampling, "rid": item.rid}
        else:
            body = item[0]
        with httpx.Client(base_url=url, timeout=120) as http:
            return item, http.post("/generate", json=body)

    traffic: list = [x for pair in zip(valid, invalid + [None] * 16, strict=True) for x in pair if x]
    with BackgroundServer(app) as server:
        url = server.url
        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(send, traffic))
    for item, r in answers:
        if isinstance(item, GenerateRequest):
            assert r.status_code == 200, r.text
            assert r.json()["output_ids"] == list(refs[item.rid].output_ids), item.rid
        else:
            assert r.status_code == 400 and item[1] in r.json()["error"], (item, r.text)
    rejected = [r for r in caplog.records if r.name == SERVER_LOG and "-> 4" in r.getMessage()]
    assert len(rejected) == len(invalid)
    assert engine.stats()["retractions"] > 0 and engine.stats()["failed_requests"] == 0
    _assert_clean(engine)
