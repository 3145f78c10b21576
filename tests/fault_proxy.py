"""An HTTP proxy in front of one rollout server that injects the faults a cluster has.

Every request is forwarded as it came (method, path, query, body, content type, authorization);
only POST /generate is tampered with: every `fail_every`-th one is answered 502 or 503 in turn
without reaching the server, and the `hang_at`-th one is held `hang_s` seconds (past the client's
timeout) and then dropped. An upstream that does not answer (the server was killed) is a 502, as a
load balancer answers. `served` records when each /generate the server answered 200 came back,
`clients` the client's (host, port) of every /generate (which process sent it: its socket's owner).
`retarget` points it at another server (a worker that came back elsewhere answers at this URL).
"""

from __future__ import annotations

import http.server
import threading
import time

import httpx


class FaultProxy:
    def __init__(self, upstream: str, *, fail_every: int = 0, hang_at: int = 0, hang_s: float = 0.0):
        self.upstream = upstream.rstrip("/")
        self.fail_every, self.hang_at, self.hang_s = fail_every, hang_at, hang_s
        self.generates = 0  # /generate requests seen
        self.injected: list[int] = []  # the status answered for each injected failure (0: a hang)
        self.served: list[float] = []  # monotonic times of /generate answers the server gave
        self.clients: list[tuple[str, int]] = []  # the peer address of every /generate
        self._lock = threading.Lock()
        self._client = httpx.Client(base_url=self.upstream, timeout=120)
        self._retired: list[httpx.Client] = []  # clients of earlier upstreams (`retarget`)
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def retarget(self, upstream: str) -> None:
        """Forward to `upstream` from now on (requests already forwarded finish where they went)."""
        with self._lock:
            self._retired.append(self._client)
            self.upstream = upstream.rstrip("/")
            self._client = httpx.Client(base_url=self.upstream, timeout=120)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        for client in [*self._retired, self._client]:
            client.close()

    def _fault(self, path: str) -> int | None:
        """What to do with this request: None (forward), a status to answer, or 0 (hang)."""
        if path != "/generate":
            return None
        with self._lock:
            self.generates += 1
            n = self.generates
            if self.hang_at and n == self.hang_at:
                self.injected.append(0)
                return 0
            if self.fail_every and n % self.fail_every == 0:
                status = (502, 503)[len(self.injected) % 2]
                self.injected.append(status)
                return status
        return None

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                del args

            def _answer(self, status: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                if status == 503:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(body)

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                path = self.path.split("?", 1)[0]
                if path == "/generate":
                    with proxy._lock:
                        proxy.clients.append(self.client_address[:2])
                fault = proxy._fault(path)
                if fault == 0:
                    time.sleep(proxy.hang_s)
                    self.close_connection = True
                    return
                if fault is not None:
                    self._answer(fault, b'{"error": "injected by the fault proxy"}')
                    return
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")
                }
                try:
                    answer = proxy._client.request(self.command, self.path, content=body, headers=headers)
                except httpx.HTTPError as exc:
                    self._answer(502, f'{{"error": "upstream: {type(exc).__name__}"}}'.encode())
                    return
                if path == "/generate" and answer.status_code == 200:
                    with proxy._lock:
                        proxy.served.append(time.monotonic())
                kind = answer.headers.get("content-type", "application/json")
                self._answer(answer.status_code, answer.content, kind)

            do_GET = do_POST = do_DELETE = _forward

        return Handler
