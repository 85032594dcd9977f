"""Speculative decoding's proposals: tokens guessed for a sequence's next positions, which the
next step runs as extra rows of that sequence and the sampler checks in order (core/verify.py):
a position's token is drawn exactly as plain decoding draws it (greedy: the argmax; sampled: the
draw keyed by the seed and the position), the proposals are kept while they equal the draws,
and the first draw that differs is the next token. Every token and logprob is
therefore what plain decoding gives, bit for bit where the kernels are row-invariant.

`NgramProposer` (prompt lookup): the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from `max_n` down to `min_n`, 2: a single recurring token proposes
too much on text that does not repeat), in the prompt or the text so far; no second model. How
many it proposes adapts per sequence (`Speculation`): one more than were accepted last time, up
to the server's most; a check that keeps none rests the sequence for 1, 3, 7, 15, 31, then
REST_MOST steps in a row of misses (one kept token ends the rests), so text that does not
repeat costs an extra row about once in REST_MOST + 1 steps, not every step (the default on
the CPU engine while few sequences run: core/speculator.py's AUTO_MOST_RUNNING). A lookup
that matches nothing does not rest it: a reply that starts to copy its prompt is caught at
once.
`DraftProposer`: a smaller model with the same tokenizer guesses greedily, run by an engine
of its own (its own KV cache; prefix caching finds each sequence's earlier
tokens there, so a step's guesses cost the new tokens and k draft steps, every sequence's in one
batch). A request with a grammar proposes the tokens its grammar forces instead (core/grammar.py:
llguidance's fast-forward tokens).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from probserve.engine.types import EngineRequest, RequestError, SamplingParams

# (request id, the sequence's tokens, how many to propose) -> the proposals by request id
Asks = Sequence[tuple[str, list[int], int]]


class Proposer(Protocol):
    @property
    def name(self) -> str:
        """What `/health`'s `speculative` calls it ("ngram", "draft:MODEL")."""
        ...

    def propose_many(self, asks: Asks) -> dict[str, tuple[int, ...]]:
        """Every ask's proposals (by request id; none for an ask it has no guess for)."""
        ...


REST_MOST = 32  # the most steps a sequence whose guesses keep missing goes without proposing


@dataclass
class Speculation:
    """A sequence's speculative state: the tokens proposed for its next step, how many it may
    propose next, its checks in a row that kept none and the steps it rests for them, and its
    totals (proposed, accepted)."""

    limit: int
    proposed: tuple[int, ...] = ()
    drafted: int = 0
    accepted: int = 0
    misses: int = 0
    rest: int = 0

    def settle(self, accepted: int, most: int) -> None:
        """After a check of `self.proposed`: `accepted` of them were kept."""
        if self.proposed:
            self.drafted += len(self.proposed)
            self.accepted += accepted
            self.limit = max(1, min(most, accepted + 1))
            if accepted:
                self.misses = self.rest = 0
            else:
                self.missed()
        self.proposed = ()

    def missed(self) -> None:
        """Its guesses kept nothing: one more miss in a row, and its rest for them."""
        self.misses += 1
        self.rest = min(REST_MOST, (1 << min(self.misses, 6)) - 1)

    def resting(self) -> bool:
        """Whether it skips proposing this step (a step of its rest passes)."""
        if self.rest:
            self.rest -= 1
            return True
        return False


class NgramProposer:
    """Prompt lookup: the continuation of the latest earlier match of the last n tokens."""

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

    @property
    def name(self) -> str:
        return "ngram"

    def propose_many(self, asks: Asks) -> dict[str, tuple[int, ...]]:
        return {rid: self.propose(tokens, k) for rid, tokens, k in asks}

    def propose(self, tokens: list[int], k: int) -> tuple[int, ...]:
        """Up to k tokens to follow `tokens` (none where no n-gram recurs)."""
        if k <= 0 or len(tokens) < self.min_n + 1:
            return ()
        arr = np.asarray(tokens, dtype=np.int64)
        last = len(arr)
        for n in range(min(self.max_n, last - 1), self.min_n - 1, -1):
            tail = arr[last - n :]
            # starts i < last - n where arr[i:i+n] == tail, the latest first
            starts = np.flatnonzero(arr[: last - n] == tail[0])
            for i in starts[::-1]:
                if np.array_equal(arr[i : i + n], tail):
                    follow = arr[i + n : i + n + k]
                    if len(follow):
                        return tuple(int(t) for t in follow)
        return ()


class DraftProposer:
    """A draft model's greedy guesses: `core` is an engine (EngineCore) of a smaller model with
    the same tokenizer, its own KV cache and prefix cache, stepped here until every ask is
    answered (the draft's EOS ends a guess, and is proposed)."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self._ids = itertools.count()

    @property
    def name(self) -> str:
        return f"draft:{self.core.loaded.name}"

    def propose(self, tokens: list[int], k: int) -> tuple[int, ...]:
        return self.propose_many([("one", tokens, k)])["one"]

    def propose_many(self, asks: Asks) -> dict[str, tuple[int, ...]]:
        out: dict[str, list[int]] = {}
        names: dict[str, str] = {}
        for rid, tokens, k in asks:
            if k <= 0:
                continue
            name = f"draft-{next(self._ids)}"
            try:
                self.core.add_request(
                    EngineRequest(name, tuple(tokens), SamplingParams(temperature=0, max_tokens=k))
                )
            except RequestError:  # past the draft's context: no guess
                continue
            names[name] = rid
            out[rid] = []
        while self.core.has_work():
            for o in self.core.step():
                if o.request_id in names:
                    out[names[o.request_id]] += o.new_token_ids
        return {rid: tuple(got) for rid, got in out.items()}
