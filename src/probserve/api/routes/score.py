"""POST /v1/score, compatible with SGLang's: the probability of each label token right after
`query + item` (or `item + query`), for every item, in one batched engine pass.

Each item becomes one engine request that computes a single next-token distribution and the
logprobs of the label ids there (target-token logprobs); the shared query is computed once for
all items through the prefix cache. `apply_softmax: false` gives each label's probability under
the full distribution; `true` renormalises over the labels.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from probserve.api.answers.label_scores import label_probabilities
from probserve.api.errors import ERRORS
from probserve.api.pipeline.run import Run
from probserve.api.plans.score import score_plan
from probserve.api.protocol import ScoreRequest, ScoreResponse, Usage
from probserve.api.server.lookup import serving_of
from probserve.api.server.state import Serving

router = APIRouter()


@router.post("/v1/score", response_model=ScoreResponse, responses=ERRORS)
async def score(
    body: ScoreRequest,
    request: Request,
    state: Annotated[Serving, Depends(serving_of(ScoreRequest))],
) -> ScoreResponse:
    plan = await score_plan(state, body)
    run = await Run(state, request, plan, "score").start()
    rows = [c.token_scores[0] if c.token_scores else None for c in await run.collect()]
    scores = label_probabilities(rows, body.apply_softmax, "items")
    usage = Usage.of(run.usage.prompt_tokens, 0, run.cached_tokens)
    return ScoreResponse(model=state.name, scores=scores, usage=usage)
