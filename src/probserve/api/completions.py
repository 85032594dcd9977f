"""POST /v1/completions: text or token-id prompts, n/best_of, echo, logprobs, streaming."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import APIRouter, Request
from fastapi.responses import Response

from probserve.api.errors import bad_request
from probserve.api.generation import (
    Candidate,
    Delta,
    merge,
    run_all,
    share_prompt_scores,
    submit_all,
)
from probserve.api.prompts import (
    Prompt,
    build_completion_prompts,
    check_text_size,
    completion_id_lists,
    off_loop,
)
from probserve.api.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    Usage,
)
from probserve.api.sampling import (
    candidate_seed,
    check_request,
    logprobs_spec,
    sampling_params,
)
from probserve.api.sse import event, sse_response
from probserve.api.state import ServerState
from probserve.api.text_stream import Piece, TextStream
from probserve.engine import AsyncEngine, EngineRequest, TokenLogprobs

router = APIRouter()

ERRORS: dict[int | str, dict] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 500, 503)
}


def _scored(prompt: Prompt, scores: TokenLogprobs | None) -> list[Piece]:
    """The prompt's pieces with their logprobs rows (the first token has none)."""
    if scores is None:
        return prompt.pieces
    return [prompt.pieces[0]] + [
        replace(p, logprobs=scores, row=j) for j, p in enumerate(prompt.pieces[1:])
    ]


@dataclass
class _Plan:
    prompts: list[Prompt]
    n: int
    best_of: int
    echo: bool
    k: int | None  # logprobs asked for (None: no logprobs in the response)
    stops: tuple[str, ...]


async def _plan(state: ServerState, body: CompletionRequest) -> _Plan:
    cfg = state.config
    if body.logprobs is not None and body.logprobs > cfg.max_logprobs:
        raise bad_request(
            f"logprobs must be at most {cfg.max_logprobs} (got {body.logprobs})", "logprobs"
        )
    best_of = body.best_of or body.n
    if best_of < body.n:
        raise bad_request(f"best_of ({best_of}) must be at least n ({body.n})", "best_of")
    if body.stream and best_of > body.n:
        raise bad_request("best_of is not supported with stream", "best_of")
    if body.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if isinstance(body.prompt, list) and body.prompt and not isinstance(body.prompt[0], int):
        cfg.limits.check_sequences(len(body.prompt), best_of, "prompt")
    cfg.limits.check_sequences(1, best_of, "best_of" if body.best_of else "n")
    stops = check_request(body, cfg.limits)
    prompts = completion_id_lists(body.prompt)
    if isinstance(prompts[0], str):
        check_text_size(cfg.limits, prompts)  # type: ignore[arg-type]
    built = await off_loop(
        build_completion_prompts, state.loaded, state.table, prompts, state.engine.core.max_context
    )
    return _Plan(built, body.n, best_of, body.echo, body.logprobs, stops)


async def _start(
    state: ServerState, body: CompletionRequest, plan: _Plan, group: str
) -> list[Candidate]:
    needs_lp = plan.k is not None or plan.best_of > plan.n
    spec = logprobs_spec(
        plan.k if needs_lp else None,
        prompt=plan.echo and plan.k is not None,
        mode=body.logprobs_mode,
        default=state.config.logprobs_mode,
    )
    # the prompt's scores are the same for every candidate: the first computes them, the others
    # share them (n candidates never score one prompt n times)
    sibling_spec = dataclasses.replace(spec, prompt=False) if spec is not None else None
    requests: list[EngineRequest] = []
    texts: list[TextStream] = []
    for prompt in plan.prompts:
        for c in range(plan.best_of):
            sp = sampling_params(
                body, body.max_tokens, state.loaded.vocab_size, candidate_seed(body.seed, c)
            )
            rid = AsyncEngine.new_request_id("cmpl")
            requests.append(
                EngineRequest(rid, tuple(prompt.ids), sp, sibling_spec if c else spec, group)
            )
            texts.append(
                TextStream(state.table, len(prompt.text), plan.stops, body.skip_special_tokens)
            )
    streams = await submit_all(state.engine, requests)
    cands = [Candidate(r, s, t) for r, s, t in zip(requests, streams, texts, strict=True)]
    if spec is not None and spec.prompt:
        for i in range(0, len(cands), plan.best_of):
            share_prompt_scores(cands[i : i + plan.best_of])
    return cands


def _choice_logprobs(
    state: ServerState,
    plan: _Plan,
    prompt: Prompt,
    delta_pieces: list[Piece],
    scores: TokenLogprobs | None,
    with_prompt: bool,
) -> CompletionLogprobs | None:
    if plan.k is None:
        return None
    pieces = (_scored(prompt, scores) if with_prompt else []) + delta_pieces
    return state.fmt.completion(pieces, plan.k)


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state: ServerState = request.app.state.probserve
    model = state.check_model(body.model)
    plan = await _plan(state, body)
    cid = f"cmpl-{uuid.uuid4().hex}"
    candidates = await _start(state, body, plan, cid)
    prompt_tokens = sum(len(p.ids) for p in plan.prompts)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(
            _stream(state, plan, candidates, cid, model, prompt_tokens, include_usage, request)
        )
    await run_all(request, candidates, state.config.limits.request_timeout)
    choices: list[CompletionChoice] = []
    for pi, prompt in enumerate(plan.prompts):
        group = candidates[pi * plan.best_of : (pi + 1) * plan.best_of]
        if plan.best_of > plan.n:
            group = sorted(group, key=lambda c: c.mean_logprob, reverse=True)[: plan.n]
        for cand in group:
            text = "".join(p.text for p in cand.pieces)
            choices.append(
                CompletionChoice(
                    index=len(choices),
                    text=(prompt.text if plan.echo else "") + text,
                    logprobs=_choice_logprobs(
                        state, plan, prompt, cand.pieces, cand.prompt_scores, plan.echo
                    ),
                    finish_reason=cand.finish_reason,  # type: ignore[arg-type]
                )
            )
    completion_tokens = sum(c.num_tokens for c in candidates)
    request.state.usage = (prompt_tokens, completion_tokens)
    resp = CompletionResponse(
        id=cid, model=model, choices=choices, usage=Usage.of(prompt_tokens, completion_tokens)
    )
    return Response(resp.model_dump_json(), media_type="application/json")


async def _stream(
    state: ServerState,
    plan: _Plan,
    candidates: list[Candidate],
    cid: str,
    model: str,
    prompt_tokens: int,
    include_usage: bool,
    request: Request,
) -> AsyncIterator[str]:
    started = [False] * len(candidates)
    try:
        timeout = state.config.limits.request_timeout
        async for i, delta in merge([c.deltas() for c in candidates], timeout):
            prompt = plan.prompts[i // plan.best_of]
            echo_now = plan.echo and not started[i]
            started[i] = True
            yield event(_chunk(state, plan, cid, model, i, prompt, delta, echo_now))
    finally:
        for c in candidates:
            c.stream.close()
    completion_tokens = sum(c.num_tokens for c in candidates)
    request.state.usage = (prompt_tokens, completion_tokens)
    if include_usage:
        yield event(
            CompletionResponse(
                id=cid, model=model, choices=[], usage=Usage.of(prompt_tokens, completion_tokens)
            )
        )


def _chunk(
    state: ServerState,
    plan: _Plan,
    cid: str,
    model: str,
    index: int,
    prompt: Prompt,
    delta: Delta,
    echo_now: bool,
) -> CompletionResponse:
    return CompletionResponse(
        id=cid,
        model=model,
        choices=[
            CompletionChoice(
                index=index,
                text=(prompt.text if echo_now else "") + delta.text,
                logprobs=_choice_logprobs(
                    state, plan, prompt, delta.pieces, delta.prompt_scores, echo_now
                ),
                finish_reason=delta.finish_reason,  # type: ignore[arg-type]
            )
        ],
    )
