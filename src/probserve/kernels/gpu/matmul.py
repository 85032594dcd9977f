"""Row-invariant matrix products: y = x @ w.T (+ bias) with fixed tiles and no split-K, so each
output row is the same bits whatever the number of rows (a row's tile runs the same loop over K
in the same order, beside whichever rows share it). `exact`: float32 weights and activations,
IEEE float32 products (no TF32); else bfloat16 inputs with float32 accumulation."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N = 32, 64
BLOCK_K = {torch.float32: 32, torch.bfloat16: 64}


def interpreted() -> bool:
    """Whether the kernels run under Triton's interpreter (TRITON_INTERPRET=1: CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def tile_dot(a, b, acc, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """acc + a @ b, a rounded to b's dtype (float32: IEEE products; bf16 inputs with float32
    sums). INTERPRETED: the interpreter's tl.dot is numpy's BLAS, whose bits for a row depend
    on where the row sits in the tile (OpenBLAS's Haswell kernel, which AMD EPYCs run, rounds
    rows 6-11 of each 12 unlike rows 0-5), and it multiplies bf16 wrongly; so there each
    product is rounded to float32 and a row's products are summed over k by one elementwise
    reduction, the same for every row."""
    if INTERPRETED:
        a32, b32 = a.to(b.dtype).to(tl.float32), b.to(tl.float32)
        acc = acc + tl.sum(a32[:, :, None] * b32[None, :, :], 1)
    else:
        acc = tl.dot(a.to(b.dtype), b, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _matmul(
    x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
    sxm, sxk, swn, swk, sym, syn,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(
            x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
            mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0,
        )  # fmt: skip
        b = tl.load(
            w_ptr + rn[None, :] * swn + kk[:, None] * swk,
            mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0,
        )  # fmt: skip
        acc = tile_dot(a, b, acc, PRECISION, INTERPRETED)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(
        y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc,
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )  # fmt: skip


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (float32) times w [N, K] (float32: the exact product; bfloat16: bf16 inputs)
    plus bias [N] (float32): [M, N] float32."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return y
    precision = "ieee" if w.dtype == torch.float32 else "tf32"  # tf32: unused for bf16 inputs
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul[grid](
        x, w, bias if bias is not None else y, y, m, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, PRECISION=precision,
        INTERPRETED=interpreted(),
        BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K[w.dtype],
    )  # fmt: skip
    return y
