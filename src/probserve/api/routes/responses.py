"""POST /v1/responses: OpenAI's Responses API, with logprobs, streamed or not.

`input` (text or messages) and `instructions` go through the model's chat template, as chat
messages do (api/plans/responses.py). Logprobs, when asked for, ride on the `output_text`
part, and on each `response.output_text.delta` event for that delta's tokens. A reply cut by
`max_output_tokens` (or the context) is `incomplete`. A thinking model's reasoning is a
`reasoning` item before the message, its text one `reasoning_text` part (with its tokens'
logprobs, probserve's), streamed as `response.reasoning_text.delta` events. Responses are not
stored: `previous_response_id` is a 400.
"""

from __future__ import annotations

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
    MessageBegun,
    ReplyItems,
    Said,
    TextSaid,
    ThoughtSaid,
)
from probserve.api.pipeline.run import Run
from probserve.api.plans.responses import in_responses_terms, responses_plan
from probserve.api.protocol import (
    IncompleteDetails,
    ResponseFunctionCall,
    ResponseObject,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseReasoningText,
    ResponsesRequest,
    ResponseUsage,
)
from probserve.api.server.lookup import serving_of
from probserve.api.server.state import Serving
from probserve.engine import RequestError

router = APIRouter()


class _Reply(ReplyItems):
    """The response object as it grows: an assistant message with one output_text part, and
    (a request with tools) the function_call items."""

    def __init__(self, run: Run, body: ResponsesRequest, model: str, k: int | None) -> None:
        super().__init__(run, k, body.return_tokens_as_token_ids)
        self.body, self.model = body, model

    @property
    def status(self) -> str:
        if self.finish is None:
            return "in_progress"
        return "incomplete" if self.finish in ("length", "grammar_limit") else "completed"

    def part(self) -> ResponseOutputText:
        return ResponseOutputText(
            text=self.text, logprobs=self.logprobs if self.k is not None else None
        )

    def item(self) -> ResponseOutputMessage:
        done = self.finish is not None
        return ResponseOutputMessage(
            id=self.item_id, status=self.status, content=[self.part()] if done else []
        )

    def thought_part(self) -> ResponseReasoningText:
        assert self.thought is not None
        logprobs = self.thought.logprobs if self.k is not None else None
        return ResponseReasoningText(text=self.thought.text, logprobs=logprobs)

    def thought_item(self) -> ResponseReasoningItem:
        """The reasoning: completed once the thinking ended (the answer began), else as the
        reply is (a reply cut short while thinking: incomplete)."""
        assert self.thought is not None
        split = self.run.candidates[0].split
        ended = split is not None and split.state == "answer"
        done = self.thought.closed or self.finish is not None
        return ResponseReasoningItem(
            id=self.thought.id,
            content=[self.thought_part()] if done else [],
            status="completed" if ended and done else self.status,
        )

    def call_item(self, index: int) -> ResponseFunctionCall:
        """A call: completed once its arguments are whole (a reply cut short leaves only the
        call it cut `incomplete`), in progress before."""
        c = self.calls[index]
        done = c.closed or self.finish is not None
        status = "completed" if c.complete else self.status
        return ResponseFunctionCall(
            id=c.id,
            call_id=c.call_id,
            name=c.name,
            arguments=c.arguments if done else "",
            status=status if done else "in_progress",
            logprobs=c.logprobs if self.k is not None and done else None,
        )

    def items(self) -> list[ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionCall]:
        thought = [self.thought_item()] if self.thought is not None else []
        return thought + [self.item() if i is None else self.call_item(i) for i in self.order]

    def response(self) -> ResponseObject:
        b = self.body
        done = self.finish is not None
        usage, cand = self.run.usage, self.run.candidates[0]
        reason = "grammar_limit" if self.finish == "grammar_limit" else "max_output_tokens"
        incomplete = IncompleteDetails(reason=reason)
        tools = self.run.plan.tools
        return ResponseObject(
            id=self.id,
            created_at=self.run.created,
            status=self.status,
            incomplete_details=incomplete if self.status == "incomplete" else None,
            model=self.model,
            output=self.items() if done else [],
            usage=(
                ResponseUsage(
                    input_tokens=usage.prompt_tokens,
                    input_tokens_details=usage.prompt_tokens_details,
                    output_tokens=usage.completion_tokens,
                    output_tokens_details={"reasoning_tokens": len(cand.thinking)},
                    total_tokens=usage.total_tokens,
                )
                if done
                else None
            ),
            instructions=b.instructions,
            max_output_tokens=b.max_output_tokens,
            temperature=b.temperature,
            top_p=b.top_p,
            top_logprobs=b.top_logprobs,
            parallel_tool_calls=tools.parallel if tools is not None else True,
            tool_choice=_echo_choice(b),
            tools=[t.model_dump(exclude_none=True) for t in b.tools or ()],
            text={"format": _echo_format(b)},
            metadata=b.metadata or {},
            prompt_token_ids=list(self.run.plan.prompts[0].ids) if b.return_token_ids else None,
            token_ids=(
                [p.token_id for p in self.run.candidates[0].every_piece]
                if b.return_token_ids and done
                else None
            ),
        )


def _echo_choice(body: ResponsesRequest) -> str | dict[str, Any]:
    choice = body.tool_choice
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()


def _echo_format(body: ResponsesRequest) -> dict[str, Any]:
    """The text format the reply followed, as the request gave it."""
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return {"type": "text"}
    return fmt.model_dump(by_alias=True, exclude_none=True)


@router.post("/v1/responses", response_model=ResponseObject, responses=ERRORS)
async def create_response(
    body: ResponsesRequest,
    request: Request,
    state: Annotated[Serving, Depends(serving_of(ResponsesRequest))],
) -> Response:
    model = state.name
    plan, ask = await responses_plan(state, body)
    try:
        run = await Run(state, request, plan, "resp").start()
    except (APIError, RequestError) as exc:
        raise in_responses_terms(exc) from None
    reply = _Reply(run, body, model, ask.alternatives)
    if body.stream:
        keepalive = state.config.http.sse_keepalive
        return sse_response(_stream(reply), False, keepalive, on_end=run.close)
    (cand,) = await run.collect()
    # formatted off the loop: a long reply's logprobs x targets are seconds of work
    return Response(await off_loop(_answer, reply, cand), media_type="application/json")


def _answer(reply: _Reply, cand: Candidate) -> bytes:
    """The whole (non-streamed) answer as JSON: blocking, run it `off_loop`."""
    reply.think(cand.thinking)
    if reply.parser is None:
        reply.message_begins()
        reply.add(cand.pieces)
    else:
        reply.add_with_tools(cand.pieces, cand.finish_reason or "stop")
    reply.finish = cand.finish_reason or "stop"
    return dump_json(reply.response())


def _event(kind: str, seq: int, **fields: Any) -> str:
    data = {"type": kind, "sequence_number": seq, **fields}
    return f"event: {kind}\ndata: {dump_json(data).decode()}\n\n"  # a big one: in slices


async def _stream(reply: _Reply) -> AsyncIterator[str]:
    seq = 0

    def ev(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return _event(kind, seq - 1, **fields)

    def where() -> dict[str, Any]:  # the message's place in the output
        return {
            "item_id": reply.item_id,
            "output_index": reply.output_index(None),
            "content_index": 0,
        }

    def call_closed(item: int) -> list[str]:  # a call's closing events
        call, at = reply.calls[item], reply.output_index(item)
        return [
            ev("response.function_call_arguments.done", item_id=call.id, output_index=at,
               arguments=call.arguments),
            ev("response.output_item.done", output_index=at, item=reply.call_item(item)),
        ]  # fmt: skip

    def thought_where() -> dict[str, Any]:  # the reasoning's place: first
        assert reply.thought is not None
        return {"item_id": reply.thought.id, "output_index": 0, "content_index": 0}

    def thought_closed() -> list[str]:  # the reasoning's closing events (once)
        if reply.thought is None or reply.thought.closed:
            return []
        reply.thought.closed = True
        return [
            ev("response.reasoning_text.done", **thought_where(), text=reply.thought.text,
               logprobs=reply.thought.logprobs),
            ev("response.content_part.done", **thought_where(), part=reply.thought_part()),
            ev("response.output_item.done", output_index=0, item=reply.thought_item()),
        ]  # fmt: skip

    def message_begun() -> list[str]:
        at = reply.output_index(None)
        return [
            ev("response.output_item.added", output_index=at, item=reply.item()),
            ev("response.content_part.added", **where(), part=ResponseOutputText(text="")),
        ]

    def said(step: Said) -> list[str]:  # what one step did, as events
        match step:
            case ThoughtSaid(text, entries, begun):
                events = []
                if begun:
                    events += [
                        ev("response.output_item.added", output_index=0, item=reply.thought_item()),
                        ev("response.content_part.added", **thought_where(),
                           part=ResponseReasoningText(text="")),
                    ]  # fmt: skip
                return [*events, ev("response.reasoning_text.delta", **thought_where(),
                                    delta=text, logprobs=entries)]  # fmt: skip
            case MessageBegun():
                return message_begun()
            case TextSaid(text, entries):
                return [ev("response.output_text.delta", **where(), delta=text, logprobs=entries)]
            case CallBegun(index):
                at = reply.output_index(index)
                item = reply.call_item(index)
                return [ev("response.output_item.added", output_index=at, item=item)]
            case CallDone(index):
                return call_closed(index)
            case ArgumentsSaid(index, text):
                call, at = reply.calls[index], reply.output_index(index)
                return [ev("response.function_call_arguments.delta", item_id=call.id,
                           output_index=at, delta=text)]  # fmt: skip
        raise AssertionError(f"unknown step {step!r}")

    yield ev("response.created", response=reply.response())
    yield ev("response.in_progress", response=reply.response())
    if reply.parser is None and not reply.thinks:
        yield ev("response.output_item.added", output_index=0, item=reply.item())
        yield ev("response.content_part.added", **where(), part=ResponseOutputText(text=""))
    try:
        async for _, delta in reply.run.deltas():
            for step in reply.think(delta.thinking):
                for e in said(step):
                    yield e
            if delta.pieces:  # the answer began: the thinking is over
                for e in thought_closed():
                    yield e
            if reply.parser is None and delta.pieces and reply.message_begins():
                for e in message_begun():
                    yield e
            if reply.parser is not None:
                for step in reply.add_with_tools(delta.pieces, delta.finish_reason):
                    for e in said(step):
                        yield e
            else:
                text, entries = reply.add(delta.pieces)
                if text or entries:
                    yield ev("response.output_text.delta", **where(), delta=text, logprobs=entries)
            if delta.finish_reason:
                reply.finish = delta.finish_reason
    except APIError as exc:  # after the first event: an error event ends the stream
        err = error_body(exc.status, exc.message, exc.param, exc.code)["error"]
        code = err["code"] or err["type"]
        yield ev("error", code=code, message=err["message"], param=err["param"])
        return
    reply.finish = reply.finish or "stop"

    def closing() -> list[str]:  # the whole reply, again: written off the loop
        events = thought_closed()
        if reply.parser is None and reply.message_begins():  # a reply that only thought
            events += message_begun()
        for item in reply.order:
            if item is None:
                at = reply.output_index(None)
                events += [
                    ev(
                        "response.output_text.done",
                        **where(),
                        text=reply.text,
                        logprobs=reply.logprobs,
                    ),
                    ev("response.content_part.done", **where(), part=reply.part()),
                    ev("response.output_item.done", output_index=at, item=reply.item()),
                ]
            elif not reply.calls[item].closed:  # a call cut short (closed calls: as they closed)
                events += call_closed(item)
        final = "response.incomplete" if reply.status == "incomplete" else "response.completed"
        return [*events, ev(final, response=reply.response())]

    for e in await off_loop(closing):
        yield e
