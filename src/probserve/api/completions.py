"""POST /v1/completions: text or token-id prompts, n/best_of, echo, logprobs, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from fastapi import APIRouter, Request
from fastapi.responses import Response

from probserve.api.errors import ERRORS, bad_request
from probserve.api.generation import Delta
from probserve.api.json_out import dump_json
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
)
from probserve.api.run import Plan, Run
from probserve.api.sampling import candidate_params, check_request, logprobs_spec
from probserve.api.sse import event, sse_response
from probserve.api.state import Serving
from probserve.api.text_stream import Piece
from probserve.engine import TokenLogprobs

router = APIRouter()


@dataclass
class _Shape:
    """How the response is shaped (what the engine runs is the Plan)."""

    n: int
    best_of: int
    echo: bool
    k: int | None  # logprobs asked for (None: no logprobs in the response)


async def _plan(state: Serving, body: CompletionRequest) -> tuple[Plan, _Shape]:
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
    sampling = candidate_params(body, body.max_tokens, state.loaded.vocab_size, best_of)
    prompts = completion_id_lists(body.prompt)
    if isinstance(prompts[0], str):
        check_text_size(cfg.limits, prompts)  # type: ignore[arg-type]
    built = await off_loop(
        build_completion_prompts, state.loaded, state.table, prompts, state.engine.info.max_context
    )
    k = body.logprobs
    shape = _Shape(body.n, best_of, body.echo, k)
    needs_lp = k is not None or best_of > body.n  # best_of ranks candidates by mean logprob
    spec = logprobs_spec(
        k if needs_lp else None,
        k if body.echo else None,
        body,
        cfg.logprobs_mode,
        state.loaded.vocab_size,
        cfg.limits,
    )
    plan = Plan(built, sampling, spec, stops, body.skip_special_tokens, offsets_from_prompt=True)
    return plan, shape


def _scored(prompt: Prompt, scores: TokenLogprobs | None) -> list[Piece]:
    """The prompt's pieces with their logprobs rows (the first token has none)."""
    if scores is None:
        return prompt.pieces
    return [prompt.pieces[0]] + [
        replace(p, logprobs=scores, row=j) for j, p in enumerate(prompt.pieces[1:])
    ]


def _choice_logprobs(
    state: Serving,
    shape: _Shape,
    prompt: Prompt,
    pieces: list[Piece],
    scores: TokenLogprobs | None,
    with_prompt: bool,
) -> CompletionLogprobs | None:
    if shape.k is None:
        return None
    return state.fmt.completion((_scored(prompt, scores) if with_prompt else []) + pieces, shape.k)


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state: Serving = request.app.state.probserve.serving(body.model)
    model = state.name
    plan, shape = await _plan(state, body)
    run = await Run(state, request, plan, "cmpl").start()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_stream(run, shape, model, include_usage))
    await run.collect()
    # formatted off the loop: echoed prompts' logprobs x targets are seconds of work
    return Response(await off_loop(_answer, run, shape, model), media_type="application/json")


def _answer(run: Run, shape: _Shape, model: str) -> bytes:
    """The whole (non-streamed) answer as JSON: blocking, run it `off_loop`."""
    state, plan, candidates = run.state, run.plan, run.candidates
    choices: list[CompletionChoice] = []
    for pi, prompt in enumerate(plan.prompts):
        group = candidates[pi * shape.best_of : (pi + 1) * shape.best_of]
        if shape.best_of > shape.n:
            group = sorted(group, key=lambda c: c.mean_logprob, reverse=True)[: shape.n]
        for cand in group:
            text = "".join(p.text for p in cand.pieces)
            choices.append(
                CompletionChoice(
                    index=len(choices),
                    text=(prompt.text if shape.echo else "") + text,
                    logprobs=_choice_logprobs(
                        state, shape, prompt, cand.pieces, cand.prompt_scores, shape.echo
                    ),
                    finish_reason=cand.finish_reason,  # type: ignore[arg-type]
                )
            )
    resp = CompletionResponse(
        id=run.id, created=run.created, model=model, choices=choices, usage=run.usage
    )
    return dump_json(resp)


async def _stream(run: Run, shape: _Shape, model: str, include_usage: bool) -> AsyncIterator[str]:
    started = [False] * len(run.candidates)
    async for i, delta in run.deltas():
        echo_now = shape.echo and not started[i]
        started[i] = True
        if echo_now and delta.prompt_scores is not None:  # the prompt's scores: off the loop
            yield await off_loop(_event, run, shape, model, i, delta, echo_now)
        else:
            yield _event(run, shape, model, i, delta, echo_now)
    if include_usage:
        yield event(
            CompletionResponse(
                id=run.id, created=run.created, model=model, choices=[], usage=run.usage
            )
        )


def _event(run: Run, shape: _Shape, model: str, index: int, delta: Delta, echo_now: bool) -> str:
    return event(_chunk(run, shape, model, index, delta, echo_now))


def _chunk(
    run: Run, shape: _Shape, model: str, index: int, delta: Delta, echo_now: bool
) -> CompletionResponse:
    prompt = run.prompt_of(index)
    return CompletionResponse(
        id=run.id,
        created=run.created,
        model=model,
        choices=[
            CompletionChoice(
                index=index,
                text=(prompt.text if echo_now else "") + delta.text,
                logprobs=_choice_logprobs(
                    run.state, shape, prompt, delta.pieces, delta.prompt_scores, echo_now
                ),
                finish_reason=delta.finish_reason,  # type: ignore[arg-type]
            )
        ],
    )
