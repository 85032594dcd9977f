"""How a request asks for the experts its tokens were routed to (`return_routed_experts`, a
mixture-of-experts model's): checked against the model (a dense one routes nothing) and the
server's bound on the tokens one request may return routing for, and made the engine's
`RoutingSpec` (None: nothing asked, nothing computed or sent)."""

from __future__ import annotations

from probserve.api.errors import bad_request
from probserve.api.plans.plan import Plan
from probserve.api.plans.sampling import budgeted
from probserve.api.protocol import SamplingFields
from probserve.api.server.state import Serving
from probserve.engine import RoutingSpec

FIELD = "return_routed_experts"


def routing_spec(state: Serving, body: SamplingFields, plan: Plan, prompt: bool) -> Plan:
    """`plan` with its `routing` when the body asks: every generated token's routing and, with
    `prompt`, the prompt's. A 400 naming the field for a model without experts on the paged
    forward, or for a request whose tokens (every candidate's most, plus each echoed prompt)
    pass `--max-routed-tokens`."""
    if not body.return_routed_experts:
        return plan
    info = state.info
    if not info.moe_layers:
        raise bad_request(
            f"{FIELD} needs a mixture-of-experts model on the paged runner; {state.name} "
            f"({info.architecture or 'its architecture'}, {info.runner}) routes nothing",
            FIELD,
        )
    context, default = state.max_context, state.max_tokens_default
    total = 0
    for p in plan.prompts:
        for asked in plan.sampling:
            sp = budgeted(asked, len(p.ids), context, default)
            generated = sp.max_tokens if sp.max_tokens is not None else context - len(p.ids)
            total += max(0, generated) + (len(p.ids) if prompt else 0)
    cap = state.config.limits.max_routed_tokens
    if total > cap:
        raise bad_request(
            f"{FIELD} returns at most {cap} tokens' routing a request; this one may reach "
            f"{total} (its sequences' max_tokens{' and echoed prompts' if prompt else ''}): "
            "lower max_tokens",
            FIELD,
        )
    return plan.with_(routing=RoutingSpec(prompt=prompt))
