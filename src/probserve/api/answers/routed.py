"""A mixture of experts' routing as an answer shows it (return_routed_experts): one entry per
token, its experts (int16) and their weights (float32) in every MoE layer, each as base64 of
the little-endian row-major [moe_layers, experts_per_token] array: compact, as
/v1/distributions' rows are."""

from __future__ import annotations

import base64

import numpy as np

from probserve.api.answers.text_stream import Piece
from probserve.api.protocol import RoutedExpertsEntry, RoutedList
from probserve.engine import RoutedExperts


def _b64(a: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode("ascii")


def entry(routed: RoutedExperts, row: int) -> RoutedExpertsEntry:
    return RoutedExpertsEntry(
        experts=_b64(routed.experts[row], "<i2"), weights=_b64(routed.weights[row], "<f4")
    )


def token_entries(pieces: list[Piece]) -> RoutedList:
    """The routing of each generated token (of `pieces`, in order; null for one the engine
    sent none for)."""
    return [None if p.routed is None else entry(p.routed, p.row) for p in pieces]


def prompt_entries(routed: RoutedExperts | None) -> RoutedList | None:
    """The prompt's routing aligned with its tokens: null for the first (no row scored it),
    then the rows of tokens 1..len-1."""
    if routed is None:
        return None
    return [None, *(entry(routed, j) for j in range(len(routed)))]
