"""The plan of POST /v1/messages (and /v1/messages/count_tokens): Anthropic's conversation as
chat messages through the model's template, its tools and tool_choice as chat's, what this
server does not serve refused naming the field.

- `system` (text or text blocks) is the first system message. A system block that is Claude
  Code's billing header (`x-anthropic-billing-header: ...`, with a value that changes on every
  request) is left out: it is addressed to Anthropic's billing, and it would make every
  prompt's prefix new to the prefix cache.
- A user message's `tool_result` blocks are tool messages answering the `tool_use` of the same
  id (an `is_error` result's text is given as `Error: <text>`); its text blocks a user message.
- An assistant message's text blocks are its content, its `tool_use` blocks its calls (the
  input as JSON arguments), its thinking blocks its `reasoning_content`, which the template
  renders where it keeps earlier thinking (Qwen3's: after the last user message only).
- `thinking` sets the template's `enable_thinking` variable and `output_config.effort` its
  `reasoning_effort` (a template without them ignores them); the reply is the model's text as
  it writes it. `output_config.format` is structured outputs (chat's `response_format`).
- A conversation that ends with an assistant message is a prefill: the reply continues it.
- Images and documents are refused: the served models read text.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import ValidationError

from probserve.api.errors import APIError, bad_request
from probserve.api.plans.chat import Conversation, chat_plan, rendered_chat, tool_format
from probserve.api.plans.logprobs_ask import LogprobsAsk, reply_alternatives
from probserve.api.plans.plan import Plan
from probserve.api.protocol import (
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolCall,
    ToolChoice,
)
from probserve.api.protocol.messages import (
    CountTokensRequest,
    MediaBlock,
    MessageParam,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from probserve.api.server.state import Serving
from probserve.api.tools.ask import ToolAsk, check_answers, made_once, tool_ask
from probserve.engine import RequestError

BILLING_HEADER = "x-anthropic-billing-header:"


def _system(body: CountTokensRequest | MessagesRequest) -> ChatMessage | None:
    system = body.system
    if system is None:
        return None
    if isinstance(system, str):
        text = system
    else:
        text = "\n\n".join(b.text for b in system if not b.text.startswith(BILLING_HEADER))
    return ChatMessage(role="system", content=text) if text else None


def _result_text(block: ToolResultBlock) -> str:
    content = block.content or ""
    text = content if isinstance(content, str) else "".join(b.text for b in content)
    return f"Error: {text}" if block.is_error else text


def _user(m: MessageParam, i: int, calls: set[str]) -> list[ChatMessage]:
    """A user message's blocks in order: each run of text one user message, each tool_result
    a tool message."""
    assert not isinstance(m.content, str)
    out: list[ChatMessage] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append(ChatMessage(role=m.role, content="".join(texts)))
            texts.clear()

    for j, block in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            check_answers(calls, block.tool_use_id, "tool_result", "tool_use block",
                          f"{where}.tool_use_id")  # fmt: skip
            flush()
            out.append(
                ChatMessage(
                    role="tool", content=_result_text(block), tool_call_id=block.tool_use_id
                )
            )
        elif isinstance(block, ToolUseBlock):
            raise bad_request("a tool_use block belongs to an assistant message", f"{where}.type")
        else:
            _refuse_block(block, where)
    flush()
    return out


def _assistant(m: MessageParam, i: int, calls: set[str]) -> ChatMessage:
    assert not isinstance(m.content, str)
    texts: list[str] = []
    thoughts: list[str] = []
    made: list[ToolCall] = []
    for j, block in enumerate(m.content):
        where = f"messages[{i}].content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            made_once(calls, block.id, "tool_use block", f"{where}.id")
            arguments = json.dumps(block.input if block.input is not None else {})
            call = FunctionCall(name=block.name, arguments=arguments)
            made.append(ToolCall(id=block.id, function=call))
        elif isinstance(block, ToolResultBlock):
            raise bad_request("a tool_result block belongs to a user message", f"{where}.type")
        elif not isinstance(block, RedactedThinkingBlock):  # nothing a local model can read
            _refuse_block(block, where)
    return ChatMessage(
        role="assistant", content="".join(texts) or None, tool_calls=made or None,
        reasoning_content="".join(thoughts) if thoughts else None,
    )  # fmt: skip


def _refuse_block(block: MediaBlock | Any, where: str) -> None:
    raise bad_request(
        f"{block.type} content is not supported: the served model reads text", f"{where}.type"
    )


def chat_messages(body: CountTokensRequest | MessagesRequest) -> list[ChatMessage]:
    """The conversation as chat messages (the module's docstring says how)."""
    out: list[ChatMessage] = []
    system = _system(body)
    if system is not None:
        out.append(system)
    calls: set[str] = set()  # the tool_use ids made so far: a tool_result answers one of them
    for i, m in enumerate(body.messages):
        try:
            if isinstance(m.content, str):
                out.append(ChatMessage(role=m.role, content=m.content))
            elif m.role == "assistant":
                out.append(_assistant(m, i, calls))
            else:
                out += _user(m, i, calls)
        except ValidationError as exc:  # chat's own bounds on what the message became
            first = exc.errors()[0]
            raise bad_request(f"{first['msg']} (messages[{i}])", f"messages[{i}]") from None
    return out


def _prefilled(body: CountTokensRequest | MessagesRequest) -> bool:
    """The conversation ends with an assistant message: the reply continues it (a prefill)."""
    return body.messages[-1].role == "assistant"


def _tools(state: Serving, body: CountTokensRequest | MessagesRequest) -> ToolAsk | None:
    functions = []
    for i, t in enumerate(body.tools or ()):
        if t.type not in (None, "custom"):
            raise bad_request(
                f"tool type {t.type!r} is a server tool, which this server does not run: give "
                "client tools (a name and an input_schema)",
                f"tools[{i}].type",
            )
        if t.input_schema is None:
            raise bad_request("a tool needs an input_schema", f"tools[{i}].input_schema")
        functions.append(
            FunctionDefinition(
                name=t.name, description=t.description, parameters=t.input_schema,
                strict=t.strict,
            )
        )  # fmt: skip
    choice: ToolChoice | None = None
    parallel: bool | None = None
    asked = body.tool_choice
    if asked is not None:
        if asked.type == "tool":
            if asked.name is None:
                raise bad_request('tool_choice "tool" names the tool', "tool_choice.name")
            choice = NamedToolChoice(type="function", function=NamedFunction(name=asked.name))
        else:
            choice = {"auto": "auto", "any": "required", "none": "none"}[asked.type]  # type: ignore[assignment]
        if asked.disable_parallel_tool_use is not None:
            parallel = not asked.disable_parallel_tool_use
    if not functions:
        if asked is not None and asked.type != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    return tool_ask(functions, choice, parallel, tool_format(state), state.config.closed_schemas)


def _template_kwargs(body: CountTokensRequest | MessagesRequest) -> dict[str, Any]:
    """`thinking` as `enable_thinking`, `output_config.effort` as `reasoning_effort`."""
    kwargs: dict[str, Any] = {}
    config = body.output_config
    if config is not None and config.effort is not None:
        kwargs["reasoning_effort"] = config.effort
    thinking = body.thinking
    if thinking is None:
        return kwargs
    budget = thinking.budget_tokens
    if isinstance(body, MessagesRequest) and budget is not None and budget >= body.max_tokens:
        raise bad_request(
            "thinking.budget_tokens must be less than max_tokens", "thinking.budget_tokens"
        )
    return {**kwargs, "enable_thinking": thinking.type != "disabled"}


def messages_ask(state: Serving, body: MessagesRequest) -> LogprobsAsk:
    """`logprobs` + `top_logprobs`, as chat's."""
    return LogprobsAsk.of(state, body, reply_alternatives(state, body.logprobs, body.top_logprobs))


def _output_format(body: MessagesRequest) -> None:
    """`output_config.format` as chat's `response_format` (the one home of structured outputs:
    api/plans/grammar.py), refused beside another way of asking for one."""
    config = body.output_config
    if config is None or config.format is None:
        return
    if body.response_format is not None:
        raise bad_request(
            "output_config.format and response_format both constrain the reply: ask for one",
            "output_config.format",
        )
    schema = JsonSchemaFormat(name="output", schema=config.format.schema_)
    body.response_format = ResponseFormat(type="json_schema", json_schema=schema)


def _refuse_unserved(body: MessagesRequest) -> None:
    if body.stop_sequences is not None:
        if body.stop is not None:
            raise bad_request("stop_sequences and stop are one field: give one", "stop")
        body.stop = body.stop_sequences
    if body.n != 1:
        raise bad_request("n must be 1 for messages", "n")
    if body.return_routed_experts:
        raise bad_request(
            "return_routed_experts is served on /v1/completions and /v1/chat/completions",
            "return_routed_experts",
        )


def _conversation(state: Serving, body: MessagesRequest | CountTokensRequest) -> Conversation:
    """The conversation, system and tools as chat's; a final assistant message continued."""
    prefill = _prefilled(body)
    return Conversation(
        messages=chat_messages(body), tools=_tools(state, body), add_generation_prompt=not prefill,
        template_kwargs=_template_kwargs(body), continue_final=prefill,
    )  # fmt: skip


async def messages_plan(state: Serving, body: MessagesRequest) -> tuple[Plan, LogprobsAsk]:
    """The plan (errors naming the Messages API's fields) and the logprobs ask."""
    _refuse_unserved(body)
    _output_format(body)
    try:
        ask = messages_ask(state, body)
        thinking = body.thinking
        budget = thinking.budget_tokens if thinking and thinking.type != "disabled" else None
        conversation = _conversation(state, body)
        plan = await chat_plan(state, body, conversation, body.max_tokens, ask, budget)
    except (APIError, RequestError) as exc:
        raise in_messages_terms(exc, body) from None
    return plan, ask


async def counted_tokens(state: Serving, body: CountTokensRequest) -> int:
    """The prompt's tokens: the conversation, system and tools through the template."""
    try:
        prompt, _, _ = await rendered_chat(state, _conversation(state, body))
    except (APIError, RequestError) as exc:
        raise in_messages_terms(exc) from None
    return len(prompt.ids)


def in_messages_terms(
    exc: APIError | RequestError, body: CountTokensRequest | MessagesRequest | None = None
) -> APIError:
    """An error of the chat pipeline (or the engine's check) naming the Messages API's fields."""
    if isinstance(exc, RequestError):
        exc = APIError(400, str(exc), exc.param)
    config = body.output_config if body is not None else None
    named = exc.param or ""
    if config is not None and config.format is not None and named.startswith("response_format"):
        exc.param = "output_config.format" + named[len("response_format.json_schema") :]
        exc.message = exc.message.replace("response_format", "output_config.format")
    if exc.param is not None and re.match(r"stop(\[|$)", exc.param):
        exc.param = "stop_sequences" + exc.param[len("stop") :]
        exc.message = re.sub(r"\bstop\b", "stop_sequences", exc.message)
    return exc
