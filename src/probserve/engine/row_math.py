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

from probserve.kernels.invariant import SCORE_MAX_K, InvariantKernels

Scores = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class RowMath(Protocol):
    def log_softmax(self, x: torch.Tensor) -> torch.Tensor: ...

    def score(self, logits: torch.Tensor, targets: torch.Tensor, k: int) -> Scores:
        """From rows of logits: each target's logprob [n], its rank (1 + the entries above it)
        [n] and the k best (logprobs, ids) [n, k], as `log_softmax` then gather, count and
        `topk` give them."""
        ...

    def topk(self, logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k best (values, ids) of each row, best first."""
        ...

    def entropy(self, logprobs: torch.Tensor) -> torch.Tensor:
        """-sum p log p of each row of log-probabilities (masked tokens add nothing)."""
        ...


def score_from_log_softmax(
    math: RowMath, logits: torch.Tensor, targets: torch.Tensor, k: int
) -> Scores:
    """`RowMath.score` the long way: the log-softmax written out, then gather, count, top-k
    (torch's path, top-k past the fused kernel's limit, and the kernel's test reference)."""
    lp = math.log_softmax(logits)
    chosen = lp.gather(1, targets.view(-1, 1))  # [n, 1]
    ranks = (lp > chosen).sum(dim=1) + 1
    vals, ids = math.topk(lp, k) if k > 0 else (lp[:, :0], targets.new_empty((len(lp), 0)))
    return chosen.view(-1), ranks, vals, ids


class TorchRowMath:
    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x, dim=-1)

    def score(self, logits: torch.Tensor, targets: torch.Tensor, k: int) -> Scores:
        return score_from_log_softmax(self, logits, targets, k)

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

    def score(self, logits: torch.Tensor, targets: torch.Tensor, k: int) -> Scores:
        # one fused pass over each row (kernels/invariant.cpp: ps_score), the same bits
        if k <= min(SCORE_MAX_K, logits.shape[1]):
            return self.kernels.score(logits, targets, k)
        return score_from_log_softmax(self, logits, targets, k)

    def topk(self, logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kernels.topk(logprobs, k)

    def entropy(self, logprobs: torch.Tensor) -> torch.Tensor:
        return self.kernels.entropy(logprobs)
