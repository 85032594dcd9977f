"""EngineReplica: one replica of a model's Ray Serve deployment, holding one engine.

The replica loads the model, runs the engine on a thread of its own process (AsyncEngine) and
serves these calls through deployment handles: `info()` (the EngineInfo), `tokenizer()` (the
class of its tokenizer, for the ingress), `generate(request)`
(a stream of ReplicaEvents: first an acknowledgement, then the request's EngineOutputs, the last
one with this replica's figures) and `stats()`. Ray Serve calls `check_health()`: a dead or stuck
engine fails it, and Serve replaces the replica. Everything that crosses the handle is the
engine's own token-level types: text and OpenAI shapes stay in the ingress.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from probserve.engine import EngineConfig, EngineOutput, EngineRequest
from probserve.engine.info import EngineInfo
from probserve.engine.stats import EngineStats

if TYPE_CHECKING:  # the engine loads torch: imported where a replica starts, never in the
    # ingress, which imports this module to bind the deployment
    from probserve.engine import AsyncEngine
    from probserve.engine.core.engine import EngineCore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaEvent:
    """One item of a `generate` stream. The first has no output (the request was accepted);
    the last output's event carries the replica's engine figures (`EngineClient.stats`)."""

    replica: str  # which replica answered (its process id and host)
    output: EngineOutput | None = None
    stats: EngineStats | None = None


class EngineReplica:
    def __init__(
        self, spec: str, config: EngineConfig, max_pending: int = 1024, draft: str | None = None
    ) -> None:
        from probserve.engine import AsyncEngine
        from probserve.engine.core.host import start_engine

        started = time.monotonic()
        self.engine: AsyncEngine  # set by `warm`, on the engine's thread

        def warm(core: EngineCore) -> None:  # the engine's own thread warms it up
            self.engine = AsyncEngine(core, max_pending=max_pending)
            self.engine.start()

        self.tokenizer_class = start_engine(spec, config, warm, draft).tokenizer_class
        self.name = f"{os.uname().nodename}:{os.getpid()}"
        log.info("replica %s of %s ready in %.1f s", self.name, spec, time.monotonic() - started)

    async def info(self) -> EngineInfo:
        return self.engine.info

    async def tokenizer(self) -> str:
        """The tokenizer's class as AutoTokenizer chose it (models/loader.py: tokenizer_class),
        so the ingress loads the same one without torch."""
        return self.tokenizer_class

    async def stats(self) -> EngineStats:
        return self.engine.stats()

    async def describe(self) -> dict[str, object]:
        """Which replica this is (its name, process id and node) and its engine's figures, for
        operators and tests."""
        import ray

        return {
            "replica": self.name,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "stats": self.engine.stats().figures(),
        }

    async def generate(self, request: EngineRequest) -> AsyncIterator[ReplicaEvent]:
        """The request's outputs; leaving early (the caller cancelled) aborts it here."""
        stream = await self.engine.submit(request)
        try:
            yield ReplicaEvent(self.name)
            async for out in stream:
                stats = self.engine.stats() if out.finished else None
                yield ReplicaEvent(self.name, out, stats)
        finally:
            stream.close()

    def check_health(self) -> None:
        status, why = self.engine.health()
        if status != "ok":
            raise RuntimeError(f"engine {status}: {why}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()
