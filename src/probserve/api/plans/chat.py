"""The plan of a chat-style request (chat completions, and responses through plans/responses):
messages through the model's template into one prompt, n candidates, the logprobs asked for
generated and prompt tokens; chat echo scores the final assistant message instead."""

from __future__ import annotations

from typing import Any

from probserve.api.errors import bad_request
from probserve.api.plans.grammar import compiled_grammar, grammar_ask
from probserve.api.plans.logprobs_ask import LogprobsAsk, capped
from probserve.api.plans.plan import Plan
from probserve.api.plans.sampling import candidate_params, check_request
from probserve.api.prompts import chat_prompt, check_messages, check_template_kwargs, off_loop
from probserve.api.protocol import ChatCompletionRequest, ChatMessage, SamplingFields
from probserve.api.state import Serving


async def chat_plan(
    state: Serving,
    body: SamplingFields,
    messages: list[ChatMessage],
    max_tokens: int | None,
    ask: LogprobsAsk,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    echo: bool = False,
    continue_final: bool = False,
) -> Plan:
    """`echo`: the final assistant message is appended as a continuation to score."""
    limits = state.config.limits
    limits.check_sequences(1, body.n, "n")
    stops = check_request(body, limits)
    asked = grammar_ask(body)
    sampling = candidate_params(body, max_tokens, state.loaded.vocab_size, body.n)
    dicts = check_messages(limits, messages)
    kwargs = check_template_kwargs(template_kwargs)
    prompt = await off_loop(
        chat_prompt, state.loaded, state.table, dicts, add_generation_prompt, kwargs, echo,
        continue_final,
    )  # fmt: skip
    grammar = await compiled_grammar(state, asked)
    return Plan([prompt], sampling, ask.spec(), stops, body.skip_special_tokens, grammar=grammar)


def chat_ask(state: Serving, body: ChatCompletionRequest) -> LogprobsAsk:
    """`logprobs` + `top_logprobs` for the reply, `prompt_logprobs` for the rendered prompt;
    echo scores the prompt with the reply's alternatives (at least)."""
    cfg = state.config
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs is only allowed when logprobs is true", "top_logprobs")
    top = capped(body.top_logprobs, cfg.max_top_logprobs, "top_logprobs")
    prompt = capped(body.prompt_logprobs, cfg.max_logprobs, "prompt_logprobs")
    alternatives = (top or 0) if body.logprobs else None
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


async def chat_completion_plan(
    state: Serving, body: ChatCompletionRequest
) -> tuple[Plan, LogprobsAsk]:
    """POST /v1/chat/completions: the plan, and the logprobs ask its answer is shaped by."""
    ask = chat_ask(state, body)
    plan = await chat_plan(
        state,
        body,
        body.messages,
        chat_max_tokens(body),
        ask,
        add_generation_prompt=body.add_generation_prompt,
        template_kwargs=body.chat_template_kwargs,
        echo=body.echo,
        continue_final=body.continue_final_message,
    )
    return plan, ask
