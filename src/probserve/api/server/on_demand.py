"""Models on demand: the models a server can serve without holding them (`--models-dir`,
`--on-demand-model`), loaded when a request names one and unloaded when idle or evicted.

Each `OnDemandModel` is in one state: "unloaded", "loading" (a request, or POST /models/load,
waits for it), "loaded" (it serves, its `ServedModel` among the server's models), "unloading"
(its requests in flight finish first; new ones wait, then load it again) or "failed" (the last
load's reason; the next request tries again). A request holds a lease on its model from the
lookup of its name to its response's last byte (api/edge/middleware.py runs the release): a
model with a lease, or with a request waiting for it, is never unloaded.

At most `max_loaded` on-demand models hold a slot (loading or loaded) at once (0: no bound):
a load past it evicts the least recently used idle one, or waits until one is idle. A model
idle for its keep-alive (the last request's `keep_alive`, else `--idle-unload`) is unloaded;
keep-alive 0 unloads it as its last request ends. The models given with `--model` are pinned:
they are not here, and never unloaded.

Loads and unloads run one at a time on a thread of their own that lives as long as the server
(a worker process dies with the thread that started it: PR_SET_PDEATHSIG); everything else runs
on the event loop, so no lock guards these records. The callables that start and stop a model
come from the composition root (serving.py)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from probserve.api.errors import APIError
from probserve.api.server.served import ServedModel

log = logging.getLogger(__name__)


@dataclass
class OnDemandModel:
    """One model served on demand: its name, its spec (a path, or `org/repo:QUANT`) and where
    it stands."""

    name: str
    spec: str
    state: str = "unloaded"  # unloaded, loading, loaded, unloading, failed
    reason: str | None = None  # why it failed, or why it was last unloaded
    served: ServedModel | None = None  # while loaded (and unloading)
    leases: int = 0  # requests using it now
    waiting: int = 0  # requests waiting for it to load
    holds_slot: bool = False  # counted against max_loaded (loading past the bound, or loaded)
    keep_alive: float | None = None  # seconds idle before unloading, as its last request asked
    last_used: float = 0.0  # monotonic time its last request ended (or it loaded)
    loads: int = 0  # loads begun, failed ones included
    loading: asyncio.Future[None] | None = field(default=None, repr=False)
    unloading: asyncio.Future[None] | None = field(default=None, repr=False)
    timer: asyncio.TimerHandle | None = field(default=None, repr=False)


class OnDemand:
    def __init__(
        self,
        specs: dict[str, str],
        load: Callable[[str, str], ServedModel],
        unload: Callable[[ServedModel], None],
        max_loaded: int = 0,
        idle_unload: float = 0.0,
    ) -> None:
        self.entries = {name: OnDemandModel(name, spec) for name, spec in specs.items()}
        self._load, self._unload = load, unload  # blocking: run on the load thread
        self.max_loaded = max_loaded
        self.idle_unload = idle_unload  # seconds (0: never)
        self.models: list[ServedModel] = []  # the server's serving models (ServerState's list)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="probserve-on-demand")
        self._changed = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()  # notifications on their way (held)

    # ---- requests -------------------------------------------------------------------------
    async def acquire(
        self, name: str, keep_alive: float | None
    ) -> tuple[ServedModel, Callable[[], None]]:
        """The model `name`, loaded (waiting for it), with a lease on it: the callable releases
        it (once; later calls do nothing), `keep_alive` (None: as before) then counting from
        the release. A failed load is a 503 naming `model`."""
        entry = self.entries[name]
        entry.waiting += 1
        try:
            while not self._serves(entry):
                if entry.unloading is not None:
                    await asyncio.shield(entry.unloading)
                else:
                    await self._loaded(entry)
        finally:
            entry.waiting -= 1
        assert entry.served is not None
        entry.leases += 1
        self._disarm(entry)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release(entry, keep_alive)

        return entry.served, release

    async def load(self, name: str) -> OnDemandModel:
        """POST /models/load: the model loaded (its idle time counting from now)."""
        _, release = await self.acquire(name, None)
        release()
        return self.entries[name]

    async def unload(self, name: str) -> OnDemandModel:
        """POST /models/unload: a load in progress ends first, then the model's requests in
        flight; returns once its worker has stopped."""
        entry = self.entries[name]
        if entry.loading is not None:
            await asyncio.wait([entry.loading])
        if entry.state == "loaded":
            self._begin_unload(entry, "unloaded by POST /models/unload")
        if entry.unloading is not None:
            await asyncio.shield(entry.unloading)
        return entry

    def _serves(self, entry: OnDemandModel) -> bool:
        """Loaded with an engine that serves; a loaded model whose engine is dead for good (its
        worker's restarts spent) is unloaded, for the request to load it afresh."""
        if entry.state != "loaded" or entry.served is None:
            return False
        status, why = entry.served.health()
        if status != "dead":
            return True
        self._begin_unload(entry, f"its engine died: {why}")
        return False

    # ---- loading --------------------------------------------------------------------------
    async def _loaded(self, entry: OnDemandModel) -> None:
        """Wait for `entry`'s load (begun here unless one runs); its failure raised to every
        request waiting for it."""
        if entry.loading is None:
            entry.loading = asyncio.ensure_future(self._load_entry(entry))
            entry.loading.add_done_callback(lambda f: f.cancelled() or f.exception())
        await asyncio.shield(entry.loading)

    async def _load_entry(self, entry: OnDemandModel) -> None:
        entry.state, entry.reason = "loading", None
        entry.loads += 1
        try:
            await self._take_slot(entry)
            log.info("model %s: loading %s", entry.name, entry.spec)
            future = self._pool.submit(self._load, entry.name, entry.spec)
            served = await asyncio.wrap_future(future)
        except Exception as exc:
            reason = str(exc) or type(exc).__name__
            log.error("model %s: the load failed: %s", entry.name, reason)
            entry.state, entry.reason, entry.holds_slot = "failed", reason, False
            raise APIError(
                503, f"the model `{entry.name}` failed to load: {reason}", "model",
                code="model_load_failed",
            ) from exc  # fmt: skip
        else:
            entry.served, entry.state = served, "loaded"
            entry.last_used = time.monotonic()
            self.models.append(served)
            log.info("model %s: loaded", entry.name)
        finally:
            entry.loading = None
            await self._notify()

    async def _take_slot(self, entry: OnDemandModel) -> None:
        """Wait until `entry` may hold a slot (evicting the least recently used idle model
        where every slot is held), and take it."""
        async with self._changed:
            while True:
                held = [e for e in self.entries.values() if e.holds_slot and e is not entry]
                if self.max_loaded <= 0 or len(held) < self.max_loaded:
                    entry.holds_slot = True
                    return
                idle = [e for e in held if self._idle(e)]
                if idle:
                    victim = min(idle, key=lambda e: e.last_used)
                    self._begin_unload(victim, f"evicted for {entry.name} (--models-max)")
                await self._changed.wait()

    # ---- unloading ------------------------------------------------------------------------
    @staticmethod
    def _idle(entry: OnDemandModel) -> bool:
        """Loaded, and neither used nor waited for."""
        unused = entry.leases == 0 and entry.waiting == 0
        return entry.state == "loaded" and entry.unloading is None and unused

    def _begin_unload(self, entry: OnDemandModel, why: str) -> None:
        if entry.unloading is None and entry.state == "loaded":
            self._disarm(entry)
            entry.state, entry.reason = "unloading", why
            entry.unloading = asyncio.ensure_future(self._unload_entry(entry))

    async def _unload_entry(self, entry: OnDemandModel) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: entry.leases == 0)
        served = entry.served
        assert served is not None
        if served in self.models:
            self.models.remove(served)
        log.info("model %s: unloading (%s)", entry.name, entry.reason)
        try:
            await asyncio.wrap_future(self._pool.submit(self._unload, served))
        except Exception:  # the worker is gone either way
            log.exception("model %s: stopping its engine failed", entry.name)
        entry.served, entry.state, entry.holds_slot = None, "unloaded", False
        entry.unloading = None
        await self._notify()

    def _release(self, entry: OnDemandModel, keep_alive: float | None) -> None:
        """A request on `entry` has ended (on the event loop)."""
        entry.leases -= 1
        entry.last_used = time.monotonic()
        if keep_alive is not None:
            entry.keep_alive = keep_alive
        after = entry.keep_alive if entry.keep_alive is not None else self.idle_unload
        if self._idle(entry):
            if entry.keep_alive == 0:
                self._begin_unload(entry, "keep_alive 0")
            elif 0 < after < math.inf:
                loop = asyncio.get_running_loop()
                entry.timer = loop.call_later(after, self._expired, entry)
        task = asyncio.get_running_loop().create_task(self._notify())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _expired(self, entry: OnDemandModel) -> None:
        entry.timer = None
        if self._idle(entry):
            self._begin_unload(entry, "idle (keep_alive / --idle-unload)")

    @staticmethod
    def _disarm(entry: OnDemandModel) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        """The load thread ends once its job (if any) has (the engines are stopped by the
        server with its other models)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
