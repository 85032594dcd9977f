"""POST /v1/responses: OpenAI's Responses API, with logprobs, streamed or not.

`input` (text or messages) and `instructions` go through the model's chat template, as chat
messages do (api/plans/responses.py). Logprobs, when asked for, ride on the `output_text`
part, and on each `response.output_text.delta` event for that delta's tokens. A reply cut by
`max_output_tokens` (or the context) is `incomplete`. Responses are not stored:
`previous_response_id` is a 400.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from probserve.api.errors import ERRORS, APIError, error_body
from probserve.api.generation import Candidate
from probserve.api.json_out import dump_json
from probserve.api.lookup import serving_of
from probserve.api.plans.responses import in_responses_terms, responses_plan
from probserve.api.prompts import off_loop
from probserve.api.protocol import (
    ChatLogprobEntry,
    IncompleteDetails,
    ResponseObject,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponsesRequest,
    ResponseUsage,
)
from probserve.api.run import Run
from probserve.api.sse import sse_response
from probserve.api.state import Serving
from probserve.api.text_stream import Piece
from probserve.engine import RequestError

router = APIRouter()


class _Reply:
    """The response object as it grows: one assistant message with one output_text part."""

    def __init__(self, run: Run, body: ResponsesRequest, model: str, k: int | None) -> None:
        self.run, self.body, self.model, self.k = run, body, model, k
        self.id = run.id
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.text = ""
        self.logprobs: list[ChatLogprobEntry] = []
        self.finish: str | None = None

    def add(self, pieces: list[Piece]) -> tuple[str, list[ChatLogprobEntry]]:
        text = "".join(p.text for p in pieces)
        entries = self.run.state.fmt.chat(pieces, self.k) if self.k is not None else []
        self.text += text
        self.logprobs += entries
        return text, entries

    @property
    def status(self) -> str:
        if self.finish is None:
            return "in_progress"
        return "incomplete" if self.finish == "length" else "completed"

    def part(self) -> ResponseOutputText:
        return ResponseOutputText(
            text=self.text, logprobs=self.logprobs if self.k is not None else None
        )

    def item(self) -> ResponseOutputMessage:
        done = self.finish is not None
        return ResponseOutputMessage(
            id=self.item_id, status=self.status, content=[self.part()] if done else []
        )

    def response(self) -> ResponseObject:
        b = self.body
        done = self.finish is not None
        usage = self.run.usage
        incomplete = IncompleteDetails(reason="max_output_tokens")
        return ResponseObject(
            id=self.id,
            created_at=self.run.created,
            status=self.status,
            incomplete_details=incomplete if self.status == "incomplete" else None,
            model=self.model,
            output=[self.item()] if done else [],
            usage=(
                ResponseUsage(
                    input_tokens=usage.prompt_tokens,
                    output_tokens=usage.completion_tokens,
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
            metadata=b.metadata or {},
        )


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
        return sse_response(_stream(reply), done=False)
    (cand,) = await run.collect()
    # formatted off the loop: a long reply's logprobs x targets are seconds of work
    return Response(await off_loop(_answer, reply, cand), media_type="application/json")


def _answer(reply: _Reply, cand: Candidate) -> bytes:
    """The whole (non-streamed) answer as JSON: blocking, run it `off_loop`."""
    reply.add(cand.pieces)
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

    where = {"item_id": reply.item_id, "output_index": 0, "content_index": 0}
    yield ev("response.created", response=reply.response())
    yield ev("response.in_progress", response=reply.response())
    yield ev("response.output_item.added", output_index=0, item=reply.item())
    yield ev("response.content_part.added", **where, part=ResponseOutputText(text=""))
    try:
        async for _, delta in reply.run.deltas():
            text, entries = reply.add(delta.pieces)
            if text or entries:
                yield ev("response.output_text.delta", **where, delta=text, logprobs=entries)
            if delta.finish_reason:
                reply.finish = delta.finish_reason
    except APIError as exc:  # after the first event: an error event ends the stream
        err = error_body(exc.status, exc.message, exc.param, exc.code)["error"]
        code = err["code"] or err["type"]
        yield ev("error", code=code, message=err["message"], param=err["param"])
        return
    reply.finish = reply.finish or "stop"

    def closing() -> list[str]:  # the whole reply, four times over: written off the loop
        final = "response.incomplete" if reply.status == "incomplete" else "response.completed"
        return [
            ev("response.output_text.done", **where, text=reply.text, logprobs=reply.logprobs),
            ev("response.content_part.done", **where, part=reply.part()),
            ev("response.output_item.done", output_index=0, item=reply.item()),
            ev(final, response=reply.response()),
        ]

    for e in await off_loop(closing):
        yield e
