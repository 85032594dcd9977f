"""POST /v1/completions: text or token-id prompts, n/best_of, echo, logprobs, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from probserve.api.answers.json_out import dump_json
from probserve.api.answers.routed import prompt_entries, token_entries
from probserve.api.answers.text_stream import Piece
from probserve.api.edge.sse import StreamUsage, event, sse_response
from probserve.api.errors import ERRORS
from probserve.api.off_loop import off_loop
from probserve.api.pipeline.candidates import Delta
from probserve.api.pipeline.run import Run
from probserve.api.plans.completion import CompletionShape, completion_plan
from probserve.api.prompts import Prompt
from probserve.api.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from probserve.api.server.lookup import serving_of
from probserve.api.server.state import Serving
from probserve.engine import TokenLogprobs

router = APIRouter()


def _choice_logprobs(
    state: Serving,
    shape: CompletionShape,
    prompt: Prompt,
    pieces: list[Piece],
    scores: TokenLogprobs | None,
    with_prompt: bool,
) -> CompletionLogprobs | None:
    """The choice's logprobs (with echo, the prompt's first: its first token has no row)."""
    k = shape.ask.alternatives
    if k is None:
        return None
    echoed = [prompt.pieces[0], *prompt.scored(scores)] if with_prompt else []
    return state.formatter(shape.as_ids).completion(echoed + pieces, k)


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
async def create_completion(
    body: CompletionRequest,
    request: Request,
    state: Annotated[Serving, Depends(serving_of(CompletionRequest))],
) -> Response:
    model = state.name
    plan, shape = await completion_plan(state, body)
    run = await Run(state, request, plan, "cmpl").start()
    if body.stream:
        usage = StreamUsage.of(body.stream_options)
        return sse_response(
            _stream(run, shape, model, usage),
            keepalive=state.config.http.sse_keepalive,
            on_end=run.close,
        )
    await run.collect()
    # formatted off the loop: echoed prompts' logprobs x targets are seconds of work
    return Response(await off_loop(_answer, run, shape, model), media_type="application/json")


def _answer(run: Run, shape: CompletionShape, model: str) -> bytes:
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
                    finish_reason=cand.finish_reason,
                    prompt_token_ids=list(prompt.ids) if shape.token_ids else None,
                    token_ids=[p.token_id for p in cand.pieces] if shape.token_ids else None,
                    routed_experts=token_entries(cand.pieces) if shape.routing else None,
                    prompt_routed_experts=prompt_entries(cand.prompt_routed),
                )
            )
    resp = CompletionResponse(
        id=run.id, created=run.created, model=model, choices=choices, usage=run.usage,
        system_fingerprint=run.state.system_fingerprint,
    )  # fmt: skip
    return dump_json(resp)


async def _stream(
    run: Run, shape: CompletionShape, model: str, usage: StreamUsage
) -> AsyncIterator[str]:
    started = [False] * len(run.candidates)
    async for i, delta in run.deltas(settled=usage.each):
        first = not started[i]
        started[i] = True
        echoed = delta.prompt_scores is not None or delta.prompt_routed is not None
        if first and shape.echo and echoed:  # off the loop
            chunk = await off_loop(_chunk, run, shape, model, i, delta, first)
        else:
            chunk = _chunk(run, shape, model, i, delta, first)
        if usage.each:
            chunk.usage = run.usage
        yield event(chunk)
    if usage.final:
        yield event(
            CompletionResponse(
                id=run.id,
                created=run.created,
                model=model,
                choices=[],
                usage=run.usage,
                system_fingerprint=run.state.system_fingerprint,
            )
        )


def _chunk(
    run: Run, shape: CompletionShape, model: str, index: int, delta: Delta, first: bool
) -> CompletionResponse:
    """Candidate `index`'s delta as a chunk (its `first` carries the echo and prompt ids)."""
    prompt = run.prompt_of(index)
    echo_now = first and shape.echo
    return CompletionResponse(
        id=run.id,
        created=run.created,
        model=model,
        system_fingerprint=run.state.system_fingerprint,
        choices=[
            CompletionChoice(
                index=index,
                text=(prompt.text if echo_now else "") + delta.text,
                logprobs=_choice_logprobs(
                    run.state, shape, prompt, delta.pieces, delta.prompt_scores, echo_now
                ),
                finish_reason=delta.finish_reason,
                prompt_token_ids=list(prompt.ids) if shape.token_ids and first else None,
                token_ids=[p.token_id for p in delta.pieces] if shape.token_ids else None,
                routed_experts=token_entries(delta.pieces) if shape.routing else None,
                prompt_routed_experts=prompt_entries(delta.prompt_routed),
            )
        ],
    )
