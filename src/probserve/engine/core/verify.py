"""The check of speculative proposals (core/speculation.py) in the step: each sequence's rows
drawn in order by the sampler, a pass a position, the proposals kept while they equal the
draws plain decoding makes there; what it gives is plain decoding's tokens and logprobs.
`sampler_row`: what the sampler needs of a sequence for its draw."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from probserve.engine.core.row_math import RowMath
from probserve.engine.core.sampler import SamplerRow, sample
from probserve.engine.core.sequence import Sequence as Seq
from probserve.engine.types import TokenLogprobs


def sampler_row(seq: Seq) -> SamplerRow:
    """What the sampler needs of a sequence for this step's draw (its grammar's mask is set
    once computed)."""
    request = seq.request
    return SamplerRow(
        params=request.sampling, logprobs=request.logprobs, seed=seq.seed,
        prompt_ids=seq.prompt_tensor, output_ids=seq.output_ids, stop_ids=seq.stop_ids,
        position=seq.num_tokens,
    )  # fmt: skip


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
    masks: Sequence[Sequence[torch.Tensor] | None] | None = None,
) -> list[Drawn]:
    """Each sequence's tokens from its rows of `logits` (1 + len(proposed[i]) rows each, in
    order): at each position the token plain decoding draws there (the sampler, with the output
    so far and the position's own draw), kept as a proposal while it equals it; the first that
    differs (or a stop id, or the last row) ends the sequence's check. Positions are drawn a
    pass at a time, every sequence still checking in one batched `sample` call. `masks[i]`: a
    grammar's allowed tokens at each of sequence i's positions (the check stops where they
    end), or None."""
    grammar = masks or [None] * len(rows)
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
                allowed=None if grammar[i] is None else grammar[i][j],  # type: ignore[index]
            )
            if j
            else rows[i]
            for i in active
        ]
        at = [first[i] + j for i in active]
        # (every row, in order: a step without proposals takes the logits as they are)
        block = logits if at == list(range(logits.shape[0])) else logits[at]
        result = sample(block, pass_rows, math)
        still: list[int] = []
        for a, i in enumerate(active):
            if result.errors[a] is not None:
                drawn[i].error = result.errors[a]
                continue
            token = int(result.token_ids[a])
            drawn[i].tokens.append(token)
            drawn[i].logprobs.append(result.logprobs[a])
            keep = j < len(proposed[i]) and token == proposed[i][j]
            ahead = grammar[i] is None or j + 1 < len(grammar[i])  # type: ignore[arg-type]
            if keep and ahead and token not in rows[i].stop_ids:
                still.append(i)
        active = still
        j += 1
    return drawn
