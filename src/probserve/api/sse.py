"""Server-sent events: `data: {json}` lines, then `data: [DONE]`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from probserve.api.errors import APIError, error_body
from probserve.api.json_out import dump_json


def event(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {dump_json(payload).decode()}\n\n"  # a big one: in slices
    return f"data: {json.dumps(payload, allow_nan=False)}\n\n"


DONE = "data: [DONE]\n\n"


def sse_response(events: AsyncIterator[str], done: bool = True) -> StreamingResponse:
    """Stream `events`; an APIError after the headers went out becomes an error event. `done`:
    end with `data: [DONE]` (completions and chat; the Responses API sends none)."""

    async def guarded() -> AsyncIterator[str]:
        try:
            async for item in events:
                yield item
        except APIError as exc:
            yield event(error_body(exc.status, exc.message, exc.param, exc.code))
        if done:
            yield DONE

    return StreamingResponse(
        guarded(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
