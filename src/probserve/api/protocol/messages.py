"""Anthropic's Messages API protocol models (POST /v1/messages and /v1/messages/count_tokens):
requests, responses and stream events, defined once.

Field names and types follow Anthropic's API reference. The request also takes probserve's
sampling extensions (api/protocol/sampling.py `SamplingFields`: seed, top_k, min_p,
logprob_token_ids, return_entropy, speculative, ...) and two logprobs fields of chat's (`logprobs`,
`top_logprobs`), since Anthropic's API has none (docs/logprobs.md, "The Messages API"). A field
this server does not implement is named back like any other (api/server/fields.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

from probserve.api.protocol.chat import ChatLogprobEntry, FunctionName
from probserve.api.protocol.common import (
    MAX_FEW,
    MAX_ITEMS,
    Extension,
    Float,
    Int,
    JsonValue,
    RequestModel,
    Text,
    Texts,
    bounded,
)
from probserve.api.protocol.sampling import SamplingFields


class CacheControl(RequestModel):
    """A prompt-caching breakpoint: accepted, and needless here: the prefix cache keeps every
    shared prefix without one (cache_read_input_tokens counts what it held)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(RequestModel):
    type: Literal["text"]
    text: Text
    cache_control: CacheControl | None = None
    # citations sent back with an assistant message this server wrote: it writes none
    citations: Annotated[list[Any], Field(max_length=0)] | None = None


class ToolUseBlock(RequestModel):
    """A call an assistant message made (sent back in the conversation)."""

    type: Literal["tool_use"]
    id: Text
    name: Text
    input: JsonValue = None
    cache_control: CacheControl | None = None


class ToolResultBlock(RequestModel):
    """A user message's answer to a call: text (or text blocks); `is_error` says it failed."""

    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | Annotated[list[TextBlock], bounded(MAX_ITEMS)] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(RequestModel):
    """An assistant's thinking, sent back in the conversation: the template's
    `reasoning_content` of that message (rendered where the template keeps earlier thinking;
    `signature` not checked: nothing here is signed)."""

    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None


class RedactedThinkingBlock(RequestModel):
    """Another server's encrypted thinking: nothing a local model can read."""

    type: Literal["redacted_thinking"]
    data: Text


class MediaBlock(RequestModel):
    """An image or a document: parsed so the refusal names it (the served models read text)."""

    type: Literal["image", "document"]
    source: JsonValue = None
    cache_control: CacheControl | None = None


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | MediaBlock,
    Field(discriminator="type"),
]
Blocks = Annotated[list[Block], bounded(MAX_ITEMS)]


class MessageParam(RequestModel):
    # "system": Claude Code's mid-conversation system messages, as a system message of chat's
    role: Literal["user", "assistant", "system"]
    content: Text | Blocks


class MessagesTool(RequestModel):
    """A client tool (`type` absent or "custom"); a server tool's type (web_search_..., bash_...)
    is refused naming it: this server runs no tool itself."""

    name: FunctionName
    description: Text | None = None
    input_schema: JsonValue = None
    type: Text | None = None
    strict: bool | None = None
    cache_control: CacheControl | None = None


class MessagesToolChoice(RequestModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(RequestModel):
    """Extended thinking: "enabled"/"adaptive" turn the template's thinking on (its
    `enable_thinking` variable), "disabled" off; `budget_tokens` is bounded by max_tokens."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int | None = Field(None, ge=1)


class OutputFormat(RequestModel):
    """Structured outputs: the reply is JSON following `schema` (a grammar enforces it)."""

    type: Literal["json_schema"]
    schema_: JsonValue = Field(alias="schema")


class OutputConfig(RequestModel):
    """`effort`: the template's `reasoning_effort` variable (as chat's reasoning_effort);
    `format`: structured outputs."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


System = Text | Annotated[list[TextBlock], bounded(MAX_ITEMS)]


class _Conversation(RequestModel):
    """What a prompt is made of: the messages, the system prompt and the tools."""

    model: Text | None = None  # as every route's: none names the one model served
    messages: list[MessageParam] = Field(min_length=1, max_length=MAX_ITEMS, fail_fast=True)
    system: System | None = None
    tools: Annotated[list[MessagesTool], Field(max_length=MAX_FEW, fail_fast=True)] | None = None
    tool_choice: MessagesToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # automatic prompt caching: accepted, and needless here (CacheControl)
    cache_control: CacheControl | None = None


class MessagesRequest(_Conversation, SamplingFields):
    max_tokens: Int = Field(ge=1)
    stop_sequences: Texts | None = None  # chat's `stop` (the plan moves them there)
    # Anthropic's temperature is 0..1 (its SDK sends sampling fields through extra_body)
    temperature: Float | None = Field(None, ge=0.0, le=1.0)
    # Anthropic's: a priority tier (one tier serves every request here)
    service_tier: Literal["auto", "standard_only"] | None = None
    # probserve's, as chat's: each output token's logprob, with `top_logprobs` alternatives
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0)


class CountTokensRequest(_Conversation):
    """POST /v1/messages/count_tokens: the prompt's tokens, nothing generated."""


# ---- answers -----------------------------------------------------------------------------------


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0  # the prompt's tokens the prefix cache held
    service_tier: Literal["standard"] = "standard"


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str
    citations: None = None
    logprobs: list[ChatLogprobEntry] | None = Extension()  # probserve's: the block's tokens


class ThinkingContent(BaseModel):
    """A thinking model's reasoning, as written (no signature: nothing here is encrypted)."""

    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""
    logprobs: list[ChatLogprobEntry] | None = Extension()  # probserve's: the block's tokens


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: Any
    logprobs: list[ChatLogprobEntry] | None = Extension()


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageObject(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ThinkingContent | TextContent | ToolUseContent]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessagesUsage
    # probserve's (return_token_ids): the prompt's and the reply's token ids
    prompt_token_ids: list[int] | None = Extension()
    token_ids: list[int] | None = Extension()


class CountTokensResponse(BaseModel):
    input_tokens: int
