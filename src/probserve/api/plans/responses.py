"""The plan of POST /v1/responses: `input` and `instructions` as chat messages, what this
server does not serve refused, and the errors of the shared chat pipeline named in Responses
terms. Logprobs are on when `include` holds "message.output_text.logprobs" or `top_logprobs`
is set (an explicit `"top_logprobs": null` with the include gives 0 alternatives)."""

from __future__ import annotations

from probserve.api.errors import APIError, bad_request
from probserve.api.plans.chat import Conversation, chat_plan, thinking_kwargs, tool_format
from probserve.api.plans.logprobs_ask import LogprobsAsk, capped
from probserve.api.plans.plan import Plan
from probserve.api.protocol import (
    LOGPROBS_INCLUDE,
    ChatMessage,
    FunctionCall,
    FunctionCallInput,
    FunctionCallOutputInput,
    InputMessage,
    NamedFunction,
    NamedToolChoice,
    ReasoningInput,
    ResponsesNamedToolChoice,
    ResponsesRequest,
    ToolCall,
    ToolChoice,
)
from probserve.api.server.state import Serving
from probserve.api.tools.ask import ToolAsk, check_answers, made_once, tool_ask
from probserve.engine import RequestError


def _messages(body: ResponsesRequest) -> list[ChatMessage]:
    """`instructions` and `input` as chat messages: a run of function_call items is one
    assistant message with those calls, a function_call_output a tool message."""
    out: list[ChatMessage] = []
    if body.instructions:
        out.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        out.append(ChatMessage(role="user", content=body.input))
        return out
    calls: set[str] = set()  # the call ids made so far: an output answers one of them
    thought: str | None = None  # a reasoning item's text: the next assistant message's
    for i, item in enumerate(body.input):
        if isinstance(item, ReasoningInput):
            parts = item.content or ()
            thought = (thought or "") + "".join(p.text for p in parts)
            continue
        if thought is not None and _assistant_item(item):
            out.append(ChatMessage(role="assistant", reasoning_content=thought))
            thought = None
        if isinstance(item, FunctionCallInput):
            made_once(calls, item.call_id, "function_call item", f"input[{i}].call_id")
            call = ToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments)
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.content is None:
                last.tool_calls = [*(last.tool_calls or ()), call]
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputInput):
            check_answers(calls, item.call_id, "function_call_output", "function_call item",
                          f"input[{i}].call_id")  # fmt: skip
            out.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
        else:
            content = item.content
            text = content if isinstance(content, str) else "".join(p.text for p in content)
            last = out[-1] if out else None
            if item.role == "assistant" and last is not None and _reasoning_only(last):
                last.content = text  # the reasoning item before it was its thinking
            else:
                out.append(ChatMessage(role=item.role, content=text))
    if not out:
        raise bad_request("input holds no message", "input")
    return out


def _assistant_item(item: object) -> bool:
    """An item the assistant said (its message or a call): a reasoning item before it is its."""
    return isinstance(item, FunctionCallInput) or (
        isinstance(item, InputMessage) and item.role == "assistant"
    )


def _reasoning_only(message: ChatMessage) -> bool:
    """An assistant message holding a reasoning item's text alone (so far)."""
    return (
        message.role == "assistant"
        and message.reasoning_content is not None
        and message.content is None
        and not message.tool_calls
    )


def _tools(state: Serving, body: ResponsesRequest) -> ToolAsk | None:
    asked = body.tool_choice
    choice: ToolChoice | None = (
        NamedToolChoice(type="function", function=NamedFunction(name=asked.name))
        if isinstance(asked, ResponsesNamedToolChoice)
        else asked
    )
    functions = [t.definition() for t in body.tools] if body.tools else None
    return tool_ask(
        functions, choice, body.parallel_tool_calls, tool_format(state), state.config.closed_schemas
    )


# what `include` may name: the logprobs, and the reasoning items' encrypted content (which
# inspect-ai always asks for): no model served writes reasoning items, so it adds nothing
INCLUDES = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content"})


def _refuse_unserved(body: ResponsesRequest) -> None:
    if body.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: this server stores no responses; send the "
            "whole conversation as input",
            "previous_response_id",
        )
    if body.n != 1:
        raise bad_request("n must be 1 for responses", "n")
    if body.return_routed_experts:
        raise bad_request(
            "return_routed_experts is served on /v1/completions and /v1/chat/completions",
            "return_routed_experts",
        )
    unknown = [i for i in body.include or () if i not in INCLUDES]
    if unknown:
        raise bad_request(f"include {unknown[0]!r} is not supported", "include")


def responses_ask(state: Serving, body: ResponsesRequest) -> LogprobsAsk:
    top = capped(body.top_logprobs, state.config.max_top_logprobs, "top_logprobs")
    wants = LOGPROBS_INCLUDE in (body.include or ()) or body.top_logprobs is not None
    return LogprobsAsk.of(state, body, (top or 0) if wants else None)


async def responses_plan(state: Serving, body: ResponsesRequest) -> tuple[Plan, LogprobsAsk]:
    """The plan (errors already in Responses terms) and the logprobs ask of the answer."""
    _refuse_unserved(body)
    try:
        ask = responses_ask(state, body)
        tools = _tools(state, body)
        messages = _messages(body)
        effort = body.reasoning.effort if body.reasoning is not None else None
        conversation = Conversation(
            messages=messages, tools=tools, template_kwargs=thinking_kwargs(effort)
        )
        budget = body.thinking_budget
        plan = await chat_plan(state, body, conversation, body.max_output_tokens, ask, budget)
    except (APIError, RequestError) as exc:
        raise in_responses_terms(exc) from None
    return plan, ask


# the shared chat pipeline names chat's fields; a Responses request has these instead
_FIELDS = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input"}


def in_responses_terms(exc: APIError | RequestError) -> APIError:
    """An error of the chat pipeline (or the engine's check) naming the Responses fields."""
    if isinstance(exc, RequestError):
        exc = APIError(400, str(exc), exc.param)
    if exc.param in _FIELDS:
        if exc.param == "max_tokens":  # the engine's message quotes the field
            exc.message = exc.message.replace("max_tokens", "max_output_tokens")
        exc.param = _FIELDS[exc.param]
    return exc
