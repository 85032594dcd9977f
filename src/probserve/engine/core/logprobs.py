"""Logprobs of chosen tokens: value, rank and top-k, from rows of logits.

`RowMath.score` gives them for all rows at once (never a full sort, ranks by counting; the
row-invariant kernels in one fused pass per row without writing the log-softmax), and the
results leave torch as compact numpy arrays (brought to the host where the rows were on the
GPU path's device).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
import torch

from probserve.engine.core.row_math import RowMath
from probserve.engine.types import LogprobsSpec, TokenLogprobs

if TYPE_CHECKING:
    from probserve.engine.core.step import ScoreRows

# rows of the vocabulary handled at once when scoring long prompts (bounds peak memory)
SCORE_CHUNK_ROWS = 256


def _host(t: torch.Tensor, dtype: type) -> np.ndarray:
    return t.cpu().numpy().astype(dtype, copy=True)


def token_logprobs(
    math: RowMath,
    logits: torch.Tensor,
    token_ids: torch.Tensor,
    k: int,
    targets: tuple[int, ...] = (),
    entropy: bool = False,
) -> TokenLogprobs:
    """Rows of logits [n, V] and the token each row scores [n] -> TokenLogprobs with k alts
    (`RowMath.score`: no log-softmax written out), plus the logprobs of the `targets` ids and
    each row's exact entropy where asked (these read the whole log-softmax)."""
    target_lp = ent = None
    if targets or entropy:
        lp = math.log_softmax(logits)
        if targets:
            ids = torch.tensor(targets, dtype=torch.long, device=lp.device)
            target_lp = _host(lp.index_select(1, ids), np.float32)
        if entropy:
            # H = -sum p log p over the whole vocabulary; masked tokens (p = 0) add nothing
            ent = _host(math.entropy(lp), np.float32)
    chosen, ranks, top_vals, top_ids = math.score(logits, token_ids, k)
    return TokenLogprobs(
        token_ids=_host(token_ids, np.int64),
        logprobs=_host(chosen, np.float32),
        ranks=_host(ranks, np.int64),
        top_ids=_host(top_ids, np.int64),
        top_logprobs=_host(top_vals, np.float32),
        target_logprobs=target_lp,
        target_ids=tuple(targets),
        entropy=ent,
    )


def score_positions(
    math: RowMath,
    rows: ScoreRows,
    targets: torch.Tensor,
    k: int,
    spec: LogprobsSpec | None = None,
    first_position: int = 0,
) -> TokenLogprobs:
    """Raw logprobs of `targets` [n] under `rows` (row i, at prompt position first_position + i,
    predicts targets[i]), in slices of rows, so a long prompt never materialises n x V logits or
    log-probabilities at once. Rows at `spec.full_positions` are also returned whole."""
    n = len(rows)
    full = sorted(set(spec.full_positions)) if spec else []
    parts = []
    for start in range(0, n, SCORE_CHUNK_ROWS):
        logits = rows.logits(start, start + SCORE_CHUNK_ROWS).float()
        part = token_logprobs(
            math,
            logits,
            targets[start : start + SCORE_CHUNK_ROWS],
            k,
            spec.target_ids if spec else (),
            bool(spec and spec.entropy),
        )
        if full:
            lo = first_position + start
            local = [p - lo for p in full if lo <= p < lo + logits.shape[0]]
            # a row's log-softmax does not depend on the rows beside it
            at = torch.tensor(local, dtype=torch.long, device=logits.device)
            picked = math.log_softmax(logits[at] if local else logits[:0])
            part = dataclasses.replace(part, full=_host(picked, np.float32))
        parts.append(part)
    if not parts:
        empty_i = np.zeros((0,), dtype=np.int64)
        n_targets = len(spec.target_ids) if spec else 0
        return TokenLogprobs(
            empty_i,
            np.zeros((0,), np.float32),
            empty_i,
            np.zeros((0, k), np.int64),
            np.zeros((0, k), np.float32),
            target_logprobs=np.zeros((0, n_targets), np.float32) if n_targets else None,
            target_ids=spec.target_ids if spec else (),
            entropy=np.zeros((0,), np.float32) if spec and spec.entropy else None,
        )
    return parts[0] if len(parts) == 1 else TokenLogprobs.concat(parts)
