"""The `Plan`: what one API request asks of the engine, whichever route built it."""

from __future__ import annotations

from dataclasses import dataclass, replace

from probserve.api.answers.harmony import Markers
from probserve.api.prompts import Prompt
from probserve.api.tools.ask import ToolAsk
from probserve.engine import LogprobsSpec, RoutingSpec, SamplingParams


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a request asks of the engine: built once, by keywords, by the route's plan (a later
    step that adds to it, as `plans/routing.py`, returns a new one with `with_`)."""

    prompts: list[Prompt]
    sampling: list[SamplingParams]  # one per candidate of a prompt (candidate i: seed + i)
    spec: LogprobsSpec | None
    stops: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    offsets_from_prompt: bool = False  # text offsets count from the prompt's start (completions)
    grammar: str | None = None  # every candidate's tokens follow it (plans/grammar.py)
    tools: ToolAsk | None = None  # replies are parsed for calls (api/tools/)
    routing: RoutingSpec | None = None  # each token's experts returned (plans/routing.py)
    speculative: bool | None = None  # speculative decoding asked on/off (None: the server's)
    embed: str | None = None  # the prompts' pooled final hidden states (/v1/embeddings)
    thinking: Markers | None = None  # replies split into reasoning and answer

    def with_(self, **changes: object) -> Plan:
        """This plan with `changes` (its fields by name)."""
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def per_prompt(self) -> int:
        return len(self.sampling)
