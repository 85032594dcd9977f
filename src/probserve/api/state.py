"""The server's state: one object, created at start-up and held by the app (no module globals).

A server serves one or more models (`ServedModel`: its names, tokenizer-side tables and engine).
A route asks `ServerState.serving(name)` for the `Serving` of the model a request names: what
that request works with (the model's engine and tables, the server's config and budgets).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from probserve.api.errors import APIError
from probserve.api.grammar_cache import GrammarCache
from probserve.api.limits import HttpLimits, Limits
from probserve.api.logprobs_format import LogprobsFormatter
from probserve.api.metrics import Metrics
from probserve.api.tokens import TokenTable
from probserve.api.tools.formats import ToolParser
from probserve.engine import ClientLimits, EngineClient, LogprobsMode
from probserve.engine.grammar import llguidance_tokenizer
from probserve.flags import setting
from probserve.models import LoadedModel
from probserve.models.generation_config import SamplingDefaults


@dataclass(frozen=True)
class ServerConfig:
    """The API's settings: the `setting` fields are `probserve serve` flags (probserve.flags);
    the keys and limits are given by the composition root (serving.py)."""

    max_logprobs: int = setting(
        20, "the most alternatives per position of completions' logprobs and chat's prompt_logprobs"
    )
    max_top_logprobs: int = setting(
        20, "the most alternatives per token of chat's and responses' top_logprobs"
    )
    logprobs_mode: LogprobsMode = setting(
        LogprobsMode.RAW,
        "the distribution logprobs describe where a request names none: raw (the model's), "
        "processed (the one sampled from), both",
    )
    open_metrics: bool = setting(False, "serve /metrics without an API key")
    generation_config: str = setting(
        "auto",
        "sampling defaults for the fields a request leaves out (temperature, top_p, top_k, "
        "min_p, repetition_penalty): auto (the model's generation_config.json, as vLLM), vllm "
        "or none (OpenAI's defaults), or a directory with a generation_config.json",
        group="model",
    )
    allowed_origins: tuple[str, ...] = setting(
        (),
        "an origin a browser page may call the API from (CORS; repeat for several, `*` for "
        "any; none: no cross-origin calls)",
        metavar="ORIGIN",
        group="server",
    )
    tool_call_parser: ToolParser = setting(
        ToolParser.AUTO,
        "how models write tool calls: auto (each model's chat template says: Hermes' "
        "<tool_call>, Llama 3's JSON, Mistral's [TOOL_CALLS]; generic where it knows no tools), "
        "or one format for every model",
    )
    schema_extra_keys: Literal["forbid", "schema"] = setting(
        "forbid",
        "keys a JSON schema's object does not name, where it does not say additionalProperties: "
        "forbid (as vLLM's default backend and llama.cpp; tool arguments too) or schema (the "
        "letter of JSON Schema: any key)",
    )
    strict_fields: bool = setting(
        False,
        "refuse a request field this server does not implement (400 unknown_parameter), as "
        "OpenAI does; by default it is accepted and named back (X-Ignored-Fields, the access "
        "line, probserve:ignored_fields_total)",
    )
    api_keys: tuple[str, ...] = ()  # none: no key asked (serving.api_keys)
    limits: Limits = field(default_factory=Limits)  # the routes enforce these
    http: HttpLimits = field(default_factory=HttpLimits)  # the HTTP server
    client: ClientLimits = field(default_factory=ClientLimits)  # each model's engine client


@dataclass
class ServedModel:
    """One model: the names it answers to (the first is its own), its tokenizer side and its
    engine. `engine` may be replaced while the server runs (a restarted worker: supervisor.py)."""

    names: tuple[str, ...]
    loaded: LoadedModel
    engine: EngineClient
    # what a request's left-out sampling fields default to (--generation-config)
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    table: TokenTable = field(init=False)
    fmt: LogprobsFormatter = field(init=False)
    fmt_ids: LogprobsFormatter = field(init=False)  # tokens named token_id:N
    restarting: str | None = field(default=None, init=False)  # why, while a restart runs
    _grammar_tokenizer: Any = field(default=None, init=False, repr=False)
    grammars: GrammarCache = field(default_factory=GrammarCache, init=False, repr=False)

    def __post_init__(self) -> None:
        self.table = TokenTable(self.loaded.tokenizer, self.loaded.vocab_size)
        self.fmt = LogprobsFormatter(self.table)
        self.fmt_ids = LogprobsFormatter(self.table, as_ids=True)

    def grammar_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built on the first structured output (blocking:
        a fraction of a second; a race builds it twice, harmlessly)."""
        if self._grammar_tokenizer is None:
            eos = sorted(self.loaded.eos_token_ids)
            tok = llguidance_tokenizer(self.loaded.tokenizer, self.loaded.vocab_size, eos)
            self._grammar_tokenizer = tok
        return self._grammar_tokenizer

    @property
    def name(self) -> str:
        """The name it is served as (the first)."""
        return self.names[0]

    @property
    def root(self) -> str:
        """Its own name: the model's path, or the embedded model's name."""
        return str(self.loaded.name)

    @property
    def context_length(self) -> int:
        """The tokens one sequence may hold as served: the engine's (`--max-model-len` caps
        the model's own)."""
        info = getattr(self.engine, "info", None)
        return int(info.context_length) if info is not None else self.loaded.context_length

    def health(self) -> tuple[str, str | None]:
        """("ok" | "stuck" | "dead" | "restarting", why)."""
        if self.restarting is not None:
            return "restarting", self.restarting
        return self.engine.health()


@dataclass
class Serving:
    """What one request works with: the model it named and the server around it."""

    name: str  # the model name to echo back (the one the request used)
    model: ServedModel
    config: ServerConfig
    metrics: Metrics
    distribution_rows: RowBudget

    @property
    def loaded(self) -> LoadedModel:
        return self.model.loaded

    @property
    def engine(self) -> EngineClient:
        return self.model.engine

    @property
    def table(self) -> TokenTable:
        return self.model.table

    @property
    def fmt(self) -> LogprobsFormatter:
        return self.model.fmt

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
