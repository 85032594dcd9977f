"""The server's state: one object, created at start-up and held by the app (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass, field

from probserve.api.errors import APIError
from probserve.api.limits import Limits
from probserve.api.logprobs_format import LogprobsFormatter
from probserve.api.metrics import Metrics
from probserve.api.tokens import TokenTable
from probserve.engine import EngineClient, LogprobsMode
from probserve.models import LoadedModel


@dataclass(frozen=True)
class ServerConfig:
    served_model_names: tuple[str, ...]
    max_logprobs: int = 20  # completions `logprobs` cap
    max_top_logprobs: int = 20  # chat `top_logprobs` cap
    logprobs_mode: LogprobsMode = LogprobsMode.RAW
    api_keys: tuple[str, ...] = ()
    open_metrics: bool = False  # /metrics without a key
    limits: Limits = field(default_factory=Limits)


@dataclass
class ServerState:
    loaded: LoadedModel
    engine: EngineClient
    config: ServerConfig
    table: TokenTable = field(init=False)
    fmt: LogprobsFormatter = field(init=False)
    metrics: Metrics = field(init=False)
    distribution_rows: RowBudget = field(init=False)

    def __post_init__(self) -> None:
        self.table = TokenTable(self.loaded.tokenizer, self.loaded.vocab_size)
        self.fmt = LogprobsFormatter(self.table)
        self.metrics = Metrics(self.engine, self.model_name)
        self.distribution_rows = RowBudget(self.config.limits.max_distribution_rows_in_flight)

    @property
    def model_name(self) -> str:
        return self.config.served_model_names[0]

    def check_model(self, name: str | None) -> str:
        """The name to echo back; 404 for a model this server does not serve."""
        if name is None or name == "":
            return self.model_name
        if name in self.config.served_model_names:
            return name
        raise APIError(404, f"The model `{name}` does not exist.", "model", code="model_not_found")


class RowBudget:
    """How many full-vocabulary rows the requests in flight may hold together (each is 192 KiB
    in float32 for a 49k vocabulary): a request that would pass the budget gets a 429."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, rows: int) -> None:
        """Reserve `rows` (a 429 past the budget); `give_back` them once the answer is sent."""
        if self.used + rows > self.limit:
            raise APIError(
                429,
                f"the server is busy ({self.used} of {self.limit} distribution rows in flight)",
                None,
                "overloaded",
                {"Retry-After": "1"},
            )
        self.used += rows

    def give_back(self, rows: int) -> None:
        self.used -= rows
