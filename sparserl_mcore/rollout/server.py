"""SGLang-style HTTP API over any `RolloutEngine` (FastAPI app + uvicorn).

Routes (request/response shapes in docs/rollout.md and `http_wire`):
  POST /generate                         SGLang native generate, single or batch
  GET  /health, GET /get_model_info
  POST /flush_cache, /pause_generation, /continue_generation                      [token]
  POST /update_weights_from_patch        body: sparse sync patch bytes             [token]
  POST /update_weights_from_safetensors  body: safetensors bytes, ?weight_version=N [token]
  POST /update_weights_from_disk         {"model_path": dir|file, "weight_version": N} [token]
[token]: needs `Authorization: Bearer <token>` when the server has a token. Without a token the
server only binds loopback, so nobody else on the network can replace its weights.

Engine work runs on `EngineWorker`'s thread, never on the event loop; a /generate whose client
disconnects is cancelled (see serve_worker) while the other requests carry on.
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
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from sparserl_mcore.rollout.http_wire import Decode, Encode, parse_generate, render_sample
from sparserl_mcore.rollout.protocol import RolloutEngine
from sparserl_mcore.rollout.serve_worker import EngineWorker

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """Where the server listens and who may change its state.

    token: bearer token for the state-changing routes; required when host is not loopback.
    max_batch_requests: most requests the worker puts into one engine.generate call.
    max_concurrent_batches: engine.generate calls in flight at once; > 1 only for engines whose
    generate is thread-safe (EmbeddedEngine), see serve_worker.
    """

    host: str = "127.0.0.1"
    port: int = 30000
    token: str | None = None
    max_batch_requests: int = 256
    max_concurrent_batches: int = 1

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
        for name in ("max_batch_requests", "max_concurrent_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")


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
        engine, max_batch_requests=cfg.max_batch_requests, max_concurrent=cfg.max_concurrent_batches
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(worker.stop)

    app = FastAPI(title="sparserl serve", lifespan=lifespan)
    app.state.worker = worker
    auth = _bearer_auth(cfg.token)

    @app.exception_handler(ValueError)
    async def _bad_request(_: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse({"error": str(exc)}, status_code=400)

    @app.get("/health")
    async def health() -> PlainTextResponse:
        if not worker.alive:
            return PlainTextResponse("engine worker is not running", status_code=503)
        return PlainTextResponse("ok")

    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        # Read-only: answered while batches run (a control job would wait for them to finish).
        info = dict(await asyncio.to_thread(engine.model_info))
        info.setdefault("is_generation", True)
        info["paused"] = worker.paused
        return info

    @app.post("/generate")
    async def generate(request: Request) -> Any:
        parsed = parse_generate(await _json(request), encode)
        job = worker.submit_generate(parsed.requests)
        samples = await _await_or_cancel(request, job.future, lambda: worker.cancel(job))
        out = [
            render_sample(
                s,
                return_logprob=parsed.return_logprob,
                return_text_in_logprobs=parsed.return_text_in_logprobs,
                decode=decode,
            )
            for s in samples
        ]
        return out if parsed.batch else out[0]

    @app.post("/flush_cache", dependencies=[Depends(auth)])
    async def flush_cache() -> dict[str, Any]:
        await _control(worker, lambda e: e.flush_cache())
        return {"success": True, "message": "prefix cache flushed"}

    @app.post("/pause_generation", dependencies=[Depends(auth)])
    async def pause_generation() -> dict[str, Any]:
        await asyncio.to_thread(worker.pause)
        return {"success": True, "message": "generation paused"}

    @app.post("/continue_generation", dependencies=[Depends(auth)])
    async def continue_generation() -> dict[str, Any]:
        await asyncio.to_thread(worker.resume)
        return {"success": True, "message": "generation continued"}

    @app.post("/abort_request", dependencies=[Depends(auth)])
    async def abort_request(request: Request) -> dict[str, Any]:
        # Straight to the engine, not a control job: that would wait for the batch to finish.
        body = await _json(request)
        rid = body.get("rid") if isinstance(body, dict) else None
        if not isinstance(rid, str) or not rid:
            raise ValueError('abort_request needs a JSON object {"rid": "<request id>"}')
        await asyncio.to_thread(engine.abort, rid)
        return {"success": True, "message": f"request {rid!r} aborted if it was in flight"}

    _add_weight_routes(app, worker, auth)
    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one), so the caller knows the port before serving."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def make_uvicorn(app: FastAPI, *, log_level: str = "info") -> uvicorn.Server:
    """The uvicorn server for `app`; run it with `.run(sockets=[bind_socket(...)])`."""
    return uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))


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
    @app.post("/update_weights_from_patch", dependencies=[Depends(auth)])
    async def update_weights_from_patch(request: Request) -> dict[str, Any]:
        patch = await _octets(request)
        version = await _control(worker, lambda e: e.apply_patch(patch))
        return {"success": True, "weight_version": int(version)}

    @app.post("/update_weights_from_safetensors", dependencies=[Depends(auth)])
    async def update_weights_from_safetensors(request: Request, weight_version: int) -> dict[str, Any]:
        from safetensors.torch import load

        state = _safetensors_or_400(load, await _octets(request))
        await _control(worker, lambda e: e.update_weights(state, weight_version))
        return {"success": True, "weight_version": weight_version, "tensors": len(state)}

    @app.post("/update_weights_from_disk", dependencies=[Depends(auth)])
    async def update_weights_from_disk(request: Request) -> dict[str, Any]:
        body = await _json(request)
        if not isinstance(body, dict) or set(body) != {"model_path", "weight_version"}:
            raise ValueError('body must be {"model_path": str, "weight_version": int}')
        path, version = Path(str(body["model_path"])), body["weight_version"]
        if not isinstance(version, int):
            raise ValueError(f"weight_version must be an int, got {version!r}")
        state = await asyncio.to_thread(_read_safetensors_path, path)
        await _control(worker, lambda e: e.update_weights(state, version))
        return {"success": True, "weight_version": version, "tensors": len(state)}


def _bearer_auth(token: str | None) -> Callable[..., None]:
    def check(request: Request) -> None:
        if token is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong token: send Authorization: Bearer <token>")

    return check


async def _json(request: Request) -> Any:
    try:
        return await request.json()
    except ValueError as exc:
        raise ValueError(f"body is not valid JSON: {exc}") from None


async def _octets(request: Request) -> bytes:
    ctype = request.headers.get("content-type", "")
    if not ctype.startswith("application/octet-stream"):
        raise HTTPException(415, f"content-type {ctype!r}: send the bytes as application/octet-stream")
    body = await request.body()
    if not body:
        raise ValueError("empty body")
    return body


def _safetensors_or_400(load: Callable[[bytes], dict[str, Any]], data: bytes) -> dict[str, Any]:
    try:
        return load(data)
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"body is not a safetensors file: {exc}") from None


def _read_safetensors_path(path: Path) -> dict[str, Any]:
    """Every tensor of a .safetensors file, or of all *.safetensors files in a directory."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise ValueError(f"model_path={str(path)!r}: no .safetensors file there")
    state: dict[str, Any] = {}
    for f in files:
        state.update(load_file(f))
    return state


async def _control(worker: EngineWorker, fn: Callable[[RolloutEngine], Any]) -> Any:
    return await asyncio.wrap_future(await asyncio.to_thread(worker.control, fn))


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
