"""The API's settings (`ServerConfig`): the `probserve serve` flags the routes read, and the
keys and limits the composition root (serving.py) gives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from probserve.api.answers.thinking import ReasoningParser
from probserve.api.server.limits import HttpLimits, Limits
from probserve.api.tools.formats import ToolParser
from probserve.engine import ClientLimits, LogprobsMode
from probserve.flags import setting


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
    pooling: Literal["mean", "last", "cls"] = setting(
        "last",
        "how /v1/embeddings pools a prompt's final hidden states where a request names none: "
        "last (the last token's, as a causal model's embeddings usually are), mean, or cls "
        "(the first token's)",
    )
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
        "<tool_call>, Qwen3-Coder / Qwen3.5's XML <function=...>, Llama 3's JSON, Mistral's "
        "[TOOL_CALLS]; generic where it knows no tools), "
        "or one format for every model",
    )
    reasoning_parser: ReasoningParser = setting(
        ReasoningParser.AUTO,
        "how a thinking model's reply is split into reasoning and answer: auto (where the chat "
        "template mentions </think> and the tokenizer has <think> and </think> as tokens: "
        "Qwen3, Qwen3.5, DeepSeek-R1 and its distills, QwQ; where the template writes "
        "<|channel|> and the tokenizer has harmony's tokens: gpt-oss's channels), think "
        "(<think> wherever the tokenizer has them), harmony (wherever the tokenizer has "
        "harmony's tokens), or none (the reply as written)",
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

    @property
    def closed_schemas(self) -> bool:
        """Schemas' objects take no keys they do not name (schema_extra_keys forbid)."""
        return self.schema_extra_keys == "forbid"
