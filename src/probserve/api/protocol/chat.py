"""/v1/chat/completions' request (messages, tools), response, stream chunks and logprobs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, Field, GetCoreSchemaHandler, model_validator
from pydantic_core import PydanticCustomError, core_schema

from probserve.api.protocol.common import (
    MAX_FEW,
    MAX_ITEMS,
    Extension,
    Int,
    JsonText,
    JsonValue,
    RequestModel,
    Text,
    Usage,
    bounded,
    entries,
    json_text,
    json_utf8,
    now,
)
from probserve.api.protocol.completions import RoutedList
from probserve.api.protocol.sampling import SamplingFields


class TextPart(RequestModel):
    type: Literal["text"]
    text: Text


class FunctionCall(RequestModel):
    """A call's function: its name and its arguments as the model wrote them (JSON text)."""

    name: Text
    arguments: JsonText


class ToolCall(RequestModel):
    """A tool call: in an assistant message sent back, and in a reply."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDefinition(RequestModel):
    name: FunctionName
    description: Text | None = None
    parameters: JsonValue = None  # a JSON schema of the arguments (None: no arguments)
    strict: bool | None = None  # the arguments follow the schema (a grammar enforces it)


class ChatTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: Text


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], bounded(MAX_ITEMS)] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[ToolCall], bounded(MAX_FEW)] | None = None  # an assistant's
    tool_call_id: Text | None = None  # a tool message's: the call it answers
    # an assistant's reasoning, sent back (vLLM's two names): the template's reasoning_content
    reasoning: Text | None = None
    reasoning_content: Text | None = None
    # what an SDK sends back with an assistant message it received: accepted when empty
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: Annotated[list[Any], Field(max_length=0)] | None = None

    @model_validator(mode="after")
    def _tool_result_bounded(self) -> ChatMessage:
        """A tool's result may be rendered as its JSON value: bounded like any JSON text."""
        if self.role == "tool" and self.content is not None:
            parts = self.content
            text = parts if isinstance(parts, str) else "".join(p.text for p in parts)
            try:
                json_text(text)
            except ValueError as exc:
                raise PydanticCustomError("value_error", str(exc), {"param": "content"}) from None
        return self


class ChatCompletionRequest(SamplingFields):
    renamed: ClassVar[dict[str, str]] = {
        **SamplingFields.renamed,
        "max_new_tokens": "max_completion_tokens",
    }
    older: ClassVar[dict[str, str]] = {"max_tokens": "max_completion_tokens"}
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_ITEMS, fail_fast=True)
    max_tokens: Int | None = Field(None, ge=0)
    max_completion_tokens: Int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: Int | None = Field(None, ge=0)
    prompt_logprobs: Int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    # vLLM's: the final assistant message is left open and the reply continues it
    continue_final_message: bool = False
    # probserve: score the final assistant message as a continuation (max_tokens 0)
    echo: bool = False
    # extra variables for the model's own chat template (never a template of the client's)
    chat_template_kwargs: (
        Annotated[dict[str, Any], entries(MAX_FEW), AfterValidator(json_utf8)] | None
    ) = None
    # tool calls (api/tools/): the functions the model may call, and whether it must
    tools: (
        Annotated[list[ChatTool], Field(min_length=1, max_length=MAX_FEW, fail_fast=True)] | None
    ) = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # accepted with no effect (docs/logprobs.md): one tier serves every request, the prefix
    # cache finds shared prefixes without a key; reasoning_effort is the chat template's
    # variable of that name (as vLLM passes it), which a template without reasoning ignores
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    prompt_cache_key: Text | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    # the template's `enable_thinking` variable (Qwen3's, as chat_template_kwargs sets it)
    enable_thinking: bool | None = None
    # a thinking model thinks at most this many tokens, then its thinking is ended (DashScope's)
    thinking_budget: Int | None = Field(None, ge=1)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TargetLogprob(BaseModel):
    id: int
    token: str
    logprob: float


class TargetRow:
    """One position's target-id logprobs (`TargetLogprob`s in JSON), held as the engine's row
    until the answer is written: a chat answer scoring 2,300 prompt positions x 256 ids holds
    2,300 of these rather than 588,800 models, whose garbage collection (each pass holding the
    GIL, so the event loop, in every thread) stalled the server for seconds. `values` are
    finite (logprobs_format.finite_row)."""

    __slots__ = ("ids", "tokens", "values")

    def __init__(self, ids: Sequence[int], tokens: Sequence[str], values: Sequence[float]):
        self.ids, self.tokens, self.values = ids, tokens, values

    def __len__(self) -> int:
        return len(self.ids)

    def entries(self) -> list[dict[str, Any]]:
        return [
            {"id": i, "token": t, "logprob": v}
            for i, t, v in zip(self.ids, self.tokens, self.values, strict=True)
        ]

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> Any:
        listed = handler.generate_schema(list[TargetLogprob])
        return core_schema.json_or_python_schema(
            json_schema=listed,
            python_schema=core_schema.union_schema([core_schema.is_instance_schema(cls), listed]),
            serialization=core_schema.plain_serializer_function_ser_schema(_target_entries),
        )


def _target_entries(value: TargetRow | list[TargetLogprob]) -> list[dict[str, Any]]:
    if isinstance(value, TargetRow):
        return value.entries()
    return [t.model_dump() for t in value]


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]
    target_logprobs: TargetRow | None = Extension()
    entropy: float | None = Extension()
    processed_logprob: float | None = Extension()
    processed_top_logprobs: list[TopLogprob] | None = Extension()
    constraint_logmass: float | None = Extension()  # a grammar's requests


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None
    refusal: list[ChatLogprobEntry] | None = None
    reasoning: list[ChatLogprobEntry] | None = Extension()  # a thinking model's reasoning's


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = Extension()
    # a thinking model's reasoning (vLLM's `reasoning`, and its older `reasoning_content`)
    reasoning: str | None = Extension()
    reasoning_content: str | None = Extension()


class FunctionCallDelta(BaseModel):
    name: str | None = Extension()
    arguments: str | None = Extension()


class ToolCallDelta(BaseModel):
    """A streamed tool call: its first delta has id, type and name; the rest add arguments."""

    index: int
    id: str | None = Extension()
    type: Literal["function"] | None = Extension()
    function: FunctionCallDelta


class PromptTokenSource(BaseModel):
    """Where a prompt token comes from: a message (its index and role) or the template."""

    message_index: int | None
    role: str  # the message's role, or "template"
    reasoning: bool = False  # inside a thinking span (a thinking model's; docs/logprobs.md)


class ContinuationScore(BaseModel):
    """Chat `echo`: the final assistant message scored as a continuation."""

    content: list[ChatLogprobEntry]
    logprob_sum: float
    is_greedy: bool  # every token was the most likely one
    # a thinking model's: per entry, whether it lies inside the message's thinking span
    reasoning: list[bool] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "grammar_limit"] | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_token_sources: list[PromptTokenSource] | None = Extension()
    prompt_entropy: list[float | None] | None = Extension()  # with return_entropy
    prompt_target_logprobs: list[TargetRow | None] | None = Extension()
    continuation: ContinuationScore | None = Extension()
    token_ids: list[int] | None = Extension()  # vLLM's, with return_token_ids
    routed_experts: RoutedList | None = Extension()  # with return_routed_experts
    prompt_routed_experts: RoutedList | None = Extension()  # and prompt_logprobs


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = Extension()  # vLLM's, with return_token_ids


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Extension()
    reasoning: str | None = Extension()  # the reasoning this chunk adds (and its older name)
    reasoning_content: str | None = Extension()


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "grammar_limit"] | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = Extension()
    prompt_token_sources: list[PromptTokenSource] | None = Extension()
    prompt_entropy: list[float | None] | None = Extension()
    prompt_target_logprobs: list[TargetRow | None] | None = Extension()
    token_ids: list[int] | None = Extension()  # the delta's, with return_token_ids
    routed_experts: RoutedList | None = Extension()  # the delta's tokens'
    prompt_routed_experts: RoutedList | None = Extension()  # in a choice's first chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = Extension()  # the first chunk's, with return_token_ids
