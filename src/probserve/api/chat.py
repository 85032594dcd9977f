"""POST /v1/chat/completions: the model's chat template, logprobs + top_logprobs, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from probserve.api.chat_plan import chat_plan
from probserve.api.errors import ERRORS, bad_request
from probserve.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    Usage,
)
from probserve.api.run import Run
from probserve.api.sse import event, sse_response
from probserve.api.state import ServerState
from probserve.api.text_stream import Piece

router = APIRouter()


def _check(state: ServerState, body: ChatCompletionRequest) -> int | None:
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


def _logprobs(state: ServerState, pieces: list[Piece], k: int | None) -> ChatLogprobs | None:
    if k is None:
        return None
    return ChatLogprobs(content=state.fmt.chat(pieces, k), refusal=None)


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state: ServerState = request.app.state.probserve
    model = state.check_model(body.model)
    k = _check(state, body)
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    )
    plan = await chat_plan(
        state,
        body,
        body.messages,
        max_tokens,
        top_k=k,
        prompt_top_k=body.prompt_logprobs,
        add_generation_prompt=body.add_generation_prompt,
        template_kwargs=body.chat_template_kwargs,
    )
    run = await Run(state, request, plan, "chatcmpl").start()
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_stream(run, model, k, include_usage))
    choices = []
    for i, cand in enumerate(await run.collect()):
        prompt_lp = None
        if body.prompt_logprobs is not None and cand.prompt_scores is not None:
            prompt_lp = state.fmt.prompt_logprobs(cand.prompt_scores, body.prompt_logprobs)
        choices.append(
            ChatChoice(
                index=i,
                message=AssistantMessage(content="".join(p.text for p in cand.pieces)),
                logprobs=_logprobs(state, cand.pieces, k),
                finish_reason=cand.finish_reason,  # type: ignore[arg-type]
                prompt_logprobs=prompt_lp,
            )
        )
    resp = ChatCompletionResponse(
        id=run.id, created=run.created, model=model, choices=choices, usage=run.usage
    )
    return Response(resp.model_dump_json(), media_type="application/json")


async def _stream(run: Run, model: str, k: int | None, include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return event(
            ChatCompletionChunk(
                id=run.id, created=run.created, model=model, choices=choices, usage=usage
            )
        )

    yield chunk(
        [
            ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
            for i in range(len(run.candidates))
        ]
    )
    async for i, delta in run.deltas():
        lp = _logprobs(run.state, delta.pieces, k)
        if delta.text or (lp and lp.content):
            content = ChatDelta(content=delta.text)
            yield chunk([ChatChunkChoice(index=i, delta=content, logprobs=lp)])
        if delta.finish_reason:
            yield chunk(
                [ChatChunkChoice(index=i, delta=ChatDelta(), finish_reason=delta.finish_reason)]  # type: ignore[arg-type]
            )
    if include_usage:
        yield chunk([], run.usage)
