"""RayEngine: the EngineClient of the ingress for one model's Ray Serve deployment.

Each request becomes one streaming call through the deployment's handle (the prefix-aware
router picks the replica, router.py). `submit()` returns once a replica has accepted it; a full
deployment queue (`max_queued_requests`) is EngineOverloaded, so the client gets a 429 with
Retry-After in OpenAI's envelope, never Ray's plain 503.

Failover: when a replica dies (or is cut off) during a request, the request runs again on
another replica. Nothing the client has seen changes: the outputs it already has are replayed
and checked token by token (the engine's deterministic mode makes a request's numbers the same
bits wherever it runs; a sampled request without a seed gets one here, so its replay is the same
draw), and only what is new goes on. A request whose replay differs, or that has failed
`retries` times, ends with an error output: a stream then ends with an error event and [DONE].

Figures: a background task asks every replica for its engine's figures (`broadcast`) each
`poll` seconds; `stats()` sums them and `health()` is "dead" while no replica answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import secrets
import time
from typing import Any

from probserve.engine import (
    EngineClient,
    EngineOutput,
    EngineOverloaded,
    EngineRequest,
    RequestError,
    TokenLogprobs,
)
from probserve.engine.client import RequestStream
from probserve.engine.info import EngineInfo
from probserve.engine.stats import EngineStats

log = logging.getLogger(__name__)


def replica_failure(exc: BaseException) -> bool:
    """True for the errors of a replica that died or cannot be reached (a retry may succeed),
    False for an error of the request itself."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    return isinstance(
        exc, (RayActorError, ActorDiedError, ActorUnavailableError, DeploymentUnavailableError)
    )


@dataclasses.dataclass
class _Progress:
    """What the client has been given of one request (so that a replay gives nothing twice),
    and how much of it the current attempt has replayed."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    prompt_sent: bool = False
    prompt_routed_sent: bool = False
    replayed: int = 0

    def fresh(self, out: EngineOutput) -> EngineOutput | None:
        """`out` less what the client already has; None when nothing is new; an error output
        when the replay differs from what was given."""
        changes: dict[str, Any] = {}
        if out.prompt_logprobs is not None:
            if self.prompt_sent:
                changes["prompt_logprobs"] = None
            self.prompt_sent = True
        if out.prompt_routed is not None:
            if self.prompt_routed_sent:
                changes["prompt_routed"] = None
            self.prompt_routed_sent = True
        ids = list(out.new_token_ids)
        given = self.token_ids[self.replayed : self.replayed + len(ids)]
        if ids[: len(given)] != given:
            return EngineOutput.failure(
                out.request_id, "a replica failed and the request's replay on another differs"
            )
        self.replayed += len(given)
        if given:
            changes["new_token_ids"] = tuple(ids[len(given) :])
            if out.logprobs is not None:
                changes["logprobs"] = _rows_from(out.logprobs, len(given))
            if out.routed is not None:
                changes["routed"] = out.routed.span(len(given), len(out.routed))
        self.token_ids += ids[len(given) :]
        self.replayed += len(ids) - len(given)
        fresh = dataclasses.replace(out, **changes) if changes else out
        news = fresh.prompt_logprobs is not None or fresh.prompt_routed is not None
        if not fresh.new_token_ids and not news and not fresh.finished:
            return None
        return fresh


class RayEngine(EngineClient):
    def __init__(
        self,
        handle: Any,  # a DeploymentHandle of EngineReplica
        info: EngineInfo,
        max_pending: int = 1024,
        stall_timeout: float = 120.0,
        retries: int = 3,
        poll: float = 1.0,
    ) -> None:
        super().__init__(max_pending, stall_timeout)
        self.handle = handle
        self.info = info
        self.retries = retries
        self.poll = poll
        self.failovers = 0  # requests moved to another replica after a failure
        self.replicas: dict[str, EngineStats] = {}  # each replica's figures, last poll
        self._polled: float | None = None
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._accepted: dict[str, asyncio.Future[None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: asyncio.Task[None] | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to start: the replicas are Serve's. The figures' poller starts with the
        first request's event loop."""
        if self._poller is None:
            with contextlib.suppress(RuntimeError):  # no running loop yet
                self._loop = asyncio.get_running_loop()
                self._poller = self._loop.create_task(self._poll_forever())

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for task in list(self._tasks.values()):
            task.cancel()

    # ---- requests -------------------------------------------------------------------------
    async def submit(self, request: EngineRequest) -> RequestStream:
        """As EngineClient's, returning once a replica has accepted the request (a full queue:
        EngineOverloaded)."""
        sp = request.sampling
        if not sp.greedy and sp.seed is None:  # a replay on another replica draws the same
            seeded = dataclasses.replace(sp, seed=secrets.randbits(63))
            request = dataclasses.replace(request, sampling=seeded)
        stream = await super().submit(request)
        try:
            await self._accepted.pop(request.request_id)
        except BaseException:
            stream.close()
            raise
        return stream

    def _send(self, adds: list[EngineRequest], aborts: list[str]) -> None:
        loop = self._loop = self._loop or asyncio.get_running_loop()
        for request in adds:
            accepted: asyncio.Future[None] = loop.create_future()
            self._accepted[request.request_id] = accepted
            task = loop.create_task(self._run(request, accepted))
            self._tasks[request.request_id] = task
            task.add_done_callback(functools.partial(self._forget, request.request_id))
        for rid in aborts:
            running = self._tasks.get(rid)
            if running is not None:
                loop.call_soon_threadsafe(running.cancel)

    async def _run(self, request: EngineRequest, accepted: asyncio.Future[None]) -> None:
        """Carry one request to a replica and its outputs back; move it when a replica fails."""
        from ray.serve.exceptions import BackPressureError

        progress = _Progress()
        failures = 0
        while True:
            progress.replayed = 0
            call = self.handle.options(stream=True).generate.remote(request)
            try:
                async for event in call:
                    if event.output is None:  # the acknowledgement
                        if not accepted.done():
                            accepted.set_result(None)
                        continue
                    out = progress.fresh(event.output)
                    if out is not None:
                        self._deliver([out], None)
                    if event.output.finished:
                        return
                    if out is not None and out.finished:  # the replay differed: stop it
                        call.cancel()
                        return
                raise RuntimeError("the replica's stream ended without a finish reason")
            except asyncio.CancelledError:  # aborted (or the ingress stops): so is the call
                call.cancel()
                if not accepted.done():
                    accepted.cancel()
                raise
            except BackPressureError as exc:
                if not accepted.done():
                    accepted.set_exception(EngineOverloaded(f"the model is busy: {exc}"))
                else:
                    self._fail(request.request_id, f"the model is busy: {exc}")
                return
            except Exception as exc:
                if replica_failure(exc) and failures < self.retries:
                    failures += 1
                    self.failovers += 1
                    log.warning("request %s: replica failed (%s)", request.request_id, exc)
                    continue
                cause = getattr(exc, "cause", exc)
                if not accepted.done() and isinstance(cause, RequestError):
                    accepted.set_exception(cause)  # the replica refused it: the caller's error
                    return
                if not accepted.done():
                    accepted.set_result(None)
                self._fail(request.request_id, f"the model's replica failed: {exc}")
                return

    def _forget(self, request_id: str, _: asyncio.Task[None]) -> None:
        self._tasks.pop(request_id, None)

    def _fail(self, request_id: str, reason: str) -> None:
        log.error("request %s: %s", request_id, reason)
        self._deliver([EngineOutput.failure(request_id, reason)], None)

    # ---- figures ----------------------------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                results = await self.handle.broadcast("stats").results_async(
                    timeout_s=max(self.poll, 5.0), return_exceptions=True
                )
                self.replicas = {
                    str(i): r for i, r in enumerate(results) if isinstance(r, EngineStats)
                }
                self._polled = time.monotonic()
            await asyncio.sleep(self.poll)

    def stats(self) -> EngineStats:
        """The replicas' figures summed (their fractions averaged: `EngineStats.summed`), with
        this client's streams, the replicas answering and the failovers."""
        replicas = list(self.replicas.values())
        with self._lock:
            streams = len(self._streams)
        return dataclasses.replace(
            EngineStats.summed(replicas), streams=streams, replicas=len(replicas),
            failovers=self.failovers,
        )  # fmt: skip

    def _host_alive(self) -> str | None:
        if self._polled is not None and not self.replicas:
            return "no replica of this model is running"
        return None


def _rows_from(lp: TokenLogprobs, start: int) -> TokenLogprobs | None:
    """Rows `start`.. of `lp` (None when there are none)."""
    rows = [lp.row(j) for j in range(start, len(lp))]
    return TokenLogprobs.concat(rows) if rows else None
