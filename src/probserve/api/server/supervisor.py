"""Supervision of each model's engine: a model whose engine dies is restarted on its own, while
the server's other models keep serving; a model that keeps dying is given up.

A dead engine has already ended its open streams with an error (EngineClient._die). The
supervisor then builds a fresh engine with the model's factory on a thread (a worker process
loads for seconds) and swaps it in; meanwhile the model's requests get 503 and /health says
"restarting". At most `restarts` restarts in any `window` seconds: past that the model stays
dead, and once every model is dead `on_gone` runs (the server exits non-zero, for its own
supervisor to act).

A model on demand (api/server/on_demand.py) is watched from its load (`adopt`) to its unload
(`forget`): an engine stopped on purpose is no crash, and a restart that ends after the model's
unload stops the engine it started.

Once the server begins to shut down (`stop()`, from its signal handler), an engine's exit is no
crash: nothing is restarted. The supervisor's thread lives until `close()`, at the very end: a
worker process is killed by the kernel when the thread that started it ends (PR_SET_PDEATHSIG),
so a restarted worker must outlive the drain.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

from probserve.api.server.served import ServedModel
from probserve.api.server.state import ServerState
from probserve.engine import EngineClient

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(
        self,
        state: ServerState,
        factory: Callable[[ServedModel], EngineClient],
        restarts: int = 3,
        window: float = 600.0,
    ) -> None:
        self.state = state
        self.factory = factory  # a new, unstarted engine for the model
        self.restarts = restarts
        self.window = window
        self.on_gone: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._history: dict[str, deque[float]] = {m.name: deque() for m in state.models}
        self._stopping = False
        self._jobs: queue.SimpleQueue[tuple[ServedModel, EngineClient] | None] = queue.SimpleQueue()
        for model in state.models:
            self._watch(model, model.engine)
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()

    def adopt(self, model: ServedModel) -> None:
        """Watch `model` (loaded on demand) from now on."""
        with self._lock:
            self._history.setdefault(model.name, deque())
            if self._stopping:
                model.engine.shutting_down = True
        self._watch(model, model.engine)

    def forget(self, model: ServedModel) -> None:
        """Stop watching `model` (being unloaded): its engine's end is no crash."""
        with self._lock:
            self._history.pop(model.name, None)
            model.engine.on_fatal = None

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._restart(*job)

    def _watch(self, model: ServedModel, engine: EngineClient) -> None:
        engine.on_fatal = lambda reason: self._died(model, engine, reason)

    def _died(self, model: ServedModel, engine: EngineClient, reason: str) -> None:
        with self._lock:
            if self._stopping or model.engine is not engine or model.restarting:
                return
            history = self._history.get(model.name)
            if history is None:  # unloaded meanwhile
                return
            now = time.monotonic()
            while history and now - history[0] > self.window:
                history.popleft()
            if len(history) >= self.restarts:
                log.critical("model %s: engine died (%s); not restarting it", model.name, reason)
                self._check_gone(reason)
                return
            history.append(now)
            model.restarting = reason
        log.error("model %s: engine died (%s); restarting it", model.name, reason)
        self._jobs.put((model, engine))

    def _restart(self, model: ServedModel, old: EngineClient) -> None:
        old.stop()
        if self._stopping:
            return
        fresh = self.factory(model)
        failed: str | None = None
        try:
            fresh.start()
        except Exception as exc:  # EngineDead: the worker failed to load or warm up
            failed = str(exc)
        with self._lock:
            if self._stopping or model.name not in self._history:  # or unloaded meanwhile
                fresh.stop()
                return
            model.engine = fresh
            model.restarting = None
        self._watch(model, fresh)
        status, why = fresh.health()
        if failed is not None or status == "dead":
            self._died(model, fresh, failed or why or "the restarted engine died")
        else:
            log.warning("model %s: engine restarted", model.name)

    def _check_gone(self, reason: str) -> None:
        """With the lock held: when no model can serve any more, the server must go (never
        while it serves models on demand: it can load another)."""
        if self.state.on_demand is not None:
            return
        alive = [m for m in self.state.models if m.restarting or m.engine.health()[0] != "dead"]
        if not alive and self.on_gone is not None:
            self.on_gone(reason)

    def stop(self) -> None:
        """No more restarts: the server is shutting down, so an engine that exits now has not
        crashed. Safe in a signal handler (takes no lock)."""
        self._stopping = True
        for model in self.state.models:
            model.engine.shutting_down = True

    def close(self) -> None:
        """Stop, and end the supervisor's thread (once the engines have stopped)."""
        self.stop()
        self._jobs.put(None)
        self._thread.join(timeout=5)
