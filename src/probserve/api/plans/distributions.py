"""The plan of POST /v1/distributions: the prompt scored with one placeholder token appended
(causal attention: it changes no row before it), whole rows at the requested positions.
Position p is the distribution after the prompt's tokens 0..p."""

from __future__ import annotations

from probserve.api.errors import bad_request
from probserve.api.off_loop import off_loop
from probserve.api.plans.logprobs_ask import LogprobsAsk
from probserve.api.plans.plan import Plan
from probserve.api.prompts import Prompt, build_completion_prompts, check_text_size
from probserve.api.protocol import DistributionsRequest
from probserve.api.server.state import Serving
from probserve.engine import SamplingParams


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


async def distributions_plan(state: Serving, body: DistributionsRequest) -> Plan:
    """One prompt (its ids are the plan's, placeholder and all: `prompt_ids` strips it)."""
    limits = state.config.limits
    if isinstance(body.prompt, str):
        check_text_size(limits, [body.prompt])
    max_context = state.max_context - 1  # room for the placeholder token
    (prompt,) = await off_loop(
        build_completion_prompts, state.record, state.table, [body.prompt], max_context
    )
    positions = _positions(body, len(prompt.ids), limits.max_distribution_positions)
    scored = Prompt([*prompt.ids, 0], prompt.text, prompt.pieces)  # the placeholder: token 0
    ask = LogprobsAsk(alternatives=0, prompt_alternatives=0, full_positions=tuple(positions))
    greedy = SamplingParams(temperature=0.0, max_tokens=0)
    return Plan(prompts=[scored], sampling=[greedy], spec=ask.spec())


def prompt_ids(plan: Plan) -> list[int]:
    """The prompt's own ids: the plan's without the placeholder."""
    return plan.prompts[0].ids[:-1]
