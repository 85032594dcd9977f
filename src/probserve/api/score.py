"""POST /v1/score, compatible with SGLang's: the probability of each label token right after
`query + item` (or `item + query`), for every item, in one batched engine pass.

Each item becomes one engine request that computes a single next-token distribution and the
logprobs of the label ids there (target-token logprobs); the shared query is computed once for
all items through the prefix cache. `apply_softmax: false` gives each label's probability under
the full distribution; `true` renormalises over the labels.
"""

from __future__ import annotations

import math

from fastapi import APIRouter, Request

from probserve.api.errors import ERRORS, bad_request
from probserve.api.limits import Limits
from probserve.api.prompts import build_completion_prompts, off_loop
from probserve.api.protocol import ScoreRequest, ScoreResponse, Usage
from probserve.api.run import Plan, Run
from probserve.api.state import Serving
from probserve.engine import LogprobsSpec, SamplingParams

router = APIRouter()


def _inputs(
    body: ScoreRequest, limits: Limits, vocab_size: int, max_tokens: int
) -> list[str] | list[list[int]]:
    """query + item (or item + query) for every item. The cheap checks come first, on the parts
    as sent (how many items, their types and sizes, the query's ids): a request that fails one
    builds nothing, and what is built is at most max_sequences inputs of max_tokens ids."""
    items = [body.items] if isinstance(body.items, str) else body.items
    if not items:
        raise bad_request("items is empty", "items")
    limits.check_sequences(len(items), 1, "items")
    query = body.query
    if isinstance(query, str):
        if not all(isinstance(i, str) for i in items):
            raise bad_request("query and items must both be text or both be token ids", "items")
        texts: list[str] = items  # type: ignore[assignment]
        cap, repeated = limits.max_prompt_chars, len(query) * len(texts)  # a query per item
        chars = repeated + sum(len(i) for i in texts)
        if chars > cap:
            message = f"query + items hold {chars} characters (the query once per item)"
            raise bad_request(
                f"{message}; the limit is {cap}", "query" if repeated > cap else "items"
            )
        return [(i + query) if body.item_first else (query + i) for i in texts]
    if not all(isinstance(i, list) for i in items):
        raise bad_request("query and items must both be text or both be token ids", "items")
    bad = next((t for t in query if not 0 <= t < vocab_size), None)
    if bad is not None:
        message = f"token id {bad} is outside the vocabulary (0..{vocab_size - 1})"
        raise bad_request(message, "query")
    id_items: list[list[int]] = items  # type: ignore[assignment]
    longest = max(len(i) for i in id_items)
    if len(query) + longest > max_tokens:
        raise bad_request(
            f"this model's maximum context length is {max_tokens + 1} tokens and scoring needs "
            f"one of them; the query and the longest item hold {len(query) + longest} tokens",
            "items",
        )
    return [(i + query) if body.item_first else (query + i) for i in id_items]


@router.post("/v1/score", response_model=ScoreResponse, responses=ERRORS)
async def score(body: ScoreRequest, request: Request) -> ScoreResponse:
    state: Serving = request.app.state.probserve.serving(body.model)
    model = state.name
    limits = state.config.limits
    labels = tuple(body.label_token_ids)
    if not labels or len(labels) > limits.max_logprob_token_ids:
        raise bad_request(
            f"label_token_ids needs 1 to {limits.max_logprob_token_ids} ids", "label_token_ids"
        )
    bad = next((t for t in labels if not 0 <= t < state.loaded.vocab_size), None)
    if bad is not None:
        raise bad_request(f"label token id {bad} is outside the vocabulary", "label_token_ids")
    # room for the one scored token: an input that fills the context is the items' fault
    max_tokens = state.engine.info.max_context - 1
    inputs = _inputs(body, limits, state.loaded.vocab_size, max_tokens)
    prompts = await off_loop(
        build_completion_prompts, state.loaded, state.table, inputs, max_tokens, "items"
    )
    spec = LogprobsSpec(top_k=0, target_ids=labels)
    plan = Plan(prompts, [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)], spec)
    run = await Run(state, request, plan, "score").start()
    scores: list[list[float]] = []
    for cand in await run.collect():
        lp = cand.pieces[0].logprobs if cand.pieces else None
        if lp is None or lp.target_logprobs is None:
            raise bad_request("an item produced no distribution", "items")
        values = [float(v) for v in lp.target_logprobs[cand.pieces[0].row]]
        if body.apply_softmax:
            top = max(values)
            exps = [math.exp(v - top) for v in values]
            scores.append([e / sum(exps) for e in exps])
        else:
            scores.append([math.exp(v) for v in values])
    return ScoreResponse(model=model, scores=scores, usage=Usage.of(run.usage.prompt_tokens, 0))
