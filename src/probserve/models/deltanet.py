"""Gated DeltaNet: Qwen3.5's linear-attention layer, and the recurrent state each sequence
carries through it (its conv state and its delta-rule state, one of each per such layer).

The layer: one projection of the normed rows into [q | k | v] (the conv's channels), z, b and
a; a causal depthwise conv1d (kernel K, no bias) over each sequence's channels, then SiLU; q
and k l2-normed (x * rsqrt(sum x^2 + 1e-6)), q scaled by dk^-0.5; per value head beta =
sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); per token, in float32,
    S <- S * exp(g);  S <- S + k (outer) ((v - S^T k) * beta);  o = S^T q
(value head h reads key head h // (nv / nk)); the output w * rms(o) * silu(z) (a plain w), and
out_proj.

One order for every path: the conv and the recurrence run in kernels/deltanet.cpp on the host's
kernels (kernels/delta_rule.py: the same rule in torch for the backends without them), token by
token, each token's step the same operations whether its token came in a whole prompt, a chunk
of one, a decode step or a batch of other sequences; the norms run on the backend's
row-invariant operations. So a position's numbers, and the state a sequence carries past it,
are the same bits however its prompt was chunked or batched. transformers' prefill uses a
chunked (64-token) form of the same recurrence, its decode this one: the two agree to float32
rounding, not bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from probserve.kernels.delta_rule import DeltaLayer, DeltaSpan
from probserve.kernels.layer_ops import LayerOps
from probserve.models.linear import Joined, Linear


@dataclass(frozen=True)
class StateShape:
    """The sizes of a hybrid model's recurrent state: its linear layers, the conv's channels
    and kernel, the key and value heads and their dimensions."""

    layers: int
    channels: int
    kernel: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int

    @staticmethod
    def of(config: Any, linear: Sequence[bool]) -> StateShape:
        nk, nv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
        dk, dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
        return StateShape(
            layers=sum(linear), channels=2 * nk * dk + nv * dv,
            kernel=int(config.linear_conv_kernel_dim), k_heads=nk, v_heads=nv, k_dim=dk, v_dim=dv,
        )  # fmt: skip

    @property
    def bytes(self) -> int:
        """A sequence's state, float32: conv (K - 1 columns) and delta rule, every layer."""
        per_layer = self.channels * (self.kernel - 1) + self.v_heads * self.k_dim * self.v_dim
        return 4 * self.layers * per_layer


@dataclass
class RecurrentState:
    """One sequence's state past its last computed token: conv [layers, K - 1, C] (the last
    K - 1 inputs of the conv, oldest first) and delta [layers, nv, dk, dv]. Zeros before its
    first token.

    A step may save the state past some of its rows (`saving`, then the forward fills saved_conv
    (n tensors [layers, K - 1, C]) and saved_delta (n [layers, nv, dk, dv]) in the order of its
    span's `saves`): the runner keeps those past a block's last token as the prefix cache's
    snapshots, and those past a verify step's last real token and each proposal (`kept`, by
    position): each saved state a tensor of its own, so what is kept is that tensor itself (no
    copy beside it), and what is not is freed with the step. The next chunk's first position
    says how many proposals were accepted, and `settle` puts back the state past the last of
    them (a rejected proposal's update undone, the same bits as never having run it). Saved and
    kept states are only read after the step that wrote them (`restore` copies from them)."""

    conv: torch.Tensor
    delta: torch.Tensor
    saved_conv: list[torch.Tensor] | None = None
    saved_delta: list[torch.Tensor] | None = None
    kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @staticmethod
    def zeros(shape: StateShape, device: torch.device | None = None) -> RecurrentState:
        conv = (shape.layers, shape.kernel - 1, shape.channels)
        delta = (shape.layers, shape.v_heads, shape.k_dim, shape.v_dim)
        return RecurrentState(torch.zeros(conv, device=device), torch.zeros(delta, device=device))

    @property
    def nbytes(self) -> int:
        """What it holds now (the states it saved and kept included)."""
        held = [self.conv, self.delta, *(self.saved_conv or ()), *(self.saved_delta or ())]
        return sum(t.numel() * t.element_size() for t in held)

    def saving(self, rows: int) -> None:
        """Room for the state past `rows` of the step's rows (none: nothing saved)."""
        self.saved_conv = [self.conv.new_empty(self.conv.shape) for _ in range(rows)] or None
        self.saved_delta = [self.delta.new_empty(self.delta.shape) for _ in range(rows)] or None

    def restore(self, conv: torch.Tensor, delta: torch.Tensor) -> None:
        self.conv.copy_(conv)
        self.delta.copy_(delta)

    def settle(self, start: int) -> None:
        """A chunk starts at `start`: the state past position start - 1, from the kept ones
        where the last step kept some (its proposals up to there accepted)."""
        if not self.kept:
            return
        kept = self.kept.get(start - 1)
        if kept is None:
            raise RuntimeError(f"no kept recurrent state for position {start - 1}")
        self.restore(*kept)
        self.kept = {}


@dataclass(frozen=True)
class Span:
    """A sequence's rows [start, end) of the step, continuing from `state` (updated in place);
    the state past each of its rows `saves` (relative to start, increasing) saved into the
    state's saved_conv and saved_delta, in that order."""

    start: int
    end: int
    state: RecurrentState
    saves: tuple[int, ...] = ()


def sigmoid_rows(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) [T, n] whose row's bits are its own alone: on the host, one call a row (torch's
    vectorized and scalar loops round a transcendental differently, and which one an element
    meets depends on its place in the tensor); on a device, one call (per element alike)."""
    if x.device.type != "cpu" or x.shape[0] <= 1:
        return torch.sigmoid(x)
    return torch.stack([torch.sigmoid(row) for row in x])


class GatedDeltaNet:
    def __init__(
        self,
        index: int,
        shape: StateShape,
        proj: Linear | Joined,
        out: Callable[[torch.Tensor], torch.Tensor],
        conv: torch.Tensor,
        a_log: torch.Tensor,
        dt_bias: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        ops: LayerOps,
    ) -> None:
        """Linear layer `index` (its place among the linear layers: its state's): `proj` the
        rows [q k v | z | b | a], `conv` [C, K] (or [C, 1, K]), the decay's A_log and dt_bias
        [nv], the gated norm's weight [dv]."""
        self.index, self.shape, self.proj, self.out, self.eps, self.ops = (
            index, shape, proj, out, eps, ops,
        )  # fmt: skip
        taps = conv.detach().float().reshape(shape.channels, shape.kernel).T.contiguous()
        self.rule = DeltaLayer(
            conv=ops.place(taps), rate=ops.place(-torch.exp(a_log.detach().float())),
            dt_bias=ops.place(dt_bias.detach().float().contiguous()), k_heads=shape.k_heads,
            v_heads=shape.v_heads, k_dim=shape.k_dim, v_dim=shape.v_dim,
        )  # fmt: skip
        self.norm = ops.place(norm.detach().float().clone())

    def __call__(self, x: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
        """The layer's output for the step's normed rows x [T, H], each span continuing its
        sequence's state (which it leaves past its last row)."""
        s = self.shape
        t, c, vd = x.shape[0], s.channels, s.v_heads * s.v_dim
        p = self.proj(x)
        o = self.ops.gated_delta(p, self.rule, [self._span(span) for span in spans])
        normed = self.ops.rms_norm(o.reshape(t * s.v_heads, s.v_dim), self.norm, self.eps)
        z = p[:, c : c + vd].reshape(t * s.v_heads, s.v_dim)
        gated = self.ops.silu_mul(torch.cat([z, normed], dim=1).contiguous())
        return self.out(gated.reshape(t, vd))

    def _span(self, span: Span) -> DeltaSpan:
        """A sequence's rows with this layer's state, and where the states past its saves go."""
        state, i = span.state, self.index
        saves: tuple[tuple[int, torch.Tensor, torch.Tensor], ...] = ()
        if span.saves:
            assert state.saved_conv is not None and state.saved_delta is not None
            saves = tuple(
                (row, state.saved_conv[j][i], state.saved_delta[j][i])
                for j, row in enumerate(span.saves)
            )
        return DeltaSpan(span.start, span.end, state.conv[i], state.delta[i], saves)
