"""A mixture of experts' feed-forward on the GPU in a few launches and no wait on the host:
every (token, expert) pair's products in one grouped product per matrix, then each token's
weighted sum over its experts.

The pairs are laid out by expert on the device (a stable sort, counts by scatter-add, each
expert's rows padded to whole tiles of TILE_M): a tile holds one expert's pairs, and the
grid is sized from the number of pairs alone (every expert at most one partial tile), so the
launch needs nothing read back and a CUDA graph can hold it. Each pair's row is computed as
the dense products compute a row (matmul.py: fixed tiles, no split-K, the same loop over K),
so its bits do not depend on which pairs share its tile; a token's sum runs over its experts
in ascending id (transformers' eager order, as models/moe.py sums them on the host).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from probserve.kernels.gpu.matmul import BLOCK_K, interpreted, tile_dot

TILE_M, TILE_N = 16, 64
SUM_BLOCK = 1024


@triton.jit
def _grouped(
    x_ptr, w_ptr, b_ptr, y_ptr, pair_ptr, tile_expert_ptr, N, K, E, DIV,
    sxm, swe, swn, swk,
    HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    """Tile t: y[pair] = x[pair // DIV] @ w[e].T (+ b[e]) for the pairs of expert e in it."""
    t = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    tile_e = tl.load(tile_expert_ptr + t)
    if tile_e >= E:  # a tile past the last used expert: nothing to compute
        return
    e = tl.minimum(tile_e, E - 1).to(tl.int64)
    # (whether the tile is used, as blocks: the interpreter's masks take no scalar)
    live = (tl.zeros((BN,), tl.int64) + tile_e) < E
    pairs = tl.load(pair_ptr + t * BM + tl.arange(0, BM))
    rows = (pairs >= 0) & ((tl.zeros((BM,), tl.int64) + tile_e) < E)
    src = tl.where(rows, pairs // DIV, 0)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(
            x_ptr + src[:, None] * sxm + kk[None, :],
            mask=rows[:, None] & (kk[None, :] < K), other=0.0,
        )  # fmt: skip
        b = tl.load(
            w_ptr + e * swe + rn[None, :] * swn + kk[:, None] * swk,
            mask=live[None, :] & (rn[None, :] < N) & (kk[:, None] < K), other=0.0,
        )  # fmt: skip
        acc = tile_dot(a, b, acc, PRECISION, INTERPRETED)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * N + rn, mask=live & (rn < N), other=0.0)[None, :]
    out = tl.where(rows, pairs, 0).to(tl.int64)
    tl.store(y_ptr + out[:, None] * N + rn[None, :], acc, mask=rows[:, None] & (rn[None, :] < N))


@triton.jit
def _weighted_sum(y_ptr, w_ptr, order_ptr, out_ptr, H, KS, BLOCK: tl.constexpr):
    """out[t] = sum over token t's experts, in ascending id, of weight * its pair's row."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < H
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(0, KS):
        s = tl.load(order_ptr + t * KS + j)
        w = tl.load(w_ptr + t * KS + s)
        acc += tl.load(y_ptr + (t * KS + s) * H + cols, mask=m, other=0.0) * w
    tl.store(out_ptr + t * H + cols, acc, mask=m)


def layout(ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs of ids [T, k] (pair p = t * k + j) by expert, in tiles of TILE_M: (pair of
    each tile row [tiles * TILE_M], -1 for padding; expert of each tile [tiles], `experts`
    past the last used), all on the device; tiles = cdiv(P, TILE_M) + min(E, P)."""
    flat = ids.reshape(-1).to(torch.int64)
    p = flat.numel()
    dev = flat.device
    order = torch.sort(flat, stable=True).indices
    counts = torch.zeros(experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + TILE_M - 1) // TILE_M * TILE_M
    pad_end = torch.cumsum(padded, 0)
    first = torch.cumsum(counts, 0) - counts
    by_expert = flat[order]
    dest = (pad_end - padded)[by_expert] + torch.arange(p, device=dev) - first[by_expert]
    tiles = triton.cdiv(p, TILE_M) + min(experts, p)
    pair = torch.full((tiles * TILE_M,), -1, dtype=torch.int64, device=dev)
    pair[dest] = order
    starts = torch.arange(tiles, device=dev) * TILE_M
    tile_expert = torch.searchsorted(pad_end, starts, right=True)
    return pair, tile_expert


def grouped_product(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    pair: torch.Tensor,
    tile_expert: torch.Tensor,
    pairs: int,
    div: int,
) -> torch.Tensor:
    """y [pairs, N]: row p is x[p // div] @ w[e].T (+ bias[e]), e the expert of p's tile; w
    [E, N, K] (float32: IEEE products; bfloat16: bf16 inputs, float32 sums)."""
    e, n, k = w.shape
    y = torch.empty((pairs, n), dtype=torch.float32, device=x.device)
    if pairs == 0:
        return y
    x = x.contiguous()
    grid = (tile_expert.numel(), triton.cdiv(n, TILE_N))
    _grouped[grid](
        x, w, bias if bias is not None else y, y, pair, tile_expert, n, k, e, div,
        x.stride(0), w.stride(0), w.stride(1), w.stride(2),
        HAS_BIAS=bias is not None,
        PRECISION="ieee" if w.dtype == torch.float32 else "tf32",
        INTERPRETED=interpreted(),
        BM=TILE_M, BN=TILE_N, BK=BLOCK_K[w.dtype],
    )  # fmt: skip
    return y


# one expert's (gate_up [2I, H], its bias or None, down [H, I], its bias or None)
ExpertParts = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class GroupedExperts:
    """A layer's experts stacked on the device: gate_up [E, 2I, H] and down [E, H, I] in the
    precision's dtype, their float32 biases [E, 2I] and [E, H] (gpt-oss) or None."""

    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None

    @staticmethod
    def stack(
        experts: Iterable[
            tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]
        ],
        count: int,
    ) -> GroupedExperts:
        """From each expert's (gate_up, bias, down, bias) on the device, one at a time: each
        copied into the stacks as it comes (the layer's experts are never held twice)."""
        stacks: list[torch.Tensor | None] = [None] * 4
        for e, parts in enumerate(experts):
            for i, part in enumerate(parts):
                if e > 0 and (part is None) != (stacks[i] is None):
                    raise ValueError(f"expert {e}: a bias where others have none, or none")
                if part is None:
                    continue
                if stacks[i] is None:
                    shape = (count, *part.shape)
                    stacks[i] = torch.empty(shape, dtype=part.dtype, device=part.device)
                stacks[i][e].copy_(part)  # type: ignore[index]
            del parts  # (this expert's device copies freed before the next is packed)
        gate_up, gu_bias, down, down_bias = stacks
        assert gate_up is not None and down is not None
        return GroupedExperts(gate_up, gu_bias, down, down_bias)

    def __call__(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        act: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The layer's output for rows x [T, H] routed to experts ids [T, k] with weights
        [T, k]: sum over each token's experts of weight * down(act(gate_up(x)))."""
        t, k = ids.shape
        pair, tile_expert = layout(ids, self.gate_up.shape[0])
        gu = grouped_product(x, self.gate_up, self.gate_up_bias, pair, tile_expert, t * k, k)
        y = grouped_product(act(gu), self.down, self.down_bias, pair, tile_expert, t * k, 1)
        h = x.shape[1]
        out = torch.empty((t, h), dtype=torch.float32, device=x.device)
        if t:
            order = torch.sort(ids, dim=1, stable=True).indices.contiguous()
            w = weights.float().contiguous()
            _weighted_sum[(t, triton.cdiv(h, SUM_BLOCK))](y, w, order, out, h, k, BLOCK=SUM_BLOCK)
        return out
