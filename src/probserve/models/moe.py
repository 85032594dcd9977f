"""A mixture-of-experts feed-forward (Qwen3-MoE, OLMoE, Mixtral): a router's choice of k experts
for each token and the weighted sum of their outputs, as the paged forward's MoE layers compute
it (models/llama.py). Everything a token gets is a function of its own row: its experts and
weights (kernels/route.cpp under --deterministic), each expert's product on the tokens routed to
it (the row-invariant kernels: the same bits for a token whether the expert sees it alone or
with 200 others), and the sum over its experts in ascending id (transformers' eager order).
The GPU path runs the same sum with its experts stacked (kernels/gpu/experts.py: `grouped`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from probserve.kernels.layer_ops import LayerOps
from probserve.models.linear import Joined, Linear


@dataclass(frozen=True)
class Expert:
    """One expert's SwiGLU: rows [gate | up] of 2I, then down."""

    gate_up: Linear | Joined
    down: Linear | Joined


# the experts stacked on the GPU path's device and run together (kernels/gpu/experts.py):
# (rows x, their experts [T, k], their weights [T, k], the gated activation) -> the output
Grouped = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]],
    torch.Tensor,
]


@dataclass(frozen=True)
class MoE:
    """A layer's router and experts; `top_k` experts a token, renormalised with `norm_topk`.
    On the GPU path the experts are `grouped` instead (`experts` is then empty)."""

    router: Linear | Joined
    experts: tuple[Expert, ...]
    top_k: int
    norm_topk: bool
    grouped: Grouped | None = None


def route(
    logits: torch.Tensor, k: int, norm: bool, kernels: LayerOps | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k experts [T, k] and their weights [T, k]: softmax over the router's logits,
    the k largest (ties by id under --deterministic), renormalised with `norm`."""
    if kernels is not None:
        return kernels.route(logits, k, norm)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


def moe_forward(
    moe: MoE,
    x: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    kernels: LayerOps | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's output for rows x [T, H]: sum over each token's experts e of w_e *
    down_e(act(gate_up_e(x))), each expert run once on all the tokens routed to it; with the
    routing it followed (each row's experts [T, k] and their weights [T, k])."""
    ids, weights = route(moe.router(x), moe.top_k, moe.norm_topk, kernels)
    if moe.grouped is not None:  # the GPU path: every pair in one grouped product, no host wait
        return moe.grouped(x, ids, weights, act), ids, weights
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():  # ascending
        rows, slot = torch.nonzero(ids == e, as_tuple=True)
        expert = moe.experts[e]
        y = expert.down(act(expert.gate_up(x[rows])))
        out.index_add_(0, rows, y * weights[rows, slot].unsqueeze(1))
    return out, ids, weights
