"""The server's state: one object, created at start-up and held by the app (no module globals).

A server serves one or more models (`ServedModel`, api/server/served.py): the pinned ones it
started with (`--model`) and, while they are loaded, its models on demand (`on_demand`:
api/server/on_demand.py). A route asks `ServerState.serving(name)` (or, loading a model on
demand, `await acquire(name)`) for the `Serving` of the model a request names: what that
request works with (the model's engine and tables, the server's config and budgets).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from probserve.api.answers.logprobs_format import LogprobsFormatter
from probserve.api.answers.tokens import TokenTable
from probserve.api.errors import APIError
from probserve.api.server.config import ServerConfig
from probserve.api.server.metrics import Metrics
from probserve.api.server.on_demand import OnDemand
from probserve.api.server.row_budget import RowBudget
from probserve.api.server.served import ServedModel
from probserve.engine import EngineClient, EngineDead
from probserve.engine.info import EngineInfo
from probserve.models import ModelRecord

MOST_TOKENS = 2**20  # the token histograms' last bucket where models load on demand


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
    models: list[ServedModel]  # the models serving now: the pinned ones, then those on demand
    config: ServerConfig
    on_demand: OnDemand | None = None
    pinned: list[ServedModel] = field(init=False)  # the models given with --model
    metrics: Metrics = field(init=False)
    distribution_rows: RowBudget = field(init=False)

    def __post_init__(self) -> None:
        first = [m.name for m in self.models]
        lazy = list(self.on_demand.entries) if self.on_demand is not None else []
        if not first + lazy or len(set(first + lazy)) != len(first + lazy):
            raise ValueError(f"served model names must be given and distinct: {first + lazy}")
        taken = set(first + lazy)
        for m in self.models:  # an alias (a model's own name) only where no other model has it
            aliases = [n for n in m.names[1:] if n not in taken]
            taken.update(aliases)
            m.names = (m.name, *aliases)
        self.pinned = list(self.models)
        if self.on_demand is not None:
            self.on_demand.models = self.models  # a loaded model serves among them
        # models on demand: token histograms up to MOST_TOKENS (their contexts are not known yet)
        self.metrics = Metrics(self.models, MOST_TOKENS if self.on_demand is not None else None)
        self.distribution_rows = RowBudget(self.config.limits.max_distribution_rows_in_flight)

    @property
    def default(self) -> ServedModel:
        """The model a request that names none gets: the first pinned one (with none pinned,
        the first model on demand: `default_name`)."""
        return self.pinned[0]

    @property
    def default_name(self) -> str:
        if self.pinned or self.on_demand is None:
            return self.default.name
        return next(iter(self.on_demand.entries))

    def model(self, name: str | None) -> tuple[ServedModel, str]:
        """The model called `name` and the name to echo back (a request that names none gets
        the first model); 404 for a model this server does not serve, 503 for a model on
        demand that is not loaded (`acquire` loads it)."""
        if name is None or name == "":
            name = self.default_name
        if self.on_demand is not None and name in self.on_demand.entries:
            entry = self.on_demand.entries[name]
            if entry.served is None or entry.state != "loaded":
                raise APIError(
                    503, f"The model `{name}` is {entry.state}: POST /models/load, or a "
                    "request naming it, loads it.", "model", code="model_not_loaded",
                )  # fmt: skip
            return entry.served, name
        for m in self.pinned:
            if name in m.names:
                return m, name
        raise APIError(404, f"The model `{name}` does not exist.", "model", code="model_not_found")

    def serving(self, name: str | None) -> Serving:
        model, echo = self.model(name)
        return Serving(echo, model, self.config, self.metrics, self.distribution_rows)

    async def acquire(
        self, name: str | None, keep_alive: float | None
    ) -> tuple[Serving, Callable[[], None] | None]:
        """The Serving of the model `name`, a model on demand loaded first (the request
        waits), with the release of its lease on it (None for a pinned model)."""
        echo = name or self.default_name
        if self.on_demand is None or echo not in self.on_demand.entries:
            return self.serving(name), None
        model, release = await self.on_demand.acquire(echo, keep_alive)
        serving = Serving(echo, model, self.config, self.metrics, self.distribution_rows)
        return serving, release
