"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, streamed or not,
for coding agents (Claude Code) and the `anthropic` SDK.

The conversation goes through the model's chat template as chat messages do
(api/plans/messages.py); the reply is content blocks: text, and a `tool_use` block per call
the reply makes (the tool-call machinery of chat, parsed as it streams), after a `thinking`
block where a thinking model thought (`thinking_delta` events as it streams). A stream is
Anthropic's events: `message_start`, `ping`, per block `content_block_start`, its
`content_block_delta`s (`text_delta`, `input_json_delta`) and `content_block_stop`, then
`message_delta` (stop reason, usage) and `message_stop`; an error after the first event is an
`error` event. Logprobs (probserve's extension, `logprobs` + `top_logprobs` as chat's) ride on
each text block and each `text_delta` event for that delta's tokens, and on each tool_use block
and its `content_block_stop` event. Errors are in Anthropic's envelope
(`{"type": "error", "error": {...}}`, api/errors.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from probserve.api.answers.json_out import dump_json
from probserve.api.edge.sse import sse_response
from probserve.api.errors import ERRORS, APIError, error_body
from probserve.api.off_loop import off_loop
from probserve.api.pipeline.candidates import Candidate
from probserve.api.pipeline.reply_items import (
    ArgumentsSaid,
    CallBegun,
    CallDone,
    ReplyItems,
    Said,
    TextSaid,
    ThoughtSaid,
)
from probserve.api.pipeline.run import Run
from probserve.api.plans.messages import counted_tokens, messages_plan
from probserve.api.protocol import ChatLogprobEntry
from probserve.api.protocol.messages import (
    CountTokensRequest,
    CountTokensResponse,
    MessageObject,
    MessagesRequest,
    MessagesUsage,
    StopReason,
    TextContent,
    ThinkingContent,
    ToolUseContent,
)
from probserve.api.server.lookup import serving_of
from probserve.api.server.state import Serving

router = APIRouter()

Event = dict[str, Any]
Block = ThinkingContent | TextContent | ToolUseContent


def _input(arguments: str) -> Any:
    """A call's input: its arguments as JSON ({} where they do not parse: a call cut short)."""
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}


class _Message(ReplyItems):
    """The message as content blocks as it grows: the reply's items (ReplyItems) in the order
    they appear, text after a call a new text block. `said` turns each step into the block
    events a stream sends; a whole answer takes the same steps and keeps the blocks."""

    def __init__(self, run: Run, body: MessagesRequest, model: str, k: int | None) -> None:
        super().__init__(run, k, body.return_tokens_as_token_ids)
        self.body, self.model = body, model
        self.id = f"msg_{uuid.uuid4().hex}"
        self.blocks: list[Block] = []
        self.calls_at: dict[int, int] = {}  # a call's index -> its block's
        self.open: int | None = None  # the block still growing
        self.held: list[ChatLogprobEntry] = []  # entries of tokens before any block

    @property
    def candidate(self) -> Candidate:
        return self.run.candidates[0]

    def steps(self, thinking: list[Any], cand_pieces: list[Any], ended: str | None) -> list[Said]:
        """What these pieces say: the reasoning's, then the answer's (`ended`: the reply's
        finish reason, if they end it)."""
        said = self.think(thinking)
        if self.parser is not None:
            return said + self.add_with_tools(cand_pieces, ended)
        text, entries = self.add(cand_pieces)
        return [*said, TextSaid(text, entries)] if text or entries else said

    def _logprobs(self) -> list[ChatLogprobEntry] | None:
        return [] if self.k is not None else None

    def _start(self, block: Block) -> list[Event]:
        events = self._stop()
        self.blocks.append(block)
        self.open = len(self.blocks) - 1
        content: Event
        if isinstance(block, TextContent):
            content = {"type": "text", "text": "", "citations": None}
        elif isinstance(block, ThinkingContent):
            content = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            content = {"type": "tool_use", "id": block.id, "name": block.name, "input": {}}
        return [*events, {"type": "content_block_start", "index": self.open,
                          "content_block": content}]  # fmt: skip

    def _stop(self) -> list[Event]:
        if self.open is None:
            return []
        at, self.open = self.open, None
        block = self.blocks[at]
        event: Event = {"type": "content_block_stop", "index": at}
        if isinstance(block, ToolUseContent):
            call = self.calls[next(i for i, b in self.calls_at.items() if b == at)]
            block.input = _input(call.arguments)
            if self.k is not None:
                block.logprobs = self.held + call.logprobs
                self.held = []
                event["logprobs"] = block.logprobs
        return [event]

    def said(self, step: Said) -> list[Event]:
        """The events of one step (and the blocks it grows)."""
        match step:
            case ThoughtSaid(text, entries, begun):
                return self._thought(text, entries, begun)
            case TextSaid(text, entries):
                return self._text(text, entries)
            case CallBegun(index):
                call = self.calls[index]
                events = self._start(
                    ToolUseContent(id=call.call_id, name=call.name, input={},
                                   logprobs=self._logprobs())
                )  # fmt: skip
                self.calls_at[index] = len(self.blocks) - 1
                return events
            case ArgumentsSaid(index, text):
                delta = {"type": "input_json_delta", "partial_json": text}
                return [{"type": "content_block_delta", "index": self.calls_at[index],
                         "delta": delta}]  # fmt: skip
            case CallDone(index):
                return self._stop() if self.open == self.calls_at.get(index) else []
        return []  # MessageBegun: a text block begins with its first text

    def _thought(self, text: str, entries: list[ChatLogprobEntry], begun: bool) -> list[Event]:
        """The thinking block (the first) as it grows."""
        events = []
        if begun:
            events = self._start(ThinkingContent(thinking="", logprobs=self._logprobs()))
        block = self.blocks[0]
        assert isinstance(block, ThinkingContent)
        block.thinking += text
        event: Event = {"type": "content_block_delta", "index": 0,
                        "delta": {"type": "thinking_delta", "thinking": text}}  # fmt: skip
        if self.k is not None:
            assert block.logprobs is not None
            block.logprobs += entries
            event["logprobs"] = entries
        return [*events, event]

    def _text(self, text: str, entries: list[ChatLogprobEntry]) -> list[Event]:
        events: list[Event] = []
        open_block = self.blocks[self.open] if self.open is not None else None
        if not text and not isinstance(open_block, TextContent):
            self.held += entries  # tokens that showed nothing: with the next block
            return []
        if not isinstance(open_block, TextContent):
            events += self._start(TextContent(text="", logprobs=self._logprobs()))
            entries, self.held = self.held + entries, []
        assert self.open is not None
        block = self.blocks[self.open]
        assert isinstance(block, TextContent)
        block.text += text
        event: Event = {"type": "content_block_delta", "index": self.open,
                        "delta": {"type": "text_delta", "text": text}}  # fmt: skip
        if self.k is not None:
            assert block.logprobs is not None
            block.logprobs += entries
            event["logprobs"] = entries
        return [*events, event]

    def close(self) -> list[Event]:
        """The open block's end (tokens that showed nothing at all: an empty text block)."""
        if self.held and all(isinstance(b, ThinkingContent) for b in self.blocks):
            events = self._start(TextContent(text="", logprobs=self.held))
            self.held = []
            return [*events, *self._stop()]
        if self.held and self.k is not None:
            last = self.blocks[-1]
            assert last.logprobs is not None
            last.logprobs += self.held
            self.held = []
        return self._stop()

    @property
    def stop(self) -> tuple[StopReason, str | None]:
        """The stop reason and the stop sequence met (if one was)."""
        finish = self.finish or "stop"
        if finish in ("length", "grammar_limit"):
            return "max_tokens", None
        matched = self.candidate.text.matched
        if matched is not None:
            return "stop_sequence", matched
        return ("tool_use" if self.calls else "end_turn"), None

    def usage(self, done: bool = True) -> MessagesUsage:
        usage, cached = self.run.usage, self.run.cached_tokens
        return MessagesUsage(
            input_tokens=usage.prompt_tokens - cached,
            output_tokens=usage.completion_tokens if done else 0,
            cache_read_input_tokens=cached,
        )

    def message(self, done: bool = True) -> MessageObject:
        reason, sequence = self.stop if done else (None, None)
        ids = self.body.return_token_ids
        return MessageObject(
            id=self.id, model=self.model, content=list(self.blocks) if done else [],
            stop_reason=reason, stop_sequence=sequence, usage=self.usage(done),
            prompt_token_ids=list(self.run.plan.prompts[0].ids) if ids else None,
            token_ids=[p.token_id for p in self.candidate.every_piece] if ids and done else None,
        )  # fmt: skip


@router.post("/v1/messages", response_model=MessageObject, responses=ERRORS)
async def create_message(
    body: MessagesRequest,
    request: Request,
    state: Annotated[Serving, Depends(serving_of(MessagesRequest))],
) -> Response:
    plan, ask = await messages_plan(state, body)
    run = await Run(state, request, plan, "msg").start()
    message = _Message(run, body, state.name, ask.alternatives)
    if body.stream:
        keepalive = state.config.http.sse_keepalive
        return sse_response(_stream(message), False, keepalive, on_end=run.close)
    (cand,) = await run.collect()
    # formatted off the loop: a long reply's logprobs x targets are seconds of work
    return Response(await off_loop(_answer, message, cand), media_type="application/json")


@router.post("/v1/messages/count_tokens", response_model=CountTokensResponse, responses=ERRORS)
async def count_tokens(
    body: CountTokensRequest,
    state: Annotated[Serving, Depends(serving_of(CountTokensRequest))],
) -> CountTokensResponse:
    return CountTokensResponse(input_tokens=await counted_tokens(state, body))


def _answer(message: _Message, cand: Candidate) -> bytes:
    """The whole (non-streamed) answer as JSON: blocking, run it `off_loop`."""
    for step in message.steps(cand.thinking, cand.pieces, cand.finish_reason or "stop"):
        message.said(step)
    message.close()
    message.finish = cand.finish_reason or "stop"
    return dump_json(message.message())


def _event(event: Event) -> str:
    return f"event: {event['type']}\ndata: {dump_json(event).decode()}\n\n"


async def _stream(message: _Message) -> AsyncIterator[str]:
    def opening() -> list[str]:
        return [
            _event({"type": "message_start", "message": message.message(done=False)}),
            _event({"type": "ping"}),
        ]

    # message_start's usage names the prompt tokens read from the cache, known once the prompt
    # is scheduled: it waits for the first (settled) delta, so that it agrees with the last
    opened = False
    try:
        async for _, delta in message.run.deltas(settled=True):
            if not opened:
                opened = True
                for line in opening():
                    yield line
            for step in message.steps(delta.thinking, delta.pieces, delta.finish_reason):
                for e in message.said(step):
                    yield _event(e)
            if delta.finish_reason:
                message.finish = delta.finish_reason
    except APIError as exc:  # after the first event: an error event ends the stream
        yield _event(error_body(exc.status, exc.message, exc.param, exc.code, anthropic=True))
        return
    if not opened:
        for line in opening():
            yield line
    for e in message.close():
        yield _event(e)
    reason, sequence = message.stop
    usage = message.usage()
    yield _event(
        {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage.model_dump(exclude={"service_tier"}),
        }
    )  # fmt: skip
    yield _event({"type": "message_stop"})
