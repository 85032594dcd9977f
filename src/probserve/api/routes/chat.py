"""POST /v1/chat/completions: the model's chat template, logprobs + top_logprobs, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from probserve.api.answers.json_out import dump_json
from probserve.api.answers.logprobs_format import LogprobsFormatter
from probserve.api.answers.routed import prompt_entries, token_entries
from probserve.api.edge.sse import StreamUsage, sse_response
from probserve.api.errors import ERRORS
from probserve.api.off_loop import off_loop
from probserve.api.pipeline.candidates import Delta
from probserve.api.pipeline.run import Run
from probserve.api.plans.chat import chat_completion_plan
from probserve.api.prompts import ChatPrompt
from probserve.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ContinuationScore,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
)
from probserve.api.server.lookup import serving_of
from probserve.api.server.state import Serving
from probserve.api.tools.reply import (
    ReplyParser,
    arguments_schemas,
    cut_short,
    finish_reason,
    whole_reply,
)
from probserve.engine import TokenLogprobs

router = APIRouter()


def _fmt(run: Run, body: ChatCompletionRequest) -> LogprobsFormatter:
    return run.state.formatter(body.return_tokens_as_token_ids)


def _prompt_extras(
    run: Run, body: ChatCompletionRequest, fmt: LogprobsFormatter, scores: TokenLogprobs | None
) -> dict[str, object]:
    """The prompt's scores where prompt_logprobs asks (LogprobsFormatter.prompt_scores)."""
    prompt = run.plan.prompts[0]
    assert isinstance(prompt, ChatPrompt)
    return fmt.prompt_scores(scores, body.prompt_logprobs, prompt.sources, prompt.reasoning)


def _continuation(
    run: Run, body: ChatCompletionRequest, scores: TokenLogprobs | None, k: int
) -> ContinuationScore:
    """Chat echo: the final assistant message's tokens, scored."""
    prompt = run.plan.prompts[0]
    assert isinstance(prompt, ChatPrompt) and scores is not None
    first = len(prompt.ids) - prompt.continuation
    pieces = prompt.scored(scores, first)
    return ContinuationScore(
        reasoning=prompt.reasoning[first:] or None,  # a thinking model's: per entry
        content=_fmt(run, body).chat(pieces, k),
        logprob_sum=float(sum(float(scores.logprobs[p.row]) for p in pieces)),
        is_greedy=all(int(scores.ranks[p.row]) == 1 for p in pieces),
    )


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    state: Annotated[Serving, Depends(serving_of(ChatCompletionRequest))],
) -> Response:
    model = state.name
    plan, ask = await chat_completion_plan(state, body)
    k = ask.alternatives
    run = await Run(state, request, plan, "chatcmpl").start()
    if body.stream:
        return sse_response(
            _stream(run, body, model, k, StreamUsage.of(body.stream_options)),
            keepalive=state.config.http.sse_keepalive,
            on_end=run.close,
        )
    await run.collect()
    # formatted off the loop: a long prompt's logprobs x targets are seconds of work
    return Response(await off_loop(_answer, run, body, model, k), media_type="application/json")


def _message(
    run: Run, text: str, finish: str | None, reasoning: str | None = None
) -> tuple[AssistantMessage, ReplyParser | None]:
    """The reply: its text, or (a request with tools) its content and calls; a thinking
    model's reasoning beside them."""
    tools = run.plan.tools
    said = {"reasoning": reasoning, "reasoning_content": reasoning}
    if tools is None:
        return AssistantMessage(content=text, **said), None
    schemas = arguments_schemas(tools)
    reply = whole_reply(tools.fmt, text, tools.forced, tools.primer, cut_short(finish), schemas)
    calls = [
        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
        for c in reply.calls
    ]
    return AssistantMessage(content=reply.content, tool_calls=calls or None, **said), reply


def _answer(run: Run, body: ChatCompletionRequest, model: str, k: int | None) -> bytes:
    """The whole (non-streamed) answer as JSON: blocking, run it `off_loop`."""
    choices = []
    fmt, ids = _fmt(run, body), body.return_token_ids
    for i, cand in enumerate(run.candidates):
        text = "".join(p.text for p in cand.pieces)
        message, reply = _message(run, text, cand.finish_reason, cand.reasoning)
        every = cand.every_piece
        choices.append(
            ChatChoice(
                index=i,
                message=message,
                logprobs=fmt.chat_logprobs(cand.pieces, k, cand.thinking),
                finish_reason=finish_reason(reply, cand.finish_reason),
                continuation=(
                    _continuation(run, body, cand.prompt_scores, k or 0) if body.echo else None
                ),
                token_ids=[p.token_id for p in every] if ids else None,
                routed_experts=token_entries(every) if body.return_routed_experts else None,
                prompt_routed_experts=prompt_entries(cand.prompt_routed),
                **_prompt_extras(run, body, fmt, cand.prompt_scores),
            )
        )
    resp = ChatCompletionResponse(
        id=run.id, created=run.created, model=model, choices=choices, usage=run.usage,
        system_fingerprint=run.state.system_fingerprint,
        prompt_token_ids=list(run.plan.prompts[0].ids) if ids else None,
    )  # fmt: skip
    return dump_json(resp)


def _chunk(
    run: Run,
    model: str,
    choices: list[ChatChunkChoice],
    usage: Usage | None = None,
    prompt_ids: list[int] | None = None,
) -> ChatCompletionChunk:
    return ChatCompletionChunk(
        id=run.id,
        created=run.created,
        model=model,
        choices=choices,
        usage=usage,
        system_fingerprint=run.state.system_fingerprint,
        prompt_token_ids=prompt_ids,
    )


def _chat_delta(reply: ReplyParser | None, delta: Delta) -> ChatDelta:
    """The text a delta adds, or (with tools) the content and call parts it lets out; a
    thinking model's reasoning beside them."""
    said = _said(reply, delta)
    reasoning = delta.reasoning or None
    if reasoning is None:
        return said
    content = said.content or None  # a chunk of reasoning alone has no content
    return said.model_copy(
        update={"content": content, "reasoning": reasoning, "reasoning_content": reasoning}
    )


def _said(reply: ReplyParser | None, delta: Delta) -> ChatDelta:
    if reply is None:
        return ChatDelta(content=delta.text)
    part = reply.feed(delta.text)
    if delta.finish_reason:
        rest = reply.close(cut_short(delta.finish_reason))
        part.content += rest.content
        part.calls += rest.calls
    calls = [
        ToolCallDelta(
            index=c.index,
            id=c.id,
            type="function" if c.id else None,
            function=FunctionCallDelta(name=c.name, arguments=c.arguments),
        )
        for c in part.calls
    ]
    return ChatDelta(content=part.content or None, tool_calls=calls or None)


def _delta_events(
    run: Run,
    body: ChatCompletionRequest,
    model: str,
    k: int | None,
    i: int,
    delta: Delta,
    reply: ReplyParser | None,
    usage: StreamUsage,
) -> list[ChatCompletionChunk]:
    """The chunks of one delta of candidate i (the first may carry the prompt's scores). With
    tools, `reply` splits the text into content and calls; the logprobs are every token's; with
    return_token_ids, the delta's token ids (each id in the chunk that first holds its text);
    with return_routed_experts, their routing likewise."""
    events = []
    fmt = _fmt(run, body)
    lp = fmt.chat_logprobs(delta.pieces, k, delta.thinking)
    extras = _prompt_extras(run, body, fmt, delta.prompt_scores)  # the first chunk: the prompt
    every = delta.every_piece
    ids = [p.token_id for p in every] if body.return_token_ids else None
    routed = token_entries(every) if body.return_routed_experts else None
    prompt_routed = prompt_entries(delta.prompt_routed)
    said = _chat_delta(reply, delta)
    each = run.usage if usage.each else None
    shown = extras or ids or routed or prompt_routed
    scored = lp is not None and bool(lp.content or lp.reasoning)
    if said.content or said.tool_calls or said.reasoning or scored or shown:
        if said.content is None and not said.tool_calls and not said.reasoning:
            # the logprobs of tokens held back (or of calls, or of the reasoning)
            said = said.model_copy(update={"content": ""})
        choice = ChatChunkChoice(
            index=i, delta=said, logprobs=lp, token_ids=ids, routed_experts=routed,
            prompt_routed_experts=prompt_routed, **extras,
        )  # fmt: skip
        events.append(_chunk(run, model, [choice], each))
    if delta.finish_reason:
        finish = finish_reason(reply, delta.finish_reason)
        done = ChatChunkChoice(index=i, delta=ChatDelta(), finish_reason=finish)
        events.append(_chunk(run, model, [done], each))
    return events


async def _stream(
    run: Run, body: ChatCompletionRequest, model: str, k: int | None, usage: StreamUsage
) -> AsyncIterator[ChatCompletionChunk]:
    def opening() -> ChatCompletionChunk:  # each choice's role
        return _chunk(
            run,
            model,
            [
                ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))
                for i in range(len(run.candidates))
            ],
            run.usage if usage.each else None,
            list(run.plan.prompts[0].ids) if body.return_token_ids else None,
        )

    # with usage on every chunk, the opening waits for the first (settled) delta: the prompt's
    # cached tokens are known only once it is scheduled, and every chunk's usage must agree
    opened = not usage.each
    if opened:
        yield opening()
    tools = run.plan.tools
    replies = [ReplyParser.of(tools) if tools else None for _ in run.candidates]
    async for i, delta in run.deltas(settled=usage.each):
        if not opened:
            opened = True
            yield opening()
        if delta.prompt_scores is not None and body.prompt_logprobs is not None:
            # the prompt's scores: formatted off the loop, as the non-streamed answer is
            events = await off_loop(_delta_events, run, body, model, k, i, delta, replies[i], usage)
        else:
            events = _delta_events(run, body, model, k, i, delta, replies[i], usage)
        for e in events:
            yield e
    if usage.final:
        yield _chunk(run, model, [], run.usage)
