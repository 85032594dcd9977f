"""Waiting for work while watching the client: a client that goes away cancels the work. The
disconnect is awaited (the server's http.disconnect message), never polled: a thousand queued
requests cost no wake-ups while they wait."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

from probserve.api.errors import APIError

T = TypeVar("T")


async def disconnected(request: Request) -> None:
    """Returns once the client has gone: the request's body has been read, so the next message
    the server gives is http.disconnect, sent when the connection closes."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it (which aborts its engine
    requests) and raise APIError 499 (nginx's "client closed request"; nobody reads it)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise APIError(499, "client closed request", None, "client_closed_request")
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
                with contextlib.suppress(BaseException):
                    await t
