"""The probabilities of label tokens right after each scored input (/v1/score, /v1/rerank):
each candidate's one distribution, read at the label ids (target-token logprobs), under the full
distribution or renormalised over the labels."""

from __future__ import annotations

import math
from collections.abc import Sequence

from probserve.api.errors import bad_request
from probserve.engine import TokenLogprobs


def label_probabilities(
    rows: Sequence[TokenLogprobs | None], softmax: bool, param: str
) -> list[list[float]]:
    """Each input's labels' probabilities from its one generated token's row (the distribution
    right after the input), in the labels' order (`softmax`: renormalised over them); an input
    with no row is a 400 naming `param`."""
    out: list[list[float]] = []
    for first in rows:
        if first is None or first.target_logprobs is None:
            raise bad_request("an input produced no distribution", param)
        values = [float(v) for v in first.target_logprobs[0]]
        if softmax:
            top = max(values)
            exps = [math.exp(v - top) for v in values]
            out.append([e / sum(exps) for e in exps])
        else:
            out.append([math.exp(v) for v in values])
    return out
