"""One served model on the API's side (`ServedModel`): the names it answers to, its
tokenizer-side tables and formatters, its compiled grammars and its engine (replaced when a
dead worker is restarted)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from probserve.api.answers.logprobs_format import LogprobsFormatter
from probserve.api.answers.tokens import TokenTable
from probserve.api.server.grammar_cache import GrammarCache
from probserve.engine import EngineClient
from probserve.engine.grammar import llguidance_tokenizer
from probserve.engine.info import EngineInfo
from probserve.models import ModelRecord
from probserve.models.generation_config import SamplingDefaults


@dataclass
class ServedModel:
    """One model: the names it answers to (the first is its own), its tokenizer side and its
    engine. `engine` may be replaced while the server runs (a restarted worker: supervisor.py)."""

    names: tuple[str, ...]
    record: ModelRecord  # the model as this process holds it (no weights)
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
        self.table = TokenTable(self.record.tokenizer, self.record.vocab_size)
        self.fmt = LogprobsFormatter(self.table)
        self.fmt_ids = LogprobsFormatter(self.table, as_ids=True)

    def grammar_tokenizer(self) -> Any:
        """llguidance's view of the tokenizer, built on the first structured output (blocking:
        a fraction of a second; a race builds it twice, harmlessly)."""
        if self._grammar_tokenizer is None:
            eos = sorted(self.record.eos_token_ids)
            tok = llguidance_tokenizer(self.record.tokenizer, self.record.vocab_size, eos)
            self._grammar_tokenizer = tok
        return self._grammar_tokenizer

    @property
    def name(self) -> str:
        """The name it is served as (the first)."""
        return self.names[0]

    @property
    def root(self) -> str:
        """Its own name: the model's path, or the embedded model's name."""
        return str(self.record.name)

    @property
    def info(self) -> EngineInfo | None:
        """What the engine said of itself in its hello; None until it has (a worker restarted
        after a death has not said it yet). The one place the API reads it from the engine."""
        return getattr(self.engine, "info", None)

    @property
    def context_length(self) -> int:
        """The tokens one sequence may hold as served: the model's context, capped by
        `--max-model-len` and by what the KV cache (and a hybrid's state budget) holds for one
        sequence: the limit a longer prompt is refused at."""
        info = self.info
        return int(info.max_context) if info is not None else self.record.context_length

    def max_tokens_default(self, flag: int) -> int | None:
        """The tokens a request that sets no budget generates at most: its generation config's
        max_new_tokens (as vLLM), else `flag` (--max-tokens-default); None (0): up to the
        context."""
        own = self.sampling_defaults.max_new_tokens
        value = own if own is not None else flag
        return value if value > 0 else None

    def health(self) -> tuple[str, str | None]:
        """("ok" | "stuck" | "dead" | "restarting", why)."""
        if self.restarting is not None:
            return "restarting", self.restarting
        return self.engine.health()
