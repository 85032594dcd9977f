"""POST /v1/distributions: the full next-token distribution (log-softmax over the whole
vocabulary, exact, raw) at requested positions of a prompt, as a compact array.

Position p is the distribution after the prompt's tokens 0..p, so p = len(prompt) - 1 is the
distribution of the token that would follow the prompt. The engine scores the prompt with one
placeholder token appended (api/plans/distributions.py), and returns the requested rows
whole. The answer is float32 or float16, row-major [positions, vocab]: raw bytes
(`application/octet-stream`, shape and dtype in headers) when `encoding` is "binary" or the
client accepts only octet-stream, else base64 inside JSON.

A 512-row answer is 100 MB (133 MB in base64): it is never built whole. `RowsResponse` sends it
a slice at a time, base64-encoding each slice as it goes and yielding the event loop between
slices, and the rows stay in the server's row budget until the last slice is handed to the
connection or the client is gone, so slow readers hold budget (and get others a 429), never
memory past it.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable, Iterator, Mapping
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from starlette.types import Receive, Scope, Send

from probserve.api.errors import ERRORS, bad_request
from probserve.api.off_loop import off_loop
from probserve.api.pipeline.run import Run
from probserve.api.plans.distributions import distributions_plan, prompt_ids
from probserve.api.protocol import DistributionsRequest, DistributionsResponse, Usage
from probserve.api.server.lookup import serving_of
from probserve.api.server.row_budget import RowBudget
from probserve.api.server.state import Serving

router = APIRouter()


@router.post("/v1/distributions", response_model=DistributionsResponse, responses=ERRORS)
async def distributions(
    body: DistributionsRequest,
    request: Request,
    state: Annotated[Serving, Depends(serving_of(DistributionsRequest))],
) -> Response:
    model = state.name
    plan = await distributions_plan(state, body)
    ids = prompt_ids(plan)
    spec = plan.spec
    assert spec is not None
    positions = list(spec.full_positions)
    budget = state.distribution_rows
    budget.take(len(positions))  # all requests' rows together are bounded
    try:
        run = await Run(state, request, plan, "dist").start()
        (cand,) = await run.collect()
        rows = cand.prompt_scores.full if cand.prompt_scores is not None else None
        if rows is None or rows.shape[0] != len(positions):
            raise bad_request("the prompt produced no distribution", "prompt")
        dtype = np.float16 if body.dtype == "float16" else np.float32
        array = await off_loop(_contiguous, rows, dtype)  # a float16 copy is 25M values
        response = _answer(
            request, body, model, ids, positions, array, release_once(budget, len(positions)),
            run.cached_tokens,
        )  # fmt: skip
        response.send_timeout = state.config.http.send_timeout
        return response
    except BaseException:
        budget.give_back(len(positions))
        raise


def _contiguous(rows: np.ndarray, dtype: type) -> np.ndarray:
    return np.ascontiguousarray(rows.astype(dtype, copy=False))


def release_once(budget: RowBudget, rows: int) -> Callable[[], None]:
    """What gives `rows` back to `budget`, once however often it is called."""
    held = [True]

    def release() -> None:
        if held[0]:
            held[0] = False
            budget.give_back(rows)

    return release


# bytes of the array per send: a multiple of 3, so the base64 of the slices, joined, is the
# base64 of the whole (256 KiB of base64 text a slice)
SLICE_BYTES = 3 * 2**16


class RowsResponse(Response):
    """`head`, the array's bytes (base64 or raw) and `tail`, sent a slice at a time. uvicorn
    waits before each send while the connection's write buffer is above its high-water mark
    (64 KiB), so the answer leaves at the client's pace without ever being copied whole; the
    loop runs other requests between slices; `release` runs once the last slice is handed over,
    the client is gone, or the send fails."""

    def __init__(
        self,
        head: bytes,
        data: memoryview,
        tail: bytes,
        b64: bool,
        media_type: str,
        headers: Mapping[str, str],
        release: Callable[[], None],
    ) -> None:
        size = 4 * -(-len(data) // 3) if b64 else len(data)
        length = str(len(head) + size + len(tail))
        super().__init__(None, 200, {**headers, "content-length": length}, media_type)
        self.head, self.data, self.tail, self.b64 = head, data, tail, b64
        self.release = release
        self.send_timeout = 30.0  # seconds one slice may wait for the client to read

    def _parts(self) -> Iterator[bytes]:
        if self.head:
            yield self.head
        for start in range(0, len(self.data), SLICE_BYTES):
            piece = self.data[start : start + SLICE_BYTES]
            yield base64.b64encode(piece) if self.b64 else bytes(piece)
        if self.tail:
            yield self.tail

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            request = Request(scope, receive)
            start = {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
            await send(start)
            for part in self._parts():
                if await request.is_disconnected():
                    return  # uvicorn drops what is sent to a closed connection: stop encoding
                if not await self._send(send, part, True):
                    return
                await asyncio.sleep(0)  # however fast the client reads, others get their turn
            # waits (as every send does) until the buffer has drained below its high-water mark
            await self._send(send, b"", False)
        finally:
            self.release()

    async def _send(self, send: Send, body: bytes, more: bool) -> bool:
        """One slice, if the client takes it within `send_timeout` seconds: a client that stops
        reading is cut (the connection closes unfinished) rather than holding its rows."""
        message = {"type": "http.response.body", "body": body, "more_body": more}
        try:
            async with asyncio.timeout(self.send_timeout if self.send_timeout > 0 else None):
                await send(message)
        except TimeoutError:
            return False
        return True


def _answer(
    request: Request,
    body: DistributionsRequest,
    model: str,
    ids: list[int],
    positions: list[int],
    array: np.ndarray,
    release: Callable[[], None],
    cached_tokens: int = 0,
) -> RowsResponse:
    shape = [int(array.shape[0]), int(array.shape[1])]
    data = array.data.cast("B")  # array.data: memoryview(array)
    accept = request.headers.get("accept", "")
    binary = body.encoding == "binary" or (
        body.encoding is None and "application/octet-stream" in accept and "json" not in accept
    )
    if binary:
        headers = {
            "X-Shape": f"{shape[0]},{shape[1]}",
            "X-Dtype": body.dtype,
            "X-Positions": ",".join(map(str, positions)),
        }
        return RowsResponse(b"", data, b"", False, "application/octet-stream", headers, release)
    resp = DistributionsResponse(
        model=model,
        token_ids=ids,
        positions=positions,
        shape=shape,
        dtype=body.dtype,
        data="",
        usage=Usage.of(len(ids), 0, cached_tokens),
    )
    # the JSON around the data: `data` is the last field before `usage`, whose values are
    # numbers, so its last occurrence is the field itself
    text = resp.model_dump_json().encode()
    cut = text.rindex(b'"data":""') + len(b'"data":"')
    return RowsResponse(text[:cut], data, text[cut:], True, "application/json", {}, release)
