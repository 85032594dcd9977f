"""POST /v1/distributions: the full next-token distribution (log-softmax over the whole
vocabulary, exact, raw) at requested positions of a prompt, as a compact array.

Position p is the distribution after the prompt's tokens 0..p, so p = len(prompt) - 1 is the
distribution of the token that would follow the prompt. The engine scores the prompt with one
placeholder token appended (causal attention: it changes no row before it), and returns the
requested rows whole. The answer is float32 or float16, row-major [positions, vocab]: raw bytes
(`application/octet-stream`, shape and dtype in headers) when `encoding` is "binary" or the
client accepts only octet-stream, else base64 inside JSON.
"""

from __future__ import annotations

import base64

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.background import BackgroundTask

from probserve.api.errors import ERRORS, bad_request
from probserve.api.prompts import Prompt, build_completion_prompts, check_text_size, off_loop
from probserve.api.protocol import DistributionsRequest, DistributionsResponse, Usage
from probserve.api.run import Plan, Run
from probserve.api.state import Serving
from probserve.engine import LogprobsSpec, SamplingParams

router = APIRouter()


def _positions(body: DistributionsRequest, n: int, cap: int) -> list[int]:
    positions = list(range(n)) if body.positions is None else body.positions
    if not positions or len(positions) > cap:
        raise bad_request(f"positions must hold 1 to {cap} positions (got {len(positions)})",
                          "positions")  # fmt: skip
    bad = next((p for p in positions if not 0 <= p < n), None)
    if bad is not None:
        raise bad_request(f"position {bad} is outside the prompt (0..{n - 1})", "positions")
    if positions != sorted(set(positions)):
        raise bad_request("positions must be distinct and increasing", "positions")
    return positions


@router.post("/v1/distributions", response_model=DistributionsResponse, responses=ERRORS)
async def distributions(body: DistributionsRequest, request: Request) -> Response:
    state: Serving = request.app.state.probserve.serving(body.model)
    model = state.name
    limits = state.config.limits
    if isinstance(body.prompt, str):
        check_text_size(limits, [body.prompt])
    max_context = state.engine.info.max_context - 1  # room for the placeholder token
    (prompt,) = await off_loop(
        build_completion_prompts, state.loaded, state.table, [body.prompt], max_context
    )
    ids = prompt.ids
    positions = _positions(body, len(ids), limits.max_distribution_positions)
    scored = Prompt([*ids, 0], prompt.text, prompt.pieces)  # the placeholder: token 0
    spec = LogprobsSpec(top_k=0, prompt_top_k=0, full_positions=tuple(positions))
    plan = Plan([scored], [SamplingParams(temperature=0.0, max_tokens=0)], spec)
    budget = state.distribution_rows
    budget.take(len(positions))  # all requests' rows together are bounded
    try:
        run = await Run(state, request, plan, "dist").start()
        (cand,) = await run.collect()
        rows = cand.prompt_scores.full if cand.prompt_scores is not None else None
        if rows is None or rows.shape[0] != len(positions):
            raise bad_request("the prompt produced no distribution", "prompt")
        array = rows.astype(np.float16 if body.dtype == "float16" else np.float32, copy=False)
        response = _answer(request, body, model, ids, positions, array)
    except BaseException:
        budget.give_back(len(positions))
        raise
    # the rows stay reserved until the answer's bytes have been sent
    response.background = BackgroundTask(budget.give_back, len(positions))
    return response


def _answer(
    request: Request,
    body: DistributionsRequest,
    model: str,
    ids: list[int],
    positions: list[int],
    array: np.ndarray,
) -> Response:
    shape = [int(array.shape[0]), int(array.shape[1])]
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
        return Response(array.tobytes(), media_type="application/octet-stream", headers=headers)
    resp = DistributionsResponse(
        model=model,
        token_ids=ids,
        positions=positions,
        shape=shape,
        dtype=body.dtype,
        data=base64.b64encode(array.tobytes()).decode("ascii"),
        usage=Usage.of(len(ids), 0),
    )
    return Response(resp.model_dump_json(), media_type="application/json")
