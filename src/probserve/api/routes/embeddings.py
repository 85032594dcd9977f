"""POST /v1/embeddings (OpenAI's shape): a text, texts, token ids or id lists, each one engine
request that computes its prompt (no token generated) and returns its final-norm hidden states
pooled (`--pooling`, or the request's `pooling`: the last token's, the mean, or the first's),
L2-normalised as OpenAI's embeddings are, as float lists or base64 float32. The prompts are
batched with the engine's other work and found in the prefix cache like any prompt; the
hidden states are the same bits as those the forward keeps for prompt scoring."""

from __future__ import annotations

import base64
from typing import Annotated

import numpy as np
from fastapi import APIRouter, Depends, Request

from probserve.api.errors import ERRORS, bad_request
from probserve.api.pipeline.run import Run
from probserve.api.plans.completion import built_prompts
from probserve.api.plans.plan import Plan
from probserve.api.protocol import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from probserve.api.server.lookup import serving_of
from probserve.api.server.state import Serving
from probserve.engine import SamplingParams

router = APIRouter()


def _vector(pooled: np.ndarray, encoding: str) -> list[float] | str:
    """The pooled state L2-normalised (in float64, then float32), as floats or base64."""
    v = pooled.astype(np.float64)
    norm = float(np.sqrt(np.dot(v, v)))
    unit = (v / norm if norm > 0 else v).astype(np.float32)
    if encoding == "base64":
        return base64.b64encode(unit.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in unit]


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERRORS)
async def embeddings(
    body: EmbeddingRequest,
    request: Request,
    state: Annotated[Serving, Depends(serving_of(EmbeddingRequest))],
) -> EmbeddingResponse:
    info = state.info
    if not info.embeddings:
        raise bad_request(
            f"{state.name} runs on {info.runner}, which keeps no hidden states to embed", "input"
        )
    hidden = info.hidden_size
    if body.dimensions is not None and body.dimensions != hidden:
        raise bad_request(
            f"dimensions: this model's embeddings have {hidden} (it cannot shorten them)",
            "dimensions",
        )
    limits = state.config.limits
    if isinstance(body.input, list) and body.input and not isinstance(body.input[0], int):
        limits.check_sequences(len(body.input), 1, "input")
    built = await built_prompts(state, body.input, "input")
    plan = Plan(
        prompts=built, sampling=[SamplingParams(temperature=0.0, max_tokens=0)], spec=None,
        embed=body.pooling or state.config.pooling,
    )  # fmt: skip
    run = await Run(state, request, plan, "embd").start()
    candidates = await run.collect()
    data = []
    for i, cand in enumerate(candidates):
        if cand.embedding is None:
            raise bad_request("an input produced no embedding", "input")
        data.append(Embedding(index=i, embedding=_vector(cand.embedding, body.encoding_format)))
    tokens = run.usage.prompt_tokens
    return EmbeddingResponse(
        data=data, model=state.name,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )  # fmt: skip
