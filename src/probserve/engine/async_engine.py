"""AsyncEngine: the engine hosted inline, on a thread of the server process.

The model work runs on one dedicated thread, so it never blocks the event loop: `submit()` and
`abort()` only append to an inbox under a short lock; the engine thread applies the inbox between
steps (EngineCore.apply, then EngineCore.safe_step). The default host is a worker process
(worker_client.py); this one serves `--worker inline`, embedding in Python programs and tests
that inject faults into the engine.
"""

from __future__ import annotations

import logging
import threading

from probserve.engine.client import EngineClient
from probserve.engine.config import ClientLimits, EngineConfig
from probserve.engine.core.engine import EngineCore
from probserve.engine.core.host import engine_over
from probserve.engine.types import EngineDead, EngineRequest
from probserve.models import LoadedModel

log = logging.getLogger(__name__)


class AsyncEngine(EngineClient):
    def __init__(
        self, core: EngineCore, max_pending: int = 1024, stall_timeout: float = 120.0
    ) -> None:
        super().__init__(max_pending, stall_timeout)
        self.core = core
        self.info = core.info
        self._wake = threading.Condition(self._lock)
        self._adds: list[EngineRequest] = []
        self._aborts: list[str] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._snapshot = core.stats()

    @classmethod
    def over(
        cls,
        loaded: LoadedModel,
        config: EngineConfig,
        limits: ClientLimits | None = None,
        draft: LoadedModel | None = None,
    ) -> AsyncEngine:
        """An (unstarted) engine over a model its caller holds and may share (`--worker
        inline`, `probserve generate`, tests): its source weights stay where they are.
        `draft`: the draft model of `--speculative draft`."""
        limits = limits or ClientLimits()
        core = engine_over(loaded, config, draft)
        return cls(core, max_pending=limits.max_queued, stall_timeout=limits.engine_stall_timeout)

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

    def _send(self, adds: list[EngineRequest], aborts: list[str]) -> None:
        self._adds += adds
        self._aborts += aborts
        self._wake.notify_all()

    def _host_alive(self) -> str | None:
        if self._thread is not None and not self._thread.is_alive():
            return "the engine thread has exited"
        return None

    # ---- the engine thread ----------------------------------------------------------------
    def _loop(self, ready: threading.Event) -> None:
        try:
            self.core.warmup()  # every torch call of the engine happens on this thread
        except BaseException as exc:
            self._fatal(exc)
            return
        finally:
            ready.set()
        try:
            self._serve()
        except BaseException as exc:  # a bug outside any one request: stop, loudly
            self._fatal(exc)

    def _serve(self) -> None:
        core = self.core
        while True:
            with self._wake:
                while not (self._stopping or self._adds or self._aborts or core.has_work()):
                    self._wake.wait()
                if self._stopping:
                    break
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            outputs = core.apply(adds, aborts)
            if core.has_work():
                outputs += core.safe_step()
            self._deliver(outputs, core.stats())
        core.close()

    def _fatal(self, exc: BaseException) -> None:
        reason = f"engine stopped: {type(exc).__name__}: {exc}"
        log.critical("%s", reason, exc_info=exc)
        self._die(reason)
