"""Speculative decoding's proposals: tokens guessed for a sequence's next positions, which the
next step runs as extra rows of that sequence and the sampler checks in order (engine.py's
`_draw`): a position's token is drawn exactly as plain decoding draws it (greedy: the argmax;
sampled: the draw keyed by the seed and the position), the proposals are kept while they equal
the draws, and the first draw that differs is the next token. Every token and logprob is
therefore what plain decoding gives, bit for bit where the kernels are row-invariant.

`NgramProposer` (prompt lookup): the tokens that followed the latest earlier occurrence of the
sequence's last n tokens (n from `max_n` down to `min_n`), in the prompt or the text so far; no
second model. How many it proposes adapts per sequence (`Speculation`): one more than were
accepted last time, up to the server's most, so a sequence whose guesses miss costs one extra
row a step at most.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from probserve.engine.core.row_math import RowMath
from probserve.engine.core.sampler import SamplerRow, sample
from probserve.engine.types import TokenLogprobs


@dataclass
class Speculation:
    """A sequence's speculative state: the tokens proposed for its next step, how many it may
    propose next, and its totals (proposed, accepted)."""

    limit: int
    proposed: tuple[int, ...] = ()
    drafted: int = 0
    accepted: int = 0

    def settle(self, accepted: int, most: int) -> None:
        """After a check of `self.proposed`: `accepted` of them were kept."""
        if self.proposed:
            self.drafted += len(self.proposed)
            self.accepted += accepted
            self.limit = max(1, min(most, accepted + 1))
        self.proposed = ()


class NgramProposer:
    """Prompt lookup: the continuation of the latest earlier match of the last n tokens."""

    def __init__(self, min_n: int = 1, max_n: int = 4) -> None:
        self.min_n, self.max_n = min_n, max_n

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


@dataclass
class Drawn:
    """What one sequence's rows gave: its tokens in order (accepted proposals, then the draw
    that ended the check), their logprobs, or why the row failed."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    error: str | None = None

    @property
    def accepted(self) -> int:
        """Proposals kept (every token but the last)."""
        return max(0, len(self.tokens) - 1)


def draw(
    logits: torch.Tensor,
    rows: Sequence[SamplerRow],
    proposed: Sequence[tuple[int, ...]],
    math: RowMath,
) -> list[Drawn]:
    """Each sequence's tokens from its rows of `logits` (1 + len(proposed[i]) rows each, in
    order): at each position the token plain decoding draws there (the sampler, with the output
    so far and the position's own draw), kept as a proposal while it equals it; the first that
    differs (or a stop id, or the last row) ends the sequence's check. Positions are drawn a
    pass at a time, every sequence still checking in one batched `sample` call."""
    first = [0]
    for p in proposed:
        first.append(first[-1] + 1 + len(p))
    drawn = [Drawn([], []) for _ in rows]
    active = list(range(len(rows)))
    j = 0
    while active:
        pass_rows = [
            dataclasses.replace(
                rows[i],
                output_ids=[*rows[i].output_ids, *proposed[i][:j]],
                position=rows[i].position + j,
            )
            if j
            else rows[i]
            for i in active
        ]
        result = sample(logits[[first[i] + j for i in active]], pass_rows, math)
        still: list[int] = []
        for a, i in enumerate(active):
            if result.errors[a] is not None:
                drawn[i].error = result.errors[a]
                continue
            token = int(result.token_ids[a])
            drawn[i].tokens.append(token)
            drawn[i].logprobs.append(result.logprobs[a])
            keep = j < len(proposed[i]) and token == proposed[i][j]
            if keep and token not in rows[i].stop_ids:
                still.append(i)
        active = still
        j += 1
    return drawn
