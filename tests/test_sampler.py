"""Sampler processors on hand-made logits rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from probserve.engine.core.row_math import InvariantRowMath, RowMath, TorchRowMath
from probserve.engine.core.sampler import SamplerResult, SamplerRow, sample
from probserve.engine.types import LogprobsMode, LogprobsSpec, SamplingParams


@pytest.fixture(params=["torch", "invariant"])
def row_math(request: pytest.FixtureRequest) -> RowMath:
    """Every sampler rule holds with torch's reductions and with the row-invariant kernels."""
    if request.param == "torch":
        return TorchRowMath()
    from probserve.kernels.invariant import InvariantKernels

    return InvariantRowMath(InvariantKernels())


def _sample(row_math: RowMath, logits: torch.Tensor, rows: list[SamplerRow]) -> SamplerResult:
    return sample(logits, rows, row_math)


def _row(
    params: SamplingParams,
    mode: LogprobsMode = LogprobsMode.PROCESSED,
    k: int = 4,
    output: tuple[int, ...] = (),
    prompt: tuple[int, ...] = (0,),
) -> SamplerRow:
    seed = None if params.greedy else params.seed or 0
    return SamplerRow(
        params,
        LogprobsSpec(top_k=k, mode=mode),
        seed,
        torch.tensor(prompt),
        list(output),
        frozenset({3}),
    )


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 3.0, -1.0, 0.0]])


def test_greedy_is_argmax_and_raw_logprobs(row_math: RowMath):
    res = _sample(row_math, LOGITS, [_row(SamplingParams(temperature=0), LogprobsMode.RAW)])
    assert res.token_ids.tolist() == [3]
    lp = res.logprobs[0]
    expected = torch.log_softmax(LOGITS[0], -1)
    assert math.isclose(float(lp.logprobs[0]), float(expected[3]), abs_tol=1e-6)
    assert lp.top_ids[0].tolist() == [3, 0, 1, 2] and int(lp.ranks[0]) == 1


def test_logit_bias_then_min_tokens(row_math: RowMath):
    # bias makes token 4 the argmax
    res = _sample(row_math, LOGITS, [_row(SamplingParams(temperature=0, logit_bias={4: 10.0}))])
    assert res.token_ids.tolist() == [4]
    # min_tokens masks the stop id 3 (-inf in processed logprobs)
    res = _sample(row_math, LOGITS, [_row(SamplingParams(temperature=0, min_tokens=1), k=6)])
    assert res.token_ids.tolist() == [0]
    lp = res.logprobs[0]
    assert np.isneginf(lp.top_logprobs[0][lp.top_ids[0] == 3]).all()


def test_penalties(row_math: RowMath):
    # frequency: token 3 seen twice in the output, penalty 1 -> 3.0 - 2 = 1.0 < 2.0
    res = _sample(
        row_math,
        LOGITS,
        [_row(SamplingParams(temperature=0, frequency_penalty=1.0), output=(3, 3))],
    )
    assert res.token_ids.tolist() == [0]
    # presence: once per present token -> 3.0 - 1.5 < 2.0
    res = _sample(
        row_math, LOGITS, [_row(SamplingParams(temperature=0, presence_penalty=1.5), output=(3, 3))]
    )
    assert res.token_ids.tolist() == [0]
    # repetition: token 3 in the prompt, 3.0 / 2 = 1.5 < 2.0
    res = _sample(
        row_math, LOGITS, [_row(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(3,))]
    )
    assert res.token_ids.tolist() == [0]


def test_top_k_and_min_p_mask(row_math: RowMath):
    res = _sample(row_math, LOGITS, [_row(SamplingParams(temperature=1.0, top_k=2, seed=1), k=6)])
    lp = res.logprobs[0]
    assert int(np.isfinite(lp.top_logprobs[0]).sum()) == 2
    assert res.token_ids[0] in (0, 3)
    # renormalised over the two kept
    kept = torch.tensor([3.0, 2.0])
    np.testing.assert_allclose(
        lp.top_logprobs[0][:2], torch.log_softmax(kept, 0).numpy(), atol=1e-6
    )
    res = _sample(row_math, LOGITS, [_row(SamplingParams(temperature=1.0, min_p=0.3, seed=1), k=6)])
    probs = torch.softmax(LOGITS[0], 0)
    n_kept = int((probs >= 0.3 * probs.max()).sum())
    assert int(np.isfinite(res.logprobs[0].top_logprobs[0]).sum()) == n_kept


def test_temperature_in_processed_logprobs(row_math: RowMath):
    res = _sample(row_math, LOGITS, [_row(SamplingParams(temperature=0.5, seed=2), k=6)])
    expected = torch.log_softmax(LOGITS[0] / 0.5, -1)
    np.testing.assert_allclose(
        res.logprobs[0].top_logprobs[0],
        torch.sort(expected, descending=True).values.numpy(),
        atol=1e-6,
    )


def test_sampling_follows_the_distribution(row_math: RowMath):
    counts = np.zeros(6)
    for position in range(3000):  # each position's draw its own
        row = SamplerRow(
            SamplingParams(temperature=1.0), None, 0, torch.tensor([0]), [], frozenset(), None,
            position,
        )  # fmt: skip
        counts[_sample(row_math, LOGITS, [row]).token_ids[0]] += 1
    probs = torch.softmax(LOGITS[0], 0).numpy()
    np.testing.assert_allclose(counts / 3000, probs, atol=0.03)


def test_a_tiny_repetition_penalty_saturates_instead_of_failing(row_math: RowMath):
    """5e-324 divides positive logits past the float range: the mass goes evenly to the
    repeated tokens with positive logits (the limit), never NaN or an error."""
    params = SamplingParams(temperature=1.0, repetition_penalty=5e-324, seed=3)
    res = _sample(row_math, LOGITS, [_row(params, prompt=(0, 3, 4), k=6)])
    assert res.errors == [None]
    assert res.token_ids.tolist()[0] in (0, 3)
    lp = res.logprobs[0]
    by_id = dict(zip(lp.top_ids[0].tolist(), lp.top_logprobs[0].tolist(), strict=True))
    assert math.isclose(by_id[0], math.log(0.5), abs_tol=1e-6)
    assert math.isclose(by_id[3], math.log(0.5), abs_tol=1e-6)
    greedy = _sample(
        row_math, LOGITS, [_row(SamplingParams(temperature=0, repetition_penalty=5e-324))]
    )
    assert greedy.errors == [None] and greedy.token_ids.tolist() == [0]
