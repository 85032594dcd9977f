"""Server-sent events: `data: {json}` lines, then `data: [DONE]`; a comment line through long
silences; the stream's end told to its route however it ends (`EventStream`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from probserve.api.answers.json_out import dump_json
from probserve.api.errors import APIError, error_body
from probserve.api.protocol import StreamOptions


def event(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {dump_json(payload).decode()}\n\n"  # a big one: in slices
    return f"data: {json.dumps(payload, allow_nan=False)}\n\n"


DONE = "data: [DONE]\n\n"


@dataclass(frozen=True)
class StreamUsage:
    """Where a stream reports usage: in a final chunk of its own (`include_usage`), and on
    every chunk, the tokens so far (vLLM's `continuous_usage_stats`, with include_usage)."""

    final: bool = False
    each: bool = False

    @classmethod
    def of(cls, options: StreamOptions | None) -> StreamUsage:
        if options is None or not options.include_usage:
            return cls()
        return cls(True, options.continuous_usage_stats)


KEEPALIVE = ": keepalive\n\n"  # an SSE comment: clients skip it, proxies see traffic


async def with_keepalive(
    events: AsyncIterator[str | BaseModel], seconds: float
) -> AsyncGenerator[str | BaseModel, None]:
    """`events`, with a comment line after every `seconds` of silence (a long prefill, a queue)
    so no proxy's idle timeout closes the stream; 0: none. Closing it closes `events`."""
    if seconds <= 0:
        try:
            async for item in events:
                yield item
        finally:
            await _aclose(events)
        return
    it = aiter(events)
    pending: asyncio.Future[str | BaseModel] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(it))
            done, _ = await asyncio.wait({pending}, timeout=seconds)
            if not done:
                yield KEEPALIVE
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await _aclose(it)


async def _aclose(events: object) -> None:
    """Close an async generator left suspended (its `finally` blocks run now)."""
    close = getattr(events, "aclose", None)
    if close is not None:
        with contextlib.suppress(Exception):
            await close()


class EventStream(StreamingResponse):
    """A StreamingResponse that, however it ends (its last event sent, the client gone while an
    event was being written, before the first, or an error), closes its events and then calls
    `on_end`, before the response's access line is written: the route's run is finished
    (engine requests aborted, usage and metrics recorded) whatever the moment the client left,
    never later when its generators happen to be collected."""

    def __init__(
        self, events: AsyncGenerator[str, None], on_end: Callable[[], None] | None
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.events = events
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await _aclose(self.events)
            if self.on_end is not None:
                self.on_end()


def sse_response(
    events: AsyncIterator[str | BaseModel],
    done: bool = True,
    keepalive: float = 15.0,
    on_end: Callable[[], None] | None = None,
) -> EventStream:
    """Stream `events` (a model: one `event`, encoded here); an APIError after the headers went
    out becomes an error event. `done`: end with `data: [DONE]` (completions and chat; the
    Responses API sends none). `keepalive`: seconds of silence before a comment line
    (with_keepalive). `on_end`: called once the stream has ended, however (EventStream)."""

    async def guarded() -> AsyncGenerator[str, None]:
        try:
            async with contextlib.aclosing(with_keepalive(events, keepalive)) as items:
                async for item in items:
                    yield item if isinstance(item, str) else event(item)
        except APIError as exc:
            yield event(error_body(exc.status, exc.message, exc.param, exc.code))
        if done:
            yield DONE

    return EventStream(guarded(), on_end)
