"""The body limit's 413 reaches a client that is still sending its body, on both of uvicorn's
HTTP parsers (api/edge/middleware.py: BodyLimitMiddleware drains what the client still sends,
bounded in bytes and time, before the connection closes; a close with unread bytes is a reset
that can overtake the answer).

Each client below waits until the 413's first bytes have reached it before it sends more, so
the answer is certainly out before the rest of the body: nothing depends on the machine's load.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from probserve.api.edge.middleware import BodyLimitMiddleware
from probserve.api.edge.server import uvicorn_config
from probserve.api.server.limits import HttpLimits

LIMIT = 64 * 1024
DRAIN_BYTES = 2 * 2**20
SLICE = 64 * 1024


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = str(size).encode()
    head = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": head})
    await send({"type": "http.response.body", "body": body})


def app() -> BodyLimitMiddleware:
    """/patient drains for as long as the tests' clients need (however loaded the machine);
    /brief drains for 0.3 s."""
    patient = BodyLimitMiddleware(echo, LIMIT, drain_bytes=DRAIN_BYTES, drain_seconds=300)
    brief = BodyLimitMiddleware(echo, LIMIT, drain_bytes=DRAIN_BYTES, drain_seconds=0.3)

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        target = brief if scope.get("path") == "/brief" else patient
        await target(scope, receive, send)

    return route  # type: ignore[return-value]


@pytest.fixture(params=["h11", "httptools"], scope="module")
def port(request: pytest.FixtureRequest) -> Iterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    config = uvicorn_config(app(), HttpLimits(), "127.0.0.1", free, parser=request.param)
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "no server"
        time.sleep(0.02)
    yield free
    srv.should_exit = True
    thread.join(30)


def head(path: str, length: int | None) -> bytes:
    framing = b"Transfer-Encoding: chunked" if length is None else b"Content-Length: %d" % length
    return b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n%s\r\n\r\n" % (
        path.encode(),
        framing,
    )


def piece(data: bytes, chunked: bool) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data) if chunked else data


def await_answer(s: socket.socket) -> None:
    """Until the 413's status line has reached the client (peeked: it stays to be read)."""
    s.settimeout(60)
    while not s.recv(64, socket.MSG_PEEK).startswith(b"HTTP/1.1 413"):
        time.sleep(0.01)


def read_all(s: socket.socket) -> bytes:
    s.settimeout(60)
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


def envelope(answer: bytes) -> dict:
    start, _, body = answer.partition(b"\r\n\r\n")
    assert start.startswith(b"HTTP/1.1 413"), answer[:300]
    return json.loads(body)["error"]


@pytest.mark.parametrize("chunked", [True, False])
def test_a_client_still_sending_reads_its_413(port: int, chunked: bool) -> None:
    """A 5 MiB-like body past the limit: the client sends the rest after the 413 is out (in
    slices, pausing), ends the body, then reads: the whole 413 envelope, no reset."""
    rest = [b"y" * SLICE for _ in range(12)]
    total = LIMIT + 1 + sum(map(len, rest))
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head("/patient", None if chunked else total))
        s.sendall(piece(b"x" * (LIMIT + 1), chunked))
        await_answer(s)
        for data in rest:
            time.sleep(0.02)
            s.sendall(piece(data, chunked))
        if chunked:
            s.sendall(b"0\r\n\r\n")
        error = envelope(read_all(s))
    assert error["code"] == "request_too_large" and str(LIMIT) in error["message"]


def test_the_drain_is_bounded_in_bytes(port: int) -> None:
    """A client that never stops sending is read for DRAIN_BYTES more, then cut off; it had its
    413 first."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head("/patient", None))
        s.sendall(piece(b"x" * (LIMIT + 1), True))
        await_answer(s)
        s.settimeout(60)
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while sent < 20 * DRAIN_BYTES:
                s.sendall(piece(b"y" * SLICE, True))
                sent += SLICE
    assert DRAIN_BYTES <= sent < 20 * DRAIN_BYTES


def test_the_drain_is_bounded_in_time(port: int) -> None:
    """A client that stops sending partway through its body is let go after the drain's time:
    it reads the whole 413, then the end of the connection."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head("/brief", None))
        s.sendall(piece(b"x" * (LIMIT + 1), True))
        error = envelope(read_all(s))  # ends: the server closed the connection
    assert error["code"] == "request_too_large"


def test_a_body_within_the_limit_is_passed_on(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(head("/patient", None) + piece(b"z" * LIMIT, True) + b"0\r\n\r\n")
        s.settimeout(60)
        got = b""
        while not got.endswith(b"\r\n\r\n%d" % LIMIT):
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
    assert got.startswith(b"HTTP/1.1 200")
