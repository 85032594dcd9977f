"""OpenAI's Responses API (/v1/responses): input items, tools, reasoning, the response object."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field

from probserve.api.protocol.chat import ChatLogprobEntry, FunctionDefinition, FunctionName
from probserve.api.protocol.common import (
    MAX_FEW,
    MAX_ITEMS,
    Extension,
    Int,
    JsonText,
    JsonValue,
    RequestModel,
    Text,
    bounded,
    now,
)
from probserve.api.protocol.sampling import JsonSchemaFormat, SamplingFields

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputText(RequestModel):
    type: Literal["input_text", "output_text", "text"] = "input_text"
    text: Text


class InputMessage(RequestModel):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[InputText], bounded(MAX_ITEMS)]


class ResponseTextFormat(JsonSchemaFormat):
    """The Responses API's `text.format`: text, json_object, or a json_schema inline."""

    type: Literal["text", "json_object", "json_schema"] = "text"


class FunctionCallInput(RequestModel):
    """A call the model made earlier, sent back as an input item."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: JsonText
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputInput(RequestModel):
    """A call's result, as an input item."""

    type: Literal["function_call_output"]
    call_id: Text
    output: JsonText  # rendered as its JSON value where the template takes results so
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningTextInput(RequestModel):
    type: Literal["reasoning_text"]
    text: Text


class SummaryTextInput(RequestModel):
    type: Literal["summary_text"]
    text: Text


class ReasoningInput(RequestModel):
    """A reasoning item the reply had, sent back: the next assistant message's reasoning (the
    template renders it where it keeps earlier thinking)."""

    type: Literal["reasoning"]
    id: Text | None = None
    summary: Annotated[list[SummaryTextInput], bounded(MAX_FEW)] | None = None  # not rendered
    content: Annotated[list[ReasoningTextInput], bounded(MAX_FEW)] | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    encrypted_content: None = None  # nothing is encrypted here


InputItem = Annotated[
    InputMessage | FunctionCallInput | FunctionCallOutputInput | ReasoningInput,
    Field(union_mode="left_to_right"),
]


class ResponsesFunctionTool(RequestModel):
    """The Responses API's function tool (the definition's fields at the top level)."""

    type: Literal["function"]
    name: FunctionName
    description: Text | None = None
    parameters: JsonValue = None
    strict: bool | None = None

    def definition(self) -> FunctionDefinition:
        return FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters,
            strict=self.strict,
        )  # fmt: skip


class ResponsesNamedToolChoice(RequestModel):
    type: Literal["function"]
    name: Text


class ResponseText(RequestModel):
    format: ResponseTextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the one a model without the notion has


class Reasoning(RequestModel):
    """The Responses API's `reasoning` (and what inspect-ai's start-up probe sends): `effort`
    is the template's `reasoning_effort` variable ("none" also turns `enable_thinking` off);
    a thinking model's reasoning is a reasoning item as written (no summary is made)."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(SamplingFields):
    renamed: ClassVar[dict[str, str]] = {
        **SamplingFields.renamed,
        "max_new_tokens": "max_output_tokens",
    }
    input: Text | Annotated[list[InputItem], bounded(MAX_ITEMS)]
    instructions: Text | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    top_logprobs: Int | None = Field(None, ge=0)
    include: Annotated[list[Text], bounded(MAX_FEW)] | None = None
    previous_response_id: Text | None = None
    tools: Annotated[list[ResponsesFunctionTool], bounded(MAX_FEW)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseText | None = None
    # what probserve does anyway: a prompt past the context is a 400, never cut; the answer
    # comes in this request, never in the background
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    reasoning: Reasoning | None = None
    # a thinking model thinks at most this many tokens, then its thinking is ended (as chat's)
    thinking_budget: Int | None = Field(None, ge=1)


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = Field(default_factory=list)
    logprobs: list[ChatLogprobEntry] | None = None


class ResponseOutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[ResponseOutputText]


class ResponseReasoningText(BaseModel):
    """A thinking model's reasoning, as written; `logprobs`: its tokens' (probserve's)."""

    type: Literal["reasoning_text"] = "reasoning_text"
    text: str
    logprobs: list[ChatLogprobEntry] | None = Extension()


class ResponseReasoningItem(BaseModel):
    """The reasoning output item, before the message: its text one reasoning_text part."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ResponseReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseFunctionCall(BaseModel):
    """A call the reply makes (an output item); `logprobs`: its tokens' (probserve's)."""

    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]
    logprobs: list[ChatLogprobEntry] | None = Extension()


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "grammar_limit"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    model: str
    output: list[ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionCall]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    previous_response_id: None = None
    store: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    # vLLM's return_token_ids: the prompt's ids and (once done) the reply's
    prompt_token_ids: list[int] | None = Extension()
    token_ids: list[int] | None = Extension()
