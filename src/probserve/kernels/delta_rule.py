"""The gated delta rule as the backends run it: Gated DeltaNet's causal conv1d + SiLU and its
recurrence over a step's projected rows (models/deltanet.py holds the layer and the states), in
one fixed order of operations per token and head on every path. `DeltaLayer` is a layer's
weights, `DeltaSpan` a sequence's rows with its state; the host's kernels run them in C++
(kernels/deltanet.cpp, `InvariantKernels.gated_delta`); `torch_gated_delta` is the same rule in
torch, token by token, for the backends without that library (torch's own operations, where the
C++ kernels do not build); the GPU path runs the conv in torch (`conv_rows`) and the recurrence in
Triton (kernels/gpu/delta.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

L2_EPS = 1e-6  # the l2 norm's of q and k (transformers' and FLA's)


@dataclass(frozen=True)
class DeltaLayer:
    """A Gated DeltaNet layer's weights as the rule reads them: the conv's [K, C] (tap-major),
    rate = -exp(A_log) and dt_bias [nv]; its key and value heads and their dimensions."""

    conv: torch.Tensor
    rate: torch.Tensor
    dt_bias: torch.Tensor
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int

    @property
    def channels(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @property
    def kernel(self) -> int:
        return int(self.conv.shape[0])


@dataclass(frozen=True)
class DeltaSpan:
    """A sequence's rows [start, end) of the step, continuing from its conv state [K - 1, C]
    (the last K - 1 inputs, oldest first) and delta state [nv, dk, dv], both updated in place;
    `saves`: (row relative to start, increasing; the conv and delta states' copies past it)."""

    start: int
    end: int
    conv: torch.Tensor
    delta: torch.Tensor
    saves: tuple[tuple[int, torch.Tensor, torch.Tensor], ...] = ()


def torch_gated_delta(
    silu: Callable[[torch.Tensor], torch.Tensor],
    proj: torch.Tensor,
    layer: DeltaLayer,
    spans: Sequence[DeltaSpan],
) -> torch.Tensor:
    """The rule on torch's operations: proj [T, C + nv dv + 2 nv] the rows [q k v | z | b | a]
    -> o [T, nv dv]; `silu` the backend's row-invariant SiLU. The conv per span (a fixed sum over
    its taps), the recurrence per token, each token's step the same operations on tensors of the
    same shapes wherever its row came from."""
    c, vd = layer.channels, layer.v_heads * layer.v_dim
    conv = silu(conv_rows(proj, layer, spans))
    b, a = proj[:, c + vd : c + vd + layer.v_heads], proj[:, c + vd + layer.v_heads :]
    out = proj.new_empty((proj.shape[0], vd))
    for span in spans:
        rows = slice(span.start, span.end)
        out[rows] = _recurrence(conv[rows], b[rows], a[rows], layer, span)
    return out


def conv_rows(proj: torch.Tensor, layer: DeltaLayer, spans: Sequence[DeltaSpan]) -> torch.Tensor:
    """The causal conv of every span's rows of proj's first C columns (before the SiLU):
    [T, C]; each span's conv state left past its last row (and copied past each save's)."""
    c = layer.channels
    conv = proj.new_empty((proj.shape[0], c))
    for span in spans:
        conv[span.start : span.end] = _conv(proj[span.start : span.end, :c], layer, span)
    return conv


def _conv(mixed: torch.Tensor, layer: DeltaLayer, span: DeltaSpan) -> torch.Tensor:
    """The causal conv of a sequence's rows [n, C] after the K - 1 inputs its state keeps (left
    there updated; past each save's row copied too): sum over taps k of
    w[k] * input[t - (K - 1) + k], in k order."""
    n, k = mixed.shape[0], layer.kernel
    rows = torch.cat([span.conv, mixed], dim=0)  # [K - 1 + n, C]
    acc = rows[0:n] * layer.conv[0]
    for tap in range(1, k):
        acc = acc + rows[tap : tap + n] * layer.conv[tap]
    for row, conv, _ in span.saves:  # the inputs up to row `row`
        conv.copy_(rows[row + 1 : row + k])
    span.conv.copy_(rows[n:])
    return acc


def _recurrence(
    conv: torch.Tensor, b: torch.Tensor, a: torch.Tensor, layer: DeltaLayer, span: DeltaSpan
) -> torch.Tensor:
    """The gated delta rule over a sequence's rows (conv's [q k v] after SiLU, b, a), token by
    token from its state (left past the last; past each save's row copied too): [n, nv dv]."""
    kd = layer.k_heads * layer.k_dim
    group = layer.v_heads // layer.k_heads
    root = layer.k_dim**0.5
    big_s = span.delta
    out = conv.new_empty((conv.shape[0], layer.v_heads * layer.v_dim))
    saved = {row: delta for row, _, delta in span.saves}
    for i in range(conv.shape[0]):
        q = conv[i, :kd].reshape(layer.k_heads, layer.k_dim)
        k = conv[i, kd : 2 * kd].reshape(layer.k_heads, layer.k_dim)
        v = conv[i, 2 * kd :].reshape(layer.v_heads, layer.v_dim)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
        q = (q / root).repeat_interleave(group, 0)  # [nv, dk]
        k = k.repeat_interleave(group, 0)
        beta = torch.sigmoid(b[i])
        g = layer.rate * F.softplus(a[i] + layer.dt_bias)
        big_s.mul_(torch.exp(g)[:, None, None])
        memory = (big_s * k[:, :, None]).sum(1)  # S^T k: [nv, dv]
        delta = (v - memory) * beta[:, None]
        big_s.add_(k[:, :, None] * delta[:, None, :])
        out[i] = (big_s * q[:, :, None]).sum(1).reshape(-1)
        if i in saved:
            saved[i].copy_(big_s)
    return out
