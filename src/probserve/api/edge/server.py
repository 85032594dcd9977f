"""The HTTP server around the app: uvicorn as probserve configures it (header deadline, bounded
connections, its own access log) and `DrainingServer`, which lets responses in flight finish on
SIGTERM before shutting down."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from probserve.api.edge.connections import HttpParser, guarded_protocol
from probserve.api.server.limits import HttpLimits

log = logging.getLogger(__name__)


class ListenError(RuntimeError):
    """The server's address cannot be listened on (in use, not this machine's, no permission)."""


def listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound and listening before any model loads, so a busy port fails
    at once instead of after the load; connections made while the models load wait in its
    backlog. (uvicorn binds the same way: SO_REUSEADDR, which never shares a port another
    socket listens on.)"""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


def uvicorn_config(
    app: ASGIApp,
    limits: HttpLimits,
    host: str,
    port: int,
    ssl_keyfile: str | None = None,
    ssl_certfile: str | None = None,
    parser: HttpParser = "auto",
) -> uvicorn.Config:
    """uvicorn for probserve: `parser`'s protocol with the header deadline, bounded
    connections, our own access log; HTTPS where a key and certificate are given."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        ssl_keyfile=ssl_keyfile,
        ssl_certfile=ssl_certfile,
        http=guarded_protocol(limits.header_timeout, parser),
        limit_concurrency=limits.max_connections,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=max(1, int(limits.drain_timeout)),
    )


class DrainingServer(uvicorn.Server):
    """On SIGTERM (or Ctrl-C): stop accepting connections, let every response in flight finish
    (streams included) for up to `drain_timeout` seconds, then shut down as uvicorn does (the
    app's lifespan stops the engine). uvicorn's own shutdown tells open connections to close,
    which cuts streams short; draining first keeps them whole."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain_timeout: float,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.drain_timeout = drain_timeout
        self.on_exit = on_exit  # told at the first shutdown signal (no more engine restarts)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.on_exit is not None:
            self.on_exit()
        super().handle_exit(sig, frame)
        # uvicorn re-raises a captured signal once it has shut down; a drained SIGTERM is a
        # clean, intended exit, so the process ends with status 0 instead
        if sig == signal.SIGTERM and self._captured_signals[-1:] == [sig]:
            self._captured_signals.pop()

    def _busy(self) -> bool:
        # each connection's request cycle: None before its first request, absent where the
        # protocol has none (WebSocket)
        cycles = (getattr(conn, "cycle", None) for conn in self.server_state.connections)
        return any(cycle is not None and not cycle.response_complete for cycle in cycles)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        while self._busy() and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        if self._busy():
            log.warning("drain timeout (%gs) passed with responses in flight", self.drain_timeout)
        await super().shutdown(sockets)
