"""The plan of a chat-style request (chat completions, and responses through plans/responses):
messages through the model's template into one prompt, n candidates, the logprobs asked for
generated and prompt tokens; chat echo scores the final assistant message instead."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from probserve.api.answers.harmony import (
    HarmonyMarkers,
    Markers,
    harmony_reasoning_positions,
    reply_markers,
)
from probserve.api.answers.thinking import ThinkMarkers, opened, reasoning_positions
from probserve.api.errors import bad_request
from probserve.api.off_loop import off_loop
from probserve.api.plans.grammar import after_thinking, compiled_grammar, grammar_ask
from probserve.api.plans.harmony_grammar import harmony_grammar
from probserve.api.plans.logprobs_ask import LogprobsAsk, capped, reply_alternatives
from probserve.api.plans.plan import Plan
from probserve.api.plans.routing import routing_spec
from probserve.api.plans.sampling import candidate_params, check_request
from probserve.api.prompts import ChatPrompt, chat_prompt, check_messages
from probserve.api.protocol import ChatCompletionRequest, ChatMessage, SamplingFields
from probserve.api.server.state import Serving
from probserve.api.structured import GrammarAsk
from probserve.api.tools.ask import ToolAsk, tool_ask
from probserve.api.tools.formats import ToolFormat, detect_format
from probserve.api.tools.grammar import tool_grammar
from probserve.api.tools.prompt import tool_prompt, tools_chars
from probserve.engine import SamplingParams


@dataclass(frozen=True, kw_only=True)
class Conversation:
    """What the model's template renders, as chat, Responses and Messages give it: the messages,
    the tools the reply may (or must) call, and how the prompt ends."""

    messages: list[ChatMessage]
    tools: ToolAsk | None = None
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] | None = None  # checked (`check_template_kwargs`)
    echo: bool = False  # the final assistant message appended as a continuation to score
    continue_final: bool = False  # the final assistant message continued (a prefill)


async def chat_plan(
    state: Serving,
    body: SamplingFields,
    conversation: Conversation,
    max_tokens: int | None,
    ask: LogprobsAsk,
    budget: int | None = None,
) -> Plan:
    """The plan of a conversation: its prompt through the template, its candidates' sampling,
    the reply's grammar (a structured output, or the tools' calls); a thinking model's reply
    thinks freely (at most `budget` tokens) before the grammar applies to its answer."""
    echo = conversation.echo
    limits = state.config.limits
    limits.check_sequences(1, body.n, "n")
    stops = check_request(body, limits)
    asked = grammar_ask(body)
    sampling = candidate_params(
        body, max_tokens, state.record.vocab_size, body.n, state.model.sampling_defaults
    )
    prompt, primed, tools = await rendered_chat(state, conversation)
    fmt = tool_format(state)
    markers = None if echo else thinking_markers(state)
    if isinstance(markers, HarmonyMarkers):
        grammar, sampling = await _harmony_reply(state, markers, tools, asked, sampling, budget)
        return Plan(
            prompts=[prompt], sampling=sampling, spec=ask.spec(), stops=stops,
            skip_special_tokens=body.skip_special_tokens, grammar=grammar, tools=tools,
            speculative=body.speculative, thinking=markers,
        )  # fmt: skip
    if tools is not None and not echo:
        called = tool_grammar(tools, _special_id(state, fmt), primed, _tags(state, fmt))
        if called is not None and asked is not None:
            raise bad_request(
                f"{asked.param} and tools both constrain the reply: ask for one", asked.param
            )
        asked = asked or called
    grammar = await compiled_grammar(state, asked)
    skip_special = body.skip_special_tokens and not (tools is not None and fmt.special)
    if markers is not None:
        markers = opened(markers, prompt.ids, state.table)
        if not markers.closed and not primed and (grammar is not None or budget is not None):
            grammar = after_thinking(markers, grammar, budget)
    return Plan(
        prompts=[prompt], sampling=sampling, spec=ask.spec(), stops=stops,
        skip_special_tokens=skip_special, grammar=grammar, tools=tools,
        speculative=body.speculative, thinking=markers,
    )  # fmt: skip


async def _harmony_reply(
    state: Serving,
    m: HarmonyMarkers,
    tools: ToolAsk | None,
    asked: GrammarAsk | None,
    sampling: list[SamplingParams],
    budget: int | None,
) -> tuple[str | None, list[SamplingParams]]:
    """A gpt-oss reply's grammar and sampling: `<|return|>` and `<|call|>` stop it; a
    response_format (the final channel's), the tools' calls or a thinking budget make
    harmony's grammar (plans/harmony_grammar.py)."""
    if tools is not None and asked is not None:
        raise bad_request(
            f"{asked.param} and tools both constrain the reply: ask for one", asked.param
        )
    answer = await compiled_grammar(state, asked)
    grammar = None
    if tools is not None or answer is not None or budget is not None:
        grammar = harmony_grammar(m, tools, answer, budget)
    stopped = [
        dataclasses.replace(s, stop_token_ids=tuple(dict.fromkeys((*s.stop_token_ids, *m.stops))))
        for s in sampling
    ]
    return grammar, stopped


async def rendered_chat(
    state: Serving, conversation: Conversation
) -> tuple[ChatPrompt, bool, ToolAsk | None]:
    """The messages (checked) and the tools' prompt through the model's template: the prompt,
    whether the reply was primed to call, and the tool ask as the prompt's end left it."""
    c = conversation
    tools, echo, continue_final = c.tools, c.echo, c.continue_final
    dicts = check_messages(state.config.limits, c.messages, tools_chars(tools))
    fmt = tool_format(state)
    if tools is not None and (echo or continue_final):  # the prompt's end is the client's
        tools = dataclasses.replace(tools, prime=False)
    shown = tool_prompt(dicts, tools, fmt)
    kwargs = {**(c.template_kwargs or {}), **shown.template_kwargs}
    markers = thinking_markers(state)
    think_end = None  # echo scores an answer after its thinking block, closed as the template does
    if echo and isinstance(markers, ThinkMarkers):
        think_end = state.table.token_bytes(markers.end).decode("utf-8", "replace")
    prompt = await off_loop(
        chat_prompt, state.record, state.table, shown.messages,
        c.add_generation_prompt and not shown.primed, kwargs, echo, continue_final or shown.primed,
        think_end,
    )  # fmt: skip
    prompt.sources = shown.request_sources(prompt.sources, dicts)
    if markers is not None:
        roles = [role for _, role in prompt.sources]
        if isinstance(markers, HarmonyMarkers):
            prompt.reasoning = harmony_reasoning_positions(markers, prompt.ids, roles, state.table)
        else:
            prompt.reasoning = reasoning_positions(markers, prompt.ids, roles)
    return prompt, shown.primed, tools


def tool_format(state: Serving) -> ToolFormat:
    """How this model writes tool calls (its template's format, or --tool-call-parser's)."""
    template = getattr(state.record.tokenizer, "chat_template", None)
    return detect_format(
        template if isinstance(template, str) else None, state.config.tool_call_parser
    )


def thinking_markers(state: Serving) -> Markers | None:
    """This model's thinking markers (its template's and tokenizer's, or --reasoning-parser's;
    None: its replies are not split)."""
    template = getattr(state.record.tokenizer, "chat_template", None)
    return reply_markers(
        template if isinstance(template, str) else None,
        state.table.added_vocab,
        state.config.reasoning_parser,
    )


def _tags(state: Serving, fmt: ToolFormat) -> tuple[int, int] | None:
    """The ids of the format's opener and closer where both are added tokens (Qwen's
    `<tool_call>`, `</tool_call>`)."""
    added = state.table.added_vocab
    opener, closer = added.get(fmt.opener), added.get(fmt.closer)
    return (opener, closer) if opener is not None and closer is not None else None


def _special_id(state: Serving, fmt: ToolFormat) -> int | None:
    """The opener's id where it is one of the tokenizer's added tokens."""
    if not fmt.special:
        return None
    found = state.record.tokenizer.get_added_vocab().get(fmt.opener)
    return int(found) if found is not None else None


def chat_ask(state: Serving, body: ChatCompletionRequest) -> LogprobsAsk:
    """`logprobs` + `top_logprobs` for the reply, `prompt_logprobs` for the rendered prompt;
    echo scores the prompt with the reply's alternatives (at least)."""
    alternatives = reply_alternatives(state, body.logprobs, body.top_logprobs)
    prompt = capped(body.prompt_logprobs, state.config.max_logprobs, "prompt_logprobs")
    if body.echo:
        alternatives = alternatives or 0
        prompt = max(prompt or 0, alternatives)
    return LogprobsAsk.of(state, body, alternatives, prompt)


def chat_max_tokens(body: ChatCompletionRequest) -> int | None:
    """max_completion_tokens over max_tokens; echo generates nothing (0)."""
    limit = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    if body.echo:
        if limit:
            raise bad_request("echo scores the final message: max_tokens must be 0", "max_tokens")
        if body.stream:
            raise bad_request("echo is not supported with stream", "stream")
        return 0
    return limit


def _template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """chat_template_kwargs (checked), with reasoning_effort and enable_thinking as the
    template's variables (`thinking_kwargs`), unless the kwargs set them themselves."""
    kwargs = check_template_kwargs(body.chat_template_kwargs)
    return {**thinking_kwargs(body.reasoning_effort, body.enable_thinking), **kwargs}


def thinking_kwargs(effort: str | None, enable: bool | None = None) -> dict[str, Any]:
    """The template variables a request's thinking asks for: `reasoning_effort` as the
    template's variable of that name (as vLLM passes it: a template that reasons reads it, any
    other ignores it), `enable_thinking` (Qwen3's; effort "none" turns it off)."""
    kwargs: dict[str, Any] = {}
    if effort is not None:
        kwargs["reasoning_effort"] = effort
    if enable is None and effort == "none":
        enable = False
    if enable is not None:
        kwargs["enable_thinking"] = enable
    return kwargs


def _reserved_template_names() -> frozenset[str]:
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    names = {n for n, p in params.items() if p.kind is not inspect.Parameter.VAR_KEYWORD}
    return frozenset(names | {"self", "messages", "raise_exception", "strftime_now"})


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """Template variables only: never the template itself (a client's Jinja would run here and
    could loop or allocate without bound), nor any argument of apply_chat_template."""
    if not kwargs:
        return {}
    reserved = _reserved_template_names()
    for key in kwargs:
        if not key.isidentifier() or key.startswith("_") or key in reserved:
            raise bad_request(
                f"chat_template_kwargs may not set {key!r}: only variables of the model's own "
                "chat template are accepted",
                f"chat_template_kwargs.{key}" if key.isidentifier() else "chat_template_kwargs",
            )
    return kwargs


async def chat_completion_plan(
    state: Serving, body: ChatCompletionRequest
) -> tuple[Plan, LogprobsAsk]:
    """POST /v1/chat/completions: the plan, and the logprobs ask its answer is shaped by."""
    ask = chat_ask(state, body)
    max_tokens = chat_max_tokens(body)
    kwargs = _template_kwargs(body)
    functions = [t.function for t in body.tools] if body.tools else None
    tools = tool_ask(
        functions,
        body.tool_choice,
        body.parallel_tool_calls,
        tool_format(state),
        state.config.closed_schemas,
    )
    conversation = Conversation(
        messages=body.messages, tools=tools, add_generation_prompt=body.add_generation_prompt,
        template_kwargs=kwargs, echo=body.echo, continue_final=body.continue_final_message,
    )  # fmt: skip
    plan = await chat_plan(state, body, conversation, max_tokens, ask, body.thinking_budget)
    return routing_spec(state, body, plan, prompt=body.prompt_logprobs is not None), ask
