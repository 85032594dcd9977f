"""Run the app with uvicorn on a free loopback port, in a thread of the test process."""

from __future__ import annotations

import argparse
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from probserve.api.app import create_app
from probserve.api.edge.server import uvicorn_config
from probserve.api.server.state import ServerState
from probserve.cli import build_parser
from probserve.models import LoadedModel
from probserve.serving import build_state
from probserve.settings import ServeSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_settings(*extra: str) -> ServeSettings:
    """`probserve serve`'s settings for these flags, as cli parses them."""
    return ServeSettings.of(serve_args(*extra))


def serve_args(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *extra])


@contextmanager
def running_state(loaded: LoadedModel, *extra: str) -> Iterator[tuple[str, ServerState]]:
    """Yields the base URL (http://127.0.0.1:PORT) of a server over `loaded`, and its state.
    The engine runs in a worker process (the default) for a model with a source on disk; a model
    built in the test (no source) is served by an inline engine."""
    if loaded.source is None and "--worker" not in extra:
        extra = (*extra, "--worker", "inline")
    state, supervisor = build_state(serve_settings(*extra), loaded)
    app = create_app(state)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, state.config.http, "127.0.0.1", port))
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
        supervisor.close()


@contextmanager
def running_server(loaded: LoadedModel, *extra: str) -> Iterator[str]:
    """Yields the base URL (http://127.0.0.1:PORT) of a server over `loaded`."""
    with running_state(loaded, *extra) as (url, _):
        yield url


class InFlight:
    """A streamed completion read on a thread of its own: `started` is set at its first event,
    so a test can act while the request is certainly in flight; `leave()` hangs up at the next
    event; `join()` gives (status, events, ended with [DONE])."""

    def __init__(self, url: str, body: dict[str, object]) -> None:
        self.started = threading.Event()
        self._leaving = threading.Event()
        self.status = 0
        self.events: list[str] = []
        self.done = False
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict[str, object]) -> None:
        import httpx

        try:
            with httpx.stream(
                "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120
            ) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if self._leaving.is_set():
                        break
                    if line.startswith("data: "):
                        self.started.set()
                        self.done = line == "data: [DONE]"
                        self.events.append(line)
        finally:
            self.started.set()

    def leave(self) -> None:
        self._leaving.set()

    def join(self, timeout: float = 120) -> tuple[int, list[str], bool]:
        self._thread.join(timeout)
        return self.status, self.events, self.done


def finish_reason(events: list[str]) -> str | None:
    """The finish reason of the last streamed completion event that has one."""
    import json

    for line in reversed(events):
        if line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                if choice.get("finish_reason"):
                    return str(choice["finish_reason"])
    return None


def wait_until(predicate: Callable[[], object], timeout: float = 30.0) -> bool:
    """Poll `predicate` every 20 ms until it holds (True) or `timeout` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def post_ok(c: Any, path: str, body: dict[str, Any], model: str) -> dict[str, Any]:
    """POST `body` for `model` on an httpx client; asserts 200 and returns the JSON answer."""
    r = c.post(path, json={"model": model, **body})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def stream_events(c: Any, path: str, body: dict[str, Any], model: str) -> list[dict[str, Any]]:
    """The JSON events of a streamed answer (its `data:` lines but `[DONE]`); asserts 200."""
    with c.stream("POST", path, json={"model": model, **body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    return [json.loads(ln) for ln in lines if ln != "[DONE]"]
