"""Mixture-of-experts routing (kernels/route.cpp, models/moe.py): a token's experts and weights are
a function of its own row (ties by expert id, the same bits alone and in any batch), softmax
and renormalisation as transformers computes them, and the families the paged forward refuses
say in one line what is missing."""

from __future__ import annotations

import pytest
import torch

from probserve.kernels.invariant import InvariantKernels
from probserve.models.family import Unsupported, family
from probserve.models.moe import route


@pytest.fixture(scope="module")
def kernels() -> InvariantKernels:
    return InvariantKernels()


def test_routing_matches_transformers_and_breaks_ties_by_id(kernels):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(50, 16, generator=gen) * 3
    for norm in (False, True):
        ids, w = kernels.route(logits, 4, norm)
        ref_ids, ref_w = route(logits, 4, norm, None)  # torch's softmax and topk
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)
        if norm:
            torch.testing.assert_close(w.double().sum(-1), torch.ones(50, dtype=torch.float64))
    tied = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0, 2.0]])
    ids, w = kernels.route(tied, 3, False)
    assert ids.tolist() == [[1, 2, 4]] and w[0, 0] == w[0, 1] == w[0, 2]
    with pytest.raises(ValueError):
        kernels.route(tied, 7, False)


def test_a_tokens_route_is_the_same_bits_in_any_batch(kernels):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(37, 128, generator=gen)
    ids, w = kernels.route(logits, 8, True)
    for start, rows in [(0, 1), (5, 1), (3, 7), (11, 26)]:
        part_ids, part_w = kernels.route(logits[start : start + rows], 8, True)
        assert torch.equal(part_ids, ids[start : start + rows])
        assert part_w.numpy().tobytes() == w[start : start + rows].numpy().tobytes()


def test_unbuilt_mixtures_are_refused_naming_what_is_missing():
    from transformers import GptOssConfig, OlmoeConfig

    with pytest.raises(Unsupported, match="attention sinks"):
        family(GptOssConfig(num_hidden_layers=2))
    with pytest.raises(Unsupported, match="clip_qkv"):
        family(OlmoeConfig(num_hidden_layers=2, clip_qkv=8.0))
