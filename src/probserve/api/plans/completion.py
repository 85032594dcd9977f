"""The plan of POST /v1/completions: text or token-id prompts, each run as best_of candidates
of which n are answered, echo, and the shape the answer takes."""

from __future__ import annotations

from dataclasses import dataclass

from probserve.api.errors import bad_request
from probserve.api.off_loop import off_loop
from probserve.api.plans.grammar import compiled_grammar, grammar_ask
from probserve.api.plans.logprobs_ask import LogprobsAsk, capped
from probserve.api.plans.plan import Plan
from probserve.api.plans.routing import routing_spec
from probserve.api.plans.sampling import candidate_params, check_request
from probserve.api.prompts import (
    Prompt,
    build_completion_prompts,
    check_text_size,
    completion_id_lists,
)
from probserve.api.protocol import CompletionRequest
from probserve.api.server.state import Serving


@dataclass(frozen=True)
class CompletionShape:
    """How the answer is shaped (what the engine runs is the Plan)."""

    n: int
    best_of: int
    echo: bool
    ask: LogprobsAsk
    as_ids: bool = False  # return_tokens_as_token_ids: logprobs name tokens token_id:N
    token_ids: bool = False  # return_token_ids: the prompt's and the completion's ids
    routing: bool = False  # return_routed_experts: each token's experts (with echo, the prompt's)


def _best_of(body: CompletionRequest) -> int:
    best_of = body.best_of or body.n
    if best_of < body.n:
        raise bad_request(f"best_of ({best_of}) must be at least n ({body.n})", "best_of")
    if body.stream and best_of > body.n:
        raise bad_request("best_of is not supported with stream", "best_of")
    return best_of


def completion_ask(state: Serving, body: CompletionRequest, best_of: int) -> LogprobsAsk:
    """`logprobs` alternatives for the generated tokens and, with echo, the prompt's; best_of
    past n ranks the candidates by mean logprob, which asks for the chosen tokens' logprobs
    whether or not the answer shows them."""
    k = capped(body.logprobs, state.config.max_logprobs, "logprobs")
    return LogprobsAsk.of(state, body, k, k if body.echo else None, ranked=best_of > body.n)


async def built_prompts(state: Serving, prompt: object, param: str = "prompt") -> list[Prompt]:
    """A completions-shaped prompt (a text, texts, token ids or id lists; its count already
    checked) tokenized and checked against the context, its texts' size first: a 400 naming
    `param` (completions' prompt, embeddings' input)."""
    prompts = completion_id_lists(prompt, param)
    if isinstance(prompts[0], str):
        check_text_size(state.config.limits, prompts, param)
    return await off_loop(
        build_completion_prompts, state.record, state.table, prompts, state.max_context, param
    )


async def completion_plan(state: Serving, body: CompletionRequest) -> tuple[Plan, CompletionShape]:
    limits = state.config.limits
    best_of = _best_of(body)
    ask = completion_ask(state, body, best_of)
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
        limits.check_sequences(len(body.prompt), best_of, "prompt")
    limits.check_sequences(1, best_of, "best_of" if body.best_of else "n")
    stops = check_request(body, limits)
    asked = grammar_ask(body)
    sampling = candidate_params(
        body, body.max_tokens, state.record.vocab_size, best_of, state.model.sampling_defaults
    )
    built = await built_prompts(state, body.prompt)
    grammar = await compiled_grammar(state, asked)
    plan = Plan(
        prompts=built, sampling=sampling, spec=ask.spec(), stops=stops,
        skip_special_tokens=body.skip_special_tokens, offsets_from_prompt=True, grammar=grammar,
        speculative=body.speculative,
    )  # fmt: skip
    plan = routing_spec(state, body, plan, prompt=body.echo)
    shape = CompletionShape(
        body.n, best_of, body.echo, ask, body.return_tokens_as_token_ids, body.return_token_ids,
        body.return_routed_experts,
    )  # fmt: skip
    return plan, shape
