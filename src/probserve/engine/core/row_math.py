"""RowMath: the reductions over a vocabulary row behind every logprob (log_softmax, top-k,
entropy), in torch's kernels, in the row-invariant ones, or in the GPU path's Triton kernels.

torch splits a reduction over 49,152 entries across threads differently for one row than for
many, so its results for a row can move in the last bits with the batch; `InvariantRowMath`
computes each row alone in one fixed order (kernels/invariant.cpp) and orders top-k by value
then id, so ties come out the same way in every batch. The runner says which one its engine
uses (`Runner.row_math`). Results come back on the device of the rows given (the host for the
CPU's; the GPU path's rows stay on the GPU, and only the small results travel).
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
        """-sum p log p of each row of log-probabilities (masked tokens add nothing), exact to
        1e-6 relative however small it is (float64, the row renormalised)."""
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
        return entropy_float64(logprobs)


# rows converted to float64 at once by `entropy_float64` (a row of 49k: 384 KiB)
ENTROPY_ROWS = 32


def entropy_float64(logprobs: torch.Tensor) -> torch.Tensor:
    """-sum p log p of each row, in float64, from the row's differences d to its largest entry:
    log(n + R) - sum(e d) / (n + R), with e = exp(d), n the entries at the max and R the sum of
    e over the others (log1p(R) when n = 1), as kernels/invariant.cpp's ps_entropy computes it.
    A float32 row's own log-sum-exp error (up to ~1e-5) cancels, and R is never added to 1
    before the log: a near-certain position's tiny entropy keeps its digits."""
    out = torch.empty(logprobs.shape[0], dtype=torch.float32)
    for a in range(0, logprobs.shape[0], ENTROPY_ROWS):
        lp = logprobs[a : a + ENTROPY_ROWS].double()
        d = lp - lp.max(dim=1, keepdim=True).values
        at_max = d == 0
        e = torch.where(at_max, 0.0, d.exp())  # masked (-inf) entries: exp gives 0
        rest, n = e.sum(dim=1), at_max.sum(dim=1).double()
        moment = torch.where(e > 0, e * d, 0.0).sum(dim=1)
        log_s = torch.where(n == 1, torch.log1p(rest), torch.log(n + rest))
        out[a : a + ENTROPY_ROWS] = (log_s - moment / (n + rest)).float()
    return out


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


class DeviceRowMath:
    """The GPU path's reductions, on the device that holds the rows (kernels/gpu/vocab.py: each
    row alone in one fixed order, float64 sums, top-k by value then id); top-k past the
    kernels' MAX_K through the log-softmax and torch's sort, value then id."""

    def __init__(self, device: torch.device) -> None:
        from probserve.kernels.gpu import vocab

        self.vocab = vocab
        self.device = device

    def _on(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(device=self.device, dtype=torch.float32)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return self.vocab.log_softmax(self._on(x))

    def score(self, logits: torch.Tensor, targets: torch.Tensor, k: int) -> Scores:
        if k <= self.vocab.MAX_K:
            return self.vocab.score(self._on(logits), targets, k)
        return score_from_log_softmax(self, self._on(logits), targets.to(self.device), k)

    def topk(self, logprobs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self._on(logprobs)
        if k <= self.vocab.MAX_K:
            return self.vocab.topk(x, k)
        # a stable sort by value descending keeps equal values in id order
        order = torch.sort(x, dim=1, descending=True, stable=True).indices[:, : min(k, x.shape[1])]
        return x.gather(1, order), order

    def entropy(self, logprobs: torch.Tensor) -> torch.Tensor:
        return self.vocab.entropy(self._on(logprobs))
