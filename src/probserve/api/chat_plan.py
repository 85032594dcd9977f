"""The plan of a chat-style request (chat completions and responses): messages through the
model's template into one prompt, n candidates, logprobs for generated and prompt tokens."""

from __future__ import annotations

from typing import Any

from probserve.api.prompts import Prompt, chat_prompt_ids
from probserve.api.protocol import ChatMessage, SamplingFields
from probserve.api.run import Plan
from probserve.api.sampling import candidate_params, check_request, logprobs_spec
from probserve.api.state import ServerState


async def chat_plan(
    state: ServerState,
    body: SamplingFields,
    messages: list[ChatMessage],
    max_tokens: int | None,
    top_k: int | None,
    prompt_top_k: int | None = None,
    add_generation_prompt: bool = True,
    template_kwargs: dict[str, Any] | None = None,
) -> Plan:
    """`top_k`: alternatives per generated token (None: no logprobs); `prompt_top_k`: score the
    rendered prompt with that many alternatives (None: not scored)."""
    limits = state.config.limits
    limits.check_sequences(1, body.n, "n")
    stops = check_request(body, limits)
    sampling = candidate_params(body, max_tokens, state.loaded.vocab_size, body.n)
    ids = await chat_prompt_ids(
        state.loaded, limits, messages, add_generation_prompt, template_kwargs
    )
    spec = logprobs_spec(
        top_k, prompt_top_k, body, state.config.logprobs_mode, state.loaded.vocab_size, limits
    )
    return Plan([Prompt(ids, "", [])], sampling, spec, stops, body.skip_special_tokens)
