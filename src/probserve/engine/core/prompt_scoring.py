"""Prompt scoring: the logprobs of a prompt's own tokens (echo, `max_tokens` 0, /v1/score).

A sequence whose LogprobsSpec asks for them gets them once, in its first output (its only one
when max_tokens is 0). Each chunk of its prefill scores a range of positions: the logits at
position p score prompt token p + 1 (`score_range`). The first chunk after a prefix-cache hit
starts at position 0: runners keep each position's final hidden state beside its KV, so a cached
prompt scores exactly as a fresh one. Runners hand the rows over as `ScoreRows`; `collect` turns
them into logprobs a slice at a time (logprobs.score_positions) and, once the prompt is complete,
returns them all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from probserve.engine.core.logprobs import score_positions
from probserve.engine.types import TokenLogprobs

if TYPE_CHECKING:
    from probserve.engine.core.row_math import RowMath
    from probserve.engine.core.sequence import Sequence
    from probserve.engine.core.step import Chunk, ScoreRows


def wanted(seq: Sequence) -> bool:
    """The sequence still needs its prompt scored (a one-token prompt has nothing to score)."""
    spec = seq.request.logprobs
    return bool(spec and spec.prompt and seq.num_prompt_tokens > 1 and not seq.prompt_scores.done)


def score_range(ch: Chunk) -> tuple[int, int]:
    """Positions of this chunk whose logits score prompt tokens: [a, b) scores prompt[a+1 .. b].
    At the first chunk after a prefix-cache hit it starts at 0 (cached positions included)."""
    seq = ch.seq
    if not wanted(seq):
        return (0, 0)
    first = 0 if ch.start == seq.num_cached else ch.start
    return (first, min(ch.end, seq.num_prompt_tokens - 1))


def collect(ch: Chunk, rows: ScoreRows | None, math: RowMath) -> TokenLogprobs | None:
    """Score this chunk's rows; once the prompt is complete, return the whole prompt's scores."""
    seq = ch.seq
    state = seq.prompt_scores
    if rows is not None:
        a, b = score_range(ch)
        spec = seq.request.logprobs
        k = (spec.prompt_top_k or 0) if spec else 0
        targets = seq.prompt_tensor[a + 1 : b + 1]
        state.parts.append(score_positions(math, rows, targets, k, spec, a))
    if wanted(seq) and ch.end >= seq.num_prompt_tokens:
        state.done = True
        parts, state.parts = state.parts, []
        return parts[0] if len(parts) == 1 else TokenLogprobs.concat(parts)
    return None


def restart(seq: Sequence) -> None:
    """Forget partial scores (a preempted sequence recomputes its prompt from the start)."""
    seq.prompt_scores.parts.clear()
