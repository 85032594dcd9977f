"""Running candidates: engine streams in, text pieces out, for completions and chat alike.

A candidate is one engine request plus its TextStream. `deltas()` yields what may be emitted
after each engine step; a stop string ends the candidate and aborts its engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TypeVar

from probserve.api.errors import APIError
from probserve.api.text_stream import Piece, TextStream
from probserve.engine import (
    AsyncEngine,
    EngineRequest,
    FinishReason,
    RequestStream,
    TokenLogprobs,
)

T = TypeVar("T")


@dataclass
class Delta:
    pieces: list[Piece]
    finish_reason: str | None = None
    prompt_scores: TokenLogprobs | None = None

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)


@dataclass
class Candidate:
    request: EngineRequest
    stream: RequestStream
    text: TextStream
    pieces: list[Piece] = field(default_factory=list)
    prompt_scores: TokenLogprobs | None = None
    finish_reason: str | None = None
    num_tokens: int = 0  # tokens the engine generated (billed), stop strings aside
    logprob_sum: float = 0.0

    @property
    def mean_logprob(self) -> float:
        return self.logprob_sum / self.num_tokens if self.num_tokens else 0.0

    async def deltas(self) -> AsyncIterator[Delta]:
        first = True
        try:
            async for out in self.stream:
                if out.finish_reason == FinishReason.ERROR:
                    raise APIError(500, out.error or "the engine failed this request")
                n = len(out.new_token_ids)
                for j, tid in enumerate(out.new_token_ids):
                    hidden = out.finish_reason == FinishReason.STOP and j == n - 1
                    self.text.add(tid, out.logprobs, j, hidden=hidden)
                self.num_tokens += n
                if out.logprobs is not None:
                    self.logprob_sum += float(out.logprobs.logprobs.astype("float64").sum())
                if out.prompt_logprobs is not None:
                    self.prompt_scores = out.prompt_logprobs
                finish: str | None = None
                if self.text.stopped:
                    finish = "stop"
                elif out.finished:
                    finish = "stop" if out.finish_reason == FinishReason.STOP else "length"
                pieces = self.text.release(final=finish is not None)
                self.pieces += pieces
                if pieces or finish or (first and self.prompt_scores is not None):
                    yield Delta(pieces, finish, self.prompt_scores if first else None)
                    first = False
                if finish:
                    self.finish_reason = finish
                    return
        finally:
            self.stream.close()

    async def run(self) -> Candidate:
        async for _ in self.deltas():
            pass
        return self


async def submit_all(engine: AsyncEngine, requests: list[EngineRequest]) -> list[RequestStream]:
    """Submit every request or none: a RequestError on one closes those already queued."""
    streams: list[RequestStream] = []
    try:
        for req in requests:
            streams.append(await engine.submit(req))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


async def merge(iterators: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive: yields (iterator index, item)."""
    queue: asyncio.Queue[tuple[int, T | None, BaseException | None, bool]] = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await queue.put((i, item, None, False))
            await queue.put((i, None, None, True))
        except Exception as exc:
            await queue.put((i, None, exc, True))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item, exc, done = await queue.get()
            if exc is not None:
                raise exc
            if done:
                remaining -= 1
                continue
            yield i, item  # type: ignore[misc]
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
