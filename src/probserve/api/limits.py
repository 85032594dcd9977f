"""Request limits: each a `probserve serve` flag; a violation is a 400 naming the field (413 for
the body). docs/operations.md lists them all and what a client sees."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from probserve.api.errors import bad_request


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 4 * 2**20  # 413 past this
    max_sequences: int = 64  # prompts x best_of (or n) in one request
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string
    max_logit_bias: int = 1024  # entries
    max_messages: int = 512
    max_message_chars: int = 1_000_000  # all messages' text together
    max_queued: int = 1024  # engine requests waiting or running; past it: 429
    request_timeout: float = 600.0  # seconds; past it the request is aborted (0: none)
    drain_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM

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
