"""The server's state: one object, created at start-up and held by the app (no module globals).

A server serves one or more models (`ServedModel`, api/server/served.py). A route asks
`ServerState.serving(name)` for the `Serving` of the model a request names: what that request
works with (the model's engine and tables, the server's config and budgets).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from probserve.api.answers.logprobs_format import LogprobsFormatter
from probserve.api.answers.tokens import TokenTable
from probserve.api.errors import APIError
from probserve.api.server.config import ServerConfig
from probserve.api.server.metrics import Metrics
from probserve.api.server.row_budget import RowBudget
from probserve.api.server.served import ServedModel
from probserve.engine import EngineClient, EngineDead
from probserve.engine.info import EngineInfo
from probserve.models import ModelRecord


@dataclass
class Serving:
    """What one request works with: the model it named and the server around it."""

    name: str  # the model name to echo back (the one the request used)
    model: ServedModel
    config: ServerConfig
    metrics: Metrics
    distribution_rows: RowBudget

    @property
    def record(self) -> ModelRecord:
        return self.model.record

    @property
    def engine(self) -> EngineClient:
        return self.model.engine

    @property
    def table(self) -> TokenTable:
        return self.model.table

    @property
    def fmt(self) -> LogprobsFormatter:
        return self.model.fmt

    @property
    def info(self) -> EngineInfo:
        """What the engine said of itself in its hello; an engine that has not said it (a
        worker that died before, being restarted) is a 503, never a 500."""
        info = self.model.info
        if info is None:
            status, why = self.model.health()
            raise EngineDead(f"the model's engine is {status}: {why or 'not started'}")
        return info

    @property
    def system_fingerprint(self) -> str | None:
        """The engine's numerics fingerprint (engine/fingerprint.py), every answer's
        `system_fingerprint`; None before the engine's hello."""
        info = self.model.info
        return None if info is None else info.system_fingerprint

    @property
    def max_context(self) -> int:
        """The tokens one sequence may hold, as the engine said in its hello (503 before)."""
        return int(self.info.max_context)

    @property
    def max_tokens_default(self) -> int | None:
        """What a request that sets no budget generates at most (None: up to the context)."""
        return self.model.max_tokens_default(self.config.limits.max_tokens_default)

    def formatter(self, as_ids: bool) -> LogprobsFormatter:
        """The logprobs formatter: tokens by text, or (`as_ids`) named `token_id:N`."""
        return self.model.fmt_ids if as_ids else self.model.fmt


@dataclass
class ServerState:
    models: list[ServedModel]
    config: ServerConfig
    metrics: Metrics = field(init=False)
    distribution_rows: RowBudget = field(init=False)

    def __post_init__(self) -> None:
        first = [m.name for m in self.models]
        if not first or len(set(first)) != len(first):
            raise ValueError(f"served model names must be given and distinct: {first}")
        taken = set(first)
        for m in self.models:  # an alias (a model's own name) only where no other model has it
            aliases = [n for n in m.names[1:] if n not in taken]
            taken.update(aliases)
            m.names = (m.name, *aliases)
        self.metrics = Metrics(self.models)
        self.distribution_rows = RowBudget(self.config.limits.max_distribution_rows_in_flight)

    @property
    def default(self) -> ServedModel:
        """The model a request that names none gets: the first one."""
        return self.models[0]

    def model(self, name: str | None) -> tuple[ServedModel, str]:
        """The model called `name` and the name to echo back (a request that names none gets
        the first model); 404 for a model this server does not serve."""
        if name is None or name == "":
            return self.default, self.default.name
        for m in self.models:
            if name in m.names:
                return m, name
        raise APIError(404, f"The model `{name}` does not exist.", "model", code="model_not_found")

    def serving(self, name: str | None) -> Serving:
        model, echo = self.model(name)
        return Serving(echo, model, self.config, self.metrics, self.distribution_rows)
