"""ASGI middleware: scope guard, Bearer-key auth, body size and time limits, and one log line
per request, under the request id it echoes as X-Request-Id."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from probserve.api.errors import anthropic_path, error_body
from probserve.api.server.fields import header_value
from probserve.logs import REQUEST_ID, request_id_from

log = logging.getLogger("probserve.access")

OPEN_PATHS = frozenset({"/health"})  # never behind a key (load balancers, probes)


async def send_error(
    scope: Scope,
    send: Send,
    status: int,
    message: str,
    code: str | None,
    headers: list[tuple[bytes, bytes]],
    more_body: bool = False,
) -> None:
    """An error response in the path's envelope (errors.py), sent from middleware (outside
    FastAPI). `more_body`: the response is left open (its whole body is sent: its
    Content-Length says so) for the caller to end with an empty last message."""
    envelope = error_body(status, message, None, code, anthropic_path(scope.get("path", "")))
    body = json.dumps(envelope).encode()
    head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head + headers})
    await send({"type": "http.response.body", "body": body, "more_body": more_body})


class ScopeGuardMiddleware:
    """Only HTTP (and the lifespan) reach the app: a websocket, or any other scope, is refused
    whatever the auth settings (deny by default; the API has no websocket route)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "lifespan"):
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})


class AuthMiddleware:
    """Requires `Authorization: Bearer KEY`, or `x-api-key: KEY` (Anthropic's SDK and Claude
    Code send it), with one of `keys` (constant-time compare) on every path but /health. No
    keys: open."""

    def __init__(
        self, app: ASGIApp, keys: tuple[str, ...], open_paths: frozenset[str] = OPEN_PATHS
    ) -> None:
        self.app = app
        self.keys = tuple(k.encode() for k in keys if k)
        self.open_paths = open_paths

    def _allowed(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        bearer = scheme.lower() == b"bearer"
        other = headers.get(b"x-api-key")
        ok = False
        for key in self.keys:  # compare with every key so timing does not tell which matched
            ok |= bearer and hmac.compare_digest(token.strip(), key)
            ok |= other is not None and hmac.compare_digest(other.strip(), key)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        if self._allowed(scope):
            await self.app(scope, receive, send)
            return
        await send_error(
            scope,
            send,
            401,
            "invalid or missing API key (Authorization: Bearer ..., or x-api-key)",
            "invalid_api_key",
            [(b"www-authenticate", b"Bearer")],
        )


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes` (by Content-Length, or counted as it arrives);
    408 for a body not fully received within `timeout` seconds (a client that sends less than
    its Content-Length, or trickles bytes, holds nothing for long).

    A 413 is sent while the client may still be sending its body. Closing the connection with
    its bytes unread would make the kernel answer with a reset, which can overtake the 413 (the
    client reads ECONNRESET, or fails its write, and never sees the answer). So the answer goes
    out whole (its Content-Length says so), then what the client still sends is read and
    dropped, up to `drain_bytes` more within `drain_seconds`, before the response ends and the
    connection closes."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout: float = 30.0,
        drain_bytes: int = 8 * 2**20,
        drain_seconds: float = 2.0,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.drain_bytes = drain_bytes
        self.drain_seconds = drain_seconds

    async def _reject(self, scope: Scope, receive: Receive, send: Send, drain: bool) -> None:
        """The 413, then (`drain`: the client is sending its body) the rest of the body read
        and dropped, bounded in bytes and time, before the response ends."""
        message = f"the request body is larger than {self.max_bytes} bytes"
        close = [(b"connection", b"close")]
        await send_error(scope, send, 413, message, "request_too_large", close, more_body=drain)
        if drain:
            await self._drain(receive)
            await send({"type": "http.response.body", "body": b""})

    async def _drain(self, receive: Receive) -> None:
        """Read and drop the body's rest: until it ends, the client leaves, `drain_bytes` are
        read or `drain_seconds` pass."""
        left = self.drain_bytes
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.drain_seconds):
                while left > 0:
                    message = await receive()
                    if message["type"] != "http.request":
                        return
                    left -= len(message.get("body", b""))
                    if not message.get("more_body", False):
                        return

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            # a client that asked `Expect: 100-continue` sends no body after a final answer
            waits = headers.get(b"expect", b"").lower() == b"100-continue"
            await self._reject(scope, receive, send, drain=not waits)
            return
        # read the body up front (bounded in size and time), so a chunked body over the limit
        # is refused too
        chunks: list[bytes] = []
        size = 0
        more = True
        deadline = asyncio.get_running_loop().time() + self.timeout
        while more:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                text = f"the request body did not arrive within {self.timeout:g} s"
                await send_error(
                    scope, send, 408, text, "body_timeout", [(b"connection", b"close")]
                )
                return
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            more = message.get("more_body", False)
            if size > self.max_bytes:
                await self._reject(scope, receive, send, drain=more)
                return
            chunks.append(chunk)
        body = b"".join(chunks)
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


CLIENT_CLOSED = 499  # nginx's "client closed request": logged for a response cut short
# the methods counted by name in http_requests_total (any other is "other")
HTTP_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})


class AccessLogMiddleware:
    """Logs route, status, prompt/completion tokens and latency when a response ends (for a
    stream: when its last byte is sent, or, as 499, when the client hung up before it). The
    request's id (its X-Request-Id, sanitised: probserve.logs, or a new one) is echoed in the
    response's X-Request-Id, kept in the request's state for its engine requests' ids, and set
    for every log line of the request. When the response has ended (or the client has gone),
    the request's `on_end` (the release of its lease on a model on demand: api/server/lookup.py)
    runs."""

    def __init__(
        self, app: ASGIApp, on_response: Callable[[str, str, int, float], None] | None = None
    ) -> None:
        self.app = app
        # (method, route template, status, seconds): the HTTP requests' counter and histogram
        self.on_response = on_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0
        logged = False
        header = next((v for k, v in scope.get("headers", []) if k == b"x-request-id"), None)
        rid = request_id_from(header.decode("latin-1") if header is not None else None)
        scope.setdefault("state", {})["request_id"] = rid
        token = REQUEST_ID.set(rid)  # every log line of the request carries it

        async def wrapped(message: Message) -> None:
            nonlocal status, logged
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), (b"x-request-id", rid.encode())]
                ignored = scope["state"].get("ignored_fields")
                if ignored:  # the field policy's names (api/server/fields.py)
                    headers.append((b"x-ignored-fields", header_value(ignored).encode()))
                message = {**message, "headers": headers}
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                logged = True
                self._log(scope, status, started)

        try:
            await self.app(scope, receive, wrapped)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # cancelled (the client hung up): logged, 499
                if not logged:
                    self._log(scope, CLIENT_CLOSED, started)
                raise
            # an unexpected error: the envelope (if nothing was sent yet) and a log line
            log.exception("unexpected error", exc_info=exc)
            if not logged:
                self._log(scope, status or 500, started)
            if status:
                raise  # the response had started: the server closes the connection
            await send_error(scope, send, 500, f"internal error: {type(exc).__name__}", None, [])
        else:
            if not logged:  # the app ended without a last byte: the client hung up (a stream)
                self._log(scope, CLIENT_CLOSED, started)
        finally:
            REQUEST_ID.reset(token)
            on_end = scope["state"].pop("on_end", None)
            if on_end is not None:
                on_end()

    def _log(self, scope: Scope, status: int, started: float) -> None:
        route = getattr(scope.get("route"), "path", "unmatched")
        seconds = time.perf_counter() - started
        method, path = escape_log(str(scope.get("method"))), escape_log(str(scope.get("path")))
        if self.on_response is not None:
            known = method if method in HTTP_METHODS else "other"  # no label explodes
            self.on_response(known, route, status, seconds)
        state: Any = scope.get("state") or {}
        usage = state.get("usage") if isinstance(state, dict) else None
        tokens = f" prompt_tokens={usage[0]} completion_tokens={usage[1]}" if usage else ""
        ignored = state.get("ignored_fields") if isinstance(state, dict) else None
        named = header_value(ignored) if ignored else None
        error = state.get("error") if isinstance(state, dict) else None  # (code, param, text)
        said = ""
        if named:
            said += f" ignored_fields=[{named}]"
        if error:
            said += f" error={error[0]} param={error[1]} message={str(error[2])[:300]!r}"
        latency = seconds * 1000
        access = {  # the line's fields, each a field of its own in --log-format json
            "method": method,
            "path": path,
            "route": route,
            "status": status,
            "model": state.get("model") if isinstance(state, dict) else None,
            "prompt_tokens": usage[0] if usage else None,
            "completion_tokens": usage[1] if usage else None,
            "latency_ms": round(latency, 1),
            "request_id": state.get("request_id", "") if isinstance(state, dict) else "",
            "ignored_fields": named,
            "error_code": error[0] if error else None,
            "error_param": error[1] if error else None,
            "error_message": error[2] if error else None,
        }
        log.info("%s %s %d%s%s %.1fms", method, path, status, tokens, said, latency, extra=access)


def escape_log(text: str) -> str:
    """Control characters (a `%0A` in a path, say) escaped, so no client can forge log lines."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
