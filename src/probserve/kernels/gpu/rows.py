"""Per-row and per-element kernels: RMSNorm (a row's sum of squares in a fixed block order),
the gated activations (SwiGLU, GeGLU with tanh), tanh soft-capping, and RoPE fused with the
paged cache write (neox halves: x * cos + rotate_half(x) * sin)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NORM_BLOCK = 1024
ELEMENT_BLOCK = 1024


@triton.jit
def _tanh(x):
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _rms_norm(x_ptr, w_ptr, y_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for h0 in range(0, H, BLOCK):
        cols = h0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row + cols, mask=cols < H, other=0.0)
        acc += x * x
    rstd = 1.0 / tl.sqrt(tl.sum(acc, 0) / H + eps)
    for h0 in range(0, H, BLOCK):
        cols = h0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + row + cols, mask=cols < H, other=0.0)
        w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
        tl.store(y_ptr + row + cols, x * rstd * w, mask=cols < H)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] float32 normed by its root mean square, times weight [H]."""
    h = x.shape[-1]
    x = x.contiguous()
    y = torch.empty_like(x)
    rows = x.numel() // h if h else 0
    if rows:
        block = min(NORM_BLOCK, triton.next_power_of_2(h))
        _rms_norm[(rows,)](x, weight, y, h, eps, BLOCK=block)
    return y


@triton.jit
def _glu(x_ptr, y_ptr, WIDTH, GELU: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < WIDTH
    gate = tl.load(x_ptr + row * 2 * WIDTH + cols, mask=m, other=0.0)
    up = tl.load(x_ptr + row * 2 * WIDTH + WIDTH + cols, mask=m, other=0.0)
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (1.0 + _tanh(inner))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    tl.store(y_ptr + row * WIDTH + cols, act * up, mask=m)


def gated(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """Rows [gate | up] of 2I: silu(gate) * up, or gelu_tanh(gate) * up (rows of I)."""
    x = gate_up.contiguous()
    rows, width = x.shape
    i = width // 2
    y = torch.empty((rows, i), dtype=torch.float32, device=x.device)
    if rows and i:
        _glu[(rows, triton.cdiv(i, ELEMENT_BLOCK))](x, y, i, GELU=gelu, BLOCK=ELEMENT_BLOCK)
    return y


@triton.jit
def _softcap(x_ptr, y_ptr, n, cap, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(y_ptr + offs, _tanh(x / cap) * cap, mask=offs < n)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """tanh(x / cap) * cap per element (a new tensor)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        _softcap[(triton.cdiv(x.numel(), ELEMENT_BLOCK),)](x, y, x.numel(), cap,
                                                           BLOCK=ELEMENT_BLOCK)  # fmt: skip
    return y


@triton.jit
def _rope_cache(
    qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, NQ, NKV, D,
    HALF: tl.constexpr, HEADS: tl.constexpr,
):  # fmt: skip
    # token t's heads HEADS at a time (rows of a [HEADS, HALF] block): queries rotated into q,
    # keys rotated into the cache, values copied there, each head's row by the same operations
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]
    half = D // 2
    i = tl.arange(0, HALF)[None, :]
    m = (i < half) & (h < NQ + 2 * NKV)
    src = qkv_ptr + t * (NQ + 2 * NKV) * D + h * D
    x1 = tl.load(src + i, mask=m, other=0.0)
    x2 = tl.load(src + half + i, mask=m, other=0.0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c1 = tl.load(cos_ptr + pos * D + i, mask=i < half, other=0.0)
    c2 = tl.load(cos_ptr + pos * D + half + i, mask=i < half, other=0.0)
    s1 = tl.load(sin_ptr + pos * D + i, mask=i < half, other=0.0)
    s2 = tl.load(sin_ptr + pos * D + half + i, mask=i < half, other=0.0)
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
    is_q = m & (h < NQ)
    tl.store(q_ptr + (t * NQ + h) * D + i, y1, mask=is_q)
    tl.store(q_ptr + (t * NQ + h) * D + half + i, y2, mask=is_q)
    is_k = m & (h >= NQ) & (h < NQ + NKV)
    kh = tl.where(is_k, h - NQ, 0)
    tl.store(k_ptr + (slot * NKV + kh) * D + i, y1, mask=is_k)
    tl.store(k_ptr + (slot * NKV + kh) * D + half + i, y2, mask=is_k)
    is_v = m & (h >= NQ + NKV)
    vh = tl.where(is_v, h - NQ - NKV, 0)
    tl.store(v_ptr + (slot * NKV + vh) * D + i, x1, mask=is_v)
    tl.store(v_ptr + (slot * NKV + vh) * D + half + i, x2, mask=is_v)


ROPE_HEADS = 16  # heads a program (a token's, in blocks)


def rope_cache(
    qkv: torch.Tensor,
    heads: tuple[int, int, int],
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> torch.Tensor:
    """RoPE of qkv [T, (nq + 2 nkv) d]'s queries and keys at `positions` (rows of the cos and
    sin tables [P, d]), the keys and values written at cache `slots` (k_cache, v_cache
    [slots, nkv, d], in place). Returns the rotated queries [T, nq, d]."""
    nq, nkv, d = heads
    qkv = qkv.contiguous()
    t = qkv.shape[0]
    q = torch.empty((t, nq, d), dtype=torch.float32, device=qkv.device)
    if t:
        half = triton.next_power_of_2(d // 2)
        heads = min(ROPE_HEADS, triton.next_power_of_2(nq + 2 * nkv))
        _rope_cache[(t, triton.cdiv(nq + 2 * nkv, heads))](
            qkv, cos, sin, positions, slots, q, k_cache, v_cache, nq, nkv, d, HALF=half,
            HEADS=heads,
        )  # fmt: skip
    return q
