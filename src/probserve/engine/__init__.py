"""Engine layer: token ids in, token ids and logprobs out.

The engine core and its inline client (`EngineCore`, `AsyncEngine`) load torch, so they are
imported on first use: the API server process, whose engines run in worker processes, imports
the types, the clients and the wire format alone and never loads torch (a few hundred MB).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from probserve.engine.client import EngineClient, RequestStream
from probserve.engine.config import ClientLimits, EngineConfig
from probserve.engine.info import EngineInfo
from probserve.engine.stats import EngineStats
from probserve.engine.types import (
    EngineDead,
    EngineOutput,
    EngineOverloaded,
    EngineRequest,
    FinishReason,
    LogprobsMode,
    LogprobsSpec,
    RequestError,
    RoutedExperts,
    RoutingSpec,
    SamplingParams,
    TokenLogprobs,
)
from probserve.engine.worker_client import WorkerEngine

if TYPE_CHECKING:
    from probserve.engine.async_engine import AsyncEngine
    from probserve.engine.core.engine import EngineCore

_WITH_TORCH = {
    "AsyncEngine": "probserve.engine.async_engine",
    "EngineCore": "probserve.engine.core.engine",
}


def __getattr__(name: str) -> Any:
    if name in _WITH_TORCH:
        import importlib

        return getattr(importlib.import_module(_WITH_TORCH[name]), name)
    raise AttributeError(f"module 'probserve.engine' has no attribute {name!r}")


__all__ = [
    "AsyncEngine",
    "ClientLimits",
    "EngineClient",
    "EngineConfig",
    "EngineCore",
    "EngineDead",
    "EngineInfo",
    "EngineOutput",
    "EngineOverloaded",
    "EngineRequest",
    "EngineStats",
    "FinishReason",
    "LogprobsMode",
    "LogprobsSpec",
    "RequestError",
    "RequestStream",
    "RoutedExperts",
    "RoutingSpec",
    "SamplingParams",
    "TokenLogprobs",
    "WorkerEngine",
]
