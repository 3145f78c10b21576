"""`sparserl serve` cannot be stalled by a large request (issue 36).

A 10 MB prompt once held the event loop for 29 s (read whole, then tokenized on the loop), and
/health with it. Now a body over `--max-body-bytes` is answered 413 before the rest is read (from
its Content-Length, or once that many bytes of a chunked body arrived), and a large prompt under
the limit is tokenized on a thread of its own while /health keeps answering. The weight routes
take bodies of any size. One real `sparserl serve` process (the CLI) on a tiny model, over
loopback; /health is timed beside each large request.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from e2e_support import PY, free_port, subprocess_env

from sparserl_mcore.ckpt.tiny import TinyModelConfig, make_tiny

LIMIT = 1_000_000  # --max-body-bytes
HEALTH_BOUND_S = 3.0  # generous for a loaded 2-core box; the 10 MB prompt held /health for 29 s


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    hf = make_tiny(TinyModelConfig(), tmp_path_factory.mktemp("serve") / "tiny")
    port = free_port()
    cmd = [PY, "-m", "sparserl_mcore", "serve", "--hf-dir", str(hf), "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--max-body-bytes", str(LIMIT), "--log-level", "warning"],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the CLI prints this line once the socket listens
            if "listening on" in line:
                break
        else:
            pytest.fail(f"sparserl serve exited with {proc.wait()}")
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(url)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"{url}/health never answered 200")


def _beside_health(
    url: str, request: Callable[[], httpx.Response]
) -> tuple[httpx.Response, float, list[float]]:
    """`request()` on this thread while another times GET /health over and over: its answer, how
    long it took, and each /health latency (every one of them a 200)."""
    done, latencies = threading.Event(), []

    def poll() -> None:
        with httpx.Client(timeout=60) as client:
            while not done.is_set():
                start = time.monotonic()
                assert client.get(f"{url}/health").status_code == 200
                latencies.append(time.monotonic() - start)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.1)  # the first /health is in before the large request starts
    start = time.monotonic()
    try:
        answer = request()
    finally:
        took = time.monotonic() - start
        done.set()
        poller.join()
    return answer, took, latencies


def _generate(url: str, content: bytes | Iterator[bytes]) -> Callable[[], httpx.Response]:
    headers = {"content-type": "application/json"}
    return lambda: httpx.post(f"{url}/generate", content=content, headers=headers, timeout=120)


def test_a_10mb_prompt_is_refused_413_and_health_answers_beside_it(server):
    body = json.dumps({"text": "a" * 10_000_000, "sampling_params": {"max_new_tokens": 4}}).encode()
    answer, took, latencies = _beside_health(server, _generate(server, body))
    assert answer.status_code == 413
    assert answer.json()["error"] == (
        f"request body of {len(body)} bytes is over this server's limit of {LIMIT} bytes "
        "(sparserl serve --max-body-bytes); send fewer or shorter prompts per request"
    )
    assert latencies and max(latencies) < HEALTH_BOUND_S, (took, latencies)


def test_a_chunked_body_is_cut_off_at_the_limit(server):
    def chunks() -> Iterator[bytes]:  # no Content-Length: the server counts what arrives
        for _ in range(100):
            yield b" " * 100_000

    answer = _generate(server, chunks())()
    assert answer.status_code == 413
    assert f"request body of more than {LIMIT} bytes is over" in answer.json()["error"]


def test_a_large_prompt_is_tokenized_off_the_event_loop(server):
    """300 KB of text is under the limit and is tokenized (seconds here), then refused for the
    context length; /health answers all along, not only once the tokenizer is done."""
    body = json.dumps({"text": "hello world " * 25_000, "sampling_params": {"max_new_tokens": 4}}).encode()
    assert len(body) < LIMIT
    answer, took, latencies = _beside_health(server, _generate(server, body))
    assert answer.status_code == 400 and "the model's context length is 2048" in answer.json()["error"]
    assert len(latencies) >= 3 and max(latencies) < min(took / 2, HEALTH_BOUND_S), (took, latencies)


def test_weight_routes_take_bodies_over_the_limit(server):
    """A weight update carries a model's weights: refused for what it is, never for its size."""
    answer = httpx.post(
        f"{server}/update_weights_from_patch",
        content=b"x" * (LIMIT + 1),
        headers={"content-type": "application/octet-stream"},
        timeout=120,
    )
    assert answer.status_code == 400 and "patch" in answer.json()["error"]


def test_a_too_small_limit_is_refused_by_the_cli(capsys, tmp_path):
    from sparserl_mcore.cli import main

    assert main(["serve", "--hf-dir", str(Path(tmp_path)), "--max-body-bytes", "0"]) == 2
    assert "--max-body-bytes: 0: must be >= 1" in capsys.readouterr().err
