"""POST /v1/chat/completions: the model's chat template, logprobs + top_logprobs, streaming."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from probserve.api.completions import ERRORS
from probserve.api.errors import bad_request
from probserve.api.generation import Candidate, merge, run_all, submit_all
from probserve.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
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


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, str]]:
    out = []
    for m in messages:
        if m.content is None:
            content = ""
        elif isinstance(m.content, str):
            content = m.content
        else:
            content = "".join(part.text for part in m.content)
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": content})
    return out


def chat_prompt_ids(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
) -> list[int]:
    tok = state.loaded.tokenizer
    dicts = message_dicts(messages)
    state.config.limits.check_messages(len(dicts), sum(len(m["content"]) for m in dicts))
    if not getattr(tok, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    try:
        text = tok.apply_chat_template(
            dicts,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(template_kwargs or {}),
        )
    except Exception as exc:  # a template that rejects the conversation (jinja raise_exception)
        raise bad_request(f"the chat template rejected the messages: {exc}", "messages") from exc
    return list(tok(text, add_special_tokens=False).input_ids)


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
    prompt_ids = chat_prompt_ids(
        state, body.messages, body.add_generation_prompt, body.chat_template_kwargs
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
        spec = type(spec)(max(spec.top_k, body.prompt_logprobs), spec.prompt, spec.mode)
    requests = [
        EngineRequest(
            AsyncEngine.new_request_id("chat"),
            tuple(prompt_ids),
            sampling_params(
                body, max_tokens, state.loaded.vocab_size, candidate_seed(body.seed, c)
            ),
            spec,
        )
        for c in range(body.n)
    ]
    streams = await submit_all(state.engine, requests)
    candidates = [
        Candidate(r, s, TextStream(state.table, 0, stops, body.skip_special_tokens))
        for r, s in zip(requests, streams, strict=True)
    ]
    cid = f"chatcmpl-{uuid.uuid4().hex}"
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
