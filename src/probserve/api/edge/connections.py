"""Connection guards below ASGI: a deadline for a request's headers, on either HTTP parser.

uvicorn bounds idle keep-alive connections, but not a client that starts a request and never
finishes its headers (slowloris): such a connection would stay open forever, unauthenticated.
`guarded_protocol` wraps uvicorn's protocol class, httptools' (C) where it is installed or h11's
(pure Python), so that every request's headers get `header_timeout` seconds from their first
byte (from the connection's opening for the first request), after which the connection is
closed. The body has its own deadline (middleware.BodyLimitMiddleware) and the number of
connections is bounded by uvicorn's `limit_concurrency` (`--max-connections`).

The guard reads only what both protocol classes share: `cycle` (the current request's
RequestResponseCycle, replaced when a request's headers are complete; `response_complete` once
it is answered), `loop` and `transport`, and wraps `connection_made`, `data_received` and
`connection_lost`. tests/test_connections.py fails if either class stops working that way.
"""

from __future__ import annotations

import asyncio
import importlib.util
from typing import Any, Literal

from uvicorn.protocols.http.h11_impl import H11Protocol

HttpParser = Literal["auto", "httptools", "h11"]


class HeaderDeadline(asyncio.Protocol):
    """Mixed in before a uvicorn protocol class (`guarded_protocol`)."""

    header_timeout: float = 10.0  # set per server by `guarded_protocol`
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._waiting_after: object = None  # the cycle current when the timer was armed

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()  # nothing sent yet: the first request's headers are due

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._header_timer is not None:
            if self.cycle is not self._waiting_after:
                self._disarm()  # the awaited request's headers are complete
        elif data and self._between_requests():
            self._arm()  # the bytes of a request whose headers are not complete yet

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        # no request yet, or the last one answered: bytes now begin the next request (bytes
        # while a request is in flight are its body, under the body deadline)
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._header_timer is None:
            self._waiting_after = self.cycle
            self._header_timer = self.loop.call_later(self.header_timeout, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if self.cycle is self._waiting_after and not self.transport.is_closing():
            self.transport.close()


def protocol_class(parser: HttpParser) -> type[asyncio.Protocol]:
    """uvicorn's protocol class for `parser`; `auto` is httptools where it is installed."""
    if parser == "auto":
        parser = "httptools" if importlib.util.find_spec("httptools") else "h11"
    if parser == "httptools":
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    return H11Protocol


def guarded_protocol(header_timeout: float, parser: HttpParser = "auto") -> type[asyncio.Protocol]:
    """The protocol class for one server: `parser`'s, with its header deadline."""
    base = protocol_class(parser)
    name = f"Guarded{base.__name__}"
    return type(name, (HeaderDeadline, base), {"header_timeout": header_timeout})
