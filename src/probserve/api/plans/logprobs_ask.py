"""How a request asks for logprobs: `LogprobsAsk` holds all a route may ask (alternatives for
generated tokens and for scored prompt positions, best_of's hidden ask, target ids, entropy,
the mode, whole rows), checked once against the server's caps and the vocabulary with one
message shape, and becomes the engine's `LogprobsSpec` (or None: no logprobs computed)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from probserve.api.errors import bad_request
from probserve.api.protocol import SamplingFields
from probserve.api.server.state import Serving
from probserve.engine import LogprobsMode, LogprobsSpec


def capped(value: int | None, cap: int, field: str) -> int | None:
    """`value` when it is at most `cap` (None passes); a 400 naming `field` otherwise."""
    if value is not None and value > cap:
        raise bad_request(f"{field} must be at most {cap} (got {value})", field)
    return value


def reply_alternatives(
    state: Serving, logprobs: bool | None, top_logprobs: int | None
) -> int | None:
    """The alternatives a reply shows per token when a route asks as chat does (`logprobs` on,
    `top_logprobs` of them, capped by --max-top-logprobs): None where logprobs are off; a 400
    for top_logprobs without logprobs (chat's and the Messages API's rule)."""
    if top_logprobs is not None and not logprobs:
        raise bad_request("top_logprobs is only allowed when logprobs is true", "top_logprobs")
    top = capped(top_logprobs, state.config.max_top_logprobs, "top_logprobs")
    return (top or 0) if logprobs else None


def checked_ids(
    ids: Sequence[int] | None, state: Serving, field: str, least: int = 0
) -> tuple[int, ...]:
    """Token ids a request wants the logprobs of: `least` to the server's cap of them, each in
    the vocabulary (a 400 naming `field` otherwise)."""
    ids = tuple(ids or ())
    cap = state.config.limits.max_logprob_token_ids
    if not least <= len(ids) <= cap:
        raise bad_request(f"{field} must hold {least} to {cap} ids (got {len(ids)})", field)
    vocab = state.record.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(f"{field}: {bad} is outside the vocabulary (0..{vocab - 1})", field)
    return ids


@dataclass(frozen=True)
class LogprobsAsk:
    """`alternatives`: the top alternatives shown per generated token (None: the answer shows no
    logprobs); `prompt_alternatives`: per scored prompt position (None: the prompt is not
    scored); `ranked`: best_of ranks the candidates by their mean logprob, so the chosen tokens'
    logprobs are computed though none is shown. These say what is reported, never what is
    sampled (that is sampling's `top_k`)."""

    alternatives: int | None = None
    prompt_alternatives: int | None = None
    ranked: bool = False
    target_ids: tuple[int, ...] = ()
    entropy: bool = False
    mode: LogprobsMode = LogprobsMode.RAW
    full_positions: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        state: Serving,
        body: SamplingFields,
        alternatives: int | None,
        prompt_alternatives: int | None = None,
        ranked: bool = False,
    ) -> LogprobsAsk:
        """The ask of a generating route: the alternatives it decided (capped by its caller,
        which knows the field), with the body's target ids, entropy and mode, which need
        logprobs asked for."""
        targets = checked_ids(body.logprob_token_ids, state, "logprob_token_ids")
        if alternatives is None and prompt_alternatives is None:
            asked = {"logprob_token_ids": targets, "return_entropy": body.return_entropy}
            for field, value in asked.items():
                if value:
                    raise bad_request(f"{field} needs logprobs to be requested", field)
        mode = LogprobsMode(body.logprobs_mode or state.config.logprobs_mode)
        return cls(alternatives, prompt_alternatives, ranked, targets, body.return_entropy, mode)

    @property
    def shown(self) -> bool:
        """The answer shows logprobs of the generated tokens."""
        return self.alternatives is not None

    def spec(self) -> LogprobsSpec | None:
        """What the engine computes; None when nothing is asked (no logprobs at all)."""
        if not self.shown and self.prompt_alternatives is None and not self.ranked:
            return None
        return LogprobsSpec(
            self.alternatives or 0,
            self.prompt_alternatives,
            self.mode,
            self.target_ids,
            self.entropy,
            self.full_positions,
        )
