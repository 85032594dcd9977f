"""/v1/completions' request, response and logprobs (OpenAI's legacy completions)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from probserve.api.protocol.common import Extension, Int, Text, Usage, now
from probserve.api.protocol.sampling import PromptType, SamplingFields


class CompletionRequest(SamplingFields):
    renamed: ClassVar[dict[str, str]] = {**SamplingFields.renamed, "max_new_tokens": "max_tokens"}
    prompt: PromptType
    max_tokens: Int | None = Field(16, ge=0)
    logprobs: Int | None = Field(None, ge=0)
    echo: bool = False
    best_of: Int | None = Field(None, ge=1)
    suffix: Text | None = None


class ProcessedLogprobs(BaseModel):
    """logprobs_mode "both": the processed figures beside the raw ones (None: a prompt token)."""

    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]
    target_logprobs: list[dict[str, float] | None] | None = Extension()  # id -> logprob
    entropy: list[float | None] | None = Extension()
    processed: ProcessedLogprobs | None = Extension()
    constraint_logmass: list[float | None] | None = Extension()  # a grammar's requests


class RoutedExpertsEntry(BaseModel):
    """One token's routing (return_routed_experts): base64 of little-endian int16 `experts`
    and float32 `weights`, each row-major [moe_layers, experts_per_token]."""

    experts: str
    weights: str


RoutedList = list[RoutedExpertsEntry | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "grammar_limit"] | None = None
    # vLLM's, with return_token_ids (a stream: the prompt's in a choice's first chunk)
    prompt_token_ids: list[int] | None = Extension()
    token_ids: list[int] | None = Extension()
    # probserve's, with return_routed_experts: one entry per token of token_ids (the prompt's:
    # null for its first token, which no row scored)
    routed_experts: RoutedList | None = Extension()
    prompt_routed_experts: RoutedList | None = Extension()


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
