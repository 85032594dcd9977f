"""The server's state: one object, created at start-up and held by the app (no module globals)."""

from __future__ import annotations

from dataclasses import dataclass, field

from probserve.api.errors import APIError
from probserve.api.limits import Limits
from probserve.api.logprobs_format import LogprobsFormatter
from probserve.api.metrics import Metrics
from probserve.api.tokens import TokenTable
from probserve.engine import AsyncEngine, LogprobsMode
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
    engine: AsyncEngine
    config: ServerConfig
    table: TokenTable = field(init=False)
    fmt: LogprobsFormatter = field(init=False)
    metrics: Metrics = field(init=False)

    def __post_init__(self) -> None:
        self.table = TokenTable(self.loaded.tokenizer, self.loaded.vocab_size)
        self.fmt = LogprobsFormatter(self.table)
        self.metrics = Metrics(self.engine, self.model_name)

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
