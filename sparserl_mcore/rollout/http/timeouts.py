"""Connections whose client stalls: closed after `client_timeout_s` without a byte it owes.

uvicorn (h11) closes an idle keep-alive connection between requests (`timeout_keep_alive`), but it
waits forever for the first request on a new connection, for the rest of a request head, and for
the rest of a body whose client stopped sending (a half-open request): each holds a socket, and a
stalled body also holds a request handler. `StallTimeoutH11` is uvicorn's h11 protocol plus one
timer, re-armed by every byte received; when it fires while the client owes bytes (no complete
request head yet, or the body is incomplete) and the server is not the one holding back (reading
paused for flow control), the connection is closed: a handler waiting for the body sees a client
disconnect. While a request is being answered the client owes nothing and the timer does nothing,
so a long generation is never cut.

    config = uvicorn.Config(app, http=stall_timeout_protocol(30.0), timeout_keep_alive=5)
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("sparserl_mcore.rollout.http.server")


class StallTimeoutH11(H11Protocol):
    """uvicorn's h11 protocol with the stall timer of the module docstring."""

    def __init__(self, *args: Any, client_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.client_timeout_s = client_timeout_s
        self._stall: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        self._arm()
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._stall = self.loop.call_later(self.client_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _expire(self) -> None:
        self._stall = None
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state not in (h11.IDLE, h11.SEND_BODY):  # the request is in; the server is answering
            return
        if self.flow is not None and self.flow.read_paused:  # we hold the client back, not it us
            self._arm()
            return
        if state is h11.SEND_BODY:
            where = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            log.info(
                "%s sent no byte of its request body for %g s; connection closed",
                where,
                self.client_timeout_s,
            )
        self.transport.close()


def stall_timeout_protocol(client_timeout_s: float) -> Any:
    """The `http=` argument of `uvicorn.Config` for this timeout."""
    if not client_timeout_s > 0:
        raise ValueError(f"client_timeout_s={client_timeout_s}: must be > 0 seconds")
    return functools.partial(StallTimeoutH11, client_timeout_s=client_timeout_s)
