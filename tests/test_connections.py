"""The header deadline on both of uvicorn's HTTP parsers (api/edge/connections.py): slowloris
clients cut off, honest ones (slow answers, keep-alive, pipelining) served, and the uvicorn
internals the guard reads checked, so that a uvicorn release that changes them fails here."""

from __future__ import annotations

import asyncio
import inspect
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from probserve.api.edge.connections import HeaderDeadline, guarded_protocol, protocol_class
from probserve.api.edge.server import uvicorn_config
from probserve.api.server.limits import HttpLimits

DEADLINE = 0.4
PARSERS = {"h11": H11Protocol, "httptools": HttpToolsProtocol}


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/slow":
        await asyncio.sleep(3 * DEADLINE)  # an answer slower than the header deadline
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(params=sorted(PARSERS), scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[tuple[uvicorn.Server, int, str]]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = uvicorn_config(app, HttpLimits(header_timeout=DEADLINE), "127.0.0.1", port,
                            parser=request.param)  # fmt: skip
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "no server"
        time.sleep(0.02)
    yield srv, port, request.param
    srv.should_exit = True
    thread.join(30)


def _closed(s: socket.socket) -> bool:
    """True once the server has closed the connection (read until EOF or a reset)."""
    s.settimeout(20)
    try:
        while s.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def _answer(s: socket.socket, request: bytes) -> bytes:
    s.sendall(request)
    s.settimeout(20)
    got = b""
    while not got.endswith(b"\r\n\r\nok"):
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    return got


GET = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


def test_the_parser_is_the_one_asked(server: tuple[uvicorn.Server, int, str]) -> None:
    srv, _, parser = server
    assert issubclass(srv.config.http, PARSERS[parser])  # type: ignore[arg-type]
    assert issubclass(srv.config.http, HeaderDeadline)  # type: ignore[arg-type]
    assert protocol_class("auto") is HttpToolsProtocol  # installed with probserve


def test_a_client_that_sends_nothing_is_cut_off(server: tuple[uvicorn.Server, int, str]) -> None:
    with socket.create_connection(("127.0.0.1", server[1])) as s:
        assert _closed(s)


def test_headers_dribbled_past_the_deadline_are_cut_off(
    server: tuple[uvicorn.Server, int, str],
) -> None:
    dribble = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"y" * 400  # 20 s at 20 bytes/s
    sent = 0
    with socket.create_connection(("127.0.0.1", server[1])) as s:
        try:
            for byte in dribble:
                s.send(bytes([byte]))
                sent += 1
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed by the server while the client was still sending
    assert sent < len(dribble)


def test_a_kept_alive_connection_gets_the_deadline_for_its_next_request(
    server: tuple[uvicorn.Server, int, str],
) -> None:
    srv, port, _ = server
    with socket.create_connection(("127.0.0.1", port)) as s:
        assert _answer(s, GET).startswith(b"HTTP/1.1 200")
        # the uvicorn internals the guard reads, as it finds them between two requests
        (conn,) = [c for c in srv.server_state.connections if isinstance(c, HeaderDeadline)]
        assert type(conn.cycle).__name__ == "RequestResponseCycle"
        assert conn.cycle.response_complete is True
        assert conn._header_timer is None
        s.sendall(b"GET / HTTP/1.1\r\nHost")  # the next request's headers, never finished
        assert _closed(s)


def test_honest_clients_are_served(server: tuple[uvicorn.Server, int, str]) -> None:
    with socket.create_connection(("127.0.0.1", server[1])) as s:
        # an answer slower than the deadline, then another request on the same connection
        assert _answer(s, b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200")
        assert _answer(s, GET).startswith(b"HTTP/1.1 200")
        # headers split across packets, within the deadline
        s.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")
        time.sleep(DEADLINE / 4)
        assert _answer(s, b"Content-Length: 2\r\n\r\nhi").startswith(b"HTTP/1.1 200")
    with socket.create_connection(("127.0.0.1", server[1])) as s:  # two requests pipelined
        s.sendall(GET + GET)
        s.settimeout(20)
        got = b""
        while got.count(b"\r\n\r\nok") < 2:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk


@pytest.mark.parametrize("parser", sorted(PARSERS))
def test_the_protocol_methods_the_guard_wraps_are_uvicorns(parser: str) -> None:
    base = PARSERS[parser]
    guarded = guarded_protocol(1.0, parser)  # type: ignore[arg-type]
    assert guarded.__mro__[1:3] == (HeaderDeadline, base)
    for name in ("connection_made", "data_received", "connection_lost"):
        theirs = inspect.signature(getattr(base, name))
        ours = inspect.signature(getattr(HeaderDeadline, name))
        assert name in base.__dict__ and list(theirs.parameters) == list(ours.parameters), name
    source = inspect.getsource(base)
    for needed in ("self.cycle = RequestResponseCycle(", "self.loop =", "self.transport ="):
        assert needed in source, needed
