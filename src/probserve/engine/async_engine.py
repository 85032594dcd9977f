"""AsyncEngine: the asyncio front of EngineCore.

The model work runs on one dedicated thread, so it never blocks the event loop: `submit()` and
`abort()` only append to an inbox under a short lock; the engine thread applies the inbox between
steps. `submit()` validates a request at once (raising RequestError), queues it and returns an
async iterator of its EngineOutputs; leaving that iterator early (a client that went away) aborts
the request. Many requests may be submitted concurrently: they queue in the scheduler.

Liveness: an exception that belongs to one request fails that request alone, and one raised by a
step fails the step's sequences; the loop goes on. Anything else stops the engine for good: every
open stream gets an error output, `submit()` raises EngineDead, `health()` says "dead" and the
`on_fatal` callback runs (the server exits non-zero so a supervisor restarts it). A step running
longer than `stall_timeout` seconds makes `health()` say "stuck".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from probserve.engine.core import EngineCore
from probserve.engine.types import (
    EngineDead,
    EngineOutput,
    EngineOverloaded,
    EngineRequest,
    FinishReason,
    RequestError,
)

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[EngineOutput]


class RequestStream:
    """The outputs of one request, as an async iterator. Closing it (or dropping it) before the
    last output aborts the request, so a client that went away frees what it held."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue[EngineOutput]):
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


class AsyncEngine:
    def __init__(
        self, core: EngineCore, max_pending: int = 1024, stall_timeout: float = 120.0
    ) -> None:
        self.core = core
        self.max_pending = max_pending  # requests queued or running; past it: EngineOverloaded
        self.stall_timeout = stall_timeout  # seconds a step may run before health says "stuck"
        self.on_fatal: Callable[[str], None] | None = None  # called (engine thread) when it dies
        self._dead: str | None = None  # why the engine thread stopped, once it has
        self._step_started: float | None = None  # monotonic time the running step began
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._streams: dict[str, _Stream] = {}
        self._adds: list[EngineRequest] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._snapshot: dict[str, float] = {
            "waiting": 0,
            "running": 0,
            "held_caches": 0,
            **core.counters(),
        }

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; returns once it has built the runner and warmed up."""
        if self._thread is None:
            self._stopping = False
            ready = threading.Event()
            self._thread = threading.Thread(
                target=self._loop, args=(ready,), name="probserve-engine", daemon=True
            )
            self._thread.start()
            ready.wait()
        if self._dead is not None:
            raise EngineDead(self._dead)

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # ---- requests -------------------------------------------------------------------------
    async def submit(self, request: EngineRequest) -> RequestStream:
        """Validate and queue `request`; returns an iterator of its outputs, the last one with a
        finish reason. Raises RequestError before anything is queued when the request is bad."""
        self.core.validate(request)
        self.start()
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._wake:
            if self._dead is not None:
                raise EngineDead(self._dead)
            if len(self._streams) >= self.max_pending:
                raise EngineOverloaded(f"the server is busy ({self.max_pending} requests queued)")
            if request.request_id in self._streams:
                raise RequestError(f"request id {request.request_id!r} is already in use")
            self._streams[request.request_id] = stream
            self._adds.append(request)
            self._wake.notify_all()
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
        with self._wake:
            if self._streams.pop(request_id, None) is not None:
                self._aborts.append(request_id)
                self._wake.notify_all()

    @staticmethod
    def new_request_id(prefix: str = "req") -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def stats(self) -> dict[str, float]:
        """As of the end of the last step: waiting, running, held_caches and streams (counts),
        kv_cache_usage (0..1), prefix_cache_queries, prefix_cache_hits, preemptions (totals)."""
        with self._lock:
            return {**self._snapshot, "streams": len(self._streams)}

    def health(self) -> tuple[str, str | None]:
        """("ok" | "dead" | "stuck", why): the engine thread's real state, read now."""
        if self._dead is not None:
            return "dead", self._dead
        if self._thread is not None and not self._thread.is_alive():
            return "dead", "the engine thread has exited"
        started = self._step_started
        if started is not None and time.monotonic() - started > self.stall_timeout:
            return "stuck", f"one engine step has run for over {self.stall_timeout:g} s"
        return "ok", None

    # ---- the engine thread ----------------------------------------------------------------
    def _loop(self, ready: threading.Event) -> None:
        try:
            self.core.warmup()  # every torch call of the engine happens on this thread
        except BaseException as exc:
            self._die(exc)
            return
        finally:
            ready.set()
        try:
            self._serve()
        except BaseException as exc:  # a bug outside any one request: stop, loudly
            self._die(exc)

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not (self._stopping or self._adds or self._aborts or self.core.has_work()):
                    self._wake.wait()
                if self._stopping:
                    return
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            self._step_started = time.monotonic()
            outputs = self._apply_inbox(adds, aborts)
            if self.core.has_work():
                try:
                    outputs += self.core.step()
                except Exception as exc:  # a bug or a bad model output: fail the running batch
                    log.exception("engine step failed")
                    outputs += self.core.fail_running(f"engine error: {type(exc).__name__}: {exc}")
            self._step_started = None
            self._deliver(outputs)

    def _die(self, exc: BaseException) -> None:
        reason = f"engine stopped: {type(exc).__name__}: {exc}"
        log.critical("%s", reason, exc_info=exc)
        with self._lock:
            self._dead = reason
            outputs = [self._error_output(rid, reason) for rid in self._streams]
        self._deliver(outputs, snapshot=False)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _apply_inbox(self, adds: list[EngineRequest], aborts: list[str]) -> list[EngineOutput]:
        outputs: list[EngineOutput] = []
        aborted = set(aborts)
        for req in adds:
            if req.request_id in aborted:
                aborted.discard(req.request_id)
                continue
            try:
                self.core.add_request(req)
            except RequestError as exc:
                outputs.append(self._error_output(req.request_id, str(exc)))
            except Exception as exc:  # anything one request causes fails that request alone
                log.exception("request %s could not be added", req.request_id)
                self.core.abort_request(req.request_id)
                outputs.append(self._error_output(req.request_id, f"{type(exc).__name__}: {exc}"))
        for request_id in aborted:
            self.core.abort_request(request_id)
        return outputs

    @staticmethod
    def _error_output(request_id: str, message: str) -> EngineOutput:
        return EngineOutput(request_id, finish_reason=FinishReason.ERROR, error=message)

    def _deliver(self, outputs: list[EngineOutput], snapshot: bool = True) -> None:
        deliveries = []
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                deliveries.append((stream, out))
            if snapshot:
                waiting, running = self.core.num_requests()
                self._snapshot = {
                    "waiting": waiting,
                    "running": running,
                    "held_caches": self.core.held_caches(),
                    **self.core.counters(),
                }
        for stream, out in deliveries:
            with contextlib.suppress(RuntimeError):  # the caller's event loop is closed
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)
