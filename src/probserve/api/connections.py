"""Connection guards below ASGI: a deadline for a request's headers.

uvicorn bounds idle keep-alive connections, but not a client that starts a request and never
finishes its headers (slowloris): such a connection would stay open forever, unauthenticated.
`GuardedH11Protocol` gives every request's headers `header_timeout` seconds from its first byte
(from the connection's opening for the first request) and then closes the connection. The body
has its own deadline (middleware.BodyLimitMiddleware) and the number of connections is bounded
by uvicorn's `limit_concurrency` (`--max-connections`).
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    header_timeout: float = 10.0  # set per server by `guarded_protocol`

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and data:
            self._arm()  # bytes of a request whose headers are not complete yet
        else:
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def guarded_protocol(header_timeout: float) -> type[GuardedH11Protocol]:
    """The protocol class for one server, with its header deadline."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout": header_timeout})
