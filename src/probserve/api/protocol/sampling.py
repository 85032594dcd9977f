"""The sampling fields every generating API takes (OpenAI's, vLLM's and probserve's), and the
structured-output asks."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field

from probserve.api.protocol.common import (
    INT64_MAX,
    INT64_MIN,
    MAX_FEW,
    MAX_ITEMS,
    Float,
    IdLists,
    Ids,
    Int,
    JsonValue,
    RequestModel,
    ShortIds,
    Text,
    Texts,
    entries,
)
from probserve.engine import LogprobsMode


class JsonSchemaFormat(RequestModel):
    """OpenAI's `response_format.json_schema` (and the Responses API's `text.format`)."""

    name: Text = "response"
    description: Text | None = None
    schema_: JsonValue = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(RequestModel):
    """vLLM's `structured_outputs`: one of a JSON schema, a regex, a choice of strings or a
    grammar (Lark, llguidance's dialect; GBNF is converted)."""

    json_: JsonValue = Field(None, alias="json")
    regex: Text | None = None
    choice: Texts | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class StreamOptions(RequestModel):
    include_usage: bool = False
    # vLLM's: usage (the tokens so far) on every chunk, not only on a final one
    continuous_usage_stats: bool = False


def _logprobs_mode(value: Any) -> Any:
    """vLLM's raw_logits / processed_logits name logits, which no probserve answer holds."""
    if value in ("raw_logits", "processed_logits"):
        raise ValueError(
            f"{value} (logits) is not available: probserve returns log-probabilities: raw "
            "(raw_logprobs), processed (processed_logprobs) or both"
        )
    return value


class SamplingFields(RequestModel):
    """Fields shared by completions and chat."""

    # transformers' generate() names, which lm-evaluation-harness passes through
    renamed: ClassVar[dict[str, str]] = {"min_new_tokens": "min_tokens"}

    model: Text | None = None
    n: Int = Field(1, ge=1)
    temperature: Float | None = Field(None, ge=0.0, le=2.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[Text, Float], entries(MAX_ITEMS)] | None = None
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Text | Texts | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # accepted with no effect (docs/logprobs.md): who asked, and what OpenAI would keep
    user: Text | None = None
    metadata: Annotated[dict[Text, Text], entries(MAX_FEW)] | None = None
    store: Literal[False] | None = None  # nothing is stored: store true is a 400
    # structured outputs (api/plans/grammar.py): OpenAI's, vLLM's, and vLLM's older names
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: JsonValue = None
    guided_regex: Text | None = None
    guided_choice: Texts | None = None
    guided_grammar: Text | None = None
    # vendor extensions (vLLM's names)
    top_k: Int | None = Field(None, ge=-1)
    min_p: Float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: Float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: Int = Field(0, ge=0)
    stop_token_ids: ShortIds | None = None
    logprobs_mode: Annotated[LogprobsMode, BeforeValidator(_logprobs_mode)] | None = None
    skip_special_tokens: bool = True
    # probserve's extensions: the logprobs of exactly these ids at every position, and the
    # exact entropy of every position's full distribution
    logprob_token_ids: ShortIds | None = None
    return_entropy: bool = False
    # vLLM's: logprobs name tokens `token_id:N`; the answer holds the prompt's and the
    # completion's token ids
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    # probserve's: a mixture of experts' routing of every token (docs/logprobs.md)
    return_routed_experts: bool = False
    # probserve's: speculative decoding (prompt lookup) on or off for this request (null: the
    # server's --speculative); the answer is the same bits either way
    speculative: bool | None = None


PromptType = Text | Texts | Ids | IdLists
