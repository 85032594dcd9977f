"""POST /v1/chat/completions: the model's chat template, logprobs + top_logprobs, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import Response

from probserve.api.chat_plan import chat_plan
from probserve.api.errors import ERRORS, bad_request
from probserve.api.generation import Delta
from probserve.api.json_out import dump_json
from probserve.api.prompts import ChatPrompt, off_loop
from probserve.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ContinuationScore,
    PromptTokenSource,
    Usage,
)
from probserve.api.run import Run
from probserve.api.sse import event, sse_response
from probserve.api.state import Serving
from probserve.api.text_stream import Piece
from probserve.engine import TokenLogprobs

router = APIRouter()


def _check(state: Serving, body: ChatCompletionRequest) -> int | None:
    cap = state.config.max_top_logprobs
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("top_logprobs is only allowed when logprobs is true", "top_logprobs")
        if body.top_logprobs > cap:
            raise bad_request(
                f"top_logprobs must be at most {cap} (got {body.top_logprobs})", "top_logprobs"
            )
    if body.prompt_logprobs is not None and body.prompt_logprobs > state.config.max_logprobs:
        raise bad_request(
            f"prompt_logprobs must be at most {state.config.max_logprobs}", "prompt_logprobs"
        )
    return (body.top_logprobs or 0) if body.logprobs else None


def _logprobs(state: Serving, pieces: list[Piece], k: int | None) -> ChatLogprobs | None:
    if k is None:
        return None
    return ChatLogprobs(content=state.fmt.chat(pieces, k), refusal=None)


def _prompt_extras(
    run: Run, body: ChatCompletionRequest, scores: TokenLogprobs | None
) -> dict[str, object]:
    """prompt_logprobs (vLLM's shape) and where each prompt token comes from."""
    if body.prompt_logprobs is None or scores is None:
        return {}
    prompt = run.plan.prompts[0]
    assert isinstance(prompt, ChatPrompt)
    fmt = run.state.fmt
    extras: dict[str, object] = {
        "prompt_logprobs": fmt.prompt_logprobs(scores, body.prompt_logprobs),
        "prompt_token_sources": [
            PromptTokenSource(message_index=i, role=role) for i, role in prompt.sources
        ],
    }
    # aligned with prompt_logprobs: nothing for the first token, then one per scored position
    if scores.entropy is not None:
        extras["prompt_entropy"] = [None, *(float(v) for v in scores.entropy)]
    if scores.target_logprobs is not None:
        extras["prompt_target_logprobs"] = [None] + [
            fmt.targets(scores, j) for j in range(len(scores))
        ]
    return extras


def _continuation(run: Run, scores: TokenLogprobs | None, k: int) -> ContinuationScore:
    """Chat echo: the final assistant message's tokens, scored (row t-1 predicts token t)."""
    prompt = run.plan.prompts[0]
    assert isinstance(prompt, ChatPrompt) and scores is not None
    first = len(prompt.ids) - prompt.continuation
    pieces = [
        replace(p, logprobs=scores, row=first + j - 1) for j, p in enumerate(prompt.pieces[first:])
    ]
    rows = range(first - 1, len(prompt.ids) - 1)
    return ContinuationScore(
        content=run.state.fmt.chat(pieces, k),
        logprob_sum=float(sum(float(scores.logprobs[r]) for r in rows)),
        is_greedy=all(int(scores.ranks[r]) == 1 for r in rows),
    )


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state: Serving = request.app.state.probserve.serving(body.model)
    model = state.name
    k = _check(state, body)
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    prompt_top_k = body.prompt_logprobs
    if body.echo:
        if max_tokens:
            raise bad_request("echo scores the final message: max_tokens must be 0", "max_tokens")
        if body.stream:
            raise bad_request("echo is not supported with stream", "stream")
        max_tokens, k = 0, k or 0
        prompt_top_k = max(prompt_top_k or 0, k)
    plan = await chat_plan(
        state,
        body,
        body.messages,
        max_tokens,
        top_k=k,
        prompt_top_k=prompt_top_k,
        add_generation_prompt=body.add_generation_prompt,
        template_kwargs=body.chat_template_kwargs,
        echo=body.echo,
        continue_final=body.continue_final_message,
    )
    run = await Run(state, request, plan, "chatcmpl").start()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_stream(run, body, model, k, include_usage))
    await run.collect()
    # formatted off the loop: a long prompt's logprobs x targets are seconds of work
    return Response(await off_loop(_answer, run, body, model, k), media_type="application/json")


def _answer(run: Run, body: ChatCompletionRequest, model: str, k: int | None) -> bytes:
    """The whole (non-streamed) answer as JSON: blocking, run it `off_loop`."""
    choices = []
    for i, cand in enumerate(run.candidates):
        choices.append(
            ChatChoice(
                index=i,
                message=AssistantMessage(content="".join(p.text for p in cand.pieces)),
                logprobs=_logprobs(run.state, cand.pieces, k),
                finish_reason=cand.finish_reason,  # type: ignore[arg-type]
                continuation=_continuation(run, cand.prompt_scores, k or 0) if body.echo else None,
                **_prompt_extras(run, body, cand.prompt_scores),  # type: ignore[arg-type]
            )
        )
    resp = ChatCompletionResponse(
        id=run.id, created=run.created, model=model, choices=choices, usage=run.usage
    )
    return dump_json(resp)


def _chunk(run: Run, model: str, choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
    return event(
        ChatCompletionChunk(
            id=run.id, created=run.created, model=model, choices=choices, usage=usage
        )
    )


def _delta_events(
    run: Run, body: ChatCompletionRequest, model: str, k: int | None, i: int, delta: Delta
) -> list[str]:
    """The events of one delta of candidate i (the first may carry the prompt's scores)."""
    events = []
    lp = _logprobs(run.state, delta.pieces, k)
    extras = _prompt_extras(run, body, delta.prompt_scores)  # the first chunk: the prompt
    if delta.text or (lp and lp.content) or extras:
        content = ChatDelta(content=delta.text)
        choice = ChatChunkChoice(index=i, delta=content, logprobs=lp, **extras)  # type: ignore[arg-type]
        events.append(_chunk(run, model, [choice]))
    if delta.finish_reason:
        done = ChatChunkChoice(index=i, delta=ChatDelta(), finish_reason=delta.finish_reason)  # type: ignore[arg-type]
        events.append(_chunk(run, model, [done]))
    return events


async def _stream(
    run: Run, body: ChatCompletionRequest, model: str, k: int | None, include_usage: bool
) -> AsyncIterator[str]:
    yield _chunk(
        run,
        model,
        [
            ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
            for i in range(len(run.candidates))
        ],
    )
    async for i, delta in run.deltas():
        if delta.prompt_scores is not None and body.prompt_logprobs is not None:
            # the prompt's scores: formatted off the loop, as the non-streamed answer is
            events = await off_loop(_delta_events, run, body, model, k, i, delta)
        else:
            events = _delta_events(run, body, model, k, i, delta)
        for e in events:
            yield e
    if include_usage:
        yield _chunk(run, model, [], run.usage)
