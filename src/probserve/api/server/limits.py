"""The limits of a running server, split by who enforces them; each field is a `probserve
serve` flag of the same name (`--max-body-bytes`, ...). `Limits`: what one request may ask,
checked by the routes (a 400 naming the field; 429 past the distribution-row budget).
`HttpLimits`: what a connection may do, enforced by the HTTP server and its middleware (413,
408, 503). The engine client's own (`--max-queued`, `--engine-stall-timeout`) are
engine.ClientLimits. docs/operations.md lists them all and what a client sees."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from probserve.api.errors import bad_request
from probserve.flags import setting


@dataclass(frozen=True)
class HttpLimits:
    """Enforced by the HTTP server (api/edge/server.py) and the body middleware."""

    max_body_bytes: int = setting(4 * 2**20, "larger request bodies get 413")
    header_timeout: float = setting(10.0, "seconds a client may take to send a request's headers")
    body_timeout: float = setting(30.0, "seconds a client may take to send a request's body (408)")
    send_timeout: float = setting(
        30.0,
        "seconds a client may leave a large answer's next slice unread before it is cut "
        "(/v1/distributions: its rows go back to the budget)",
    )
    max_connections: int = setting(1024, "open connections; past it new requests get 503")
    sse_keepalive: float = setting(
        15.0,
        "seconds of silence on a stream (a long prefill, a queue) before a `: keepalive` comment "
        "line keeps proxies from closing it (0: never)",
    )
    drain_timeout: float = setting(30.0, "seconds in-flight requests get to finish after SIGTERM")


@dataclass(frozen=True)
class Limits:
    """What one request may ask: checked by the routes before any work is done."""

    max_sequences: int = setting(64, "prompts x best_of (or n) per request")
    max_stop_strings: int = setting(16, "stop strings per request")
    max_stop_chars: int = setting(256, "characters per stop string")
    max_stop_token_ids: int = setting(1024, "entries in stop_token_ids")
    max_logit_bias: int = setting(1024, "entries in logit_bias")
    max_logprob_token_ids: int = setting(
        256, "entries in logprob_token_ids (and /v1/score's label_token_ids)"
    )
    max_distribution_positions: int = setting(
        512, "positions per /v1/distributions request (each a full vocabulary row)"
    )
    max_distribution_rows_in_flight: int = setting(
        2048, "full vocabulary rows of all /v1/distributions requests at once; past it: 429"
    )
    max_routed_tokens: int = setting(
        8192,
        "tokens whose routed experts one request may return (return_routed_experts): its "
        "sequences' max_tokens, plus their prompts where they are returned too",
    )
    max_messages: int = setting(512, "messages per chat request")
    max_message_chars: int = setting(1_000_000, "characters in all messages of a chat request")
    max_prompt_chars: int = setting(1_000_000, "characters in a request's text prompts")
    max_grammar_chars: int = setting(
        65_536, "characters of a structured output's schema (as JSON), regex, grammar or choices"
    )
    max_grammar_choices: int = setting(1024, "strings of a structured output's choice")
    max_tokens_default: int = setting(
        2048,
        "tokens a request that sets no budget (chat's max_tokens / max_completion_tokens, "
        "Responses' max_output_tokens, completions' max_tokens: null) generates at most, where "
        "the model's generation_config.json sets no max_new_tokens (--generation-config); it "
        "ends with finish_reason length (0: up to the context)",
    )
    request_timeout: float = setting(600.0, "seconds before a request is aborted (0: never)")

    def check_sequences(self, prompts: int, per_prompt: int, param: str) -> None:
        total = prompts * per_prompt
        if total > self.max_sequences:
            raise bad_request(
                f"this request asks for {total} sequences ({prompts} prompt(s) x {per_prompt}); "
                f"the limit is {self.max_sequences}",
                param,
            )

    def check_stop(self, stop: Sequence[str]) -> None:
        if len(stop) > self.max_stop_strings:
            raise bad_request(
                f"at most {self.max_stop_strings} stop strings (got {len(stop)})", "stop"
            )
        if any(len(s) > self.max_stop_chars for s in stop):
            raise bad_request(
                f"a stop string may have at most {self.max_stop_chars} characters", "stop"
            )

    def check_stop_token_ids(self, ids: Sequence[int] | None) -> None:
        if ids and len(ids) > self.max_stop_token_ids:
            raise bad_request(
                f"stop_token_ids may have at most {self.max_stop_token_ids} entries "
                f"(got {len(ids)})",
                "stop_token_ids",
            )

    def check_logit_bias(self, bias: dict[str, float] | None) -> None:
        if bias and len(bias) > self.max_logit_bias:
            raise bad_request(
                f"logit_bias may have at most {self.max_logit_bias} entries (got {len(bias)})",
                "logit_bias",
            )

    def check_messages(self, count: int, chars: int) -> None:
        if count > self.max_messages:
            raise bad_request(f"at most {self.max_messages} messages (got {count})", "messages")
        if chars > self.max_message_chars:
            raise bad_request(
                f"the messages hold {chars} characters; the limit is {self.max_message_chars}",
                "messages",
            )
