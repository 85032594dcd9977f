"""OpenAI protocol models, defined once: requests, responses, stream chunks and errors.

Field names and types follow OpenAI's API reference. Vendor fields vLLM users send are accepted
too (top_k, min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids, logprobs_mode,
prompt_logprobs, skip_special_tokens, structured_outputs and the older guided_*), and another
server's spelling of a field with the same meaning is taken as that field (`_Request.renamed`:
max_new_tokens, min_new_tokens). A field this server does not implement is kept in the model's
extras, never silently ignored: api/server/fields.py names it back (a header, the access line, a
counter), or refuses it with --strict-fields (docs/operations.md, "Unknown fields").
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    model_validator,
)
from pydantic_core import PydanticCustomError

from probserve.engine import LogprobsMode

# the range of a 64-bit signed integer: seeds and other integers past it are a 400
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Parse-time bounds (docs/operations.md, "Parse-time bounds"): the most entries any list or map
# of a request may hold. pydantic counts a list's items as it validates them and `fail_fast`
# ends a list at its first bad item (one error, not one per item), so a list past its bound
# costs at most bound + 1 item checks and one error, whatever its length or its items' types.
# They are fixed ceilings above the runtime limits (api/server/limits.py, checked after parsing): a
# limit flag set past its ceiling has no effect beyond it.
MAX_IDS = 2**20  # token ids in one prompt, query, item or /detokenize call
MAX_ITEMS = 4096  # prompts, items, messages, content parts, stop strings and ids, target and
# label ids, positions, logit_bias entries
MAX_FEW = 64  # include, tools, metadata, text, chat_template_kwargs keys
MAX_JSON_VALUES = 10_000  # values in all of chat_template_kwargs, nested ones included
MAX_UNKNOWN = 16  # fields one object may hold that this server does not implement


def _utf8(text: str) -> str:
    """Reject strings that cannot be encoded as UTF-8 (JSON escapes of lone surrogates such as
    "\\ud800"): no tokenizer, template or response could carry them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"the string holds a lone surrogate (U+{ord(text[exc.start]):04X}), which is not "
            "valid Unicode"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]


def _no_bool(value: Any) -> Any:
    """JSON's true and false are no numbers to a client (pydantic would take them as 1 and 0):
    a 400 naming the field, whose message says so."""
    if isinstance(value, bool):
        raise ValueError(f"{json.dumps(value)} is a boolean, not a number")
    return value


# A request's numbers, strictly: an integer field takes a JSON integer (true, false, 2.0 and
# "2" are a 400 naming it, as OpenAI answers them), a number field a JSON number (an integer
# or not; true, false and "0.5" are a 400)
Int = Annotated[int, Strict(), BeforeValidator(_no_bool)]
Float = Annotated[float, Strict(), BeforeValidator(_no_bool)]

MAX_JSON_DEPTH = 32  # nesting of any JSON value a request holds, or a JSON text it holds


def _depth_within(value: Any, most: int) -> bool:
    """Whether `value` nests at most `most` levels (iterative: any depth is safe to ask)."""
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if d > most:
            return False
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return True


def _json_text(text: str) -> str:
    """A string a request's server may parse as JSON (a call's arguments, a tool's result, a
    schema as text): if it is JSON, nested at most MAX_JSON_DEPTH deep. Text that is not JSON
    is left as it is (a model's malformed arguments, a plain result)."""
    if text.lstrip()[:1] not in ("{", "["):
        return text
    try:
        value = json.loads(text)
    except RecursionError:
        raise ValueError(
            f"the JSON text is nested more than {MAX_JSON_DEPTH} levels deep"
        ) from None
    except ValueError:
        return text
    if not _depth_within(value, MAX_JSON_DEPTH):
        raise ValueError(f"the JSON text is nested more than {MAX_JSON_DEPTH} levels deep")
    return text


JsonText = Annotated[str, AfterValidator(_utf8), AfterValidator(_json_text)]


def _json_utf8(value: Any, depth: int = 0, seen: list[int] | None = None) -> Any:
    """Every string (keys included) of a JSON value is valid Unicode, nesting at most 32 deep,
    at most MAX_JSON_VALUES values in all."""
    seen = [0] if seen is None else seen
    if depth == 0 and isinstance(value, str):  # a schema given as JSON text
        _json_text(value)
    seen[0] += 1
    if seen[0] > MAX_JSON_VALUES:
        raise ValueError(f"the value holds more than {MAX_JSON_VALUES} values")
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"the value is nested more than {MAX_JSON_DEPTH} levels deep")
    if isinstance(value, str):
        _utf8(value)
    elif isinstance(value, list):
        for v in value:
            _json_utf8(v, depth + 1, seen)
    elif isinstance(value, dict):
        for k, v in value.items():
            _utf8(k)
            _json_utf8(v, depth + 1, seen)
    return value


def _bounded(most: int) -> Any:
    """A list of at most `most` items, refused while it is parsed, at its first bad item."""
    return Field(max_length=most, fail_fast=True)


def _entries(most: int) -> Any:
    """A map of at most `most` entries, counted before any entry is validated (pydantic checks
    a dict's length only after validating every entry, with one error per bad one)."""

    def check(value: Any) -> Any:
        if isinstance(value, dict) and len(value) > most:
            raise ValueError(f"at most {most} entries (got {len(value)})")
        return value

    return BeforeValidator(check)


Ids = Annotated[list[Int], _bounded(MAX_IDS)]  # a prompt's token ids
IdLists = Annotated[list[Ids], _bounded(MAX_ITEMS)]
Texts = Annotated[list[Text], _bounded(MAX_ITEMS)]
ShortIds = Annotated[list[Int], _bounded(MAX_ITEMS)]  # stop, target and label ids, positions


class _Request(BaseModel):
    """A request object. JSON's non-standard NaN/Infinity literals are refused: every float is
    finite. A field this server does not implement is kept in `model_extra` (api/server/fields.py
    names it back or refuses it); more than MAX_UNKNOWN of them in one object is a 400 before
    any field is validated, so a body of 300,000 unknown keys costs one pass over its keys."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)
    # another server's name for one of this object's fields, with the same meaning
    renamed: ClassVar[dict[str, str]] = {}
    # an older name of this API's for one of its fields (chat's max_tokens for
    # max_completion_tokens): both fields are kept, and given together they must agree
    older: ClassVar[dict[str, str]] = {}
    _known: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        names = {n for n, f in cls.model_fields.items()} | {
            f.alias for f in cls.model_fields.values() if f.alias
        }
        cls._known = frozenset(names | set(cls.renamed))

    @model_validator(mode="before")
    @classmethod
    def _fields_first(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        unknown = 0
        for key in data:
            if key not in cls._known:
                unknown += 1
                if unknown > MAX_UNKNOWN:
                    raise PydanticCustomError(
                        "too_many_unknown_fields",
                        "the object holds more than {most} fields this server does not "
                        "implement (the 17th: {param})",
                        {"most": MAX_UNKNOWN, "param": str(key)[:64]},
                    )
        renamed = [k for k in cls.renamed if k in data]
        given: dict[str, str] = {}  # a field -> another server's name it was given under
        if renamed:
            data = dict(data)
        for other in renamed:
            ours = cls.renamed[other]
            value = data.pop(other)
            if ours in data and data[ours] != value:
                raise _conflict(other, ours)
            data[ours] = value
            given[ours] = other
        for old, ours in cls.older.items():
            both = data.get(old) is not None and data.get(ours) is not None
            if both and data[old] != data[ours]:
                if ours in given:  # given under another server's name: that one is named
                    raise _conflict(given[ours], old)
                raise _conflict(old, ours)
        return data


def _conflict(param: str, ours: str) -> PydanticCustomError:
    """Two names of one field given different values: a 400 naming `param` (the other name)."""
    return PydanticCustomError(
        "field_conflict",
        "{param} is another name for {ours}, and the two disagree",
        {"param": param, "ours": ours},
    )


JsonValue = Annotated[Any, AfterValidator(_json_utf8)]  # bounded in size and depth


class JsonSchemaFormat(_Request):
    """OpenAI's `response_format.json_schema` (and the Responses API's `text.format`)."""

    name: Text = "response"
    description: Text | None = None
    schema_: JsonValue = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs`: one of a JSON schema, a regex, a choice of strings or a
    grammar (Lark, llguidance's dialect; GBNF is converted)."""

    json_: JsonValue = Field(None, alias="json")
    regex: Text | None = None
    choice: Texts | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class StreamOptions(_Request):
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


class SamplingFields(_Request):
    """Fields shared by completions and chat."""

    # transformers' generate() names, which lm-evaluation-harness passes through
    renamed: ClassVar[dict[str, str]] = {"min_new_tokens": "min_tokens"}

    model: Text | None = None
    n: Int = Field(1, ge=1)
    temperature: Float | None = Field(None, ge=0.0, le=2.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[Text, Float], _entries(MAX_ITEMS)] | None = None
    seed: Int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Text | Texts | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # accepted with no effect (docs/logprobs.md): who asked, and what OpenAI would keep
    user: Text | None = None
    metadata: Annotated[dict[Text, Text], _entries(MAX_FEW)] | None = None
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


class CompletionRequest(SamplingFields):
    renamed: ClassVar[dict[str, str]] = {**SamplingFields.renamed, "max_new_tokens": "max_tokens"}
    prompt: PromptType
    max_tokens: Int | None = Field(16, ge=0)
    logprobs: Int | None = Field(None, ge=0)
    echo: bool = False
    best_of: Int | None = Field(None, ge=1)
    suffix: Text | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class FunctionCall(_Request):
    """A call's function: its name and its arguments as the model wrote them (JSON text)."""

    name: Text
    arguments: JsonText


class ToolCall(_Request):
    """A tool call: in an assistant message sent back, and in a reply."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionDefinition(_Request):
    name: FunctionName
    description: Text | None = None
    parameters: JsonValue = None  # a JSON schema of the arguments (None: no arguments)
    strict: bool | None = None  # the arguments follow the schema (a grammar enforces it)


class ChatTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: Text


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | Annotated[list[TextPart], _bounded(MAX_ITEMS)] | None = None
    name: Text | None = None
    tool_calls: Annotated[list[ToolCall], _bounded(MAX_FEW)] | None = None  # an assistant's
    tool_call_id: Text | None = None  # a tool message's: the call it answers
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
                _json_text(text)
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
        Annotated[dict[str, Any], _entries(MAX_FEW), AfterValidator(_json_utf8)] | None
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


# ---- responses ---------------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's: of the prompt tokens, those the prefix cache held (not computed again)
    prompt_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details={"cached_tokens": cached_tokens},
        )


def _absent(value: object) -> bool:
    return value is None


def Extension(default: Any = None) -> Any:
    """A field of probserve's own: left out of the JSON unless the request asked for it."""
    return Field(default, exclude_if=_absent)


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


def _now() -> int:
    return int(time.time())


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TargetLogprob(BaseModel):
    id: int
    token: str
    logprob: float


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]
    target_logprobs: list[TargetLogprob] | None = Extension()
    entropy: float | None = Extension()
    processed_logprob: float | None = Extension()
    processed_top_logprobs: list[TopLogprob] | None = Extension()
    constraint_logmass: float | None = Extension()  # a grammar's requests


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None
    refusal: list[ChatLogprobEntry] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = Extension()


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


class ContinuationScore(BaseModel):
    """Chat `echo`: the final assistant message scored as a continuation."""

    content: list[ChatLogprobEntry]
    logprob_sum: float
    is_greedy: bool  # every token was the most likely one


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "grammar_limit"] | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None
    prompt_token_sources: list[PromptTokenSource] | None = Extension()
    prompt_entropy: list[float | None] | None = Extension()  # with return_entropy
    prompt_target_logprobs: list[list[TargetLogprob] | None] | None = Extension()
    continuation: ContinuationScore | None = Extension()
    token_ids: list[int] | None = Extension()  # vLLM's, with return_token_ids
    routed_experts: RoutedList | None = Extension()  # with return_routed_experts
    prompt_routed_experts: RoutedList | None = Extension()  # and prompt_logprobs


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = Extension()  # vLLM's, with return_token_ids


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = Extension()


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls", "grammar_limit"] | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = Extension()
    prompt_token_sources: list[PromptTokenSource] | None = Extension()
    prompt_entropy: list[float | None] | None = Extension()
    prompt_target_logprobs: list[list[TargetLogprob] | None] | None = Extension()
    token_ids: list[int] | None = Extension()  # the delta's, with return_token_ids
    routed_experts: RoutedList | None = Extension()  # the delta's tokens'
    prompt_routed_experts: RoutedList | None = Extension()  # in a choice's first chunk


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Extension()  # the first chunk's, with return_token_ids


# ---- models, tokenizer, errors ----------------------------------------------------------------


class RoutedShape(BaseModel):
    """A mixture of experts' routing as return_routed_experts gives it: the MoE layers (the
    rows of each token's arrays) and the experts a token goes to (the columns)."""

    layers: list[int]
    experts_per_token: int


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "probserve"
    root: str | None = None  # the model this name serves (its first name)
    max_model_len: int | None = None
    # what a request that sets no budget generates at most (--max-tokens-default; null: the context)
    max_tokens_default: int | None = None
    status: str = "ok"  # the model's engine: ok, stuck, dead or restarting (see /health)
    replicas: int | None = None  # on Ray Serve: the model's replicas answering (see /health)
    # what runs how (see /health): absent before the engine has said
    architecture: str | None = None
    runner: str | None = None
    device: str | None = None  # cpu, cuda (the GPU path), interpreted
    precision: str | None = None  # the GPU path's weights: exact or bf16
    deterministic: bool | None = None
    weights: str | None = None
    weights_in_blocks: float | None = None
    block_sums: bool | None = None
    products: str | None = None
    kernel_isa: str | None = None
    routed_experts: RoutedShape | None = None  # a mixture of experts: what routing holds
    speculative: str | None = None  # requests' default speculative decoding ("off", "ngram")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], _bounded(MAX_ITEMS)] | None = None
    tools: Annotated[list[ChatTool], _bounded(MAX_FEW)] | None = None  # with messages
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[Int, Field(ge=0)]] = _bounded(MAX_IDS)


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    eos_token: str | None
    bos_token: str | None
    pad_token: str | None
    unk_token: str | None
    eos_token_id: int | None
    bos_token_id: int | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- responses (OpenAI's Responses API) --------------------------------------------------------

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputText(_Request):
    type: Literal["input_text", "output_text", "text"] = "input_text"
    text: Text


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[InputText], _bounded(MAX_ITEMS)]


class ResponseTextFormat(JsonSchemaFormat):
    """The Responses API's `text.format`: text, json_object, or a json_schema inline."""

    type: Literal["text", "json_object", "json_schema"] = "text"


class FunctionCallInput(_Request):
    """A call the model made earlier, sent back as an input item."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: JsonText
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputInput(_Request):
    """A call's result, as an input item."""

    type: Literal["function_call_output"]
    call_id: Text
    output: JsonText  # rendered as its JSON value where the template takes results so
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = Annotated[
    InputMessage | FunctionCallInput | FunctionCallOutputInput, Field(union_mode="left_to_right")
]


class ResponsesFunctionTool(_Request):
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


class ResponsesNamedToolChoice(_Request):
    type: Literal["function"]
    name: Text


class ResponseText(_Request):
    format: ResponseTextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the one a model without the notion has


class Reasoning(_Request):
    """The Responses API's `reasoning` (and what inspect-ai's start-up probe sends): accepted
    with no effect, as the models served write no reasoning items (docs/logprobs.md)."""

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(SamplingFields):
    renamed: ClassVar[dict[str, str]] = {
        **SamplingFields.renamed,
        "max_new_tokens": "max_output_tokens",
    }
    input: Text | Annotated[list[InputItem], _bounded(MAX_ITEMS)]
    instructions: Text | None = None
    max_output_tokens: Int | None = Field(None, ge=1)
    top_logprobs: Int | None = Field(None, ge=0)
    include: Annotated[list[Text], _bounded(MAX_FEW)] | None = None
    previous_response_id: Text | None = None
    tools: Annotated[list[ResponsesFunctionTool], _bounded(MAX_FEW)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: ResponseText | None = None
    # what probserve does anyway: a prompt past the context is a 400, never cut; the answer
    # comes in this request, never in the background
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None
    reasoning: Reasoning | None = None


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
    created_at: int = Field(default_factory=_now)
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    model: str
    output: list[ResponseOutputMessage | ResponseFunctionCall]
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


# ---- /v1/score (SGLang's scoring API) ----------------------------------------------------------


class ScoreRequest(_Request):
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


# ---- /v1/embeddings (OpenAI's) -------------------------------------------------------------------


class EmbeddingRequest(_Request):
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


# ---- /v1/rerank (Jina's and Cohere's shape, as vLLM and llama-server serve it) ---------------


class RerankDocument(_Request):
    """A document given as an object (Cohere's): its text (another key is named back or
    refused, as any unknown field)."""

    text: Text


class RerankRequest(_Request):
    model: Text | None = None
    query: Text
    documents: Annotated[list[Text | RerankDocument], _bounded(MAX_ITEMS)]
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


# ---- /v1/distributions (probserve) -------------------------------------------------------------


class DistributionsRequest(_Request):
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
