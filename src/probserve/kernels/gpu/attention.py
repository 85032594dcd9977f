"""Paged attention with a fixed reduction order: each (token, head) reads its sequence's keys
through the block table from position 0 (or the window's start) in blocks of KEYS positions
at absolute boundaries, with an online softmax; so a token's output is the same bits whatever
else is in the batch and however its prompt was chunked. Soft-capped scores (Gemma 2) and
attention sinks (gpt-oss: one more logit per head, attending to nothing) included."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KEYS = 32  # positions per step of the reduction


@triton.jit
def _attention(
    q_ptr, k_ptr, v_ptr, o_ptr, tab_ptr, seq_ptr, len_ptr, sink_ptr,
    NQ, NKV, D, WIDTH, BS, scale, window, cap,
    HAS_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kvh = h // (NQ // NKV)
    length = tl.load(len_ptr + t)
    s = tl.load(seq_ptr + t)
    lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(q_ptr + (t * NQ + h) * D + d, mask=dm, other=0.0)
    m_i = tl.zeros((1,), dtype=tl.float32) - float("inf")
    l_i = tl.zeros((1,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    start = (lo // BLOCK_N) * BLOCK_N
    for j0 in range(start, length, BLOCK_N):
        pos = j0 + tl.arange(0, BLOCK_N)
        valid = (pos < length) & (pos >= lo)
        blk = tl.load(tab_ptr + s * WIDTH + pos // BS, mask=valid, other=0)
        at = ((blk * BS + pos % BS) * NKV + kvh) * D
        both = valid[:, None] & dm[None, :]
        k = tl.load(k_ptr + at[:, None] + d[None, :], mask=both, other=0.0)
        scores = tl.sum(k * q[None, :], 1) * scale
        if HAS_CAP:
            scores = (2.0 / (1.0 + tl.exp(-2.0 * scores / cap)) - 1.0) * cap
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + at[:, None] + d[None, :], mask=both, other=0.0)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    if HAS_SINKS:
        sink = tl.load(sink_ptr + h)
        m_f = tl.maximum(m_i, sink)
        alpha = tl.exp(m_i - m_f)
        l_i = l_i * alpha + tl.exp(sink - m_f)
        acc = acc * alpha
    tl.store(o_ptr + (t * NQ + h) * D + d, acc / l_i, mask=dm)


def attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    tables: torch.Tensor,
    seq: torch.Tensor,
    lengths: torch.Tensor,
    block_size: int,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, nq, d] over a paged cache [slots, nkv, d]: token t attends to
    the first lengths[t] positions of the sequence whose block table is tables[seq[t]] (with a
    sliding `window`, the last `window` of them). Returns [T, nq * d]."""
    t, nq, d = q.shape
    nkv = k_cache.shape[1]
    out = torch.empty((t, nq * d), dtype=torch.float32, device=q.device)
    if t == 0:
        return out
    q = q.contiguous()
    _attention[(t, nq)](
        q, k_cache, v_cache, out, tables, seq, lengths,
        sinks if sinks is not None else out,
        nq, nkv, d, tables.shape[1], block_size, float(scale), int(window or 0),
        float(softcap or 1.0),
        HAS_CAP=bool(softcap), HAS_SINKS=sinks is not None,
        BLOCK_N=KEYS, BLOCK_D=triton.next_power_of_2(d),
    )  # fmt: skip
    return out
