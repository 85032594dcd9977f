"""A mixture-of-experts feed-forward (Qwen3-MoE, OLMoE, Mixtral, gpt-oss, Gemma 4): a router's
choice of k experts for each token and the weighted sum of their outputs, as the paged forward's
MoE layers compute it (models/llama.py). Gemma 4's router reads other rows than its experts (its
own norm of the residual: models/gemma4_layer.py) and scales each chosen weight by its expert's
learned factor. Everything a token gets is a function of its own row: its
experts and weights (the backend's `route`: kernels/route.cpp under --deterministic), each
expert's product on the tokens routed to it (the row-invariant kernels: the same bits for a
token whether the expert sees it alone or with 200 others), and the sum over its experts in
ascending id (transformers' eager order). The experts run as the backend holds them
(`LayerOps.experts`: each on its own tokens on the host, kernels/experts.py; stacked on the GPU
path, kernels/gpu/experts.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from probserve.kernels.experts import Activation
from probserve.kernels.layer_ops import Experts, LayerOps
from probserve.models.linear import Joined, Linear


@dataclass(frozen=True)
class MoE:
    """A layer's router and its experts as the backend runs them; `top_k` experts a token,
    renormalised with `norm_topk`, each weight then times its expert's `expert_scale` (Gemma
    4's per-expert factor [E], where the backend computes; None: none)."""

    router: Linear | Joined
    run: Experts
    top_k: int
    norm_topk: bool
    expert_scale: torch.Tensor | None = None

    def __call__(
        self, x: torch.Tensor, act: Activation, ops: LayerOps, routed: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's output for rows x [T, H]: sum over each token's experts e of w_e *
        down_e(act(gate_up_e(x))); with the routing it followed (each row's experts [T, k] and
        their weights [T, k]). `routed`: the rows the router reads, where not x."""
        logits = self.router(x if routed is None else routed)
        ids, weights = ops.route(logits, self.top_k, self.norm_topk)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[ids]
        return self.run(x, ids, weights, act), ids, weights
