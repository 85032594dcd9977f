"""POST /v1/chat/completions: the model's chat template, logprobs + top_logprobs, streaming."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from probserve.api.completions import ERRORS
from probserve.api.errors import bad_request
from probserve.api.generation import Candidate, merge, run_all, share_prompt_scores, submit_all
from probserve.api.prompts import chat_prompt_ids
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
from probserve.api.sampling import (
    candidate_seed,
    check_request,
    logprobs_spec,
    sampling_params,
)
from probserve.api.sse import event, sse_response
from probserve.api.state import ServerState
from probserve.api.text_stream import Piece, TextStream
from probserve.engine import AsyncEngine, EngineRequest

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
    limits = state.config.limits
    stops = check_request(body, limits)
    limits.check_sequences(1, body.n, "n")
    prompt_ids = await chat_prompt_ids(
        state.loaded, limits, body.messages, body.add_generation_prompt, body.chat_template_kwargs
    )
    max_tokens = (
        body.max_completion_tokens if body.max_completion_tokens is not None else (body.max_tokens)
    )
    spec = logprobs_spec(
        k if k is not None else (0 if body.prompt_logprobs is not None else None),
        prompt=body.prompt_logprobs is not None,
        mode=body.logprobs_mode,
        default=state.config.logprobs_mode,
    )
    if spec is not None and body.prompt_logprobs is not None:
        spec = dataclasses.replace(spec, top_k=max(spec.top_k, body.prompt_logprobs))
    # one candidate scores the prompt; the others share its scores
    sibling_spec = dataclasses.replace(spec, prompt=False) if spec is not None else None
    cid = f"chatcmpl-{uuid.uuid4().hex}"
    requests = [
        EngineRequest(
            AsyncEngine.new_request_id("chat"),
            tuple(prompt_ids),
            sampling_params(
                body, max_tokens, state.loaded.vocab_size, candidate_seed(body.seed, c)
            ),
            sibling_spec if c else spec,
            cid,
        )
        for c in range(body.n)
    ]
    streams = await submit_all(state.engine, requests)
    candidates = [
        Candidate(r, s, TextStream(state.table, 0, stops, body.skip_special_tokens))
        for r, s in zip(requests, streams, strict=True)
    ]
    if spec is not None and spec.prompt:
        share_prompt_scores(candidates)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(
            _stream(state, candidates, cid, model, k, len(prompt_ids), include_usage, request)
        )
    await run_all(request, candidates, state.config.limits.request_timeout)
    choices = []
    for i, cand in enumerate(candidates):
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
    completion_tokens = sum(c.num_tokens for c in candidates)
    request.state.usage = (len(prompt_ids), completion_tokens)
    resp = ChatCompletionResponse(
        id=cid,
        model=model,
        choices=choices,
        usage=Usage.of(len(prompt_ids), completion_tokens),
    )
    return Response(resp.model_dump_json(), media_type="application/json")


async def _stream(
    state: ServerState,
    candidates: list[Candidate],
    cid: str,
    model: str,
    k: int | None,
    prompt_tokens: int,
    include_usage: bool,
    request: Request,
) -> AsyncIterator[str]:
    def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
        return event(ChatCompletionChunk(id=cid, model=model, choices=choices, usage=usage))

    try:
        yield chunk(
            [
                ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                for i in range(len(candidates))
            ]
        )
        timeout = state.config.limits.request_timeout
        async for i, delta in merge([c.deltas() for c in candidates], timeout):
            lp = _logprobs(state, delta.pieces, k)
            if delta.text or (lp and lp.content):
                yield chunk(
                    [ChatChunkChoice(index=i, delta=ChatDelta(content=delta.text), logprobs=lp)]
                )
            if delta.finish_reason:
                yield chunk(
                    [ChatChunkChoice(index=i, delta=ChatDelta(), finish_reason=delta.finish_reason)]
                )  # type: ignore[arg-type]
    finally:
        for c in candidates:
            c.stream.close()
    completion_tokens = sum(c.num_tokens for c in candidates)
    request.state.usage = (prompt_tokens, completion_tokens)
    if include_usage:
        yield chunk([], Usage.of(prompt_tokens, completion_tokens))
