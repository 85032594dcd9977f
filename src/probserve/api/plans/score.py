"""The plan of POST /v1/score: query + item (or item + query) for every item, each an engine
request for the one next-token distribution after it, with the label ids' logprobs there
(target-token logprobs). The cheap checks come first, on the parts as sent."""

from __future__ import annotations

from probserve.api.errors import APIError, bad_request
from probserve.api.off_loop import off_loop
from probserve.api.plans.logprobs_ask import LogprobsAsk, checked_ids
from probserve.api.plans.plan import Plan
from probserve.api.prompts import build_completion_prompts
from probserve.api.protocol import ScoreRequest
from probserve.api.server.limits import Limits
from probserve.api.server.state import Serving
from probserve.engine import SamplingParams


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
            "query" if len(query) >= max_tokens else "items",  # an item holds a token at least
        )
    return [(i + query) if body.item_first else (query + i) for i in id_items]


def _query_tokens(state: Serving, query: str) -> int:
    """The tokens of the query alone: blocking, run it `off_loop`."""
    return len(state.record.tokenizer(query).input_ids)


async def score_plan(state: Serving, body: ScoreRequest) -> Plan:
    labels = checked_ids(body.label_token_ids, state, "label_token_ids", least=1)
    # room for the one scored token: an input that fills the context is the items' fault (the
    # query's, where it alone does)
    max_tokens = state.max_context - 1
    inputs = _inputs(body, state.config.limits, state.record.vocab_size, max_tokens)
    try:
        prompts = await off_loop(
            build_completion_prompts, state.record, state.table, inputs, max_tokens, "items"
        )
    except APIError as exc:  # past the context: the query's fault if it alone is
        if exc.param == "items" and isinstance(body.query, str):
            tokens = await off_loop(_query_tokens, state, body.query)
            if tokens >= max_tokens:
                raise bad_request(
                    f"this model's maximum context length is {max_tokens + 1} tokens; the "
                    f"query alone has {tokens}, which leaves no room for an item and the "
                    "scored token",
                    "query",
                ) from None
        raise
    ask = LogprobsAsk(alternatives=0, target_ids=labels)
    greedy_one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    return Plan(prompts=prompts, sampling=[greedy_one], spec=ask.spec())
