"""RowMath: the reductions over a vocabulary row behind every logprob (log_softmax, top-k,
entropy), in torch's kernels or in the row-invariant ones.

torch splits a reduction over 49,152 entries across threads differently for one row than for
many, so its results for a row can move in the last bits with the batch; `InvariantRowMath`
computes each row alone in one fixed order (kernels/invariant.cpp) and orders top-k by value
then id, so ties come out the same way in every batch. The runner says which one its engine
uses (`Runner.row_math`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from probserve.kernels.invariant import InvariantKernels


class RowMath(Protocol):
    def log_softmax(self, x: torch.Tensor) -> torch.Tensor: ...

    def topk(self, logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best (values, ids) of each row, best first."""
        ...

    def entropy(self, logprobs: torch.Tensor) -> torch.Tensor:
        """-sum p log p of each row of log-probabilities (masked tokens add nothing)."""
        ...


class TorchRowMath:
    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, dim=-1)

    def topk(self, logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        top = torch.topk(logprobs, min(k, logprobs.shape[1]), dim=1)
        return top.values, top.indices

    def entropy(self, logprobs: torch.Tensor) -> torch.Tensor:
        return torch.special.entr(logprobs.exp()).sum(dim=1)


class InvariantRowMath:
    def __init__(self, kernels: InvariantKernels) -> None:
        self.kernels = kernels

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.log_softmax(x)

    def topk(self, logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.topk(logprobs, k)

    def entropy(self, logprobs: torch.Tensor) -> torch.Tensor:
        return self.kernels.entropy(logprobs)
