"""A request hung behind a router is retried without colliding with its abandoned attempt, and
without the router leaving the pool (issue #35 point 1, as measured live by test_sglang_fleet.py).

Real HTTP on loopback: a stand-in SGLang worker that refuses a request id it still runs with
sglang 0.5.23's 400 "Duplicate request ID" and drops an aborted id a moment after
`POST /abort_request` (as its scheduler does), and a stand-in router that forwards /generate to it
and answers 404 on every other POST (sglang-router 0.3.2 does not forward the abort route).
"""

from __future__ import annotations

import http.server
import json
import threading
from collections import Counter

import httpx

from sparserl_mcore.rollout.protocol import GenerateRequest
from sparserl_mcore.sglang.client import SGLangRouter, SGLangWorker
from sparserl_mcore.trainer.engine_pool import EnginePool, PoolConfig

TIMEOUT_S = 2.0  # rollout.request_timeout_s: the router client's and the pool's chunk timeout


class _Server:
    """A threading HTTP server on loopback answering through `handle(method, path, body)`."""

    def __init__(self) -> None:
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _answer(self, method: str) -> None:
                size = int(self.headers.get("content-length") or 0)
                body = json.loads(self.rfile.read(size) or b"null")
                status, answer = owner.handle(method, self.path, body)
                data = json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("content-type", "application/json")
                    self.send_header("content-length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client gave up on it (a held request)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def handle(self, method: str, path: str, body: object) -> tuple[int, object]:
        raise NotImplementedError

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class Worker(_Server):
    """Holds the first request with id `hold` until it is aborted; echoes every other prompt."""

    def __init__(self, hold: str) -> None:
        super().__init__()
        self.hold = hold
        self.running: dict[str, threading.Event] = {}  # ids it runs now, and what ends each
        self.served: Counter[str] = Counter()
        self.aborted: list[str] = []
        self.duplicates = 0
        self._lock = threading.Lock()

    def handle(self, method: str, path: str, body: object) -> tuple[int, object]:
        if method == "GET" and path == "/health":
            return 200, {}
        assert isinstance(body, dict)
        if path == "/abort_request":
            with self._lock:
                self.aborted.append(body["rid"])
            threading.Timer(0.3, self._end, args=(body["rid"],)).start()  # the scheduler's next step
            return 200, {}
        rid, ids = body["rid"], body["input_ids"]
        with self._lock:
            if rid in self.running:
                self.duplicates += 1
                return 400, {"error": {"message": f"Duplicate request ID detected: {rid}"}}
            done = self.running[rid] = threading.Event()
            held = rid == self.hold and not self.aborted
        if held and not done.wait(60):
            raise AssertionError("the held request was never aborted")
        self._end(rid)
        if held:
            return 200, {"output_ids": [], "meta_info": {"id": rid, "finish_reason": {"type": "abort"}}}
        with self._lock:
            self.served[rid] += 1
        meta = {
            "id": rid,
            "finish_reason": {"type": "length"},
            "weight_version": "0",
            "output_token_logprobs": [[-0.5, t, None] for t in ids],
        }
        return 200, {"output_ids": ids, "meta_info": meta}

    def _end(self, rid: str) -> None:
        with self._lock:
            done = self.running.pop(rid, None)
        if done is not None:
            done.set()


class Router(_Server):
    """Forwards POST /generate to its worker as it answers; no abort route (404)."""

    def __init__(self, worker: str) -> None:
        super().__init__()
        self._client = httpx.Client(base_url=worker, timeout=120)

    def handle(self, method: str, path: str, body: object) -> tuple[int, object]:
        if method == "GET" and path == "/health":
            return 200, {}
        if path != "/generate":
            return 404, {"error": "not found"}
        answer = self._client.post("/generate", json=body)
        return answer.status_code, answer.json()

    def close(self) -> None:
        super().close()
        self._client.close()


def test_a_request_hung_behind_the_router_is_retried_once_and_the_router_stays():
    """Before the fix, the retried chunk's held request was refused as a duplicate on every retry
    and the run ended (`NoEngineLeftError`: the chunk out of retries, or the router removed after 3
    failed calls) although its worker was healthy."""
    worker = Worker(hold="r5")
    router = Router(worker.url)
    engine = SGLangRouter(
        router.url,
        concurrency=4,
        chunk_size=2,
        timeout=TIMEOUT_S,
        retries=2,
        backoff_s=0.2,
        workers=[SGLangWorker(worker.url, timeout=10, retries=0)],
    )
    cfg = PoolConfig(chunk_size=2, chunk_timeout_s=TIMEOUT_S, max_attempts=3, retry_backoff_s=0.2)
    events: list[tuple[str, dict]] = []
    pool = EnginePool({router.url: engine}, cfg, lambda kind, fields: events.append((kind, fields)))
    try:
        requests = [GenerateRequest(input_ids=(i + 1, i + 2), rid=f"r{i}") for i in range(8)]
        samples = pool.generate(requests)
        assert [s.rid for s in samples] == [r.rid for r in requests]
        assert [s.output_ids for s in samples] == [r.input_ids for r in requests]
        assert list(pool.live) == [router.url] and not [e for e in events if e[0] == "engine_removed"]
        assert "r5" in worker.aborted  # the abandoned attempt was aborted on the worker
        assert set(worker.served) == {r.rid for r in requests}  # (the retried chunk's r4 twice)
        assert pool.take_requests_retried() >= 1
    finally:
        pool.close()
        router.close()
        worker.close()
