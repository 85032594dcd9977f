"""A mixture of experts' feed-forward as the host's backends run it (the row-invariant kernels',
torch's): each expert once, on the tokens routed to it, in ascending id, and each token's sum
over its experts in that order (transformers' eager order). With the row-invariant products a
token's output is the same bits whether its expert sees it alone or with 200 others. The
row-invariant kernels run this loop in one native call (kernels/native_experts.py: the same
bits); the GPU path stacks its experts instead (kernels/gpu/experts.py)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from probserve.kernels.weights import Packed

Activation = Callable[[torch.Tensor], torch.Tensor]  # rows [gate | up] -> the gated rows


class Projection(Protocol):
    """A linear layer as the forward holds it (models/linear.py): called on rows, and its
    weights as packed (one, or several whose outputs sit side by side)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...

    @property
    def weights(self) -> list[Packed]: ...


class Expert(NamedTuple):
    """One expert's SwiGLU: rows [gate | up] of 2I, then down."""

    gate_up: Projection
    down: Projection


@dataclass(frozen=True)
class EachExpert:
    """A layer's experts, each run on its own tokens."""

    experts: Sequence[Expert]

    def __call__(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, act: Activation
    ) -> torch.Tensor:
        """Rows x [T, H] routed to experts ids [T, k] with weights [T, k]: sum over each
        token's experts e of w_e * down_e(act(gate_up_e(x)))."""
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():  # ascending
            rows, slot = torch.nonzero(ids == e, as_tuple=True)
            expert = self.experts[e]
            y = expert.down(act(expert.gate_up(x[rows])))
            out.index_add_(0, rows, y * weights[rows, slot].unsqueeze(1))
        return out
