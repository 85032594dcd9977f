"""Running candidates: engine streams in, text pieces out, for completions and chat alike.

A candidate is one engine request plus its TextStream. `deltas()` yields what may be emitted
after each engine step; a stop string ends the candidate and aborts its engine request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
from starlette.requests import Request

from probserve.api.answers.harmony import HarmonySplit
from probserve.api.answers.text_stream import Piece, TextStream
from probserve.api.answers.thinking import ThinkSplit
from probserve.api.edge.disconnect import unless_disconnected
from probserve.api.errors import APIError
from probserve.engine import (
    EngineClient,
    EngineRequest,
    FinishReason,
    RequestStream,
    RoutedExperts,
    TokenLogprobs,
)

T = TypeVar("T")


@dataclass
class Delta:
    pieces: list[Piece]  # the answer's (a thinking model's: after its thinking)
    finish_reason: str | None = None
    prompt_scores: TokenLogprobs | None = None
    prompt_routed: RoutedExperts | None = None  # the first delta's, with the prompt's routing
    thinking: list[Piece] = field(default_factory=list)  # the reasoning's, before `pieces`

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)

    @property
    def reasoning(self) -> str:
        return "".join(p.text for p in self.thinking)

    @property
    def every_piece(self) -> list[Piece]:
        """Every token's piece, in the order generated (the reasoning's come first)."""
        return self.thinking + self.pieces if self.thinking else self.pieces


# the engine's finish -> the answer's: OpenAI's "stop" for a stop token or a grammar complete;
# "grammar_limit" (probserve's) where the grammar met one of llguidance's bounds partway
_FINISH = {
    FinishReason.STOP: "stop",
    FinishReason.GRAMMAR: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.GRAMMAR_LIMIT: "grammar_limit",
}


@dataclass
class Candidate:
    request: EngineRequest
    stream: RequestStream
    text: TextStream
    pieces: list[Piece] = field(default_factory=list)  # the answer's
    # a thinking model's reply: reasoning and answer apart
    split: ThinkSplit | HarmonySplit | None = None
    thinking: list[Piece] = field(default_factory=list)  # the reasoning's (before `pieces`)
    prompt_scores: TokenLogprobs | None = None
    prompt_routed: RoutedExperts | None = None  # RoutingSpec.prompt: tokens 1..len-1
    embedding: np.ndarray | None = None  # EngineRequest.embed: the pooled hidden states
    finish_reason: str | None = None
    num_tokens: int = 0  # tokens the engine generated (billed), stop strings aside
    logprob_sum: float = 0.0
    token_scores: list[TokenLogprobs] = field(default_factory=list)  # each output's rows, in order
    # prompt scores shared among the candidates of one prompt: the first candidate's engine
    # request scores the prompt and publishes the result; its siblings wait for it
    publish_prompt: asyncio.Future[TokenLogprobs | None] | None = None
    shared_prompt: asyncio.Future[TokenLogprobs | None] | None = None
    # for metrics: when each output with tokens arrived, and the engine's queue time
    token_times: list[float] = field(default_factory=list)
    queue_time: float | None = None
    cached_tokens: int | None = None  # of its prompt, found in the prefix cache

    @property
    def every_piece(self) -> list[Piece]:
        """Every token's piece, in the order generated (the reasoning's come first)."""
        return self.thinking + self.pieces if self.thinking else self.pieces

    @property
    def reasoning(self) -> str | None:
        """The reasoning's text (None: the reply did not think)."""
        return "".join(p.text for p in self.thinking) if self.thinking else None

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
                if n:
                    self.token_times.append(time.monotonic())
                if self.queue_time is None:
                    self.queue_time = out.queue_time
                if self.cached_tokens is None:
                    self.cached_tokens = out.cached_tokens
                for j, tid in enumerate(out.new_token_ids):
                    hidden = out.finish_reason == FinishReason.STOP and j == n - 1
                    self.text.add(tid, out.logprobs, j, hidden, out.routed)
                self.num_tokens += n
                if out.logprobs is not None:
                    self.token_scores.append(out.logprobs)
                    self.logprob_sum += float(out.logprobs.logprobs.astype("float64").sum())
                if out.prompt_logprobs is not None:
                    self.prompt_scores = out.prompt_logprobs
                    self._publish(out.prompt_logprobs)
                if out.prompt_routed is not None:
                    self.prompt_routed = out.prompt_routed
                if out.embedding is not None:
                    self.embedding = out.embedding
                if first and self.shared_prompt is not None:
                    self.prompt_scores = await asyncio.shield(self.shared_prompt)
                finish: str | None = None
                if self.text.stopped:
                    finish = "stop"
                elif out.finished:
                    finish = _FINISH[out.finish_reason or FinishReason.LENGTH]
                pieces = self.text.release(final=finish is not None)
                thinking: list[Piece] = []
                if self.split is not None and (pieces or finish):
                    thinking, answer = self.split.split(pieces, final=finish is not None)
                    self.thinking += thinking
                else:
                    answer = pieces
                self.pieces += answer
                news = self.prompt_scores is not None or self.prompt_routed is not None
                if pieces or finish or (first and news):
                    if first:
                        yield Delta(
                            answer, finish, self.prompt_scores, self.prompt_routed, thinking
                        )
                    else:
                        yield Delta(answer, finish, thinking=thinking)
                    first = False
                if finish:
                    self.finish_reason = finish
                    return
        finally:
            self._publish(None)  # a sibling never waits for a candidate that has ended
            self.stream.close()

    def _publish(self, scores: TokenLogprobs | None) -> None:
        if self.publish_prompt is not None and not self.publish_prompt.done():
            self.publish_prompt.set_result(scores)

    async def run(self) -> Candidate:
        async for _ in self.deltas():
            pass
        return self


def share_prompt_scores(candidates: list[Candidate]) -> None:
    """The first candidate's prompt scores serve all of `candidates` (one prompt's)."""
    future: asyncio.Future[TokenLogprobs | None] = asyncio.get_running_loop().create_future()
    candidates[0].publish_prompt = future
    for cand in candidates[1:]:
        cand.shared_prompt = future


async def submit_all(engine: EngineClient, requests: list[EngineRequest]) -> list[RequestStream]:
    """Submit every request or none: a RequestError on one closes those already queued."""
    engine.check_capacity(len(requests))
    streams: list[RequestStream] = []
    try:
        for req in requests:
            streams.append(await engine.submit(req))
    except BaseException:
        for s in streams:
            s.close()
        raise
    return streams


async def merge(
    iterators: list[AsyncIterator[T]], timeout: float = 0
) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as items arrive: yields (iterator index, item). Past
    `timeout` seconds (0: none) it raises a 408 APIError (a stream turns it into an error
    event) and the iterators are cancelled, which aborts their engine requests."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout if timeout > 0 else None
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
            try:
                wait = None if end is None else max(0.0, end - loop.time())
                i, item, exc, done = await asyncio.wait_for(queue.get(), wait)
            except TimeoutError:
                raise _timeout_error(timeout) from None
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


def _timeout_error(timeout: float) -> APIError:
    return APIError(
        408,
        f"the request ran past the server's limit of {timeout:g} s and was stopped",
        None,
        "timeout",
    )


async def run_all(request: Request, candidates: list[Candidate], timeout: float) -> None:
    """Run every candidate to its end (non-streamed responses). A client that disconnects, or a
    request that passes `timeout` seconds (0: none), aborts them all."""
    try:
        work: Awaitable[object] = _run_together(candidates)
        if timeout > 0:
            work = asyncio.wait_for(work, timeout)
        await unless_disconnected(request, work)
    except TimeoutError:
        raise _timeout_error(timeout) from None
    finally:
        for c in candidates:
            c.stream.close()


async def _run_together(candidates: list[Candidate]) -> None:
    """Run the candidates concurrently; the first failure cancels the others (no task is left
    waiting on an engine stream that will never speak again) and is raised as it is."""
    try:
        async with asyncio.TaskGroup() as group:
            for c in candidates:
                group.create_task(c.run())
    except BaseExceptionGroup as eg:
        raise eg.exceptions[0] from None
