"""The token-level engine contract: what goes in (EngineRequest) and what comes out (EngineOutput).

The engine knows token ids and numbers only. Text, offsets and OpenAI shapes are the API's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np


class LogprobsMode(enum.StrEnum):
    """Which distribution logprobs describe (docs/logprobs.md).

    RAW: log_softmax of the model's logits. PROCESSED: log_softmax of the distribution actually
    sampled from, after logit_bias, penalties, temperature and top-k/top-p/min-p (masked: -inf).
    BOTH: raw, with the processed figures beside them (`TokenLogprobs.processed`).
    """

    RAW = "raw"
    PROCESSED = "processed"
    BOTH = "both"

    @classmethod
    def _missing_(cls, value: object) -> LogprobsMode | None:
        """vLLM's spellings of the same distributions (its `logprobs_mode`); its raw_logits
        and processed_logits are logits, not log-probabilities: no mode of ours."""
        return {"raw_logprobs": cls.RAW, "processed_logprobs": cls.PROCESSED}.get(str(value))


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an EOS or stop token id was generated (the last token: that id)
    GRAMMAR = "grammar"  # the request's grammar is complete (the last token is its last)
    LENGTH = "length"  # max_tokens (or the context) reached
    # the grammar hit one of llguidance's bounds (a parser row, the items of a step, the
    # lexer's states) partway: the tokens so far stand, no more can follow
    GRAMMAR_LIMIT = "grammar_limit"
    ERROR = "error"  # the engine failed this request


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters. Processors apply in this order: logit_bias, min_tokens (stop ids
    masked), penalties (repetition, frequency, presence), temperature, top-k, top-p, min-p.
    temperature == 0 is greedy (argmax of the biased/penalised logits)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length; 0: score only
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def needs_processing(self) -> bool:
        """True when processed logits differ from raw ones for some processor."""
        return bool(
            self.logit_bias
            or self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or (not self.greedy and self.temperature != 1.0)
            or self.top_k > 0
            or self.top_p < 1.0
            or self.min_p > 0.0
        )


@dataclass(frozen=True)
class LogprobsSpec:
    """What logprobs to return. `top_k`: how many alternatives per generated position (0: the
    chosen token's logprob and rank only). `prompt_top_k`: also score every prompt position
    after the first (always raw), with that many alternatives; None: the prompt is not scored.
    `mode`: raw, processed or both, for generated tokens. `target_ids` and `entropy` add the
    named ids' logprobs and the entropy at every position, generated and scored."""

    top_k: int = 0
    prompt_top_k: int | None = None
    mode: LogprobsMode = LogprobsMode.RAW
    target_ids: tuple[int, ...] = ()  # logprobs of exactly these ids at every position
    entropy: bool = False  # the exact entropy of each position's full distribution (nats)
    full_positions: tuple[int, ...] = ()  # scored prompt positions whose whole row is returned

    @property
    def prompt(self) -> bool:
        return self.prompt_top_k is not None


@dataclass(frozen=True)
class RoutingSpec:
    """Return the experts each token was routed to (a mixture of experts): for every generated
    token, and with `prompt` for every prompt token after the first, the routing of the row
    that gave it its logprob (the position before it), in every MoE layer."""

    prompt: bool = False


@dataclass(frozen=True)
class RoutedExperts:
    """Routing for n tokens: `experts` int16 [n, moe_layers, k], the k experts of each MoE layer
    (in the router's order: by weight, ties to the lower id), and their `weights` float32 (as
    the layer summed them: renormalised where the model does)."""

    experts: np.ndarray
    weights: np.ndarray

    def __len__(self) -> int:
        return int(self.experts.shape[0])

    def span(self, a: int, b: int) -> RoutedExperts:
        return RoutedExperts(self.experts[a:b], self.weights[a:b])

    @staticmethod
    def concat(parts: list[RoutedExperts]) -> RoutedExperts:
        return RoutedExperts(
            np.concatenate([p.experts for p in parts]), np.concatenate([p.weights for p in parts])
        )


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    logprobs: LogprobsSpec | None = None  # None: compute no logprobs at all
    # requests of one group (the candidates of one API request) share the batch fairly with
    # other groups: no group can hold every running slot while another waits ("": its own id)
    group: str = ""
    # constrained decoding: an llguidance grammar (its JSON form; the client compiled and
    # checked it, the engine checks it again); the sampled tokens are those it allows
    grammar: str | None = None
    routing: RoutingSpec | None = None  # None: no routing returned
    # speculative decoding (prompt lookup) for this request: None the server's default
    # (--speculative), True on, False off; tokens and logprobs are the same bits either way
    speculative: bool | None = None
    # an embedding of the prompt (max_tokens 0): its final hidden states pooled "mean", "last"
    # or "cls" (the first position); None: none
    embed: str | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """Compact logprobs for n positions (one row per token): the token ids, their logprobs and
    ranks (1 = most likely), and the top-k alternatives best first. Arrays, not dicts: they leave
    the tensor world once per step."""

    token_ids: np.ndarray  # int64 [n]
    logprobs: np.ndarray  # float32 [n]
    ranks: np.ndarray  # int64 [n]
    top_ids: np.ndarray  # int64 [n, k]
    top_logprobs: np.ndarray  # float32 [n, k]
    target_logprobs: np.ndarray | None = None  # float32 [n, T]: the ids of `target_ids`
    target_ids: tuple[int, ...] = ()
    entropy: np.ndarray | None = None  # float32 [n], nats
    processed: TokenLogprobs | None = None  # mode BOTH: the processed figures, same rows
    full: np.ndarray | None = None  # float32 [m, V]: the rows of LogprobsSpec.full_positions
    # a grammar's requests: log of the raw probability mass of the tokens it allowed [n]
    constraint_logmass: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.token_ids.shape[0])

    def row(self, j: int, k: int | None = None) -> TokenLogprobs:
        """Row j alone (with at most k alternatives)."""
        return self.span(j, j + 1, k)

    def span(self, a: int, b: int, k: int | None = None) -> TokenLogprobs:
        """Rows [a, b) (with at most k alternatives: a top-k is a prefix of a wider one)."""

        def cut(x: np.ndarray | None) -> np.ndarray | None:
            return None if x is None else x[a:b]

        return TokenLogprobs(
            token_ids=self.token_ids[a:b],
            logprobs=self.logprobs[a:b],
            ranks=self.ranks[a:b],
            top_ids=self.top_ids[a:b, :k],
            top_logprobs=self.top_logprobs[a:b, :k],
            target_logprobs=cut(self.target_logprobs),
            target_ids=self.target_ids,
            entropy=cut(self.entropy),
            processed=None if self.processed is None else self.processed.span(a, b, k),
            constraint_logmass=cut(self.constraint_logmass),
        )

    @staticmethod
    def concat(parts: list[TokenLogprobs]) -> TokenLogprobs:
        def cat(arrays: list[np.ndarray | None]) -> np.ndarray | None:
            return None if arrays[0] is None else np.concatenate(arrays)  # type: ignore[arg-type]

        processed = [p.processed for p in parts]
        return TokenLogprobs(
            token_ids=np.concatenate([p.token_ids for p in parts]),
            logprobs=np.concatenate([p.logprobs for p in parts]),
            ranks=np.concatenate([p.ranks for p in parts]),
            top_ids=np.concatenate([p.top_ids for p in parts]),
            top_logprobs=np.concatenate([p.top_logprobs for p in parts]),
            target_logprobs=cat([p.target_logprobs for p in parts]),
            target_ids=parts[0].target_ids,
            entropy=cat([p.entropy for p in parts]),
            full=cat([p.full for p in parts]),
            constraint_logmass=cat([p.constraint_logmass for p in parts]),
            processed=None if processed[0] is None else TokenLogprobs.concat(processed),  # type: ignore[arg-type]
        )


@dataclass(frozen=True)
class EngineOutput:
    """One step's news for one request: the new token ids (usually one), their logprobs if asked,
    the prompt's logprobs once (in the first output, for prompt positions 1..len-1), and the
    finish reason in the last output."""

    request_id: str
    new_token_ids: tuple[int, ...] = ()
    logprobs: TokenLogprobs | None = None
    prompt_logprobs: TokenLogprobs | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    queue_time: float | None = None  # seconds from arrival to first being scheduled
    # prompt tokens found in the prefix cache when it was first scheduled (not computed again)
    cached_tokens: int | None = None
    routed: RoutedExperts | None = None  # RoutingSpec: the new tokens' routing
    prompt_routed: RoutedExperts | None = None  # with its prompt: tokens 1..len-1, once
    embedding: np.ndarray | None = None  # float32 [hidden]: EngineRequest.embed's pooling

    def __post_init__(self) -> None:
        if self.error is not None:
            # an error message may quote anything (an exception's text): keep it valid UTF-8,
            # as JSON and the engine protocol need
            clean = self.error.encode("utf-8", "backslashreplace").decode("utf-8")
            object.__setattr__(self, "error", clean)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @staticmethod
    def failure(request_id: str, message: str) -> EngineOutput:
        """The last output of a request the engine failed."""
        return EngineOutput(request_id, finish_reason=FinishReason.ERROR, error=message)


class EngineOverloaded(RuntimeError):
    """The engine's queue is full; the caller should retry later."""


class EngineDead(RuntimeError):
    """The engine thread has stopped after an unexpected error: nothing can be served."""


class RequestError(ValueError):
    """A request the engine refuses (bad token ids, too long for the context, bad params).
    `param` names the offending field, for the API's error envelope."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
