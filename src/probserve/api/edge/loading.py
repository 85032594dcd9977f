"""LoadingApp: what the server answers while its models load, then the app itself.

The port is bound and served from the start of `probserve serve`, so a load balancer and a
client see the truth at once: `/health` is 503 `{"status": "loading"}` and every other path a
503 in OpenAI's error envelope (with Retry-After), until the app is ready and put in; from then
on every request goes to it. A load that fails puts nothing in: the server stops and the error
is the command's.
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from probserve.api.errors import anthropic_path, error_body

RETRY_AFTER = "5"  # seconds a client is told to wait while models load


class LoadingApp:
    def __init__(self) -> None:
        self.app: ASGIApp | None = None  # the ready app: every request goes to it once set

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
        elif scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "http":
            await _loading(scope, send)
        # a WebSocket before the app is ready: closed unanswered (the app serves none)

    def ready(self, app: ASGIApp) -> None:
        self.app = app


async def _lifespan(receive: Receive, send: Send) -> None:
    """Startup and shutdown acknowledged: the engines are started by the load and stopped by
    the server's exit (serving.run_server), not by the app's lifespan."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _loading(scope: Scope, send: Send) -> None:
    body: dict[str, Any]
    if scope["path"] == "/health":
        body = {"status": "loading", "models": {}}
    else:
        message = "the server is loading its models: retry once /health says ok"
        body = error_body(503, message, None, "loading", anthropic_path(scope["path"]))
    payload = json.dumps(body).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(payload)).encode()),
        (b"retry-after", RETRY_AFTER.encode()),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
