"""Work that would block the event loop, run on a worker thread instead: tokenizers and chat
templates, grammar compilation, formatting a big answer. One helper, imported wherever a
route or plan hands such work off."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run blocking work (`fn(*args)`) in a worker thread: the event loop stays free."""
    return await asyncio.to_thread(fn, *args)
