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
from probserve.api.server import build_state
from probserve.cli import build_parser
from probserve.models import LoadedModel


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *extra])


@contextmanager
def running_server(loaded: LoadedModel, *extra: str) -> Iterator[str]:
    """Yields the base URL (http://127.0.0.1:PORT) of a server over `loaded`."""
    app = create_app(build_state(loaded, serve_args(*extra)))
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
