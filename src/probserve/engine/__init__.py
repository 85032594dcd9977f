"""Engine layer: token ids in, token ids and logprobs out."""

from probserve.engine.async_engine import AsyncEngine, RequestStream
from probserve.engine.config import EngineConfig
from probserve.engine.core import EngineCore
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

__all__ = [
    "AsyncEngine",
    "EngineConfig",
    "EngineCore",
    "EngineDead",
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
]
