"""POST /v1/rerank (and /rerank, /v2/rerank): Jina's and Cohere's rerank shape on the scoring
path. Each document is scored as /v1/score scores an item: the probability of the answer
" yes" (renormalised over " yes" and " no") right after

    Query: {query}
    Document: {document}
    Is the document relevant to the query? Answer:

so a document's relevance_score equals /v1/score's for query "Query: {query}\\nDocument: ",
item "{document}" + SUFFIX and those two labels (tests hold it to that). Results come most
relevant first (ties: the earlier document), the first `top_n`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request

from probserve.api.answers.label_scores import label_probabilities
from probserve.api.errors import ERRORS, APIError, bad_request
from probserve.api.pipeline.run import Run
from probserve.api.plans.score import score_plan
from probserve.api.protocol import (
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreRequest,
)
from probserve.api.server.lookup import serving_of
from probserve.api.server.state import Serving

router = APIRouter()

PREFIX = "Query: {query}\nDocument: "
SUFFIX = "\nIs the document relevant to the query? Answer:"
ANSWERS = (" yes", " no")


def answer_ids(state: Serving) -> list[int]:
    """The first token of each answer, in the model's tokenizer."""
    tok = state.record.tokenizer
    return [int(tok(a, add_special_tokens=False).input_ids[0]) for a in ANSWERS]


@router.post("/v1/rerank", response_model=RerankResponse, responses=ERRORS)
@router.post("/v2/rerank", response_model=RerankResponse, responses=ERRORS, include_in_schema=False)
@router.post("/rerank", response_model=RerankResponse, responses=ERRORS, include_in_schema=False)
async def rerank(
    body: RerankRequest,
    request: Request,
    state: Annotated[Serving, Depends(serving_of(RerankRequest))],
) -> RerankResponse:
    if not body.documents:
        raise bad_request("documents is empty", "documents")
    texts = [d.text if isinstance(d, RerankDocument) else d for d in body.documents]
    scoring = ScoreRequest(
        query=PREFIX.format(query=body.query), items=[t + SUFFIX for t in texts],
        label_token_ids=answer_ids(state), apply_softmax=True,
    )  # fmt: skip
    try:
        plan = await score_plan(state, scoring)
    except APIError as exc:  # the score plan names its fields: here they are the documents
        if exc.param == "items":
            exc.param = "documents"
        raise
    run = await Run(state, request, plan, "rerank").start()
    rows = [c.token_scores[0] if c.token_scores else None for c in await run.collect()]
    scores = [p[0] for p in label_probabilities(rows, True, "documents")]
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: body.top_n]
    results = [
        RerankResult(
            index=i,
            relevance_score=scores[i],
            document=RerankDocument(text=texts[i]) if body.return_documents else None,
        )
        for i in order
    ]
    tokens = run.usage.prompt_tokens
    return RerankResponse(
        id=run.id, model=state.name, results=results,
        usage=RerankUsage(total_tokens=tokens, prompt_tokens=tokens),
    )  # fmt: skip
