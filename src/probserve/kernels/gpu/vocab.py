"""Reductions over rows of the vocabulary, each row alone in one fixed order (so its numbers do
not depend on the rows beside it): the log-softmax (the row's max, then the sum of exp(x - max)
in float64 lanes of a fixed width, its log rounded once: as kernels/invariant.cpp's
row_normalizer), a chosen token's logprob and rank (1 + the entries above it) from the logits
without writing the log-softmax, the k best entries by value then id (a total order: ties come
out the same way in every batch), and the exact entropy (float64, from the row's differences to
its largest entry).

Top-k runs in two passes: each block of TOPK_BLOCK columns keeps its own k best, then one
program per row takes the k best of those candidates. Each pass picks "the best after the last
one picked" in the total order k times, so no state but the last pick is kept and the answer is
the total order's whatever the blocks are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROW_BLOCK = 1024  # columns a program reads at a time (the lanes of the float64 sums)
TOPK_BLOCK = 1024  # columns whose k best one program keeps in the first top-k pass
MAX_K = 64  # the most alternatives the kernels keep (the API caps top_logprobs far below)


@triton.jit
def _normalizer(x_row, V, BLOCK: tl.constexpr):
    """A row's max and log(sum exp(x - max)) (float32, the sum in float64 lanes)."""
    mx = tl.full((BLOCK,), float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mx = tl.maximum(mx, tl.load(x_row + cols, mask=cols < V, other=float("-inf")))
    m = tl.max(mx, 0)
    acc = tl.zeros((BLOCK,), dtype=tl.float64)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < V, other=float("-inf"))
        acc += tl.exp(x - m).to(tl.float64)
    lse = tl.log(tl.sum(acc, 0)).to(tl.float32)
    return m, lse


@triton.jit
def _log_softmax(x_ptr, y_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * V
    m, lse = _normalizer(x_ptr + row, V, BLOCK)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row + cols, mask=cols < V, other=0.0)
        tl.store(y_ptr + row + cols, (x - m) - lse, mask=cols < V)


@triton.jit
def _chosen(x_ptr, t_ptr, lp_ptr, rank_ptr, norm_ptr, V, BLOCK: tl.constexpr):
    """Row r's target logprob and rank; its (max, lse) kept for the top-k pass."""
    r = tl.program_id(0).to(tl.int64)
    row = r * V
    m, lse = _normalizer(x_ptr + row, V, BLOCK)
    target = tl.load(t_ptr + r)
    chosen = (tl.load(x_ptr + row + target) - m) - lse
    above = tl.zeros((BLOCK,), dtype=tl.int32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        lp = (tl.load(x_ptr + row + cols, mask=cols < V, other=float("-inf")) - m) - lse
        above += ((lp > chosen) & (cols < V)).to(tl.int32)
    tl.store(lp_ptr + r, chosen)
    tl.store(rank_ptr + r, tl.sum(above.to(tl.int64), 0) + 1)
    tl.store(norm_ptr + 2 * r, m)
    tl.store(norm_ptr + 2 * r + 1, lse)


@triton.jit
def _next_best(vals, ids, ok, prev_v, prev_i, BIG):
    """The best (value, id) after (prev_v, prev_i) in the order value descending, then id
    ascending, among entries `ok`; (-inf, BIG) where none is left."""
    after = ok & ((vals < prev_v) | ((vals == prev_v) & (ids > prev_i)))
    best_v = tl.max(tl.where(after, vals, float("-inf")), 0)
    best_i = tl.min(tl.where(after & (vals == best_v), ids, BIG), 0)
    return best_v, best_i


@triton.jit
def _topk_blocks(
    x_ptr, norm_ptr, cv_ptr, ci_ptr, V, NB, K, SHIFT: tl.constexpr, BLOCK: tl.constexpr
):
    """Pass 1: block b of row r keeps its K best log-probabilities (x - max) - lse (or the
    row's values as they are, without SHIFT) as candidates [r, b, :K]."""
    r = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    cols = b * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    vals = tl.load(x_ptr + r * V + cols, mask=ok, other=float("-inf"))
    if SHIFT:
        vals = (vals - tl.load(norm_ptr + 2 * r)) - tl.load(norm_ptr + 2 * r + 1)
    ids = cols.to(tl.int64)
    big = tl.zeros([], tl.int64) + V + 1  # (V may come as a constexpr: no .to)
    prev_v = tl.full([], float("inf"), tl.float32)
    prev_i = tl.full([], -1, tl.int64)
    out = (r * NB + b) * K
    for j in range(0, K):
        prev_v, prev_i = _next_best(vals, ids, ok, prev_v, prev_i, big)
        tl.store(cv_ptr + out + j, prev_v)
        tl.store(ci_ptr + out + j, prev_i)


@triton.jit
def _topk_merge(cv_ptr, ci_ptr, v_ptr, i_ptr, C, K, V, BLOCK: tl.constexpr):
    """Pass 2: row r's K best of its C candidates, best first."""
    r = tl.program_id(0).to(tl.int64)
    big = tl.zeros([], tl.int64) + V + 1  # (V may come as a constexpr: no .to)
    prev_v = tl.full([], float("inf"), tl.float32)
    prev_i = tl.full([], -1, tl.int64)
    for j in range(0, K):
        best_v = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], -1, tl.int64) + big
        for c0 in range(0, C, BLOCK):
            at = c0 + tl.arange(0, BLOCK)
            ok = at < C
            vals = tl.load(cv_ptr + r * C + at, mask=ok, other=float("-inf"))
            ids = tl.load(ci_ptr + r * C + at, mask=ok, other=0)
            v, i = _next_best(vals, ids, ok & (ids < V), prev_v, prev_i, big)
            better = (v > best_v) | ((v == best_v) & (i < best_i))
            best_v = tl.where(better, v, best_v)
            best_i = tl.where(better, i, best_i)
        tl.store(v_ptr + r * K + j, best_v)
        tl.store(i_ptr + r * K + j, best_i)
        prev_v, prev_i = best_v, best_i


@triton.jit
def _log1p(r):
    """log(1 + r) for r >= 0 to the last bits (Goldberg: log(u) r / (u - 1), u = 1 + r)."""
    u = 1.0 + r
    return tl.where(u == 1.0, r, tl.log(u) * (r / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def _entropy(lp_ptr, h_ptr, V, BLOCK: tl.constexpr):
    """-sum p log p of row r of log-probabilities: log(n + R) - D / (n + R) with d = lp - max,
    n the entries at the max, R and D the sums of exp(d) and exp(d) d over the others (float64;
    log1p(R) when n = 1), as kernels/invariant.cpp's ps_entropy."""
    r = tl.program_id(0).to(tl.int64)
    row = lp_ptr + r * V
    mx = tl.full((BLOCK,), float("-inf"), tl.float32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        mx = tl.maximum(mx, tl.load(row + cols, mask=cols < V, other=float("-inf")))
    m = tl.max(mx, 0).to(tl.float64)
    rest = tl.zeros((BLOCK,), dtype=tl.float64)
    moment = tl.zeros((BLOCK,), dtype=tl.float64)
    n = tl.zeros((BLOCK,), dtype=tl.int32)
    for v0 in range(0, V, BLOCK):
        cols = v0 + tl.arange(0, BLOCK)
        d = tl.load(row + cols, mask=cols < V, other=float("-inf")).to(tl.float64) - m
        at_max = (d == 0.0) & (cols < V)
        e = tl.where(at_max, 0.0, tl.exp(d))
        n += at_max.to(tl.int32)
        rest += e
        moment += e * tl.where(e > 0.0, d, 0.0)  # masked entries: 0, not 0 * -inf
    big_r = tl.sum(rest, 0)
    total = tl.sum(n, 0).to(tl.float64) + big_r
    log_s = tl.where(tl.sum(n, 0) == 1, _log1p(big_r), tl.log(total))
    tl.store(h_ptr + r, (log_s - tl.sum(moment, 0) / total).to(tl.float32))


def _block(v: int) -> int:
    return min(ROW_BLOCK, triton.next_power_of_2(max(v, 1)))


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's log-softmax [M, V] (float32)."""
    x = x.float().contiguous()
    y = torch.empty_like(x)
    if x.shape[0] and x.shape[1]:
        _log_softmax[(x.shape[0],)](x, y, x.shape[1], BLOCK=_block(x.shape[1]))
    return y


def topk(
    x: torch.Tensor, k: int, norm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The k <= MAX_K best (values, ids) of each row, best first, by value then id; with `norm`
    ([M, 2]: each row's max and lse) those of the row's log-softmax, from its logits."""
    x = x.float().contiguous()
    m, v = x.shape
    k = min(k, v)
    if not 0 <= k <= MAX_K:
        raise ValueError(f"top-{k}: the kernels keep at most {MAX_K}")
    vals = torch.empty((m, k), dtype=torch.float32, device=x.device)
    ids = torch.empty((m, k), dtype=torch.int64, device=x.device)
    if m == 0 or k == 0:
        return vals, ids
    block = min(TOPK_BLOCK, triton.next_power_of_2(v))
    nb = triton.cdiv(v, block)
    cand_v = torch.empty((m, nb * k), dtype=torch.float32, device=x.device)
    cand_i = torch.empty((m, nb * k), dtype=torch.int64, device=x.device)
    _topk_blocks[(m, nb)](
        x, norm if norm is not None else x, cand_v, cand_i, v, nb, k,
        SHIFT=norm is not None, BLOCK=block,
    )  # fmt: skip
    c = nb * k
    merge_block = min(1024, triton.next_power_of_2(c))
    _topk_merge[(m,)](cand_v, cand_i, vals, ids, c, k, v, BLOCK=merge_block)
    return vals, ids


def score(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From rows of logits [M, V], without writing their log-softmax: each target's logprob [M],
    its rank [M] and the k best (logprobs, ids) [M, k], the bits `log_softmax` then gather,
    count and `topk` give."""
    x = logits.float().contiguous()
    m, v = x.shape
    t = targets.to(device=x.device, dtype=torch.int64).contiguous()
    if m and not bool(((t >= 0) & (t < v)).all()):  # the kernel reads the row at each target
        raise IndexError("a target id is outside the row")
    lp = torch.empty(m, dtype=torch.float32, device=x.device)
    rank = torch.empty(m, dtype=torch.int64, device=x.device)
    norm = torch.empty((m, 2), dtype=torch.float32, device=x.device)
    if m:
        _chosen[(m,)](x, t, lp, rank, norm, v, BLOCK=_block(v))
    vals, ids = topk(x, k, norm)
    return lp, rank, vals, ids


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """-sum p log p of each row of log-probabilities [M] (masked entries add nothing)."""
    lp = logprobs.float().contiguous()
    h = torch.empty(lp.shape[0], dtype=torch.float32, device=lp.device)
    if lp.shape[0] and lp.shape[1]:
        _entropy[(lp.shape[0],)](lp, h, lp.shape[1], BLOCK=_block(lp.shape[1]))
    return h
