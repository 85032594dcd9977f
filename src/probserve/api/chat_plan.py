"""The plan of a chat-style request (chat completions and responses): messages through the
model's template into one prompt, n candidates, logprobs for generated and prompt tokens."""

from __future__ import annotations

from typing import Any

from probserve.api.prompts import chat_prompt, check_messages, check_template_kwargs, off_loop
from probserve.api.protocol import ChatMessage, SamplingFields
from probserve.api.run import Plan
from probserve.api.sampling import candidate_params, check_request, logprobs_spec
from probserve.api.state import Serving


async def chat_plan(
    state: Serving,
    body: SamplingFields,
    messages: list[ChatMessage],
    max_tokens: int | None,
    top_k: int | None,
    prompt_top_k: int | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
    echo: bool = False,
    continue_final: bool = False,
) -> Plan:
    """`top_k`: alternatives per generated token (None: no logprobs); `prompt_top_k`: score the
    rendered prompt with that many alternatives (None: not scored); `echo`: the final assistant
    message is appended as a continuation to score."""
    limits = state.config.limits
    limits.check_sequences(1, body.n, "n")
    stops = check_request(body, limits)
    sampling = candidate_params(body, max_tokens, state.loaded.vocab_size, body.n)
    dicts = check_messages(limits, messages)
    kwargs = check_template_kwargs(template_kwargs)
    prompt = await off_loop(
        chat_prompt, state.loaded, state.table, dicts, add_generation_prompt, kwargs, echo,
        continue_final,
    )  # fmt: skip
    spec = logprobs_spec(
        top_k, prompt_top_k, body, state.config.logprobs_mode, state.loaded.vocab_size, limits
    )
    return Plan([prompt], sampling, spec, stops, body.skip_special_tokens)
