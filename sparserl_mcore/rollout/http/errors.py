"""HTTP answers for what goes wrong while serving: one JSON body and one log line per refusal.

A refusal's cause is the request (or the server's load), not a bug, so it is logged as one line
naming the route, the status and the reason, never with a traceback. Engine failures (5xx) are
logged once with their traceback where they happen (scheduler.py), and here as one line.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from fastapi import FastAPI, HTTPException, Request
from fastapi.exception_handlers import request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from sparserl_mcore.rollout.http.worker import DeadlineExceeded, Overloaded, ShuttingDown
from sparserl_mcore.rollout.protocol import WeightVersionConflict

log = logging.getLogger("sparserl_mcore.rollout.http.server")

RETRY_AFTER_S = 1


class ServeError(Exception):
    """An answer other than 200: status, one-line reason, extra headers."""

    def __init__(self, status: int, reason: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.headers = status, " ".join(reason.split()), headers


def as_serve_error(exc: BaseException) -> ServeError:
    """The HTTP answer for an exception raised while serving a request."""
    if isinstance(exc, ServeError):
        return exc
    if isinstance(exc, ClientDisconnect):  # the client left: routine, nobody reads the answer
        return ServeError(499, "client disconnected")
    if isinstance(exc, WeightVersionConflict):
        return ServeError(409, str(exc))
    if isinstance(exc, ValueError):
        return ServeError(400, str(exc))
    if isinstance(exc, (Overloaded, DeadlineExceeded, ShuttingDown)):
        return ServeError(503, str(exc), {"Retry-After": str(RETRY_AFTER_S)})
    return ServeError(500, f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def answers() -> Iterator[None]:
    """Turn whatever a route's work raises into its HTTP answer (HTTPExceptions pass)."""
    try:
        yield
    except (HTTPException, ServeError):
        raise
    except Exception as exc:
        raise as_serve_error(exc) from None


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal is one JSON answer and one log line (no traceback: the cause is the request)."""

    def logged(request: Request, status: int, reason: str) -> None:
        # a client's mistake is routine, a full server worth a warning, an engine failure an error
        level = logging.INFO if status < 500 else logging.WARNING if status == 503 else logging.ERROR
        log.log(level, "%s %s -> %d: %s", request.method, request.url.path, status, reason)

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, exc: ServeError) -> JSONResponse:
        logged(request, exc.status, exc.reason)
        return JSONResponse({"error": exc.reason}, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(ValueError)
    async def _bad_request(request: Request, exc: ValueError) -> JSONResponse:
        return await _serve_error(request, as_serve_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_exception(request: Request, exc: StarletteHTTPException) -> Response:
        logged(request, exc.status_code, str(exc.detail))
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        logged(request, 422, "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
        return await request_validation_exception_handler(request, exc)
