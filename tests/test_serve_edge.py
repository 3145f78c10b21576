"""The HTTP edge of `sparserl serve` against clients that misbehave at the byte level (issue 27),
over real loopback sockets: malformed bodies are 400 however deep they nest, a /generate that is
not JSON is 415, a client that leaves mid-body is one INFO line (never an ERROR 500), and
connections whose client stalls (silent, half a head, half a body, idle between requests) are
closed after the configured timeouts, while a request the server is answering is never cut.

One server for the module: the tiny model's embedded engine, `client_timeout_s` and
`keep_alive_s` shortened to 0.5 s so the timeouts are observed in seconds. Raw sockets send what
an HTTP client library would refuse to send.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from waiting import wait_until

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny
from sparserl_mcore.rollout.engine import EmbeddedEngine, EngineConfig
from sparserl_mcore.rollout.http.server import BackgroundServer, ServerConfig, create_app

TOKEN = "edge-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SERVER_LOG = "sparserl_mcore.rollout.http.server"
TIMEOUT_S = 0.5
GENERATE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2, "temperature": 0}}


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[tuple[str, int]]:
    hf = make_tiny(TinyModelConfig(seed=3), tmp_path_factory.mktemp("edge") / "tiny")
    engine = EmbeddedEngine(hf, EngineConfig(device="cpu", capacity_pages=64))
    cfg = ServerConfig(token=TOKEN, client_timeout_s=TIMEOUT_S, keep_alive_s=TIMEOUT_S)
    with BackgroundServer(create_app(engine, cfg)) as running:
        yield running.url, int(running.url.rsplit(":", 1)[1])


def _connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    return sock


def _closed_by_server(sock: socket.socket) -> float:
    """Seconds until the server closes `sock` (recv returns b"" or the connection is reset);
    whatever the server answers first is read and dropped."""
    started = time.monotonic()
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - started


def _head(path: str, body_len: int, ctype: str = "application/json") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {ctype}\r\n"
        f"Content-Length: {body_len}\r\n\r\n"
    ).encode()


def _logged(caplog, text: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == SERVER_LOG and text in r.getMessage()]


def test_a_body_nested_10000_deep_is_400_on_every_json_route(server):
    url, _ = server
    deep = b"[" * 10_000 + b"]" * 10_000
    inside = b'{"input_ids": ' + deep + b"}"
    with httpx.Client(timeout=30, headers={"Content-Type": "application/json"}) as http:
        for route, body in (("/generate", deep), ("/generate", inside), ("/abort_request", deep)):
            r = http.post(f"{url}{route}", content=body, headers=AUTH)
            assert r.status_code == 400 and r.json() == {"error": "body is not valid JSON: nested too deeply"}
        r = http.post(f"{url}/pause_generation", content=deep, headers=AUTH)
        assert r.status_code == 400 and "nested too deeply" in r.json()["error"]
        assert http.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_generate_with_another_content_type_is_415(server, ctype):
    url, _ = server
    r = httpx.post(f"{url}/generate", json=GENERATE, headers={"Content-Type": ctype}, timeout=30)
    assert r.status_code == 415, r.text
    assert r.json() == {"error": f"content-type {ctype!r}: send the body as application/json"}


def test_json_with_a_charset_or_without_a_content_type_is_served(server):
    url, port = server
    r = httpx.post(
        f"{url}/generate", json=GENERATE, headers={"Content-Type": "application/json; charset=utf-8"}
    )
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 2
    body = httpx.Request("POST", url, json=GENERATE).content
    with _connect(port) as sock:  # no Content-Type header at all, as FastAPI and SGLang accept
        head = (
            f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        answer = b"".join(iter(lambda: sock.recv(65536), b""))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


def test_a_client_that_leaves_mid_body_is_one_info_line(server, caplog):
    url, port = server
    caplog.set_level(logging.INFO, logger=SERVER_LOG)
    with _connect(port) as sock:
        sock.sendall(_head("/generate", 1000) + b'{"input_ids": [5, 6')
        # answered by the same event loop after it took the head above: the handler is reading the body
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
    lines = wait_until(lambda: _logged(caplog, "-> 499"), timeout=30, what="the disconnect logged")
    assert len(lines) == 1 and lines[0].levelno == logging.INFO, [r.getMessage() for r in lines]
    assert "client disconnected before its request body arrived" in lines[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "a disconnect logged as a problem"
    assert httpx.get(f"{url}/health").status_code == 200


def test_a_stalled_body_is_disconnected_after_the_client_timeout(server, caplog):
    _, port = server
    caplog.set_level(logging.INFO, logger=SERVER_LOG)
    with _connect(port) as sock:
        sock.sendall(_head("/generate", 1000) + b'{"input_ids": [5, 6')
        waited = _closed_by_server(sock)
    assert waited >= TIMEOUT_S * 0.8, waited
    stalled = wait_until(lambda: _logged(caplog, "sent no byte of its request body"), timeout=30, what="log")
    assert stalled[0].levelno == logging.INFO and "0.5 s; connection closed" in stalled[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize(
    "sent", [b"", b"POST /generate HTTP/1.1\r\nHost: x\r\n"], ids=["silent", "half-head"]
)
def test_a_connection_without_a_whole_request_head_is_closed(server, sent):
    _, port = server
    with _connect(port) as sock:
        sock.sendall(sent)
        assert _closed_by_server(sock) >= TIMEOUT_S * 0.8


def test_an_idle_keep_alive_connection_is_closed(server):
    _, port = server
    with _connect(port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        assert _closed_by_server(sock) >= TIMEOUT_S * 0.8


def test_a_request_being_answered_is_never_cut(server):
    """/generate waits (generation paused) for longer than the client timeout: a silent connection
    opened with it is closed meanwhile, the waiting request is answered once generation goes on."""
    url, port = server
    with httpx.Client(timeout=60) as http:
        assert (
            http.post(f"{url}/pause_generation", json={"mode": "in_place"}, headers=AUTH).status_code == 200
        )
        answer: dict = {}
        post = lambda: answer.update(r=httpx.post(f"{url}/generate", json=GENERATE, timeout=60))  # noqa: E731
        waiting = threading.Thread(target=post)
        waiting.start()
        wait_until(
            lambda: http.get(f"{url}/get_model_info").json()["pending_requests"] == 1,
            timeout=30,
            what="queued",
        )
        with _connect(port) as silent:  # proof that a client timeout passed while the request waited
            assert _closed_by_server(silent) >= TIMEOUT_S * 0.8
        assert "r" not in answer and waiting.is_alive()
        assert http.post(f"{url}/continue_generation", headers=AUTH).status_code == 200
        waiting.join(60)
    assert answer["r"].status_code == 200 and answer["r"].json()["meta_info"]["completion_tokens"] == 2
