"""The gated delta rule's recurrence on the device (Gated DeltaNet: kernels/delta_rule.py states
the rule): one program per (sequence, value head, block of value columns) holds its slice of the
state [dk, block] in registers and walks the sequence's rows in order, token by token: q and k
normed over dk, the state decayed by exp(g), the delta step, the output read. Each program's
operations depend on its own sequence's rows only, in one order, so a token's output and the
state are the same bits alone, among other sequences, or with its rows split across calls."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from probserve.kernels.delta_rule import L2_EPS

VALUE_BLOCK = 32  # value columns a program holds (the state's [dk, VALUE_BLOCK] slice)


@triton.jit
def _recurrence(
    x_ptr, ba_ptr, o_ptr, s_ptr, rate_ptr, dtb_ptr, start_ptr, end_ptr,
    C, LDBA, KH, VH, DK, DV, root, eps,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h // (VH // KH)
    start = tl.load(start_ptr + seq).to(tl.int64)
    end = tl.load(end_ptr + seq).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    km = kk < DK
    vv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
    vm = vv < DV
    both = km[:, None] & vm[None, :]
    at = ((seq * VH + h) * DK + kk[:, None]).to(tl.int64) * DV + vv[None, :]
    state = tl.load(s_ptr + at, mask=both, other=0.0)
    rate = tl.load(rate_ptr + h)
    dt_bias = tl.load(dtb_ptr + h)
    for i in range(start, end):
        row = x_ptr + i * C
        q = tl.load(row + kh * DK + kk, mask=km, other=0.0)
        k = tl.load(row + KH * DK + kh * DK + kk, mask=km, other=0.0)
        v = tl.load(row + 2 * KH * DK + h * DV + vv, mask=vm, other=0.0)
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + eps)) / root
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + eps))
        b = tl.load(ba_ptr + i * LDBA + h)
        a = tl.load(ba_ptr + i * LDBA + VH + h) + dt_bias
        beta = 1.0 / (1.0 + tl.exp(-b))
        softplus = tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(tl.minimum(a, 20.0))))
        state = state * tl.exp(rate * softplus)
        memory = tl.sum(state * k[:, None], 0)  # S^T k: [BLOCK_V]
        delta = (v - memory) * beta
        state = state + k[:, None] * delta[None, :]
        out = tl.sum(state * q[:, None], 0)
        tl.store(o_ptr + i * VH * DV + h * DV + vv, out, mask=vm)
    tl.store(s_ptr + at, state, mask=both)


def recurrence(
    x: torch.Tensor,
    ba: torch.Tensor,
    states: torch.Tensor,
    rate: torch.Tensor,
    dt_bias: torch.Tensor,
    bounds: torch.Tensor,
    heads: tuple[int, int, int, int],
    out: torch.Tensor,
) -> None:
    """Sequence j's rows [bounds[0, j], bounds[1, j]) of x [T, 2 kh dk + vh dv] (q, k, v after
    the conv and its SiLU) and ba [T, 2 vh] (b, then a, a row `ba.stride(0)` apart) from its
    state states[j] [vh, dk, dv] (left past its last row): their outputs into out [T, vh dv].
    `heads` is (kh, vh, dk, dv); rate = -exp(A_log) and dt_bias are [vh]."""
    kh, vh, dk, dv = heads
    if bounds.shape[1] == 0:
        return
    grid = (bounds.shape[1], vh, triton.cdiv(dv, VALUE_BLOCK))
    _recurrence[grid](
        x, ba, out, states, rate, dt_bias, bounds[0], bounds[1],
        x.shape[1], ba.stride(0), kh, vh, dk, dv, float(dk) ** 0.5, L2_EPS,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=VALUE_BLOCK,
    )  # fmt: skip
