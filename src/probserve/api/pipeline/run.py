"""One request pipeline for every route.

A route's plan (api/plans/) validates its request and builds a `Plan`: the prompts, the
candidates per prompt and their sampling, what logprobs to compute, stop strings. A `Run`
does the rest the same way for every route: it submits all engine requests or none, streams
the candidates' deltas or collects them, enforces the request deadline, counts usage (and the
metrics), and closes every engine stream whatever happens. The route only turns candidates
and deltas into its own shapes.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request

from probserve.api.answers.harmony import reply_split
from probserve.api.answers.text_stream import TextStream
from probserve.api.pipeline.candidates import (
    Candidate,
    Delta,
    merge,
    run_all,
    share_prompt_scores,
    submit_all,
)
from probserve.api.plans.plan import Plan
from probserve.api.plans.sampling import budgeted
from probserve.api.prompts import Prompt
from probserve.api.protocol import Usage
from probserve.api.server.state import Serving
from probserve.engine import EngineClient, EngineRequest


class Run:
    def __init__(self, state: Serving, request: Request, plan: Plan, prefix: str) -> None:
        self.state = state
        self.request = request
        self.plan = plan
        self.prefix = prefix
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        # the engine requests' ids begin with the HTTP request's id (its X-Request-Id)
        rid = getattr(request.state, "request_id", None)
        self.engine_prefix = f"{rid}-{prefix}" if rid else prefix
        request.state.model = state.name
        self.created = int(time.time())
        self.started = time.monotonic()
        self.candidates: list[Candidate] = []
        self._finished = False

    async def start(self) -> Run:
        """Submit every candidate of every prompt (all or none). The candidates of one prompt
        share its prompt scores: only the first one's engine request computes them. A candidate
        whose request set no budget gets the server's default (`budgeted`)."""
        plan, table = self.plan, self.state.table
        sibling = dataclasses.replace(plan.spec, prompt_top_k=None) if plan.spec else None
        default = self.state.max_tokens_default
        unbudgeted = any(s.max_tokens is None for s in plan.sampling)
        context = self.state.max_context if unbudgeted and default is not None else 0
        requests: list[EngineRequest] = []
        texts: list[TextStream] = []
        for prompt in plan.prompts:
            base = len(prompt.text) if plan.offsets_from_prompt else 0
            for c, asked in enumerate(plan.sampling):
                rid = EngineClient.new_request_id(self.engine_prefix)
                spec = sibling if c else plan.spec
                ids = tuple(prompt.ids)
                sampling = budgeted(asked, len(ids), context, default)
                req = EngineRequest(
                    request_id=rid, prompt_token_ids=ids, sampling=sampling, logprobs=spec,
                    group=self.id, grammar=plan.grammar, routing=plan.routing,
                    speculative=plan.speculative, embed=plan.embed,
                )  # fmt: skip
                requests.append(req)
                texts.append(TextStream(table, base, plan.stops, plan.skip_special_tokens))
        streams = await submit_all(self.state.engine, requests)
        calls = plan.tools is not None
        self.candidates = [
            Candidate(r, s, t, split=reply_split(m, table, calls) if (m := plan.thinking) else None)
            for r, s, t in zip(requests, streams, texts, strict=True)
        ]
        if plan.spec is not None and plan.spec.prompt and plan.per_prompt > 1:
            for i in range(0, len(self.candidates), plan.per_prompt):
                share_prompt_scores(self.candidates[i : i + plan.per_prompt])
        return self

    def prompt_of(self, index: int) -> Prompt:
        """The prompt of candidate `index`."""
        return self.plan.prompts[index // self.plan.per_prompt]

    @property
    def timeout(self) -> float:
        return self.state.config.limits.request_timeout

    async def collect(self) -> list[Candidate]:
        """Run every candidate to its end (non-streamed responses)."""
        try:
            await run_all(self.request, self.candidates, self.timeout)
        finally:
            self.close()
        return self.candidates

    async def deltas(self, settled: bool = False) -> AsyncIterator[tuple[int, Delta]]:
        """(candidate index, delta) as the engine produces them (streamed responses).
        `settled`: the first deltas are held until every candidate has been scheduled, so that
        the prompts' cached tokens (`cached_tokens`, known once each is scheduled) are final
        from the first delta on: usage shown with any delta then agrees with the last."""
        held: list[tuple[int, Delta]] | None = [] if settled else None
        try:
            async for item in merge([c.deltas() for c in self.candidates], self.timeout):
                if held is None:
                    yield item
                    continue
                held.append(item)
                if self.scheduled:
                    for early in held:
                        yield early
                    held = None
            for early in held or ():  # every candidate ended
                yield early
        finally:
            self.close()

    @property
    def scheduled(self) -> bool:
        """Every candidate has been scheduled (its cached prompt tokens known) or has ended."""
        return all(
            c.cached_tokens is not None or c.finish_reason is not None for c in self.candidates
        )

    def close(self) -> None:
        """The run's end, however it came (idempotent): every engine stream closed (a request
        still running is aborted) and the usage and metrics recorded. A streamed route's
        response calls it when it ends (edge/sse.py: EventStream), whether or not its events
        ever reached `deltas()`."""
        for c in self.candidates:
            c.stream.close()
        self._finish()

    @property
    def usage(self) -> Usage:
        prompt_tokens = sum(len(p.ids) for p in self.plan.prompts)
        usage = Usage.of(
            prompt_tokens, sum(c.num_tokens for c in self.candidates), self.cached_tokens
        )
        if self.plan.thinking is not None:  # a thinking model's: its reasoning tokens
            thought = sum(len(c.thinking) for c in self.candidates)
            usage.completion_tokens_details = {"reasoning_tokens": thought}
        return usage

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held, each prompt counted once as it is billed once:
        its least-cached candidate's (the siblings of the one that computed it find it cached)."""
        per = self.plan.per_prompt
        total = 0
        for i in range(0, len(self.candidates), per):
            found = [c.cached_tokens for c in self.candidates[i : i + per]]
            total += min((n for n in found if n is not None), default=0)
        return total

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = True
        usage = self.usage
        self.request.state.usage = (usage.prompt_tokens, usage.completion_tokens)
        usage = self.usage
        self.state.metrics.observe_run(
            self.state.model.name, usage.prompt_tokens, usage.completion_tokens, self.candidates,
            self.started,
        )  # fmt: skip
