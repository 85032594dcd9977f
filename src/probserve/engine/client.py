"""EngineClient: the asyncio face of an engine, wherever it runs.

The API talks to this interface only. `submit()` validates a request at once against the
engine's `EngineInfo` (raising RequestError), queues it and returns an async iterator of its
EngineOutputs; leaving that iterator early (a client that went away) aborts the request. Outputs
come from the host of the engine (a thread of this process: AsyncEngine; a worker process:
WorkerEngine) through `_deliver`, from any thread.

Liveness: when the engine stops for good, every open stream gets an error output, `submit()`
raises EngineDead, `health()` says "dead" and `on_fatal` runs (the server then exits non-zero,
so a supervisor restarts it). When the engine owes news (requests in flight) and has said nothing
for `stall_timeout` seconds, `health()` says "stuck".
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from probserve.engine.info import EngineInfo, validate
from probserve.engine.stats import EngineStats
from probserve.engine.types import (
    EngineDead,
    EngineOutput,
    EngineOverloaded,
    EngineRequest,
    RequestError,
)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[EngineOutput]


class RequestStream:
    """The outputs of one request, as an async iterator. Closing it (or dropping it) before the
    last output aborts the request, so a client that went away frees what it held."""

    def __init__(self, engine: EngineClient, request_id: str, queue: asyncio.Queue[EngineOutput]):
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            out = await self._queue.get()
        except BaseException:  # cancelled while waiting: the caller is gone
            self.close()
            raise
        if out.finished:
            self._done = True
        return out

    def close(self) -> None:
        if not self._done:
            self._done = True
            self.engine.abort(self.request_id)

    async def aclose(self) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class EngineClient(abc.ABC):
    """What the API needs of an engine. Subclasses start and stop the host and carry requests
    and aborts to it (`_send`); the streams, validation and liveness live here."""

    info: EngineInfo

    def __init__(self, max_pending: int = 1024, stall_timeout: float = 120.0) -> None:
        self.max_pending = max_pending  # requests queued or running; past it: EngineOverloaded
        self.stall_timeout = stall_timeout  # seconds of silence with work owed before "stuck"
        self.on_fatal: Callable[[str], None] | None = None  # called when the engine dies
        self.shutting_down = False  # set when the server begins to stop: an exit is no crash
        self._dead: str | None = None  # why the engine stopped, once it has
        self._owed_since: float | None = None  # monotonic time since which news is owed
        # re-entrant: a RequestStream dropped while the lock is held (its __del__ aborts, and
        # the garbage collector may run it at any allocation) must not deadlock this thread
        self._lock = threading.RLock()
        self._streams: dict[str, _Stream] = {}
        self._snapshot = EngineStats()

    # ---- for subclasses -------------------------------------------------------------------
    @abc.abstractmethod
    def start(self) -> None:
        """Start the host (if not yet) and return once the engine serves; EngineDead if not."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop the host and free what it holds."""

    @abc.abstractmethod
    def _send(self, adds: list[EngineRequest], aborts: list[str]) -> None:
        """Carry new requests and aborts to the engine (called with the lock held)."""

    def _host_alive(self) -> str | None:
        """None while the host runs; else why not."""
        return None

    # ---- requests -------------------------------------------------------------------------
    async def submit(self, request: EngineRequest) -> RequestStream:
        """Validate and queue `request`; returns an iterator of its outputs, the last one with a
        finish reason. Raises RequestError before anything is queued when the request is bad."""
        self.start()
        validate(request, self.info)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if self._dead is not None:
                raise EngineDead(self._dead)
            if len(self._streams) >= self.max_pending:
                raise EngineOverloaded(f"the server is busy ({self.max_pending} requests queued)")
            if request.request_id in self._streams:
                raise RequestError(f"request id {request.request_id!r} is already in use")
            if not self._streams:
                self._owed_since = time.monotonic()
            self._streams[request.request_id] = stream
            try:
                self._send([request], [])
            except BaseException:
                del self._streams[request.request_id]
                raise
        return RequestStream(self, request.request_id, stream.queue)

    async def generate(self, request: EngineRequest) -> list[EngineOutput]:
        """Submit and collect every output (for callers that do not stream)."""
        return [out async for out in await self.submit(request)]

    def check_capacity(self, n: int) -> None:
        """Raise EngineOverloaded unless `n` more requests fit in the queue now."""
        with self._lock:
            if len(self._streams) + n > self.max_pending:
                raise EngineOverloaded(
                    f"the server is busy ({len(self._streams)} of {self.max_pending} queued)"
                )

    def abort(self, request_id: str) -> None:
        """Abort a request: it is removed, and its state freed, before the next step runs."""
        with self._lock:
            if self._streams.pop(request_id, None) is not None and self._dead is None:
                self._send([], [request_id])

    @staticmethod
    def new_request_id(prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def stats(self) -> EngineStats:
        """The engine's figures as of the end of its last step (engine/stats.py), with this
        client's open streams."""
        with self._lock:
            return dataclasses.replace(self._snapshot, streams=len(self._streams))

    def health(self) -> tuple[str, str | None]:
        """("ok" | "dead" | "stuck", why): the engine's real state, read now."""
        if self._dead is not None:
            return "dead", self._dead
        why = self._host_alive()
        if why is not None:
            return "dead", why
        with self._lock:
            owed = self._owed_since if self._streams else None
        if owed is not None and time.monotonic() - owed > self.stall_timeout:
            return "stuck", f"the engine has said nothing for over {self.stall_timeout:g} s"
        return "ok", None

    # ---- from the host ----------------------------------------------------------------------
    def _deliver(self, outputs: list[EngineOutput], stats: EngineStats | None) -> None:
        """Hand each output to its stream (any thread); `stats`: the engine's figures now."""
        deliveries = []
        with self._lock:
            self._owed_since = time.monotonic()
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                deliveries.append((stream, out))
            if stats is not None:
                self._snapshot = stats
        for stream, out in deliveries:
            with contextlib.suppress(RuntimeError):  # the caller's event loop is closed
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _die(self, reason: str) -> None:
        """The engine has stopped for good: end every open stream with an error."""
        with self._lock:
            if self._dead is not None:
                return
            self._dead = reason
            outputs = [EngineOutput.failure(rid, reason) for rid in self._streams]
        self._deliver(outputs, None)
        if self.on_fatal is not None:
            self.on_fatal(reason)
