"""SGLang-style HTTP API over any `RolloutEngine` (FastAPI app + uvicorn).

Routes (request/response shapes in docs/rollout.md and `http_wire`):
  POST /generate                         SGLang native generate, single or batch
  GET  /health, GET /get_model_info
  POST /flush_cache, /pause_generation, /continue_generation, /abort_request        [token]
  POST /update_weights_from_patch        body: sparse sync patch bytes             [token]
  POST /update_weights_from_safetensors  body: safetensors bytes, ?weight_version=N [token]
  POST /update_weights_from_disk         {"model_path": dir|file, "weight_version": N} [token]
[token]: needs `Authorization: Bearer <token>` when the server has a token. Without a token the
server only binds loopback, so nobody else on the network can replace its weights.

Every request is validated here, before it reaches the engine (body type and JSON, sampling
contract, vocabulary, context length, the operator's limits); a refusal is one 4xx answer
`{"error": reason}` and one log line. Engine work runs on `EngineWorker`'s thread, never on the
event loop; a /generate whose client disconnects is cancelled (see serve_worker) while the other
requests carry on, and a client that leaves mid-body is one INFO line, not an error. A client that
stalls (no request head, or half a body, for `client_timeout_s`) is disconnected (`http_timeouts`).
A body over `max_body_bytes` is answered 413 before the rest is read (`bodies`). Parsing a
/generate body, tokenizing its text and decoding its answers run on one tokenizer thread (HF
tokenizers are not safe to call from several threads at once), never on the event loop: a 10 MB
prompt once held /health for 29 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import PlainTextResponse

from sparserl_mcore.rollout.http.bodies import loads, read_body, read_json, read_json_body, read_octets
from sparserl_mcore.rollout.http.errors import add_error_handlers, answers
from sparserl_mcore.rollout.http.timeouts import stall_timeout_protocol
from sparserl_mcore.rollout.http.wire import (
    Decode,
    Encode,
    ParsedGenerate,
    parse_generate,
    parse_pause,
    render_sample,
)
from sparserl_mcore.rollout.http.worker import EngineWorker
from sparserl_mcore.rollout.protocol import RequestLimits, RolloutEngine

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Where the server listens, who may change its state, and how much work it accepts.

    token: bearer token for the state-changing routes; required when host is not loopback.
    max_batch_requests: most requests the worker puts into one engine.generate call.
    max_concurrent_batches: engine.generate calls in flight at once; > 1 only for engines whose
    generate is thread-safe (EmbeddedEngine), see serve_worker.
    max_new_tokens: cap on a request's max_new_tokens (None: only the context length bounds it).
    max_pending_requests: requests accepted and not yet answered; more get 503 + Retry-After.
    request_timeout_s: a request not started by then fails (503), a running one is aborted and
    returns what it generated (finish_reason abort). None: no deadline.
    max_body_bytes: the largest request body of every route but the weight updates; a larger one is
    answered 413 before the rest is read (None: no limit).
    client_timeout_s: a connection whose client owes bytes (a new connection's first request head,
    the rest of a head or of a body) and sends none for this long is closed. keep_alive_s: an idle
    connection between requests is closed after this long (uvicorn's timeout_keep_alive).
    """

    host: str = "127.0.0.1"
    port: int = 30000
    token: str | None = None
    max_batch_requests: int = 256
    max_concurrent_batches: int = 1
    max_new_tokens: int | None = None
    max_pending_requests: int | None = 4096
    request_timeout_s: float | None = 3600.0
    max_body_bytes: int | None = 8 * 2**20
    client_timeout_s: float = 60.0
    keep_alive_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port}: must be in [0, 65535] (0 picks a free port)")
        if self.token is not None and len(self.token) < 8:
            raise ValueError("token is shorter than 8 characters; use a long random string")
        if self.token is None and not is_loopback(self.host):
            raise ValueError(
                f"host={self.host!r} is reachable from the network but no token is set: pass --token "
                "(or SPARSERL_SERVE_TOKEN) so only the trainer can update weights, or bind 127.0.0.1"
            )
        for name in (
            "max_batch_requests",
            "max_concurrent_batches",
            "max_new_tokens",
            "max_pending_requests",
            "max_body_bytes",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s}: must be > 0 seconds (or None)")
        for name in ("client_timeout_s", "keep_alive_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{name}={value}: must be > 0 seconds")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def create_app(
    engine: RolloutEngine,
    cfg: ServerConfig,
    *,
    encode: Encode | None = None,
    decode: Decode | None = None,
) -> FastAPI:
    """The ASGI app; the engine worker starts and stops with the app's lifespan."""
    worker = EngineWorker(
        engine,
        max_batch_requests=cfg.max_batch_requests,
        max_concurrent=cfg.max_concurrent_batches,
        max_pending_requests=cfg.max_pending_requests,
        request_timeout_s=cfg.request_timeout_s,
    )
    limits, has_tokenizer = _request_limits(engine.model_info(), cfg)
    tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sparserl-tokenizer")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)
            tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    def parse(body: bytes) -> ParsedGenerate:
        parsed = parse_generate(loads(body), encode)
        for req in parsed.requests:
            limits.check(req)
            if req.sampling.stop and not has_tokenizer:
                raise ValueError(
                    "stop strings need the model's tokenizer, which it lacks; use stop_token_ids"
                )
        return parsed

    def render(parsed: ParsedGenerate, samples: list[Any], message: str) -> list[dict[str, Any]]:
        return [
            render_sample(
                s,
                return_logprob=parsed.return_logprob,
                return_text_in_logprobs=parsed.return_text_in_logprobs,
                decode=decode,
                abort_message=message,
            )
            for s in samples
        ]

    async def on_tokenizer_thread(fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(tokenizer_thread, fn, *args)

    app = FastAPI(title="sparserl serve", lifespan=lifespan)
    app.state.worker = worker
    app.state.config = cfg  # make_uvicorn reads the connection timeouts
    add_error_handlers(app)
    auth = _bearer_auth(cfg.token)

    @app.get("/health")
    async def health() -> PlainTextResponse:
        problem = None if worker.alive else "engine worker thread is not running"
        check = getattr(engine, "health_problem", None)
        problem = problem or (check() if check is not None else None)
        if problem:
            return PlainTextResponse(f"unhealthy: {problem}", status_code=503)
        return PlainTextResponse("ok")

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        # Read-only: answered while batches run.
        info = dict(await asyncio.to_thread(engine.model_info))
        info.setdefault("is_generation", True)
        info["paused"] = worker.paused
        info["pending_requests"] = worker.pending_requests
        info["server_limits"] = dataclasses.asdict(limits)
        return info

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        with answers():
            parsed = await on_tokenizer_thread(parse, await read_json_body(request))
            job = worker.submit_generate(parsed.requests)
            samples = await _await_or_cancel(request, job.future, lambda: worker.cancel(job))
            message = f"deadline of {cfg.request_timeout_s:g} s passed" if job.expired else "request aborted"
            out = await on_tokenizer_thread(render, parsed, samples, message)
        return out if parsed.batch else out[0]

    @app.post("/flush_cache", dependencies=[Depends(auth)])
    async def flush_cache() -> dict[str, Any]:
        with answers():
            await asyncio.to_thread(worker.control, lambda e: e.flush_cache(), pause_mode="in_place")
        return {"success": True, "message": "prefix cache flushed"}

    @app.post("/pause_generation", dependencies=[Depends(auth)])
    async def pause_generation(request: Request) -> dict[str, Any]:
        with answers():
            mode = parse_pause(await read_body(request))
            await asyncio.to_thread(worker.pause, mode)
        return {"success": True, "message": f"generation paused ({mode})"}

    @app.post("/continue_generation", dependencies=[Depends(auth)])
    async def continue_generation() -> dict[str, Any]:
        await asyncio.to_thread(worker.resume)
        # how long generation stood still (engines that measure it): the in-flight update's cost
        paused_ms = getattr(engine, "last_pause_ms", None)
        return {"success": True, "message": "generation continued", "paused_ms": paused_ms}

    @app.post("/abort_request", dependencies=[Depends(auth)])
    async def abort_request(request: Request) -> dict[str, Any]:
        # Straight to the engine: it lands at the next step boundary.
        with answers():
            body = await read_json(request)
            rid = body.get("rid") if isinstance(body, dict) else None
            if not isinstance(rid, str) or not rid:
                raise ValueError('abort_request needs a JSON object {"rid": "<request id>"}')
            await asyncio.to_thread(engine.abort, rid)
        return {"success": True, "message": f"request {rid!r} aborted if it was in flight"}

    _add_weight_routes(app, worker, auth)
    return app


def _request_limits(info: dict[str, Any], cfg: ServerConfig) -> tuple[RequestLimits, bool]:
    """The engine's request limits (EmbeddedEngine's model_info carries them) plus the server's cap,
    and whether the engine can match stop strings (it has a tokenizer)."""
    own = info.get("request_limits") or {"vocab_size": info.get("vocab_size")}
    limits = dataclasses.replace(RequestLimits(**own), max_new_tokens=cfg.max_new_tokens)
    return limits, info.get("tokenizer_path", "") is not None


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one), so the caller knows the port before serving."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def make_uvicorn(app: FastAPI, *, log_level: str = "info") -> uvicorn.Server:
    """The uvicorn server for `app` with the connection timeouts of its `ServerConfig`; run it with
    `.run(sockets=[bind_socket(...)])`."""
    cfg = getattr(app.state, "config", None) or ServerConfig()
    config = uvicorn.Config(
        app,
        log_level=log_level,
        timeout_graceful_shutdown=5,
        http=stall_timeout_protocol(cfg.client_timeout_s),
        timeout_keep_alive=cfg.keep_alive_s,  # type: ignore[arg-type]  # uvicorn annotates int
    )
    return uvicorn.Server(config)


class BackgroundServer:
    """uvicorn serving `app` on a background thread (tests, in-process demos); a context manager.

    Binds before starting, so `url` is known at once (port 0 picks a free port); `__enter__`
    returns once the server accepts connections.
    """

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self._sock = bind_socket(host, port)
        bound_host, bound_port = self._sock.getsockname()[:2]
        self.url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}"
        self._server = make_uvicorn(app, log_level=log_level)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="sparserl-http", daemon=True
        )

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"HTTP server on {self.url} exited during startup")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()


def _add_weight_routes(app: FastAPI, worker: EngineWorker, auth: Callable[..., None]) -> None:
    """Weight updates run between engine steps with in-flight requests retracted (serve_worker)."""

    async def update(fn: Callable[[RolloutEngine], Any]) -> Any:
        with answers():
            return await asyncio.to_thread(worker.control, fn, pause_mode="retract")

    @app.post("/update_weights_from_patch", dependencies=[Depends(auth)])
    async def update_weights_from_patch(request: Request) -> dict[str, Any]:
        patch = await read_octets(request)
        own_pause = not worker.paused  # else the explicit pause's clock, at /continue_generation
        version = await update(lambda e: e.apply_patch(patch))
        pause_ms = getattr(worker.engine, "last_pause_ms", None) if own_pause else None
        return {"success": True, "weight_version": int(version), "pause_ms": pause_ms}

    @app.post("/update_weights_from_safetensors", dependencies=[Depends(auth)])
    async def update_weights_from_safetensors(request: Request, weight_version: int) -> dict[str, Any]:
        from safetensors.torch import load

        _check_version(weight_version)
        state = _safetensors_or_400(load, await read_octets(request))
        await update(lambda e: e.update_weights(state, weight_version))
        return {"success": True, "weight_version": weight_version, "tensors": len(state)}

    @app.post("/update_weights_from_disk", dependencies=[Depends(auth)])
    async def update_weights_from_disk(request: Request) -> dict[str, Any]:
        body = await read_json(request)
        if not isinstance(body, dict) or set(body) != {"model_path", "weight_version"}:
            raise ValueError('body must be {"model_path": str, "weight_version": int}')
        path, version = body["model_path"], body["weight_version"]
        if not isinstance(path, str) or not path:
            raise ValueError(f"model_path must be a non-empty string, got {path!r}")
        _check_version(version)
        state = await asyncio.to_thread(_read_safetensors_path, Path(path))
        await update(lambda e: e.update_weights(state, version))
        return {"success": True, "weight_version": version, "tensors": len(state)}


def _check_version(version: Any) -> None:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"weight_version must be an integer >= 0, got {version!r}")


def _bearer_auth(token: str | None) -> Callable[..., None]:
    def check(request: Request) -> None:
        if token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong token: send Authorization: Bearer <token>")

    return check


def _safetensors_or_400(load: Callable[[bytes], dict[str, Any]], data: bytes) -> dict[str, Any]:
    try:
        return load(data)
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"body is not a safetensors file: {exc}") from None


def _read_safetensors_path(path: Path) -> dict[str, Any]:
    """Every tensor of a .safetensors file, or of all *.safetensors files in a directory."""
    from safetensors.torch import load_file

    if not path.exists():
        raise ValueError(f"model_path={str(path)!r}: no such file or directory on the server")
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"model_path={str(path)!r}: no .safetensors file there")
    state: dict[str, Any] = {}
    for f in files:
        try:
            state.update(load_file(f))
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"model_path={str(f)!r}: not a readable safetensors file ({exc})") from None
    return state


async def _await_or_cancel(request: Request, future: Future[Any], cancel: Callable[[], None]) -> Any:
    """Wait for the worker's result; if the client disconnects first (or the server cancels the
    handler at shutdown), cancel its job."""
    waiter = asyncio.wrap_future(future)
    try:
        while True:
            done, _ = await asyncio.wait({waiter}, timeout=DISCONNECT_POLL_S)
            if done:
                return waiter.result()
            if await request.is_disconnected():
                log.info("client disconnected; cancelling its generate job")
                cancel()
                raise HTTPException(499, "client disconnected")
    except asyncio.CancelledError:
        cancel()
        raise
