"""Engine layer: token ids in, token ids and logprobs out."""

from probserve.engine.async_engine import AsyncEngine
from probserve.engine.client import EngineClient, RequestStream
from probserve.engine.config import EngineConfig
from probserve.engine.core import EngineCore
from probserve.engine.info import EngineInfo
from probserve.engine.types import (
    EngineDead,
    EngineOutput,
    EngineOverloaded,
    EngineRequest,
    FinishReason,
    LogprobsMode,
    LogprobsSpec,
    RequestError,
    SamplingParams,
    TokenLogprobs,
)
from probserve.engine.worker_client import WorkerEngine

__all__ = [
    "AsyncEngine",
    "EngineClient",
    "EngineConfig",
    "EngineCore",
    "EngineDead",
    "EngineInfo",
    "EngineOutput",
    "EngineOverloaded",
    "EngineRequest",
    "FinishReason",
    "LogprobsMode",
    "LogprobsSpec",
    "RequestError",
    "RequestStream",
    "SamplingParams",
    "TokenLogprobs",
    "WorkerEngine",
]
