"""The scoring APIs: /v1/score (SGLang's), /v1/rerank (Jina's and Cohere's shape) and
/v1/distributions (probserve's)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from probserve.api.protocol.common import (
    MAX_ITEMS,
    IdLists,
    Ids,
    Int,
    RequestModel,
    ShortIds,
    Text,
    Texts,
    Usage,
    bounded,
)


class ScoreRequest(RequestModel):
    model: Text | None = None
    query: Text | Ids
    items: Text | Texts | IdLists
    label_token_ids: ShortIds
    apply_softmax: bool = False
    item_first: bool = False


class ScoreResponse(BaseModel):
    object: Literal["scoring"] = "scoring"
    model: str
    scores: list[list[float]]
    usage: Usage


class RerankDocument(RequestModel):
    """A document given as an object (Cohere's): its text (another key is named back or
    refused, as any unknown field)."""

    text: Text


class RerankRequest(RequestModel):
    model: Text | None = None
    query: Text
    documents: Annotated[list[Text | RerankDocument], bounded(MAX_ITEMS)]
    top_n: Int | None = Field(None, ge=1)
    return_documents: bool = True


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankUsage(BaseModel):
    total_tokens: int
    prompt_tokens: int


class RerankResponse(BaseModel):
    id: str
    object: Literal["rerank"] = "rerank"
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class DistributionsRequest(RequestModel):
    model: Text | None = None
    prompt: Text | Ids
    positions: ShortIds | None = None  # None: every position of the prompt
    dtype: Literal["float32", "float16"] = "float32"
    encoding: Literal["base64", "binary"] | None = None  # None: binary if Accept asks for it


class DistributionsResponse(BaseModel):
    object: Literal["distributions"] = "distributions"
    model: str
    token_ids: list[int]
    positions: list[int]
    shape: list[int]
    dtype: Literal["float32", "float16"]
    data: str  # base64 of the row-major array
    usage: Usage
