"""Reading request bodies: the size limit, the media type and the JSON of every route.

A body over the server's `max_body_bytes` (`ServerConfig`) is answered 413 as soon as that is known,
from its Content-Length or once that many bytes arrived, and the rest is never read; the weight
routes (`read_octets`), behind the token, take a model's weights and are not limited. A client that
leaves mid-body is a 499, logged at INFO.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from sparserl_mcore.rollout.http.errors import ServeError


async def read_body(request: Request, *, limited: bool = True) -> bytes:
    """The request body, or 413 once it is known to exceed the server's `max_body_bytes` (from
    its Content-Length, or when that many bytes arrived): the rest is never read."""
    limit = request.app.state.config.max_body_bytes if limited else None
    declared = request.headers.get("content-length", "")
    if limit is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(f"request body of {int(declared)} bytes", limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if limit is not None and size > limit:
                raise _too_large(f"request body of more than {limit} bytes", limit)
            chunks.append(chunk)
    except ClientDisconnect:  # routine: logged at INFO by the error handler, nobody reads the answer
        raise ServeError(499, "client disconnected before its request body arrived") from None
    return b"".join(chunks)


def _too_large(what: str, limit: int) -> ServeError:
    return ServeError(
        413,
        f"{what} is over this server's limit of {limit} bytes "
        "(sparserl serve --max-body-bytes); send fewer or shorter prompts per request",
    )


def _media_type(request: Request) -> str | None:
    ctype = request.headers.get("content-type")
    return ctype.split(";")[0].strip().lower() if ctype is not None else None


async def read_json(request: Request) -> Any:
    """The parsed JSON body (`read_json_body`, `loads`)."""
    return loads(await read_json_body(request))


async def read_json_body(request: Request) -> bytes:
    """The bytes of a JSON body: application/json (or +json; a request without a Content-Type is
    read as JSON too, as FastAPI and SGLang do), anything else 415."""
    media = _media_type(request)
    if media is not None and media != "application/json" and not media.endswith("+json"):
        raise ServeError(415, f"content-type {media!r}: send the body as application/json")
    return await read_body(request)


def loads(body: bytes) -> Any:
    """A JSON body, parsed; 400 when it does not parse."""
    try:
        return json.loads(body)
    except RecursionError:
        raise ValueError("body is not valid JSON: nested too deeply") from None
    except ValueError as exc:
        raise ValueError(f"body is not valid JSON: {exc}") from None


async def read_octets(request: Request) -> bytes:
    """The non-empty application/octet-stream body of a weight route, of any size."""
    if _media_type(request) != "application/octet-stream":
        ctype = request.headers.get("content-type", "")
        raise ServeError(415, f"content-type {ctype!r}: send the bytes as application/octet-stream")
    body = await read_body(request, limited=False)  # a model's weights, behind the token
    if not body:
        raise ValueError("empty body")
    return body
