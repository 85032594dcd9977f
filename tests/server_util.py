"""Run the app with uvicorn on a free loopback port, in a thread of the test process."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn

from probserve.api.app import create_app
from probserve.api.server import build_state, uvicorn_config
from probserve.api.state import ServerState
from probserve.cli import build_parser
from probserve.models import LoadedModel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *extra])


@contextmanager
def running_state(loaded: LoadedModel, *extra: str) -> Iterator[tuple[str, ServerState]]:
    """Yields the base URL (http://127.0.0.1:PORT) of a server over `loaded`, and its state.
    The engine runs in a worker process (the default) for a model with a source on disk; a model
    built in the test (no source) is served by an inline engine."""
    if loaded.source is None and "--worker" not in extra:
        extra = (*extra, "--worker", "inline")
    state, supervisor = build_state(serve_args(*extra), loaded)
    app = create_app(state)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, state.config.limits, "127.0.0.1", port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", state
    finally:
        supervisor.stop()
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def running_server(loaded: LoadedModel, *extra: str) -> Iterator[str]:
    """Yields the base URL (http://127.0.0.1:PORT) of a server over `loaded`."""
    with running_state(loaded, *extra) as (url, _):
        yield url
