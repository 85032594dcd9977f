"""Prompt scoring: the logprobs of a prompt's own tokens (echo, `max_tokens` 0, /v1/score).

A sequence whose LogprobsSpec asks for them gets them once, in its first output (its only one
when max_tokens is 0). Each chunk of its prefill scores a range of positions: the logits at
position p score prompt token p + 1 (`score_range`). The first chunk after a prefix-cache hit
starts at position 0: runners keep each position's final hidden state beside its KV, so a cached
prompt scores exactly as a fresh one. Runners hand the rows over as `ScoreRows`; `score_step`
turns a step's rows into logprobs, every sequence's together a slice at a time
(logprobs.score_positions), and `collect` returns a prompt's once it is complete. `pooled`:
a prompt's final hidden states pooled as its request asks (an embedding).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from probserve.engine.core.logprobs import score_positions
from probserve.engine.core.step import ScoreRows
from probserve.engine.types import TokenLogprobs

if TYPE_CHECKING:
    from probserve.engine.core.row_math import RowMath
    from probserve.engine.core.sequence import Sequence
    from probserve.engine.core.step import Chunk


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


def score_step(chunks: list[Chunk], prompt_rows: dict[str, ScoreRows], math: RowMath) -> None:
    """Score every chunk's rows of this step, each sequence's part kept for `collect`.

    The rows of every sequence that asks the same things (the same head, target ids and entropy)
    are scored together: one head product and one scoring pass over all of this step's scored
    positions, in slices of SCORE_CHUNK_ROWS rows whoever's they are, instead of a head call per
    sequence (unrelated 100-token prompts would each run the head over one short slice). A row's
    numbers do not depend on the rows beside it (the row-invariant kernels), and each sequence
    gets its own top-k as a prefix of the group's widest (ordered by value, then id). A sequence
    that also asks whole rows (`full_positions`) is scored alone."""
    groups: dict[tuple[object, ...], list[tuple[Sequence, ScoreRows, torch.Tensor, int]]] = {}
    for ch in chunks:
        rows = prompt_rows.get(ch.seq.request_id)
        spec = ch.seq.request.logprobs
        if rows is None or spec is None:
            continue
        a, b = score_range(ch)
        k = spec.prompt_top_k or 0
        targets = ch.seq.prompt_tensor[a + 1 : b + 1]
        if spec.full_positions:
            ch.seq.prompt_scores.parts.append(score_positions(math, rows, targets, k, spec, a))
            continue
        key = (rows.head, spec.target_ids, spec.entropy)
        groups.setdefault(key, []).append((ch.seq, rows, targets, k))
    for items in groups.values():
        spec = items[0][0].request.logprobs
        if len(items) == 1:
            seq, rows, targets, k = items[0]
            seq.prompt_scores.parts.append(score_positions(math, rows, targets, k, spec))
            continue
        joined = ScoreRows(torch.cat([r.rows for _, r, _, _ in items]), items[0][1].head)
        targets = torch.cat([t for _, _, t, _ in items])
        scored = score_positions(math, joined, targets, max(k for *_, k in items), spec)
        at = 0
        for seq, rows, _, k in items:
            seq.prompt_scores.parts.append(scored.span(at, at + len(rows), k))
            at += len(rows)


def collect(ch: Chunk) -> TokenLogprobs | None:
    """Once this chunk completes its prompt, the whole prompt's scores (`score_step`'s parts)."""
    seq = ch.seq
    state = seq.prompt_scores
    if wanted(seq) and ch.end >= seq.num_prompt_tokens:
        state.done = True
        parts, state.parts = state.parts, []
        return parts[0] if len(parts) == 1 else TokenLogprobs.concat(parts)
    return None


def restart(seq: Sequence) -> None:
    """Forget partial scores (a preempted sequence recomputes its prompt from the start)."""
    seq.prompt_scores.parts.clear()


def pooled(
    hidden: Callable[[Sequence, int, int], torch.Tensor], seq: Sequence
) -> np.ndarray | None:
    """The prompt's final hidden states (`hidden`: the runner's, of positions [a, b)) pooled as
    its request asks (mean: summed in float64 in position order; last; cls: the first),
    float32; None where none is asked."""
    how = seq.request.embed
    if how is None:
        return None
    n = seq.num_prompt_tokens
    if how == "mean":
        rows = hidden(seq, 0, n).double()
        return (rows.sum(dim=0) / n).float().numpy()
    at = n - 1 if how == "last" else 0
    return hidden(seq, at, at + 1)[0].float().numpy().copy()
