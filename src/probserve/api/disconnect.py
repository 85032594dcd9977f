"""Waiting for work while watching the client: a client that goes away cancels the work."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from probserve.api.errors import APIError

T = TypeVar("T")

POLL_SECONDS = 0.25


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (which aborts its engine
    requests) and raise APIError 499 (nginx's "client closed request"; nobody reads it)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=POLL_SECONDS)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise APIError(499, "client closed request", None, "client_closed_request")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
