"""The native layers (kernels/layers.py: every layer in one call) against the op-by-op path they
replace (the same kernels called one by one from Python): the same bits, hidden states and cache,
over steps that mix prefill chunks, chunks after a cached prefix and decode tokens (a mixture of
experts: the routing kept too)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from probserve.kernels.invariant import InvariantKernels
from probserve.models.llama import AttentionPlan, KVCache, LlamaForward

BLOCK = 4


def _step(
    chunks: list[tuple[int, int, int]], vocab: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionPlan]:
    """Chunks (sequence, start, end), sequence s owning cache blocks 1 + 8 s .. 8 + 8 s."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.cat([torch.arange(a, b) for _, a, b in chunks])
    seq = torch.cat([torch.full((b - a,), s) for s, a, b in chunks])
    tables = torch.stack([torch.arange(1 + 8 * s, 9 + 8 * s) for s, _, _ in chunks])
    order = torch.cat([torch.full((b - a,), i) for i, (_, a, b) in enumerate(chunks)])
    plan = AttentionPlan(slots=(1 + 8 * seq) * BLOCK + positions)
    plan.tables, plan.token_seq, plan.token_len = tables, order, positions + 1
    ids = torch.randint(3, vocab, (positions.numel(),), generator=gen)
    return ids, positions, plan


STEPS = [
    [(0, 0, 13), (1, 0, 6)],  # two prompts
    [(0, 13, 14), (1, 6, 11), (2, 0, 3)],  # a decode token, a chunk after its prefix, a prompt
    [(0, 14, 15), (1, 11, 12), (2, 3, 4)],  # decode tokens only
]


def assert_native_equals_op_by_op(
    model: Any, weights: Mapping[str, Any] | None = None, block_sums: bool = False
) -> None:
    kernels = InvariantKernels(block_sums)
    native = LlamaForward(model, kernels, weights)
    op = LlamaForward(model, kernels, weights, op_by_op=True)
    assert native.native is not None and op.native is None
    caches = [KVCache.allocate(model.config, 32, BLOCK) for _ in range(2)]
    for cache in caches:  # every slot defined, so whole caches compare
        cache.k.zero_()
        cache.v.zero_()
        cache.hidden.zero_()
    routed = [(c.experts, c.expert_weights) for c in caches]
    for i, chunks in enumerate(STEPS):
        ids, positions, plan = _step(chunks, model.config.vocab_size, i)
        a = native.forward(ids, positions, plan, caches[0])
        b = op.forward(ids, positions, plan, caches[1])
        assert torch.equal(a, b), f"step {i}: hidden states differ"
        assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
        (ids, w), (op_ids, op_w) = routed
        if ids is not None:  # a mixture of experts: the same routing kept
            assert torch.equal(ids, op_ids) and torch.equal(w, op_w), f"step {i}: routing differs"
        assert torch.equal(native.logits(a), op.logits(b))
