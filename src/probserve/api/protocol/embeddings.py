"""/v1/embeddings (OpenAI's)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from probserve.api.protocol.common import Int, RequestModel, Text
from probserve.api.protocol.sampling import PromptType


class EmbeddingRequest(RequestModel):
    model: Text | None = None
    input: PromptType
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int | None = Field(None, ge=1)
    user: Text | None = None
    # probserve's: how the prompt's final hidden states are pooled (null: --pooling)
    pooling: Literal["mean", "last", "cls"] | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
